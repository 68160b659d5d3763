"""SPP against an independent transcription of Caffe's pooling loops (``PoolingLayer::Forward_cpu`` with
the kernel/stride/pad ``SPPLayer::GetPoolingParam`` gives each level), its shape quirks and its gradient."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from caffe_compat.errors import FormatError
from caffe_compat.io import read_net
from caffe_compat.net_shapes import infer_shapes
from tests.layers.zoo_single_layer import make_layer


def caffe_pool(x: np.ndarray, kernel: int, pad: int, method: str) -> np.ndarray:
    """Caffe's CPU pooling of a square (N, C, H, H) input with stride = kernel: output size
    ceil((H + 2p − k)/k) + 1, minus one when the last window starts in the padding; MAX over the
    in-image part of each window; AVE divides by the window clipped to [−p, H + p)."""
    size = x.shape[2]
    out = math.ceil((size + 2 * pad - kernel) / kernel) + 1
    if pad and (out - 1) * kernel >= size + pad:
        out -= 1
    y = np.zeros(x.shape[:2] + (out, out))
    for i in range(out):
        for j in range(out):
            h0, w0 = i * kernel - pad, j * kernel - pad
            h1, w1 = min(h0 + kernel, size + pad), min(w0 + kernel, size + pad)
            divisor = (h1 - h0) * (w1 - w0)
            window = x[:, :, max(h0, 0):min(h1, size), max(w0, 0):min(w1, size)]
            y[:, :, i, j] = window.max(axis=(2, 3)) if method == "MAX" else window.sum(axis=(2, 3)) / divisor
    return y


def caffe_spp(x: np.ndarray, height: int, method: str) -> np.ndarray:
    levels = []
    for level in range(height):
        bins = 2 ** level
        kernel = math.ceil(x.shape[2] / bins)
        pad = (kernel * bins - x.shape[2] + 1) // 2
        levels.append(caffe_pool(x, kernel, pad, method))
    if height == 1:
        return levels[0]
    return np.concatenate([lv.reshape(x.shape[0], -1) for lv in levels], axis=1)


@pytest.mark.parametrize("method", ["MAX", "AVE"])
@pytest.mark.parametrize("size,height", [(4, 2), (5, 2), (7, 3), (8, 3), (6, 1)])
def test_spp_matches_caffe_pooling_levels(method, size, height):
    x = np.random.default_rng(size * 10 + height).standard_normal((2, 3, size, size))
    port = make_layer(f'type: "SPP" spp_param {{ pyramid_height: {height} pool: {method} }}', [x.shape])
    (y,) = port(torch.from_numpy(x))
    expected = caffe_spp(x, height, method)
    assert y.shape == expected.shape == tuple(port.output_shapes()[0])
    np.testing.assert_allclose(y.numpy(), expected, rtol=0, atol=1e-15 * size * size)


def test_spp_4x4_closed_form():
    """Level 0: the maximum 15; level 1: the quadrants' maxima 5, 7, 13, 15 (row-major bins)."""
    x = torch.arange(16, dtype=torch.float64).reshape(1, 1, 4, 4)
    (y,) = make_layer('type: "SPP" spp_param { pyramid_height: 2 }', [(1, 1, 4, 4)])(x)
    assert y.tolist() == [[15.0, 5.0, 7.0, 13.0, 15.0]]


def test_one_level_keeps_the_4d_pooling_top():
    """Caffe sets a one-level pyramid's pooling layer up on the top itself: (N, C, 1, 1), no flatten."""
    port = make_layer('type: "SPP" spp_param { pyramid_height: 1 }', [(2, 3, 6, 5)])
    assert port.output_shapes() == [(2, 3, 1, 1)]
    assert tuple(port(torch.zeros(2, 3, 6, 5))[0].shape) == (2, 3, 1, 1)


def test_a_level_whose_pad_reaches_its_kernel_is_refused():
    """H = 5 at level 2 (4 bins): kernel 2, pad (8 − 5 + 1) // 2 = 2, which Caffe's Pooling CHECK refuses."""
    with pytest.raises(FormatError, match="pad must be smaller than the kernel"):
        make_layer('type: "SPP" spp_param { pyramid_height: 3 }', [(1, 1, 5, 5)])


def test_spp_follows_the_input_size_and_inspect_agrees():
    port = make_layer('type: "SPP" spp_param { pyramid_height: 2 pool: AVE }', [(1, 2, 8, 8)])
    assert tuple(port(torch.zeros(3, 2, 12, 12))[0].shape) == (3, 2 * (1 + 4))
    text = ('layer { name: "d" type: "Input" top: "d" input_param { shape { dim: 2 dim: 4 dim: 9 dim: 9 } } }\n'
            'layer { name: "spp" type: "SPP" bottom: "d" top: "s" spp_param { pyramid_height: 3 } }\n')
    blobs, _ = infer_shapes(read_net(text))
    assert blobs["s"] == (2, 4 * (1 + 4 + 16))


@pytest.mark.parametrize("method", ["MAX", "AVE"])
def test_spp_gradient(method):
    x = torch.randn(2, 2, 5, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    port = make_layer(f'type: "SPP" spp_param {{ pyramid_height: 2 pool: {method} }}', [tuple(x.shape)])
    assert torch.autograd.gradcheck(lambda t: port(t)[0], (x,))


@pytest.mark.parametrize("method", ["MAX", "AVE"])
def test_spp_exports_to_onnx_and_onnx_runtime_agrees(tmp_path, method):
    """A deployed net with SPP goes through the project's export; ONNX Runtime computes Caffe's levels."""
    ort = pytest.importorskip("onnxruntime")
    from caffe_compat.export import export_onnx

    prototxt = tmp_path / "spp.prototxt"
    prototxt.write_text(
        'layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 7 dim: 7 } } }\n'
        f'layer {{ name: "spp" type: "SPP" bottom: "data" top: "spp" spp_param {{ pyramid_height: 3 pool: {method} }} }}\n')
    path = export_onnx(str(prototxt), output_blob="spp", path=tmp_path / "spp.onnx", batch=2,
                       preprocessing={"resize": [7, 7]})
    x = np.random.default_rng(11).standard_normal((2, 3, 7, 7)).astype(np.float32)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {session.get_inputs()[0].name: x})
    expected = caffe_spp(x.astype(np.float64), 3, method)
    assert got.shape == expected.shape == (2, 3 * (1 + 4 + 16))
    np.testing.assert_allclose(got, expected, rtol=0, atol=4 * np.finfo(np.float32).eps * np.abs(x).max())


@pytest.mark.parametrize("height", [40, 4294967295])
def test_a_pyramid_too_high_for_the_input_is_a_format_error(height):
    """pyramid_height 2^32 - 1 (or 40) raised protobuf's ValueError (a level's pad outgrew uint32) before
    the Pooling CHECK pad < kernel of level 4 could refuse it."""
    with pytest.raises(FormatError, match=r"layer 'spp' \(SPP\): spp_param.pyramid_height .* too high for the "
                                          r"8x8 input: level 4 \(16 bins\)"):
        make_layer(f'type: "SPP" spp_param {{ pyramid_height: {height} }}', [(1, 1, 8, 8)])


@pytest.mark.parametrize("height", [1, 2])
def test_spp_with_no_channel_gives_caffes_empty_top(height):
    # SPPLayer: each level's Pooling, Flatten and the Concat of (N, 0) pieces: an (N, 0) top (one level: the
    # Pooling's (N, 0, 1, 1)).  We raised torch's RuntimeError (pooling refuses C = 0).
    port = make_layer(f'type: "SPP" spp_param {{ pyramid_height: {height} }}', [(2, 0, 4, 4)])
    (y,) = port(torch.zeros(2, 0, 4, 4))
    assert tuple(y.shape) == tuple(port.output_shapes()[0]) == ((2, 0, 1, 1) if height == 1 else (2, 0))

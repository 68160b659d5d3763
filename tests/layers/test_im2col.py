"""Im2col against a transcription of Caffe's im2col loops (2-D with dilation, and N-D), as Convolution's
column buffer (W · columns = Convolution), its col2im gradient, setup CHECKs, and ONNX Runtime."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from caffe_compat.errors import FormatError
from tests.layers.zoo_single_layer import make_layer


def caffe_im2col(x, kernel, stride, pad, dilation):
    """Caffe's im2col_nd for one image (C, S_1..S_k): row c·prod(K) + row-major kernel offset, 0 in padding."""
    channels, spatial = x.shape[0], x.shape[1:]
    # C++ int division (toward zero), as Caffe's output-size formula
    out = [int((s + 2 * p - (d * (k - 1) + 1)) / st) + 1
           for s, k, st, p, d in zip(spatial, kernel, stride, pad, dilation)]
    offsets = list(itertools.product(*[range(k) for k in kernel]))
    cols = np.zeros((channels * len(offsets), *out))
    for c in range(channels):
        for r, offset in enumerate(offsets):
            for position in itertools.product(*[range(o) for o in out]):
                src = [o * st - p + k * d for o, st, p, k, d in zip(position, stride, pad, offset, dilation)]
                if all(0 <= v < s for v, s in zip(src, spatial)):
                    cols[(c * len(offsets) + r, *position)] = x[(c, *src)]
    return cols


@pytest.mark.parametrize("spec,kernel,stride,pad,dilation", [
    ("kernel_size: 3", (3, 3), (1, 1), (0, 0), (1, 1)),
    ("kernel_size: 3 stride: 2 pad: 1", (3, 3), (2, 2), (1, 1), (1, 1)),
    ("kernel_h: 2 kernel_w: 3 stride_h: 1 stride_w: 2 pad_h: 2 pad_w: 0", (2, 3), (1, 2), (2, 0), (1, 1)),
    ("kernel_size: 3 dilation: 2 pad: 2", (3, 3), (1, 1), (2, 2), (2, 2)),
    ("kernel_size: 2 kernel_size: 3 dilation: 3 dilation: 1 force_nd_im2col: true", (2, 3), (1, 1), (0, 0), (3, 1)),
])
def test_2d_matches_caffes_loops(spec, kernel, stride, pad, dilation):
    x = np.random.default_rng(0).standard_normal((2, 3, 7, 8))
    port = make_layer(f'type: "Im2col" convolution_param {{ {spec} }}', [x.shape])
    (top,) = port(torch.from_numpy(x))
    expected = np.stack([caffe_im2col(img, kernel, stride, pad, dilation) for img in x])
    assert top.shape == expected.shape and port.output_shapes() == [expected.shape]
    np.testing.assert_array_equal(top.numpy(), expected)


def test_an_overhang_below_one_stride_gives_one_output_as_caffes_int_division():
    # (in + 2p - extent) / stride + 1 in C++ ints: (6 - 7) / 2 + 1 = 0 + 1 = 1 column (floor would give 0);
    # Caffe's im2col reads the overhanging tap (column 6) as 0.
    x = np.arange(1.0, 13.0).reshape(1, 1, 2, 6)
    port = make_layer('type: "Im2col" convolution_param { kernel_h: 1 kernel_w: 3 stride_h: 1 stride_w: 2 '
                      'dilation: 3 }', [x.shape])
    (top,) = port(torch.from_numpy(x))
    assert port.output_shapes() == [(1, 3, 2, 1)]
    assert top[0, :, :, 0].tolist() == [[1.0, 7.0], [4.0, 10.0], [0.0, 0.0]]
    np.testing.assert_array_equal(top[0].numpy(), caffe_im2col(x[0], (1, 3), (1, 2), (0, 0), (1, 3)))


def test_3d_spatial_axes():
    x = np.random.default_rng(1).standard_normal((1, 2, 4, 5, 3))
    port = make_layer('type: "Im2col" convolution_param { kernel_size: 2 kernel_size: 3 kernel_size: 1 stride: 2 '
                      'pad: 1 }', [x.shape])
    (top,) = port(torch.from_numpy(x))
    np.testing.assert_array_equal(top[0].numpy(), caffe_im2col(x[0], (2, 3, 1), (2, 2, 2), (1, 1, 1), (1, 1, 1)))


def test_is_convolutions_column_buffer():
    """Caffe's Convolution is W (O, C·kh·kw) times the column buffer."""
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(2, 3, 9, 9, generator=g, dtype=torch.float64), torch.randn(4, 3, 3, 3, generator=g,
                                                                                   dtype=torch.float64)
    (cols,) = make_layer('type: "Im2col" convolution_param { kernel_size: 3 stride: 2 pad: 1 dilation: 2 }',
                         [x.shape])(x)
    conv = torch.einsum("ok,nkhw->nohw", w.reshape(4, -1), cols)
    torch.testing.assert_close(conv, F.conv2d(x, w, stride=2, padding=1, dilation=2), rtol=1e-12, atol=1e-12)


def test_gradient_is_col2im():
    """Each input element receives the sum of the column entries copied from it: with ones as top diff,
    the number of windows covering it."""
    x = torch.zeros(1, 1, 4, 4, dtype=torch.float64, requires_grad=True)
    (top,) = make_layer('type: "Im2col" convolution_param { kernel_size: 3 pad: 1 }', [x.shape])(x)
    top.backward(torch.ones_like(top))
    assert x.grad[0, 0].tolist() == [[4, 6, 6, 4], [6, 9, 9, 6], [6, 9, 9, 6], [4, 6, 6, 4]]
    y = torch.randn(2, 2, 5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3), requires_grad=True)
    port = make_layer('type: "Im2col" convolution_param { kernel_size: 2 stride: 2 pad: 1 dilation: 2 }', [y.shape])
    assert torch.autograd.gradcheck(lambda t: port(t)[0], (y,))


def test_axis_two_keeps_the_leading_axes():
    x = np.random.default_rng(4).standard_normal((2, 3, 2, 5, 5))
    port = make_layer('type: "Im2col" convolution_param { axis: 2 kernel_size: 3 }', [x.shape])
    (top,) = port(torch.from_numpy(x))
    assert tuple(top.shape) == (2, 3, 18, 3, 3)
    np.testing.assert_array_equal(top[1, 2].numpy(), caffe_im2col(x[1, 2], (3, 3), (1, 1), (0, 0), (1, 1)))


def test_setup_checks():
    with pytest.raises(FormatError, match="kernel_size .or kernel_h and kernel_w. is required"):
        make_layer('type: "Im2col" convolution_param { stride: 1 }', [(1, 1, 4, 4)])
    with pytest.raises(FormatError, match="kernel_h & kernel_w can only be used for 2D"):
        make_layer('type: "Im2col" convolution_param { kernel_h: 2 kernel_w: 2 }', [(1, 1, 4, 4, 4)])
    with pytest.raises(FormatError, match="once per spatial dimension"):
        make_layer('type: "Im2col" convolution_param { kernel_size: 2 kernel_size: 2 kernel_size: 2 }', [(1, 1, 4, 4)])
    with pytest.raises(FormatError, match="stride dimensions must be nonzero"):
        make_layer('type: "Im2col" convolution_param { kernel_size: 2 stride: 0 }', [(1, 1, 4, 4)])
    with pytest.raises(FormatError, match="at least one spatial axis"):
        make_layer('type: "Im2col" convolution_param { kernel_size: 2 }', [(4, 4)])


def test_onnx_runtime_agrees(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    from caffe_compat.export import export_onnx

    prototxt = tmp_path / "im2col.prototxt"
    prototxt.write_text(
        'layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 8 dim: 7 } } }\n'
        'layer { name: "cols" type: "Im2col" bottom: "data" top: "cols" '
        'convolution_param { kernel_size: 3 stride: 2 pad: 1 dilation: 2 } }\n')
    path = export_onnx(str(prototxt), output_blob="cols", path=tmp_path / "im2col.onnx", batch=2,
                       preprocessing={"resize": [8, 7]})
    x = np.random.default_rng(5).standard_normal((2, 3, 8, 7)).astype(np.float32)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {session.get_inputs()[0].name: x})
    expected = np.stack([caffe_im2col(img, (3, 3), (2, 2), (1, 1), (2, 2)) for img in x]).reshape(2, -1)
    np.testing.assert_array_equal(got, expected.astype(np.float32))


@pytest.mark.parametrize("shape, kernel, top", [((0, 3, 4, 4), 2, (0, 12, 3, 3)), ((2, 3, 0, 4), 1, (2, 3, 0, 4)),
                                                ((2, 3, 4, 0), 1, (2, 3, 4, 0))])
def test_an_empty_input_gives_caffes_empty_top(shape, kernel, top):
    # Im2colLayer::Reshape: (N, C·kh·kw, H', W'), H' = (H + 2p - k) / s + 1 = 0 for H = 0, k = 1; Forward_cpu's
    # loops run zero times.  We raised torch's RuntimeError (reshape(..., -1, ...) of 0 elements is ambiguous).
    port = make_layer(f'type: "Im2col" convolution_param {{ kernel_size: {kernel} }}', [shape])
    x = torch.zeros(shape, requires_grad=True)
    (cols,) = port(x)
    assert tuple(cols.shape) == top == tuple(port.output_shapes()[0])
    cols.sum().backward()
    assert x.grad.shape == x.shape

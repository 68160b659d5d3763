"""MAX pooling's CPU form (``caffe_compat.layers.pooling_numpy``): in training the forward keeps Caffe's choice
(``MaxPoolRouted``); its top is the layer's own top bit for bit and its bottom diff Caffe's written-out loop's,
in any block size, with NaN, infinities, -FLT_MAX and ties."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from caffe_compat.layers import cache_blocking, pooling_numpy
from tests.layers.test_boundaries import FLT_MAX, _caffe_max_pool
from tests.layers.zoo_single_layer import make_layer

GEOMETRIES = [
    ("kernel_size: 3 stride: 2", (5, 3, 9, 8)),                      # ceil overhang on both axes
    ("kernel_size: 3 stride: 1 pad: 1", (4, 2, 6, 7)),               # overlapping windows, padding
    ("kernel_h: 3 kernel_w: 2 stride: 2 pad_h: 1 pad_w: 0", (3, 3, 6, 7)),
    ("kernel_size: 2 stride: 2", (3, 4, 6, 8)),                      # no padding: whole samples transposed
    ("kernel_h: 3 kernel_w: 2 stride: 2 pad_h: 1 pad_w: 0", (2, 3, 7, 8)),  # rows padded, columns not
]


def _bottom(shape, seed):
    rng = np.random.RandomState(seed)
    specials = np.array([np.inf, -np.inf, -FLT_MAX, -1.0, 0.0, 1.0, 2.0], dtype=np.float32)
    x = specials[rng.choice(len(specials), size=shape, p=[0.05, 0.1, 0.1, 0.2, 0.25, 0.2, 0.1])]
    x[1, 0, 1:3] = np.nan      # one sample holds NaN: its block takes the layer's own top
    x[-1, -1] = -np.inf        # a plane where nothing is above -FLT_MAX
    return x


@pytest.mark.parametrize("row_transpose_min", [0, 10**9])  # padded columns: OpenCV row by row, or NumPy's copy
@pytest.mark.parametrize("samples_per_block", [1, 2, 100])
@pytest.mark.parametrize("pooling, shape", GEOMETRIES)
def test_training_forward_keeps_the_top_and_routes_like_caffe(pooling, shape, samples_per_block, row_transpose_min,
                                                              monkeypatch):
    monkeypatch.setattr(cache_blocking, "BLOCK_BYTES", samples_per_block * int(np.prod(shape[1:])) * 4)
    monkeypatch.setattr(pooling_numpy, "ROW_TRANSPOSE_MIN", row_transpose_min)
    x = _bottom(shape, seed=len(pooling) + samples_per_block)
    port = make_layer(f'type: "Pooling" pooling_param {{ pool: MAX {pooling} }}', [shape])
    kernel, stride, pad, out = port.geometry_for(*shape[2:])
    xt = torch.from_numpy(x).requires_grad_()
    (top,) = port(xt)
    assert type(top.grad_fn).__name__ == "MaxPoolRoutedBackward"
    with torch.no_grad():
        (reference_top,) = port(torch.from_numpy(x))
    assert torch.equal(top.detach().view(torch.int32), reference_top.view(torch.int32))  # NaN bits included
    dy = np.random.RandomState(1).randint(1, 5, size=top.shape).astype(np.float32)
    (dx,) = torch.autograd.grad(top, xt, torch.from_numpy(dy))
    _, _, reference_dx = _caffe_max_pool(x, kernel, stride, pad, out, dy)
    np.testing.assert_array_equal(dx.numpy(), reference_dx.astype(np.float32))


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
def test_the_pytorch_form_gives_the_same_diff(layout, monkeypatch):
    """With the CPU form switched off (as on CUDA, under compile, for other dtypes) the layer routes through
    ``with_caffe_backward`` and the PyTorch scan: the same diff bit for bit, in the bottom's layout."""
    shape = (3, 2, 7, 7)
    port = make_layer('type: "Pooling" pooling_param { pool: MAX kernel_size: 3 stride: 2 }', [shape])
    x = torch.from_numpy(_bottom(shape, seed=5)).contiguous(memory_format=layout)
    dy = torch.rand(3, 2, 3, 3)
    diffs = []
    for form in ("numpy", "torch"):
        if form == "torch":
            monkeypatch.setattr(pooling_numpy, "applies", lambda t: False)
        xt = x.clone().requires_grad_()
        (top,) = port(xt)
        assert type(top.grad_fn).__name__ == ("MaxPoolRoutedBackward" if form == "numpy" else "_CaffeBackwardBackward")
        assert top.is_contiguous(memory_format=layout)
        diffs.append(torch.autograd.grad(top, xt, dy)[0])
        assert diffs[-1].is_contiguous(memory_format=layout), form
    assert torch.equal(diffs[0], diffs[1])


def _routed_back(bottom_values: torch.Tensor, mask: np.ndarray) -> torch.Tensor:
    """Per output, the bottom value at Caffe's mask (``h·W + w``), 0 where the mask is -1."""
    n, c = mask.shape[:2]
    index = torch.from_numpy(mask)
    picked = bottom_values.reshape(n, c, -1).gather(2, index.clamp_min(0).view(n, c, -1)).view(mask.shape)
    return torch.where(index >= 0, picked, 0.0)


def test_a_differentiable_backward_keeps_the_diff_linear_in_the_top_diff():
    """``create_graph=True`` (a gradient penalty): the routed diff is differentiated again, w.r.t. the top diff,
    as through the PyTorch form; the second derivative routes back the same way."""
    shape = (2, 2, 7, 7)
    port = make_layer('type: "Pooling" pooling_param { pool: MAX kernel_size: 3 stride: 2 }', [shape])
    x = torch.from_numpy(_bottom(shape, seed=9)).nan_to_num(nan=0.5)
    xt = x.clone().requires_grad_()
    (top,) = port(xt)
    assert type(top.grad_fn).__name__ == "MaxPoolRoutedBackward"
    dy = torch.rand(top.shape, dtype=torch.float64).float().requires_grad_()
    (dx,) = torch.autograd.grad(top, xt, dy, create_graph=True)
    (ddy,) = torch.autograd.grad((dx * dx).sum(), dy)
    _, mask, _ = _caffe_max_pool(x.numpy(), *port.geometry_for(7, 7), np.zeros(top.shape, np.float32))
    assert torch.equal(ddy, _routed_back(2 * dx.detach(), mask))


# ------------------------------------------------------------------------- windows that tile the bottom

TILED = [
    ("kernel_size: 2 stride: 2", (5, 3, 6, 8)),
    ("kernel_size: 3 stride: 3", (2, 2, 9, 6)),
    ("kernel_h: 2 kernel_w: 3 stride_h: 2 stride_w: 3", (3, 2, 4, 9)),
    ("kernel_h: 1 kernel_w: 2 stride_h: 1 stride_w: 2", (2, 3, 3, 4)),
]


@pytest.mark.parametrize("kernel, stride, pad, out, size, expected", [
    ((2, 2), (2, 2), (0, 0), (3, 4), (6, 8), True),
    ((2, 2), (2, 2), (0, 0), (4, 4), (7, 8), False),   # Caffe's rounding up adds a partial window
    ((2, 2), (2, 2), (1, 0), (4, 4), (6, 8), False),   # padding
    ((3, 3), (2, 2), (0, 0), (2, 3), (5, 7), False),   # overlapping windows
    ((16, 16), (16, 16), (0, 0), (1, 1), (16, 16), False),  # 256 offsets: more than a uint8 slot holds
])
def test_tiles(kernel, stride, pad, out, size, expected):
    assert pooling_numpy.tiles(kernel, stride, pad, out, size) is expected


def _signed_bottom(shape, seed, dtype):
    """Specials with both zeros, so that a zero maximum's sign is Caffe's first zero's."""
    rng = np.random.RandomState(seed)
    specials = np.array([np.nan, np.inf, -np.inf, -FLT_MAX, -1.0, -0.0, 0.0, 1.0], dtype=dtype)
    return specials[rng.choice(len(specials), size=shape, p=[0.05, 0.05, 0.1, 0.1, 0.15, 0.25, 0.25, 0.05])]


def _signed_top_diff(shape, seed, dtype):
    rng = np.random.RandomState(seed)
    values = np.array([-0.0, 0.0, -2.5, 1.5, np.inf, np.nan], dtype=dtype)
    return values[rng.choice(len(values), size=shape, p=[0.2, 0.1, 0.3, 0.3, 0.05, 0.05])]


def _assert_same_bits(actual: np.ndarray, expected: np.ndarray):
    np.testing.assert_array_equal(actual, expected)  # NaN where NaN
    np.testing.assert_array_equal(np.signbit(actual), np.signbit(expected))  # -0.0 where -0.0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("samples_per_block", [1, 2, 100])
@pytest.mark.parametrize("pooling, shape", TILED)
def test_tiling_windows_take_the_offset_rows_and_match_caffes_loop(pooling, shape, samples_per_block, dtype,
                                                                   monkeypatch):
    """Tiling windows: the top (a zero maximum's sign included) and the bottom diff (``0 + top_diff``: -0.0
    becomes +0.0, NaN and inf kept, +0.0 for the elements that did not win) are those of Caffe's loop."""
    monkeypatch.setattr(cache_blocking, "BLOCK_BYTES", samples_per_block * int(np.prod(shape[1:])) * 4)
    scans = []
    real_scan = pooling_numpy._tiled_scan
    monkeypatch.setattr(pooling_numpy, "_tiled_scan", lambda *a: scans.append(1) or real_scan(*a))
    x = _signed_bottom(shape, seed=len(pooling) + samples_per_block, dtype=dtype)
    port = make_layer(f'type: "Pooling" pooling_param {{ pool: MAX {pooling} }}', [shape])
    kernel, stride, pad, out = port.geometry_for(*shape[2:])
    xt = torch.from_numpy(x).requires_grad_()
    (top,) = port(xt)
    assert scans and type(top.grad_fn).__name__ == "MaxPoolRoutedBackward"
    dy = _signed_top_diff(top.shape, seed=3, dtype=dtype)
    (dx,) = torch.autograd.grad(top, xt, torch.from_numpy(dy))
    reference_top, _, reference_dx = _caffe_max_pool(x, kernel, stride, pad, out, dy)
    _assert_same_bits(top.detach().numpy(), reference_top.astype(dtype))
    _assert_same_bits(dx.numpy(), reference_dx.astype(dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("pooling, shape", GEOMETRIES)
def test_the_separable_scan_matches_caffes_loop_with_both_zeros(pooling, shape, dtype, monkeypatch):
    """The separable scan (per row, then per window; the tiled windows sent through it too): the top's bits, a
    zero maximum's sign included, and the bottom diff (sums of special top diffs) are those of Caffe's loop."""
    monkeypatch.setattr(pooling_numpy, "tiles", lambda *a: False)
    x = _signed_bottom(shape, seed=len(pooling), dtype=dtype)
    port = make_layer(f'type: "Pooling" pooling_param {{ pool: MAX {pooling} }}', [shape])
    kernel, stride, pad, out = port.geometry_for(*shape[2:])
    xt = torch.from_numpy(x).requires_grad_()
    (top,) = port(xt)
    dy = _signed_top_diff(top.shape, seed=5, dtype=dtype)
    (dx,) = torch.autograd.grad(top, xt, torch.from_numpy(dy))
    reference_top, _, reference_dx = _caffe_max_pool(x, kernel, stride, pad, out, dy)
    _assert_same_bits(top.detach().numpy(), reference_top.astype(dtype))
    _assert_same_bits(dx.numpy(), reference_dx.astype(dtype))


def test_a_zero_maximum_takes_the_sign_of_the_first_zero():
    """Windows whose maximum is zero, both signs in both orders: Caffe copies the first zero (``0 > -0`` is false)."""
    windows = np.array([[-0.0, 0.0, -1.0, -1.0], [0.0, -0.0, -1.0, -1.0], [-1.0, -0.0, -0.0, 0.0],
                        [-1.0, -1.0, 0.0, -0.0], [0.0, 0.0, 0.0, 0.0], [-0.0, -0.0, -0.0, -0.0]], dtype=np.float32)
    x = windows.reshape(1, 6, 2, 2)
    port = make_layer('type: "Pooling" pooling_param { pool: MAX kernel_size: 2 stride: 2 }', [x.shape])
    xt = torch.from_numpy(x).requires_grad_()
    (top,) = port(xt)
    assert np.signbit(top.detach().numpy().reshape(-1)).tolist() == [True, False, True, False, False, True]
    (dx,) = torch.autograd.grad(top, xt, torch.ones_like(top))
    winners = dx.numpy().reshape(6, 4).argmax(1)
    assert winners.tolist() == [0, 0, 1, 2, 0, 0] and dx.sum() == 6


def test_tiling_windows_keep_a_differentiable_backward():
    """``create_graph=True`` on tiling windows: the forward's slots route the backward, as Caffe's mask."""
    shape = (2, 3, 4, 6)
    port = make_layer('type: "Pooling" pooling_param { pool: MAX kernel_size: 2 stride: 2 }', [shape])
    x = torch.from_numpy(_signed_bottom(shape, seed=4, dtype=np.float32)).nan_to_num(nan=0.5)
    xt = x.clone().requires_grad_()
    (top,) = port(xt)
    dy = torch.rand(top.shape).requires_grad_()
    (dx,) = torch.autograd.grad(top, xt, dy, create_graph=True)
    _, mask, reference_dx = _caffe_max_pool(x.numpy(), *port.geometry_for(4, 6), dy.detach().numpy())
    np.testing.assert_array_equal(dx.detach().numpy(), reference_dx.astype(np.float32))
    (ddy,) = torch.autograd.grad((dx * dx).sum(), dy)
    assert torch.equal(ddy, _routed_back(2 * dx.detach(), mask))


@pytest.mark.parametrize("samples_per_block", [1, 100])
@pytest.mark.parametrize("top_diff_layout", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("pooling, shape", GEOMETRIES)
def test_a_channels_last_bottom_gives_the_same_top_and_diff_in_its_layout(pooling, shape, top_diff_layout,
                                                                          samples_per_block, monkeypatch):
    """Training with ``--channels-last``: the bottom arrives NHWC; the top and the bottom diff come back NHWC
    (what the next convolution reads and the one before expects), with the bits of the NCHW scan, whatever
    the layout of the top diff."""
    monkeypatch.setattr(cache_blocking, "BLOCK_BYTES", samples_per_block * int(np.prod(shape[1:])) * 4)
    port = make_layer(f'type: "Pooling" pooling_param {{ pool: MAX {pooling} }}', [shape])
    x = _signed_bottom(shape, seed=7, dtype=np.float32)
    results = []
    for layout in (torch.contiguous_format, torch.channels_last):
        xt = torch.from_numpy(x).contiguous(memory_format=layout).requires_grad_()
        (top,) = port(xt)
        assert type(top.grad_fn).__name__ == "MaxPoolRoutedBackward"
        assert top.is_contiguous(memory_format=layout)
        dy = torch.from_numpy(_signed_top_diff(top.shape, seed=2, dtype=np.float32))
        (dx,) = torch.autograd.grad(top, xt, dy.contiguous(memory_format=top_diff_layout))
        assert dx.is_contiguous(memory_format=layout)
        results.append((top.detach().contiguous().numpy(), dx.contiguous().numpy()))
    for nchw, nhwc in zip(*results):
        _assert_same_bits(nhwc, nchw)


def test_a_channels_last_bottom_keeps_a_differentiable_backward():
    """create_graph through an NHWC bottom: the diff and its derivative in the top diff as from an NCHW one."""
    shape = (2, 3, 7, 7)
    port = make_layer('type: "Pooling" pooling_param { pool: MAX kernel_size: 3 stride: 2 pad: 1 }', [shape])
    x = _signed_bottom(shape, seed=3, dtype=np.float32)
    results = []
    for layout in (torch.contiguous_format, torch.channels_last):
        xt = torch.from_numpy(x).contiguous(memory_format=layout).requires_grad_()
        (top,) = port(xt)
        dy = torch.from_numpy(_signed_top_diff(top.shape, seed=4, dtype=np.float32)).requires_grad_()
        (dx,) = torch.autograd.grad(top, xt, dy, create_graph=True)
        (ddy,) = torch.autograd.grad((dx * dx).sum(), dy)
        results.append((dx.detach().contiguous().numpy(), ddy.numpy()))
    for nchw, nhwc in zip(*results):
        _assert_same_bits(nhwc, nchw)

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


def test_the_pytorch_form_gives_the_same_diff(monkeypatch):
    """With the CPU form switched off (as on CUDA, under compile, for other dtypes) the layer routes through
    ``with_caffe_backward`` and the PyTorch scan: the same diff bit for bit."""
    shape = (3, 2, 7, 7)
    port = make_layer('type: "Pooling" pooling_param { pool: MAX kernel_size: 3 stride: 2 }', [shape])
    x = torch.from_numpy(_bottom(shape, seed=5))
    dy = torch.rand(3, 2, 3, 3)
    diffs = []
    for form in ("numpy", "torch"):
        if form == "torch":
            monkeypatch.setattr(pooling_numpy, "applies", lambda t: False)
        xt = x.clone().requires_grad_()
        (top,) = port(xt)
        assert type(top.grad_fn).__name__ == ("MaxPoolRoutedBackward" if form == "numpy" else "_CaffeBackwardBackward")
        diffs.append(torch.autograd.grad(top, xt, dy)[0])
    assert torch.equal(diffs[0], diffs[1])


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
    flat_dx = dx.detach().reshape(2, 2, -1)
    expected = torch.where(torch.from_numpy(mask) >= 0,
                           2 * flat_dx.gather(2, torch.from_numpy(mask).clamp_min(0).view(2, 2, -1)).view(top.shape), 0.0)
    assert torch.equal(ddy, expected)

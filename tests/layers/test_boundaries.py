"""Gradients and tie-breaking exactly on the boundaries, against Caffe's own formulas.

Each test states the formula of Caffe's layer source (``src/caffe/layers/*.cpp``) in its docstring,
evaluates it independently in numpy, and checks our forward and backward at the kinks, ties and
overflow guards, where the derivative autograd would pick is torch's implementation detail (torch 2.14
changed ``clamp``'s at the bounds).  A change in torch that leaks into a port fails here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.layers.zoo_single_layer import Zoo, assert_matches, make_layer
from caffe_compat.layers import pooling_numpy

FLT_MAX = float(np.finfo(np.float32).max)
DTYPES = [torch.float32, torch.float64]


def _forward_backward(port, *bottoms, top_diff=None, seed=0):
    """Tops of ``port`` and the bottom diffs for ``top_diff`` (random, fixed seed, when None)."""
    bottoms = [b.detach().clone().requires_grad_() for b in bottoms]
    (top,) = port(*bottoms)[:1]
    if top_diff is None:
        top_diff = torch.randn(top.shape, dtype=top.dtype, generator=torch.Generator().manual_seed(seed))
    grads = torch.autograd.grad(top, bottoms, top_diff, allow_unused=True)
    grads = [torch.zeros_like(b) if g is None else g for b, g in zip(bottoms, grads)]
    return top.detach().numpy(), top_diff.numpy(), [g.numpy() for g in grads]


def _edge_values(dtype, *points):
    """The points, their float neighbours on both sides, ±0, ±1 and NaN, as a numpy array of ``dtype``."""
    np_dtype = np.float32 if dtype == torch.float32 else np.float64
    values = [0.0, -0.0, 1.0, -1.0, np.nan]
    for p in points:
        p = np_dtype(p)
        values += [p, np.nextafter(p, np_dtype(-np.inf)), np.nextafter(p, np_dtype(np.inf))]
    return np.array(values, dtype=np_dtype)


# --------------------------------------------------------------------------- neuron layers


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slope", [0.0, 0.1, -0.3])
def test_relu_gradient_at_zero_is_the_negative_slope(dtype, slope):
    """ReLULayer: ``y = max(x, 0) + s·min(x, 0)``; ``dx = dy · ((x > 0) + s·(x <= 0))``: s at x = ±0 and
    0 for NaN (both comparisons false), where torch's relu backward would pass dy."""
    x = _edge_values(dtype, 1e-30, -1e-30)
    port = make_layer(f'type: "ReLU" relu_param {{ negative_slope: {slope} }}', [x.shape]).to(dtype)
    top, dy, (dx,) = _forward_backward(port, torch.from_numpy(x))
    s = x.dtype.type(np.float32(slope))  # prototxt floats are float32
    np.testing.assert_array_equal(top, np.maximum(x, 0) + s * np.minimum(x, 0))
    np.testing.assert_array_equal(dx, dy * ((x > 0) + s * (x <= 0)))


@pytest.mark.parametrize("shared", [False, True])
def test_prelu_gradients_at_zero(shared):
    """PReLULayer: ``dx = dy · ((x > 0) + a_c·(x <= 0))`` and ``da_c = Σ dy · x · (x <= 0)`` over every
    position of channel c (all channels when shared): x = 0 takes the slope branch."""
    x = np.array([[[0.0, -0.0, 2.0, -1.5], [1e-30, -1e-30, 0.0, 3.0], [0.0, 0.0, -2.0, 0.5]],
                  [[-4.0, 0.0, 1.0, 0.0], [0.0, -0.5, 0.0, -0.0], [2.5, 0.0, 0.0, -3.0]]])
    text = 'type: "PReLU" prelu_param { channel_shared: true }' if shared else 'type: "PReLU"'
    port = make_layer(text, [x.shape]).double()
    slopes = np.array(0.3) if shared else np.array([0.25, -0.4, 0.7])
    with torch.no_grad():
        port.slope.copy_(torch.from_numpy(slopes))
    xt = torch.from_numpy(x).requires_grad_()
    (top,) = port(xt)
    dy = np.random.RandomState(1).randn(*x.shape)
    dx, da = torch.autograd.grad(top, (xt, port.slope), torch.from_numpy(dy))
    a = slopes if shared else slopes.reshape(1, 3, 1)
    np.testing.assert_array_equal(top.detach().numpy(), np.maximum(x, 0) + a * np.minimum(x, 0))
    np.testing.assert_array_equal(dx.numpy(), dy * ((x > 0) + a * (x <= 0)))
    per_position = dy * x * (x <= 0)
    expected = per_position.sum() if shared else per_position.sum(axis=(0, 2))
    np.testing.assert_allclose(da.numpy(), expected, rtol=1e-15, atol=1e-15)


@pytest.mark.parametrize("dtype", DTYPES)
def test_elu_gradient_at_zero_is_alpha(dtype):
    """ELULayer: ``dx = dy · ((x > 0) + (alpha + y)·(x <= 0))``: alpha at x = 0 (the left slope), 1 just
    above.  Checked against the layer_zoo fixture too (``elu``, alpha 0.7)."""
    x = _edge_values(dtype, 1e-30, -1e-30, -3.0)
    port = make_layer('type: "ELU" elu_param { alpha: 0.7 }', [x.shape]).to(dtype)
    top, dy, (dx,) = _forward_backward(port, torch.from_numpy(x))
    alpha = x.dtype.type(np.float32(0.7))
    np.testing.assert_allclose(top, np.where(x > 0, x, alpha * np.expm1(x)), rtol=1e-6, atol=0)
    expected = dy * ((x > 0) + (alpha + top) * (x <= 0))
    np.testing.assert_allclose(dx, expected, rtol=2e-7 if dtype == torch.float32 else 1e-15, atol=0)
    assert dx[0] == dy[0] * alpha and dx[1] == dy[1] * alpha  # x = ±0: exactly alpha


def test_threshold_is_strict_at_the_threshold_and_has_no_backward():
    """ThresholdLayer: ``y = x > t ? 1 : 0`` (strict); Backward_cpu is NOT_IMPLEMENTED, so no gradient."""
    for t in (0.0, 0.2, -1.5):
        x = _edge_values(torch.float32, t)
        port = make_layer(f'type: "Threshold" threshold_param {{ threshold: {t} }}', [x.shape])
        (top,) = port(torch.from_numpy(x).requires_grad_())
        np.testing.assert_array_equal(top.numpy(), (x > np.float32(t)).astype(np.float32))
        assert not top.requires_grad


@pytest.mark.parametrize("dtype", DTYPES)
def test_absval_gradient_uses_caffe_sign(dtype):
    """AbsValLayer: ``dx = sign(x) · dy`` with ``caffe_sign(v) = (0 < v) - (v < 0)``: 0 at ±0 and NaN."""
    x = _edge_values(dtype, 1e-30, -1e-30)
    top, dy, (dx,) = _forward_backward(make_layer('type: "AbsVal"', [x.shape]).to(dtype), torch.from_numpy(x))
    np.testing.assert_array_equal(top, np.abs(x))
    np.testing.assert_array_equal(dx, dy * ((0 < x).astype(x.dtype) - (x < 0).astype(x.dtype)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_clip_passes_the_gradient_at_both_bounds(dtype):
    """ClipLayer: ``y = max(min, min(x, max))``; ``dx = dy · (x >= min && x <= max)``: inclusive at both
    bounds (torch 2.14's clamp gives 0 there), 0 for NaN."""
    lo, hi = -1.0, 1.5
    x = _edge_values(dtype, lo, hi, 0.3)
    port = make_layer(f'type: "Clip" clip_param {{ min: {lo} max: {hi} }}', [x.shape]).to(dtype)
    top, dy, (dx,) = _forward_backward(port, torch.from_numpy(x))
    np.testing.assert_array_equal(top, np.maximum(lo, np.minimum(x, hi)))
    np.testing.assert_array_equal(dx, dy * ((x >= lo) & (x <= hi)))
    assert dx[list(x).index(lo)] == dy[list(x).index(lo)] != 0


def _caffe_power_backward(x, dy, power, scale, shift):
    """PowerLayer::Backward_cpu, branch by branch (``d = power · scale``, y the top computed as Caffe's
    Forward_cpu does: scale, add the shift only when nonzero, powx)."""
    diff_scale = power * scale
    y = _caffe_power_base(x, scale, shift) ** power
    if diff_scale == 0 or power == 1:
        return np.full_like(x, diff_scale) * (dy if diff_scale != 0 else 0)
    if power == 2:
        local = diff_scale * scale * x + diff_scale * shift
    elif shift == 0:
        local = y / x * power
    else:
        local = y / _caffe_power_base(x, scale, shift) * diff_scale
    return dy * local


def _caffe_power_base(x, scale, shift):
    base = x * scale if scale != 1 else x
    return base + shift if shift != 0 else base  # with shift 0, -0.0 stays -0.0 (so 0^-1 = -inf)


@pytest.mark.parametrize("power, scale, shift", [
    (1.5, 1.0, 0.0),    # shift 0: power · y / x, 0/0 = NaN at x = 0
    (-1.0, 2.0, 0.0),   # shift 0, negative power: inf / 0 at x = 0
    (0.5, 2.0, 1.0),    # general: d · y / (shift + scale x), NaN where the base is 0 (x = -0.5)
    (3.0, -0.5, 0.25),  # general, base 0 at x = 0.5
    (2.0, -0.7, 0.25),  # power 2: d·scale·x + d·shift, finite everywhere
    (1.0, 3.0, 2.0),    # power 1: the constant diff_scale
])
def test_power_backward_special_cases_at_a_zero_base(power, scale, shift):
    """PowerLayer: ``y = (shift + scale·x)^power``; Backward_cpu: ``d = power·scale``; power 1 → ``d``;
    power 2 → ``d·scale·x + d·shift``; shift 0 → ``power·y/x``; else ``d·y/(shift + scale·x)``; times dy.
    Caffe's y/x is NaN or inf where the base is 0 (the true derivative is 0 or inf): reproduced."""
    port = make_layer(f'type: "Power" power_param {{ power: {power} scale: {scale} shift: {shift} }}', [(6,)]).double()
    power, scale, shift = (float(np.float32(v)) for v in (power, scale, shift))  # prototxt floats are float32
    zero = -shift / scale
    x = np.array([zero, zero + 0.25, zero + 1.0, 2.0, 0.0, 0.75])
    with np.errstate(divide="ignore", invalid="ignore"):
        top, dy, (dx,) = _forward_backward(port, torch.from_numpy(x))
        np.testing.assert_allclose(top, _caffe_power_base(x, scale, shift) ** power, rtol=1e-15)
        expected = _caffe_power_backward(x, dy, power, scale, shift)
    np.testing.assert_allclose(dx, expected, rtol=1e-14, atol=0)
    if power not in (1.0, 2.0):
        assert not np.isfinite(dx[0])


@pytest.mark.parametrize("text", ['power: 0 scale: 2 shift: 3', 'power: 2 scale: 0 shift: 3'])
def test_power_constant_cases_have_zero_gradient(text):
    """PowerLayer with ``diff_scale = power·scale = 0``: the top is a constant and Backward sets the bottom
    diff to 0 (not multiplied by dy)."""
    port = make_layer(f'type: "Power" power_param {{ {text} }}', [(3,)])
    x = torch.tensor([0.0, -1.0, 2.0], requires_grad=True)
    (top,) = port(x)
    assert not top.requires_grad  # no dependence on x: a zero bottom diff


@pytest.mark.parametrize("dtype", DTYPES)
def test_log_backward_at_and_near_a_zero_argument(dtype):
    """LogLayer: ``y = ln(shift + scale·x) / ln(base)``; ``dx = dy · (scale / ln(base)) · (shift + scale·x)^-1``:
    ±inf where the argument is 0, NaN for dy = 0 there; a negative argument has a NaN top, a finite diff."""
    base, scale, shift = 2.0, 0.5, 1.75
    x = np.array([-3.5, -3.5, -3.4, -3.6, 0.0, 1.0, 10.0], dtype=np.float32 if dtype == torch.float32 else None)
    port = make_layer(f'type: "Log" log_param {{ base: {base} scale: {scale} shift: {shift} }}', [x.shape]).to(dtype)
    dy = torch.tensor([1.0, 0.0, -2.0, 1.0, 0.5, 1.0, -1.0], dtype=dtype)
    with np.errstate(divide="ignore", invalid="ignore"):
        top, _, (dx,) = _forward_backward(port, torch.from_numpy(x), top_diff=dy)
        inner = shift + scale * x.astype(np.float64)
        expected_top = np.log(inner) / np.log(base)
        expected = dy.numpy() * (scale / np.log(base)) * (1.0 / inner)
    rtol = 1e-6 if dtype == torch.float32 else 1e-14
    np.testing.assert_allclose(top, expected_top, rtol=rtol)
    np.testing.assert_allclose(dx, expected, rtol=rtol)
    assert dx[0] == np.inf and np.isnan(dx[1]) and np.isnan(top[3]) and np.isfinite(dx[3])


@pytest.mark.parametrize("dtype", DTYPES)
def test_bnll_branches_and_the_50_guard(dtype):
    """BNLLLayer: ``y = x > 0 ? x + log(1 + exp(-x)) : log(1 + exp(x))`` (in double: ``1.`` literals);
    ``dx = dy · e / (e + 1)`` with ``e = exp(min(x, 50))``, so 1, not inf/inf = NaN, for huge x.

    Forward is softplus, which returns x above 20 where Caffe adds log(1 + exp(-x)) < 2.1e-9, and keeps
    log1p's accuracy below -17 where Caffe's double ``1 + exp(x)`` rounds (|difference| < 1e-15)."""
    x = np.array([-800.0, -100.0, -80.0, -20.0, -1e-8, 0.0, -0.0, 1e-8, 1.0, 20.0, 30.0, 49.0, 50.0, 51.0, 100.0,
                  800.0])
    x = x.astype(np.float32 if dtype == torch.float32 else np.float64)
    top, dy, (dx,) = _forward_backward(make_layer('type: "BNLL"', [x.shape]).to(dtype), torch.from_numpy(x))
    xd = x.astype(np.float64)
    with np.errstate(over="ignore"):
        expected_top = np.where(xd > 0, xd + np.log(1.0 + np.exp(-np.abs(xd))), np.log(1.0 + np.exp(np.minimum(xd, 0))))
        e = np.exp(np.minimum(xd, 50.0))
    np.testing.assert_allclose(top, expected_top, rtol=1e-6 if dtype == torch.float32 else 1e-15, atol=2.1e-9)
    expected = dy.astype(np.float64) * e / (e + 1.0)
    # (float32 products near exp(-100) are denormal: Caffe's float top_diff · expval rounds there too)
    np.testing.assert_allclose(dx, expected, rtol=1e-6 if dtype == torch.float32 else 1e-15,
                               atol=1e-40 if dtype == torch.float32 else 0)
    assert np.all(np.isfinite(dx))
    if dtype == torch.float64:  # softplus's own gradient is exactly 1 from 20 on; Caffe's is e/(e+1) up to 50
        assert dx[10] != dy[10] and dx[10] == pytest.approx(dy[10] * (1 - np.exp(-30.0)), rel=1e-15)


def test_boundary_layers_match_the_caffe_fixtures():
    """Where the layer_zoo fixture (real Caffe) has the port, the explicit backward still matches it."""
    zoo = Zoo("layer_zoo")
    for layer in ("elu", "absval", "power", "power_sq", "bnll", "pool_max_clip", "pool_max_ceil", "gpool_max"):
        port = zoo.build(layer)
        bottoms = zoo.bottoms(layer)
        (top,) = port(*bottoms)
        assert_matches(top, zoo.blobs[layer], what=f"{layer} forward")
        (grad,) = torch.autograd.grad(top, bottoms, torch.from_numpy(zoo.grads[f"diff:{layer}"]))
        assert_matches(grad, zoo.grads[f"diff:{zoo.bottom_keys(layer)[0]}"], what=f"{layer} backward")


# --------------------------------------------------------------------------- pooling, eltwise, argmax


def _caffe_max_pool(x, kernel, stride, pad, out, top_diff):
    """PoolingLayer MAX Forward_cpu / Backward_cpu, written out: top from -FLT_MAX, the window clipped to
    the image, ``if (bottom[index] > top)`` keeps the first maximum in row-major scan order; the mask is
    its ``h·W + w`` (-1 if none); backward adds each top diff to ``bottom_diff[mask]``."""
    n, c, height, width = x.shape
    top = np.full((n, c, *out), -FLT_MAX)
    mask = np.full((n, c, *out), -1, dtype=np.int64)
    bottom_diff = np.zeros_like(x, dtype=np.float64)
    for i in range(n):
        for j in range(c):
            for ph in range(out[0]):
                for pw in range(out[1]):
                    h0, w0 = ph * stride[0] - pad[0], pw * stride[1] - pad[1]
                    for h in range(max(h0, 0), min(h0 + kernel[0], height)):
                        for w in range(max(w0, 0), min(w0 + kernel[1], width)):
                            if x[i, j, h, w] > top[i, j, ph, pw]:
                                top[i, j, ph, pw], mask[i, j, ph, pw] = x[i, j, h, w], h * width + w
                    if mask[i, j, ph, pw] >= 0:
                        h, w = divmod(int(mask[i, j, ph, pw]), width)
                        bottom_diff[i, j, h, w] += top_diff[i, j, ph, pw]
    return top, mask, bottom_diff


@pytest.fixture(params=["numpy", "torch"])
def scan_form(request, monkeypatch):
    """MAX pooling's routing in its NumPy CPU form and in its PyTorch form (CUDA, compile, other dtypes)."""
    if request.param == "torch":
        monkeypatch.setattr(pooling_numpy, "applies", lambda x: False)
    return request.param


@pytest.mark.parametrize("pooling, shape", [
    ("kernel_size: 3 stride: 1", (2, 2, 5, 6)),                 # overlapping windows, every tie shared
    ("kernel_size: 3 stride: 2 pad: 1", (2, 2, 7, 6)),          # padding never selected
    ("kernel_h: 3 kernel_w: 2 stride: 2 pad_h: 1 pad_w: 0", (1, 3, 6, 7)),
    ("kernel_size: 2 stride: 3", (1, 2, 9, 9)),                 # a window past the end: mask -1, no diff
    ("kernel_size: 3 stride: 2 pad: 2", (1, 2, 7, 8)),          # pad > kernel / 2: the explicit path
    ("global_pooling: true", (2, 3, 4, 5)),
])
def test_max_pooling_ties_go_to_the_first_maximum_in_scan_order(pooling, shape, scan_form):
    """PoolingLayer MAX: among equal maxima the first in the window's row-major scan wins (strict ``>``
    from -FLT_MAX), in every overlapping window; the gradient goes to that element only and adds up over
    the windows that chose it; the mask top is its ``h·W + w``.  Values from {-1, 0, 1} force ties."""
    rng = np.random.RandomState(sum(shape))
    x = rng.randint(-1, 2, size=shape).astype(np.float32)
    x[0, 0] = -1.0  # a plane of equal values: every window a tie (and padding, at 0, would beat them)
    text = f'type: "Pooling" top: "p" top: "mask" pooling_param {{ pool: MAX {pooling} }}'
    port = make_layer(text, [shape])
    kernel, stride, pad, out = port.geometry_for(*shape[2:])
    xt = torch.from_numpy(x).requires_grad_()
    top, mask = port(xt)
    dy = rng.randint(1, 5, size=top.shape).astype(np.float32)  # small integers: every sum is exact
    (dx,) = torch.autograd.grad(top, xt, torch.from_numpy(dy))
    ref_top, ref_mask, ref_dx = _caffe_max_pool(x, kernel, stride, pad, out, dy)
    np.testing.assert_array_equal(top.detach().numpy(), ref_top.astype(np.float32))
    np.testing.assert_array_equal(mask.numpy(), ref_mask.astype(np.float32))
    np.testing.assert_array_equal(dx.numpy(), ref_dx.astype(np.float32))
    single = make_layer(text.replace('top: "mask" ', ''), [shape])  # one top: the same routing
    (top1,) = single(xt)
    np.testing.assert_array_equal(torch.autograd.grad(top1, xt, torch.from_numpy(dy))[0].numpy(), dx.numpy())


@pytest.mark.parametrize("pooling, shape", [
    ("kernel_size: 3 stride: 1", (2, 3, 6, 5)),
    ("kernel_size: 3 stride: 2 pad: 1", (2, 2, 7, 8)),
    ("kernel_size: 2 stride: 3", (1, 2, 9, 9)),                 # ceil overhang: windows past the end
    ("kernel_size: 3 stride: 2 pad: 2", (1, 2, 7, 8)),          # the explicit path
    ("kernel_size: 17 stride: 1", (1, 2, 18, 19)),              # 289 offsets: the wide first-match code
])
def test_max_pooling_routes_nan_infinities_and_flt_max_like_caffe(pooling, shape, scan_form):
    """NaN is never selected (``NaN > top`` is false), -inf and -FLT_MAX never beat Caffe's start value
    (a window of nothing else selects nothing: mask -1, no diff), +inf is selected like any maximum; the
    mask and the diff are Caffe's written-out loop's on a bottom full of them and of ties."""
    rng = np.random.RandomState(sum(shape) + len(pooling))
    specials = np.array([np.nan, -np.inf, np.inf, -FLT_MAX, -1.0, 0.0, 1.0], dtype=np.float32)
    x = specials[rng.choice(len(specials), size=shape, p=[0.15, 0.2, 0.05, 0.2, 0.1, 0.15, 0.15])]
    x[0, 0, :4] = np.nan  # whole windows of NaN
    x[0, 0, :, :2] = np.nan
    x[-1, -1, -4:] = -FLT_MAX
    x[-1, -1, :, -2:] = -np.inf
    text = f'type: "Pooling" top: "p" top: "mask" pooling_param {{ pool: MAX {pooling} }}'
    port = make_layer(text, [shape])
    kernel, stride, pad, out = port.geometry_for(*shape[2:])
    xt = torch.from_numpy(x).requires_grad_()
    top, mask = port(xt)
    dy = rng.randint(1, 5, size=top.shape).astype(np.float32)
    (dx,) = torch.autograd.grad(top, xt, torch.from_numpy(dy))
    ref_top, ref_mask, ref_dx = _caffe_max_pool(x, kernel, stride, pad, out, dy)
    assert (ref_mask >= 0).any() and ((ref_mask == -1).any() or kernel[0] > 3)
    np.testing.assert_array_equal(mask.numpy(), ref_mask.astype(np.float32))
    np.testing.assert_array_equal(dx.numpy(), ref_dx.astype(np.float32))
    assert ((ref_top == -FLT_MAX).any() or kernel[0] > 3) and not np.isnan(ref_top).any()
    with torch.no_grad():  # the values: NaN never taken, -FLT_MAX where nothing is above it (training and inference)
        for values in (top.detach(), port(torch.from_numpy(x))[0]):
            np.testing.assert_array_equal(values.numpy(), ref_top.astype(np.float32))


def test_max_pooling_channels_last_and_float64_route_like_caffe(scan_form):
    """The channels_last fast path and float64 bottoms take the same first-maximum routing."""
    rng = np.random.RandomState(3)
    x = rng.randint(0, 2, size=(2, 3, 6, 6)).astype(np.float64)
    port = make_layer('type: "Pooling" pooling_param { pool: MAX kernel_size: 3 stride: 1 pad: 1 }', [x.shape])
    dy = rng.randint(1, 4, size=(2, 3, 6, 6)).astype(np.float64)
    _, _, ref_dx = _caffe_max_pool(x, (3, 3), (1, 1), (1, 1), (6, 6), dy)
    for bottom in (torch.from_numpy(x), torch.from_numpy(x).float().contiguous(memory_format=torch.channels_last)):
        bottom.requires_grad_()
        (top,) = port(bottom)
        (dx,) = torch.autograd.grad(top, bottom, torch.from_numpy(dy).to(bottom.dtype))
        np.testing.assert_array_equal(dx.double().numpy(), ref_dx)


def test_eltwise_max_ties_follow_caffes_comparisons():
    """EltwiseLayer MAX: ``mask = a > b ? 0 : 1`` for bottoms 0 and 1 (a tie goes to bottom **1**), then
    bottom k >= 2 replaces the maximum only when strictly greater (among later ties the earliest wins);
    ``dx_k = dy · (mask == k)``."""
    rng = np.random.RandomState(7)
    bottoms = [rng.randint(0, 3, size=(4, 5)).astype(np.float32) for _ in range(4)]
    top_ref = np.where(bottoms[0] > bottoms[1], bottoms[0], bottoms[1])
    mask = np.where(bottoms[0] > bottoms[1], 0, 1)
    for k in range(2, 4):
        mask = np.where(bottoms[k] > top_ref, k, mask)
        top_ref = np.maximum(top_ref, bottoms[k])
    port = make_layer('type: "Eltwise" eltwise_param { operation: MAX }', [(4, 5)] * 4)
    top, dy, grads = _forward_backward(port, *map(torch.from_numpy, bottoms))
    np.testing.assert_array_equal(top, top_ref)
    for k, grad in enumerate(grads):
        np.testing.assert_array_equal(grad, np.where(mask == k, dy, 0))
    assert np.any((bottoms[0] == bottoms[1]) & (mask == 1))


def _caffe_argmax(rows: np.ndarray, top_k: int):
    """ArgMaxLayer: ``std::partial_sort`` of (value, index) pairs with ``std::greater``: larger value
    first, and among equal values the larger index (lexicographic order on the pair)."""
    ordered = [sorted(((v, j) for j, v in enumerate(row)), reverse=True)[:top_k] for row in rows]
    return np.array([[j for _, j in o] for o in ordered]), np.array([[v for v, _ in o] for o in ordered])


@pytest.mark.parametrize("argmax_param, axis", [
    ("top_k: 3", None), ("top_k: 4 out_max_val: true", None), ("axis: 1 top_k: 2", 1),
    ("axis: 2 top_k: 3 out_max_val: true", 2), ("axis: -1", 3),
])
def test_argmax_ties_put_the_larger_index_first(argmax_param, axis):
    """ArgMaxLayer on values from {0, 1, 2} (many ties): indices and values in Caffe's pair order; without
    ``axis`` the top is (N, 1 or 2, top_k, 1) with indices then values; with ``axis`` only one of them."""
    x = np.random.RandomState(11).randint(0, 3, size=(2, 4, 5, 3)).astype(np.float32)
    port = make_layer(f'type: "ArgMax" argmax_param {{ {argmax_param} }}', [x.shape])
    (top,) = port(torch.from_numpy(x))
    top_k = int(argmax_param.split("top_k: ")[1].split()[0]) if "top_k" in argmax_param else 1
    with_values = "out_max_val" in argmax_param
    if axis is None:
        index, value = _caffe_argmax(x.reshape(2, -1), top_k)
        expected = np.stack([index, value] if with_values else [index], axis=1).reshape(2, -1, top_k, 1)
    else:
        moved = np.moveaxis(x, axis, -1)
        index, value = _caffe_argmax(moved.reshape(-1, moved.shape[-1]), top_k)
        chosen = (value if with_values else index).reshape(*moved.shape[:-1], top_k)
        expected = np.moveaxis(chosen, -1, axis)
    np.testing.assert_array_equal(top.numpy(), expected.astype(np.float32))


# --------------------------------------------------------------------------- BatchNorm, Reduction, losses


@pytest.mark.parametrize("factor", [0.0, 4.0])
def test_batchnorm_global_stats_with_a_zero_scale_factor(factor):
    """BatchNormLayer, use_global_stats: ``f = blobs[2] == 0 ? 0 : 1/blobs[2]``; mean = f·blobs[0],
    var = f·blobs[1]; ``y = (x - mean)/sqrt(var + eps)``, ``dx = dy/sqrt(var + eps)``: a zero factor
    ignores the stored statistics (y = x/sqrt(eps))."""
    port = make_layer('type: "BatchNorm" batch_norm_param { use_global_stats: true eps: 0.001 }',
                      [(2, 3, 2, 2)]).double()
    stored_mean, stored_var = np.array([1.0, -2.0, 0.5]), np.array([4.0, 0.25, 9.0])
    with torch.no_grad():
        port.mean.copy_(torch.from_numpy(stored_mean))
        port.variance.copy_(torch.from_numpy(stored_var))
        port.scale_factor.fill_(factor)
    x = np.random.RandomState(2).randn(2, 3, 2, 2)
    top, dy, (dx,) = _forward_backward(port, torch.from_numpy(x))
    f = 0.0 if factor == 0 else 1.0 / factor
    eps = float(np.float32(0.001))
    std = np.sqrt(f * stored_var + eps).reshape(1, 3, 1, 1)
    np.testing.assert_allclose(top, (x - f * stored_mean.reshape(1, 3, 1, 1)) / std, rtol=1e-14)
    np.testing.assert_allclose(dx, dy / std, rtol=1e-14)


def test_batchnorm_moving_average_fraction_zero_keeps_only_the_last_batch():
    """BatchNormLayer, TRAIN: ``s ← λ·s + 1``, ``blobs[0] ← λ·blobs[0] + μ``, ``blobs[1] ← λ·blobs[1] +
    m/(m-1)·σ²``; with λ = 0 the blobs hold the last batch's statistics and the factor is 1."""
    port = make_layer('type: "BatchNorm" batch_norm_param { moving_average_fraction: 0 }', [(4, 2, 3)],
                      phase="train").double()
    rng = np.random.RandomState(4)
    for _ in range(2):
        x = rng.randn(4, 2, 3) * 3 + 1
        port(torch.from_numpy(x))
    assert port.scale_factor.item() == 1.0
    np.testing.assert_allclose(port.mean.numpy(), x.mean(axis=(0, 2)), rtol=1e-14)
    np.testing.assert_allclose(port.variance.numpy(), x.var(axis=(0, 2), ddof=1), rtol=1e-13)


def test_reduction_asum_gradient_is_zero_at_zero():
    """ReductionLayer ASUM: ``y = coeff·Σ|x|``; ``dx = coeff·dy·sign(x)`` with caffe_sign (0 at ±0)."""
    x = np.array([[0.0, -0.0, 2.0, -3.0], [1e-30, 0.0, -1e-30, 0.0]], dtype=np.float32)
    port = make_layer('type: "Reduction" reduction_param { operation: ASUM axis: 1 coeff: -1.5 }', [x.shape])
    top, dy, (dx,) = _forward_backward(port, torch.from_numpy(x))
    np.testing.assert_array_equal(top, -1.5 * np.abs(x).sum(axis=1))
    np.testing.assert_array_equal(dx, np.float32(-1.5) * dy[:, None] * np.sign(x))


@pytest.mark.parametrize("norm", ["L1", "L2"])
def test_hinge_loss_gradient_is_zero_at_the_kink(norm):
    """HingeLossLayer: ``z = max(0, 1 + t·x)`` with t = -1 at the label, +1 elsewhere; L1 ``Σz/N`` with
    ``dx = t·sign(z)/N`` (caffe_sign: 0 at the kink z = 0), L2 ``Σz²/N`` with ``dx = 2·t·z/N``."""
    x = np.array([[1.0, -1.0, 0.5, -2.0], [-1.0, 3.0, 1.0, -1.0]])  # z = 0 at every ±1 entry
    label = np.array([0, 1])
    t = np.where(np.arange(4)[None, :] == label[:, None], -1.0, 1.0)
    z = np.maximum(0.0, 1.0 + t * x)
    port = make_layer(f'type: "HingeLoss" hinge_loss_param {{ norm: {norm} }}', [x.shape, (2,)])
    xt = torch.from_numpy(x).requires_grad_()
    (loss,) = port(xt, torch.from_numpy(label.astype(np.float64)))
    (dx,) = torch.autograd.grad(loss, xt)
    if norm == "L1":
        assert loss.item() == pytest.approx(z.sum() / 2, rel=1e-15)
        np.testing.assert_array_equal(dx.numpy(), t * np.sign(z) / 2)
    else:
        assert loss.item() == pytest.approx((z * z).sum() / 2, rel=1e-15)
        np.testing.assert_array_equal(dx.numpy(), 2 * t * z / 2)
    assert np.count_nonzero(z == 0) >= 4


@pytest.mark.parametrize("legacy", [True, False])
def test_contrastive_dissimilar_pair_exactly_at_the_margin_has_no_gradient(legacy):
    """ContrastiveLossLayer, dissimilar pair: ``mdist = margin - d²`` (legacy) or ``margin - d``; Backward
    writes 0 unless ``mdist > 0`` (strict), so a pair exactly at the margin gets none; just inside, it
    gets ``-(a - b)/N`` (legacy) or ``-mdist/(d + 1e-4)·(a - b)/N``."""
    a = np.array([[3.0, 4.0], [0.6, 0.8]])  # d = 5 (d² = 25) and d = 1
    b = np.zeros_like(a)
    margin = 25.0 if legacy else 5.0
    port = make_layer(f'type: "ContrastiveLoss" contrastive_loss_param {{ margin: {margin} '
                      f'legacy_version: {str(legacy).lower()} }}', [a.shape, b.shape, (2,)])
    at = torch.from_numpy(a).requires_grad_()
    (loss,) = port(at, torch.from_numpy(b), torch.zeros(2, dtype=torch.float64))
    (da,) = torch.autograd.grad(loss, at)
    assert np.array_equal(da.numpy()[0], [0.0, 0.0])
    mdist = margin - (1.0 if legacy else 1.0)
    expected = -a[1] / 2 if legacy else -mdist / (1.0 + 1e-4) * a[1] / 2
    np.testing.assert_allclose(da.numpy()[1], expected, rtol=1e-14)

"""Activation layers against real Caffe (layer_zoo fixtures), closed forms and float64 gradcheck."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from caffe_compat.errors import FormatError, ShapeMismatchError
from tests.layers.zoo_single_layer import Zoo, assert_matches, make_layer, run_and_compare


@pytest.fixture(scope="module")
def zoo():
    return Zoo("layer_zoo")


@pytest.fixture(scope="module")
def zoo_nondiff():
    return Zoo("layer_zoo_nondiff")


@pytest.mark.parametrize("layer", ["prelu_shared", "elu", "drop", "sig", "tanh", "absval", "power", "power_sq",
                                   "exp", "exp_e", "bnll"])
def test_layer_matches_caffe_forward_and_backward(zoo, layer):
    errors = run_and_compare(zoo, layer)
    assert max(errors.values()) < 1e-6


def test_prelu_shared_slope_is_a_0_axis_blob(zoo):
    port = zoo.build("prelu_shared")
    assert port.caffe_blobs()[0].shape == ()
    assert zoo.params["prelu_shared:0"].shape == ()


def test_leaky_relu_in_place_matches_caffe(zoo):
    # conv_g's pre-activation is not stored (ReLU ran in place), so recompute it from the stored conv
    # weights in float64; the stored conv_g blob is the post-ReLU value.
    data = torch.from_numpy(zoo.blobs[zoo.bottom_keys("conv_g")[0]]).double()
    weight = torch.from_numpy(zoo.params["conv_g:0"]).double()
    pre = F.conv2d(data, weight, stride=(2, 1), padding=(1, 0), dilation=2, groups=2).float().requires_grad_()
    relu = zoo.build("relu_leaky")
    (out,) = relu(pre)
    assert_matches(out, zoo.blobs["conv_g"], rtol=1e-5, atol_scale=1e-6, what="relu_leaky forward")
    # The ReLU's top diff is the sum of the diffs of the three auto-split copies of conv_g; its bottom
    # diff is what Caffe leaves in diff:conv_g.
    top_diff = sum(zoo.grads[f"diff:conv_g_relu_leaky_0_split_{k}"] for k in range(3))
    (grad,) = torch.autograd.grad(out, pre, torch.from_numpy(top_diff))
    assert_matches(grad, zoo.grads["diff:conv_g"], what="relu_leaky backward")
    assert bool((pre < 0).any()) and bool((pre > 0).any())


def test_threshold_is_strict_and_has_no_gradient(zoo_nondiff):
    errors = run_and_compare(zoo_nondiff, "threshold", compare_backward=False)
    assert errors["top threshold"] == 0.0
    data = zoo_nondiff.blobs["data"]
    assert data[0, 0, 0, 0] == np.float32(0.2) and zoo_nondiff.blobs["threshold"][0, 0, 0, 0] == 0.0
    port = zoo_nondiff.build("threshold")
    (out,) = port(torch.tensor(data, requires_grad=True))
    assert not out.requires_grad


def test_dropout_train_is_inverted_and_test_is_identity():
    x = torch.randn(200, 50, generator=torch.Generator().manual_seed(0))
    train = make_layer('type: "Dropout" dropout_param { dropout_ratio: 0.3 }', [x.shape], phase="train")
    train.generator = torch.Generator().manual_seed(1)
    (y,) = train(x)
    mask = train.last_mask
    assert torch.all(y[~mask] == 0)
    torch.testing.assert_close(y[mask], x[mask] / 0.7, rtol=1e-6, atol=0)
    keep = mask.float().mean().item()
    assert abs(keep - 0.7) < 4 * math.sqrt(0.7 * 0.3 / x.numel())
    test = make_layer('type: "Dropout" dropout_param { dropout_ratio: 0.3 }', [x.shape], phase="test")
    assert torch.equal(test(x)[0], x)


def test_dropout_follows_the_torch_mode_initialised_from_the_phase():
    x = torch.randn(30, 40, generator=torch.Generator().manual_seed(2))
    text = 'type: "Dropout" dropout_param { dropout_ratio: 0.25 }'
    train = make_layer(text, [x.shape], phase="train")
    assert train.training and train.mode_phase == "train"
    assert torch.equal(train.eval()(x)[0], x) and train.phase == "train"  # Caffe's TEST: identity
    test = make_layer(text, [x.shape], phase="test")
    assert not test.training and torch.equal(test(x)[0], x)
    test.train().generator = torch.Generator().manual_seed(4)  # Caffe's TRAIN: inverted dropout
    (y,) = test(x)
    mask = test.last_mask
    assert 0 < int(mask.sum()) < mask.numel()
    assert torch.equal(y, torch.where(mask, x * (1.0 / 0.75), torch.zeros_like(x)))
    test.phase = "test"  # assigning the phase re-initialises the mode from it
    assert not test.training and torch.equal(test(x)[0], x)


def test_relu_default_slope_and_gradient_at_zero():
    relu = make_layer('type: "ReLU"', [(5,)])
    x = torch.tensor([-2.0, -0.0, 0.0, 0.5, 3.0], requires_grad=True)
    (y,) = relu(x)
    assert y.tolist() == [0.0, 0.0, 0.0, 0.5, 3.0]
    (g,) = torch.autograd.grad(y.sum(), x)
    assert g.tolist() == [0.0, 0.0, 0.0, 1.0, 1.0]  # Caffe: x > 0 ? 1 : slope


@pytest.mark.parametrize("slope", [0.0, 0.25])
def test_relu_diff_takes_the_layout_of_its_channels_last_bottom(slope):
    """``--channels-last``: a Concat's backward hands each branch a channel slice of an NHWC diff (strided); the
    ReLU diff comes back NHWC like the bottom (not NCHW, which PyTorch's strided loops and the convolution's
    conversion then pay for), with the values of the NCHW computation."""
    relu = make_layer(f'type: "ReLU" relu_param {{ negative_slope: {slope} }}', [(2, 3, 4, 5)])
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 4, 5, generator=gen)
    x[0, 0, 0, :2] = 0.0
    concat_diff = torch.randn(2, 8, 4, 5, generator=gen).contiguous(memory_format=torch.channels_last)
    dy = concat_diff[:, 2:5]  # what Concat's backward passes to this branch
    assert not dy.is_contiguous() and not dy.is_contiguous(memory_format=torch.channels_last)
    results = []
    for layout in (torch.contiguous_format, torch.channels_last):
        xt = x.contiguous(memory_format=layout).requires_grad_()
        (y,) = relu(xt)
        (dx,) = torch.autograd.grad(y, xt, dy)
        assert dx.is_contiguous(memory_format=layout)
        results.append(dx.contiguous())
    expected = torch.where(x > 0, dy, slope * dy)
    assert torch.equal(results[0], expected) and torch.equal(results[1], expected)


def test_prelu_default_filler_is_0_25_and_custom_filler_applies():
    port = make_layer('type: "PReLU"', [(2, 3, 4)])
    port.fill(torch.Generator().manual_seed(0))
    assert port.slope.shape == (3,) and torch.all(port.slope == 0.25)
    custom = make_layer('type: "PReLU" prelu_param { filler { type: "constant" value: -0.5 } channel_shared: true }',
                        [(2, 3)])
    custom.fill()
    assert custom.slope.shape == () and custom.slope.item() == -0.5
    x = torch.tensor([[1.0, -2.0, 0.0]])
    assert custom(x)[0].tolist() == [[1.0, 1.0, 0.0]]


@pytest.mark.parametrize("ratio", [1.0, 1.5, -0.5])
def test_dropout_ratio_is_checked_only_by_a_train_forward(ratio):
    """dropout_layer.cpp checks the ratio with DCHECKs only (gone in a release build): the layer builds, TEST
    is the identity; TRAIN's caffe_rng_bernoulli(1 - ratio) CHECKs 0 <= p <= 1, and ratio 1 gives
    x · 0 · (1 / 0) = NaN."""
    x = torch.tensor([[1.0, -2.0, 0.0, 3.5]])
    text = f'type: "Dropout" dropout_param {{ dropout_ratio: {ratio} }}'
    assert torch.equal(make_layer(text, [x.shape], phase="test")(x)[0], x)
    train = make_layer(text, [x.shape], phase="train")
    if ratio == 1.0:
        assert torch.isnan(train(x)[0]).all()
    else:
        with pytest.raises(FormatError, match="caffe_rng_bernoulli"):
            train(x)


def test_log_constants_are_caffes_dtype_arithmetic():
    """log_layer.cpp (and exp_layer.cpp, next test) LayerSetUp: ``log_base = log(base)``, ``base_scale_ =
    1 / log_base``, ``backward_num_scale_ = scale / log_base``, ``inner_scale_ = log_base · scale``,
    ``outer_scale_ = pow(base, shift)``, each a Dtype operation.  In float, base 10 gives base_scale_
    0.43429446 (1 / float(ln 10)), one ulp below float(1 / ln 10) = 0.4342945."""
    f = np.float32
    log_base = f(math.log(10.0))
    base_scale, num_scale = f(1) / log_base, f(0.5) / log_base
    assert base_scale != f(1 / math.log(10.0))
    x = torch.tensor([0.5, 2.0, 10.0, 1234.5], requires_grad=True)
    (y,) = make_layer('type: "Log" log_param { base: 10 }', [(4,)])(x)
    assert torch.equal(y, torch.log(x.detach()) * torch.tensor(base_scale))
    (z,) = make_layer('type: "Log" log_param { base: 10 scale: 0.5 }', [(4,)])(x)
    (gx,) = torch.autograd.grad(z.sum(), x)
    assert torch.equal(gx, (x.detach() * f(0.5)).reciprocal() * torch.tensor(num_scale))
    for text in ("log_param { base: 1 }", "log_param { base: inf }", "log_param { base: nan }"):
        with pytest.raises(FormatError, match="base"):  # 1/log(1) = inf, log(inf) = inf, nan > 0 is false
            make_layer(f'type: "Log" {text}', [(4,)])


def test_exp_constants_are_caffes_dtype_arithmetic():
    f = np.float32
    x = torch.tensor([0.5, 2.0, 10.0, 1234.5])
    inner = f(math.log(f(10))) * f(0.3)  # float(ln 10) · 0.3 in float: 0.6907756, float(0.3 ln 10) 0.6907755
    assert inner != f(0.3 * math.log(10.0))
    (e,) = make_layer('type: "Exp" exp_param { base: 10 scale: 0.3 shift: 3 }', [(4,)])(x)
    assert torch.equal(e, torch.exp(x * torch.tensor(inner)) * torch.tensor(f(1000)))
    for text in ("exp_param { base: inf }", "exp_param { base: nan }"):
        with pytest.raises(FormatError, match="base"):
            make_layer(f'type: "Exp" {text}', [(4,)])


def test_prelu_refuses_more_than_4_axes():
    # prelu_layer.cpp reads C with the legacy channels(): CHECK_LE(num_axes(), 4), in LayerSetUp and Forward
    with pytest.raises(FormatError, match="legacy accessors"):
        make_layer('type: "PReLU"', [(2, 3, 1, 1, 1)])
    port = make_layer('type: "PReLU"', [(2, 3, 1, 1)])
    with pytest.raises(FormatError, match="legacy accessors"):
        port(torch.zeros(2, 3, 1, 1, 1))


def test_prelu_rejects_one_axis_bottom():
    with pytest.raises(FormatError, match="PReLU needs a bottom with >= 2 axes"):
        make_layer('type: "PReLU"', [(5,)])


def test_power_zero_scale_and_zero_power_are_constants():
    x = torch.randn(4, requires_grad=True)
    (y,) = make_layer('type: "Power" power_param { power: 2 scale: 0 shift: 3 }', [(4,)])(x)
    assert y.tolist() == [9.0] * 4
    (y0,) = make_layer('type: "Power" power_param { power: 0 scale: 2 shift: 3 }', [(4,)])(x)
    assert y0.tolist() == [1.0] * 4


def test_exp_and_log_closed_forms():
    x64 = np.linspace(-1.5, 2.0, 9)
    x = torch.tensor(x64, dtype=torch.float64)
    (y,) = make_layer('type: "Exp" exp_param { base: 3 scale: 0.5 shift: -0.25 }', [(9,)])(x)
    np.testing.assert_allclose(y.numpy(), 3.0 ** (-0.25 + 0.5 * x64), rtol=1e-13)
    (z,) = make_layer('type: "Log" log_param { base: 2 scale: 0.5 shift: 1.75 }', [(9,)])(x)
    np.testing.assert_allclose(z.numpy(), np.log2(1.75 + 0.5 * x64), rtol=1e-13)
    (ln,) = make_layer('type: "Log"', [(3,)])(torch.tensor([1.0, math.e, 10.0], dtype=torch.float64))
    np.testing.assert_allclose(ln.numpy(), [0.0, 1.0, math.log(10.0)], rtol=1e-15)
    with pytest.raises(FormatError, match="base must be strictly positive"):
        make_layer('type: "Exp" exp_param { base: -2 }', [(3,)])


def test_bnll_is_stable_for_large_inputs():
    x = torch.tensor([-80.0, -20.0, 0.0, 20.0, 100.0], requires_grad=True)
    (y,) = make_layer('type: "BNLL"', [(5,)])(x)
    expected = [math.log1p(math.exp(-80.0)), math.log1p(math.exp(-20.0)), math.log(2.0), 20.0 + math.log1p(math.exp(-20.0)), 100.0]
    np.testing.assert_allclose(y.detach().numpy(), expected, rtol=1e-6)
    (g,) = torch.autograd.grad(y.sum(), x)
    np.testing.assert_allclose(g.numpy(), [1.0 / (1.0 + math.exp(80.0)), 1.0 / (1.0 + math.exp(20.0)), 0.5, 1.0, 1.0],
                               rtol=1e-6)


def test_swish_and_clip_closed_forms():
    x64 = np.linspace(-3.0, 3.0, 13)
    x = torch.tensor(x64, requires_grad=True)
    (y,) = make_layer('type: "Swish" swish_param { beta: 1.5 }', [(13,)])(x)
    np.testing.assert_allclose(y.detach().numpy(), x64 / (1.0 + np.exp(-1.5 * x64)), rtol=1e-13)
    (c,) = make_layer('type: "Clip" clip_param { min: -1 max: 1.5 }', [(13,)])(x)
    np.testing.assert_allclose(c.detach().numpy(), np.clip(x64, -1.0, 1.5), rtol=0)
    edge = torch.tensor([-1.0, 1.5, -1.01, 1.51], requires_grad=True)
    (ce,) = make_layer('type: "Clip" clip_param { min: -1 max: 1.5 }', [(4,)])(edge)
    (g,) = torch.autograd.grad(ce.sum(), edge)
    assert g.tolist() == [1.0, 1.0, 0.0, 0.0]  # Caffe: x >= min && x <= max
    with pytest.raises(FormatError, match="clip_param.min and clip_param.max"):
        make_layer('type: "Clip" clip_param { min: 0 }', [(3,)])


@pytest.mark.parametrize("text", [
    'type: "Power" power_param { power: 1.5 scale: 2.0 shift: 0.5 }',
    'type: "Power" power_param { power: -0.7 scale: 0.5 shift: 3.0 }',
    'type: "BNLL"',
    'type: "ELU" elu_param { alpha: 0.7 }',
    'type: "Exp" exp_param { base: 2.0 scale: 0.5 shift: -0.2 }',
    'type: "Swish" swish_param { beta: 0.8 }',
])
def test_gradcheck_float64(text):
    x = (torch.rand(3, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 2 + 0.05)
    x = x.requires_grad_()
    port = make_layer(text, [x.shape])
    assert torch.autograd.gradcheck(lambda t: port(t)[0], (x,))


def test_prelu_per_channel_values_and_slope_gradient_float64():
    port = make_layer('type: "PReLU"', [(2, 3, 5)]).double()
    with torch.no_grad():
        port.slope.copy_(torch.tensor([0.25, -0.4, 0.7], dtype=torch.float64))
    x = torch.randn(2, 3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(4)).requires_grad_()
    (y,) = port(x)
    xd, a = x.detach().numpy(), np.array([0.25, -0.4, 0.7]).reshape(1, 3, 1)
    np.testing.assert_array_equal(y.detach().numpy(), np.where(xd > 0, xd, a * xd))
    gx, gs = torch.autograd.grad(y.sum(), (x, port.slope))
    np.testing.assert_array_equal(gx.numpy(), np.where(xd > 0, 1.0, a + 0 * xd))
    np.testing.assert_allclose(gs.numpy(), np.where(xd <= 0, xd, 0.0).sum(axis=(0, 2)), rtol=1e-12)
    assert torch.autograd.gradcheck(lambda t: port(t)[0], (x,))


def test_exp_shift_overflowing_is_caffes_inf():
    """``exp_param { shift: 1e30 }``: Caffe's float ``pow(base, shift)`` is inf; math.exp raised OverflowError."""
    port = make_layer('type: "Exp" exp_param { shift: 1e30 }', [(2, 3)])
    (y,) = port(torch.zeros(2, 3))
    assert torch.isinf(y).all()


@pytest.mark.parametrize("shift, power, expected", [(-2.0, 0.5, math.nan), (0.0, -1.0, math.inf),
                                                     (1e30, 1e10, math.inf), (3.0, 2.0, 9.0)])
def test_power_with_scale_zero_is_caffes_pow_of_the_shift(shift, power, expected):
    """``scale: 0``: every top is ``pow(shift, power)`` as Caffe's float pow gives it (NaN, inf); math.pow raised
    ValueError (math domain error) or OverflowError at the forward."""
    port = make_layer(f'type: "Power" power_param {{ power: {power} scale: 0 shift: {shift} }}', [(2, 3)])
    (y,) = port(torch.zeros(2, 3))
    np.testing.assert_array_equal(y.numpy(), np.full((2, 3), expected, np.float32))


def test_prelu_fed_fewer_channels_uses_the_first_slopes_as_caffe():
    """prelu_layer.cpp's Reshape checks no channel count and its loops index ``slope[c]`` for the bottom's
    ``c``: fewer channels than at setup use the first slopes (the others get a zero diff); more would read
    past the blob and are refused, naming the layer."""
    port = make_layer('name: "p" type: "PReLU"', [(2, 3, 2, 2)])
    with torch.no_grad():
        port.slope.copy_(torch.tensor([0.5, -2.0, 7.0]))
    x = torch.tensor([[[[1.0, -1.0], [-3.0, 0.0]], [[-2.0, 2.0], [0.0, -0.5]]]]).repeat(2, 1, 1, 1)
    (y,) = port(x)
    expected = torch.tensor([[[[1.0, -0.5], [-1.5, 0.0]], [[4.0, 2.0], [0.0, 1.0]]]]).repeat(2, 1, 1, 1)
    assert torch.equal(y, expected)
    y.sum().backward()
    assert port.slope.grad.tolist() == [2 * (-1.0 - 3.0 + 0.0), 2 * (-2.0 + 0.0 - 0.5), 0.0]
    with pytest.raises(ShapeMismatchError, match="layer 'p' \\(PReLU\\): the bottom has 4 channels, the slope blob 3"):
        port(torch.zeros(2, 4, 2, 2))
    with pytest.raises(ShapeMismatchError, match="layer 'p' \\(PReLU\\).*>= 2 axes"):
        port(torch.zeros(3))

"""BatchNorm, Scale, Bias, MVN and LRN against real Caffe (layer_zoo), closed forms and gradcheck."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from caffe_compat.errors import FormatError
from tests.layers.zoo_single_layer import Zoo, assert_matches, make_layer, run_and_compare


@pytest.fixture(scope="module")
def zoo():
    return Zoo("layer_zoo")


@pytest.mark.parametrize("layer", ["bn_zero_factor", "bias_ch_h", "scale2", "bias2", "mvn", "mvn_across_mean_only",
                                   "mvn_across_eps", "lrn_within"])
def test_layer_matches_caffe_forward_and_backward(zoo, layer):
    errors = run_and_compare(zoo, layer)
    assert max(errors.values()) < 1e-6


def test_batchnorm_zero_factor_divides_by_sqrt_eps(zoo):
    x = zoo.blobs[zoo.bottom_keys("bn_zero_factor")[0]].astype(np.float64)
    assert zoo.params["bn_zero_factor:2"][0] == 0.0
    np.testing.assert_allclose(zoo.blobs["bn_zero_factor"], x / np.sqrt(1e-5), rtol=1e-6)
    port = zoo.build("bn_zero_factor")
    assert [b.requires_grad for b in port.caffe_blobs()] == [False, False, False]
    assert not any(np.any(zoo.grads[f"param_diff:bn_zero_factor:{i}"]) for i in range(3))


def test_batchnorm_then_in_place_scale_matches_caffe(zoo):
    # bn and bn_scale share the blob "bn" (an output of the net): the stored data is the Scale output
    # and the stored diff is the random diff injected as that output's top diff.
    bn, scale = zoo.build("bn"), zoo.build("bn_scale")
    (x,) = zoo.bottoms("bn")
    (normalised,) = bn(x)
    (out,) = scale(normalised)
    assert_matches(out, zoo.blobs["bn"], what="bn -> bn_scale forward")
    top_diff = torch.from_numpy(zoo.grads["diff:bn"])
    gx, g_gamma, g_beta = torch.autograd.grad(out, [x, scale.scale, scale.bias], top_diff)
    assert_matches(gx, zoo.grads[f"diff:{zoo.bottom_keys('bn')[0]}"], what="bn bottom diff")
    assert_matches(g_gamma, zoo.grads["param_diff:bn_scale:0"], what="bn_scale gamma diff")
    assert_matches(g_beta, zoo.grads["param_diff:bn_scale:1"], what="bn_scale beta diff")
    assert zoo.params["bn:2"][0] == 0.5  # global stats divided by the factor 0.5
    assert not any(np.any(zoo.grads[f"param_diff:bn:{i}"]) for i in range(3))


def test_lrn_across_then_in_place_prelu_matches_caffe(zoo):
    # lrn_across is rewritten in place by prelu_ch; the blob is a net output, so its stored diff is the
    # injected top diff of the chain.
    lrn, prelu = zoo.build("lrn_across"), zoo.build("prelu_ch")
    (x,) = zoo.bottoms("lrn_across")
    (normalised,) = lrn(x)
    (out,) = prelu(normalised)
    assert_matches(out, zoo.blobs["lrn_across"], what="lrn_across -> prelu_ch forward")
    top_diff = torch.from_numpy(zoo.grads["diff:lrn_across"])
    gx, g_slope = torch.autograd.grad(out, [x, prelu.slope], top_diff)
    assert_matches(g_slope, zoo.grads["param_diff:prelu_ch:0"], what="prelu_ch slope diff")
    # Caffe quirk: LRN's backward reads its *top data*, which the in-place PReLU has overwritten with
    # PReLU(y).  Where every channel of the LRN window has y > 0 the two coincide and the port matches;
    # elsewhere Caffe's gradient is the one computed from the clobbered top (checked in float64 below).
    reference = zoo.grads[f"diff:{zoo.bottom_keys('lrn_across')[0]}"]
    y = normalised.detach().double().numpy()
    negative = np.pad((y <= 0).astype(np.int64), ((0, 0), (1, 1), (0, 0), (0, 0)))
    clean = (negative[:, :-2] + negative[:, 1:-1] + negative[:, 2:]) == 0
    assert clean.mean() > 0.1 and (~clean).mean() > 0.1
    assert_matches(gx.numpy()[clean], reference[clean], what="lrn_across bottom diff (unclobbered windows)")
    assert np.max(np.abs(gx.numpy() - reference)) > 1e-3
    np.testing.assert_allclose(_lrn_backward_with_clobbered_top(zoo, y), reference, rtol=1e-5, atol=1e-6)


def _lrn_backward_with_clobbered_top(zoo, y):
    """float64 transcription of Caffe's LRNLayer::CrossChannelBackward_cpu reading PReLU(y) as top."""
    x = zoo.blobs[zoo.bottom_keys("lrn_across")[0]].astype(np.float64)
    n, alpha, beta, k, channels = 3, 0.5, 0.6, 1.5, x.shape[1]
    pad = ((0, 0), (1, 1), (0, 0), (0, 0))
    squares = np.pad(x * x, pad)
    scale = k + alpha / n * sum(squares[:, i:i + channels] for i in range(n))
    slope = zoo.params["prelu_ch:0"].reshape(1, -1, 1, 1).astype(np.float64)
    top_data = np.where(y > 0, y, slope * y)  # the in-place PReLU output
    top_diff = zoo.grads["diff:lrn_across"] * np.where(y > 0, 1.0, slope)  # PReLU backward
    ratio = np.pad(top_diff * top_data / scale, pad)
    accumulated = sum(ratio[:, i:i + channels] for i in range(n))
    return top_diff * scale ** -beta - 2.0 * alpha * beta / n * x * accumulated


def test_lrn_within_channel_ignores_k():
    x = torch.randn(2, 3, 5, 4, generator=torch.Generator().manual_seed(0))
    a = make_layer('type: "LRN" lrn_param { norm_region: WITHIN_CHANNEL local_size: 3 alpha: 0.3 beta: 0.7 k: 1 }',
                   [x.shape])(x)[0]
    b = make_layer('type: "LRN" lrn_param { norm_region: WITHIN_CHANNEL local_size: 3 alpha: 0.3 beta: 0.7 k: 5 }',
                   [x.shape])(x)[0]
    assert torch.equal(a, b)
    # By hand at a corner: the 3x3 window holds 4 in-range values and is still divided by 9.
    xd = x.double().numpy()
    window = (xd[0, 1, 0:2, 0:2] ** 2).sum() / 9.0
    expected = xd[0, 1, 0, 0] / (1 + float(np.float32(0.3)) * window) ** float(np.float32(0.7))
    assert abs(a[0, 1, 0, 0].item() - expected) < 1e-6 * abs(expected)


def test_lrn_across_channels_closed_form():
    x = torch.randn(2, 6, 3, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (y,) = make_layer('type: "LRN" lrn_param { local_size: 5 alpha: 0.5 beta: 0.6 k: 1.5 }', [x.shape])(x)
    xd, beta = x.numpy(), float(np.float32(0.6))  # prototxt floats are float32
    expected = np.empty_like(xd)
    for c in range(6):
        lo, hi = max(0, c - 2), min(6, c + 3)
        expected[:, c] = xd[:, c] / (1.5 + 0.5 / 5 * (xd[:, lo:hi] ** 2).sum(axis=1)) ** beta
    np.testing.assert_allclose(y.numpy(), expected, rtol=1e-13)


@pytest.mark.parametrize("samples_per_block", [1, 100])
@pytest.mark.parametrize("train", [False, True])
def test_lrn_across_channels_keeps_a_channels_last_bottom_in_its_layout(train, samples_per_block, monkeypatch):
    """``--channels-last``: an NHWC bottom gives an NHWC top and bottom diff (the neighbouring convolutions'
    layout), each element computed by the same operations in the same order as from an NCHW bottom."""
    from caffe_compat.layers import cache_blocking

    shape = (3, 7, 5, 6)
    monkeypatch.setattr(cache_blocking, "BLOCK_BYTES", samples_per_block * int(np.prod(shape[1:])) * 4)
    port = make_layer('type: "LRN" lrn_param { local_size: 5 alpha: 0.5 beta: 0.75 k: 1.5 }', [shape])
    gen = torch.Generator().manual_seed(3)
    x, dy = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    results = []
    for layout in (torch.contiguous_format, torch.channels_last):
        xt = x.contiguous(memory_format=layout).requires_grad_(train)
        with torch.set_grad_enabled(train):
            (top,) = port(xt)
        assert top.is_contiguous(memory_format=layout)
        if not train:
            results.append((top.contiguous(),))
            continue
        (dx,) = torch.autograd.grad(top, xt, dy.contiguous(memory_format=layout))
        assert dx.is_contiguous(memory_format=layout)
        results.append((top.detach().contiguous(), dx.contiguous()))
    for nchw, nhwc in zip(*results):
        assert torch.equal(nhwc, nchw)


def test_lrn_rejects_even_size_and_non_4d():
    with pytest.raises(FormatError, match="odd local_size"):
        make_layer('type: "LRN" lrn_param { local_size: 4 }', [(1, 3, 4, 4)])
    with pytest.raises(FormatError, match="4-axis"):
        make_layer('type: "LRN"', [(3, 4)])


def _bn_reference(x, mean_blob, var_blob, factor, lam, eps):
    """float64 transcription of Caffe's BatchNorm TRAIN forward (with the statistic updates)."""
    axes = (0, 2, 3)
    mean = x.mean(axis=axes)
    var = ((x - mean.reshape(1, -1, 1, 1)) ** 2).mean(axis=axes)
    m = x.size // x.shape[1]
    y = (x - mean.reshape(1, -1, 1, 1)) / np.sqrt(var.reshape(1, -1, 1, 1) + eps)
    return y, lam * mean_blob + mean, lam * var_blob + m / (m - 1) * var, lam * factor + 1


def test_batchnorm_train_updates_statistics_like_caffe():
    text = 'type: "BatchNorm" batch_norm_param { moving_average_fraction: 0.9 eps: 0.001 }'
    port = make_layer(text, [(4, 3, 2, 5)], phase="train").double()
    assert not port.use_global_stats
    rng = np.random.RandomState(5)
    mean_blob, var_blob, factor = np.zeros(3), np.zeros(3), 0.0
    lam, eps = float(np.float32(0.9)), float(np.float32(0.001))  # prototxt floats are float32
    for step in range(2):
        x = rng.randn(4, 3, 2, 5) * (step + 2) + step
        (y,) = port(torch.from_numpy(x))
        y_ref, mean_blob, var_blob, factor = _bn_reference(x, mean_blob, var_blob, factor, lam, eps)
        np.testing.assert_allclose(y.numpy(), y_ref, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(port.mean.numpy(), mean_blob, rtol=1e-12)
        np.testing.assert_allclose(port.variance.numpy(), var_blob, rtol=1e-12)
        np.testing.assert_allclose(port.scale_factor.numpy(), [factor], rtol=1e-12)
    # The same blobs in TEST phase: global statistics = blob / factor.
    port.phase = "test"
    assert port.use_global_stats
    x = rng.randn(2, 3, 2, 5)
    (y,) = port(torch.from_numpy(x))
    mean, var = (mean_blob / factor).reshape(1, -1, 1, 1), (var_blob / factor).reshape(1, -1, 1, 1)
    np.testing.assert_allclose(y.numpy(), (x - mean) / np.sqrt(var + eps), rtol=1e-12)


def test_batchnorm_explicit_use_global_stats_overrides_phase():
    port = make_layer('type: "BatchNorm" batch_norm_param { use_global_stats: false }', [(2, 3)], phase="test")
    assert not port.use_global_stats
    assert make_layer('type: "BatchNorm"', [(2, 3)], phase="test").use_global_stats
    assert [tuple(b.shape) for b in port.caffe_blobs()] == [(3,), (3,), (1,)]


def test_batchnorm_follows_the_torch_mode_unless_use_global_stats_is_explicit():
    rng = np.random.RandomState(3)
    x = torch.from_numpy(rng.randn(4, 3, 2, 5))
    lam, eps = float(np.float32(0.9)), float(np.float32(0.001))
    text = 'type: "BatchNorm" batch_norm_param { moving_average_fraction: 0.9 eps: 0.001 }'
    blobs = np.array([1.0, -2.0, 3.0]), np.array([8.0, 2.0, 4.0]), 2.0
    # A TEST port switched to train(): batch statistics and Caffe's moving-average update.
    port = make_layer(text, [x.shape], phase="test").double()
    assert port.use_global_stats
    with torch.no_grad():
        port.mean.copy_(torch.from_numpy(blobs[0])), port.variance.copy_(torch.from_numpy(blobs[1]))
        port.scale_factor.fill_(blobs[2])
    port.train()
    assert not port.use_global_stats and port.phase == "test"
    (y,) = port(x)
    y_ref, mean_blob, var_blob, factor = _bn_reference(x.numpy(), *blobs, lam, eps)
    np.testing.assert_allclose(y.numpy(), y_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(port.mean.numpy(), mean_blob, rtol=1e-12)
    np.testing.assert_allclose(port.variance.numpy(), var_blob, rtol=1e-12)
    np.testing.assert_allclose(port.scale_factor.numpy(), [factor], rtol=1e-12)
    # ... and back to eval(): the stored global statistics, blobs untouched.
    port.eval()
    (y,) = port(x)
    mean, var = (mean_blob / factor).reshape(1, -1, 1, 1), (var_blob / factor).reshape(1, -1, 1, 1)
    np.testing.assert_allclose(y.numpy(), (x.numpy() - mean) / np.sqrt(var + eps), rtol=1e-12)
    np.testing.assert_allclose(port.scale_factor.numpy(), [factor], rtol=1e-12)
    # An explicit use_global_stats keeps its value in both modes (as in Caffe).
    for value in ("true", "false"):
        for phase in ("train", "test"):
            fixed = make_layer(f'type: "BatchNorm" batch_norm_param {{ use_global_stats: {value} }}', [(2, 3)], phase)
            assert fixed.train().use_global_stats == (value == "true")
            assert fixed.eval().use_global_stats == (value == "true")


def test_scale_blob_shapes_fillers_and_order():
    one = make_layer('type: "Scale" scale_param { axis: 1 num_axes: -1 bias_term: true '
                     'bias_filler { type: "constant" value: 0.5 } }', [(2, 3, 4)])
    assert [tuple(b.shape) for b in one.caffe_blobs()] == [(3, 4), (3, 4)]
    one.fill(torch.Generator().manual_seed(0))
    assert torch.all(one.scale == 1.0) and torch.all(one.bias == 0.5)
    scalar = make_layer('type: "Scale" scale_param { num_axes: 0 filler { type: "constant" value: 3 } }', [(2, 3)])
    scalar.fill()
    assert scalar.scale.shape == () and torch.equal(scalar(torch.ones(2, 3))[0], torch.full((2, 3), 3.0))
    two = make_layer('type: "Scale" bottom: "a" bottom: "b" scale_param { axis: 0 bias_term: true }', [(2, 3, 4), (2, 3)])
    assert [tuple(b.shape) for b in two.caffe_blobs()] == [(2, 3)]  # two bottoms: blob 0 is the bias
    with pytest.raises(FormatError, match="second bottom shape"):
        make_layer('type: "Scale" bottom: "a" bottom: "b"', [(2, 3, 4), (2, 3)])
    bias = make_layer('type: "Bias" bias_param { axis: -1 }', [(2, 3, 4)])
    assert bias.bias.shape == (4,)
    with pytest.raises(FormatError, match="exceeds"):
        make_layer('type: "Bias" bias_param { axis: 2 num_axes: 2 }', [(2, 3, 4)])


def test_scalar_second_bottom_ignores_the_axis_and_a_0_axis_bottom_needs_one():
    """scale_layer.cpp / bias_layer.cpp Reshape: ``axis_ = scale->num_axes() == 0 ? 0 :
    CanonicalAxisIndex(axis)``, and LayerSetUp canonicalises the axis only for a learned blob (one bottom), or
    in Scale's inner BiasLayer (bias_term), which is set up on bottom 0 alone."""
    x, s = torch.tensor([1.0, -2.0, 3.5]), torch.tensor(4.0)
    for kind, expected in (("Scale", x * 4.0), ("Bias", x + 4.0)):
        for axis in ("", f"{kind.lower()}_param {{ axis: 5 }}"):  # default axis 1 is out of range for (3,) too
            port = make_layer(f'type: "{kind}" bottom: "x" bottom: "s" {axis}', [(3,), ()])
            assert port.output_shapes() == [(3,)] and torch.equal(port(x, s)[0], expected)
        scalar_bottoms = make_layer(f'type: "{kind}" bottom: "x" bottom: "s"', [(), ()])
        assert torch.equal(scalar_bottoms(s, s)[0], s * s if kind == "Scale" else s + s)
        with pytest.raises(FormatError, match="out of range for a 0-axis blob"):  # learned blob: CHECKed axis
            make_layer(f'type: "{kind}" {kind.lower()}_param {{ num_axes: 0 }}', [()])
    with pytest.raises(FormatError, match="scale_param.axis 1 is out of range for a 1-axis blob"):
        make_layer('type: "Scale" bottom: "x" bottom: "s" scale_param { bias_term: true }', [(3,), ()])


@pytest.mark.parametrize("shape", [(2, 0, 4, 4), (0, 3, 4, 4)])
def test_batch_norm_with_no_sample_or_no_channel_is_a_format_error(shape):
    # BatchNormLayer::Reshape: spatial_dim = count / (channels_ * shape(0)), an int division by zero (we raised
    # ZeroDivisionError in a TRAIN forward)
    with pytest.raises(FormatError, match="N·C = 0"):
        make_layer('type: "BatchNorm"', [shape], phase="train")


def test_mvn_backward_is_caffes_formula_not_the_exact_derivative():
    x = torch.randn(2, 3, 4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(2)).requires_grad_()
    dy = torch.randn(2, 3, 4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    port = make_layer('type: "MVN" mvn_param { eps: 0.5 }', [x.shape])
    (y,) = port(x)
    (gx,) = torch.autograd.grad(y, x, dy)
    xd, g = x.detach().numpy().reshape(6, -1), dy.numpy().reshape(6, -1)
    c = xd - xd.mean(1, keepdims=True)
    std = np.sqrt((c * c).mean(1, keepdims=True))
    yd = c / (std + 0.5)
    np.testing.assert_allclose(y.detach().numpy().reshape(6, -1), yd, rtol=1e-13)
    caffe = (g - g.mean(1, keepdims=True) - yd * (g * yd).mean(1, keepdims=True)) / (std + 0.5)
    np.testing.assert_allclose(gx.numpy().reshape(6, -1), caffe, rtol=1e-10, atol=1e-12)
    exact = (g - g.mean(1, keepdims=True) - yd * (std + 0.5) / std * (g * yd).mean(1, keepdims=True)) / (std + 0.5)
    assert np.max(np.abs(caffe - exact)) > 1e-3


def test_mvn_top_has_caffes_legacy_four_axes():
    # MVNLayer::Reshape: top->Reshape(num(), channels(), height(), width()), legacy accessors (1 for a missing
    # axis, CHECK-fail above 4 axes): an (N, D) bottom, e.g. after an InnerProduct, gives an (N, D, 1, 1) top.
    x = torch.tensor([[1.0, 2.0, 3.0, 6.0], [0.0, 0.0, 4.0, 4.0]], dtype=torch.float64)
    port = make_layer('type: "MVN" mvn_param { normalize_variance: false }', [x.shape])
    assert port.output_shapes() == [(2, 4, 1, 1)]
    (y,) = port(x)
    assert y.shape == (2, 4, 1, 1)
    # per (sample, channel) over height·width = 1 value: x - mean = 0; across channels: over the 4 values
    assert y.abs().max().item() == 0.0
    across = make_layer('type: "MVN" mvn_param { normalize_variance: false across_channels: true }', [x.shape])
    assert across(x)[0].flatten().tolist() == [-2.0, -1.0, 0.0, 3.0, -2.0, -2.0, 2.0, 2.0]
    assert make_layer('type: "MVN"', [(2, 3, 5)]).output_shapes() == [(2, 3, 5, 1)]
    with pytest.raises(FormatError, match="> 4 axes"):
        make_layer('type: "MVN"', [(1, 2, 3, 4, 5)])


@pytest.mark.parametrize("text", [
    'type: "LRN" lrn_param { local_size: 3 alpha: 0.5 beta: 0.6 k: 1.5 }',
    'type: "LRN" lrn_param { local_size: 5 alpha: 2 beta: 0.75 k: 0.5 }',  # Caffe's backward formula
    'type: "LRN" lrn_param { norm_region: WITHIN_CHANNEL local_size: 3 alpha: 0.3 beta: 0.7 k: 3 }',
    'type: "MVN"',
    'type: "MVN" mvn_param { across_channels: true }',
    'type: "MVN" mvn_param { normalize_variance: false }',
    'type: "BatchNorm" batch_norm_param { eps: 0.001 }',
])
def test_gradcheck_float64(text):
    x = torch.randn(3, 4, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(7)).requires_grad_()
    port = make_layer(text, [x.shape], phase="train").double()
    assert torch.autograd.gradcheck(lambda t: port(t)[0], (x,))


def test_gradcheck_two_bottom_scale_and_bias_float64():
    x = torch.randn(2, 3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(8)).requires_grad_()
    s = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(9)).requires_grad_()
    scale = make_layer('type: "Scale" bottom: "x" bottom: "s"', [x.shape, s.shape])
    bias = make_layer('type: "Bias" bottom: "x" bottom: "s"', [x.shape, s.shape])
    assert torch.autograd.gradcheck(lambda a, b: scale(a, b)[0], (x, s))
    assert torch.autograd.gradcheck(lambda a, b: bias(a, b)[0], (x, s))


def _lrn_closed_form(x: np.ndarray, size: int, alpha: float, beta: float, k: float) -> np.ndarray:
    channels, half, out = x.shape[1], (size - 1) // 2, np.empty_like(x)
    for c in range(channels):
        lo, hi = max(0, c - half), min(channels, c + half + 1)
        out[:, c] = x[:, c] / (k + alpha / size * (x[:, lo:hi] ** 2).sum(axis=1)) ** beta
    return out


@pytest.mark.parametrize("size, beta", [(5, 0.75), (3, 0.5), (1, 1.0), (5, 0.6)])
def test_lrn_onnx_form_is_the_closed_form(size, beta):
    from caffe_compat.layers.normalization import _across_channels_for_onnx

    x = torch.randn(2, 7, 3, 4, generator=torch.Generator().manual_seed(size)) * 10
    alpha, k = 0.01, 1.5
    exact = _lrn_closed_form(x.double().numpy(), size, alpha, beta, k)
    np.testing.assert_allclose(_across_channels_for_onnx(x.double(), size, alpha, beta, k).numpy(), exact,
                               rtol=1e-13)
    # float32: the window's size + 1 roundings and α/n's (scale ≤ (size + 2)·u relative), at most β of it
    # in s^-β, plus the square roots, product and division (≤ 4 roundings): < (size + 6)·u relative
    got = _across_channels_for_onnx(x, size, alpha, beta, k).double().numpy()
    assert np.all(np.abs(got - exact) <= (size + 6) * 2.0 ** -24 * np.abs(exact))
    half = _across_channels_for_onnx(x.half(), size, alpha, beta, k).double().numpy()
    assert np.all(np.abs(half - exact) <= (size + 6) * 2.0 ** -11 * np.abs(exact) + 2.0 ** -24)


def test_lrn_exports_the_onnx_form_and_the_port_otherwise(monkeypatch):
    port = make_layer('type: "LRN" lrn_param { local_size: 5 alpha: 0.01 beta: 0.75 k: 2 }', [(2, 6, 3, 3)])
    x = torch.randn(2, 6, 3, 3, generator=torch.Generator().manual_seed(3)) * 10
    (eager,) = port(x)
    monkeypatch.setattr(torch.onnx, "is_in_onnx_export", lambda: True)
    (exported,) = port(x)
    assert not torch.equal(exported, eager)  # another summation order: the ONNX form ran
    assert torch.allclose(exported, eager, rtol=11 * 2.0 ** -24, atol=0)


def test_lrn_local_size_outside_caffes_int_is_a_format_error():
    """local_size 2^32 - 1 (Caffe's int reads -1, refused by its odd CHECK): the allocator's RuntimeError
    (4 TB) across channels, torch's int overflow within."""
    for region in ("ACROSS_CHANNELS", "WITHIN_CHANNEL"):
        with pytest.raises(FormatError, match="local_size 4294967295 must be at most 2147483647"):
            make_layer(f'type: "LRN" lrn_param {{ local_size: 4294967295 norm_region: {region} }}', [(1, 3, 4, 4)])


@pytest.mark.parametrize("size", [5, 7, 2147483647])
def test_lrn_window_wider_than_the_channels_sums_them_all(size):
    """A window of 2C - 1 channels or more covers every channel from each: ``local_size: 2147483647`` padded
    the squares by 2^30 channels each side (the allocator's RuntimeError) and looped 2^31 times."""
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64, requires_grad=True)
    port = make_layer(f'type: "LRN" lrn_param {{ local_size: {size} alpha: 0.5 beta: 0.75 k: 2 }}', [x.shape])
    (y,) = port.double()(x)
    ref = x * (2 + 0.5 / size * (x * x).sum(1, keepdim=True)) ** -0.75
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(torch.autograd.grad(y.sum(), x)[0], torch.autograd.grad(ref.sum(), x)[0])


@pytest.mark.parametrize("shape, across", [((0, 3, 4, 4), False), ((2, 0, 4, 4), False), ((0, 3, 4, 4), True)])
def test_mvn_with_no_row_is_a_format_error(shape, across):
    # MVNLayer::Forward_cpu: dim = count / num in int, num = N (across_channels) or N·C: 0 rows is a division by
    # zero in Caffe (we raised torch's RuntimeError on reshape(0, -1))
    with pytest.raises(FormatError, match="no row to normalise"):
        make_layer(f'type: "MVN" mvn_param {{ across_channels: {str(across).lower()} }}', [shape])


def test_mvn_across_channels_with_no_channel_gives_caffes_empty_top():
    # num = N = 2, dim = 0: Caffe's BLAS calls see an empty row and the top is (2, 0, 4, 4), count 0
    port = make_layer('type: "MVN" mvn_param { across_channels: true }', [(2, 0, 4, 4)])
    (y,) = port(torch.zeros(2, 0, 4, 4))
    assert y.shape == (2, 0, 4, 4)


@pytest.mark.parametrize("shape", [(2, 3, 0, 4), (2, 3, 4, 0)])
def test_lrn_within_channel_on_an_empty_plane_gives_caffes_empty_top(shape):
    # LRNLayer WITHIN_CHANNEL runs an inner AVE Pooling (kernel n, pad (n-1)/2): an empty plane pools to an
    # empty plane and the top is empty.  We raised torch's RuntimeError (avg_pool2d refuses H or W = 0).
    port = make_layer('type: "LRN" lrn_param { norm_region: WITHIN_CHANNEL }', [shape])
    x = torch.zeros(shape, requires_grad=True)
    (y,) = port(x)
    assert tuple(y.shape) == shape
    y.sum().backward()
    assert x.grad.shape == x.shape


def test_mvn_fed_an_empty_batch_at_run_time_is_a_shape_mismatch_error():
    # a net set up for (2, 3, 4, 4) and fed (0, 3, 4, 4): Caffe's Forward divides by num = 0 (we raised torch's
    # RuntimeError on reshape(0, -1))
    from caffe_compat.errors import ShapeMismatchError

    port = make_layer('type: "MVN"', [(2, 3, 4, 4)])
    with pytest.raises(ShapeMismatchError, match="no row to normalise"):
        port(torch.zeros(0, 3, 4, 4))



AFFINE_RUN_TIME = [  # (layer, second bottom's shape, the run-time value, a fed shape that passes, one that does not)
    ('type: "Scale"', None, 2.0, (3, 3, 2, 5), (2, 5, 4, 4)),
    ('type: "Scale" scale_param { bias_term: true }', None, 4.0, (3, 3, 2, 5), (2, 5, 4, 4)),
    ('type: "Scale" scale_param { axis: 2 num_axes: -1 }', None, 2.0, (1, 7, 4, 4), (2, 3, 4, 5)),
    ('type: "Bias"', None, 3.0, (3, 3, 2, 5), (2, 5, 4, 4)),
    ('type: "Scale" scale_param { bias_term: true }', (3,), 4.0, (3, 3, 2, 5), (2, 5, 4, 4)),
    ('type: "Bias"', (3,), 3.0, (3, 3, 2, 5), (2, 5, 4, 4)),
]


@pytest.mark.parametrize("layer, second, value, passes, fails", AFFINE_RUN_TIME)
@pytest.mark.parametrize("in_place", [False, True])
def test_scale_and_bias_fed_a_mismatched_bottom_at_run_time_are_a_shape_mismatch_error(layer, second, value, passes,
                                                                                        fails, in_place):
    """scale_layer.cpp / bias_layer.cpp Reshape, run before every Forward (Net::ForwardFromTo): CHECK_EQ(
    bottom[0]->shape(axis + i), blob->shape(i)) for each axis of the scale/bias blob (bottom 1 or the learned one).
    A net built for (2, 3, 4, 4) and fed other channels aborts in Caffe; we raised torch's broadcasting
    RuntimeError.  Another batch or plane still runs, with Caffe's numbers (every blob 2, the input 1)."""
    from caffe_compat.errors import ShapeMismatchError
    from caffe_compat.net import load_net

    inputs = [("x", (2, 3, 4, 4))] + ([("s", second)] if second else [])
    text = "\n".join(f'layer {{ name: "in_{n}" type: "Input" top: "{n}" input_param {{ shape {{ '
                     f'{" ".join(f"dim: {d}" for d in shape)} }} }} }}' for n, shape in inputs)
    top = "x" if in_place else "y"
    bottoms = 'bottom: "x"' + (' bottom: "s"' if second else "")
    net = load_net(text + f'\nlayer {{ name: "affine" {layer} {bottoms} top: "{top}" }}')
    for blob in net.layers[next(s.module_key for s in net.steps if s.name == "affine")].caffe_blobs():
        blob.data.fill_(2.0)
    extra = {"s": torch.full(second, 2.0)} if second else {}
    out = net.forward(x=torch.ones(passes), **extra)[top]  # Reshape accepts another batch or plane
    assert tuple(out.shape) == passes and bool((out == value).all())
    blob_shape = second or ((4, 4) if "axis: 2" in layer else (3,))
    with pytest.raises(ShapeMismatchError, match=rf"layer 'affine'.*{re.escape(str(blob_shape))}.*"
                                                 rf"{re.escape(str(fails))}"):
        net.forward(x=torch.ones(fails), **extra)


@pytest.mark.parametrize("layer", ['type: "Scale" scale_param { axis: -1 bias_term: true }',
                                   'type: "Bias" bias_param { axis: -1 }'])
def test_scale_and_bias_recompute_a_negative_axis_on_the_bottom_fed_at_run_time(layer):
    """scale_layer.cpp / bias_layer.cpp Reshape set ``axis_ = CanonicalAxisIndex(param.axis())`` on the bottom of
    every Forward: a net built for (2, 3, 4) with axis -1 (axis 2, a blob of shape (4,)) and fed a (5, 4) bottom
    broadcasts over its axis 1; we kept axis 2 from setup and refused it.  A bottom with too few axes for the
    parameter fails CanonicalAxisIndex's CHECK, a FormatError naming the field."""
    from caffe_compat.net import load_net

    net = load_net('layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 dim: 4 } } }\n'
                   f'layer {{ name: "affine" {layer} bottom: "x" top: "y" }}')
    port = net.layer("affine")
    with torch.no_grad():
        for blob in port.caffe_blobs():
            blob.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    x = torch.arange(20, dtype=torch.float32).reshape(5, 4)
    row = torch.tensor([1.0, 2.0, 3.0, 4.0])
    expected = x * row + row if "Scale" in layer else x + row
    assert torch.equal(net.forward(x=x)["y"], expected)
    field = "scale_param.axis" if "Scale" in layer else "bias_param.axis"
    with pytest.raises(FormatError, match=rf"layer 'affine': {field} -1 is out of range for a 0-axis blob"):
        net.forward(x=torch.tensor(1.0))

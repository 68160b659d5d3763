"""Caffe's fillers: exact values where Caffe's are deterministic, moments within sampling error otherwise."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from caffe_compat.errors import FormatError
from caffe_compat.layers.fillers import bilinear_kernel, fan_in_out, fill_blob, filler_parameter
from tests.layers.zoo_single_layer import make_layer

SHAPE = (64, 32, 3, 3)  # fan_in = 32*9 = 288, fan_out = 64*9 = 576, count = 18432
COUNT = math.prod(SHAPE)


def _fill(type_, shape=SHAPE, seed=0, **fields):
    blob = torch.empty(shape)
    fill_blob(blob, filler_parameter(type_, **fields), torch.Generator().manual_seed(seed))
    return blob.double().numpy()


def _assert_moments(values, mean, var):
    """Sample mean within 5 standard errors, sample variance within 5 standard errors (kurtosis-free
    bound sqrt(2/N) relative, generous for the uniform's lighter tails)."""
    n = values.size
    assert abs(values.mean() - mean) < 5 * math.sqrt(var / n), (values.mean(), mean)
    assert abs(values.var() / var - 1) < 5 * math.sqrt(2.0 / n), (values.var(), var)


def test_constant_and_missing_filler():
    assert np.all(_fill("constant", value=-1.25) == -1.25)
    blob = torch.full((3, 4), 7.0)
    fill_blob(blob, None)  # an unset weight_filler is Caffe's default FillerParameter: constant 0
    assert torch.all(blob == 0)


def test_uniform_bounds_and_moments():
    values = _fill("uniform", min=-2.0, max=3.0)
    assert values.min() >= -2.0 and values.max() < 3.0
    _assert_moments(values, 0.5, 25.0 / 12.0)


def test_gaussian_moments_and_sparse_keep_probability():
    _assert_moments(_fill("gaussian", mean=1.5, std=0.2), 1.5, 0.04)
    # sparse: each value survives with probability sparse / shape[0] (an IP weight: outputs x inputs).
    values = _fill("gaussian", shape=(50, 400), std=1.0, sparse=10)
    p = 10 / 50
    assert abs(np.mean(values != 0) - p) < 5 * math.sqrt(p * (1 - p) / values.size)
    with pytest.raises(FormatError, match="only supported by the gaussian"):
        _fill("uniform", sparse=3)


def test_fans_follow_caffes_legacy_num_and_channels():
    assert fan_in_out(SHAPE) == (288, 576)
    assert fan_in_out((10, 20)) == (20, 10)
    assert fan_in_out((7,)) == (1, 7)


@pytest.mark.parametrize("norm, n", [(0, 288), (1, 576), (2, 432)])  # FAN_IN, FAN_OUT, AVERAGE
def test_xavier_is_uniform_with_variance_one_over_n(norm, n):
    values = _fill("xavier", variance_norm=norm)
    bound = math.sqrt(3.0 / n)
    assert values.min() >= -bound and values.max() < bound
    assert values.max() > 0.99 * bound and values.min() < -0.99 * bound
    _assert_moments(values, 0.0, 1.0 / n)


@pytest.mark.parametrize("norm, n", [(0, 288), (1, 576), (2, 432)])
def test_msra_is_gaussian_with_variance_two_over_n(norm, n):
    _assert_moments(_fill("msra", variance_norm=norm), 0.0, 2.0 / n)


def test_positive_unitball_rows_sum_to_one():
    values = _fill("positive_unitball", shape=(6, 4, 5))
    assert np.all(values >= 0) and np.all(values <= 1)
    np.testing.assert_allclose(values.reshape(6, -1).sum(axis=1), np.ones(6), rtol=1e-6)


def test_bilinear_kernels_by_hand():
    # K = 4: f = 2, c = 3/4, weights 1 - |x/2 - 3/4| = 1/4, 3/4, 3/4, 1/4.
    w4 = np.array([0.25, 0.75, 0.75, 0.25])
    np.testing.assert_array_equal(bilinear_kernel(4).numpy(), np.outer(w4, w4))
    # K = 3: f = 2, c = 1/2, weights 1/2, 1, 1/2.
    values = _fill("bilinear", shape=(2, 1, 3, 3))
    w3 = np.array([0.5, 1.0, 0.5])
    for out in range(2):
        np.testing.assert_array_equal(values[out, 0], np.outer(w3, w3))
    with pytest.raises(FormatError, match="square"):
        _fill("bilinear", shape=(1, 1, 3, 4))
    with pytest.raises(FormatError, match="4 axes"):
        _fill("bilinear", shape=(3, 3))


def _caffe_bilinear(size, dtype):
    """BilinearFiller::Fill step by step in Dtype (numpy scalars round each operation): ``c`` is a double
    rounded to Dtype; ``x / f``, ``− c``, ``fabs`` (math.h's float overload), ``1 − ·`` and ``·`` are Dtype's."""
    f = int(np.ceil(size / 2.0))
    c = dtype((size - 1) / (2.0 * f))
    out = np.empty(size * size, dtype)
    for i in range(size * size):
        x, y = dtype(i % size), dtype((i // size) % size)
        out[i] = (dtype(1) - abs(x / dtype(f) - c)) * (dtype(1) - abs(y / dtype(f) - c))
    return out.reshape(size, size)


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 6, 9, 12, 16, 21, 32])
def test_bilinear_rounds_each_step_in_the_blobs_type(size):
    for dtype, torch_dtype in ((np.float32, torch.float32), (np.float64, torch.float64)):
        expected = _caffe_bilinear(size, dtype)
        assert expected.dtype == dtype
        np.testing.assert_array_equal(bilinear_kernel(size, torch_dtype).numpy(), expected)
        values = _fill("bilinear", shape=(2, 1, size, size)) if dtype is np.float32 else None
        if values is not None:
            np.testing.assert_array_equal(values, np.broadcast_to(expected, (2, 1, size, size)))


def test_bilinear_corner_of_a_5x5_kernel_is_float_arithmetic():
    # f = 3, c = float32(2/3) = 0.666666686..., so 1 − c = 0.333333313... (exact) and the corner is its
    # square rounded to float32, 0.1111110970...: below float32(1/9) = 0.1111111119..., which is what a double
    # computation rounded once gives
    one_minus_c = np.float32(1) - np.float32(2 / 3)
    assert bilinear_kernel(5)[0, 0].item() == one_minus_c * one_minus_c == np.float32(0.111111097)
    assert np.float32((1 - 2 / 3) ** 2) == np.float32(1 / 9) > one_minus_c * one_minus_c


def test_bilinear_upsampling_kernel_interpolates():
    # factor 2: kernel 4, stride 2, pad 1 (Caffe's recipe) upsamples a ramp to a ramp inside the border.
    kernel = bilinear_kernel(4).reshape(1, 1, 4, 4)
    ramp = torch.arange(5.0).reshape(1, 1, 1, 5).expand(1, 1, 5, 5)
    up = torch.nn.functional.conv_transpose2d(ramp, kernel, stride=2, padding=1)
    row = up[0, 0, 4, 1:-1].numpy()
    np.testing.assert_allclose(np.diff(row), 0.5 * np.ones(len(row) - 1), rtol=1e-6)


def test_same_seed_same_values_and_unknown_type():
    np.testing.assert_array_equal(_fill("msra", seed=3), _fill("msra", seed=3))
    assert not np.array_equal(_fill("msra", seed=3), _fill("msra", seed=4))
    with pytest.raises(FormatError, match="unknown filler type 'orthogonal'"):
        _fill("orthogonal")


def test_layer_default_fillers():
    scale = make_layer('type: "Scale" scale_param { bias_term: true }', [(2, 3)])
    bias = make_layer('type: "Bias"', [(2, 3)])
    embed = make_layer('type: "Embed" embed_param { input_dim: 4 num_output: 2 }', [(5,)])
    for port in (scale, bias, embed):
        with torch.no_grad():
            for blob in port.caffe_blobs():
                blob.fill_(9.0)
        port.fill(torch.Generator().manual_seed(0))
    assert torch.all(scale.scale == 1) and torch.all(scale.bias == 0)
    assert torch.all(bias.bias == 0)
    assert torch.all(embed.weight == 0) and torch.all(embed.bias == 0)  # Caffe: unset filler = constant 0
    xavier = make_layer('type: "Embed" embed_param { input_dim: 400 num_output: 300 weight_filler { type: "xavier" } }',
                        [(5,)])
    xavier.fill(torch.Generator().manual_seed(1))
    _assert_moments(xavier.weight.detach().double().numpy(), 0.0, 1.0 / 300)  # fan_in = count / 400


def test_gaussian_sparse_above_the_outputs_fails_like_caffe():
    """Caffe's GaussianFiller keeps each value with probability ``Dtype(sparse) / Dtype(shape[0])`` drawn by
    ``caffe_rng_bernoulli``, which CHECKs ``p <= 1``: ``sparse`` above the number of outputs aborts.  Before,
    ours kept every value (a dense gaussian) without a word."""
    with pytest.raises(FormatError, match=r"sparse=11 is more than the 10 outputs"):
        _fill("gaussian", shape=(10, 30), sparse=11)
    dense = _fill("gaussian", shape=(10, 30), sparse=10)  # p = 1 exactly: allowed, every value kept
    assert np.count_nonzero(dense) == dense.size
    assert np.count_nonzero(_fill("gaussian", shape=(10, 30), sparse=0)) == 0  # p = 0: all zero


@pytest.mark.parametrize("type_, fields, message", [
    ("gaussian", {"std": 0.0}, r"gaussian filler: std must be > 0, got 0"),
    ("gaussian", {"std": -1.0, "mean": 2.0}, r"gaussian filler: std must be > 0, got -1"),
    ("uniform", {"min": 1.0, "max": 0.5}, r"uniform filler: min 1.0 is above max 0.5"),
])
def test_degenerate_gaussian_and_uniform_parameters_fail_like_caffe(type_, fields, message):
    """Caffe's caffe_rng_gaussian CHECKs ``sigma > 0`` and caffe_rng_uniform ``a <= b``: a gaussian filler with
    ``std: 0`` (or negative) and a uniform one with ``min > max`` abort.  Before, ours filled the constant mean
    (or a negative-std gaussian) and values in (max, min]."""
    with pytest.raises(FormatError, match=message):
        _fill(type_, shape=(4, 5), **fields)
    assert np.all(_fill("uniform", shape=(4, 5), min=0.5, max=0.5) == 0.5)  # min == max is allowed: the value

"""LSTMUnit: gate order [i, f, o, g] in closed form, the cont flush, Caffe's CPU backward (including its
f(1 - f) for a non-binary cont), float64 gradcheck for binary cont, setup CHECKs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from caffe_compat.errors import FormatError
from tests.layers.zoo_single_layer import make_layer

N, H = 3, 2


def sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


def test_gate_order_closed_form():
    """Gate blocks along X: i = σ(1), f = σ(2)·cont, o = σ(3), g = tanh(4); c = f c_prev + i g, h = o tanh c."""
    port = make_layer('type: "LSTMUnit"', [(1, N, H), (1, N, 4 * H), (1, N)])
    x = torch.tensor([1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 4.0, 4.0], dtype=torch.float64).repeat(1, N, 1)
    c_prev = torch.full((1, N, H), 0.5, dtype=torch.float64)
    cont = torch.tensor([[1.0, 0.0, 0.5]], dtype=torch.float64)
    c, h = port(c_prev, x, cont)
    i, f, o, g = sigmoid(1.0), sigmoid(2.0), sigmoid(3.0), np.tanh(4.0)
    expected_c = np.array([f * 0.5 + i * g, i * g, 0.5 * f * 0.5 + i * g])
    np.testing.assert_allclose(c[0, :, 0].numpy(), expected_c, rtol=1e-14)
    np.testing.assert_allclose(h[0, :, 1].numpy(), o * np.tanh(expected_c), rtol=1e-14)
    assert port.output_shapes() == [(1, N, H), (1, N, H)]


def caffe_backward(c_prev, x, cont, c_diff, h_diff):
    """LSTMUnitLayer::Backward_cpu transcribed."""
    i, fs = sigmoid(x[:, :H]), sigmoid(x[:, H:2 * H])
    f = np.where(cont[:, None] == 0, 0.0, cont[:, None] * fs)
    o, g = sigmoid(x[:, 2 * H:3 * H]), np.tanh(x[:, 3 * H:])
    c = f * c_prev + i * g
    tanh_c = np.tanh(c)
    term = c_diff + h_diff * o * (1 - tanh_c ** 2)
    dx = np.concatenate([term * g * i * (1 - i), term * c_prev * f * (1 - f), h_diff * tanh_c * o * (1 - o),
                         term * i * (1 - g * g)], axis=1)
    return term * f, dx


def test_backward_is_caffes_cpu_formula_also_for_a_fractional_cont():
    rng = np.random.default_rng(0)
    c_prev, x = rng.standard_normal((N, H)), rng.standard_normal((N, 4 * H))
    cont = np.array([1.0, 0.0, 0.3])
    c_diff, h_diff = rng.standard_normal((N, H)), rng.standard_normal((N, H))
    port = make_layer('type: "LSTMUnit"', [(1, N, H), (1, N, 4 * H), (1, N)])
    tc, tx = torch.tensor(c_prev[None], requires_grad=True), torch.tensor(x[None], requires_grad=True)
    c, h = port(tc, tx, torch.tensor(cont[None]))
    torch.autograd.backward([c, h], [torch.tensor(c_diff[None]), torch.tensor(h_diff[None])])
    d_prev, dx = caffe_backward(c_prev, x, cont, c_diff, h_diff)
    np.testing.assert_allclose(tc.grad[0].numpy(), d_prev, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(tx.grad[0].numpy(), dx, rtol=1e-13, atol=1e-15)
    # the quirk: at cont = 0.3 the forget-gate entry is f(1-f), not the derivative cont·σ(1-σ)
    s = sigmoid(x[2, H:2 * H])
    true = (c_diff[2] + h_diff[2] * sigmoid(x[2, 2 * H:3 * H]) * (1 - np.tanh(c[0, 2].detach().numpy()) ** 2)) \
        * c_prev[2] * 0.3 * s * (1 - s)
    assert not np.allclose(tx.grad[0, 2, H:2 * H].numpy(), true)


def test_gradcheck_float64_binary_cont():
    port = make_layer('type: "LSTMUnit"', [(1, N, H), (1, N, 4 * H), (1, N)])
    g = torch.Generator().manual_seed(1)
    c_prev = torch.randn(1, N, H, dtype=torch.float64, generator=g, requires_grad=True)
    x = torch.randn(1, N, 4 * H, dtype=torch.float64, generator=g, requires_grad=True)
    cont = torch.tensor([[1.0, 0.0, 1.0]], dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda c, x: port(c, x, cont), (c_prev, x))


def test_setup_checks():
    with pytest.raises(FormatError, match=r"last axis must be 4 x 2"):
        make_layer('type: "LSTMUnit"', [(1, N, H), (1, N, 3 * H), (1, N)])
    with pytest.raises(FormatError, match="the cont bottom must have 2 axes"):
        make_layer('type: "LSTMUnit"', [(1, N, H), (1, N, 4 * H), (1, N, 1)])
    with pytest.raises(FormatError, match=r"must lead with \(1, 3\)"):
        make_layer('type: "LSTMUnit"', [(1, N, H), (2, N, 4 * H), (1, N)])
    with pytest.raises(FormatError, match=r"needs 2 top blob\(s\), got 1"):
        make_layer('type: "LSTMUnit" bottom: "c" bottom: "x" bottom: "k" top: "c1"',
                   [(1, N, H), (1, N, 4 * H), (1, N)])

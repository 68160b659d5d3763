"""Caffe's update rules against hand computations and, where the definitions coincide (fixed rate,
lr_mult 1, L2 decay), against ``torch.optim``.

With a constant rate every Caffe rule equals a torch.optim one: SGD/Nesterov (Caffe keeps lr inside the
history), AdaGrad, RMSProp, AdaDelta, and Adam with eps 0 (Caffe adds delta to the *uncorrected*
sqrt(v)).  Hyper-parameters are dyadic so their float32 rounding is exact and float64 runs compare to
~1e-12.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from caffe_compat.errors import FormatError
from caffe_compat.solver import SGD, AdaDelta, AdaGrad, Adam, Nesterov, RMSProp, make_optimizer
from caffe_compat.proto import caffe_pb2

STEPS = 4


def tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 4, generator=g, dtype=torch.float64), torch.randn(5, generator=g, dtype=torch.float64)]


def grads(seed, t):
    g = torch.Generator().manual_seed(1000 * seed + t)
    return [torch.randn(3, 4, generator=g, dtype=torch.float64), torch.randn(5, generator=g, dtype=torch.float64)]


def run(make, seed=0):
    params = [p.clone().requires_grad_() for p in tensors(seed)]
    opt = make(params)
    for t in range(STEPS):
        for p, g in zip(params, grads(seed, t)):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params], opt


PAIRS = {
    "SGD": (lambda ps: SGD(ps, lr=0.125, momentum=0.875, weight_decay=0.0625),
            lambda ps: torch.optim.SGD(ps, lr=0.125, momentum=0.875, weight_decay=0.0625), 1e-12),
    "Nesterov": (lambda ps: Nesterov(ps, lr=0.125, momentum=0.875, weight_decay=0.0625),
                 lambda ps: torch.optim.SGD(ps, lr=0.125, momentum=0.875, weight_decay=0.0625, nesterov=True), 1e-12),
    "AdaGrad": (lambda ps: AdaGrad(ps, lr=0.125, delta=2.0 ** -20, weight_decay=0.0625),
                lambda ps: torch.optim.Adagrad(ps, lr=0.125, eps=2.0 ** -20, weight_decay=0.0625), 1e-12),
    "RMSProp": (lambda ps: RMSProp(ps, lr=0.125, rms_decay=0.875, delta=2.0 ** -20, weight_decay=0.0625),
                lambda ps: torch.optim.RMSprop(ps, lr=0.125, alpha=0.875, eps=2.0 ** -20, weight_decay=0.0625), 1e-12),
    "AdaDelta": (lambda ps: AdaDelta(ps, lr=0.5, momentum=0.875, delta=2.0 ** -10, weight_decay=0.0625),
                 lambda ps: torch.optim.Adadelta(ps, lr=0.5, rho=0.875, eps=2.0 ** -10, weight_decay=0.0625), 1e-12),
    # Caffe's bias correction is rounded to float32: agreement to ~1e-7 relative
    "Adam": (lambda ps: Adam(ps, lr=0.125, momentum=0.875, momentum2=0.9921875, delta=0.0, weight_decay=0.0625),
             lambda ps: torch.optim.Adam(ps, lr=0.125, betas=(0.875, 0.9921875), eps=0.0, weight_decay=0.0625), 1e-6),
}


@pytest.mark.parametrize("rule", list(PAIRS))
def test_rule_equals_torch_optim_at_fixed_rate(rule):
    ours_make, torch_make, rtol = PAIRS[rule]
    ours, _ = run(ours_make)
    theirs, _ = run(torch_make)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=rtol, atol=rtol)


def test_sgd_history_holds_the_rate():
    """Caffe: h = m·h + lr·g, so a rate change does not rescale the momentum already accumulated."""
    w = torch.tensor([1.0], dtype=torch.float64, requires_grad=True)
    opt = SGD([w], lr=0.5, momentum=0.5)
    w.grad = torch.tensor([1.0], dtype=torch.float64)
    opt.step()  # h = 0.5, w = 0.5
    opt.param_groups[0]["lr"] = 0.25
    w.grad = torch.tensor([2.0], dtype=torch.float64)
    opt.step()  # h = 0.25 + 0.5 = 0.75 ; torch.optim.SGD would give lr·(m·1 + 2) = 0.625
    assert w.item() == 0.5 - 0.75
    assert opt.history_blobs()[0].item() == 0.75
    assert w.grad.item() == 0.75  # the diff holds the update value, as in Caffe


def test_lr_mult_decay_mult_l1_iter_size_and_clip_by_hand():
    w1 = torch.tensor([2.0, -1.0], dtype=torch.float64, requires_grad=True)
    w2 = torch.tensor([0.5], dtype=torch.float64, requires_grad=True)
    w1.lr_mult, w1.decay_mult = 2.0, 1.0
    w2.lr_mult, w2.decay_mult = 10.0, 0.0
    opt = SGD([w1, w2], lr=0.125, momentum=0.0, weight_decay=0.25, regularization_type="L1", iter_size=2,
              clip_gradients=2.5)
    w1.grad = torch.tensor([3.0, 0.0], dtype=torch.float64)  # accumulated over 2 sub-batches
    w2.grad = torch.tensor([4.0], dtype=torch.float64)
    opt.step()
    # clip on the raw accumulated diffs: norm 5 > 2.5 -> scale 0.5 ; then / iter_size 2
    assert opt.last_clip == (5.0, 0.5)
    d1 = np.array([3.0, 0.0]) * 0.5 / 2 + 0.25 * np.sign([2.0, -1.0])  # L1 decay, decay_mult 1
    d2 = np.array([4.0]) * 0.5 / 2  # decay_mult 0
    np.testing.assert_array_equal(w1.detach().numpy(), [2.0, -1.0] - 0.125 * 2.0 * d1)
    np.testing.assert_array_equal(w2.detach().numpy(), [0.5] - 0.125 * 10.0 * d2)


def test_zero_lr_mult_keeps_values_but_history_sees_decay():
    stats = torch.tensor([4.0, 8.0])  # like a BatchNorm statistic: no grad, lr_mult 0, decay_mult 1
    stats.lr_mult, stats.decay_mult = 0.0, 1.0
    opt = Adam([stats], lr=0.1, weight_decay=0.5)
    opt.step()
    assert stats.tolist() == [4.0, 8.0]
    m, v = opt.history_blobs()
    torch.testing.assert_close(m, torch.tensor([0.1 * 2.0, 0.1 * 4.0]))  # (1 - β1) · decay · w
    torch.testing.assert_close(v, torch.tensor([0.001 * 4.0, 0.001 * 16.0]))


def test_adam_bias_correction_uses_iter():
    w = torch.tensor([1.0], dtype=torch.float64, requires_grad=True)
    opt = Adam([w], lr=0.5, momentum=0.5, momentum2=0.75, delta=0.0)
    opt.iter = 4  # e.g. restored at iteration 4: t = 5
    w.grad = torch.tensor([2.0], dtype=torch.float64)
    opt.step()
    m, v = 0.5 * 2.0, 0.25 * 4.0
    correction = np.float32(np.sqrt(1 - 0.75 ** 5) / (1 - 0.5 ** 5))
    assert w.item() == pytest.approx(1.0 - np.float32(0.5 * correction) * m / np.sqrt(v), rel=1e-12)
    assert opt.iter == 5


def test_history_layout_and_set_history():
    params = [torch.zeros(2, requires_grad=True), torch.zeros(3, requires_grad=True)]
    opt = AdaDelta(params, lr=1.0, momentum=0.5)
    blobs = opt.history_blobs()
    assert [tuple(b.shape) for b in blobs] == [(2,), (3,), (2,), (3,)]
    opt.set_history([np.full(2, 1.0), np.full(3, 2.0), np.full(2, 3.0), np.full(3, 4.0)])
    assert [b.tolist() for b in opt.history_blobs()] == [[1.0] * 2, [2.0] * 3, [3.0] * 2, [4.0] * 3]
    with pytest.raises(FormatError, match="expected 4 history blobs"):
        opt.set_history([np.zeros(2)])
    with pytest.raises(FormatError, match="history blob 1 has 2 values"):
        opt.set_history([np.zeros(2), np.zeros(2), np.zeros(2), np.zeros(3)])


def test_caffe_checks():
    p = [torch.zeros(1, requires_grad=True)]
    with pytest.raises(FormatError, match="Momentum cannot be used with AdaGrad"):
        AdaGrad(p, momentum=0.9)
    with pytest.raises(FormatError, match="Momentum cannot be used with RMSProp"):
        RMSProp(p, momentum=0.9)
    with pytest.raises(FormatError, match="rms_decay"):
        RMSProp(p, rms_decay=1.5)
    with pytest.raises(FormatError, match=r"rms_decay must lie in \[0, 1\).*got 1.0"):  # CHECK_LT(rms_decay, 1)
        RMSProp(p, rms_decay=1.0)
    with pytest.raises(FormatError, match="rms_decay"):
        RMSProp(p, rms_decay=-0.5)
    RMSProp(p, rms_decay=0.0)
    # Caffe's Regularize reaches LOG(FATAL) "Unknown regularization type" only when local_decay != 0
    w = torch.ones(2, requires_grad=True)
    w.grad = torch.full((2,), 0.5)
    SGD([w], lr=1.0, regularization_type="l2").step()  # weight_decay 0: trains
    assert w.tolist() == [0.5, 0.5]
    w.decay_mult = 0.0
    SGD([w], lr=1.0, weight_decay=0.1, regularization_type="l2").step()  # decay_mult 0: local_decay 0
    assert w.tolist() == [0.0, 0.0]
    w.decay_mult = 1.0
    with pytest.raises(FormatError, match="Unknown regularization type: 'l2'"):
        SGD([w], lr=1.0, weight_decay=0.1, regularization_type="l2").step()
    assert w.tolist() == [0.0, 0.0]  # refused before any change
    param = caffe_pb2.SolverParameter(type="Adamax", base_lr=0.1)
    with pytest.raises(FormatError, match="unknown solver type"):
        make_optimizer(param, p)


def test_make_optimizer_reads_the_solver_fields():
    param = caffe_pb2.SolverParameter(type="RMSProp", base_lr=0.5, rms_decay=0.75, delta=0.25, weight_decay=0.125,
                                      iter_size=3, clip_gradients=7.0)
    opt = make_optimizer(param, [torch.zeros(1, requires_grad=True)])
    group = opt.param_groups[0]
    assert isinstance(opt, RMSProp) and opt.iter_size == 3 and opt.clip_gradients == 7.0
    assert (group["lr"], group["rms_decay"], group["delta"], group["weight_decay"]) == (0.5, 0.75, 0.25, 0.125)

"""``torch.compile(loss, fullgraph=True)``: every loss module traces as one graph (no host synchronisation)
and gives the eager loss and gradient; MarginLoss's distance weighted sampler draws in its static form there
(a fixed number of draws per anchor), so its loss is compared with the eager loss of that form.

Tolerance: a traced graph may sum in another order; each loss is a float32 reduction over at most
n = B² = 1,024 pair terms here, and a reordered sum of n terms moves by at most about n·u of the sum of
their magnitudes (u = 2^-24): the losses and gradients are compared at ``rtol = n·2^-24 ≈ 6.1e-5``.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import caffe_compat.losses as L
from caffe_compat.losses import miners
from caffe_compat.losses.loss_errors import LossInputError

B = 32
RTOL = B * B * 2.0 ** -24

LOSSES = {
    "binomial_deviance": lambda: L.BinomialDevianceLoss(),
    "contrastive": lambda: L.ContrastiveLoss(),
    "fappy_caffe": lambda: L.FAPPYLoss(1e-2),
    "fappy_paper": lambda: L.FAPPYLoss(1e-3, mode="paper"),
    "fastap": lambda: L.FastAPLoss(),
    "histogram": lambda: L.HistogramLoss(),
    "lifted_struct": lambda: L.LiftedStructLoss(),
    "margin_all_pairs": lambda: L.MarginLoss(distance_weighted=False),
    "margin_per_class_beta": lambda: L.MarginLoss(num_classes=B // 4, distance_weighted=False),
    "multi_similarity": lambda: L.MultiSimilarityLoss(),
    "raw": lambda: L.RAWLoss(),
    "smooth_ap": lambda: L.SmoothAPLoss(),
    "triplet": lambda: L.TripletLoss(),
}


def _loss_and_grad(fn, x, labels):
    x = x.clone().requires_grad_()
    loss = fn(x, labels)
    loss.backward()
    return loss.detach(), x.grad


def _batch(labels_per_class: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(B, 16, generator=generator), (torch.arange(B) // labels_per_class).float()


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_loss_traces_as_one_graph_with_the_eager_loss_and_gradient(name):
    torch._dynamo.reset()
    module = LOSSES[name]()
    x, labels = _batch(4)
    eager_loss, eager_grad = _loss_and_grad(module, x, labels)
    loss, grad = _loss_and_grad(torch.compile(module, fullgraph=True, backend="aot_eager"), x, labels)
    torch.testing.assert_close(loss, eager_loss, rtol=RTOL, atol=0.0)
    torch.testing.assert_close(grad, eager_grad, rtol=RTOL, atol=RTOL * float(eager_grad.abs().max()))
    assert float(eager_grad.abs().max()) > 0


@pytest.mark.parametrize("labels_per_class, expected", [(1, 0.0), (B, float("nan"))])
def test_fappy_paper_mode_traced_keeps_the_empty_and_single_label_batches(labels_per_class, expected):
    """No positive pair: 0 (with a zero gradient); one label only: NaN, like Caffe's 0·inf (module docstring)."""
    torch._dynamo.reset()
    module = L.FAPPYLoss(1e-2, mode="paper")
    x, labels = _batch(labels_per_class, seed=1)
    loss, grad = _loss_and_grad(torch.compile(module, fullgraph=True, backend="aot_eager"), x, labels)
    eager_loss, eager_grad = _loss_and_grad(module, x, labels)
    torch.testing.assert_close(loss, torch.tensor(expected), equal_nan=True)
    torch.testing.assert_close(eager_loss, torch.tensor(expected), equal_nan=True)
    if expected == 0.0:
        assert not grad.any() and (eager_grad is None or not eager_grad.any())


def test_traced_input_checks_still_refuse_bad_batches():
    """Under compile the checks that raise in eager code are assertions inside the graph: a NaN embedding
    (FAPPY's histogram read out of bounds) and a label outside MarginLoss's per-class betas still stop."""
    torch._dynamo.reset()
    x, labels = _batch(4)
    x[3] = float("nan")
    with pytest.raises(LossInputError):
        L.FAPPYLoss(1e-2, mode="paper")(x, labels)
    with pytest.raises(RuntimeError, match="FAPPY: a cosine the layer reads is NaN"):
        torch.compile(L.FAPPYLoss(1e-2, mode="paper"), fullgraph=True, backend="aot_eager")(x, labels)
    x, labels = _batch(4)
    margin = L.MarginLoss(num_classes=B // 4 - 1, distance_weighted=False)
    with pytest.raises(LossInputError):
        margin(x, labels)
    with pytest.raises(RuntimeError, match="labels must be integers in"):
        torch.compile(margin, fullgraph=True, backend="aot_eager")(x, labels)


def test_margin_loss_with_distance_weighted_sampling_traces_as_one_graph(monkeypatch):
    """MarginLoss's default, Wu et al.'s sampler (torch's global generator), in one graph: its draws take their
    static form (R per anchor, the first |P_a| counted; ``DistanceWeightedMiner._draw``), so from the same seed
    the compiled loss and gradient are those of the eager loss with that form, step after step without
    recompiling.  (Eager draws take another stretch of the stream; a ``generator=`` object cannot enter a
    graph: Dynamo refuses it.)"""
    torch._dynamo.reset()
    module = L.MarginLoss()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(module, fullgraph=True, backend=counter)
    results = []
    for seed in (3, 4):
        x, labels = _batch(4, seed=seed)
        torch.manual_seed(seed)
        results.append(_loss_and_grad(compiled, x, labels))
    assert counter.frame_count == 1
    monkeypatch.setattr(miners, "static_form", lambda t: True)
    for seed, (loss, grad) in zip((3, 4), results):
        x, labels = _batch(4, seed=seed)
        torch.manual_seed(seed)
        eager_loss, eager_grad = _loss_and_grad(module, x, labels)
        torch.testing.assert_close(loss, eager_loss, rtol=RTOL, atol=0.0)
        torch.testing.assert_close(grad, eager_grad, rtol=RTOL, atol=RTOL * float(eager_grad.abs().max()))
        assert float(eager_grad.abs().max()) > 0

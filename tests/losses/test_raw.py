"""RAWLoss (Eq. 17 with VTHM): hand-computed cases, gradcheck, pytorch-metric-learning's MS loss + miner."""

import math

import pytest
import torch
from pytorch_metric_learning import losses, miners

from caffe_compat.losses.raw import RAWLoss

A = 1 / math.sqrt(2)


def lg(*terms):
    return math.log(1 + sum(terms))


def four_points():
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [A, A], [-A, -A]], dtype=torch.float64)
    return x, torch.tensor([0, 0, 1, 2])


def test_full_method_by_hand():
    x, y = four_points()
    # anchor 0 and 1: positive cosine 0, negatives: x2 (cos a) and x3 (cos −a).
    # VTHM (λ = 0.1): keep negative if s > 0 − 0.1 -> x2 only; keep positive if 0 < a + 0.1 -> yes.
    # anchors 2 and 3 have no positive -> nothing mined, 0.  m = 4.
    per = lg(math.exp(-2 * (0 - 0.5))) / 2 + lg(math.exp(50 * (A - 0.5))) / 50
    assert RAWLoss()(x, y).item() == pytest.approx(2 * per / 4, rel=1e-12)


def test_without_vthm_by_hand():
    x, y = four_points()
    e = lambda s: math.exp(50 * (s - 0.5))
    a0 = lg(math.exp(1.0)) / 2 + lg(e(A), e(-A)) / 50
    a2 = lg(e(A), e(A), e(-1.0)) / 50
    a3 = lg(e(-A), e(-A), e(-1.0)) / 50
    assert RAWLoss(vthm=False)(x, y).item() == pytest.approx((2 * a0 + a2 + a3) / 4, rel=1e-12)


def test_gradcheck():
    torch.manual_seed(16)
    x = torch.randn(10, 3, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 3, 3])
    assert torch.autograd.gradcheck(lambda e: RAWLoss(beta=10.0)(e, y), (x,))


@pytest.mark.parametrize("vthm_margin", [0.1, 0.3])
def test_equals_pml_multi_similarity_with_its_miner(vthm_margin):
    torch.manual_seed(17)
    x = torch.randn(40, 16, dtype=torch.float64)
    y = torch.arange(40) // 5
    xo, xp = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ours = RAWLoss(vthm_margin=vthm_margin)(xo, y)
    mined = miners.MultiSimilarityMiner(epsilon=vthm_margin)(xp, y)
    pml = losses.MultiSimilarityLoss(alpha=2, beta=50, base=0.5)(xp, y, mined)
    assert ours.item() == pytest.approx(pml.item(), rel=1e-12)
    ours.backward()
    pml.backward()
    torch.testing.assert_close(xo.grad, xp.grad, rtol=1e-9, atol=1e-12)

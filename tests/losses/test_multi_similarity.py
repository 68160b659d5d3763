"""MultiSimilarityLoss: hand-computed cases, gradcheck, pytorch-metric-learning, the official preset."""

import math

import pytest
import torch
from pytorch_metric_learning import losses, miners

from caffe_compat.losses.miners import VTHMMiner
from caffe_compat.losses.multi_similarity import MultiSimilarityLoss

A = 1 / math.sqrt(2)


def test_official_preset_by_hand():
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [A, A], [-A, -A]], dtype=torch.float64)
    y = torch.tensor([0, 0, 1, 2])
    loss = MultiSimilarityLoss.official()
    assert (loss.alpha, loss.beta, loss.base, loss.miner.margin) == (2.0, 40.0, 0.5, 0.1)
    per = math.log1p(math.exp(1.0)) / 2 + math.log1p(math.exp(40 * (A - 0.5))) / 40
    assert loss(x, y).item() == pytest.approx(2 * per / 4, rel=1e-12)


def test_skip_incomplete_anchors_by_hand():
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [A, A]], dtype=torch.float64)
    y = torch.tensor([0, 0, 1])
    # anchor 2 has negatives but no positive: counted by PML's form, skipped by the official form
    keep = MultiSimilarityLoss()(x, y).item()
    skip = MultiSimilarityLoss(skip_incomplete_anchors=True)(x, y).item()
    anchor2 = math.log1p(2 * math.exp(50 * (A - 0.5))) / 50
    assert keep - skip == pytest.approx(anchor2 / 3, rel=1e-10)


def test_gradcheck():
    torch.manual_seed(18)
    x = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])
    assert torch.autograd.gradcheck(lambda e: MultiSimilarityLoss(beta=8.0)(e, y), (x,))


@pytest.mark.parametrize("alpha,beta,base", [(2, 50, 0.5), (1.5, 30, 0.3)])
def test_equals_pml_without_miner(alpha, beta, base):
    torch.manual_seed(19)
    x = torch.randn(48, 16, dtype=torch.float64)
    y = torch.randint(0, 7, (48,))
    xo, xp = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ours = MultiSimilarityLoss(alpha, beta, base)(xo, y)
    pml = losses.MultiSimilarityLoss(alpha=alpha, beta=beta, base=base)(xp, y)
    assert ours.item() == pytest.approx(pml.item(), rel=1e-12)
    ours.backward()
    pml.backward()
    torch.testing.assert_close(xo.grad, xp.grad, rtol=1e-9, atol=1e-12)


def test_equals_pml_with_vthm_as_ms_miner():
    torch.manual_seed(20)
    x = torch.randn(32, 8, dtype=torch.float64)
    y = torch.arange(32) // 4
    ours = MultiSimilarityLoss(miner=VTHMMiner(0.2))(x, y)
    pml = losses.MultiSimilarityLoss()(x, y, miners.MultiSimilarityMiner(epsilon=0.2)(x, y))
    assert ours.item() == pytest.approx(pml.item(), rel=1e-12)

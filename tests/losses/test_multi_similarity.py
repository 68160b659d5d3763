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


def official_code_by_hand(x, y, drop_eps, alpha=2.0, beta=40.0, base=0.5, margin=0.1):
    """The released MS loss as a per-anchor loop.  ``drop_eps=1e-5``: positives are the same-label
    similarities below 1 − eps (the authors' way of removing the anchor, which also removes exact
    duplicates); ``drop_eps=None``: the anchor is removed by index (ours)."""
    xn = torch.nn.functional.normalize(x, dim=1)
    s = xn @ xn.t()
    total = 0.0
    for i in range(len(y)):
        same = y == y[i]
        if drop_eps is None:
            pos = s[i][same & (torch.arange(len(y)) != i)]
        else:
            pos = s[i][same]
            pos = pos[pos < 1 - drop_eps]
        neg = s[i][~same]
        if len(pos) == 0 or len(neg) == 0:
            continue
        neg_kept, pos_kept = neg[neg + margin > pos.min()], pos[pos - margin < neg.max()]
        if len(neg_kept) == 0 or len(pos_kept) == 0:
            continue
        total += torch.log1p(torch.exp(-alpha * (pos_kept - base)).sum()).item() / alpha
        total += torch.log1p(torch.exp(beta * (neg_kept - base)).sum()).item() / beta
    return total / len(y)


def test_documented_difference_exact_duplicates_stay_positives():
    torch.manual_seed(63)
    x = torch.randn(8, 4, dtype=torch.float64)
    y = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    x[2] = x[0] + 0.05 * torch.randn(4, dtype=torch.float64)  # a hard negative of 0 (s > 0.9): keeps s=1 positives
    official = MultiSimilarityLoss.official()
    # no duplicate: the official code's filter and ours agree
    assert official(x, y).item() == pytest.approx(official_code_by_hand(x, y, drop_eps=1e-5), rel=1e-12)
    assert official(x, y).item() == pytest.approx(official_code_by_hand(x, y, drop_eps=None), rel=1e-12)
    # sample 1 becomes an exact duplicate of 0 (same direction): the official code drops the pair (0, 1)
    x[1] = 3.0 * x[0]
    ours = official(x, y).item()
    assert ours == pytest.approx(official_code_by_hand(x, y, drop_eps=None), rel=1e-12)
    assert abs(ours - official_code_by_hand(x, y, drop_eps=1e-5)) > 1e-3

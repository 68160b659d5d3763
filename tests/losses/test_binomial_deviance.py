"""BinomialDevianceLoss: hand-computed case, gradcheck, mined pairs."""

import math

import pytest
import torch

from caffe_compat.losses.binomial_deviance import BinomialDevianceLoss
from caffe_compat.losses.miners import VTHMMiner


def sp(z):
    return math.log1p(math.exp(z))


def test_three_points_by_hand():
    a = 1 / math.sqrt(2)
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    y = torch.tensor([0, 0, 1])
    # one positive cosine 0; two negative cosines a; α = 2, γ = 0.5, β = α·C = 50
    expected = sp(-2 * (0 - 0.5)) + sp(50 * (a - 0.5))
    assert BinomialDevianceLoss()(x, y).item() == pytest.approx(expected, rel=1e-12)
    assert BinomialDevianceLoss(alpha=1.0, neg_cost=10.0)(x, y).item() == pytest.approx(
        sp(-(0 - 0.5)) + sp(10 * (a - 0.5)), rel=1e-12
    )
    assert BinomialDevianceLoss(beta=3.0)(x, y).item() == pytest.approx(sp(1.0) + sp(3 * (a - 0.5)), rel=1e-12)


def test_gradcheck():
    torch.manual_seed(14)
    x = torch.randn(8, 3, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 0, 1, 1, 1, 2, 2, 2])
    assert torch.autograd.gradcheck(lambda e: BinomialDevianceLoss(beta=5.0)(e, y), (x,))
    assert torch.autograd.gradcheck(lambda e: BinomialDevianceLoss(miner=VTHMMiner(0.3))(e, y), (x,))


def test_vthm_mined_pairs_weights():
    torch.manual_seed(15)
    x = torch.randn(16, 6, dtype=torch.float64)
    y = torch.arange(16) // 4
    mined = VTHMMiner()(x, y)
    xn = torch.nn.functional.normalize(x, dim=1)
    s = xn @ xn.t()
    pos = (mined.pos * torch.nn.functional.softplus(-2 * (s - 0.5))).sum() / mined.pos.sum()
    neg = (mined.neg * torch.nn.functional.softplus(50 * (s - 0.5))).sum() / mined.neg.sum()
    assert BinomialDevianceLoss(miner=VTHMMiner())(x, y).item() == pytest.approx((pos + neg).item(), rel=1e-12)

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


# ---- normalization="anchor": the unified view's Eq. (12), 1/|P_i| and 1/|N_i| per anchor, summed ----

def test_anchor_normalization_by_hand():
    # cosines of x0=(1,0), x1=(0,1), x2=(1,1), x3=(1,-1): s01 = 0, s02 = s12 = s03 = a, s13 = −a, s23 = 0
    a = 1 / math.sqrt(2)
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    y = torch.tensor([0, 0, 0, 1])  # anchors 0-2: |P| = 2, |N| = 1; anchor 3: |P| = 0, |N| = 3
    for alpha, beta, gamma in [(2.0, 50.0, 0.5), (1.5, 3.0, 0.2)]:
        def cp(s):
            return sp(-alpha * (s - gamma))

        def cn(s):
            return sp(beta * (s - gamma))

        anchor = ((cp(0) + cp(a)) / 2 + cn(a)            # anchor 0: P = {1, 2}, N = {3}
                  + (cp(0) + cp(a)) / 2 + cn(-a)         # anchor 1: P = {0, 2}, N = {3}
                  + (cp(a) + cp(a)) / 2 + cn(0)          # anchor 2: P = {0, 1}, N = {3}
                  + (cn(a) + cn(-a) + cn(0)) / 3)        # anchor 3: no positive, N = {0, 1, 2}
        # Yi et al.: 6 ordered positive pairs, 6 ordered negative pairs
        pairs = (2 * cp(0) + 4 * cp(a)) / 6 + (2 * cn(a) + 2 * cn(-a) + 2 * cn(0)) / 6
        got_anchor = BinomialDevianceLoss(alpha=alpha, beta=beta, gamma=gamma, normalization="anchor")(x, y)
        got_pairs = BinomialDevianceLoss(alpha=alpha, beta=beta, gamma=gamma)(x, y)
        assert got_anchor.item() == pytest.approx(anchor, rel=1e-12)
        assert got_pairs.item() == pytest.approx(pairs, rel=1e-12)
        assert got_pairs.item() == pytest.approx(
            BinomialDevianceLoss(alpha=alpha, beta=beta, gamma=gamma, normalization="pairs")(x, y).item(), rel=0)
        assert abs(anchor - 4 * pairs) > 1e-3  # unequal |P_i|, |N_i|: not a rescaling of Yi's loss


def test_anchor_equals_batch_size_times_pairs_for_equal_class_blocks():
    torch.manual_seed(16)
    x = torch.randn(12, 5, dtype=torch.float64)
    y = torch.arange(12) // 3
    anchor = BinomialDevianceLoss(normalization="anchor")(x, y)
    assert anchor.item() == pytest.approx(12 * BinomialDevianceLoss()(x, y).item(), rel=1e-12)


def test_anchor_normalization_with_mined_counts():
    torch.manual_seed(17)
    x = torch.randn(16, 6, dtype=torch.float64)
    y = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 3, 3, 4, 5])
    mined = VTHMMiner()(x, y)
    xn = torch.nn.functional.normalize(x, dim=1)
    s = xn @ xn.t()
    expected = 0.0
    for i in range(16):
        n_p, n_n = mined.pos[i].sum().item(), mined.neg[i].sum().item()
        if n_p:
            expected += (mined.pos[i] * torch.nn.functional.softplus(-2 * (s[i] - 0.5))).sum().item() / n_p
        if n_n:
            expected += (mined.neg[i] * torch.nn.functional.softplus(50 * (s[i] - 0.5))).sum().item() / n_n
    got = BinomialDevianceLoss(miner=VTHMMiner(), normalization="anchor")(x, y)
    assert got.item() == pytest.approx(expected, rel=1e-12)


def test_anchor_normalization_gradcheck():
    torch.manual_seed(18)
    x = torch.randn(9, 3, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 0, 1, 1, 1, 2, 2, 2, 3])  # unequal classes, one anchor without positives
    assert torch.autograd.gradcheck(lambda e: BinomialDevianceLoss(beta=5.0, normalization="anchor")(e, y), (x,))
    assert torch.autograd.gradcheck(
        lambda e: BinomialDevianceLoss(beta=5.0, miner=VTHMMiner(0.3), normalization="anchor")(e, y), (x,))


def test_unknown_normalization_is_rejected():
    from caffe_compat.losses.loss_errors import LossInputError

    with pytest.raises(LossInputError, match="normalization must be one of"):
        BinomialDevianceLoss(normalization="batch")

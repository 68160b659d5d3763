"""ContrastiveLoss: hand-computed case, Caffe's ContrastiveLoss layer, gradcheck, pytorch-metric-learning."""

import math

import numpy as np
import pytest
import torch
from pytorch_metric_learning import distances, losses, reducers

from caffe_compat.losses.loss_errors import LossInputError
from caffe_compat.losses.contrastive import ContrastiveLoss
from caffe_compat.losses.miners import VTHMMiner
from tests.conftest import fixture_path


def test_three_points_by_hand():
    x = torch.tensor([[0.0, 0.0], [0.0, 0.5], [0.6, 0.0]], dtype=torch.float64)
    y = torch.tensor([0, 0, 1])
    # pairs: (0,1) positive d²=0.25; (0,2) negative d=0.6; (1,2) negative d=√0.61; M = 3 pairs
    expected = (0.25 + (1 - 0.6) ** 2 + (1 - math.sqrt(0.61)) ** 2) / (2 * 3)
    assert ContrastiveLoss()(x, y).item() == pytest.approx(expected, rel=1e-12)
    expected_p1 = (0.5 + (1 - 0.6) + (1 - math.sqrt(0.61))) / (2 * 3)
    assert ContrastiveLoss(power=1)(x, y).item() == pytest.approx(expected_p1, rel=1e-12)


@pytest.mark.parametrize("case,margin", [("contrastive_default_margin_lw0.5", 1.0), ("contrastive_margin1.3_legacy_false", 1.3)])
def test_batch_of_two_is_one_caffe_siamese_pair(case, margin):
    z = np.load(fixture_path(f"losses/{case}.npz"))
    a = torch.tensor(z["a"], dtype=torch.float64, requires_grad=True)
    b = torch.tensor(z["b"], dtype=torch.float64, requires_grad=True)
    similar = z["sim"].astype(np.int64) != 0  # Caffe: static_cast<int>(sim) != 0
    loss_fn = ContrastiveLoss(margin=margin)
    terms = [
        loss_fn(torch.stack([a[k], b[k]]), torch.tensor([0, 0 if similar[k] else 1])) for k in range(len(similar))
    ]
    mean = torch.stack(terms).mean()  # Caffe's 1/(2N) Σ over the N siamese pairs
    assert mean.item() == pytest.approx(float(z["loss"]), rel=1e-5)
    (float(z["loss_weight"]) * mean).backward()
    # Caffe's dissimilar-pair backward divides by (d + 1e-4) instead of d: reproduce that known offset
    d = (a - b).detach().norm(dim=1)
    quirk = torch.where(torch.tensor(similar), torch.ones_like(d), d / (d + 1e-4))[:, None]
    np.testing.assert_allclose((a.grad * quirk).numpy(), z["diff:a"], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose((b.grad * quirk).numpy(), z["diff:b"], rtol=1e-4, atol=1e-6)


def test_gradcheck():
    torch.manual_seed(1)
    x = torch.randn(7, 3, dtype=torch.float64, requires_grad=True) * 0.4
    y = torch.tensor([0, 0, 1, 1, 1, 2, 2])
    assert torch.autograd.gradcheck(lambda e: ContrastiveLoss()(e, y), (x,))
    assert torch.autograd.gradcheck(lambda e: ContrastiveLoss(power=1, normalize=True)(e, y), (x,))


@pytest.mark.parametrize("normalize", [False, True])
def test_equals_pml_with_power1_and_sum_reducer(normalize):
    torch.manual_seed(2)
    x = torch.randn(20, 6, dtype=torch.float64) * 0.3
    y = torch.randint(0, 4, (20,))
    ours_x = x.clone().requires_grad_(True)
    pml_x = x.clone().requires_grad_(True)
    ours = ContrastiveLoss(margin=1.0, power=1, normalize=normalize)(ours_x, y)
    pml = losses.ContrastiveLoss(
        pos_margin=0, neg_margin=1.0, distance=distances.LpDistance(normalize_embeddings=normalize),
        reducer=reducers.SumReducer(),
    )(pml_x, y)
    scale = 2 * 20 * 19  # PML sums the ordered pairs; ours is Σ_{i<j} / (2·M)
    assert (ours * scale).item() == pytest.approx(pml.item(), rel=1e-12)
    (ours * scale).backward()
    pml.backward()
    torch.testing.assert_close(ours_x.grad, pml_x.grad, rtol=1e-9, atol=1e-12)


def test_miner_restricts_pairs():
    torch.manual_seed(3)
    x = torch.randn(12, 4, dtype=torch.float64)
    y = torch.arange(12) // 3
    mined = VTHMMiner()(x, y)
    loss = ContrastiveLoss(miner=VTHMMiner())(x, y)
    d = torch.cdist(x, x)
    terms = mined.pos * d**2 + mined.neg * torch.relu(1 - d) ** 2
    assert loss.item() == pytest.approx((terms.sum() / (2 * (mined.pos.sum() + mined.neg.sum()))).item(), rel=1e-10)


def test_bad_input():
    with pytest.raises(LossInputError):
        ContrastiveLoss()(torch.zeros(4, 2), torch.zeros(3))
    with pytest.raises(LossInputError):
        ContrastiveLoss(power=3)


def test_documented_difference_pml_default_reducer_averages_pos_and_neg_separately():
    """PML's default (``AvgNonZeroReducer``, L2-normalised, power 1) = mean of the non-zero positive terms
    + mean of the non-zero negative terms; with ``SumReducer`` it is ours times 2·B(B−1)."""
    from caffe_compat.losses.miners import PairSelection

    torch.manual_seed(65)
    x = torch.randn(16, 5, dtype=torch.float64)
    y = torch.randint(0, 4, (16,))
    xn = torch.nn.functional.normalize(x, dim=1)
    d = torch.cdist(xn, xn)
    same = y[:, None] == y[None, :]
    eye = torch.eye(16, dtype=torch.bool)
    pos_nz = (same & ~eye & (d > 0)).double()
    neg_nz = (~same & (d < 1.0)).double()
    assert 0 < neg_nz.sum() < (~same).sum()  # some negative hinges are 0: the "non-zero" rule matters

    class Fixed:
        def __init__(self, pos, neg):
            self.selection = PairSelection(pos, neg)

        def __call__(self, embeddings, labels):
            return self.selection

    ours = lambda miner=None: ContrastiveLoss(power=1, normalize=True, miner=miner)(x, y).item()
    zero = torch.zeros(16, 16, dtype=torch.float64)
    # ours over a pair set W is Σ_W ℓ / (2|W|): each non-zero mean is 2× ours on that set
    expected = 2 * ours(Fixed(pos_nz, zero)) + 2 * ours(Fixed(zero, neg_nz))
    pml = losses.ContrastiveLoss(pos_margin=0, neg_margin=1.0)(x, y).item()
    assert pml == pytest.approx(expected, rel=1e-12)
    all_nz = 2 * ours(Fixed(pos_nz, neg_nz))  # one joint mean over all non-zero terms: not PML's value
    assert abs(pml - all_nz) > 1e-3
    summed = losses.ContrastiveLoss(pos_margin=0, neg_margin=1.0, reducer=reducers.SumReducer())(x, y).item()
    assert summed == pytest.approx(2 * 16 * 15 * ours(), rel=1e-12)

"""TripletLoss: hand-computed case, gradcheck, brute-force triplets, pytorch-metric-learning."""

import math

import pytest
import torch
from pytorch_metric_learning import distances, losses, miners

from caffe_compat.losses.loss_errors import LossInputError
from caffe_compat.losses.miners import EasyPositiveMiner
from caffe_compat.losses.triplet import TripletLoss


def unit(angle_deg):
    t = math.radians(angle_deg)
    return [math.cos(t), math.sin(t)]


def hand_case():
    c = 0.45
    x = torch.tensor([[1.0, 0.0], unit(60), [c, -math.sqrt(1 - c * c)]], dtype=torch.float64)
    return x, torch.tensor([0, 0, 1])


def test_three_points_by_hand():
    x, y = hand_case()
    # squared distances of unit vectors: d = 2 − 2 cos
    d01 = 2 - 2 * 0.5  # = 1
    d02 = 2 - 2 * 0.45  # = 1.1  -> triplet (0,1,2): 1 − 1.1 + 0.2 = 0.1, semi-hard
    d12 = 2 - 2 * (0.5 * 0.45 - math.sin(math.radians(60)) * math.sqrt(1 - 0.45**2))  # ≈ 3.10 -> 0
    l012 = max(0.0, d01 - d02 + 0.2)
    l102 = max(0.0, d01 - d12 + 0.2)
    assert l012 == pytest.approx(0.1) and l102 == 0.0
    assert TripletLoss(triplets="all")(x, y).item() == pytest.approx((l012 + l102) / 2, rel=1e-12)
    assert TripletLoss(triplets="all", reduction="mean_nonzero")(x, y).item() == pytest.approx(0.1, rel=1e-12)
    assert TripletLoss(triplets="all", reduction="sum")(x, y).item() == pytest.approx(0.1, rel=1e-12)
    assert TripletLoss(triplets="semihard")(x, y).item() == pytest.approx(0.1, rel=1e-12)
    assert TripletLoss(triplets="hard")(x, y).item() == 0.0


def brute_force(x, y, margin, kind, reduction):
    xn = torch.nn.functional.normalize(x, dim=1)
    d = torch.cdist(xn, xn) ** 2
    losses_, selected = [], 0
    for a in range(len(y)):
        for p in range(len(y)):
            for n in range(len(y)):
                if p == a or y[p] != y[a] or y[n] == y[a]:
                    continue
                gap = d[a, n] - d[a, p]
                if kind == "semihard" and not (0 < gap <= margin):
                    continue
                if kind == "hard" and not gap <= 0:
                    continue
                selected += 1
                losses_.append(torch.relu(d[a, p] - d[a, n] + margin))
    values = torch.stack(losses_) if losses_ else torch.zeros(0, dtype=x.dtype)
    if reduction == "sum":
        return values.sum()
    if reduction == "mean":
        return values.sum() / max(selected, 1)
    nz = values[values > 0]
    return nz.mean() if len(nz) else torch.zeros((), dtype=x.dtype)


@pytest.mark.parametrize("kind", ["all", "semihard", "hard"])
@pytest.mark.parametrize("reduction", ["mean", "mean_nonzero", "sum"])
def test_matches_explicit_triplet_enumeration(kind, reduction):
    torch.manual_seed(4)
    x = torch.randn(15, 4, dtype=torch.float64)
    y = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 4, 4, 4, 4, 4])
    ours = TripletLoss(margin=0.3, triplets=kind, reduction=reduction)(x, y)
    assert ours.item() == pytest.approx(brute_force(x, y, 0.3, kind, reduction).item(), rel=1e-10, abs=1e-14)


@pytest.mark.parametrize("kind", ["all", "semihard", "hard"])
def test_gradcheck(kind):
    torch.manual_seed(5)
    x = torch.randn(9, 3, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])
    assert torch.autograd.gradcheck(lambda e: TripletLoss(margin=0.5, triplets=kind)(e, y), (x,))


@pytest.mark.parametrize("kind", ["all", "semihard", "hard"])
@pytest.mark.parametrize("squared", [True, False])
def test_equals_pml_triplet_margin_loss_with_miner(kind, squared):
    torch.manual_seed(6)
    x = torch.randn(32, 8, dtype=torch.float64)
    y = torch.arange(32) // 4
    dist = distances.LpDistance(power=2 if squared else 1)
    xo, xp = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ours = TripletLoss(margin=0.2, triplets=kind, squared=squared, reduction="mean_nonzero")(xo, y)
    mined = miners.TripletMarginMiner(margin=0.2, type_of_triplets=kind, distance=dist)(xp, y)
    pml = losses.TripletMarginLoss(margin=0.2, distance=dist)(xp, y, mined)
    assert ours.item() == pytest.approx(pml.item(), rel=1e-10)
    ours.backward()
    pml.backward()
    torch.testing.assert_close(xo.grad, xp.grad, rtol=1e-8, atol=1e-12)


def test_easy_positive_miner_gives_eps_triplets():
    torch.manual_seed(7)
    x = torch.randn(12, 5, dtype=torch.float64)
    y = torch.arange(12) // 4
    xn = torch.nn.functional.normalize(x, dim=1)
    d = torch.cdist(xn, xn) ** 2
    total, count = 0.0, 0
    for a in range(12):
        same = [p for p in range(12) if p != a and y[p] == y[a]]
        p = min(same, key=lambda j: d[a, j].item())  # the easy positive Φ(y_a, y_p)
        for n in range(12):
            if y[n] != y[a]:
                total += max(0.0, (d[a, p] - d[a, n] + 0.2).item())
                count += 1
    assert TripletLoss(miner=EasyPositiveMiner())(x, y).item() == pytest.approx(total / count, rel=1e-10)


def test_bad_parameters():
    with pytest.raises(LossInputError):
        TripletLoss(triplets="batch_hard")
    with pytest.raises(LossInputError):
        TripletLoss(reduction="max")
    with pytest.raises(LossInputError):
        TripletLoss()(torch.zeros(3), torch.zeros(3))

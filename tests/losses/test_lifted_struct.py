"""LiftedStructLoss: hand-computed case, the Caffe layer's loop, gradcheck, pytorch-metric-learning."""

import math

import pytest
import torch
from pytorch_metric_learning import distances, losses

from caffe_compat.losses.lifted_struct import LiftedStructLoss


def test_four_points_by_hand():
    x = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 1.0], [3.0, 0.0]], dtype=torch.float64)
    y = torch.tensor([0, 0, 1, 1])
    r2, r10 = math.sqrt(2), math.sqrt(10)
    # pair (0,1): D=1; negatives of 0: D=1, 3; of 1: D=√2, 2
    j01 = math.log(math.exp(1 - 1) + math.exp(1 - 3) + math.exp(1 - r2) + math.exp(1 - 2)) + 1
    # pair (2,3): D=√10; negatives of 2: D=1, √2; of 3: D=3, 2
    j23 = math.log(math.exp(0) + math.exp(1 - r2) + math.exp(1 - 3) + math.exp(1 - 2)) + r10
    expected = (max(j01, 0) ** 2 + max(j23, 0) ** 2) / (2 * 2)
    assert LiftedStructLoss()(x, y).item() == pytest.approx(expected, rel=1e-12)


def caffe_layer_loop(x, y, margin=1.0):
    """The authors' Caffe forward, loop for loop (i<j positives, negatives of i then of j)."""
    n = len(y)
    d = torch.cdist(x, x)
    loss, constraints = 0.0, 0
    for i in range(n):
        for j in range(i + 1, n):
            if y[i] != y[j]:
                continue
            aug = [margin - d[i, k].item() for k in range(n) if y[k] != y[i]]
            aug += [margin - d[j, k].item() for k in range(n) if y[k] != y[j]]
            top = max(aug)
            soft_max = math.log(sum(math.exp(a - top) for a in aug)) + top
            loss += max(soft_max + d[i, j].item(), 0.0) ** 2
            constraints += 1
    return loss / constraints / 2.0


def test_matches_caffe_layer_loop():
    torch.manual_seed(8)
    x = torch.randn(18, 5, dtype=torch.float64)
    y = torch.tensor([3, 3, 3, 1, 1, 0, 0, 0, 0, 7, 7, 2, 2, 2, 5, 5, 6, 6])
    assert LiftedStructLoss()(x, y).item() == pytest.approx(caffe_layer_loop(x, y), rel=1e-12)
    assert LiftedStructLoss(margin=0.5)(x, y).item() == pytest.approx(caffe_layer_loop(x, y, 0.5), rel=1e-12)


def test_gradcheck():
    torch.manual_seed(9)
    x = torch.randn(8, 3, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 0, 1, 1, 1, 2, 2, 3])
    assert torch.autograd.gradcheck(lambda e: LiftedStructLoss()(e, y), (x,))


def test_equals_pml_lifted_structure_loss():
    torch.manual_seed(10)
    x = torch.randn(40, 16, dtype=torch.float64) * 0.3
    y = torch.arange(40) // 5
    xo, xp = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ours = LiftedStructLoss()(xo, y)
    pml = losses.LiftedStructureLoss(neg_margin=1, pos_margin=0, distance=distances.LpDistance(normalize_embeddings=False))(xp, y)
    assert ours.item() == pytest.approx(pml.item(), rel=1e-10)
    ours.backward()
    pml.backward()
    torch.testing.assert_close(xo.grad, xp.grad, rtol=1e-7, atol=1e-10)


def test_degenerate_batches():
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    no_positive = LiftedStructLoss()(x, torch.tensor([0, 1, 2, 3]))
    assert no_positive.item() == 0.0  # Caffe: 0/0 = NaN
    one_class = LiftedStructLoss()(x, torch.tensor([1, 1, 1, 1]))
    assert one_class.item() == 0.0  # no negatives: J = −∞, as in Caffe
    one_class.backward()
    assert torch.isfinite(x.grad).all() and (x.grad == 0).all()

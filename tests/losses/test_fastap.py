"""FastAPLoss: hand-computed case, gradcheck, the supplement's analytic gradient, pytorch-metric-learning."""

import pytest
import torch
from pytorch_metric_learning import losses

from caffe_compat.losses.loss_errors import LossInputError
from caffe_compat.losses.fastap import FastAPLoss


def test_three_points_by_hand():
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]], dtype=torch.float64)
    y = torch.tensor([0, 0, 1])
    # 2 bins: centres 0, 2, 4.  d01 = 2, d02 = 4, d12 = 2.
    # anchor 0: h⁺ = [0,1,0], h⁻ = [0,0,1] -> FastAP = 1·1/1 = 1
    # anchor 1: h⁺ = [0,1,0], h⁻ = [0,1,0] -> FastAP = 1·1/2 = 0.5 (a tie with the negative)
    # anchor 2: no positive, left out
    assert FastAPLoss(num_bins=2)(x, y).item() == pytest.approx(1 - (1 + 0.5) / 2, rel=1e-12)


def test_between_centres_by_hand():
    x = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0]], dtype=torch.float64)
    y = torch.tensor([0, 0, 1])
    # 4 bins (Δ = 1).  d01 = 0.4, d02 = 2, d12 = 0.8
    # anchor 0: h⁺ = [0.6, 0.4, 0,..], h⁻ = [0, 0, 1, ..]: H⁺ = [.6, 1, ..], H = [.6, 1, 2, ..]
    #   FastAP = 0.6·0.6/0.6 + 0.4·1/1 = 1
    # anchor 1: h⁺ = [0.6, 0.4], h⁻ = [0.2, 0.8]: H⁺ = [.6, 1], H = [.8, 2]
    #   FastAP = 0.6·0.6/0.8 + 0.4·1/2 = 0.45 + 0.2 = 0.65
    assert FastAPLoss(num_bins=4)(x, y).item() == pytest.approx(1 - (1 + 0.65) / 2, rel=1e-12)


@pytest.mark.parametrize("analytic", [False, True])
def test_gradcheck(analytic):
    torch.manual_seed(25)
    x = torch.randn(10, 4, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 3, 4])
    assert torch.autograd.gradcheck(lambda e: FastAPLoss(num_bins=6, analytic_gradient=analytic)(e, y), (x,))


@pytest.mark.parametrize("num_bins", [4, 10, 40])
def test_analytic_gradient_equals_autograd(num_bins):
    torch.manual_seed(26)
    x = torch.randn(48, 16, dtype=torch.float64)
    y = torch.randint(0, 9, (48,))
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    auto = FastAPLoss(num_bins)(xa, y)
    analytic = FastAPLoss(num_bins, analytic_gradient=True)(xb, y)
    assert analytic.item() == pytest.approx(auto.item(), rel=1e-14)
    (3.0 * auto).backward()
    (3.0 * analytic).backward()
    assert xa.grad.abs().max() > 0
    torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-9, atol=1e-13)


@pytest.mark.parametrize("num_bins", [10, 25])
def test_equals_pml_fastap(num_bins):
    torch.manual_seed(27)
    x = torch.randn(40, 8, dtype=torch.float64)
    y = torch.randint(0, 8, (40,))
    xo, xp = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ours = FastAPLoss(num_bins)(xo, y)
    pml = losses.FastAPLoss(num_bins=num_bins)(xp, y)
    assert ours.item() == pytest.approx(pml.item(), rel=1e-12)
    ours.backward()
    pml.backward()
    torch.testing.assert_close(xo.grad, xp.grad, rtol=1e-8, atol=1e-12)


def test_bad_bins():
    with pytest.raises(LossInputError):
        FastAPLoss(num_bins=2.5)


@pytest.mark.parametrize("analytic", [False, True])
def test_no_positive_anywhere_gives_zero_with_zero_gradient_like_pml(analytic):
    torch.manual_seed(60)
    x = torch.randn(7, 5, dtype=torch.float64)
    y = torch.tensor([4, 0, 2, 9, 1, 3, 7])  # every label once: no anchor has a positive
    xo, xp = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ours = FastAPLoss(num_bins=10, analytic_gradient=analytic)(xo, y)
    pml = losses.FastAPLoss(num_bins=10)(xp, y)
    assert pml.item() == 0.0
    assert ours.item() == pml.item()
    assert ours.grad_fn is not None  # attached to the graph: backward() works in a training loop
    ours.backward()
    assert torch.equal(xo.grad, torch.zeros_like(x))

"""HistogramLoss and the soft-histogram helper: hand-computed cases, gradcheck, pytorch-metric-learning."""

import math

import pytest
import torch
from pytorch_metric_learning import losses

from caffe_compat.losses.loss_errors import LossInputError
from caffe_compat.losses.histogram import HistogramLoss
from caffe_compat.losses.soft_histogram import triangular_histogram


def test_triangular_histogram_by_hand():
    values = torch.tensor([[-1.0, -0.25, 0.5, 1.0]], dtype=torch.float64)
    weights = torch.tensor([[1.0, 1.0, 2.0, 1.0]], dtype=torch.float64)
    # nodes −1, 0, 1 (Δ = 1): −1 -> node 0; −0.25 -> 0.25 / 0.75; 0.5 (×2) -> 1 / 1; 1 -> node 2
    h = triangular_histogram(values, weights, 2, -1.0, 1.0)
    torch.testing.assert_close(h, torch.tensor([[1.25, 1.75, 2.0]], dtype=torch.float64))


def test_three_points_by_hand():
    a = 1 / math.sqrt(2)
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-a, a]], dtype=torch.float64)
    y = torch.tensor([0, 0, 1])
    # positive cosine 0 -> h⁺ = [0, 1, 0]; negatives −a and +a -> h⁻ = [a, 2(1−a), a] / 2
    # L = Σ h⁻_r Φ⁺_r = (2(1 − a) + a) / 2
    assert HistogramLoss(num_bins=2)(x, y).item() == pytest.approx(1 - a / 2, rel=1e-12)


def test_gradcheck():
    torch.manual_seed(11)
    x = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])
    assert torch.autograd.gradcheck(lambda e: HistogramLoss(num_bins=7)(e, y), (x,))


@pytest.mark.parametrize("num_bins", [10, 100])
def test_equals_pml_histogram_loss(num_bins):
    torch.manual_seed(12)
    x = torch.randn(30, 8, dtype=torch.float64)
    y = torch.arange(30) // 3  # every class has >= 2 samples: PML uses every pair too
    xo, xp = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ours = HistogramLoss(num_bins=num_bins)(xo, y)
    pml = losses.HistogramLoss(n_bins=num_bins)(xp, y)
    assert ours.item() == pytest.approx(pml.item(), abs=1e-6)  # PML computes bin indices in float32
    ours.backward()
    pml.backward()
    torch.testing.assert_close(xo.grad, xp.grad, rtol=1e-5, atol=1e-7)


def test_documented_difference_singleton_classes():
    """PML drops negative pairs between two samples that have no positive; here every pair counts."""
    torch.manual_seed(13)
    x = torch.randn(8, 4, dtype=torch.float64)
    y = torch.tensor([0, 0, 0, 1, 1, 2, 3, 4])  # 2, 3, 4 are singletons
    pml = losses.HistogramLoss(n_bins=20)(x, y)
    # PML's value is the histogram loss on pairs that touch at least one of samples 0..4
    xn = torch.nn.functional.normalize(x, dim=1)
    s = xn @ xn.t()
    i, j = torch.triu_indices(8, 8, 1)
    has_pos = torch.tensor([True] * 5 + [False] * 3)
    keep = has_pos[i] | has_pos[j]
    same = y[i] == y[j]
    h = lambda v: triangular_histogram(v[None, :], torch.ones_like(v)[None, :], 20, -1.0, 1.0)[0] / len(v)
    restricted = (h(s[i, j][keep & ~same]) * torch.cumsum(h(s[i, j][same]), 0)).sum()
    assert pml.item() == pytest.approx(restricted.item(), abs=1e-6)
    full = (h(s[i, j][~same]) * torch.cumsum(h(s[i, j][same]), 0)).sum()
    assert HistogramLoss(num_bins=20)(x, y).item() == pytest.approx(full.item(), rel=1e-12)
    assert abs(full.item() - restricted.item()) > 1e-4


def test_cosine_exactly_one_and_bad_bins():
    x = torch.tensor([[1.0, 0.0], [2.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    # positive cosine exactly 1 (last node), negatives 0: no negative above the positive
    assert HistogramLoss(num_bins=4)(x, torch.tensor([0, 0, 1])).item() == 0.0
    # positive cosine 0, negatives 1 and 0: every negative at or above the positive
    assert HistogramLoss(num_bins=4)(x, torch.tensor([0, 1, 0])).item() == pytest.approx(1.0, rel=1e-12)
    with pytest.raises(LossInputError):
        HistogramLoss(num_bins=0)


def test_documented_difference_similarity_exactly_one():
    """PML indexes past the last node for s = 1 and fails; ours puts s = 1 on the last node."""
    x = torch.tensor([[1.0, 0.0, 0.0], [3.0, 0.0, 0.0], [0.6, 0.8, 0.0], [0.8, 0.6, 0.0]], dtype=torch.float64)
    y = torch.tensor([0, 0, 1, 1])
    # 4 bins, nodes −1, −.5, 0, .5, 1.  Positives s = 1 (node 4) and 0.96 (nodes 3/4: .08/.92):
    # h⁺ = [0, 0, 0, .04, .96], Φ⁺ = [0, 0, 0, .04, 1].  Negatives 0.6, 0.8, 0.6, 0.8 (nodes 3/4:
    # .8/.2 and .4/.6): h⁻ = [0, 0, 0, .6, .4].  L = .6·.04 + .4·1
    exact = HistogramLoss(num_bins=4)(x, y).item()
    assert exact == pytest.approx(0.6 * 0.04 + 0.4, rel=1e-12)
    with pytest.raises((IndexError, RuntimeError)):
        losses.HistogramLoss(n_bins=4)(x, y)
    # tilt sample 1 off the plane: s_01 = 1 − 5e-7 (below 1 even in PML's float32 bin index), the other
    # similarities move by < 1e-6.  Both agree there, and ours is continuous at s = 1
    nudged = x.clone()
    nudged[1, 2] = 3e-3
    ours, pml = HistogramLoss(num_bins=4)(nudged, y).item(), losses.HistogramLoss(n_bins=4)(nudged, y).item()
    assert ours == pytest.approx(pml, rel=1e-10)
    assert ours == pytest.approx(exact, abs=1e-5)

"""SmoothAPLoss: hand-computed cases, gradcheck, the appendix's Eq. 14, pytorch-metric-learning."""

import math

import pytest
import torch
from pytorch_metric_learning import losses

from caffe_compat.losses.loss_errors import LossInputError
from caffe_compat.losses.smooth_ap import SmoothAPLoss, smooth_ap_per_query


def G(d, tau):
    return 1 / (1 + math.exp(-d / tau))


def three_points():
    return torch.tensor([[1.0, 0.0], [0.6, 0.8], [0.8, 0.6]], dtype=torch.float64), torch.tensor([0, 0, 1])


def test_query_excluded_by_hand():
    x, y = three_points()
    tau = 0.1
    # query 0: positive s=0.6, negative s=0.8;  query 1: positive s=0.6, negative s=0.96; query 2: none
    ap0 = 1 / (1 + G(0.8 - 0.6, tau))
    ap1 = 1 / (1 + G(0.96 - 0.6, tau))
    assert SmoothAPLoss(temperature=tau)(x, y).item() == pytest.approx(1 - (ap0 + ap1) / 2, rel=1e-12)


def test_query_included_by_hand():
    x, y = three_points()
    tau = 0.1
    # query 0 ranks {itself s=1, x1 s=0.6} (positives) and x2 s=0.8 (negative)
    r_self = (1 + G(0.6 - 1, tau)) / (1 + G(0.6 - 1, tau) + G(0.8 - 1, tau))
    r_x1 = (1 + G(1 - 0.6, tau)) / (1 + G(1 - 0.6, tau) + G(0.8 - 0.6, tau))
    ap0 = (r_self + r_x1) / 2
    r_self = (1 + G(0.6 - 1, tau)) / (1 + G(0.6 - 1, tau) + G(0.96 - 1, tau))
    r_x0 = (1 + G(1 - 0.6, tau)) / (1 + G(1 - 0.6, tau) + G(0.96 - 0.6, tau))
    ap1 = (r_self + r_x0) / 2
    ap2 = 1 / (1 + G(0.8 - 1, tau) + G(0.96 - 1, tau))  # only itself as positive
    got = SmoothAPLoss(temperature=tau, include_query=True)(x, y).item()
    assert got == pytest.approx(1 - (ap0 + ap1 + ap2) / 3, rel=1e-12)


@pytest.mark.parametrize("include_query", [False, True])
def test_gradcheck(include_query):
    torch.manual_seed(28)
    x = torch.randn(8, 3, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([2, 0, 0, 1, 2, 1, 1, 5])  # unequal, interleaved classes
    fn = lambda e: SmoothAPLoss(temperature=0.05, include_query=include_query)(e, y)
    assert torch.autograd.gradcheck(fn, (x,))


def eq14_gradient(q, v, positive, tau):
    """Bleeker & de Rijke, appendix Eq. 14 exactly as printed, with their ∂D_ij/∂q = v_i − v_j (Eq. 5).

    The appendix's Eq. 4 writes D_ij = s_i − s_j (Brown et al. use s_j − s_i) and its quotient rule in
    Eq. 11 is R_P·∂R_Ω − R_Ω·∂R_P (the negative of the usual one); the two sign flips cancel, so the
    printed Eq. 14 is the gradient of Brown et al.'s Smooth-AP, G evaluated at s_j − s_i.
    """
    s = v @ q
    P = [i for i in range(len(v)) if positive[i]]
    N = [j for j in range(len(v)) if not positive[j]]
    g = lambda i, j: torch.sigmoid((s[j] - s[i]) / tau)
    sim = lambda i, j: g(i, j) * (1 - g(i, j)) / tau
    total = torch.zeros_like(q)
    for i in P:
        r_pos = 1 + sum(g(i, j) for j in P if j != i)
        r_neg_minus_1 = sum(g(i, j) for j in N)
        r_all = r_pos + r_neg_minus_1
        d_neg = sum(sim(i, j) * (v[i] - v[j]) for j in N)
        d_pos = sum((sim(i, j) * (v[i] - v[j]) for j in P if j != i), torch.zeros_like(q))
        total = total + (r_pos * d_neg - r_neg_minus_1 * d_pos) / r_all**2
    return total / len(P)


@pytest.mark.parametrize("tau", [0.01, 0.1])
def test_query_gradient_is_appendix_eq14(tau):
    torch.manual_seed(29)
    v = torch.nn.functional.normalize(torch.randn(9, 5, dtype=torch.float64), dim=1)
    q = torch.nn.functional.normalize(torch.randn(5, dtype=torch.float64), dim=0).requires_grad_(True)
    positive = torch.tensor([1, 0, 1, 0, 0, 1, 0, 1, 0], dtype=torch.bool)
    ap, has_pos = smooth_ap_per_query((v @ q)[None, :], positive[None, :], torch.ones(1, 9, dtype=torch.bool), tau)
    assert bool(has_pos[0])
    (grad,) = torch.autograd.grad(ap[0], q)
    expected = eq14_gradient(q.detach(), v, positive, tau)
    assert expected.abs().max() > 1e-6
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-13)


def test_equals_pml_with_query_included_on_its_layout():
    # PML 2.9 needs equal contiguous classes and groups in blocks of #classes: 4 classes × 4 samples
    torch.manual_seed(30)
    x = torch.randn(16, 8, dtype=torch.float64)
    y = torch.arange(16) // 4
    xo, xp = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ours = SmoothAPLoss(include_query=True)(xo, y)
    pml = losses.SmoothAPLoss(temperature=0.01)(xp, y)
    assert ours.item() == pytest.approx(pml.item(), abs=1e-6)  # PML accumulates AP in float32
    ours.backward()
    pml.backward()
    torch.testing.assert_close(xo.grad, xp.grad.to(torch.float64), rtol=1e-4, atol=1e-6)


def test_any_label_layout_matches_permuted_batch():
    torch.manual_seed(31)
    x = torch.randn(14, 6, dtype=torch.float64)
    y = torch.tensor([3, 1, 3, 0, 1, 1, 7, 3, 0, 9, 1, 0, 3, 7])
    perm = torch.randperm(14)
    loss = SmoothAPLoss()
    assert loss(x, y).item() == pytest.approx(loss(x[perm], y[perm]).item(), rel=1e-12)


def test_bad_temperature():
    with pytest.raises(LossInputError):
        SmoothAPLoss(temperature=0.0)


def test_no_positive_anywhere_gives_zero_with_zero_gradient():
    torch.manual_seed(61)
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([5, 1, 0, 3, 2, 8])  # every label once: no query has a positive
    loss = SmoothAPLoss()(x, y)
    assert loss.item() == 0.0
    assert loss.grad_fn is not None
    loss.backward()
    assert torch.equal(x.grad, torch.zeros_like(x))
    # with the query included every query is its own positive: an ordinary (non-zero) value
    assert SmoothAPLoss(include_query=True, temperature=0.1)(x.detach(), y).item() > 0.0


def smooth_ap_direct(x, y, tau):
    """O(B³) Smooth-AP with the query among its own positives (the authors' code / PML's definition),
    positives found from the labels, not from the batch layout."""
    xn = torch.nn.functional.normalize(x, dim=1)
    s = xn @ xn.t()
    aps = []
    for q in range(len(y)):
        positives = [i for i in range(len(y)) if y[i] == y[q]]
        ratios = []
        for i in positives:
            g = torch.sigmoid((s[q] - s[q, i]) / tau)  # G(D_ij), D_ij = s_qj − s_qi
            g[i] = 0.0
            ratios.append((1 + g[positives].sum()) / (1 + g.sum()))
        aps.append(torch.stack(ratios).mean())
    return 1 - torch.stack(aps).mean()


@pytest.mark.parametrize("layout", ["interleaved_4x4", "blocks_3x4"])
def test_documented_difference_pml_needs_blocks_of_size_num_classes(layout):
    torch.manual_seed(64)
    if layout == "interleaved_4x4":
        y = torch.arange(16) % 4  # equal classes (PML accepts them) but not contiguous
    else:
        y = torch.arange(12) // 4  # contiguous blocks of 4, but PML groups blocks of #classes = 3
    x = torch.randn(len(y), 6, dtype=torch.float64)
    ours = SmoothAPLoss(temperature=0.05, include_query=True)(x, y).item()
    assert ours == pytest.approx(smooth_ap_direct(x, y, 0.05).item(), rel=1e-12)
    pml = losses.SmoothAPLoss(temperature=0.05)(x, y).item()
    assert abs(pml - ours) > 1e-3
    if layout == "interleaved_4x4":  # the same batch sorted into blocks of 4: PML agrees with ours
        order = torch.argsort(y, stable=True)
        assert losses.SmoothAPLoss(temperature=0.05)(x[order], y[order]).item() == pytest.approx(ours, abs=1e-6)

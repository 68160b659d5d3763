"""MarginLoss: hand-computed case (incl. the learnable per-class β), gradcheck, pytorch-metric-learning."""

import math

import pytest
import torch
from pytorch_metric_learning import losses

from caffe_compat.losses.loss_errors import LossInputError
from caffe_compat.losses.margin import MarginLoss
from caffe_compat.losses.miners import DistanceWeightedMiner, EasyPositiveMiner, PairSelection, select_pairs


def test_all_pairs_by_hand_with_per_class_beta():
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-0.6, 0.8]], dtype=torch.float64)
    y = torch.tensor([0, 0, 1])
    # D01 = √2, D02 = √3.2, D12 = √0.4; α = 0.2
    shared = MarginLoss(distance_weighted=False).double()
    with torch.no_grad():
        shared.beta.fill_(1.2)  # exactly 1.2 in float64 (the float32 initial value is 1.2000000477)
    # positives (0,1),(1,0): 0.2 + √2 − 1.2; negatives (1,2),(2,1): 0.2 − √0.4 + 1.2; (0,2),(2,0): < 0
    expected = (2 * (math.sqrt(2) - 1) + 2 * (1.4 - math.sqrt(0.4))) / 4
    assert shared(x, y).item() == pytest.approx(expected, rel=1e-12)
    per_class = MarginLoss(num_classes=2, distance_weighted=False).double()
    with torch.no_grad():
        per_class.beta.copy_(torch.tensor([1.2, 1.0], dtype=torch.float64))  # anchor 2 (class 1) uses β = 1.0
    loss = per_class(x, y)
    expected = (2 * (math.sqrt(2) - 1) + (1.4 - math.sqrt(0.4)) + (1.2 - math.sqrt(0.4))) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    loss.backward()
    # ∂/∂β_0: two positive terms (−1 each) and negative (1,2) (+1); ∂/∂β_1: negative (2,1) (+1)
    torch.testing.assert_close(per_class.beta.grad, torch.tensor([-0.25, 0.25], dtype=torch.float64))


def test_gradcheck():
    torch.manual_seed(21)
    x = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])
    loss = MarginLoss(num_classes=3, distance_weighted=False).double()
    beta = torch.tensor([1.1, 0.9, 1.3], dtype=torch.float64, requires_grad=True)
    run = lambda e, b: torch.func.functional_call(loss, {"beta": b}, (e, y))  # β as a gradcheck input
    assert torch.autograd.gradcheck(run, (x, beta))


class _AllTripletsAsPairs:
    """PML's "all" triplets written as pair counts: w⁺_ap = |N_a|, w⁻_an = |P_a|."""

    def __call__(self, embeddings, labels):
        full = select_pairs(None, embeddings, labels)
        return PairSelection(full.pos * full.neg.sum(1, keepdim=True), full.neg * full.pos.sum(1, keepdim=True))


@pytest.mark.parametrize("num_classes", [None, 6])
def test_equals_pml_margin_loss_all_triplets(num_classes):
    torch.manual_seed(22)
    x = torch.randn(30, 8, dtype=torch.float64)
    y = torch.arange(30) // 5
    ours_fn = MarginLoss(num_classes=num_classes, distance_weighted=False, miner=_AllTripletsAsPairs()).double()
    pml_fn = losses.MarginLoss(margin=0.2, beta=1.2, learn_beta=True, num_classes=num_classes)
    xo, xp = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ours, pml = ours_fn(xo, y), pml_fn(xp, y)
    assert ours.item() == pytest.approx(pml.item(), rel=1e-10)
    ours.backward()
    pml.backward()
    torch.testing.assert_close(xo.grad, xp.grad, rtol=1e-8, atol=1e-12)
    # PML keeps β and its gradient in float32
    torch.testing.assert_close(ours_fn.beta.grad, pml_fn.beta.grad.double(), rtol=2e-5, atol=1e-7)


def test_equals_pml_on_distance_weighted_triplets():
    torch.manual_seed(23)
    x = torch.randn(32, 16, dtype=torch.float64)
    y = torch.arange(32) // 4
    miner = DistanceWeightedMiner(generator=torch.Generator().manual_seed(0))
    mined = miner(x, y)
    # Wu's triplets (a, p, n_ap): every positive once, the drawn negatives with their counts
    a, p = torch.nonzero(mined.pos, as_tuple=True)
    negs = [n for anchor in range(32) for n in torch.nonzero(mined.neg[anchor]).flatten().tolist()
            for _ in range(int(mined.neg[anchor, n]))]
    anchors_n = [anchor for anchor in range(32) for n in torch.nonzero(mined.neg[anchor]).flatten().tolist()
                 for _ in range(int(mined.neg[anchor, n]))]
    assert anchors_n == a.tolist()  # one draw per positive, anchors in the same order
    triplets = (a, p, torch.tensor(negs))

    class Fixed:
        def __call__(self, e, lbl):
            return mined

    ours = MarginLoss(distance_weighted=False, miner=Fixed()).double()(x, y)
    pml = losses.MarginLoss(margin=0.2, beta=1.2)(x, y, triplets)
    assert ours.item() == pytest.approx(pml.item(), rel=1e-10)


def test_default_is_distance_weighted_and_labels_checked():
    loss = MarginLoss(num_classes=3)
    assert isinstance(loss.miner, DistanceWeightedMiner)
    assert (loss.miner.cutoff, loss.miner.nonzero_loss_cutoff, loss.margin) == (0.5, 1.4, 0.2)
    assert loss.beta.requires_grad and loss.beta.shape == (3,)
    with pytest.raises(LossInputError):
        loss(torch.randn(4, 3), torch.tensor([0, 1, 2, 3]))
    torch.manual_seed(24)
    value = loss(torch.randn(12, 3), torch.arange(12) // 4)
    assert value.item() > 0


def test_easy_positive_sampling_by_hand():
    # class 0: anchor (1,0), easy positive (0.8,0.6) [D=√0.4], far positive (−1,0) [D=2]; class 1: (0,1)
    x = torch.tensor([[1.0, 0.0], [0.8, 0.6], [-1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    y = torch.tensor([0, 0, 0, 1])
    loss = MarginLoss(distance_weighted=False, miner=EasyPositiveMiner()).double()
    with torch.no_grad():
        loss.beta.fill_(1.2)
    d = torch.cdist(x, x)
    # easy positives: 0->1, 1->0, 2->1 (D21 = √3.6 < D20 = 2); 3 has none.  Negatives: all pairs with 3.
    terms = [0.2 + d[0, 1] - 1.2, 0.2 + d[1, 0] - 1.2, 0.2 + d[2, 1] - 1.2]
    terms += [0.2 - d[i, j] + 1.2 for i, j in [(0, 3), (1, 3), (2, 3), (3, 0), (3, 1), (3, 2)]]
    positive = [t.item() for t in terms if t > 0]
    assert loss(x, y).item() == pytest.approx(sum(positive) / len(positive), rel=1e-12)

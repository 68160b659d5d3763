"""Miners: VTHM (= PML's MultiSimilarityMiner), easy positives, distance weighted sampling; the pair counts a
loss uses (``Miner.selection``) and the static form of the distance weighted draws."""

import math

import pytest
import torch
from pytorch_metric_learning import miners

from caffe_compat.losses import miners as our_miners
from caffe_compat.losses.loss_errors import LossInputError
from caffe_compat.losses.miners import DistanceWeightedMiner, EasyPositiveMiner, TripletMiner, VTHMMiner

A = 1 / math.sqrt(2)


def as_set(matrix):
    return {tuple(ij) for ij in torch.nonzero(matrix).tolist()}


def test_vthm_by_hand():
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [A, A], [-A, -A], [1.0, 0.05]], dtype=torch.float64)
    y = torch.tensor([0, 0, 1, 2, 2])
    mined = VTHMMiner(0.1)(x, y)
    # anchor 0: positive 1 (s=0); negatives 2 (a), 3 (−a), 4 (≈1): keep negatives with s > −0.1 -> 2, 4
    # its positive (s=0) is kept since 0 < max negative (≈1) + 0.1
    assert {j for i, j in as_set(mined.neg) if i == 0} == {2, 4}
    assert {j for i, j in as_set(mined.pos) if i == 0} == {1}
    # anchor 3: positive 4 (s≈−a) < max negative (≈ −0.05·a…) + 0.1 -> kept; negatives with s > −a − 0.1
    s = torch.nn.functional.normalize(x, dim=1) @ torch.nn.functional.normalize(x, dim=1).t()
    keep3 = {j for j in (0, 1, 2) if s[3, j] > s[3, 4] - 0.1}
    assert {j for i, j in as_set(mined.neg) if i == 3} == keep3
    # anchor 2: no positive -> nothing
    assert not any(i == 2 for i, _ in as_set(mined.pos) | as_set(mined.neg))


def test_vthm_equals_pml_multi_similarity_miner():
    torch.manual_seed(32)
    x = torch.randn(40, 8)
    y = torch.randint(0, 6, (40,))
    for eps in (0.05, 0.1, 0.4):
        mined = VTHMMiner(eps)(x, y)
        a1, p, a2, n = miners.MultiSimilarityMiner(epsilon=eps)(x, y)
        assert as_set(mined.pos) == set(zip(a1.tolist(), p.tolist()))
        assert as_set(mined.neg) == set(zip(a2.tolist(), n.tolist()))


def test_easy_positive_by_hand():
    x = torch.tensor([[0.0, 0.0], [1.0, 0.0], [3.0, 0.0], [0.0, 1.0], [0.0, 2.5]], dtype=torch.float64)
    y = torch.tensor([0, 0, 0, 1, 1])
    mined = EasyPositiveMiner(normalize=False)(x, y)
    # nearest same-class sample: 0->1, 1->0, 2->1, 3->4, 4->3
    assert as_set(mined.pos) == {(0, 1), (1, 0), (2, 1), (3, 4), (4, 3)}
    assert as_set(mined.neg) == {(i, j) for i in range(5) for j in range(5) if y[i] != y[j]}


def test_distance_weighted_probabilities_by_hand():
    # 4-D unit vectors: anchor e0; negatives at distance √2 (≥ 1.4: weight 0), 1, and 0.2 (clamped to 0.5)
    n = 4
    e = torch.eye(4, dtype=torch.float64)
    far = e[1]  # D = √2 ≥ 1.4: excluded
    mid = torch.tensor([0.5, math.sqrt(0.75), 0, 0], dtype=torch.float64)  # D = 1
    near = torch.tensor([0.98, 0, math.sqrt(1 - 0.98**2), 0], dtype=torch.float64)  # D = 0.2 -> clamped to 0.5
    x = torch.stack([e[0], e[0], far, mid, near])  # sample 1 = the positive of 0
    y = torch.tensor([0, 0, 1, 2, 3])
    probs = DistanceWeightedMiner().negative_probabilities(x, y)

    def inv_q(d):  # 1 / q(d) = d^(2−n) · (1 − d²/4)^(−(n−3)/2)
        return d ** (2 - n) * (1 - d * d / 4) ** (-(n - 3) / 2)

    w_mid, w_near = inv_q(1.0), inv_q(0.5)
    torch.testing.assert_close(probs[0], torch.tensor([0, 0, 0, w_mid / (w_mid + w_near), w_near / (w_mid + w_near)], dtype=torch.float64))


def test_distance_weighted_draws_one_negative_per_positive():
    torch.manual_seed(33)
    x = torch.randn(24, 16)
    y = torch.tensor([0] * 5 + [1] * 4 + [2] * 6 + [3] * 3 + [4] * 5 + [5])
    mined = DistanceWeightedMiner(generator=torch.Generator().manual_seed(1))(x, y)
    positives = (y[:, None] == y[None, :]).sum(1) - 1
    torch.testing.assert_close(mined.neg.sum(1), positives.to(mined.neg.dtype))
    assert ((mined.neg > 0) <= (y[:, None] != y[None, :])).all()
    torch.testing.assert_close(mined.pos.sum(1), positives.to(mined.pos.dtype))


def test_distance_weighted_frequencies_follow_probabilities():
    torch.manual_seed(34)
    x = torch.randn(6, 3, dtype=torch.float64)
    y = torch.tensor([0, 0, 1, 2, 3, 4])
    miner = DistanceWeightedMiner(generator=torch.Generator().manual_seed(2))
    probs = miner.negative_probabilities(x, y)[0]
    counts = sum(miner(x, y).neg[0] for _ in range(1500))
    torch.testing.assert_close(counts / counts.sum(), probs, atol=0.05, rtol=0)


def test_bad_cutoffs():
    with pytest.raises(LossInputError):
        DistanceWeightedMiner(cutoff=1.5, nonzero_loss_cutoff=1.4)


def test_documented_difference_no_candidate_negative_draws_uniformly(monkeypatch):
    """Anchors 0–2 (class 0, all e0) have every negative at distance √2 ≥ 1.4: we draw uniformly among
    their 7 negatives, PML's weights are NaN there (its anchors are dropped); the other rows agree."""
    from pytorch_metric_learning.utils import loss_and_miner_utils as lmu

    rest = torch.nn.functional.normalize(torch.randn(7, 4, generator=torch.Generator().manual_seed(5),
                                                     dtype=torch.float64), dim=1)
    x = torch.cat([torch.eye(5, dtype=torch.float64)[:1].repeat(3, 1),
                   torch.cat([torch.zeros(7, 1, dtype=torch.float64), rest], dim=1)])  # rest ⟂ e0
    y = torch.tensor([0, 0, 0, 1, 1, 2, 2, 3, 3, 4])
    miner = DistanceWeightedMiner(generator=torch.Generator().manual_seed(6))
    probs = miner.negative_probabilities(x, y)
    torch.testing.assert_close(probs[:3, 3:], torch.full((3, 7), 1 / 7, dtype=torch.float64))

    captured = {}
    original = lmu.get_random_triplet_indices

    def capture(labels, ref_labels=None, t_per_anchor=None, weights=None):
        captured["weights"] = weights.clone()
        return original(labels, ref_labels=ref_labels, t_per_anchor=t_per_anchor, weights=weights)

    monkeypatch.setattr(lmu, "get_random_triplet_indices", capture)
    anchors, _, _ = miners.DistanceWeightedMiner(cutoff=0.5, nonzero_loss_cutoff=1.4)(x, y)
    pml = captured["weights"]
    assert torch.isnan(pml[:3]).all() and not (anchors < 3).any()
    assert (probs[3:].sum(1) > 0).all()  # every other anchor has a candidate: there both agree
    torch.testing.assert_close(probs[3:], pml[3:], rtol=1e-10, atol=1e-12)

    # the uniform choice, statistically: 500 batches, 2 draws per anchor 0–2 each (one per positive)
    counts = sum(miner(x, y).neg[:3].sum(0) for _ in range(500))
    assert counts[:3].sum() == 0 and counts.sum() == 3000
    expected = 3000 / 7
    chi2 = ((counts[3:] - expected) ** 2 / expected).sum().item()
    assert chi2 < 22.46  # χ²(6 d.o.f.) at p = 0.001


def _labelled_batch(seed: int):
    """24 rows in 6 classes of 1 to 6 samples (one singleton: an anchor without positive that draws nothing)."""
    x = torch.randn(24, 8, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return x, torch.tensor([0] * 5 + [1] * 4 + [2] * 6 + [3] * 3 + [4] * 5 + [5])


@pytest.mark.parametrize("make", [
    VTHMMiner, EasyPositiveMiner, TripletMiner,
    lambda: DistanceWeightedMiner(generator=torch.Generator().manual_seed(4)),
], ids=["vthm", "easy_positive", "triplet", "distance_weighted"])
def test_selection_is_the_miners_pair_counts_without_its_tuple(make):
    """What a loss's ``miner=`` reads: the ``pos`` / ``neg`` counts of the tuple, bit for bit, built without
    it (its length is read on the host: CUDA-graph capture cannot hold that)."""
    x, y = _labelled_batch(7)
    mined, selection = make()(x, y), make().selection(x, y)
    assert torch.equal(selection.pos, mined.pos) and torch.equal(selection.neg, mined.neg)
    assert float(selection.neg.sum()) > 0


def test_distance_weighted_static_form_draws_r_per_anchor_and_counts_the_first_positives(monkeypatch):
    """In the static form (``torch.compile``, CUDA-graph capture) every anchor draws R = 24 times (a bound on
    its positives, so no count is read on the host) from its probabilities, an anchor that draws nothing
    from all rows; its first |P_a| draws count, one per positive, in the tuple's row-major order."""
    monkeypatch.setattr(our_miners, "static_form", lambda t: True)
    x, y = _labelled_batch(8)
    mined = DistanceWeightedMiner(generator=torch.Generator().manual_seed(9))(x, y)
    probs = DistanceWeightedMiner().negative_probabilities(x, y)
    positives = (y[:, None] == y[None, :]).sum(1) - 1
    drawing = positives > 0
    picks = torch.multinomial(torch.where(drawing[:, None], probs, 1.0), 24, replacement=True,
                              generator=torch.Generator().manual_seed(9))
    expected, negatives = torch.zeros(24, 24, dtype=torch.float64), []
    for a in range(24):
        for k in range(int(positives[a])):
            expected[a, picks[a, k]] += 1
            negatives.append(int(picks[a, k]))
    assert torch.equal(mined.neg, expected)
    assert mined[2].tolist() == negatives and mined[0].tolist() == sorted(mined[0].tolist())
    assert not drawing[23] and float(mined.neg[23].sum()) == 0 and float(mined.pos[23].sum()) == 0
    assert ((mined.neg > 0) <= (probs > 0)).all()

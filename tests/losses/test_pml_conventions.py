"""pytorch-metric-learning's calling conventions: ``loss(embeddings, labels, indices_tuple, ref_emb,
ref_labels)`` and ``miner(embeddings, labels, ref_emb, ref_labels)`` -> index tuples.

The training-loop test runs one PML loop text with PML's loss and miner objects, then with ours.
Where the definitions coincide the loss values agree to a tolerance derived from the computation:

* ``MultiSimilarityLoss()`` + ``VTHMMiner(0.1)`` = PML's ``MultiSimilarityLoss()`` +
  ``MultiSimilarityMiner(epsilon=0.1)``: the same float64 formula on cosines, differing only in the
  order of the sums (≤ 2·32 terms per anchor, ~1e-16 each) and in how the normalisation rounds; one
  step moves the weights by lr·gradient with gradients equal to ~1e-15 relative, so after 6 steps the
  values agree to ~1e-14 relative (measured: 1.3e-16).  Asserted: ``rel=1e-12``.
* ``TripletLoss(0.2, squared=False, reduction="mean_nonzero")`` + ``TripletMiner(0.2, "semihard",
  squared=False)`` = PML's default ``TripletMarginLoss(0.2)`` + ``TripletMarginMiner(0.2,
  "semihard")``: our Euclidean distance is ``sqrt(|x − y|² + 1e-12)`` (finite gradient at 0), PML's
  ``torch.cdist``; for unit vectors at distance d that shifts d by ≤ 1e-12/(2d), and the mined
  distances of a semi-hard triplet are not tiny (d_an > d_ap), so for d ≥ 0.05 that is ≤ 1e-11 absolute
  per distance, ≤ 2e-11 per hinge and so per mean; on these losses (≈ 0.09) ≤ 3e-10 relative, plus
  the same drift through the steps (measured: 3.6e-12).  Asserted: ``rel=1e-9``.
* ``ContrastiveLoss`` does *not* coincide (ours: Caffe's Σℓ / (2·#pairs) with squared hinges by
  default; PML: positive and negative terms averaged separately over the non-zero ones).  With
  ``power=1`` and PML's ``SumReducer`` they are proportional: PML = 2·M·ours, M the number of mined
  pairs; the loop runs with both and the first step (same weights) is checked at ``rel=1e-9`` (same
  sqrt-eps bound as above; measured 1.9e-12); later steps differ since the gradients differ by that
  factor.

In every loop the mined index sets of both are checked equal at every step (the same pairs or
triplets are selected, so the values compare the losses only).
"""

from __future__ import annotations

import re

import pytest
import torch
from pytorch_metric_learning import distances, losses, miners, reducers
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu
from sklearn.datasets import load_digits

from caffe_compat.errors import CaffeCompatError
from caffe_compat.losses import (
    BinomialDevianceLoss, ContrastiveLoss, DistanceWeightedMiner, EasyPositiveMiner, FAPPYLoss, FastAPLoss,
    HistogramLoss, LiftedStructLoss, MarginLoss, MultiSimilarityLoss, RAWLoss, SmoothAPLoss, TripletLoss,
    TripletMiner, VTHMMiner,
)
from caffe_compat.losses.loss_errors import LossArgumentError, LossInputError
from caffe_compat.losses.miners import Mined
from caffe_compat.losses.pairwise import selection_from_tuple

DIGITS = load_digits()


def pml_training_loop(loss_func, miner, steps=6, seed=0):
    """A PML-style training loop on sklearn's digits (8 classes × 4 samples per batch), float64.
    Returns the loss value and the mined index tuple of every step."""
    torch.manual_seed(seed)
    data = torch.tensor(DIGITS.data / 16.0, dtype=torch.float64)
    targets = torch.tensor(DIGITS.target)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = torch.Generator().manual_seed(seed)
    history = []
    for _ in range(steps):
        classes = torch.randperm(10, generator=sampler)[:8]
        batch = torch.cat([torch.nonzero(targets == c).flatten()[torch.randperm(int((targets == c).sum()),
                                                                                 generator=sampler)[:4]]
                           for c in classes])
        embeddings = model(data[batch])
        labels = targets[batch]
        indices_tuple = miner(embeddings, labels)
        loss = loss_func(embeddings, labels, indices_tuple)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        history.append((loss.item(), indices_tuple))
    return history


def index_set(indices_tuple):
    """The multiset of pairs / triplets of a tuple, order-free (PML's MS miner sorts by similarity)."""
    if len(indices_tuple) == 3:
        return sorted(zip(*(t.tolist() for t in indices_tuple)))
    a1, p, a2, n = (t.tolist() for t in indices_tuple)
    return sorted(zip(a1, p)), sorted(zip(a2, n))


LOOPS = {
    "multi_similarity": (
        lambda: (losses.MultiSimilarityLoss(), miners.MultiSimilarityMiner(epsilon=0.1)),
        lambda: (MultiSimilarityLoss(), VTHMMiner(0.1)),
        1e-12,
    ),
    "triplet_semihard": (
        lambda: (losses.TripletMarginLoss(margin=0.2),
                 miners.TripletMarginMiner(margin=0.2, type_of_triplets="semihard")),
        lambda: (TripletLoss(margin=0.2, squared=False, reduction="mean_nonzero"),
                 TripletMiner(margin=0.2, triplets="semihard", squared=False)),
        1e-9,
    ),
}


@pytest.mark.parametrize("name", sorted(LOOPS))
def test_pml_training_loop_gives_pml_values_with_our_objects(name):
    make_pml, make_ours, rel = LOOPS[name]
    pml = pml_training_loop(*make_pml())
    ours = pml_training_loop(*make_ours())
    for step, ((pml_value, pml_tuple), (our_value, our_tuple)) in enumerate(zip(pml, ours)):
        assert index_set(our_tuple) == index_set(pml_tuple), step
        assert len(our_tuple[0]) > 0, step
        assert our_value == pytest.approx(pml_value, rel=rel), step
    assert len({round(v, 6) for v, _ in ours}) > 1  # it trains: the values change


def test_pml_training_loop_contrastive_runs_and_is_proportional_at_the_first_step():
    pml = pml_training_loop(
        losses.ContrastiveLoss(pos_margin=0, neg_margin=1, reducer=reducers.SumReducer(),
                               distance=distances.LpDistance(normalize_embeddings=False)),
        miners.MultiSimilarityMiner(epsilon=0.1))
    ours = pml_training_loop(ContrastiveLoss(margin=1.0, power=1), VTHMMiner(0.1))
    (pml_value, pml_tuple), (our_value, our_tuple) = pml[0], ours[0]
    assert index_set(our_tuple) == index_set(pml_tuple)
    mined_pairs = len(our_tuple[0]) + len(our_tuple[2])
    assert 2 * mined_pairs * our_value == pytest.approx(pml_value, rel=1e-9)
    assert all(torch.isfinite(torch.tensor(v)) for v, _ in ours)


# ----------------------------------------------------------------------------- indices_tuple forms


def batch(seed=40, b=24, d=8, classes=6):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, d, dtype=torch.float64, generator=g), torch.arange(b) % classes


PAIR_LOSSES = {
    "contrastive": lambda miner=None: ContrastiveLoss(miner=miner),
    "lifted": lambda miner=None: LiftedStructLoss(miner=miner),
    "binomial": lambda miner=None: BinomialDevianceLoss(miner=miner),
    "raw": lambda miner=None: RAWLoss(vthm=False, miner=miner),
    "multi_similarity": lambda miner=None: MultiSimilarityLoss(miner=miner),
    "margin": lambda miner=None: MarginLoss(distance_weighted=False, miner=miner).double(),
    "triplet": lambda miner=None: TripletLoss(miner=miner),
}


class Fixed:
    """A constructor miner returning a fixed tuple (as an old-style miner would)."""

    def __init__(self, mined):
        self.mined = mined

    def __call__(self, embeddings, labels):
        return self.mined


@pytest.mark.parametrize("name", sorted(PAIR_LOSSES))
def test_pair_tuple_at_call_equals_the_same_miner_in_the_constructor(name):
    x, y = batch()
    mined = VTHMMiner(0.3)(x, y)
    at_call = PAIR_LOSSES[name]()(x, y, mined)
    in_constructor = PAIR_LOSSES[name](VTHMMiner(0.3))(x, y)
    assert at_call.item() == in_constructor.item()
    plain = tuple(t.clone() for t in mined)  # a plain tuple (as PML's miners return) works the same
    assert PAIR_LOSSES[name]()(x, y, plain).item() == at_call.item()


@pytest.mark.parametrize("name", sorted(set(PAIR_LOSSES) - {"triplet"}))
def test_triplet_tuple_given_to_a_pair_loss_is_its_pairs(name):
    x, y = batch(41)
    a, p, n = TripletMiner(0.5, "semihard")(x, y)
    assert len(a) > 0
    assert PAIR_LOSSES[name]()(x, y, (a, p, n)).item() == PAIR_LOSSES[name]()(x, y, (a, p, a, n)).item()


def test_pair_tuple_given_to_triplet_loss_is_every_triplet_from_it():
    x, y = batch(42)
    pairs = EasyPositiveMiner()(x, y)
    as_triplets = lmu.convert_to_triplets(tuple(pairs), y)
    for kind in ("all", "semihard", "hard"):
        for reduction in ("mean", "mean_nonzero", "sum"):
            loss = TripletLoss(margin=0.3, triplets=kind, reduction=reduction)
            assert loss(x, y, pairs).item() == pytest.approx(loss(x, y, as_triplets).item(), rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("squared", [False, True])
def test_triplet_tuple_equals_pml_triplet_margin_loss(squared):
    x, y = batch(43)
    dist = distances.LpDistance(power=2 if squared else 1)
    triplets = miners.TripletMarginMiner(margin=0.2, type_of_triplets="all", distance=dist)(x, y)
    xo, xp = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ours = TripletLoss(margin=0.2, squared=squared, reduction="mean_nonzero")(xo, y, triplets)
    pml = losses.TripletMarginLoss(margin=0.2, distance=dist)(xp, y, triplets)
    assert ours.item() == pytest.approx(pml.item(), rel=1e-10)  # sqrt(·+1e-12) vs cdist, see module doc
    ours.backward()
    pml.backward()
    torch.testing.assert_close(xo.grad, xp.grad, rtol=1e-8, atol=1e-12)


def test_triplet_tuple_by_hand_with_sets_and_reductions():
    x, y = batch(44, b=9, d=3, classes=3)
    a, p, n = torch.tensor([0, 0, 1, 4, 4]), torch.tensor([3, 6, 4, 1, 7]), torch.tensor([1, 2, 0, 5, 3])
    xn = torch.nn.functional.normalize(x, dim=1)
    d = torch.cdist(xn, xn) ** 2
    d_ap, d_an = d[a, p], d[a, n]
    hinge = torch.relu(d_ap - d_an + 0.5)
    for kind, keep in (("all", torch.ones_like(d_ap, dtype=torch.bool)),
                       ("semihard", (d_ap < d_an) & (d_an <= d_ap + 0.5)),
                       ("hard", d_an <= d_ap)):
        sel = hinge[keep]
        expected = {"sum": sel.sum(), "mean": sel.sum() / max(len(sel), 1),
                    "mean_nonzero": sel.sum() / max(int((sel > 0).sum()), 1)}
        for reduction, value in expected.items():
            got = TripletLoss(margin=0.5, triplets=kind, reduction=reduction)(x, y, (a, p, n))
            assert got.item() == pytest.approx(value.item(), rel=1e-10, abs=1e-12), (kind, reduction)


@pytest.mark.parametrize("name", sorted(PAIR_LOSSES))
def test_empty_tuple_gives_zero_with_a_gradient(name):
    x, y = batch(45)
    x.requires_grad_(True)
    empty = torch.tensor([], dtype=torch.long)
    for indices_tuple in ((empty, empty, empty), (empty, empty, empty, empty)):
        value = PAIR_LOSSES[name]()(x, y, indices_tuple)
        if name in ("raw", "multi_similarity", "binomial"):  # log(1 + 0) terms / 0-weight means
            assert value.item() == pytest.approx(0.0, abs=1e-12) or value.item() > 0
        else:
            assert value.item() == 0.0
        value.backward()
        assert torch.isfinite(x.grad).all()
        x.grad = None


def test_indices_tuple_replaces_the_default_miner():
    x, y = batch(46)
    pairs = VTHMMiner(0.05)(x, y)
    assert RAWLoss()(x, y, pairs).item() == RAWLoss(vthm=False)(x, y, pairs).item()  # VTHM(0.1) not run
    assert RAWLoss()(x, y, pairs).item() != RAWLoss()(x, y).item()
    triplets = TripletMiner(0.4, "all")(x, y)
    pml = losses.MarginLoss(margin=0.2, beta=1.2)(x, y, triplets)
    assert MarginLoss()(x, y, triplets).item() == pytest.approx(pml.item(), rel=1e-10)  # DW miner not run


def test_int32_and_list_tuples_accepted():
    x, y = batch(47)
    mined = VTHMMiner()(x, y)
    expected = MultiSimilarityLoss()(x, y, mined).item()
    assert MultiSimilarityLoss()(x, y, [t.int() for t in mined]).item() == expected


# ----------------------------------------------------------------------------- miners' tuples


@pytest.mark.parametrize("miner, size", [(VTHMMiner(), 4), (EasyPositiveMiner(), 4), (TripletMiner(), 3),
                                         (DistanceWeightedMiner(generator=torch.Generator().manual_seed(0)), 3)],
                         ids=lambda v: type(v).__name__ if not isinstance(v, int) else str(v))
def test_miners_return_pml_shaped_tuples_with_their_counts(miner, size):
    x, y = batch(48)
    mined = miner(x, y)
    assert isinstance(mined, tuple) and isinstance(mined, Mined) and len(mined) == size
    assert all(t.dtype == torch.long and t.dim() == 1 for t in mined)
    counts = selection_from_tuple(mined, 24, 24, torch.float64)
    torch.testing.assert_close(counts.pos, mined.pos, rtol=0, atol=0)
    torch.testing.assert_close(counts.neg, mined.neg, rtol=0, atol=0)
    same = y[:, None] == y[None, :]
    assert (same & ~torch.eye(24, dtype=torch.bool))[mined.pos > 0].all() and (~same)[mined.neg > 0].all()


def test_our_tuples_work_in_pml_losses_and_pml_miners_in_our_constructors():
    x, y = batch(49)
    ours, pml = VTHMMiner(0.1)(x, y), miners.MultiSimilarityMiner(epsilon=0.1)(x, y)
    assert losses.MultiSimilarityLoss()(x, y, ours).item() == pytest.approx(
        losses.MultiSimilarityLoss()(x, y, pml).item(), rel=1e-12)
    assert MultiSimilarityLoss(miner=miners.MultiSimilarityMiner(epsilon=0.1))(x, y).item() == pytest.approx(
        MultiSimilarityLoss(miner=VTHMMiner(0.1))(x, y).item(), rel=1e-12)
    dw = DistanceWeightedMiner(generator=torch.Generator().manual_seed(1))(x, y)
    assert losses.MarginLoss(margin=0.2, beta=1.2)(x, y, dw).item() == pytest.approx(
        MarginLoss(distance_weighted=False)(x, y, dw).item(), rel=1e-10)


def test_triplet_miner_equals_pml_triplet_margin_miner():
    x, y = batch(50)
    for kind in ("semihard", "hard"):
        for squared in (False, True):
            dist = distances.LpDistance(power=2 if squared else 1)
            pml = miners.TripletMarginMiner(margin=0.3, type_of_triplets=kind, distance=dist)(x, y)
            ours = TripletMiner(margin=0.3, triplets=kind, squared=squared)(x, y)
            assert index_set(ours) == index_set(pml), (kind, squared)


# ----------------------------------------------------------------------------- ref_emb / ref_labels


def reference(seed=51, r=18, d=8, classes=6):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(r, d, dtype=torch.float64, generator=g), torch.randint(0, classes, (r,), generator=g)


@pytest.mark.parametrize("self_reference", [False, True])
def test_ref_emb_equals_pml_cross_batch(self_reference):
    x, y = batch(52)
    r, ry = (x.clone(), y.clone()) if self_reference else reference()
    ref = dict(ref_emb=r, ref_labels=ry)
    assert MultiSimilarityLoss()(x, y, **ref).item() == pytest.approx(
        losses.MultiSimilarityLoss()(x, y, **ref).item(), rel=1e-12)
    ours_ms, pml_ms = VTHMMiner(0.1)(x, y, r, ry), miners.MultiSimilarityMiner(epsilon=0.1)(x, y, r, ry)
    assert index_set(ours_ms) == index_set(pml_ms)
    assert MultiSimilarityLoss()(x, y, ours_ms, **ref).item() == pytest.approx(
        losses.MultiSimilarityLoss()(x, y, pml_ms, **ref).item(), rel=1e-12)
    triplets = miners.TripletMarginMiner(margin=0.2, type_of_triplets="semihard")(x, y, r, ry)
    assert index_set(TripletMiner(0.2, "semihard", squared=False)(x, y, r, ry)) == index_set(triplets)
    triplet = TripletLoss(margin=0.2, squared=False, reduction="mean_nonzero")
    for t in (None, triplets):
        assert triplet(x, y, t, **ref).item() == pytest.approx(
            losses.TripletMarginLoss(margin=0.2)(x, y, t, **ref).item(), rel=1e-10)
    assert MarginLoss(distance_weighted=False)(x, y, triplets, **ref).item() == pytest.approx(
        losses.MarginLoss(margin=0.2, beta=1.2)(x, y, triplets, **ref).item(), rel=1e-10)
    # contrastive: every (query, reference) pair, self-pairs included: PML's sum = 2·B·R · ours
    pml_sum = losses.ContrastiveLoss(pos_margin=0, neg_margin=1, reducer=reducers.SumReducer(),
                                     distance=distances.LpDistance(normalize_embeddings=False))(x, y, **ref)
    ours = ContrastiveLoss(power=1)(x, y, **ref)
    # a self-pair has our distance sqrt(0 + 1e-12) = 1e-6 (PML: 0): B of them add B·1e-6 to the sum
    self_pairs = len(x) * 1e-6 if self_reference else 0.0
    assert 2 * len(x) * len(r) * ours.item() == pytest.approx(pml_sum.item() + self_pairs, rel=1e-9)


def test_ref_emb_is_not_self_excluded_and_gets_a_gradient():
    x, y = batch(53)
    r = x.clone().requires_grad_(True)
    with_self = MultiSimilarityLoss()(x, y, ref_emb=r, ref_labels=y)
    assert with_self.item() != MultiSimilarityLoss()(x, y).item()  # the diagonal (s = 1) is a positive
    with_self.backward()
    assert r.grad is not None and torch.isfinite(r.grad).all() and r.grad.abs().sum() > 0


def test_miners_with_ref():
    x, y = batch(54)
    r, ry = reference(55)
    eps = EasyPositiveMiner(normalize=False)(x, y, r, ry)
    d = torch.cdist(x, r)
    for a, p in zip(*eps[:2]):
        assert ry[p] == y[a] and d[a, p] == d[a][ry == y[a]].min()
    assert len(eps[2]) == int((y[:, None] != ry[None, :]).sum())
    a, p, n = DistanceWeightedMiner(generator=torch.Generator().manual_seed(2))(x, y, r, ry)
    assert (ry[p] == y[a]).all() and (ry[n] != y[a]).all() and len(a) == int((y[:, None] == ry[None, :]).sum())
    probs = DistanceWeightedMiner().negative_probabilities(x, y, r, ry)
    assert probs.shape == (24, 18) and torch.allclose(probs.sum(1), torch.ones(24, dtype=torch.float64))


@pytest.mark.parametrize("name", sorted(set(PAIR_LOSSES) - {"lifted"}))
def test_every_pair_loss_takes_ref_and_a_tuple_into_it(name):
    x, y = batch(56)
    r, ry = reference(57)
    mined = VTHMMiner(0.3)(x, y, r, ry)
    value = PAIR_LOSSES[name]()(x, y, mined, ref_emb=r, ref_labels=ry)
    assert value.item() == PAIR_LOSSES[name](VTHMMiner(0.3))(x, y, ref_emb=r, ref_labels=ry).item()
    assert torch.isfinite(value)


# ----------------------------------------------------------------------------- typed errors

NO_PML_ARGUMENTS = {
    "HistogramLoss": HistogramLoss, "FastAPLoss": FastAPLoss, "SmoothAPLoss": SmoothAPLoss,
    "FAPPYLoss (mode='caffe')": FAPPYLoss, "FAPPYLoss (mode='paper')": lambda: FAPPYLoss(mode="paper"),
}


@pytest.mark.parametrize("name", sorted(NO_PML_ARGUMENTS))
@pytest.mark.parametrize("argument", ["indices_tuple", "ref_emb", "ref_labels"])
def test_losses_without_a_meaning_for_an_argument_raise_naming_it(name, argument):
    x, y = batch(58)
    r, ry = reference()
    values = {"indices_tuple": VTHMMiner()(x, y), "ref_emb": r, "ref_labels": ry}
    kwargs = {argument: values[argument]}
    if argument == "ref_emb":
        kwargs["ref_labels"] = ry
    with pytest.raises(LossArgumentError, match="^" + re.escape(f"{name} takes no {argument}:")) as info:
        NO_PML_ARGUMENTS[name]()(x, y, **kwargs)
    assert isinstance(info.value, TypeError) and isinstance(info.value, CaffeCompatError)


def test_lifted_struct_takes_no_reference_set():
    x, y = batch(59)
    r, ry = reference()
    with pytest.raises(LossArgumentError, match="LiftedStructLoss takes no ref_emb"):
        LiftedStructLoss()(x, y, ref_emb=r, ref_labels=ry)


@pytest.mark.parametrize("bad, message", [
    ("pair", r"indices_tuple must be \(a, p, n\) triplets or \(a1, p, a2, n\) pairs"),
    ("float", r"indices_tuple's a must be a 1-D integer tensor"),
    ("range", r"indices_tuple's p must lie in \[0, 24\)"),
    ("lengths", r"indices_tuple lengths differ: a=2, p=2, n=1"),
    ("ref_only", r"ref_emb given without ref_labels"),
    ("labels_only", r"ref_labels given without ref_emb"),
    ("ref_dim", r"ref_emb \(18, 3\) .* expected \(R, 8\)"),
])
def test_malformed_pml_arguments_raise_loss_input_error(bad, message):
    x, y = batch(60)
    r, ry = reference()
    i = torch.tensor([0, 1])
    calls = {
        "pair": lambda: ContrastiveLoss()(x, y, (i, i)),
        "float": lambda: ContrastiveLoss()(x, y, (i.double(), i, i)),
        "range": lambda: ContrastiveLoss()(x, y, (i, i + 23, i)),
        "lengths": lambda: TripletLoss()(x, y, (i, i, i[:1])),
        "ref_only": lambda: ContrastiveLoss()(x, y, ref_emb=r),
        "labels_only": lambda: VTHMMiner()(x, y, ref_labels=ry),
        "ref_dim": lambda: MultiSimilarityLoss()(x, y, ref_emb=r[:, :3], ref_labels=ry),
    }
    with pytest.raises(LossInputError, match=message):
        calls[bad]()

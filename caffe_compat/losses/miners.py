"""Miners: which anchor-positive and anchor-negative pairs (or triplets) a loss should use.

A miner is called as pytorch-metric-learning's are, ``miner(embeddings, labels, ref_emb=None,
ref_labels=None)``, and returns PML's index tuple: a *pair miner* ``(a1, p, a2, n)``, a *triplet
miner* ``(a, p, n)``, long tensors on the embeddings' device (anchors index the batch, the others the
reference set, the batch itself without ``ref_emb``; with ``ref_emb`` no self-pair is excluded).  So
``loss(embeddings, labels, miner(embeddings, labels))`` works with our losses and with PML's.  The
tuple (a :class:`Mined`) also carries the same selection as two ``(B, R)`` float matrices ``pos`` and
``neg`` of *pair counts*, row = anchor (0 = not used, k = used k times, e.g. drawn k times by a
sampling miner; a triplet miner's pairs are those of its triplets, PML's ``convert_to_pairs``).  They
are computed without gradient and are always subsets of the label masks.

Passed to a loss's constructor (``miner=``), a miner works through these pair counts, as it always
has: every loss that takes ``miner=`` replaces its full positive/negative masks by them, so a miner
works in front of any pair loss and, by combining each anchor's mined positives with its mined
negatives, in front of the triplet loss.  (A triplet tuple passed at call time to
:class:`~caffe_compat.losses.TripletLoss` is used triplet by triplet instead, as in PML; for a pair
miner both are the same triplets.)  A foreign miner returning a plain PML tuple works there too.

Losses that accept ``miner=``: :class:`~caffe_compat.losses.ContrastiveLoss`,
:class:`~caffe_compat.losses.TripletLoss`, :class:`~caffe_compat.losses.LiftedStructLoss`,
:class:`~caffe_compat.losses.BinomialDevianceLoss`, :class:`~caffe_compat.losses.RAWLoss` (VTHM by
default), :class:`~caffe_compat.losses.MultiSimilarityLoss` and :class:`~caffe_compat.losses.MarginLoss`
(distance weighted by default).  :class:`~caffe_compat.losses.HistogramLoss`,
:class:`~caffe_compat.losses.FastAPLoss` and :class:`~caffe_compat.losses.SmoothAPLoss` do not: they are
histogram / list-wise losses over every pair of the batch (so is ``FAPPYLoss``).

Miners:

* :class:`VTHMMiner` (pairs) — valid triplet based hard mining ("A unified view of DML via gradient
  analysis", Sec. 5.1): with cosine similarities ``s`` of L2-normalised embeddings, a negative ``j`` of
  anchor ``i`` is kept when ``s_ij > min_{k∈P_i} s_ik − λ`` and a positive when ``s_ij < max_{k∈N_i}
  s_ik + λ``; λ = 0.1.  Identical to pytorch-metric-learning's ``MultiSimilarityMiner(epsilon=λ)``
  (with ``ref_emb`` too).
* :class:`EasyPositiveMiner` (pairs) — easy positive sampling (Levi et al., "Rethinking preventing
  class-collapsing", supplement B): each anchor keeps only its nearest same-class sample
  (``Φ(y_i, y_j)``, first index on ties) and all its negatives.
* :class:`TripletMiner` (triplets) — the triplet sets of :class:`~caffe_compat.losses.TripletLoss`
  (``"all"``, ``"semihard"``, ``"hard"``) as explicit triplets; ``semihard`` / ``hard`` are PML's
  ``TripletMarginMiner`` types (its ``"all"`` keeps only ``d_an ≤ d_ap + margin``; here every triplet).
* :class:`DistanceWeightedMiner` (triplets) — distance weighted sampling (Wu et al. 2017, Sec. 4): on
  Euclidean distances ``D`` of L2-normalised n-dimensional embeddings, clamped below at ``cutoff`` =
  0.5, each negative is drawn with probability ∝ ``q(D)^{-1}``, ``log q(D) = (n−2)·log D + (n−3)/2·log(1
  − D²/4)``, restricted to ``D < nonzero_loss_cutoff`` = 1.4 (pairs that can have a non-zero margin
  loss).  Per anchor one negative is drawn per positive: Wu's triplets ``(a, p, n_ap)``, so ``neg``
  holds counts.  An anchor whose candidate weights are all zero draws uniformly among its negatives
  (Wu's MXNet code draws uniformly among *all* samples there; PML leaves such rows NaN).  Under
  ``torch.compile`` and CUDA-graph capture every anchor draws R times and its first ``|P_a|`` draws count
  (fixed shapes, no host read): the same distribution, other draws than eagerly from the same seed.

A loss's ``miner=`` reads :meth:`Miner.selection`, the pair counts alone: the index tuple's length is
known only on the host, which a captured training step cannot read.
"""

from __future__ import annotations

import torch

from caffe_compat.losses.loss_errors import LossInputError
from caffe_compat.losses.batch_input import check_batch, check_reference
from caffe_compat.losses.pairwise import (
    TRIPLET_SETS, PairSelection, euclidean_matrix, in_triplet_set, label_masks, normalized_cosine_matrix,
    pairs_of_counts, select_pairs, selection_from_tuple, squared_euclidean_matrix, unit_rows,
)
from caffe_compat.losses.static_form import static_form

__all__ = ["DistanceWeightedMiner", "EasyPositiveMiner", "Mined", "Miner", "PairSelection", "TripletMiner",
           "VTHMMiner", "select_pairs"]


class Mined(tuple):
    """A miner's result: PML's index tuple (``(a1, p, a2, n)`` or ``(a, p, n)``, long tensors) that also
    carries the selection as ``(B, R)`` pair-count matrices :attr:`pos` and :attr:`neg`."""

    def __new__(cls, indices, selection: PairSelection):
        mined = super().__new__(cls, indices)
        mined.selection = selection
        return mined

    @classmethod
    def from_pairs(cls, selection: PairSelection) -> "Mined":
        """The pair tuple of count matrices, row-major (PML's order), repeated pairs listed repeatedly."""
        return cls((*pairs_of_counts(selection.pos), *pairs_of_counts(selection.neg)), selection)

    @classmethod
    def from_triplets(cls, triplets, n_query: int, n_ref: int, dtype) -> "Mined":
        return cls(triplets, selection_from_tuple(triplets, n_query, n_ref, dtype))

    @property
    def pos(self) -> torch.Tensor:
        return self.selection.pos

    @property
    def neg(self) -> torch.Tensor:
        return self.selection.neg


def _given_ref(ref, ref_labels, normalize: bool):
    """The reference rows to measure against: None (the batch itself) when no reference set was given."""
    return None if ref_labels is None else unit_rows(ref, normalize)


class Miner:
    """Base class: subclasses implement :meth:`mine`; calling the miner validates, detaches and returns
    a :class:`Mined` tuple (pairs when :meth:`mine` returns a :class:`PairSelection`).

    :meth:`selection` is what a loss's ``miner=`` uses: the same pair counts without the index tuple,
    whose length depends on the values (``torch.nonzero``), so that a training step reads nothing on the
    host and CUDA-graph capture can hold it (a miner whose selection itself needs the tuple overrides
    :meth:`select`)."""

    def __call__(self, embeddings: torch.Tensor, labels: torch.Tensor, ref_emb=None, ref_labels=None) -> Mined:
        mined = self._checked(self.mine, embeddings, labels, ref_emb, ref_labels)
        return Mined.from_pairs(mined) if isinstance(mined, PairSelection) else mined

    def selection(self, embeddings: torch.Tensor, labels: torch.Tensor, ref_emb=None, ref_labels=None
                  ) -> PairSelection:
        """The ``(B, R)`` pair counts of ``miner(embeddings, labels, ...)`` (:attr:`Mined.pos` and
        :attr:`Mined.neg`), without building the index tuple."""
        return self._checked(self.select, embeddings, labels, ref_emb, ref_labels)

    def _checked(self, method, embeddings, labels, ref_emb, ref_labels):
        name = type(self).__name__
        labels = check_batch(embeddings, labels, name)
        ref_emb, ref_labels = check_reference(embeddings, ref_emb, ref_labels, name)
        with torch.no_grad():
            ref = embeddings.detach() if ref_emb is None else ref_emb.detach()
            return method(embeddings.detach(), labels, ref, ref_labels)

    def mine(self, embeddings: torch.Tensor, labels: torch.Tensor, ref: torch.Tensor,
             ref_labels) -> PairSelection | Mined:
        """``ref`` is the reference rows (the batch itself when ``ref_labels`` is None)."""
        raise NotImplementedError

    def select(self, embeddings: torch.Tensor, labels: torch.Tensor, ref: torch.Tensor, ref_labels) -> PairSelection:
        """:meth:`mine`'s pair counts (validated and detached inputs, as :meth:`mine` gets them)."""
        mined = self.mine(embeddings, labels, ref, ref_labels)
        return mined if isinstance(mined, PairSelection) else mined.selection


class VTHMMiner(Miner):
    """Valid triplet based hard mining, margin λ (default 0.1, the paper's Sec. 6 value)."""

    def __init__(self, margin: float = 0.1):
        self.margin = float(margin)

    def mine(self, embeddings, labels, ref, ref_labels):
        sim = normalized_cosine_matrix(embeddings, ref)
        pos, neg = label_masks(labels, ref_labels)
        hardest_pos = sim.masked_fill(~pos, float("inf")).min(dim=1, keepdim=True).values
        hardest_neg = sim.masked_fill(~neg, float("-inf")).max(dim=1, keepdim=True).values
        keep_pos = pos & (sim - self.margin < hardest_neg)
        keep_neg = neg & (sim + self.margin > hardest_pos)
        return PairSelection(keep_pos.to(sim.dtype), keep_neg.to(sim.dtype))


class EasyPositiveMiner(Miner):
    """Easy positive sampling: the nearest same-class sample of each anchor, all its negatives.

    Nearness is the Euclidean distance of the embeddings, L2-normalised first when ``normalize``
    (default True, as for the margin and triplet losses it is paired with).
    """

    def __init__(self, normalize: bool = True):
        self.normalize = bool(normalize)

    def mine(self, embeddings, labels, ref, ref_labels):
        dist = euclidean_matrix(unit_rows(embeddings, self.normalize), _given_ref(ref, ref_labels, self.normalize))
        pos, neg = label_masks(labels, ref_labels)
        nearest = dist.masked_fill(~pos, float("inf")).argmin(dim=1)
        easy = torch.zeros_like(dist)
        easy[torch.arange(len(labels), device=dist.device), nearest] = 1.0
        return PairSelection(easy * pos.to(dist.dtype), neg.to(dist.dtype))


class TripletMiner(Miner):
    """Triplet miner: the triplets ``(a, p, n)`` of one of :class:`~caffe_compat.losses.TripletLoss`'s sets.

    Distance ``d``: squared Euclidean (``squared``, default True) or Euclidean of the L2-normalised
    (``normalize``, default True) embeddings.  ``triplets``: ``"semihard"`` (default, ``d_ap < d_an ≤
    d_ap + margin``), ``"hard"`` (``d_an ≤ d_ap``) or ``"all"`` (every triplet).  ``semihard`` / ``hard``
    with ``squared=False`` are PML's ``TripletMarginMiner(margin, type_of_triplets)`` on its default
    distance; with ``squared=True`` on ``LpDistance(power=2)``.  Builds the B·R² triplet mask, as PML does.
    """

    def __init__(self, margin: float = 0.2, triplets: str = "semihard", squared: bool = True, normalize: bool = True):
        if triplets not in TRIPLET_SETS:
            raise LossInputError(f"TripletMiner: triplets must be one of {TRIPLET_SETS}, got {triplets!r}")
        self.margin = float(margin)
        self.triplets = triplets
        self.squared = bool(squared)
        self.normalize = bool(normalize)

    def mine(self, embeddings, labels, ref, ref_labels):
        x, r = unit_rows(embeddings, self.normalize), _given_ref(ref, ref_labels, self.normalize)
        dist = squared_euclidean_matrix(x, r) if self.squared else euclidean_matrix(x, r)
        pos, neg = label_masks(labels, ref_labels)
        a, p, n = torch.where(pos[:, :, None] & neg[:, None, :])
        keep = in_triplet_set(dist[a, p], dist[a, n], self.margin, self.triplets)
        return Mined.from_triplets((a[keep], p[keep], n[keep]), dist.shape[0], dist.shape[1], dist.dtype)


class DistanceWeightedMiner(Miner):
    """Distance weighted negative sampling of Wu et al. (cutoff 0.5, nonzero-loss cutoff 1.4).

    ``generator`` (a ``torch.Generator`` on the embeddings' device) makes the draws reproducible.
    """

    def __init__(self, cutoff: float = 0.5, nonzero_loss_cutoff: float = 1.4, generator=None):
        if not 0.0 < cutoff < nonzero_loss_cutoff:
            raise LossInputError(
                f"DistanceWeightedMiner: need 0 < cutoff < nonzero_loss_cutoff, got {cutoff}, {nonzero_loss_cutoff}"
            )
        self.cutoff = float(cutoff)
        self.nonzero_loss_cutoff = float(nonzero_loss_cutoff)
        self.generator = generator

    def negative_probabilities(self, embeddings, labels, ref=None, ref_labels=None) -> torch.Tensor:
        """``(B, R)`` sampling probabilities of each anchor's negatives among the reference rows (the
        batch itself without ``ref_labels``; rows without negatives are 0)."""
        dim = embeddings.shape[1]
        dist = euclidean_matrix(unit_rows(embeddings), _given_ref(ref, ref_labels, True)).clamp_min(self.cutoff)
        _, neg = label_masks(labels, ref_labels)
        candidate = neg & (dist < self.nonzero_loss_cutoff)
        safe = torch.where(candidate, dist, torch.full_like(dist, 1.0))
        log_weight = (2.0 - dim) * torch.log(safe) - 0.5 * (dim - 3.0) * torch.log1p(-0.25 * safe * safe)
        log_weight = log_weight.masked_fill(~candidate, float("-inf"))
        row_max = log_weight.max(dim=1, keepdim=True).values
        weight = torch.exp(log_weight - torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)))
        empty = weight.sum(dim=1, keepdim=True) == 0
        weight = torch.where(empty, neg.to(weight.dtype), weight)
        total = weight.sum(dim=1, keepdim=True)
        return weight / torch.where(total > 0, total, torch.ones_like(total))

    def mine(self, embeddings, labels, ref, ref_labels):
        selection, picks, used = self._draw(embeddings, labels, ref, ref_labels)
        anchor, positive = torch.nonzero(selection.pos, as_tuple=True)  # row-major: anchor by anchor
        negative = picks[used]  # the k-th draw of an anchor goes with its k-th positive: (a, p, n_ap)
        return Mined((anchor, positive, negative), selection)

    def select(self, embeddings, labels, ref, ref_labels):
        return self._draw(embeddings, labels, ref, ref_labels)[0]

    def _draw(self, embeddings, labels, ref, ref_labels):
        """``(selection, picks, used)``: each anchor's draws (``picks``, reference rows) and which of them
        count (``used``: the first ``|P_a|`` of an anchor that has positives and negatives).

        Eagerly the anchors that draw take ``max |P_a|`` draws each (read on the host).  In the static form
        (``torch.compile``, CUDA-graph capture: :func:`~caffe_compat.losses.static_form.static_form`) every
        anchor takes R draws, R the reference rows (a bound on ``|P_a|``; an anchor that does not draw
        samples all rows and counts none): fixed shapes and no host read, the same distribution from
        another stretch of the generator's stream (so the draws differ from eager ones of the same seed,
        as PyTorch's compiled random operators' do)."""
        pos, neg = label_masks(labels, ref_labels)
        probs = self.negative_probabilities(embeddings, labels, ref, ref_labels)
        draws_per_anchor = pos.sum(dim=1)
        drawing = (draws_per_anchor > 0) & neg.any(dim=1)
        counts = torch.zeros_like(probs)
        keep_pos = pos & drawing[:, None]
        if static_form(probs):
            picks = torch.multinomial(torch.where(drawing[:, None], probs, 1.0), probs.shape[1], replacement=True,
                                      generator=self.generator)
            used = (torch.arange(probs.shape[1], device=probs.device) < draws_per_anchor[:, None]) & drawing[:, None]
            counts = counts.scatter_add(1, picks, used.to(probs.dtype))
        elif bool(drawing.any()):
            anchors = torch.nonzero(drawing).squeeze(1)
            most = int(draws_per_anchor.max())
            picks = torch.multinomial(probs[anchors], most, replacement=True, generator=self.generator)
            used = torch.arange(most, device=probs.device)[None, :] < draws_per_anchor[anchors, None]
            counts[anchors] = counts[anchors].scatter_add(1, picks, used.to(probs.dtype))
        else:  # no anchor draws: no triplet
            picks = torch.zeros((0, 0), dtype=torch.long, device=probs.device)
            used = torch.zeros((0, 0), dtype=torch.bool, device=probs.device)
        return PairSelection(keep_pos.to(probs.dtype), counts), picks, used

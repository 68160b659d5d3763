"""Pair miners: which anchor-positive and anchor-negative pairs a loss should use.

The interface is deliberately small.  A miner is called as ``miner(embeddings, labels)`` and returns a
:class:`PairSelection`: two ``(B, B)`` float matrices ``pos`` and ``neg`` of *pair counts*, row = anchor,
column = the other sample (0 = not used, 1 = used once, k = drawn k times by a sampling miner).  They
are computed without gradient and are always subsets of the label masks.  Every loss in this package
that takes ``miner=`` replaces its full positive/negative masks by these matrices, so a miner works in
front of any pair loss and, by combining each anchor's mined positives with its mined negatives, in
front of the triplet loss.

Losses that accept ``miner=``: :class:`~caffe_compat.losses.ContrastiveLoss`,
:class:`~caffe_compat.losses.TripletLoss`, :class:`~caffe_compat.losses.LiftedStructLoss`,
:class:`~caffe_compat.losses.BinomialDevianceLoss`, :class:`~caffe_compat.losses.RAWLoss` (VTHM by
default), :class:`~caffe_compat.losses.MultiSimilarityLoss` and :class:`~caffe_compat.losses.MarginLoss`
(distance weighted by default).  :class:`~caffe_compat.losses.HistogramLoss`,
:class:`~caffe_compat.losses.FastAPLoss` and :class:`~caffe_compat.losses.SmoothAPLoss` do not: they are
histogram / list-wise losses over every pair of the batch (so is ``FAPPYLoss``).

Miners:

* :class:`VTHMMiner` — valid triplet based hard mining ("A unified view of DML via gradient analysis",
  Sec. 5.1): with cosine similarities ``s`` of L2-normalised embeddings, a negative ``j`` of anchor ``i``
  is kept when ``s_ij > min_{k∈P_i} s_ik − λ`` and a positive when ``s_ij < max_{k∈N_i} s_ik + λ``;
  λ = 0.1.  Identical to pytorch-metric-learning's ``MultiSimilarityMiner(epsilon=λ)``.
* :class:`EasyPositiveMiner` — easy positive sampling (Levi et al., "Rethinking preventing
  class-collapsing", supplement B): each anchor keeps only its nearest same-class sample
  (``Φ(y_i, y_j)``, first index on ties) and all its negatives.
* :class:`DistanceWeightedMiner` — distance weighted sampling (Wu et al. 2017, Sec. 4): on Euclidean
  distances ``D`` of L2-normalised n-dimensional embeddings, clamped below at ``cutoff`` = 0.5, each
  negative is drawn with probability ∝ ``q(D)^{-1}``, ``log q(D) = (n−2)·log D + (n−3)/2·log(1 − D²/4)``,
  restricted to ``D < nonzero_loss_cutoff`` = 1.4 (pairs that can have a non-zero margin loss).  Per
  anchor one negative is drawn per positive (Wu's triplets ``(a, p, n_ap)``), so ``neg`` holds counts.
  An anchor whose candidate weights are all zero draws uniformly among its negatives (Wu's MXNet code
  draws uniformly among *all* samples there; PML leaves such rows NaN).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from caffe_compat.losses.loss_errors import LossInputError
from caffe_compat.losses.batch_input import check_batch
from caffe_compat.losses.pairwise import euclidean_matrix, label_masks, normalized_cosine_matrix


@dataclass(frozen=True)
class PairSelection:
    """Mined pairs as ``(B, B)`` count matrices (row = anchor): ``pos`` positives, ``neg`` negatives."""

    pos: torch.Tensor
    neg: torch.Tensor


class Miner:
    """Base class: subclasses implement :meth:`mine`; calling the miner validates and detaches."""

    def __call__(self, embeddings: torch.Tensor, labels: torch.Tensor) -> PairSelection:
        labels = check_batch(embeddings, labels, type(self).__name__)
        with torch.no_grad():
            return self.mine(embeddings.detach(), labels)

    def mine(self, embeddings: torch.Tensor, labels: torch.Tensor) -> PairSelection:
        raise NotImplementedError


def select_pairs(miner, embeddings: torch.Tensor, labels: torch.Tensor) -> PairSelection:
    """The pairs a loss uses: the miner's selection, or every positive and negative pair."""
    if miner is not None:
        selection = miner(embeddings, labels)
        return PairSelection(selection.pos.to(embeddings.dtype), selection.neg.to(embeddings.dtype))
    pos, neg = label_masks(labels)
    return PairSelection(pos.to(embeddings.dtype), neg.to(embeddings.dtype))


class VTHMMiner(Miner):
    """Valid triplet based hard mining, margin λ (default 0.1, the paper's Sec. 6 value)."""

    def __init__(self, margin: float = 0.1):
        self.margin = float(margin)

    def mine(self, embeddings, labels):
        sim = normalized_cosine_matrix(embeddings)
        pos, neg = label_masks(labels)
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

    def mine(self, embeddings, labels):
        x = torch.nn.functional.normalize(embeddings, dim=1) if self.normalize else embeddings
        dist = euclidean_matrix(x)
        pos, neg = label_masks(labels)
        nearest = dist.masked_fill(~pos, float("inf")).argmin(dim=1)
        easy = torch.zeros_like(dist)
        easy[torch.arange(len(labels), device=dist.device), nearest] = 1.0
        return PairSelection(easy * pos.to(dist.dtype), neg.to(dist.dtype))


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

    def negative_probabilities(self, embeddings, labels) -> torch.Tensor:
        """``(B, B)`` sampling probabilities of each anchor's negatives (rows without negatives are 0)."""
        dim = embeddings.shape[1]
        dist = euclidean_matrix(torch.nn.functional.normalize(embeddings, dim=1)).clamp_min(self.cutoff)
        _, neg = label_masks(labels)
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

    def mine(self, embeddings, labels):
        pos, neg = label_masks(labels)
        probs = self.negative_probabilities(embeddings, labels)
        draws_per_anchor = pos.sum(dim=1)
        drawing = (draws_per_anchor > 0) & neg.any(dim=1)
        counts = torch.zeros_like(probs)
        if bool(drawing.any()):
            anchors = torch.nonzero(drawing).squeeze(1)
            most = int(draws_per_anchor.max())
            picks = torch.multinomial(probs[anchors], most, replacement=True, generator=self.generator)
            used = torch.arange(most, device=probs.device)[None, :] < draws_per_anchor[anchors, None]
            counts[anchors] = counts[anchors].scatter_add(1, picks, used.to(probs.dtype))
        keep_pos = pos & drawing[:, None]
        return PairSelection(keep_pos.to(probs.dtype), counts)

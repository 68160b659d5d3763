"""Triplet loss (Hoffer & Ailon 2015; FaceNet, Schroff et al. 2015) over every triplet of a batch.

Space: squared Euclidean distance of L2-normalised embeddings (FaceNet; ``squared=False`` uses the
plain Euclidean distance, ``normalize=False`` the raw embeddings).  For anchor a, positive p
(same label, p ≠ a) and negative n (other label)::

    ℓ_apn = max(0, d_ap − d_an + margin),          margin = 0.2 (FaceNet's α)

``triplets`` chooses the set T (the names and conditions of pytorch-metric-learning's
``TripletMarginMiner``):

* ``"all"``      every triplet;
* ``"semihard"`` ``d_ap < d_an ≤ d_ap + margin`` (FaceNet's semi-hard negatives);
* ``"hard"``     ``d_an ≤ d_ap`` (every negative closer than the positive; *not* Hermans' batch-hard).

``reduction``: ``"mean"`` (default) = Σ_T ℓ / |T|, FaceNet's sum normalised by the number of triplets;
``"mean_nonzero"`` = mean over the triplets with ℓ > 0 (pytorch-metric-learning's ``AvgNonZeroReducer``,
so ``TripletMarginLoss(margin, distance=LpDistance(power=2))`` with a ``TripletMarginMiner`` of the same
type equals ``reduction="mean_nonzero"``); ``"sum"`` = Σ_T ℓ.  An empty T gives 0.

With ``miner=`` the anchor's mined positives and negatives are combined (triplet weight
``pos[a,p]·neg[a,n]``), e.g. :class:`~caffe_compat.losses.miners.EasyPositiveMiner` gives EPS + triplet.
Called PML's way, ``loss(embeddings, labels, indices_tuple)``: a pair tuple gives the same combination
(PML's ``convert_to_triplets``), a triplet tuple ``(a, p, n)`` is used triplet by triplet (those in T;
``reduction`` over them), so ``TripletLoss(margin, squared=False, reduction="mean_nonzero")`` equals
PML's default ``TripletMarginLoss(margin)`` given the same tuple, or none.

Never materialises the B³ triplets: per anchor the negatives' distances are sorted once and each
(a, p) sums its hinge over them with ``searchsorted`` and prefix sums (O(B² log B) time, O(B²) memory).
"""

from __future__ import annotations

import torch

from caffe_compat.losses.loss_errors import LossInputError
from caffe_compat.losses.batch_input import pair_inputs
from caffe_compat.losses.pairwise import TRIPLET_SETS, euclidean_matrix, in_triplet_set, squared_euclidean_matrix
REDUCTIONS = ("mean", "mean_nonzero", "sum")


class _SortedNegatives:
    """Each anchor's negatives sorted by distance, with weighted prefix counts and sums."""

    def __init__(self, dist: torch.Tensor, neg_weight: torch.Tensor):
        keyed = torch.where(neg_weight > 0, dist, torch.full_like(dist, float("inf")))
        self.sorted, order = torch.sort(keyed.detach(), dim=1)
        w = neg_weight.gather(1, order)
        d = dist.gather(1, order)  # differentiable copy of the sorted distances
        zero = dist.new_zeros(dist.shape[0], 1)
        self.cum_w = torch.cat([zero, torch.cumsum(w, dim=1)], dim=1)
        self.cum_wd = torch.cat([zero, torch.cumsum(w * d, dim=1)], dim=1)

    def below(self, bound: torch.Tensor, inclusive: bool):
        """``(Σ w, Σ w·d)`` over the anchor's negatives with ``d < bound`` (``≤`` if inclusive)."""
        idx = torch.searchsorted(self.sorted, bound.detach().contiguous(), right=inclusive)
        return self.cum_w.gather(1, idx), self.cum_wd.gather(1, idx)


class TripletLoss(torch.nn.Module):
    """Triplet margin loss over every (or every semi-hard / hard) triplet of the batch.

    Space: squared Euclidean distance of L2-normalised embeddings by default (FaceNet).  For anchor a,
    positive p ≠ a and negative n: ``ℓ_apn = max(0, d_ap − d_an + margin)`` over the triplet set T.

    Args:
        margin: the margin (default 0.2, FaceNet's α).
        triplets: T: ``"all"`` (default), ``"semihard"`` (d_ap < d_an ≤ d_ap + margin) or ``"hard"``
            (d_an ≤ d_ap), as PML's ``TripletMarginMiner``.
        squared: squared Euclidean distance (default True); False: Euclidean distance.
        normalize: L2-normalise the embeddings first (default True).
        reduction: ``"mean"`` (default, Σ_T ℓ / |T|), ``"mean_nonzero"`` (over ℓ > 0: PML's
            ``AvgNonZeroReducer``) or ``"sum"``.  An empty set gives 0.
        miner: optional pair miner; a triplet then weighs ``pos[a,p]·neg[a,n]`` (e.g. EPS + triplet).

    Also ``loss(embeddings, labels, indices_tuple, ref_emb, ref_labels)`` (PML): a triplet tuple is
    used triplet by triplet, a pair tuple as a miner's pairs.

    O(B² log B) time, O(B²) memory: the B³ triplets are never materialised.
    """

    def __init__(
        self,
        margin: float = 0.2,
        triplets: str = "all",
        squared: bool = True,
        normalize: bool = True,
        reduction: str = "mean",
        miner=None,
    ):
        super().__init__()
        if triplets not in TRIPLET_SETS:
            raise LossInputError(f"TripletLoss: triplets must be one of {TRIPLET_SETS}, got {triplets!r}")
        if reduction not in REDUCTIONS:
            raise LossInputError(f"TripletLoss: reduction must be one of {REDUCTIONS}, got {reduction!r}")
        if not margin >= 0:
            raise LossInputError(f"TripletLoss: margin must be >= 0, got {margin!r}")
        self.margin = float(margin)
        self.triplets = triplets
        self.squared = bool(squared)
        self.normalize = bool(normalize)
        self.reduction = reduction
        self.miner = miner

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor, indices_tuple=None, ref_emb=None,
                ref_labels=None) -> torch.Tensor:
        batch = pair_inputs("TripletLoss", embeddings, labels, indices_tuple, ref_emb, ref_labels,
                            miner=self.miner, normalize=self.normalize)
        pairs = batch.pairs
        distance = squared_euclidean_matrix if self.squared else euclidean_matrix
        dist = distance(batch.x, batch.ref)
        if batch.triplets is not None:
            return self._given_triplets(dist, *batch.triplets)
        negatives = _SortedNegatives(dist, pairs.neg)
        shifted = dist + self.margin  # (a, p): hinge is positive for d_an < d_ap + margin
        cnt_hinge, sum_hinge = negatives.below(shifted, inclusive=False)
        hinge_total = cnt_hinge * shifted - sum_hinge  # Σ_n w_n (d_ap + m − d_an) over ℓ > 0
        if self.triplets == "all":
            loss_sum, nonzero = hinge_total, cnt_hinge
            selected = pairs.neg.sum(dim=1, keepdim=True).expand_as(dist)
        else:
            cnt_close, sum_close = negatives.below(dist, inclusive=True)  # d_an ≤ d_ap
            close_total = cnt_close * shifted - sum_close
            if self.triplets == "hard":
                loss_sum, selected = close_total, cnt_close
                nonzero = cnt_close if self.margin > 0 else cnt_hinge.minimum(cnt_close)
            else:  # semihard: d_ap < d_an ≤ d_ap + m
                loss_sum, nonzero = hinge_total - close_total, cnt_hinge - cnt_close
                cnt_upto, _ = negatives.below(shifted, inclusive=True)
                selected = cnt_upto - cnt_close
        w = pairs.pos
        total = (w * loss_sum).sum()
        count = (w * (nonzero if self.reduction == "mean_nonzero" else selected)).sum()
        return self._reduce(total, count)

    def _reduce(self, total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        if self.reduction == "sum":
            return total
        return torch.where(count > 0, total / count.clamp_min(1e-30), total * 0.0)

    def _given_triplets(self, dist, a, p, n) -> torch.Tensor:
        """The loss over the triplets of a call's ``indices_tuple`` that lie in the set ``triplets``."""
        d_ap, d_an = dist[a, p], dist[a, n]
        hinge = torch.relu(d_ap - d_an + self.margin)
        selected = in_triplet_set(d_ap.detach(), d_an.detach(), self.margin, self.triplets).to(dist.dtype)
        total = (selected * hinge).sum()
        count = (selected * (hinge > 0) if self.reduction == "mean_nonzero" else selected).sum()
        return self._reduce(total, count)

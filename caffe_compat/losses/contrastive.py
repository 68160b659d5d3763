"""Contrastive loss (Hadsell, Chopra & LeCun 2006), over every pair of a batch.

Space: Euclidean distance ``d_ij = ‖x_i − x_j‖`` of the embeddings as given (``normalize=False``,
the default, as in Hadsell et al. and Caffe's ``ContrastiveLoss``; ``normalize=True`` L2-normalises
first, as pytorch-metric-learning does by default).  With y = 1 for a positive pair::

    ℓ_ij = y·d_ij^p + (1 − y)·max(0, m − d_ij)^p,      p = power (default 2), m = margin (default 1.0)
    L    = 1/(2·M) · Σ_{pairs i<j} ℓ_ij,               M = number of pairs

This is exactly Caffe's ``ContrastiveLoss`` layer (``legacy_version: false``, normalised by 2N) fed
with all B(B−1)/2 pairs of the batch: a batch of two embeddings is one Caffe siamese pair.  With
``miner=`` the mined pair counts replace the all-pairs set (``L = Σ w·ℓ / (2·Σ w)``, ordered pairs).

Differences from pytorch-metric-learning's ``ContrastiveLoss(pos_margin=0, neg_margin=m)``: PML uses
``power = 1`` hinges (``d`` and ``max(0, m − d)``), L2-normalises by default and averages the positive
and the negative terms separately over the non-zero ones.  With ``power=1, normalize=`` matching and a
``SumReducer`` in PML, ``PML = 2·B(B−1)·L``.
Caffe quirk not reproduced: Caffe's backward divides by ``d + 1e-4`` in the dissimilar term; the
gradient here is the exact one.
"""

from __future__ import annotations

import torch

from caffe_compat.losses.loss_errors import LossInputError
from caffe_compat.losses.batch_input import pair_inputs
from caffe_compat.losses.pairwise import euclidean_matrix, squared_euclidean_matrix


class ContrastiveLoss(torch.nn.Module):
    """Contrastive loss over every pair of the batch (Hadsell et al.; Caffe's ``ContrastiveLoss``).

    Space: Euclidean distance ``d_ij = ‖x_i − x_j‖`` of the embeddings as given (``normalize=True``:
    of the L2-normalised embeddings).  With y = 1 for a same-label pair::

        ℓ_ij = y·d_ij^p + (1 − y)·max(0, m − d_ij)^p
        L    = Σ_{i<j} ℓ_ij / (2·M),        M = B(B−1)/2 (Caffe's 1/(2N) over N siamese pairs)

    With ``miner=``: ``L = Σ w·ℓ / (2·Σ w)`` over the mined ordered pairs (w = pair counts).

    Args:
        margin: m of the dissimilar hinge (default 1.0).
        power: p, 2 (default; Hadsell et al., Caffe) or 1 (pytorch-metric-learning's hinges).
        normalize: L2-normalise the embeddings first (default False; PML's default is True).
        miner: optional pair miner from :mod:`caffe_compat.losses.miners` (default: every pair).

    PML's default reducer averages the positive and negative terms separately over the non-zero
    ones; see the module docstring for the exact relation.
    """

    def __init__(self, margin: float = 1.0, power: int = 2, normalize: bool = False, miner=None):
        super().__init__()
        if power not in (1, 2):
            raise LossInputError(f"ContrastiveLoss: power must be 1 or 2, got {power!r}")
        self.margin = float(margin)
        self.power = int(power)
        self.normalize = bool(normalize)
        self.miner = miner

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor, indices_tuple=None, ref_emb=None,
                ref_labels=None) -> torch.Tensor:
        batch = pair_inputs("ContrastiveLoss", embeddings, labels, indices_tuple, ref_emb, ref_labels,
                            miner=self.miner, normalize=self.normalize)
        x, ref, pairs = batch.x, batch.ref, batch.pairs
        dist = euclidean_matrix(x, ref)
        hinge = torch.relu(self.margin - dist)
        if self.power == 2:
            pos_term, neg_term = squared_euclidean_matrix(x, ref), hinge * hinge
        else:
            pos_term, neg_term = dist, hinge
        total = (pairs.pos * pos_term).sum() + (pairs.neg * neg_term).sum()
        count = pairs.pos.sum() + pairs.neg.sum()
        return total / (2.0 * count.clamp_min(1.0))

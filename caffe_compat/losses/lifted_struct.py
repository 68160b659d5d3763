"""Lifted structured feature embedding loss (Oh Song, Xiang, Jegelka & Savarese, CVPR 2016).

Reproduces the authors' Caffe layer ``LiftedStructSimilaritySoftmaxLoss``.  Space: Euclidean distance
``D_ij = ‖x_i − x_j‖`` of the *unnormalised* embeddings (Gram expansion, as the layer).  For every
positive pair i<j::

    J_ij = log( Σ_{k∈N_i} exp(m − D_ik) + Σ_{l∈N_j} exp(m − D_jl) ) + D_ij,      m = margin = 1.0
    L    = 1/(2·|P|) · Σ_{(i,j)∈P, i<j} max(0, J_ij)²

|P| is the number of positive pairs i<j (the layer's ``num_constraints``).  The log-sum-exp over the
negatives of both i and j is ``logaddexp(lse_i, lse_j)`` of two per-sample log-sum-exps, so memory is
O(B²) (pytorch-metric-learning's ``LiftedStructureLoss`` builds a (#pos pairs × #neg pairs) mask, which
needs >24 GB at B = 512).  A batch without positive pairs gives 0 (the Caffe layer divides 0 by 0:
NaN); a positive pair without any negative has J = −∞ and contributes 0, as in Caffe.

Equals ``pytorch_metric_learning.losses.LiftedStructureLoss(neg_margin=m, pos_margin=0,
distance=LpDistance(normalize_embeddings=False))``.  With ``miner=``, the mined counts replace the
positive pairs (weights of J²) and the negatives inside the log-sum-exps.
"""

from __future__ import annotations

import torch

from caffe_compat.losses.batch_input import pair_inputs, reject_pml_arguments
from caffe_compat.losses.pairwise import euclidean_matrix


class LiftedStructLoss(torch.nn.Module):
    """Lifted structured loss of Oh Song et al. (their Caffe ``LiftedStructSimilaritySoftmaxLoss``).

    Space: Euclidean distance ``D`` of the *unnormalised* embeddings.  For each positive pair i<j::

        J_ij = log(Σ_{k∈N_i} exp(m − D_ik) + Σ_{l∈N_j} exp(m − D_jl)) + D_ij
        L    = Σ_{(i,j)∈P, i<j} max(0, J_ij)² / (2·|P|)

    A batch without positive pairs gives 0.  Equals PML's ``LiftedStructureLoss(neg_margin=m,
    pos_margin=0)`` on ``LpDistance(normalize_embeddings=False)``.

    Args:
        margin: m (default 1.0).
        miner: optional pair miner: mined counts weigh the J² terms and the negatives in the sums.

    PML's ``indices_tuple`` acts like a miner; ``ref_emb`` / ``ref_labels`` raise ``LossArgumentError``.
    """

    def __init__(self, margin: float = 1.0, miner=None):
        super().__init__()
        self.margin = float(margin)
        self.miner = miner

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor, indices_tuple=None, ref_emb=None,
                ref_labels=None) -> torch.Tensor:
        reject_pml_arguments("LiftedStructLoss", "J_ij pools the negatives of both ends of a positive pair, "
                             "so both must be in the batch", ref_emb=ref_emb, ref_labels=ref_labels)
        pairs = pair_inputs("LiftedStructLoss", embeddings, labels, indices_tuple, miner=self.miner).pairs
        dist = euclidean_matrix(embeddings)
        has_neg = (pairs.neg > 0).any(dim=1)
        neg_logits = (self.margin - dist) + torch.log(pairs.neg)  # log 0 = −inf drops non-negatives
        neg_logits = torch.where(has_neg[:, None], neg_logits, torch.zeros_like(neg_logits))
        lse = torch.logsumexp(neg_logits, dim=1)  # finite in every row: no NaN in the backward
        lse = torch.where(has_neg, lse, torch.full_like(lse, -1e30))  # no negative: exp(...) = 0
        j = torch.logaddexp(lse[:, None], lse[None, :]) + dist
        hinge = torch.relu(j)
        pos = torch.triu(pairs.pos + pairs.pos.t(), diagonal=1) * 0.5
        hinge = torch.where(pos > 0, hinge, torch.zeros_like(hinge))  # −∞/NaN-free outside P
        count = pos.sum()
        return (pos * hinge * hinge).sum() / (2.0 * count.clamp_min(1.0))

"""Binomial deviance loss (Yi, Lei, Liao & Li, "Deep metric learning for person re-identification", 2014).

Space: cosine similarity ``s`` of L2-normalised embeddings.  Yi et al.'s cost of a pair with sign
``m = +1`` (positive) or ``m = −C`` (negative) is ``log(1 + exp(−α(s − γ)·m))``, i.e.::

    positive pair:  log(1 + exp(−α (s − γ)))
    negative pair:  log(1 + exp( β (s − γ))),        β = α·C
    L = (1/n⁺) Σ_{positive pairs} + (1/n⁻) Σ_{negative pairs}

with Yi et al.'s weights ``W = 1/n⁺`` on positive and ``1/n⁻`` on negative pairs (n± the pair counts).
Defaults are the paper's: α = 2, γ = 0.5 (Yi's β), negative cost C = 25, hence β = 50 (the unified
view paper's Eq. (12) writes the same costs with α, β, γ; pass ``beta`` to set β directly, in which
case C is ignored).  With ``miner=`` (e.g. VTHM, "Binomial+VTHM" of the unified-view paper) the mined
pair counts replace the pairs and n±.  No pytorch-metric-learning counterpart.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from caffe_compat.losses.batch_input import check_batch
from caffe_compat.losses.miners import select_pairs
from caffe_compat.losses.pairwise import normalized_cosine_matrix


class BinomialDevianceLoss(torch.nn.Module):
    def __init__(self, alpha: float = 2.0, gamma: float = 0.5, neg_cost: float = 25.0, beta=None, miner=None):
        super().__init__()
        self.alpha = float(alpha)
        self.gamma = float(gamma)
        self.neg_cost = float(neg_cost)
        self.beta = float(beta) if beta is not None else self.alpha * self.neg_cost
        self.miner = miner

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        labels = check_batch(embeddings, labels, "BinomialDevianceLoss")
        sim = normalized_cosine_matrix(embeddings)
        pairs = select_pairs(self.miner, embeddings, labels)
        pos_cost = F.softplus(-self.alpha * (sim - self.gamma))
        neg_cost = F.softplus(self.beta * (sim - self.gamma))
        pos_part = (pairs.pos * pos_cost).sum() / pairs.pos.sum().clamp_min(1.0)
        neg_part = (pairs.neg * neg_cost).sum() / pairs.neg.sum().clamp_min(1.0)
        return pos_part + neg_part

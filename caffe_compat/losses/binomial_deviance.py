"""Binomial deviance loss (Yi, Lei, Liao & Li, "Deep metric learning for person re-identification", 2014).

Space: cosine similarity ``s`` of L2-normalised embeddings.  Yi et al.'s cost of a pair with sign
``m = +1`` (positive) or ``m = −C`` (negative) is ``log(1 + exp(−α(s − γ)·m))``, i.e.::

    positive pair:  c⁺_ik = log(1 + exp(−α (s_ik − γ)))
    negative pair:  c⁻_ik = log(1 + exp( β (s_ik − γ))),        β = α·C

Defaults are the paper's: α = 2, γ = 0.5 (Yi's β), negative cost C = 25, hence β = 50 (the unified
view paper's Eq. (12) writes the same costs with α, β, γ; pass ``beta`` to set β directly, in which
case C is ignored).

``normalization`` chooses how the pair costs are weighted:

* ``"pairs"`` (default) — Yi et al.'s weights ``W = 1/n⁺`` on positive and ``1/n⁻`` on negative pairs,
  n± the batch-wide pair counts (ordered pairs (i, k), k ≠ i; the ratio is the same for unordered ones)::

      L = (1/n⁺) Σ_{(i,k): k∈P_i} c⁺_ik + (1/n⁻) Σ_{(i,k): k∈N_i} c⁻_ik,      n⁺ = Σ_i |P_i|, n⁻ = Σ_i |N_i|

* ``"anchor"`` — the per-anchor normalisation of "A unified view of DML via gradient analysis",
  Eq. (12) (its "Binomial" rows, with the weights of Eqs. (13)–(14))::

      L = Σ_{i=1}^{m} { (1/|P_i|) Σ_{k∈P_i} c⁺_ik + (1/|N_i|) Σ_{k∈N_i} c⁻_ik }

  As printed, Eq. (12) *sums* over the m anchors (no 1/m, unlike its Eqs. (9) and (17)); divide by the
  batch size for a per-anchor mean.  An anchor without positives (negatives) contributes 0 to that term.

The two coincide up to a constant factor only when every anchor has the same |P_i| and |N_i| (equal
class blocks: then ``anchor = m · pairs``).  With ``miner=`` (e.g. VTHM, "Binomial+VTHM" of the
unified-view paper) the mined pair counts replace the pairs, n± and |P_i|, |N_i| (the mined |P̃_i|,
|Ñ_i|).  No pytorch-metric-learning counterpart.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from caffe_compat.losses.batch_input import pair_inputs
from caffe_compat.losses.loss_errors import LossInputError

NORMALIZATIONS = ("pairs", "anchor")


class BinomialDevianceLoss(torch.nn.Module):
    """Binomial deviance loss (Yi et al. 2014) on the pairs of the batch.

    Space: cosine similarity ``s`` of L2-normalised embeddings.  Pair costs
    ``c⁺ = log(1 + exp(−α(s − γ)))`` (positive) and ``c⁻ = log(1 + exp(β(s − γ)))`` (negative), β = α·C.

    Args:
        alpha: α, positive-pair scale (default 2).
        gamma: γ, similarity threshold (default 0.5).
        neg_cost: Yi's negative cost C (default 25, so β = 50).
        beta: β directly (default None: α·C); when given, ``neg_cost`` is ignored.
        miner: optional pair miner (e.g. VTHM: "Binomial+VTHM"); mined counts weigh the costs.
        normalization: ``"pairs"`` (default, Yi et al.): mean cost of the positive pairs + mean cost of
            the negative pairs, batch-wide; ``"anchor"`` (unified view, Eq. 12): per-anchor means of each,
            *summed* over the anchors (no 1/B).
    """

    def __init__(
        self,
        alpha: float = 2.0,
        gamma: float = 0.5,
        neg_cost: float = 25.0,
        beta=None,
        miner=None,
        normalization: str = "pairs",
    ):
        super().__init__()
        if normalization not in NORMALIZATIONS:
            raise LossInputError(
                f"BinomialDevianceLoss: normalization must be one of {NORMALIZATIONS}, got {normalization!r}"
            )
        self.alpha = float(alpha)
        self.gamma = float(gamma)
        self.neg_cost = float(neg_cost)
        self.beta = float(beta) if beta is not None else self.alpha * self.neg_cost
        self.miner = miner
        self.normalization = normalization

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor, indices_tuple=None, ref_emb=None,
                ref_labels=None) -> torch.Tensor:
        batch = pair_inputs("BinomialDevianceLoss", embeddings, labels, indices_tuple, ref_emb, ref_labels,
                            miner=self.miner)
        sim, pairs = batch.cosine(), batch.pairs
        pos_cost = F.softplus(-self.alpha * (sim - self.gamma))
        neg_cost = F.softplus(self.beta * (sim - self.gamma))
        if self.normalization == "anchor":  # unified view, Eq. (12): 1/|P_i|, 1/|N_i| per anchor, summed
            pos_part = (pairs.pos * pos_cost).sum(dim=1) / pairs.pos.sum(dim=1).clamp_min(1.0)
            neg_part = (pairs.neg * neg_cost).sum(dim=1) / pairs.neg.sum(dim=1).clamp_min(1.0)
            return (pos_part + neg_part).sum()
        pos_part = (pairs.pos * pos_cost).sum() / pairs.pos.sum().clamp_min(1.0)
        neg_part = (pairs.neg * neg_cost).sum() / pairs.neg.sum().clamp_min(1.0)
        return pos_part + neg_part

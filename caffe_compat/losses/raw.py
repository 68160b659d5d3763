"""RAW: relative and absolute similarity based weight assignment, with VTHM mining.

From "A Unified View of Deep Metric Learning via Gradient Analysis" (Eqs. (13)–(17)).  Space: cosine
similarity ``s`` of L2-normalised embeddings.  The weights (15)–(16) are the gradient of::

    L_RAW = 1/m Σ_i { 1/α · log[1 + Σ_{k∈P̃_i} exp(−α (s_ik − γ))] + 1/β · log[1 + Σ_{k∈Ñ_i} exp(β (s_ik − γ))] }   (17)

where P̃_i, Ñ_i are the informative positives/negatives of anchor i chosen by valid triplet based hard
mining (VTHM, Sec. 5.1, margin λ) and m is the batch size (anchors with nothing mined count as 0).
Defaults are the paper's Sec. 6: λ = 0.1, α = 2, β = 50, γ = 0.5, VTHM on ("RAW+VTHM", the full
method); ``vthm=False`` gives plain RAW over all pairs (the ablation's "RAW"); ``miner=`` substitutes
another miner (e.g. distance weighted: "RAW+DW").

This is the same function as the multi-similarity loss (Wang et al. 2019) with ``base = γ``; it equals
pytorch-metric-learning's ``MultiSimilarityLoss(alpha, beta, base=γ)`` with
``MultiSimilarityMiner(epsilon=λ)`` in front.
"""

from __future__ import annotations

import torch

from caffe_compat.losses.batch_input import check_positive, pair_inputs
from caffe_compat.losses.miners import VTHMMiner


def _log1p_sum_exp(logits: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Row-wise ``log(1 + Σ_k counts_k · exp(logits_k))``, stable, finite gradient."""
    used = counts > 0
    terms = torch.where(used, logits + torch.log(torch.where(used, counts, torch.ones_like(counts))),
                        torch.full_like(logits, float("-inf")))
    one = logits.new_zeros(logits.shape[0], 1)
    return torch.logsumexp(torch.cat([one, terms], dim=1), dim=1)


def raw_anchor_losses(sim, pos_counts, neg_counts, alpha: float, beta: float, gamma: float) -> torch.Tensor:
    """The per-anchor bracket of Eq. (17): ``(B,)``."""
    pos_part = _log1p_sum_exp(-alpha * (sim - gamma), pos_counts) / alpha
    neg_part = _log1p_sum_exp(beta * (sim - gamma), neg_counts) / beta
    return pos_part + neg_part


class RAWLoss(torch.nn.Module):
    """RAW (+VTHM by default) of "A unified view of DML via gradient analysis", Eq. (17).

    Space: cosine similarity ``s`` of L2-normalised embeddings::

        L = 1/B Σ_i { 1/α log[1 + Σ_{k∈P̃_i} exp(−α(s_ik − γ))] + 1/β log[1 + Σ_{k∈Ñ_i} exp(β(s_ik − γ))] }

    with P̃_i, Ñ_i the mined positives/negatives (anchors with nothing mined contribute 0 to the mean).

    Args:
        alpha: α (default 2).  beta: β (default 50).  gamma: γ (default 0.5).
        vthm: mine with :class:`~caffe_compat.losses.miners.VTHMMiner` (default True, "RAW+VTHM");
            False: every pair ("RAW").
        vthm_margin: VTHM's λ (default 0.1).
        miner: another miner instead (e.g. distance weighted: "RAW+DW"); overrides ``vthm``.
    """

    def __init__(
        self,
        alpha: float = 2.0,
        beta: float = 50.0,
        gamma: float = 0.5,
        vthm: bool = True,
        vthm_margin: float = 0.1,
        miner=None,
    ):
        super().__init__()
        self.alpha = check_positive(float(alpha), "alpha", "RAWLoss")
        self.beta = check_positive(float(beta), "beta", "RAWLoss")
        self.gamma = float(gamma)
        self.miner = miner if miner is not None else (VTHMMiner(vthm_margin) if vthm else None)

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor, indices_tuple=None, ref_emb=None,
                ref_labels=None) -> torch.Tensor:
        batch = pair_inputs("RAWLoss", embeddings, labels, indices_tuple, ref_emb, ref_labels, miner=self.miner)
        sim, pairs = batch.cosine(), batch.pairs
        return raw_anchor_losses(sim, pairs.pos, pairs.neg, self.alpha, self.beta, self.gamma).mean()

"""Multi-similarity loss (Wang, Han, Huang, Dong & Scott, CVPR 2019).

Space: cosine similarity ``s`` of L2-normalised embeddings.  Per anchor i, over its (mined) positives
P_i and negatives N_i, averaged over all B anchors::

    L = 1/B Σ_i { 1/α log[1 + Σ_{k∈P_i} exp(−α (s_ik − base))] + 1/β log[1 + Σ_{k∈N_i} exp(β (s_ik − base))] }

— the RAW formula (:mod:`caffe_compat.losses.raw`, Eq. 17) with γ = base.  Defaults α = 2, β = 50,
base = 0.5 and no miner: equal to ``pytorch_metric_learning.losses.MultiSimilarityLoss()``; with
``miner=VTHMMiner(ε)`` equal to PML's loss behind ``MultiSimilarityMiner(epsilon=ε)``.

:meth:`MultiSimilarityLoss.official` is the authors' released configuration: α = 2, β = 40, base 0.5,
pair mining margin 0.1 (:class:`~caffe_compat.losses.miners.VTHMMiner`), and — as their code does — an
anchor contributes only if it keeps at least one positive *and* one negative
(``skip_incomplete_anchors``).  Documented difference to that code: it drops positives with
``s ≥ 1 − 1e-5`` to exclude the anchor itself (and so also exact duplicates); here the anchor is
excluded by index, duplicates stay.
"""

from __future__ import annotations

import torch

from caffe_compat.losses.batch_input import check_positive, pair_inputs
from caffe_compat.losses.miners import VTHMMiner
from caffe_compat.losses.raw import raw_anchor_losses

OFFICIAL = {"alpha": 2.0, "beta": 40.0, "base": 0.5, "mining_margin": 0.1}


class MultiSimilarityLoss(torch.nn.Module):
    """Multi-similarity loss (Wang et al. 2019).

    Space: cosine similarity ``s`` of L2-normalised embeddings; mean over all B anchors of::

        1/α log[1 + Σ_{k∈P_i} exp(−α(s_ik − base))] + 1/β log[1 + Σ_{k∈N_i} exp(β(s_ik − base))]

    Without a miner it equals PML's ``MultiSimilarityLoss(alpha, beta, base)``.

    Args:
        alpha: α (default 2).  beta: β (default 50; the authors' release uses 40).
        base: similarity threshold λ of the paper (default 0.5).
        miner: optional pair miner (``VTHMMiner(ε)`` is MS's own pair mining, = PML's
            ``MultiSimilarityMiner(epsilon=ε)``).
        skip_incomplete_anchors: an anchor without a mined positive or negative contributes 0, as the
            authors' code does (default False).

    :meth:`official` builds the released configuration (α=2, β=40, base 0.5, VTHM ε=0.1, incomplete
    anchors skipped).  Unlike that code, an exact duplicate of the anchor stays a positive.
    """

    def __init__(
        self,
        alpha: float = 2.0,
        beta: float = 50.0,
        base: float = 0.5,
        miner=None,
        skip_incomplete_anchors: bool = False,
    ):
        super().__init__()
        self.alpha = check_positive(float(alpha), "alpha", "MultiSimilarityLoss")
        self.beta = check_positive(float(beta), "beta", "MultiSimilarityLoss")
        self.base = float(base)
        self.miner = miner
        self.skip_incomplete_anchors = bool(skip_incomplete_anchors)

    @classmethod
    def official(cls) -> "MultiSimilarityLoss":
        """The released MS-loss setup: α=2, β=40, base=0.5, mining margin 0.1, incomplete anchors skipped."""
        return cls(
            alpha=OFFICIAL["alpha"],
            beta=OFFICIAL["beta"],
            base=OFFICIAL["base"],
            miner=VTHMMiner(OFFICIAL["mining_margin"]),
            skip_incomplete_anchors=True,
        )

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor, indices_tuple=None, ref_emb=None,
                ref_labels=None) -> torch.Tensor:
        batch = pair_inputs("MultiSimilarityLoss", embeddings, labels, indices_tuple, ref_emb, ref_labels,
                            miner=self.miner)
        sim, pairs = batch.cosine(), batch.pairs
        per_anchor = raw_anchor_losses(sim, pairs.pos, pairs.neg, self.alpha, self.beta, self.base)
        if self.skip_incomplete_anchors:
            complete = (pairs.pos.sum(dim=1) > 0) & (pairs.neg.sum(dim=1) > 0)
            per_anchor = torch.where(complete, per_anchor, torch.zeros_like(per_anchor))
        return per_anchor.mean()

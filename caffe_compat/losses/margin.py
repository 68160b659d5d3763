"""Margin loss with distance weighted sampling (Wu, Manmatha, Smola & Krähenbühl, ICCV 2017).

Space: Euclidean distance ``D`` of L2-normalised embeddings.  For an anchor a of class c = y_a::

    positive pair:  ℓ⁺_ap = max(0, α + D_ap − β_c)
    negative pair:  ℓ⁻_an = max(0, α − D_an + β_c)
    L = (Σ w⁺·ℓ⁺ + Σ w⁻·ℓ⁻) / (number of terms with ℓ > 0, counted with the same weights)

α = margin = 0.2; β is a learnable ``nn.Parameter``, one per class when ``num_classes`` is given
(labels must then be integers in [0, num_classes)), else **one shared scalar** (Wu et al. learn β per
class: pass ``num_classes`` to reproduce them); initial β = 1.2.  The pairs:
by default Wu et al.'s :class:`~caffe_compat.losses.miners.DistanceWeightedMiner` (cutoff 0.5,
nonzero-loss cutoff 1.4): every positive pair once and, per positive, one negative drawn ∝ q(D)⁻¹ (so
``w⁻`` are draw counts).  ``distance_weighted=False`` uses every positive and negative pair once;
``miner=`` substitutes any miner (e.g. :class:`~caffe_compat.losses.miners.EasyPositiveMiner`: EPS +
margin).  A batch with no non-zero term gives 0.

Relation to pytorch-metric-learning's ``MarginLoss(margin, beta, learn_beta, num_classes)`` (its
``DivisorReducer``): PML sums ``ℓ⁺ + ℓ⁻`` over triplets (a, p, n); for Wu's sampled triplets
``(a, p, n_ap)`` that is exactly the pair sum above with w⁺ = 1 and w⁻ = draw counts; for PML's
"all" triplets it is the pair sum with ``w⁺_ap = |N_a|``, ``w⁻_an = |P_a|``.  Wu's β regulariser ν
(0 in PML's default) is not implemented.
"""

from __future__ import annotations

import torch

from caffe_compat.losses.loss_errors import LossInputError
from caffe_compat.losses.batch_input import pair_inputs
from caffe_compat.losses.miners import DistanceWeightedMiner
from caffe_compat.losses.pairwise import euclidean_matrix
from caffe_compat.losses.static_form import static_form


class MarginLoss(torch.nn.Module):
    """Margin loss with distance weighted sampling (Wu et al. 2017).

    **β is one shared learnable scalar unless ``num_classes`` is given.**  Wu et al. learn one β per
    class: pass ``num_classes`` for that (labels must then be integers in [0, num_classes)).

    Space: Euclidean distance ``D`` of L2-normalised embeddings.  For an anchor a of class c::

        ℓ⁺_ap = max(0, α + D_ap − β_c),    ℓ⁻_an = max(0, α − D_an + β_c)
        L     = (Σ w⁺ℓ⁺ + Σ w⁻ℓ⁻) / (weighted number of terms with ℓ > 0),   0 if there is none

    Args:
        num_classes: one β per class when given; default None: a single shared β.
        margin: α (default 0.2).
        beta: initial β (default 1.2).
        learn_beta: β is trained (default True; an ``nn.Parameter`` either way).
        distance_weighted: use Wu's :class:`~caffe_compat.losses.miners.DistanceWeightedMiner`
            (default True; draws from torch's global generator); False: every pair once.
        cutoff: distance clamp of the sampler (default 0.5).
        nonzero_loss_cutoff: the sampler's upper distance bound (default 1.4).
        miner: any pair miner instead (e.g. ``EasyPositiveMiner``: EPS + margin).

    Under ``torch.compile`` the loss is one graph (``fullgraph=True``), the per-class β's label check an
    assertion in the graph; Wu's sampler then draws in its static form (a fixed number of draws per
    anchor, of which as many count as eagerly: ``DistanceWeightedMiner._draw``), from torch's global
    generator (a ``generator=`` object cannot enter a graph).
    """

    def __init__(
        self,
        num_classes=None,
        margin: float = 0.2,
        beta: float = 1.2,
        learn_beta: bool = True,
        distance_weighted: bool = True,
        cutoff: float = 0.5,
        nonzero_loss_cutoff: float = 1.4,
        miner=None,
    ):
        super().__init__()
        if num_classes is not None and int(num_classes) < 1:
            raise LossInputError(f"MarginLoss: num_classes must be >= 1, got {num_classes!r}")
        self.num_classes = None if num_classes is None else int(num_classes)
        self.margin = float(margin)
        init = torch.full((self.num_classes or 1,), float(beta))
        self.beta = torch.nn.Parameter(init, requires_grad=bool(learn_beta))
        if miner is None and distance_weighted:
            miner = DistanceWeightedMiner(cutoff=cutoff, nonzero_loss_cutoff=nonzero_loss_cutoff)
        self.miner = miner

    def anchor_beta(self, labels: torch.Tensor) -> torch.Tensor:
        if self.num_classes is None:
            return self.beta.expand(labels.shape[0])
        index = labels.long()
        bad = (index.to(labels.dtype) != labels).any() | ((index < 0) | (index >= self.num_classes)).any()
        message = f"MarginLoss: labels must be integers in [0, {self.num_classes}) to index the per-class beta"
        if static_form(labels):  # no host synchronisation in a graph: the check is an assertion there
            torch._assert_async(~bad, message)
        elif bool(bad):
            raise LossInputError(message)
        return self.beta[index]

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor, indices_tuple=None, ref_emb=None,
                ref_labels=None) -> torch.Tensor:
        batch = pair_inputs("MarginLoss", embeddings, labels, indices_tuple, ref_emb, ref_labels,
                            miner=self.miner, normalize=True)
        pairs = batch.pairs
        dist = euclidean_matrix(batch.x, batch.ref)
        beta = self.anchor_beta(batch.labels).to(dist.dtype)[:, None]
        pos_loss = torch.relu(self.margin + dist - beta)
        neg_loss = torch.relu(self.margin - dist + beta)
        total = (pairs.pos * pos_loss).sum() + (pairs.neg * neg_loss).sum()
        divisor = (pairs.pos * (pos_loss > 0)).sum() + (pairs.neg * (neg_loss > 0)).sum()
        return torch.where(divisor > 0, total / divisor.clamp_min(1.0), total * 0.0)

"""Histogram loss (Ustinova & Lempitsky, NIPS 2016).

Space: cosine similarity of L2-normalised embeddings, in [−1, 1].  Over the unordered pairs i<j, the
positive (same label) and negative similarities are soft-binned with the triangular kernel of width
Δ = 2/num_bins on the nodes ``t_r = −1 + rΔ``, r = 0..num_bins (``num_bins`` as pytorch-metric-learning's
``n_bins``; default 100), each histogram normalised by its number of pairs.  The loss estimates the
probability that a random negative is more similar than a random positive::

    L = Σ_r h⁻_r · Φ⁺_r,        Φ⁺_r = Σ_{q≤r} h⁺_q

Memory O(B² + bins) (two ``scatter_add``s, :mod:`caffe_compat.losses.soft_histogram`); PML builds all
B³ triplets first.  An empty positive or negative set gives 0.

Difference from pytorch-metric-learning ``HistogramLoss(n_bins)``: PML takes the pairs that occur in
some (anchor, positive, negative) triplet, so a negative pair between two samples that both have no
positive in the batch is left out; here every pair counts, as in the paper.  When every class in the
batch has at least two samples the two coincide.  PML also fails on a similarity of exactly 1
(index past the last node); here it lands on the last node.
"""

from __future__ import annotations

import torch

from caffe_compat.losses.batch_input import check_batch, check_num_bins, reject_pml_arguments
from caffe_compat.losses.pairwise import label_masks, normalized_cosine_matrix
from caffe_compat.losses.soft_histogram import triangular_histogram
from caffe_compat.losses.static_form import static_form


class HistogramLoss(torch.nn.Module):
    """Histogram loss of Ustinova & Lempitsky: the probability that a negative outranks a positive.

    Space: cosine similarity of L2-normalised embeddings, in [−1, 1].  The similarities of the
    unordered positive and negative pairs i<j are soft-binned with the triangular kernel of width
    Δ = 2/num_bins on the nodes ``t_r = −1 + rΔ``; each histogram is divided by its pair count::

        L = Σ_r h⁻_r · Σ_{q≤r} h⁺_q

    A batch without positive or without negative pairs gives 0.  A similarity of exactly 1 lands on the
    last node (PML fails there).  Takes no ``miner=``, ``indices_tuple``, ``ref_emb`` or ``ref_labels``
    (``LossArgumentError``): the histograms use every pair.

    Args:
        num_bins: number of bins, Δ = 2/num_bins (default 100; PML's ``n_bins``).
    """

    def __init__(self, num_bins: int = 100):
        super().__init__()
        self.num_bins = check_num_bins(num_bins, "HistogramLoss")

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor, indices_tuple=None, ref_emb=None,
                ref_labels=None) -> torch.Tensor:
        reject_pml_arguments("HistogramLoss", "its two histograms are over every pair of the batch",
                             indices_tuple=indices_tuple, ref_emb=ref_emb, ref_labels=ref_labels)
        labels = check_batch(embeddings, labels, "HistogramLoss")
        sim = normalized_cosine_matrix(embeddings)
        pos, neg = label_masks(labels)
        upper = torch.ones_like(pos).triu(diagonal=1)
        pos_w = (pos & upper).to(sim.dtype).reshape(1, -1)
        neg_w = (neg & upper).to(sim.dtype).reshape(1, -1)
        n_pos, n_neg = pos_w.sum(), neg_w.sum()
        static = static_form(sim)
        if not static and (n_pos == 0 or n_neg == 0):
            return sim.sum() * 0.0
        if static:  # the same values without a data-dependent branch: an empty histogram gives 0
            n_pos, n_neg = n_pos.clamp_min(1), n_neg.clamp_min(1)
        values = sim.reshape(1, -1)
        h_pos = triangular_histogram(values, pos_w, self.num_bins, -1.0, 1.0)[0] / n_pos
        h_neg = triangular_histogram(values, neg_w, self.num_bins, -1.0, 1.0)[0] / n_neg
        return (h_neg * torch.cumsum(h_pos, dim=0)).sum()

"""Smooth-AP (Brown, Xie, Kalogeiton & Zisserman, ECCV 2020).

Space: cosine similarity ``s`` of L2-normalised embeddings.  Every sample q queries the batch; with
its positives P (same label) and negatives N, ``D_ij = s_qj − s_qi`` and the sigmoid
``G(D; τ) = 1 / (1 + exp(−D/τ))``, τ = temperature = 0.01::

    AP_q = 1/|P| Σ_{i∈P} (1 + Σ_{j∈P, j≠i} G(D_ij)) / (1 + Σ_{j∈P, j≠i} G(D_ij) + Σ_{j∈N} G(D_ij))
    L    = 1 − mean of AP_q over the queries with at least one positive

(the appendix of Bleeker & de Rijke, Eq. 1–2; its Eq. 4 prints ``D_ij = s_i − s_j``, the opposite sign
of Brown et al.'s definition and code, which is used here so that ``G(D_ij) ≈ 1`` when j outranks i).

A batch in which no query has a positive gives 0 (as PML's FastAP; attached to the autograd graph,
zero gradient); with ``include_query=True`` every query is its own positive, so this cannot happen.

The query itself: by default (``include_query=False``) it is not a candidate — the retrieval set is the
rest of the batch, as in the paper.  ``include_query=True`` reproduces the authors' code (and
pytorch-metric-learning's ``SmoothAPLoss``), where the query is one of its own positives, with
similarity 1 (it then ranks first and adds a near-1 term to every AP).

Any label layout works (the authors' code and PML need equal-size contiguous classes; PML 2.9 also
groups the batch in blocks of size #classes instead of #samples per class, so it matches only when the
two are equal).  Work and memory are O(B · P_max · B) with P_max the largest number of positives of a
query (each query only ranks its own positives), not the B³ tensors of the reference code; except in the
static form (``torch.compile``, CUDA-graph capture), where P_max, read on the host, becomes B: B³ there.
The gradient with respect to the query is the appendix's Eq. 14 exactly as printed (checked in the
tests): its Eq. 4 sign (``∂D_ij/∂q = v_i − v_j``) and its reversed quotient rule in Eq. 11 cancel.
"""

from __future__ import annotations

import torch

from caffe_compat.losses.batch_input import check_batch, check_positive, reject_pml_arguments
from caffe_compat.losses.pairwise import label_masks, normalized_cosine_matrix, one_minus_mean_ap
from caffe_compat.losses.static_form import static_form


def smooth_ap_per_query(sim: torch.Tensor, pos: torch.Tensor, candidates: torch.Tensor, temperature: float):
    """``AP_q`` for each row of ``sim`` (queries × candidates).

    ``pos`` (bool, same shape) marks each query's positives, ``candidates`` (bool) every candidate in
    its retrieval set (positives included).  Returns ``(AP, has_positive)``, both ``(Q,)``.
    """
    n_pos = pos.sum(dim=1)
    # slots per query: the largest |P| (read on the host); in the static form every candidate column (no
    # host read: torch.compile, CUDA-graph capture), the extra slots padding like the others
    if static_form(sim):
        most = max(pos.shape[1], 1)
    else:
        most = max(int(n_pos.max()), 1) if pos.numel() else 1
    # column indices of each query's positives, padded; `real` marks the non-padding slots
    order = torch.sort(pos.to(torch.int8), dim=1, descending=True, stable=True).indices[:, :most]
    real = torch.arange(most, device=sim.device)[None, :] < n_pos[:, None]
    scaled = sim / temperature
    g = torch.sigmoid(scaled[:, None, :] - scaled.gather(1, order)[:, :, None])  # G(D_ij), (Q, P, C)
    # Σ_j over candidates and over positives in one batched product; the j = i term is G(0) = 1/2
    # exactly (its gradient cancels exactly too), so "1 + Σ_{j≠i}" is "1/2 + Σ_j"
    sums = torch.bmm(g, torch.stack([candidates, pos], dim=2).to(sim.dtype))  # (Q, P, 2)
    rank_all = 0.5 + sums[..., 0]
    rank_pos = 0.5 + sums[..., 1]
    ratio = torch.where(real, rank_pos / rank_all, torch.zeros_like(rank_all))
    has_pos = n_pos > 0
    return ratio.sum(dim=1) / n_pos.clamp_min(1).to(sim.dtype), has_pos


class SmoothAPLoss(torch.nn.Module):
    """Smooth-AP (Brown et al. 2020): 1 − mean sigmoid-smoothed AP of each query's ranking.

    Space: cosine similarity of L2-normalised embeddings.  ``G(D) = sigmoid(D/τ)``, ``D_ij = s_qj − s_qi``::

        AP_q = 1/|P| Σ_{i∈P} (1 + Σ_{j∈P, j≠i} G(D_ij)) / (1 + Σ_{j∈P∪N, j≠i} G(D_ij))
        L    = 1 − mean of AP_q over the queries with at least one positive

    If no query has a positive the loss is 0 (still attached to the graph, with zero gradient).  Any
    label layout is supported.
    Takes no ``miner=``, ``indices_tuple``, ``ref_emb`` or ``ref_labels`` (list-wise loss; the latter
    raise ``LossArgumentError``).

    Args:
        temperature: τ (default 0.01).
        include_query: the query is one of its own positives, as in the authors' code and PML (default
            False: the retrieval set is the rest of the batch).  Every query then has a positive.
    """

    def __init__(self, temperature: float = 0.01, include_query: bool = False):
        super().__init__()
        self.temperature = check_positive(float(temperature), "temperature", "SmoothAPLoss")
        self.include_query = bool(include_query)

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor, indices_tuple=None, ref_emb=None,
                ref_labels=None) -> torch.Tensor:
        reject_pml_arguments("SmoothAPLoss", "each query ranks the whole rest of the batch (list-wise loss)",
                             indices_tuple=indices_tuple, ref_emb=ref_emb, ref_labels=ref_labels)
        labels = check_batch(embeddings, labels, "SmoothAPLoss")
        sim = normalized_cosine_matrix(embeddings)
        pos, neg = label_masks(labels)
        if self.include_query:
            eye = torch.eye(len(labels), dtype=torch.bool, device=sim.device)
            pos = pos | eye
        candidates = pos | neg
        ap, has_pos = smooth_ap_per_query(sim, pos, candidates, self.temperature)
        return one_minus_mean_ap(ap, has_pos)  # no positive anywhere: 0, zero gradient

"""FastAP (He, Lu & Sclaroff, "Deep Metric Learning to Rank", CVPR 2019).

Space: squared Euclidean distance ``d_ij = ‖x̂_i − x̂_j‖²`` of L2-normalised embeddings, in [0, 4].
Each sample i queries the rest of the batch; its positives (same label) and negatives are soft-binned
(supplement C.1, Eqs. 6–7) on ``L + 1`` bin centres ``c_l = linspace(0, 4, L + 1)`` (``L = num_bins``,
default 10) with the triangular kernel of width Δ = 4/L, giving ``h⁺_i``, ``h⁻_i``.  With the
cumulative histograms ``H⁺ = cumsum h⁺``, ``H = cumsum (h⁺ + h⁻)`` and ``N⁺_i = |B_i⁺|``::

    FastAP_i = 1/N⁺_i · Σ_l h⁺_{i,l} H⁺_{i,l} / H_{i,l}                   (0/0 terms are 0)
    L        = 1 − mean of FastAP_i over the anchors with at least one positive

A batch in which no anchor has a positive gives a loss of 0 (as PML; an empty mean would otherwise
read as the worst value 1), still attached to the autograd graph with a zero gradient.

Equal to ``pytorch_metric_learning.losses.FastAPLoss(num_bins)`` (which builds the (L+1)·B² "pulse"
tensor; here the binning is two ``scatter_add``s, O(B² + B·L) memory).

``analytic_gradient=True`` computes the backward pass of the supplement (C.2–C.3) in a
``torch.autograd.Function`` instead of autograd: ``F⁺ = [ĝ⁺] + U[f̂⁺]`` (Eq. 30) with
``ĝ⁺_l = ∂FastAP_{i,l}/∂h⁺_l``, ``f̂⁺_j = h⁺_j H⁻_j / H_j²`` (Eq. 26) and U the strict upper-triangular
ones (a reverse exclusive cumsum), the same for F⁻, then Eq. 17: ``∂/∂Ψ = −2/M · Σ_l (F_l B_l + B_l F_l)
Ψ`` over both signs.  B_l holds δ'(d_ij, c_l), non-zero only for the two centres around d_ij, so the sum
over l is evaluated by gathering those two bins: O(B² + B·L) instead of O(L·B²).  Eq. 17 uses
``∂d_ij/∂x̂_i = −2 x̂_j`` (unit norm); the dropped radial term is annihilated by the normalisation, so
the gradient with respect to the raw embeddings equals autograd's.
"""

from __future__ import annotations

import torch

from caffe_compat.losses.batch_input import check_batch, check_num_bins, reject_pml_arguments
from caffe_compat.losses.pairwise import label_masks, one_minus_mean_ap, squared_euclidean_matrix
from caffe_compat.losses.soft_histogram import bin_coordinates, triangular_histogram

HIGH = 4.0  # squared distance of unit vectors lies in [0, 4]


def _fastap_terms(h_pos: torch.Tensor, h_neg: torch.Tensor):
    """Per-bin quantities of Eq. (21): cumulative histograms and the safe denominator."""
    cum_pos = torch.cumsum(h_pos, dim=1)
    cum_all = torch.cumsum(h_pos + h_neg, dim=1)
    safe = torch.where(cum_all > 0, cum_all, torch.ones_like(cum_all))
    return cum_pos, cum_all, safe


def fastap_per_anchor(h_pos: torch.Tensor, h_neg: torch.Tensor, n_pos: torch.Tensor) -> torch.Tensor:
    """``FastAP_i`` from the (B, L+1) soft histograms; anchors without positives get 0."""
    cum_pos, _, safe = _fastap_terms(h_pos, h_neg)
    ap = (h_pos * cum_pos / safe).sum(dim=1)
    return ap / n_pos.clamp_min(1.0)


def _histograms(dist, pos_w, neg_w, num_bins):
    return (
        triangular_histogram(dist, pos_w, num_bins, 0.0, HIGH),
        triangular_histogram(dist, neg_w, num_bins, 0.0, HIGH),
    )


class _FastAPAnalytic(torch.autograd.Function):
    """``loss = 1 − mean_i FastAP_i`` of unit-norm rows ``x̂`` with the supplement's gradient."""

    @staticmethod
    def forward(ctx, unit, pos_w, neg_w, num_bins):
        dist = squared_euclidean_matrix(unit)
        h_pos, h_neg = _histograms(dist, pos_w, neg_w, num_bins)
        n_pos = pos_w.sum(dim=1)
        valid = n_pos > 0
        ap = fastap_per_anchor(h_pos, h_neg, n_pos)
        loss = one_minus_mean_ap(ap, valid)
        ctx.save_for_backward(unit, dist, pos_w, neg_w, h_pos, h_neg, n_pos)
        ctx.num_bins = num_bins
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        unit, dist, pos_w, neg_w, h_pos, h_neg, n_pos = ctx.saved_tensors
        num_bins = ctx.num_bins
        cum_pos, cum_all, safe = _fastap_terms(h_pos, h_neg)
        cum_neg = cum_all - cum_pos
        inv, inv2 = 1.0 / safe, 1.0 / (safe * safe)
        live = (cum_all > 0).to(unit.dtype)
        # ĝ: derivative of the own-bin term h⁺_l H⁺_l / H_l; f̂: of a later bin j > l (Eq. 26)
        g_pos = ((cum_pos + h_pos) * inv - h_pos * cum_pos * inv2) * live
        g_neg = -(h_pos * cum_pos * inv2) * live
        f_pos = h_pos * cum_neg * inv2 * live
        f_neg = -(h_pos * cum_pos * inv2) * live

        def later_sum(f):  # (U f)_l = Σ_{j>l} f_j
            return torch.flip(torch.cumsum(torch.flip(f, [1]), dim=1), [1]) - f

        valid = n_pos > 0
        scale = -grad_out / valid.sum().clamp_min(1) * valid.to(unit.dtype) / n_pos.clamp_min(1.0)
        big_f_pos = (g_pos + later_sum(f_pos)) * scale[:, None]  # ∂loss/∂h⁺_{i,l}
        big_f_neg = (g_neg + later_sum(f_neg)) * scale[:, None]
        lower, _, inside = bin_coordinates(dist, num_bins, 0.0, HIGH)
        slope = inside.to(unit.dtype) * (num_bins / HIGH)  # δ' = −1/Δ at the lower, +1/Δ at the upper centre

        def through_bins(big_f, w):
            return w * slope * (big_f.gather(1, lower + 1) - big_f.gather(1, lower))

        grad_dist = through_bins(big_f_pos, pos_w) + through_bins(big_f_neg, neg_w)  # ∂loss/∂d_ij
        sym = grad_dist + grad_dist.t()
        grad_unit = -2.0 * (sym @ unit)  # Eq. (17), ∂d_ij/∂x̂_i = −2 x̂_j
        return grad_unit, None, None, None


class FastAPLoss(torch.nn.Module):
    """FastAP (He et al. 2019): 1 − mean histogram-approximated AP of each anchor's ranking.

    Space: squared Euclidean distance of L2-normalised embeddings, in [0, 4], soft-binned with the
    triangular kernel on the L + 1 centres ``linspace(0, 4, L + 1)`` (width Δ = 4/L)::

        FastAP_i = 1/N⁺_i · Σ_l h⁺_{i,l} H⁺_{i,l} / H_{i,l}
        L        = 1 − mean of FastAP_i over the anchors with at least one positive

    If no anchor has a positive the loss is 0 (still attached to the graph, with zero gradient), as in
    PML.  Equals PML's ``FastAPLoss(num_bins)``.
    Takes no ``miner=``, ``indices_tuple``, ``ref_emb`` or ``ref_labels`` (list-wise loss; the latter
    raise ``LossArgumentError``).

    Args:
        num_bins: L (default 10).
        analytic_gradient: backward pass of the supplement (C.2–C.3) instead of autograd (default
            False; same gradient).
    """

    def __init__(self, num_bins: int = 10, analytic_gradient: bool = False):
        super().__init__()
        self.num_bins = check_num_bins(num_bins, "FastAPLoss")
        self.analytic_gradient = bool(analytic_gradient)

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor, indices_tuple=None, ref_emb=None,
                ref_labels=None) -> torch.Tensor:
        reject_pml_arguments("FastAPLoss", "each anchor ranks the whole rest of the batch (list-wise loss)",
                             indices_tuple=indices_tuple, ref_emb=ref_emb, ref_labels=ref_labels)
        labels = check_batch(embeddings, labels, "FastAPLoss")
        unit = torch.nn.functional.normalize(embeddings, dim=1)
        pos, neg = label_masks(labels)
        pos_w, neg_w = pos.to(unit.dtype), neg.to(unit.dtype)
        if self.analytic_gradient:
            return _FastAPAnalytic.apply(unit, pos_w, neg_w, self.num_bins)
        dist = squared_euclidean_matrix(unit)
        h_pos, h_neg = _histograms(dist, pos_w, neg_w, self.num_bins)
        n_pos = pos_w.sum(dim=1)
        valid = n_pos > 0
        ap = fastap_per_anchor(h_pos, h_neg, n_pos)
        return one_minus_mean_ap(ap, valid)

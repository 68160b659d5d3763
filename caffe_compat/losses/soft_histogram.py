"""Triangular-kernel soft histograms (Ustinova & Lempitsky 2016; reused by FastAP, He et al. 2018).

Nodes ``c_l = low + l·Δ``, ``l = 0..L`` with ``Δ = (high − low) / L`` (``L = num_bins``, so L + 1 nodes).
A value ``v`` contributes ``δ(v, c_l) = max(0, 1 − |v − c_l| / Δ)`` to node l: with the kernel width equal
to one bin, that is ``1 − t`` to the node below and ``t`` to the node above, ``t = (v − c_lo)/Δ``.

Computed with two ``scatter_add`` calls per row, so memory is O(rows·cols + rows·L), never the
O(rows·cols·L) "pulse" tensor a naive ``relu(1 − |v − c|/Δ)`` broadcast materialises.  Values are clamped
to ``[low, high]`` (round-off can push a cosine past 1 or a squared distance below 0); a value exactly
on the top node puts weight 1 there.
"""

from __future__ import annotations

import torch


def triangular_histogram(
    values: torch.Tensor, weights: torch.Tensor, num_bins: int, low: float, high: float
) -> torch.Tensor:
    """Row-wise soft histograms ``h[r, l] = Σ_c weights[r, c] · δ(values[r, c], c_l)``.

    ``values`` and ``weights`` are ``(R, C)`` (weights 0 exclude an entry); returns ``(R, num_bins + 1)``.
    Differentiable in ``values`` (slope ±weights/Δ between nodes) and in ``weights``.
    """
    delta = (high - low) / num_bins
    position = ((values - low) / delta).clamp(0.0, float(num_bins))
    lower = position.detach().floor().clamp(max=num_bins - 1).long()
    upper_share = position - lower.to(position.dtype)
    weights = weights.to(values.dtype)
    hist = values.new_zeros(values.shape[0], num_bins + 1)
    hist = hist.scatter_add(1, lower, weights * (1.0 - upper_share))
    return hist.scatter_add(1, lower + 1, weights * upper_share)


def bin_coordinates(values: torch.Tensor, num_bins: int, low: float, high: float):
    """``(lower node index, upper share t, in-range mask)`` of each value, as used by
    :func:`triangular_histogram`; the mask is where the clamp lets the gradient through."""
    delta = (high - low) / num_bins
    raw = (values - low) / delta
    position = raw.clamp(0.0, float(num_bins))
    lower = position.floor().clamp(max=num_bins - 1).long()
    inside = (raw >= 0.0) & (raw <= float(num_bins))
    return lower, position - lower.to(position.dtype), inside

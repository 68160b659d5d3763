"""Pairwise similarities and label masks shared by every metric-learning loss.

One place for the batch geometry: cosine matrices (Caffe's ``CosineSimilarityBatch`` formula),
(squared) Euclidean distance matrices, the i<j pair enumeration Caffe uses, and same/different-label
masks.  Losses import from here and nowhere else for these quantities.
"""

from __future__ import annotations

import torch


def cosine_matrix(x: torch.Tensor) -> torch.Tensor:
    """``S[i, j] = <x_i, x_j> / sqrt(|x_i|^2 |x_j|^2)``: the square root of the *product* of squared
    norms, exactly as the FAPPY authors' ``CosineSimilarityBatch`` computes it (a zero row gives NaN,
    as in Caffe)."""
    xy = x @ x.t()
    sq = torch.diagonal(xy)
    return xy / torch.sqrt(sq[:, None] * sq[None, :])


def normalized_cosine_matrix(x: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """Cosine matrix of L2-normalised rows (``F.normalize`` convention: a zero row gives zeros)."""
    xn = torch.nn.functional.normalize(x, dim=1, eps=eps)
    return xn @ xn.t()


def squared_euclidean_matrix(x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
    """``D[i, j] = |x_i - y_j|^2`` by the Gram expansion, clamped at 0 against round-off."""
    y = x if y is None else y
    xx = (x * x).sum(1)
    yy = (y * y).sum(1)
    return (xx[:, None] + yy[None, :] - 2.0 * (x @ y.t())).clamp_min(0.0)


def euclidean_matrix(x: torch.Tensor, y: torch.Tensor | None = None, eps: float = 1e-12) -> torch.Tensor:
    """``D[i, j] = sqrt(|x_i - y_j|^2 + eps)``: eps keeps the gradient finite on the diagonal."""
    return torch.sqrt(squared_euclidean_matrix(x, y) + eps)


def label_masks(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positive, negative)`` boolean B×B masks: same label without the diagonal, different label."""
    labels = labels.reshape(-1)
    same = labels[:, None] == labels[None, :]
    eye = torch.eye(len(labels), dtype=torch.bool, device=labels.device)
    return same & ~eye, ~same


def upper_pairs(batch_size: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices ``(i, j)`` of the pairs i<j in Caffe's row-major order: pair k = B·i − i(i+1)/2 + (j−i−1)."""
    ij = torch.triu_indices(batch_size, batch_size, offset=1, device=device)
    return ij[0], ij[1]


def pair_index(i: torch.Tensor, j: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Row-major index k of the pair (i, j), i<j (the inverse of :func:`upper_pairs`)."""
    return batch_size * i - i * (i + 1) // 2 + (j - i - 1)

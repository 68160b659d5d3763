"""Validation of the ``(embeddings, labels)`` batch every metric-learning loss takes.

One place for the checks so that each loss raises the same :class:`~caffe_compat.losses.loss_errors.LossInputError` (a ``CaffeCompatError``)
with the loss's name, the offending shape and what was expected: embeddings ``(B, D)`` floating point,
labels ``(B,)`` (any dtype: Caffe label blobs are float; compared with ``==``), both on one device.
"""

from __future__ import annotations

import torch

from caffe_compat.losses.loss_errors import LossInputError


def check_batch(embeddings: torch.Tensor, labels: torch.Tensor, loss_name: str) -> torch.Tensor:
    """Validate a batch and return the labels flattened to ``(B,)``."""
    if not isinstance(embeddings, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise LossInputError(f"{loss_name}: embeddings and labels must be torch tensors")
    if embeddings.dim() != 2:
        raise LossInputError(f"{loss_name}: embeddings must be (B, D), got shape {tuple(embeddings.shape)}")
    if not embeddings.is_floating_point():
        raise LossInputError(f"{loss_name}: embeddings must be floating point, got {embeddings.dtype}")
    flat = labels.reshape(-1)
    if flat.numel() != embeddings.shape[0]:
        raise LossInputError(
            f"{loss_name}: {flat.numel()} labels for {embeddings.shape[0]} embeddings (labels shape "
            f"{tuple(labels.shape)}); expected one label per row"
        )
    if flat.device != embeddings.device:
        raise LossInputError(f"{loss_name}: embeddings on {embeddings.device} but labels on {flat.device}")
    return flat


def check_positive(value: float, name: str, loss_name: str) -> float:
    """A strictly positive hyper-parameter (temperature, scale, bin count, ...)."""
    if not value > 0:
        raise LossInputError(f"{loss_name}: {name} must be > 0, got {value!r}")
    return value


def check_num_bins(num_bins: int, loss_name: str) -> int:
    if isinstance(num_bins, bool) or int(num_bins) != num_bins or num_bins < 1:
        raise LossInputError(f"{loss_name}: num_bins must be a positive integer, got {num_bins!r}")
    return int(num_bins)

"""Validation of the ``(embeddings, labels)`` batch every metric-learning loss takes, and of
pytorch-metric-learning's optional ``indices_tuple``, ``ref_emb``, ``ref_labels``.

One place for the checks so that each loss raises the same :class:`~caffe_compat.losses.loss_errors.LossInputError` (a ``CaffeCompatError``)
with the loss's name, the offending shape and what was expected: embeddings ``(B, D)`` floating point,
labels ``(B,)`` (any dtype: Caffe label blobs are float; compared with ``==``), both on one device.

PML's calling convention ``loss(embeddings, labels, indices_tuple=None, ref_emb=None, ref_labels=None)``
is resolved by :func:`pair_inputs` into the (transformed) queries, the reference rows and the pair
counts (:class:`~caffe_compat.losses.pairwise.PairSelection`) every pair loss works on:

* ``indices_tuple`` (``(a1, p, a2, n)`` pairs or ``(a, p, n)`` triplets, integer index tensors; PML's
  conversions, :mod:`~caffe_compat.losses.pairwise`) is the pair set: the loss's own ``miner=`` is then
  not run.  Anchors index the batch, positives and negatives the reference set (the batch itself
  without ``ref_emb``);
* ``ref_emb`` with ``ref_labels`` (both or neither): pairs are (query, reference sample), all of them
  counted, none excluded as a self-pair; a ``miner=`` is called with the reference set too;
* neither: every pair of the batch, or the ``miner=``'s selection, as before.

A loss that has no meaning for one of these arguments calls :func:`reject_pml_arguments`, which
raises :class:`~caffe_compat.losses.loss_errors.LossArgumentError` naming the loss and the argument.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from caffe_compat.losses.loss_errors import LossArgumentError, LossInputError
from caffe_compat.losses.pairwise import (
    PairSelection, normalized_cosine_matrix, select_pairs, selection_from_tuple, unit_rows,
)


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


def check_reference(embeddings: torch.Tensor, ref_emb, ref_labels, loss_name: str):
    """Validate PML's ``ref_emb`` / ``ref_labels`` (both or neither); return ``(ref_emb, flat ref_labels)``
    or ``(None, None)``."""
    if ref_emb is None and ref_labels is None:
        return None, None
    if ref_emb is None or ref_labels is None:
        given, missing = ("ref_emb", "ref_labels") if ref_labels is None else ("ref_labels", "ref_emb")
        raise LossInputError(f"{loss_name}: {given} given without {missing}; pass both or neither")
    ref_labels = check_batch(ref_emb, ref_labels, f"{loss_name} (ref_emb, ref_labels)")
    if ref_emb.shape[1] != embeddings.shape[1] or ref_emb.device != embeddings.device:
        raise LossInputError(
            f"{loss_name}: ref_emb {tuple(ref_emb.shape)} on {ref_emb.device} does not match embeddings "
            f"{tuple(embeddings.shape)} on {embeddings.device}; expected (R, {embeddings.shape[1]}) on one device"
        )
    return ref_emb, ref_labels


def check_indices_tuple(indices_tuple, n_query: int, n_ref: int, device, loss_name: str) -> tuple:
    """Validate a PML index tuple: 3 (triplets) or 4 (pairs) 1-D integer tensors on the embeddings'
    device, matching lengths, anchors in [0, n_query), the others in [0, n_ref).  Returns it as a tuple
    of long tensors."""
    if not isinstance(indices_tuple, (tuple, list)) or len(indices_tuple) not in (3, 4):
        length = f" of length {len(indices_tuple)}" if isinstance(indices_tuple, (tuple, list)) else ""
        raise LossInputError(f"{loss_name}: indices_tuple must be (a, p, n) triplets or (a1, p, a2, n) pairs, "
                             f"got {type(indices_tuple).__name__}{length}")
    names = ("a", "p", "n") if len(indices_tuple) == 3 else ("a1", "p", "a2", "n")
    out = []
    for name, idx in zip(names, indices_tuple):
        if not isinstance(idx, torch.Tensor) or idx.dim() != 1 or idx.is_floating_point() or idx.is_complex() \
                or idx.dtype == torch.bool:
            raise LossInputError(f"{loss_name}: indices_tuple's {name} must be a 1-D integer tensor, got "
                                 f"{getattr(idx, 'dtype', type(idx).__name__)} {tuple(getattr(idx, 'shape', ()))}")
        if idx.device != device:
            raise LossInputError(f"{loss_name}: indices_tuple's {name} is on {idx.device}, embeddings on {device}")
        bound = n_query if name.startswith("a") else n_ref
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= bound):
            raise LossInputError(f"{loss_name}: indices_tuple's {name} must lie in [0, {bound}), got "
                                 f"[{int(idx.min())}, {int(idx.max())}]")
        out.append(idx.long())
    groups = [out] if len(out) == 3 else [out[:2], out[2:]]
    for group in groups:
        if len({len(t) for t in group}) != 1:
            raise LossInputError(f"{loss_name}: indices_tuple lengths differ: "
                                 + ", ".join(f"{n}={len(t)}" for n, t in zip(names, out)))
    return tuple(out)


def reject_pml_arguments(loss_name: str, why: str, **arguments) -> None:
    """Raise :class:`LossArgumentError` for the first of ``arguments`` that is not None."""
    for name, value in arguments.items():
        if value is not None:
            raise LossArgumentError(f"{loss_name} takes no {name}: {why}")


@dataclass(frozen=True)
class PairInputs:
    """A pair loss's resolved inputs: ``x`` the (transformed) queries ``(B, D)``, ``ref`` the (transformed)
    reference rows ``(R, D)`` or None without ``ref_emb`` (the batch itself), ``labels`` ``(B,)``,
    ``ref_labels`` ``(R,)`` or None, ``pairs`` the ``(B, R)`` pair counts, ``triplets`` the ``(a, p, n)`` of a triplet
    ``indices_tuple`` (None otherwise)."""

    x: torch.Tensor
    ref: torch.Tensor | None
    labels: torch.Tensor
    ref_labels: torch.Tensor | None
    pairs: PairSelection
    triplets: tuple | None

    def cosine(self) -> torch.Tensor:
        """``(B, R)`` cosine similarities of the L2-normalised queries and reference rows."""
        return normalized_cosine_matrix(self.x, self.ref)


def pair_inputs(loss_name: str, embeddings, labels, indices_tuple=None, ref_emb=None, ref_labels=None, *,
                miner=None, normalize: bool = False) -> PairInputs:
    """Validate a PML-convention call and resolve its pair set (see the module docstring).

    ``normalize``: L2-normalise the embeddings and the reference rows first (the miner sees them so)."""
    labels = check_batch(embeddings, labels, loss_name)
    ref_emb, ref_labels = check_reference(embeddings, ref_emb, ref_labels, loss_name)
    x, ref = unit_rows(embeddings, normalize), unit_rows(ref_emb, normalize)
    n_ref = x.shape[0] if ref is None else ref.shape[0]
    triplets = None
    if indices_tuple is not None:
        indices_tuple = check_indices_tuple(indices_tuple, x.shape[0], n_ref, x.device, loss_name)
        pairs = selection_from_tuple(indices_tuple, x.shape[0], n_ref, x.dtype)
        triplets = indices_tuple if len(indices_tuple) == 3 else None
    else:
        pairs = select_pairs(miner, x, labels, ref, ref_labels)
    return PairInputs(x, ref, labels, ref_labels, pairs, triplets)

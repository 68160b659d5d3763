"""Caffe's ``Blob::Reshape`` memory rule and pycaffe's ``reshape`` / ``add_blob`` argument rules, shared by
the blobs a Python layer sees (:class:`~caffe_compat.layers.python_user.HostBlob`) and pycaffe's net and
parameter blobs (:mod:`caffe_compat.pycaffe.blob`).

* ``Blob::Reshape`` keeps the blob's memory (its values, seen in the new shape) while the new count fits in
  its capacity (the largest count it had); a larger count allocates new memory, which Caffe's
  ``SyncedMemory`` hands out zeroed on first use (``to_cpu`` of an uninitialised head memsets it).
* pycaffe's ``Blob.reshape`` and ``BlobVec.add_blob`` are boost ``raw_function`` s that throw
  ``std::runtime_error("... takes no kwargs")`` on a keyword argument: a RuntimeError in Python.
"""

from __future__ import annotations

import numpy as np
import torch

from caffe_compat.errors import ShapeMismatchError

__all__ = ["shape_argument", "within_capacity"]


def shape_argument(name: str, shape: tuple, kwargs: dict | None = None, method: str = "Blob.reshape"
                   ) -> tuple[int, ...]:
    """pycaffe's ``blob.reshape(n, c, h, w)`` (or ``blob.reshape((n, c, h, w))``) as a tuple of ints.  Keyword
    arguments are pycaffe's RuntimeError ``"<method> takes no kwargs"``."""
    if kwargs:
        raise RuntimeError(f"{method} takes no kwargs")
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    shape = tuple(int(d) for d in shape)
    if any(d < 0 for d in shape):
        raise ShapeMismatchError(f"blob '{name}': negative dimension in {shape}")
    return shape


def within_capacity(current: torch.Tensor, shape: tuple[int, ...], base: torch.Tensor | None):
    """Caffe's ``Blob::Reshape`` of one memory: ``(view, base)``, the memory seen in ``shape`` (values kept,
    those past the current count too, as Caffe's capacity keeps them) when the new count fits in ``base``
    (the largest memory an earlier reshape gave this blob, if ``current`` still lies in it, else ``current``),
    else new zeros, which become the base."""
    if base is None or base.untyped_storage().data_ptr() != current.untyped_storage().data_ptr():
        base = current
    count = int(np.prod(shape, dtype=np.int64))
    if base.is_contiguous() and count <= base.numel():
        return base.reshape(-1)[:count].view(shape), base
    fresh = torch.zeros(shape, dtype=current.dtype, device=current.device)
    return fresh, fresh

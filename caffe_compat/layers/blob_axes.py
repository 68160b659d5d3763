"""Blob-axis arithmetic shared by the layer ports (Caffe's ``Blob::CanonicalAxisIndex`` and ``count``).

Caffe addresses axes by a signed index: ``-1`` is the last axis, and an index must lie in
``[-num_axes, num_axes)``.  Many layers split a blob into ``outer × dim × inner`` around an axis; the
helpers here do that arithmetic once so that every layer raises the same clear error for a bad axis.
"""

from __future__ import annotations

import math
from typing import Sequence

from caffe_compat.errors import FormatError


def canonical_axis(axis: int, num_axes: int, layer: str, field: str = "axis") -> int:
    """``axis`` mapped into ``[0, num_axes)`` (negative counts from the end), as Caffe's
    ``CanonicalAxisIndex``; raises :class:`FormatError` naming the layer and field when out of range."""
    if not -num_axes <= axis < num_axes:
        raise FormatError(f"layer '{layer}': {field} {axis} is out of range for a {num_axes}-axis blob "
                          f"(expected -{num_axes} <= {field} < {num_axes})")
    return axis + num_axes if axis < 0 else axis


def count(shape: Sequence[int], start: int = 0, end: int | None = None) -> int:
    """Product of ``shape[start:end]`` (1 for an empty range), Caffe's ``Blob::count(start, end)``."""
    return int(math.prod(shape[start:end]))


def broadcast_view(param_shape: Sequence[int], ndim: int, axis: int) -> list[int]:
    """Shape that lines a blob of ``param_shape`` up with axes ``axis .. axis+len-1`` of an ``ndim``-axis
    tensor (ones elsewhere), for broadcasting Scale/Bias/PReLU parameters."""
    return [1] * axis + list(param_shape) + [1] * (ndim - axis - len(param_shape))


def check_bottoms(layer: str, bottom_shapes: Sequence, minimum: int, maximum: int | None = None) -> None:
    """Raise :class:`FormatError` unless the layer got between ``minimum`` and ``maximum`` bottoms."""
    n = len(bottom_shapes)
    maximum = minimum if maximum is None else maximum
    if not minimum <= n <= maximum:
        expected = str(minimum) if minimum == maximum else f"{minimum} to {maximum}"
        raise FormatError(f"layer '{layer}': takes {expected} bottom blob(s), got {n}")

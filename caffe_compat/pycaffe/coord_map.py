"""pycaffe's ``caffe.coord_map``: the spatial coordinate mapping between two tops of a
:class:`~caffe_compat.pycaffe.net_spec.NetSpec` graph, and ``crop``, the Crop layer that aligns them
(how FCN nets crop their upsampled score maps to the input).

A map is ``(axis, a, b)``: output coordinate ``a * x + b`` for input coordinate ``x`` (``a``, ``b`` numpy
arrays, one entry per spatial axis, or broadcast scalars), axis ``None`` for pointwise layers.  As Caffe's
module:

* Convolution / Pooling / Im2col: ``(axis, 1/s, (p - (k_eff - 1)/2) / s)`` with ``k_eff = (k - 1)·d + 1``
  (``kernel_size``, ``stride`` ``s``, ``pad`` ``p``, ``dilation`` ``d`` read from ``convolution_param`` or the
  flat keywords; Pooling's from the flat keywords or ``pooling_param``); Deconvolution ``(axis, s,
  (k_eff - 1)/2 - p)``; Crop ``(axis - 1, 1, -offset)`` (``axis`` default 2); a map's axis is the last
  non-coordinate axis (1 for N×C×H×W); the pointwise types in
  :data:`PASS_THROUGH_LAYERS` ``(None, 1, 0)``; any other type raises :class:`UndefinedMapException`, which
  stops the walk through that layer.
* Maps compose as ``(a1·a2, a1·b2 + b1)``; axes must agree (:class:`AxisMismatchException`) unless one is
  ``None``.  :func:`coord_map_from_to` walks back from both tops to a common ancestor (a Crop layer's
  second bottom, the reference shape, is not walked) and returns ``to ∘ inverse(from)``.
* :func:`crop` checks that the scale is 1 and the shift a non-positive integer and returns
  ``L.Crop(top_from, top_to, crop_param=dict(axis=axis + 1, offset=[-b...]))`` (the first cropped axis;
  Caffe's module fails when only pointwise layers separate the tops, here the crop is then spatial, axis 2).

Caffe uses ``assert`` for the crop checks and a ``RuntimeError`` when no common ancestor exists; here they
are :class:`CoordMapError` (a CaffeCompatError that is also an ``AssertionError``/``RuntimeError``, so code
catching Caffe's exceptions keeps working).  The legacy ``kernel_h``/``pad_w``... keywords are refused, as
in Caffe.
"""

from __future__ import annotations

import numpy as np

from caffe_compat.errors import CaffeCompatError
from caffe_compat.pycaffe.net_spec import layers as L

__all__ = ["PASS_THROUGH_LAYERS", "UndefinedMapException", "AxisMismatchException", "CoordMapError", "conv_params",
           "crop_params", "coord_map", "compose", "inverse", "coord_map_from_to", "crop"]

PASS_THROUGH_LAYERS = ("AbsVal", "BatchNorm", "Bias", "BNLL", "Dropout", "Eltwise", "ELU", "Log", "LRN", "Exp",
                       "MVN", "Power", "ReLU", "PReLU", "Scale", "Sigmoid", "Split", "TanH", "Threshold")


class UndefinedMapException(CaffeCompatError):
    """The layer type has no coordinate mapping."""


class AxisMismatchException(CaffeCompatError):
    """Two maps to be composed act on different axes."""


class CoordMapError(CaffeCompatError, AssertionError, RuntimeError):
    """No mapping between the tops, or a crop that cannot be made (scale ≠ 1, negative or fractional width)."""


_LEGACY = {"pad_h", "pad_w", "kernel_h", "kernel_w", "stride_h", "stride_w"}


def conv_params(fn) -> tuple:
    """``(axis, stride, effective kernel size, pad)`` of a Convolution/Deconvolution/Pooling/Im2col Function
    (arrays of at least one entry; effective kernel ``(k - 1)·dilation + 1``)."""
    params = fn.params.get("convolution_param", fn.params.get("pooling_param", fn.params))
    if _LEGACY & (set(fn.params) | set(params)):
        raise CoordMapError(f"{fn.type_name}: cropping does not support the legacy _h/_w parameters")
    if "kernel_size" not in params:
        raise CoordMapError(f"{fn.type_name}: no kernel_size to map coordinates through")
    axis = params.get("axis", 1)
    kernel = np.array(params["kernel_size"], ndmin=1)
    dilation = np.array(params.get("dilation", 1), ndmin=1)
    return (axis, np.array(params.get("stride", 1), ndmin=1), (kernel - 1) * dilation + 1,
            np.array(params.get("pad", 0), ndmin=1))


def crop_params(fn) -> tuple:
    """``(axis, offset)`` of a Crop Function (defaults: axis 2, offset 0)."""
    params = fn.params.get("crop_param", fn.params)
    return params.get("axis", 2), np.array(params.get("offset", 0), ndmin=1)


def coord_map(fn) -> tuple:
    """The ``(axis, scale, shift)`` map of one layer (see the module docstring)."""
    if fn.type_name in ("Convolution", "Pooling", "Im2col"):
        axis, stride, kernel, pad = conv_params(fn)
        return axis, 1 / stride, (pad - (kernel - 1) / 2) / stride
    if fn.type_name == "Deconvolution":
        axis, stride, kernel, pad = conv_params(fn)
        return axis, stride, (kernel - 1) / 2 - pad
    if fn.type_name in PASS_THROUGH_LAYERS:
        return None, 1, 0
    if fn.type_name == "Crop":
        axis, offset = crop_params(fn)
        return axis - 1, 1, -offset  # the map's axis is the last non-coordinate one
    raise UndefinedMapException(f"layer type {fn.type_name} has no coordinate mapping")


def compose(base_map, next_map) -> tuple:
    """``base ∘ next``: scales multiply, ``next``'s shift is scaled by ``base``'s scale."""
    ax1, a1, b1 = base_map
    ax2, a2, b2 = next_map
    if ax1 is None:
        axis = ax2
    elif ax2 is None or ax1 == ax2:
        axis = ax1
    else:
        raise AxisMismatchException(f"cannot compose coordinate maps on axes {ax1} and {ax2}")
    return axis, a1 * a2, a1 * b2 + b1


def inverse(coord_map_) -> tuple:
    """The inverse map (output to input coordinates)."""
    axis, a, b = coord_map_
    return axis, 1 / a, -b / a


def _walked_bottoms(top) -> tuple:
    # every bottom maps alike, except a Crop's second bottom (it only gives the shape)
    bottoms = top.fn.inputs
    return bottoms[:1] if top.fn.type_name == "Crop" else bottoms


def _ancestor_maps(top) -> dict:
    maps = {top: (None, 1, 0)}
    frontier = [top]
    while frontier:
        current = frontier.pop()
        try:
            step = coord_map(current.fn)
        except UndefinedMapException:
            continue
        for bottom in _walked_bottoms(current):
            maps[bottom] = compose(maps[current], step)
            frontier.append(bottom)
    return maps


def coord_map_from_to(top_from, top_to) -> tuple:
    """The map from ``top_from``'s coordinates to ``top_to``'s, through their nearest common ancestor."""
    from_maps = _ancestor_maps(top_from)
    to_maps = {top_to: (None, 1, 0)}
    frontier = [top_to]
    while frontier:
        current = frontier.pop()
        if current in from_maps:
            return compose(to_maps[current], inverse(from_maps[current]))
        try:
            step = coord_map(current.fn)
        except UndefinedMapException:
            continue
        for bottom in _walked_bottoms(current):
            to_maps[bottom] = compose(to_maps[current], step)
            frontier.append(bottom)
    raise CoordMapError("could not compute the map between the tops: are they connected by spatial layers?")


def crop(top_from, top_to):
    """A Crop layer top cropping ``top_from`` to ``top_to`` with the axis and offsets of their mapping."""
    axis, a, b = coord_map_from_to(top_from, top_to)
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if not (a == 1).all():
        raise CoordMapError(f"scale mismatch on crop (a = {a})")
    if not (b <= 0).all():
        raise CoordMapError(f"cannot crop negative width (b = {b})")
    if not (np.round(b) == b).all():
        raise CoordMapError(f"cannot crop noninteger width (b = {b})")
    offsets = [int(v) for v in np.atleast_1d(-np.round(b).astype(int))]
    return L.Crop(top_from, top_to, crop_param=dict(axis=2 if axis is None else int(axis) + 1, offset=offsets))

"""Caffe's spatial geometry for convolution and pooling, torch-free (the ports' shape rules use it).

* convolution: ``out = (in + 2·pad − (dilation·(k − 1) + 1)) / stride + 1``, the division C++'s (toward zero);
* deconvolution: ``out = stride·(in − 1) + dilation·(k − 1) + 1 − 2·pad``;
* pooling (``pooled_hw`` / ``pooled_size``): ``ceil((in + 2·pad − k) / stride) + 1`` (``round_mode:
  FLOOR`` uses floor instead of ceil), then Caffe's clip: the last window must start inside the image or
  its left padding, ``if (out − 1)·stride >= in + pad: out −= 1``.  Quirk of Caffe 1.0's
  ``PoolingLayer::Reshape``: the clip is guarded by ``if (pad_h_ || pad_w_)``, so when *either* pad is
  nonzero it is applied to *both* axes, also to the one whose own pad is 0 (11×11 input, kernel 2,
  stride 4, ``pad_h: 1 pad_w: 0`` → 3×3, where per-axis rules would give 3×4).

Bad parameters raise :class:`~caffe_compat.errors.FormatError` naming the layer and the field, where
Caffe would stop with a failed CHECK.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from caffe_compat.errors import FormatError


def conv_out_size(size: int, kernel: int, stride: int = 1, pad: int = 0, dilation: int = 1) -> int:
    """Caffe's ``(size + 2·pad − extent) / stride + 1`` in C++ ``int`` arithmetic: the division truncates
    toward zero, so a kernel overhanging the padded input by less than a stride still gives one output
    (im2col reads the overhang as zeros), e.g. size 2, kernel 3, stride 2 → 1, where floor division gives 0."""
    extent = dilation * (kernel - 1) + 1
    span = size + 2 * pad - extent
    quotient = abs(span) // stride
    return (quotient if span >= 0 else -quotient) + 1


def conv_overhang(size: int, out: int, kernel: int, stride: int = 1, pad: int = 0, dilation: int = 1) -> int:
    """Zeros past the end of the padded input that the last of ``out`` windows reads (nonzero only in the
    truncation case of :func:`conv_out_size`)."""
    return max(0, (out - 1) * stride + dilation * (kernel - 1) + 1 - size - 2 * pad) if out > 0 else 0


def may_overhang(kernel, pad, dilation) -> bool:
    """Whether a convolution's kernel can overhang its padded input at all (its extent exceeds both pads by
    more than 1 on some axis): only then need the input's size be read for :func:`conv_overhangs`."""
    return any(d * (k - 1) + 1 - 2 * p > 1 for k, p, d in zip(kernel, pad, dilation))


def conv_overhangs(hw, kernel, stride, pad, dilation) -> tuple[int, ...]:
    """Per spatial axis, the zeros to append to an input of size ``hw`` so that a plain convolution gives
    Caffe's output size (:func:`conv_overhang` of :func:`conv_out_size`)."""
    return tuple(conv_overhang(int(size), conv_out_size(int(size), k, s, p, d), k, s, p, d)
                 for size, k, s, p, d in zip(hw, kernel, stride, pad, dilation))


def fold_zero_dilation(weight, dilation):
    """``(weight, dilation)`` for torch's convolutions, which refuse a dilation of 0.  Caffe's im2col/col2im
    read (write) input element ``o·s − p + k·d``: with ``d = 0`` every kernel offset ``k`` on that axis reaches
    the same element, so the product is that of a kernel 1 wide there holding the sum of the weights along
    it, with dilation 1 (weight axes 2, 3, ... are the spatial ones, for Convolution and Deconvolution).
    Unchanged when no dilation is 0."""
    if 0 not in tuple(dilation):
        return weight, tuple(dilation)
    axes = [2 + a for a, d in enumerate(dilation) if d == 0]
    return weight.sum(dim=axes, keepdim=True), tuple(d or 1 for d in dilation)


def deconv_out_size(size: int, kernel: int, stride: int = 1, pad: int = 0, dilation: int = 1) -> int:
    extent = dilation * (kernel - 1) + 1
    return stride * (size - 1) + extent - 2 * pad


def pooled_size(size: int, kernel: int, stride: int = 1, pad: int = 0, ceil_mode: bool = True,
                padded: bool | None = None) -> int:
    """Caffe's pooled output size along one axis (see module docstring); ``ceil_mode=False`` is
    ``round_mode: FLOOR``.  ``padded`` says whether the layer has *any* nonzero pad (Caffe's
    ``pad_h_ || pad_w_``), which decides the clip; by default this axis's ``pad != 0``, right only when
    both axes have the same pad: use :func:`pooled_hw` for a 2-D layer."""
    if padded is None:
        padded = pad != 0
    span = size + 2 * pad - kernel
    out = (int(math.ceil(span / stride)) if ceil_mode else span // stride) + 1
    if padded and (out - 1) * stride >= size + pad:
        out -= 1
    return out


def pooled_hw(in_hw, kernel, stride, pad, ceil_mode: bool = True) -> tuple[int, int]:
    """Caffe's pooled ``(height, width)``: the clip applies to both axes when either pad is nonzero."""
    padded = any(int(p) != 0 for p in pad)
    return tuple(pooled_size(int(size), int(k), int(s), int(p), ceil_mode, padded)
                 for size, k, s, p in zip(in_hw, kernel, stride, pad))


def _pair(values, default, name, layer):
    """A repeated kernel/stride/pad/dilation field: 1 value for both axes or 2 (h, w); ``default`` if empty."""
    n = len(values)
    if not n:
        if default is None:
            raise FormatError(f"layer '{layer}': {name} is required")
        return default, default
    if n == 1:
        v = int(values[0])
        return v, v
    if n == 2:
        return int(values[0]), int(values[1])
    raise FormatError(f"layer '{layer}': {name} has {len(values)} values; 2-D layers take 1 or 2")


@dataclass
class ConvGeometry:
    kernel: tuple[int, int]
    stride: tuple[int, int]
    pad: tuple[int, int]
    dilation: tuple[int, int]
    group: int
    num_output: int
    bias_term: bool


def conv_geometry(layer) -> ConvGeometry:
    """Caffe's BaseConvolutionLayer rules: the ``_h``/``_w`` forms when either is set (an unset one is 0,
    which is fine for pad and an error for kernel and stride), else the repeated field (1 or 2 values).
    Giving both forms of one field is an error (Caffe's CHECK: "Either kernel_size or kernel_h/w should be
    specified; not both", and the same for stride and pad).  Caffe checks kernel and stride > 0 but not
    dilation: a dilation of 0 makes the kernel's extent ``0·(k − 1) + 1 = 1`` (see :func:`fold_zero_dilation`)."""
    p = layer.convolution_param
    for name, repeated in (("kernel", "kernel_size"), ("stride", "stride"), ("pad", "pad")):
        if (p.HasField(f"{name}_h") or p.HasField(f"{name}_w")) and len(getattr(p, repeated)):
            raise FormatError(f"layer '{layer.name}' ({layer.type}): either convolution_param.{repeated} or "
                              f"{name}_h/w should be specified; not both")
    if p.HasField("kernel_h") or p.HasField("kernel_w"):
        kernel = int(p.kernel_h), int(p.kernel_w)
    else:
        kernel = _pair(p.kernel_size, None, "kernel", layer.name)
    if p.HasField("stride_h") or p.HasField("stride_w"):
        stride = int(p.stride_h), int(p.stride_w)
    else:
        stride = _pair(p.stride, 1, "stride", layer.name)
    if p.HasField("pad_h") or p.HasField("pad_w"):
        pad = int(p.pad_h), int(p.pad_w)
    else:
        pad = _pair(p.pad, 0, "pad", layer.name)
    dilation = _pair(p.dilation, 1, "dilation", layer.name)  # 0 is accepted (Caffe checks no dilation)
    if min(kernel) <= 0 or min(stride) <= 0:
        raise FormatError(f"layer '{layer.name}': kernel and stride must be > 0, got kernel {kernel} stride {stride}")
    if p.num_output == 0:
        raise FormatError(f"layer '{layer.name}': convolution_param.num_output must be > 0")
    if p.group < 1:  # Caffe takes channels % group: a division by zero
        raise FormatError(f"layer '{layer.name}' ({layer.type}): convolution_param.group must be >= 1, got {p.group}")
    return ConvGeometry(kernel, stride, pad, dilation, int(p.group), int(p.num_output), bool(p.bias_term))


@dataclass
class PoolGeometry:
    kernel: tuple[int, int]
    stride: tuple[int, int]
    pad: tuple[int, int]
    global_pooling: bool
    ceil_mode: bool


#: Caffe's ``int``: the layers copy their uint32 size fields (kernel, stride, pad, local_size) into ints.
INT32_MAX = 2 ** 31 - 1


def pool_geometry(layer, in_hw: tuple[int, int] | None = None) -> PoolGeometry:
    """Caffe's PoolingLayer::LayerSetUp rules.  Its CHECKs on the fields given: ``pad`` alone or ``pad_h``
    *and* ``pad_w`` (neither ``pad_h`` nor ``pad_w`` alone, nor with ``pad``), the same for stride; without
    global pooling ``kernel_size`` or ``kernel_h`` and ``kernel_w`` but not all three (``kernel_size`` with
    one stray ``kernel_h``/``kernel_w`` passes, and ``kernel_size`` is used); with it no kernel field, and
    pad 0 and stride 1 (the defaults, or given so)."""
    p = layer.pooling_param
    for name in ("pad", "stride"):
        has_h, has_w = p.HasField(f"{name}_h"), p.HasField(f"{name}_w")
        if (has_h or has_w) and not (has_h and has_w and not p.HasField(name)):
            given = ", ".join(f for f in (name, f"{name}_h", f"{name}_w") if p.HasField(f))
            raise FormatError(f"layer '{layer.name}' (Pooling): {name} is {name} OR {name}_h and {name}_w are "
                              f"required (got {given})")
    pad = (int(p.pad_h), int(p.pad_w)) if p.HasField("pad_h") else (int(p.pad),) * 2
    stride = (int(p.stride_h), int(p.stride_w)) if p.HasField("stride_h") else (int(p.stride),) * 2
    if p.global_pooling:
        if in_hw is None:
            raise FormatError(f"layer '{layer.name}': global pooling needs the input size")
        if p.HasField("kernel_size") or p.HasField("kernel_h") or p.HasField("kernel_w"):
            raise FormatError(f"layer '{layer.name}': global_pooling and kernel_size cannot both be set")
        if pad != (0, 0) or stride != (1, 1):  # Caffe's CHECK: "only pad = 0 and stride = 1"
            raise FormatError(f"layer '{layer.name}' (Pooling): with global_pooling only pad 0 and stride 1 are "
                              f"allowed, got pad {pad} and stride {stride}")
        return PoolGeometry(tuple(in_hw), (1, 1), (0, 0), True, True)
    # kernel_size, or kernel_h and kernel_w (not all three); pad_h / stride_h come with their _w partner
    # (checked above), else the single pad / stride serves both axes.
    both_hw = p.HasField("kernel_h") and p.HasField("kernel_w")
    if p.HasField("kernel_size") and both_hw:
        raise FormatError(f"layer '{layer.name}': filter size is kernel_size OR kernel_h and kernel_w; not both")
    if p.HasField("kernel_size"):
        kernel = (int(p.kernel_size),) * 2
    elif both_hw:
        kernel = (int(p.kernel_h), int(p.kernel_w))
    elif p.HasField("kernel_h") or p.HasField("kernel_w"):
        raise FormatError(f"layer '{layer.name}': for non-square filters both kernel_h and kernel_w are required")
    else:
        raise FormatError(f"layer '{layer.name}': kernel_size (or kernel_h and kernel_w) is required")
    if max(kernel + stride + pad) > INT32_MAX:  # Caffe's PoolingLayer keeps them in ints: 2^32 - 1 reads as -1
        raise FormatError(f"layer '{layer.name}' (Pooling): kernel {kernel}, stride {stride} and pad {pad} must "
                          f"be at most {INT32_MAX} (Caffe holds them as int)")
    if min(kernel) <= 0 or min(stride) <= 0:
        raise FormatError(f"layer '{layer.name}': kernel and stride must be > 0, got kernel {kernel} stride {stride}")
    if (pad[0] or pad[1]) and p.pool not in (p.MAX, p.AVE):
        raise FormatError(f"layer '{layer.name}' (Pooling): padding implemented only for average and max pooling")
    if (pad[0] or pad[1]) and (pad[0] >= kernel[0] or pad[1] >= kernel[1]):
        raise FormatError(f"layer '{layer.name}': pad must be smaller than the kernel")
    return PoolGeometry(kernel, stride, pad, False, p.round_mode == 0)


def need_axes(layer, bottoms, axes: int, exact: bool = True, what: str = "") -> None:
    """FormatError unless bottom 0 has ``axes`` axes (at least ``axes`` when not ``exact``)."""
    shape = bottoms[0]
    if len(shape) == axes or (not exact and len(shape) >= axes):
        return
    name = f"input '{layer.bottom[0]}'" if layer.bottom else "the input"
    raise FormatError(f"layer '{layer.name}' ({layer.type}): {name} has shape {tuple(shape)} ({len(shape)} axes); "
                      f"expected {'' if exact else 'at least '}{axes} axes{what}")

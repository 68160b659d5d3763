"""Shape inference without running a network, with Caffe's rules (no torch here).

:func:`infer_shapes` walks a (V2) NetParameter and returns every blob's shape and every layer's
learnable blob shapes.  The output-size formulas live here once and the layer ports import them:

* convolution: ``out = (in + 2·pad − (dilation·(k − 1) + 1)) // stride + 1``;
* deconvolution: ``out = stride·(in − 1) + dilation·(k − 1) + 1 − 2·pad``;
* pooling (``pooled_hw`` / ``pooled_size``): ``ceil((in + 2·pad − k) / stride) + 1`` (``round_mode:
  FLOOR`` uses floor instead of ceil), then Caffe's clip: the last window must start inside the image or
  its left padding, ``if (out − 1)·stride >= in + pad: out −= 1``.  Quirk of Caffe 1.0's
  ``PoolingLayer::Reshape``: the clip is guarded by ``if (pad_h_ || pad_w_)``, so when *either* pad is
  nonzero it is applied to *both* axes, also to the one whose own pad is 0 (11×11 input, kernel 2,
  stride 4, ``pad_h: 1 pad_w: 0`` → 3×3, where per-axis rules would give 3×4).

Bad input raises :class:`~caffe_compat.errors.FormatError` naming the layer, its type and the field or
input at fault, where Caffe would stop with a failed CHECK (or crash): a Convolution / Pooling input
without 4 axes, ``group`` 0 or not dividing the channels / ``num_output``, a Reshape ``axis`` or
``num_axes`` out of range, a missing bottom blob.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from caffe_compat.errors import FormatError


def conv_out_size(size: int, kernel: int, stride: int = 1, pad: int = 0, dilation: int = 1) -> int:
    extent = dilation * (kernel - 1) + 1
    return (size + 2 * pad - extent) // stride + 1


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


def _pair(values, single_h, single_w, default, name, layer):
    """Caffe's kernel/stride/pad resolution: explicit _h/_w, else repeated field (1 or 2 values)."""
    if single_h is not None or single_w is not None:
        if single_h is None or single_w is None:
            raise FormatError(f"layer '{layer}': {name}_h and {name}_w must be given together")
        return int(single_h), int(single_w)
    values = list(values)
    if not values:
        if default is None:
            raise FormatError(f"layer '{layer}': {name} is required")
        return default, default
    if len(values) == 1:
        return int(values[0]), int(values[0])
    if len(values) == 2:
        return int(values[0]), int(values[1])
    raise FormatError(f"layer '{layer}': {name} has {len(values)} values; 2-D layers take 1 or 2")


def _opt(msg, name):
    return getattr(msg, name) if msg.HasField(name) else None


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
    """Caffe's BaseConvolutionLayer rules: ``_h``/``_w`` forms win when either is set (an unset one is 0,
    which is fine for pad and an error for kernel and stride), else the repeated field (1 or 2 values)."""
    p = layer.convolution_param

    def hw(name, repeated, default):
        if p.HasField(f"{name}_h") or p.HasField(f"{name}_w"):
            return int(getattr(p, f"{name}_h")), int(getattr(p, f"{name}_w"))
        return _pair(repeated, None, None, default, name, layer.name)

    kernel = hw("kernel", p.kernel_size, None)
    stride = hw("stride", p.stride, 1)
    pad = hw("pad", p.pad, 0)
    dilation = _pair(p.dilation, None, None, 1, "dilation", layer.name)
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


def pool_geometry(layer, in_hw: tuple[int, int] | None = None) -> PoolGeometry:
    p = layer.pooling_param
    if p.global_pooling:
        if in_hw is None:
            raise FormatError(f"layer '{layer.name}': global pooling needs the input size")
        if p.HasField("kernel_size") or p.HasField("kernel_h"):
            raise FormatError(f"layer '{layer.name}': global_pooling and kernel_size cannot both be set")
        return PoolGeometry(tuple(in_hw), (1, 1), (0, 0), True, True)
    # Caffe's PoolingLayer: kernel_h and kernel_w together; pad_h / stride_h, when set, take their _w
    # partner as given (an unset pad_w is 0), else the single pad / stride serves both axes.
    if p.HasField("kernel_h") != p.HasField("kernel_w"):
        raise FormatError(f"layer '{layer.name}': for non-square filters both kernel_h and kernel_w are required")
    if p.HasField("kernel_h"):
        kernel = (int(p.kernel_h), int(p.kernel_w))
    elif p.HasField("kernel_size"):
        kernel = (int(p.kernel_size),) * 2
    else:
        raise FormatError(f"layer '{layer.name}': kernel_size (or kernel_h and kernel_w) is required")
    pad = (int(p.pad_h), int(p.pad_w)) if p.HasField("pad_h") else (int(p.pad),) * 2
    stride = (int(p.stride_h), int(p.stride_w)) if p.HasField("stride_h") else (int(p.stride),) * 2
    if min(kernel) <= 0 or min(stride) <= 0:
        raise FormatError(f"layer '{layer.name}': kernel and stride must be > 0, got kernel {kernel} stride {stride}")
    if (pad[0] or pad[1]) and (pad[0] >= kernel[0] or pad[1] >= kernel[1]):
        raise FormatError(f"layer '{layer.name}': pad must be smaller than the kernel")
    return PoolGeometry(kernel, stride, pad, False, p.round_mode == 0)


def canonical_axis(axis: int, ndim: int, layer: str = "?") -> int:
    if not -ndim <= axis < ndim:
        raise FormatError(f"layer '{layer}': axis {axis} out of range for a {ndim}-D blob")
    return axis % ndim


# ---------------------------------------------------------------------------- inference

@dataclass
class LayerShapes:
    name: str
    type: str
    bottoms: list[str]
    tops: list[str]
    top_shapes: list[tuple[int, ...] | None]
    param_shapes: list[tuple[int, ...]] = field(default_factory=list)
    macs: int = 0


def _count(shape):
    return int(math.prod(shape)) if shape is not None else 0


def _need_axes(layer, bottoms, axes: int, exact: bool = True, what: str = "") -> None:
    """FormatError unless bottom 0 has ``axes`` axes (at least ``axes`` when not ``exact``)."""
    shape = bottoms[0]
    if len(shape) == axes or (not exact and len(shape) >= axes):
        return
    name = f"input '{layer.bottom[0]}'" if layer.bottom else "the input"
    raise FormatError(f"layer '{layer.name}' ({layer.type}): {name} has shape {tuple(shape)} ({len(shape)} axes); "
                      f"expected {'' if exact else 'at least '}{axes} axes{what}")


#: Bottom counts Caffe checks (ExactNumBottomBlobs / MinBottomBlobs) for the types inferred here.
_MIN_BOTTOMS = {"Crop": 2, "Eltwise": 2, "Accuracy": 2}
_NO_BOTTOMS = {"Input", "MemoryData", "DummyData"}
_NEURON_TYPES = ("ReLU", "Sigmoid", "TanH", "AbsVal", "Power", "Exp", "Log", "BNLL", "Threshold", "Dropout", "ELU",
                 "LRN", "MVN", "Softmax", "Swish", "Clip", "Split")
#: The types :func:`_infer_layer` has a rule for (``*Loss`` types are matched by name on top of these).
_RULE_TYPES = frozenset(_NO_BOTTOMS | set(_NEURON_TYPES) | {
    "Convolution", "Deconvolution", "Pooling", "InnerProduct", "Embed", "PReLU", "BatchNorm", "Scale", "Bias",
    "Eltwise", "Concat", "Slice", "Flatten", "Reshape", "Crop", "Tile", "Reduction", "ArgMax", "Accuracy",
    "Silence", "CosineSimilarityBatch"})


def _infer_layer(layer, bottoms):  # noqa: C901 - a table of Caffe rules
    t = layer.type
    b0 = bottoms[0] if bottoms else None
    same = [b0] * len(layer.top)
    if t == "Input":
        shapes = [tuple(int(d) for d in s.dim) for s in layer.input_param.shape]
        if len(shapes) == 1:
            shapes = shapes * len(layer.top)
        return shapes, [], 0
    if t == "MemoryData":
        p = layer.memory_data_param
        return [(p.batch_size, p.channels, p.height, p.width), (p.batch_size,)][:len(layer.top)], [], 0
    if t == "DummyData":
        p = layer.dummy_data_param
        if p.shape:
            shapes = [tuple(int(d) for d in s.dim) for s in p.shape]
        else:
            shapes = [(n, c, h, w) for n, c, h, w in zip(p.num, p.channels, p.height, p.width)]
        if len(shapes) == 1:
            shapes = shapes * len(layer.top)
        return shapes, [], 0
    if any(s is None for s in bottoms):
        return [None] * len(layer.top), [], 0
    if t == "Convolution" or t == "Deconvolution":
        _need_axes(layer, bottoms, 4, what=" (N, C, H, W): only 2-D convolution is supported")
        g = conv_geometry(layer)
        n, c, h, w = b0
        if c % g.group:
            raise FormatError(f"layer '{layer.name}' ({t}): the input's {c} channels are not divisible by "
                              f"convolution_param.group {g.group}")
        if g.num_output % g.group:
            raise FormatError(f"layer '{layer.name}' ({t}): convolution_param.num_output {g.num_output} is not "
                              f"divisible by convolution_param.group {g.group}")
        f = conv_out_size if t == "Convolution" else deconv_out_size
        oh = f(h, g.kernel[0], g.stride[0], g.pad[0], g.dilation[0])
        ow = f(w, g.kernel[1], g.stride[1], g.pad[1], g.dilation[1])
        if t == "Convolution":
            weight = (g.num_output, c // g.group, *g.kernel)
            macs = n * g.num_output * oh * ow * (c // g.group) * g.kernel[0] * g.kernel[1]
        else:
            weight = (c, g.num_output // g.group, *g.kernel)
            macs = n * c * h * w * (g.num_output // g.group) * g.kernel[0] * g.kernel[1]
        params = [weight] + ([(g.num_output,)] if g.bias_term else [])
        return [(n, g.num_output, oh, ow)], params, macs
    if t == "Pooling":
        _need_axes(layer, bottoms, 4, what=" (N, C, H, W), as Caffe's PoolingLayer requires")
        n, c, h, w = b0
        g = pool_geometry(layer, (h, w))
        if g.global_pooling:
            return [(n, c, 1, 1)] * len(layer.top), [], 0
        oh, ow = pooled_hw((h, w), g.kernel, g.stride, g.pad, g.ceil_mode)
        return [(n, c, oh, ow)] * len(layer.top), [], 0
    if t == "InnerProduct":
        p = layer.inner_product_param
        axis = canonical_axis(p.axis, len(b0), layer.name)
        k = _count(b0[axis:])
        weight = (k, p.num_output) if p.transpose else (p.num_output, k)
        params = [weight] + ([(p.num_output,)] if p.bias_term else [])
        return [tuple(b0[:axis]) + (p.num_output,)], params, _count(b0[:axis]) * k * p.num_output
    if t == "Embed":
        p = layer.embed_param
        params = [(p.input_dim, p.num_output)] + ([(p.num_output,)] if p.bias_term else [])
        return [tuple(b0) + (p.num_output,)], params, 0
    if t in _NEURON_TYPES:
        return same, [], 0
    if t == "PReLU":
        # Caffe's PReLULayer makes the shared slope a 0-axis blob: Blob(vector<int>(0)), shape (), count 1.
        _need_axes(layer, bottoms, 2, exact=False)
        shared = layer.prelu_param.channel_shared
        return same, [() if shared else (b0[1],)], 0
    if t == "BatchNorm":
        _need_axes(layer, bottoms, 2, exact=False)
        return same, [(b0[1],), (b0[1],), (1,)], 0
    if t in ("Scale", "Bias"):
        p = layer.scale_param if t == "Scale" else layer.bias_param
        if len(bottoms) > 1:
            return [b0], [], 0
        axis = canonical_axis(p.axis, len(b0), layer.name)
        end = len(b0) if p.num_axes == -1 else axis + p.num_axes
        params = [tuple(b0[axis:end])]
        if t == "Scale" and p.bias_term:
            params.append(tuple(b0[axis:end]))
        return [b0], params, 0
    if t == "Eltwise":
        return [b0], [], 0
    if t == "Concat":
        p = layer.concat_param
        axis = p.concat_dim if p.HasField("concat_dim") and not p.HasField("axis") else p.axis
        axis = canonical_axis(axis, len(b0), layer.name)
        out = list(b0)
        out[axis] = sum(s[axis] for s in bottoms)
        return [tuple(out)], [], 0
    if t == "Slice":
        p = layer.slice_param
        axis = p.slice_dim if p.HasField("slice_dim") and not p.HasField("axis") else p.axis
        axis = canonical_axis(axis, len(b0), layer.name)
        points = [0] + list(p.slice_point) + [b0[axis]]
        if not p.slice_point:
            step = b0[axis] // len(layer.top)
            points = [i * step for i in range(len(layer.top) + 1)]
        return [tuple(b0[:axis]) + (points[i + 1] - points[i],) + tuple(b0[axis + 1:]) for i in range(len(layer.top))], [], 0
    if t == "Flatten":
        p = layer.flatten_param
        a = canonical_axis(p.axis, len(b0), layer.name)
        e = canonical_axis(p.end_axis, len(b0), layer.name)
        return [tuple(b0[:a]) + (_count(b0[a:e + 1]),) + tuple(b0[e + 1:])], [], 0
    if t == "Reshape":
        return [_reshape(layer, b0)], [], 0
    if t == "Crop":
        p = layer.crop_param
        axis = canonical_axis(p.axis, len(b0), layer.name)
        return [tuple(b0[:axis]) + tuple(bottoms[1][axis:])], [], 0
    if t == "Tile":
        p = layer.tile_param
        axis = canonical_axis(p.axis, len(b0), layer.name)
        out = list(b0)
        out[axis] *= p.tiles
        return [tuple(out)], [], 0
    if t == "Reduction":
        p = layer.reduction_param
        axis = canonical_axis(p.axis, len(b0), layer.name)
        return [tuple(b0[:axis])], [], 0
    if t == "ArgMax":
        p = layer.argmax_param
        if p.HasField("axis"):
            out = list(b0)
            out[canonical_axis(p.axis, len(b0), layer.name)] = p.top_k
            return [tuple(out)], [], 0
        out = [1] * max(len(b0), 3)  # Caffe keeps the bottom's axis count (at least 3)
        out[0], out[1], out[2] = b0[0], 2 if p.out_max_val else 1, p.top_k
        return [tuple(out)], [], 0
    if t == "Accuracy":
        return [()] + [(bottoms[0][1],)] * (len(layer.top) - 1), [], 0
    if t == "Silence":
        return [], [], 0
    if t == "CosineSimilarityBatch":
        m = b0[0] * (b0[0] - 1) // 2
        return [(m, 1, 1, 1), (m, 1, 1, 1)][:len(layer.top)], [], 0
    if t.endswith("Loss") or layer.loss_weight:
        tops = [()]
        if t == "SoftmaxWithLoss" and len(layer.top) > 1:
            tops.append(b0)
        return tops, [], 0
    return [None] * len(layer.top), [], 0


def _reshape(layer, b0) -> tuple[int, ...]:
    """Caffe's ReshapeLayer, with its CHECKs as FormatErrors: ``axis`` in ``[-(n+1), n]`` (negative counts
    from the end, -1 = after the last axis), ``num_axes >= -1``, ``axis + num_axes <= n``; a 0 copies the
    bottom axis at the same position (which must exist), at most one -1 is inferred, and the counts agree."""
    p = layer.reshape_param
    where = f"layer '{layer.name}' (Reshape)"
    ndim = len(b0)
    start = p.axis if p.axis >= 0 else ndim + p.axis + 1
    if not 0 <= start <= ndim:
        raise FormatError(f"{where}: reshape_param.axis {p.axis} is out of range for the {ndim}-axis input "
                          f"{tuple(b0)} (expected {-(ndim + 1)} to {ndim})")
    if p.num_axes < -1:
        raise FormatError(f"{where}: reshape_param.num_axes must be >= 0, or -1 for all, got {p.num_axes}")
    end = ndim if p.num_axes == -1 else start + p.num_axes
    if end > ndim:
        raise FormatError(f"{where}: reshape_param.axis + num_axes = {end} is out of range for the {ndim}-axis "
                          f"input {tuple(b0)}")
    new = []
    for i, d in enumerate(int(d) for d in p.shape.dim):
        if d == 0:
            if start + i >= ndim:
                raise FormatError(f"{where}: reshape_param.shape dim {i} is 0, but the input {tuple(b0)} has no "
                                  f"axis {start + i} to copy")
            new.append(b0[start + i])
        elif d < -1:
            raise FormatError(f"{where}: reshape_param.shape dim {i} is {d}; expected -1 (infer), 0 (copy) or > 0")
        else:
            new.append(d)
    if new.count(-1) > 1:
        raise FormatError(f"{where}: reshape_param.shape has more than one -1 (at most one dim can be inferred)")
    out = list(b0[:start]) + new + list(b0[end:])
    if -1 in out:
        known = _count([d for d in out if d != -1])
        if known == 0 or _count(b0) % known:
            raise FormatError(f"{where}: the input count {_count(b0)} is not divisible by the product of the given "
                              f"dims ({known})")
        out[out.index(-1)] = _count(b0) // known
    if _count(out) != _count(b0):
        raise FormatError(f"{where}: reshape_param.shape gives {tuple(out)} ({_count(out)} values), the input "
                          f"{tuple(b0)} has {_count(b0)}")
    return tuple(out)


def _checked_infer(layer, bottoms):
    """``_infer_layer`` with Caffe's bottom-count checks, and any arithmetic failure on malformed shapes
    turned into a FormatError naming the layer (no bare ValueError / IndexError reaches the CLI)."""
    t = layer.type
    if t not in _NO_BOTTOMS and t in _RULE_TYPES and len(bottoms) < _MIN_BOTTOMS.get(t, 1):
        raise FormatError(f"layer '{layer.name}' ({t}): needs at least {_MIN_BOTTOMS.get(t, 1)} bottom blob(s), "
                          f"got {len(bottoms)}")
    try:
        return _infer_layer(layer, bottoms)
    except (ArithmeticError, IndexError, TypeError, ValueError) as exc:
        raise FormatError(f"layer '{layer.name}' ({t}): cannot infer its output shapes from the input shapes "
                          f"{[tuple(b) if b is not None else None for b in bottoms]}: {exc}") from None


def has_shape_rule(layer_type: str) -> bool:
    """True when :func:`infer_shapes` has a rule for this type (besides the ``*Loss`` catch-all)."""
    return layer_type in _RULE_TYPES


def infer_shapes(net, input_shapes: dict[str, tuple[int, ...]] | None = None) -> tuple[dict, list[LayerShapes]]:
    """Every blob's shape (``None`` when it depends on data, e.g. a Data layer) and, per layer, the top
    shapes, learnable blob shapes and multiply-adds.  ``input_shapes`` overrides/assigns blob shapes."""
    blobs: dict[str, tuple[int, ...] | None] = dict(input_shapes or {})
    table = []
    for layer in net.layer:
        bottoms = []
        for name in layer.bottom:
            if name not in blobs:
                raise FormatError(f"layer '{layer.name}' ({layer.type}): unknown bottom blob '{name}'")
            bottoms.append(blobs[name])
        known_tops = [blobs.get(t) if t in (input_shapes or {}) else None for t in layer.top]
        tops, params, macs = _checked_infer(layer, bottoms)
        tops = list(tops) + [None] * (len(layer.top) - len(tops))
        tops = [k if k is not None else s for k, s in zip(known_tops, tops)]
        for name, shape in zip(layer.top, tops):
            blobs[name] = None if shape is None else tuple(int(d) for d in shape)
        table.append(LayerShapes(layer.name, layer.type, list(layer.bottom), list(layer.top),
                                 [blobs[t] for t in layer.top], [tuple(p) for p in params], int(macs)))
    return blobs, table

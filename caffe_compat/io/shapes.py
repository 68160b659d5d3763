"""Shape inference without running a network, with Caffe's rules (no torch here).

:func:`infer_shapes` walks a (V2) NetParameter and returns every blob's shape and every layer's
learnable blob shapes.  The output-size formulas live here once and the layer ports import them:

* convolution: ``out = (in + 2·pad − (dilation·(k − 1) + 1)) // stride + 1``;
* deconvolution: ``out = stride·(in − 1) + dilation·(k − 1) + 1 − 2·pad``;
* pooling (``pooled_size``): ``ceil((in + 2·pad − k) / stride) + 1`` and, when padded, the last window
  must start inside the image or left padding: if ``(out − 1)·stride >= in + pad``, ``out −= 1``
  (``round_mode: FLOOR`` uses floor instead of ceil).
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


def pooled_size(size: int, kernel: int, stride: int = 1, pad: int = 0, ceil_mode: bool = True) -> int:
    """Caffe's pooled output size (see module docstring); ``ceil_mode=False`` is ``round_mode: FLOOR``."""
    span = size + 2 * pad - kernel
    out = (int(math.ceil(span / stride)) if ceil_mode else span // stride) + 1
    if pad > 0 and (out - 1) * stride >= size + pad:
        out -= 1
    return out


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
        g = conv_geometry(layer)
        n, c, h, w = b0
        if c % g.group or g.num_output % g.group:
            raise FormatError(f"layer '{layer.name}': channels {c} and num_output {g.num_output} must be "
                              f"divisible by group {g.group}")
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
        n, c, h, w = b0
        g = pool_geometry(layer, (h, w))
        if g.global_pooling:
            return [(n, c, 1, 1)] * len(layer.top), [], 0
        oh = pooled_size(h, g.kernel[0], g.stride[0], g.pad[0], g.ceil_mode)
        ow = pooled_size(w, g.kernel[1], g.stride[1], g.pad[1], g.ceil_mode)
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
    if t in ("ReLU", "Sigmoid", "TanH", "AbsVal", "Power", "Exp", "Log", "BNLL", "Threshold", "Dropout", "ELU",
             "LRN", "MVN", "Softmax", "Swish", "Clip", "Split"):
        return same, [], 0
    if t == "PReLU":
        shared = layer.prelu_param.channel_shared
        return same, [(1,) if shared else (b0[1],)], 0
    if t == "BatchNorm":
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
        p = layer.reshape_param
        start = canonical_axis(p.axis, len(b0) + 1, layer.name) if p.axis < 0 else p.axis
        if p.axis < 0:
            start = len(b0) + 1 + p.axis
        end = len(b0) if p.num_axes == -1 else start + p.num_axes
        dims = list(p.shape.dim)
        new = []
        for i, d in enumerate(dims):
            new.append(b0[start + i] if d == 0 else d)
        out = list(b0[:start]) + new + list(b0[end:])
        if -1 in out:
            known = _count([d for d in out if d != -1])
            out[out.index(-1)] = _count(b0) // max(known, 1)
        return [tuple(out)], [], 0
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
        tops, params, macs = _infer_layer(layer, bottoms)
        tops = list(tops) + [None] * (len(layer.top) - len(tops))
        tops = [k if k is not None else s for k, s in zip(known_tops, tops)]
        for name, shape in zip(layer.top, tops):
            blobs[name] = None if shape is None else tuple(int(d) for d in shape)
        table.append(LayerShapes(layer.name, layer.type, list(layer.bottom), list(layer.top),
                                 [blobs[t] for t in layer.top], [tuple(p) for p in params], int(macs)))
    return blobs, table

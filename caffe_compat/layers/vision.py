"""Vision layers: Convolution, Deconvolution, InnerProduct (Caffe semantics, 2-D spatial) and Im2col.

(Pooling and SPP are in :mod:`caffe_compat.layers.pooling`.)

* **Convolution** ``y = W ⋆ x + b`` with Caffe's blobs ``W: num_output × (C/group) × kh × kw`` and
  ``b: num_output``; ``out = (in + 2·pad − (dilation·(k − 1) + 1)) / stride + 1`` (C++ division).
  kernel/pad/stride come from the repeated fields (one value for both axes or one per axis) or their
  ``_h``/``_w`` forms; ``dilation`` is repeated only (0 allowed: extent 1, see
  :func:`~caffe_compat.layers.geometry.fold_zero_dilation`).  Defaults: pad 0, stride 1, dilation 1, group 1,
  bias_term true, fillers constant 0 (Caffe's FillerParameter default).  Several bottoms are convolved with the same
  weights, one top each (Caffe allows this).
* **Deconvolution** is the transpose of Convolution; Caffe stores its weight **C_in × (num_output/group)
  × kh × kw** (the convolution it transposes has C_in outputs), which is exactly
  ``conv_transpose2d``'s layout.  ``out = stride·(in − 1) + dilation·(k − 1) + 1 − 2·pad``.
* **InnerProduct** ``y = x_flat · Wᵀ + b`` with ``x_flat`` of shape ``(prod(shape[:axis]), K)``;
  ``W`` is ``N × K``, or ``K × N`` when ``transpose: true`` (then ``y = x_flat · W + b``); the top has
  shape ``shape[:axis] + (N,)``.  Defaults: axis 1, bias_term true, transpose false, fillers constant 0.

Only ``axis: 1`` is supported for (De)Convolution, and 4-D blobs; anything else raises FormatError.  An output
size of 0 is Caffe's empty top (Blob::Reshape accepts it, so the net builds; Caffe's forward would then fail its
CHECK on the never-allocated top, ours computes nothing); a negative one fails its CHECK (a ShapeMismatchError).

* **Im2col** is Convolution's column buffer as a top, N-D (see :class:`Im2col`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from caffe_compat.errors import FormatError, ShapeMismatchError
from caffe_compat.layers.facts import ONE, BlobCount, Shapes, canonical_axis, count
from caffe_compat.layers.fillers import fill_blob, layer_filler
from caffe_compat.layers.geometry import (conv_geometry, conv_out_size, conv_overhang, conv_overhangs,
                                         deconv_out_size, fold_zero_dilation, may_overhang, need_axes)
from caffe_compat.layers.registry import CaffeLayer, register_layer


def _fill_blob(tensor: torch.Tensor, container, field: str, generator) -> None:
    """Fill ``tensor`` with ``container.<field>`` (constant 0 when the prototxt leaves it unset)."""
    fill_blob(tensor, layer_filler(container, field), generator)


# ---------------------------------------------------------------------------- convolution


class _ConvolutionBase(CaffeLayer):
    transposed = False
    param_message = "convolution_param"
    bottoms = tops = BlobCount.at_least(1)  # one top per bottom (Caffe's EqualNumBottomTopBlobs)
    in_caffe_1_0 = True

    @classmethod
    def infer(cls, layer, bottoms):
        """One ``(N, num_output, H', W')`` top per bottom; blobs ``W`` (Convolution ``num_output × C/group ×
        kh × kw``, Deconvolution ``C × num_output/group × kh × kw``) and ``b``; group must divide both."""
        need_axes(layer, bottoms, 4, what=" (N, C, H, W): only 2-D convolution is supported")
        if layer.top and len(layer.top) != len(bottoms):
            raise FormatError(f"layer '{layer.name}' ({layer.type}): needs one top per bottom, got "
                              f"{len(bottoms)} bottoms and {len(layer.top)} tops")
        g = conv_geometry(layer)
        n, c, h, w = bottoms[0]
        if not c:  # the weight blob would be empty: LayerSetUp fills it, and Caffe's fillers CHECK(count)
            raise FormatError(f"layer '{layer.name}' ({layer.type}): input {tuple(bottoms[0])} has no channel, so the "
                              f"weight blob would be empty (Caffe's weight filler CHECKs its count)")
        if c % g.group:
            raise FormatError(f"layer '{layer.name}' ({layer.type}): the input's {c} channels are not divisible by "
                              f"convolution_param.group {g.group}")
        if g.num_output % g.group:
            raise FormatError(f"layer '{layer.name}' ({layer.type}): convolution_param.num_output {g.num_output} is "
                              f"not divisible by convolution_param.group {g.group}")
        f = deconv_out_size if cls.transposed else conv_out_size
        oh, ow = (f(size, g.kernel[a], g.stride[a], g.pad[a], g.dilation[a]) for a, size in enumerate((h, w)))
        if oh < 0 or ow < 0:  # Caffe's Blob::Reshape CHECK_GE(dim, 0) on the top; a size of 0 is its empty top
            raise ShapeMismatchError(f"layer '{layer.name}': input {tuple(bottoms[0])} gives a negative output size "
                                     f"{(n, g.num_output, oh, ow)}")
        if cls.transposed:
            weight = (c, g.num_output // g.group, *g.kernel)
            macs = n * c * h * w * (g.num_output // g.group) * g.kernel[0] * g.kernel[1]
        else:
            weight = (g.num_output, c // g.group, *g.kernel)
            macs = n * g.num_output * oh * ow * (c // g.group) * g.kernel[0] * g.kernel[1]
        params = [weight] + ([(g.num_output,)] if g.bias_term else [])
        return Shapes([(n, g.num_output, oh, ow)] * len(bottoms), params, macs * len(bottoms))

    def __init__(self, param, bottom_shapes, phase="test"):
        super().__init__(param, bottom_shapes, phase)
        p = param.convolution_param
        shape = self.bottom_shapes[0]
        if len(shape) != 4:
            raise FormatError(f"layer '{self.layer_name}' ({param.type}): only 4-D bottoms (N, C, H, W) are "
                              f"supported, got shape {shape}")
        if canonical_axis(p.axis, len(shape), self.layer_name) != 1:
            raise FormatError(f"layer '{self.layer_name}' ({param.type}): only axis 1 is supported, got {p.axis}")
        for other in self.bottom_shapes[1:]:
            if other != shape:
                raise ShapeMismatchError(f"layer '{self.layer_name}': all bottoms must have the same shape, "
                                         f"got {shape} and {other}")
        g = conv_geometry(param)
        if len(p.dilation) > 2:
            raise FormatError(f"layer '{self.layer_name}': dilation has {len(p.dilation)} values; 2-D takes 1 or 2")
        channels = shape[1]
        if g.group < 1 or channels % g.group or g.num_output % g.group:
            raise FormatError(f"layer '{self.layer_name}': channels {channels} and num_output {g.num_output} must "
                              f"be divisible by group {g.group}")
        if g.stride[0] < 1 or g.stride[1] < 1 or g.kernel[0] < 1 or g.kernel[1] < 1:
            raise FormatError(f"layer '{self.layer_name}': kernel and stride must be positive")
        # plain values (no parameter, buffer or module): straight into __dict__, as CaffeLayer.__init__ does
        self.__dict__.update(kernel=g.kernel, stride=g.stride, pad=g.pad, dilation=g.dilation, group=g.group,
                             num_output=g.num_output, bias_term=g.bias_term, channels=channels,
                             empty_up_to=self._empty_up_to(g), negative_up_to=self._negative_up_to(g))
        blobs = self.rule().params
        self.weight = nn.Parameter(self.new_blob(blobs[0]))
        self.bias = nn.Parameter(self.new_blob(blobs[1])) if g.bias_term else None

    def _extents(self, g) -> list[int]:
        return [d * (k - 1) + 1 for k, d in zip(g.kernel, g.dilation)]

    def _empty_up_to(self, g) -> tuple[int, int]:
        """Per spatial axis, the largest input size whose output size is <= 0 (the shape rule, which a net fed
        another shape at run time does not re-run): one comparison per axis in forward before torch's convolution,
        which refuses such a plane.  Convolution: trunc((H + 2p - e) / s) + 1 <= 0 iff H <= e - 2p - s;
        Deconvolution: s(H - 1) + e - 2p <= 0 iff H <= 1 + floor((2p - e) / s)."""
        if self.transposed:
            return tuple(1 + (2 * p - e) // s for e, s, p in zip(self._extents(g), g.stride, g.pad))
        return tuple(e - 2 * p - s for e, s, p in zip(self._extents(g), g.stride, g.pad))

    def _negative_up_to(self, g) -> tuple[int, int]:
        """Per spatial axis, the largest input size whose output size is < 0 (Caffe's Blob::Reshape CHECK on the
        top).  Convolution: trunc((H + 2p - e) / s) + 1 < 0 iff H + 2p - e <= -2s; Deconvolution:
        s(H - 1) + e - 2p < 0 iff H <= ceil((2p - e) / s)."""
        if self.transposed:
            return tuple(-((e - 2 * p) // s) for e, s, p in zip(self._extents(g), g.stride, g.pad))
        return tuple(e - 2 * p - 2 * s for e, s, p in zip(self._extents(g), g.stride, g.pad))

    def caffe_blobs(self):
        return [self.weight] + ([self.bias] if self.bias is not None else [])

    def fill(self, generator=None):
        p = self.param.convolution_param
        _fill_blob(self.weight, p, "weight_filler", generator)
        if self.bias is not None:
            _fill_blob(self.bias, p, "bias_filler", generator)

    def _convolve(self, x):
        raise NotImplementedError

    def forward(self, *bottoms):
        outs = []
        for x in bottoms:
            if x.dim() != 4 or x.shape[1] != self.channels:
                raise ShapeMismatchError(f"layer '{self.layer_name}': expected (N, {self.channels}, H, W) input, "
                                         f"got {tuple(x.shape)}")
            if x.shape[2] <= self.negative_up_to[0] or x.shape[3] <= self.negative_up_to[1]:
                raise ShapeMismatchError(f"layer '{self.layer_name}': input {tuple(x.shape)} gives a negative output "
                                         f"size")
            empty = x.shape[2] <= self.empty_up_to[0] or x.shape[3] <= self.empty_up_to[1]
            if empty or not x.shape[2] or not x.shape[3]:
                outs.append(self._degenerate(x))
            else:
                outs.append(self._convolve(x))
        return tuple(outs)

    def _degenerate(self, x):
        """What Caffe computes where torch's convolution refuses: an output plane of size 0 is an empty top (the
        forward and backward loops run zero times), and an input plane of size 0 whose padding still gives outputs
        reads only zeros (im2col's padding; Deconvolution's col2im writes nothing), so each output is the bias.
        The top stays on the autograd graph: the weight's gradient is 0 (a product with zeros), the bias's the
        sum of the top's gradient (its backward_cpu_bias)."""
        f = deconv_out_size if self.transposed else conv_out_size
        out = [f(int(size), *geometry) for size, *geometry in
               zip(x.shape[2:], self.kernel, self.stride, self.pad, self.dilation)]
        top = x.new_zeros((x.shape[0], self.num_output, *out)) + x.flatten()[:0].sum() + self.weight.flatten()[:0].sum()
        return top + self.bias.view(1, -1, 1, 1) if self.bias is not None else top

    def extra_repr(self):
        return (f"{super().extra_repr()}, num_output={self.num_output}, kernel={self.kernel}, stride={self.stride}, "
                f"pad={self.pad}, dilation={self.dilation}, group={self.group}, bias_term={self.bias_term}")


@register_layer("Convolution")
class Convolution(_ConvolutionBase):
    """Caffe Convolution (see module docstring).  The output size's division is C++'s, toward zero: when
    the kernel overhangs the padded input by less than a stride (input 2, kernel 3, stride 2) Caffe still
    computes one output, its im2col reading the overhang as zeros; so does the port (zeros appended)."""

    def _convolve(self, x):
        weight, dilation = fold_zero_dilation(self.weight, self.dilation)
        x = pad_overhang(x, self.kernel, self.stride, self.pad, self.dilation)
        return F.conv2d(x, weight, self.bias, self.stride, self.pad, dilation, self.group)


def pad_overhang(x, kernel, stride, pad, dilation):
    """``x`` (N, C, H, W) with the zeros Caffe's im2col reads past its padded end appended (an overhang of less
    than a stride, see :func:`~caffe_compat.layers.geometry.conv_out_size`); ``x`` itself when there is none.
    A kernel that cannot overhang (:func:`~caffe_compat.layers.geometry.may_overhang`) reads no shape, so a
    trace or a compiled graph stays shape-generic."""
    if not may_overhang(kernel, pad, dilation):
        return x
    extra = conv_overhangs(x.shape[2:], kernel, stride, pad, dilation)
    return F.pad(x, (0, extra[1], 0, extra[0])) if any(extra) else x


@register_layer("Deconvolution")
class Deconvolution(_ConvolutionBase):
    """Caffe Deconvolution: weight C_in × (num_output/group) × kh × kw (see module docstring)."""

    transposed = True

    def _convolve(self, x):
        weight, dilation = fold_zero_dilation(self.weight, self.dilation)
        return F.conv_transpose2d(x, weight, self.bias, self.stride, self.pad, 0, self.group, dilation)


# ---------------------------------------------------------------------------- inner product


@register_layer("InnerProduct")
class InnerProduct(CaffeLayer):
    """Caffe InnerProduct (fully connected) layer (see module docstring)."""

    bottoms = tops = ONE
    in_caffe_1_0 = True

    @classmethod
    def infer(cls, layer, bottoms):
        """``shape[:axis] + (num_output,)``; blobs ``W`` (``num_output × K``, ``K × num_output`` transposed, K the
        count from ``axis``) and ``b``."""
        p = layer.inner_product_param
        b0 = bottoms[0]
        axis = canonical_axis(p.axis, len(b0), layer.name)
        k = count(b0, axis)
        weight = (k, p.num_output) if p.transpose else (p.num_output, k)
        params = [weight] + ([(p.num_output,)] if p.bias_term else [])
        return Shapes([tuple(b0[:axis]) + (p.num_output,)], params, count(b0, 0, axis) * k * p.num_output)

    def __init__(self, param, bottom_shapes, phase="test"):
        super().__init__(param, bottom_shapes, phase)
        p = param.inner_product_param
        shape = self.bottom_shapes[0]
        if p.num_output == 0:
            raise FormatError(f"layer '{self.layer_name}': inner_product_param.num_output must be > 0")
        self.axis = canonical_axis(p.axis, len(shape), self.layer_name)
        self.num_input = int(math.prod(shape[self.axis:]))
        self.num_output = int(p.num_output)
        self.transpose = bool(p.transpose)
        self.weight = nn.Parameter(self.new_blob(self.rule().params[0]))
        self.bias = nn.Parameter(self.new_blob((self.num_output,))) if p.bias_term else None

    def caffe_blobs(self):
        return [self.weight] + ([self.bias] if self.bias is not None else [])

    def fill(self, generator=None):
        p = self.param.inner_product_param
        _fill_blob(self.weight, p, "weight_filler", generator)
        if self.bias is not None:
            _fill_blob(self.bias, p, "bias_filler", generator)

    def forward(self, x):
        # flatten, not reshape(..., -1): an empty batch (M = 0) is Caffe's empty top, not an ambiguous reshape
        # (and no shape arithmetic in a trace: an ONNX export keeps one Flatten)
        flat = x.flatten(self.axis) if x.dim() > self.axis else None
        if flat is None or flat.shape[-1] != self.num_input:
            raise ShapeMismatchError(f"layer '{self.layer_name}': input shape {tuple(x.shape)} gives "
                                     f"{math.prod(x.shape[self.axis:])} inputs from axis {self.axis}, the weights "
                                     f"expect {self.num_input}")
        if self.transpose:
            y = flat.matmul(self.weight)
            return (y + self.bias if self.bias is not None else y,)
        return (F.linear(flat, self.weight, self.bias),)

    def extra_repr(self):
        return (f"{super().extra_repr()}, num_output={self.num_output}, axis={self.axis}, "
                f"transpose={self.transpose}, bias_term={self.bias is not None}")


# ------------------------------------------------------------------------------------------ Im2col


def _nd_field(p, name: str, spatial: int, default, where: str) -> list[int]:
    """Caffe's Im2col/BaseConvolution rule for kernel/stride/pad: ``<name>_h``/``_w`` (2-D only, never with
    the repeated field), else the repeated field once or once per spatial axis (``default`` when empty)."""
    repeated = [int(v) for v in getattr(p, name if name != "kernel" else "kernel_size")]
    field = "kernel_size" if name == "kernel" else name
    if p.HasField(f"{name}_h") or p.HasField(f"{name}_w"):
        if spatial != 2:
            raise FormatError(f"{where}: convolution_param.{name}_h & {name}_w can only be used for 2D convolution")
        if repeated:
            raise FormatError(f"{where}: either convolution_param.{field} or {name}_h/w should be specified; not both")
        return [int(getattr(p, f"{name}_h")), int(getattr(p, f"{name}_w"))]
    if not repeated:
        if default is None:
            raise FormatError(f"{where}: convolution_param.kernel_size (or kernel_h and kernel_w) is required")
        return [default] * spatial
    if len(repeated) not in (1, spatial):
        raise FormatError(f"{where}: convolution_param.{field} must be specified once, or once per spatial dimension "
                          f"({field} specified {len(repeated)} times; {spatial} spatial dims)")
    return repeated * spatial if len(repeated) == 1 else repeated


@register_layer("Im2col")
class Im2col(CaffeLayer):
    """Caffe's Im2colLayer: the column buffer Convolution multiplies by its weights, as a top.

    ``convolution_param`` gives ``axis`` (the channel axis, default 1; every later axis is spatial),
    kernel/stride/pad (repeated once or once per spatial axis, or ``_h``/``_w`` in 2-D) and ``dilation``
    (repeated; default 1); ``num_output`` and the fillers are unused.  For an input ``(..., C, S_1..S_k)``
    the top is ``(..., C·K_1···K_k, O_1..O_k)`` with ``O_i = (S_i + 2·p_i − (d_i·(K_i − 1) + 1)) / s_i + 1``
    (C++ division, toward zero: an overhang of less than a stride still gives one output, read as zeros)
    and row ``c·∏K + (k_1·K_2 + k_2)…`` (channel-major, kernel offsets row-major), holding
    ``x[c, o_i·s_i − p_i + k_i·d_i]``, or 0 where that lies in the padding.  ``force_nd_im2col`` only
    picks Caffe's N-D routine, whose values are the 2-D one's, so it changes nothing here.  Backward is
    Caffe's col2im: each column entry's gradient is added back to the input element it was copied from
    (overlapping windows accumulate; padding receives nothing).  Computed explicitly: zero padding, then
    one strided slice per kernel offset (an ONNX trace gives Pad + Slice + Concat).  Setup checks:
    at least one spatial axis, kernel and stride nonzero, the repeated fields' counts as Caffe requires.
    """

    bottoms = tops = ONE
    in_caffe_1_0 = True
    param_message = "convolution_param"

    @classmethod
    def geometry(cls, layer, shape):
        where = f"layer '{layer.name}' (Im2col)"
        p = layer.convolution_param
        axis = canonical_axis(p.axis, len(shape), layer.name, "convolution_param.axis")
        spatial = len(shape) - axis - 1
        if spatial < 1:
            raise FormatError(f"{where}: needs at least one spatial axis after channel axis {axis}, got shape "
                              f"{tuple(shape)}")
        kernel = _nd_field(p, "kernel", spatial, None, where)
        stride = _nd_field(p, "stride", spatial, 1, where)
        pad = _nd_field(p, "pad", spatial, 0, where)
        dilation = [int(d) for d in p.dilation]
        if len(dilation) not in (0, 1, spatial):
            raise FormatError(f"{where}: convolution_param.dilation must be specified once, or once per spatial "
                              f"dimension (specified {len(dilation)} times; {spatial} spatial dims)")
        dilation = [1] * spatial if not dilation else dilation * spatial if len(dilation) == 1 else dilation
        if min(kernel) <= 0:
            raise FormatError(f"{where}: filter dimensions must be nonzero, got kernel {kernel}")
        if min(stride) <= 0:
            raise FormatError(f"{where}: stride dimensions must be nonzero, got stride {stride}")
        out = _im2col_out(shape[axis + 1:], kernel, stride, pad, dilation)
        if min(out) < 0:
            raise FormatError(f"{where}: the kernel extent exceeds the padded input {tuple(shape)} (output {out})")
        return axis, kernel, stride, pad, dilation, out

    @classmethod
    def infer(cls, layer, bottoms):
        shape = tuple(bottoms[0])
        axis, kernel, _, _, _, out = cls.geometry(layer, shape)
        top = shape[:axis] + (shape[axis] * math.prod(kernel),) + tuple(out)
        return Shapes([top])

    def __init__(self, param, bottom_shapes, phase="test"):
        super().__init__(param, bottom_shapes, phase)
        self.axis, self.kernel, self.stride, self.pad, self.dilation, _ = self.geometry(param, self.bottom_shapes[0])

    def forward(self, x):
        axis = self.axis
        if x.dim() != axis + 1 + len(self.kernel):
            raise ShapeMismatchError(f"layer '{self.layer_name}' (Im2col): set up for {axis + 1 + len(self.kernel)} "
                                     f"axes, got shape {tuple(x.shape)}")
        out = _im2col_out(x.shape[axis + 1:], self.kernel, self.stride, self.pad, self.dilation)
        if min(out) < 0:  # (ints only: no protobuf read in forward, which torch.compile cannot trace)
            raise ShapeMismatchError(f"layer '{self.layer_name}' (Im2col): the kernel extent exceeds the padded input "
                                     f"{tuple(x.shape)} (output {out})")
        overhang = [conv_overhang(int(size), o, k, s, p, d) for size, o, k, s, p, d in
                    zip(x.shape[axis + 1:], out, self.kernel, self.stride, self.pad, self.dilation)]
        pads = [v for p, extra in zip(reversed(self.pad), reversed(overhang)) for v in (p, p + extra)]
        padded = F.pad(x, pads) if any(pads) else x
        columns = []
        for offset in _offsets(self.kernel):
            index = [slice(None)] * (axis + 1)
            for k, s, d, o in zip(offset, self.stride, self.dilation, out):
                index.append(slice(k * d, k * d + (o - 1) * s + 1, s) if o > 0 else slice(0, 0))
            columns.append(padded[tuple(index)])
        stacked = torch.stack(columns, dim=axis + 1)  # (..., C, prod(K), O...)
        return (stacked.flatten(axis, axis + 1),)  # not reshape(..., -1, ...): ambiguous for an empty top


def _im2col_out(sizes, kernel, stride, pad, dilation) -> list[int]:
    """The output size along each spatial axis (Caffe's convolution rule; negative: the kernel does not fit)."""
    return [conv_out_size(int(size), k, s, p, d) for size, k, s, p, d in zip(sizes, kernel, stride, pad, dilation)]


def _offsets(kernel):
    """Every kernel offset, row-major (last axis fastest), as Caffe's im2col loops over them."""
    offsets = [()]
    for k in kernel:
        offsets = [o + (i,) for o in offsets for i in range(k)]
    return offsets

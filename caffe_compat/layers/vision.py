"""Vision layers: Convolution, Deconvolution, InnerProduct (Caffe semantics, 2-D spatial).

(Pooling and SPP are in :mod:`caffe_compat.layers.pooling`.)

* **Convolution** ``y = W ⋆ x + b`` with Caffe's blobs ``W: num_output × (C/group) × kh × kw`` and
  ``b: num_output``; ``out = (in + 2·pad − (dilation·(k − 1) + 1)) // stride + 1``.  kernel/pad/stride
  come from the repeated fields (one value for both axes or one per axis) or their ``_h``/``_w`` forms;
  ``dilation`` is repeated only.  Defaults: pad 0, stride 1, dilation 1, group 1, bias_term true,
  fillers constant 0 (Caffe's FillerParameter default).  Several bottoms are convolved with the same
  weights, one top each (Caffe allows this).
* **Deconvolution** is the transpose of Convolution; Caffe stores its weight **C_in × (num_output/group)
  × kh × kw** (the convolution it transposes has C_in outputs), which is exactly
  ``conv_transpose2d``'s layout.  ``out = stride·(in − 1) + dilation·(k − 1) + 1 − 2·pad``.
* **InnerProduct** ``y = x_flat · Wᵀ + b`` with ``x_flat`` of shape ``(prod(shape[:axis]), K)``;
  ``W`` is ``N × K``, or ``K × N`` when ``transpose: true`` (then ``y = x_flat · W + b``); the top has
  shape ``shape[:axis] + (N,)``.  Defaults: axis 1, bias_term true, transpose false, fillers constant 0.

Only ``axis: 1`` is supported for (De)Convolution, and 4-D blobs; anything else raises FormatError.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from caffe_compat.errors import FormatError, ShapeMismatchError
from caffe_compat.layers.facts import ONE, BlobCount, Shapes, canonical_axis, count
from caffe_compat.layers.fillers import fill_blob, layer_filler
from caffe_compat.layers.geometry import conv_geometry, conv_out_size, deconv_out_size, need_axes
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
        if c % g.group:
            raise FormatError(f"layer '{layer.name}' ({layer.type}): the input's {c} channels are not divisible by "
                              f"convolution_param.group {g.group}")
        if g.num_output % g.group:
            raise FormatError(f"layer '{layer.name}' ({layer.type}): convolution_param.num_output {g.num_output} is "
                              f"not divisible by convolution_param.group {g.group}")
        f = deconv_out_size if cls.transposed else conv_out_size
        oh, ow = (f(size, g.kernel[a], g.stride[a], g.pad[a], g.dilation[a]) for a, size in enumerate((h, w)))
        if oh < 1 or ow < 1:
            raise ShapeMismatchError(f"layer '{layer.name}': input {tuple(bottoms[0])} gives an empty output "
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
        self.kernel, self.stride, self.pad, self.dilation = g.kernel, g.stride, g.pad, g.dilation
        self.group, self.num_output, self.bias_term = g.group, g.num_output, g.bias_term
        self.channels = channels
        blobs = self.infer(param, self.bottom_shapes).params
        self.weight = nn.Parameter(self.new_blob(blobs[0]))
        self.bias = nn.Parameter(self.new_blob(blobs[1])) if g.bias_term else None

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
            outs.append(self._convolve(x))
        return tuple(outs)

    def extra_repr(self):
        return (f"{super().extra_repr()}, num_output={self.num_output}, kernel={self.kernel}, stride={self.stride}, "
                f"pad={self.pad}, dilation={self.dilation}, group={self.group}, bias_term={self.bias_term}")


@register_layer("Convolution")
class Convolution(_ConvolutionBase):
    """Caffe Convolution (see module docstring)."""

    def _convolve(self, x):
        return F.conv2d(x, self.weight, self.bias, self.stride, self.pad, self.dilation, self.group)


@register_layer("Deconvolution")
class Deconvolution(_ConvolutionBase):
    """Caffe Deconvolution: weight C_in × (num_output/group) × kh × kw (see module docstring)."""

    transposed = True

    def _convolve(self, x):
        return F.conv_transpose2d(x, self.weight, self.bias, self.stride, self.pad, 0, self.group, self.dilation)


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
        self.weight = nn.Parameter(self.new_blob(self.infer(param, self.bottom_shapes).params[0]))
        self.bias = nn.Parameter(self.new_blob((self.num_output,))) if p.bias_term else None

    def caffe_blobs(self):
        return [self.weight] + ([self.bias] if self.bias is not None else [])

    def fill(self, generator=None):
        p = self.param.inner_product_param
        _fill_blob(self.weight, p, "weight_filler", generator)
        if self.bias is not None:
            _fill_blob(self.bias, p, "bias_filler", generator)

    def forward(self, x):
        lead = tuple(x.shape[:self.axis])
        flat = x.reshape(*lead, -1) if x.dim() > self.axis else None
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

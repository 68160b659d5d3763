"""Caffe's normalisation and affine layers: BatchNorm, Scale, Bias, MVN, LRN.

Channels are axis 1 throughout.  BatchNorm's three blobs are non-learnable state (registered buffers,
still listed by ``caffe_blobs`` in Caffe's order); Scale/Bias blobs are ``nn.Parameter``.  No port
writes its input, so in-place prototxt chains (``BatchNorm → Scale`` on one blob) stay differentiable.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from caffe_compat.errors import FormatError, ShapeMismatchError
from caffe_compat.layers.cache_blocking import blocking_applies, in_blocks, samples_per_block, writes_into_views
from caffe_compat.layers.caffe_backward import caffe_backward_applies
from caffe_compat.layers.layout import is_channels_last, to_channels_last, to_contiguous
from caffe_compat.layers.facts import (ONE, BlobCount, Shapes, broadcast_view, canonical_axis, legacy_shape,
                                       same_as_bottom)
from caffe_compat.layers.geometry import INT32_MAX, need_axes
from caffe_compat.layers.fillers import constant_filler, fill_blob, layer_filler
from caffe_compat.layers.registry import CaffeLayer, register_layer
from caffe_compat.proto import caffe_pb2


@register_layer("BatchNorm")
class BatchNorm(CaffeLayer):
    """Caffe's BatchNorm (normalisation only; the affine part is a separate ``Scale`` layer).

    Blobs (all non-learnable, zero-initialised): 0 = accumulated mean (C,), 1 = accumulated variance
    (C,), 2 = scale factor s (1,).  ``batch_norm_param``: ``use_global_stats`` (unset: Caffe's default
    ``phase == TEST``, decided at call time from the torch ``training`` flag, which starts as
    ``phase == "train"``: ``.eval()`` gives global statistics, ``.train()`` batch statistics and the
    moving-average update; an explicit value is kept in both modes, as in Caffe),
    ``moving_average_fraction`` λ (0.999),
    ``eps`` (1e-5).  Statistics are per channel (axis 1; one channel for a 1-axis bottom) over every
    other axis, m = count / C values each.

    * global stats: ``f = 0 if s == 0 else 1/s``; ``y = (x - f·blob0) / sqrt(f·blob1 + eps)``.  A stored
      factor of 0 therefore normalises with mean 0 and variance 0: ``y = x / sqrt(eps)``.
    * batch stats (TRAIN): ``μ`` = batch mean, ``σ²`` = biased batch variance ``mean((x - μ)²)``,
      ``y = (x - μ) / sqrt(σ² + eps)``; then, in the forward pass and without gradient,
      ``s ← λ·s + 1``, ``blob0 ← λ·blob0 + μ``, ``blob1 ← λ·blob1 + m/(m-1)·σ²`` (factor 1 if m = 1).

    The blobs never get a gradient (Caffe forces their lr_mult to 0 and never writes their diff)."""

    bottoms = tops = ONE
    in_caffe_1_0 = True

    @classmethod
    def infer(cls, layer, bottoms):
        """The bottom's shape; blobs mean ``(C,)``, variance ``(C,)``, factor ``(1,)``.  Caffe reads ``shape(1)``,
        so the bottom needs at least 2 axes (its 1-axis branch then fails a CHECK in Reshape); Reshape divides
        the count by ``N·C`` in int, so an empty batch or no channel is a division by zero (a FormatError)."""
        need_axes(layer, bottoms, 2, exact=False)
        channels = bottoms[0][1]
        if not bottoms[0][0] * channels:
            raise FormatError(f"layer '{layer.name}' (BatchNorm): input {tuple(bottoms[0])} has N·C = 0, and Caffe's "
                              f"Reshape divides its count by N·C (an integer division by zero)")
        return Shapes([tuple(bottoms[0])], [(channels,), (channels,), (1,)])

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        p = param.batch_norm_param
        # plain values (no parameter, buffer or module): straight into __dict__, as CaffeLayer.__init__ does
        self.__dict__.update(channels=self.rule().params[0][0],
                             moving_average_fraction=float(p.moving_average_fraction), eps=float(p.eps),
                             _global_stats_setting=p.use_global_stats if p.HasField("use_global_stats") else None)
        self.register_buffer("mean", self.new_blob((self.channels,)))
        self.register_buffer("variance", self.new_blob((self.channels,)))
        self.register_buffer("scale_factor", self.new_blob((1,)))

    @property
    def use_global_stats(self) -> bool:
        if self._global_stats_setting is not None:
            return bool(self._global_stats_setting)
        return not self.training

    def caffe_blobs(self):
        return [self.mean, self.variance, self.scale_factor]

    def fill(self, generator=None):
        with torch.no_grad():
            for blob in self.caffe_blobs():
                blob.zero_()

    def forward(self, x):
        if x.dim() == 0 or (x.dim() > 1 and x.shape[1] != self.channels) or (x.dim() == 1 and self.channels != 1):
            raise FormatError(f"layer '{self.layer_name}': bottom shape {tuple(x.shape)} does not have "
                              f"{self.channels} channels on axis 1")
        stat_shape = [1] * x.dim()
        if x.dim() > 1:
            stat_shape[1] = self.channels
        if self.use_global_stats:
            mean, std = self._global_statistics(x, stat_shape)
            return ((x - mean).div_(std),)
        dims = [d for d in range(x.dim()) if d != 1] if x.dim() > 1 else [0]
        mean = x.mean(dim=dims, keepdim=True)
        centred = x - mean
        var = (centred * centred).mean(dim=dims, keepdim=True)
        self._update_statistics(mean.detach().reshape(-1), var.detach().reshape(-1), x.numel() // self.channels)
        return (centred / torch.sqrt(var + self.eps),)

    def _global_statistics(self, x, stat_shape):
        """(stored mean, sqrt(stored variance + eps)), both divided by the scale factor, shaped to broadcast."""
        s = self.scale_factor.to(x.dtype)
        factor = torch.where(s == 0, torch.zeros_like(s), 1.0 / s)
        mean = (self.mean.to(x.dtype) * factor).reshape(stat_shape)
        var = (self.variance.to(x.dtype) * factor).reshape(stat_shape)
        return mean, torch.sqrt(var + self.eps)

    def forward_inplace(self, x):
        if not self.use_global_stats or x.dim() < 2 or x.shape[1] != self.channels:
            return None
        stat_shape = [1, self.channels] + [1] * (x.dim() - 2)
        # The folded statistics, kept while the three blobs are unchanged (their version counters and
        # storage are part of the key), so repeated inference forwards do not recompute them.
        key = (x.dtype, x.device, tuple(stat_shape), *((b._version, b.data_ptr()) for b in self.caffe_blobs()))
        cached = getattr(self, "_inference_statistics", None)
        if cached is None or cached[0] != key:
            cached = (key, self._global_statistics(x, stat_shape))
            self._inference_statistics = cached
        mean, std = cached[1]
        return x.sub_(mean).div_(std)

    def _update_statistics(self, mean, var, m):
        lam = self.moving_average_fraction
        correction = m / (m - 1) if m > 1 else 1.0
        with torch.no_grad():
            self.scale_factor.copy_(self.scale_factor * lam + 1.0)
            self.mean.copy_(self.mean * lam + mean.to(self.mean.dtype))
            self.variance.copy_(self.variance * lam + correction * var.to(self.variance.dtype))


def _param_shape(layer: str, bottom_shape, axis: int, num_axes: int, kind: str) -> tuple[int, tuple[int, ...]]:
    """A learned blob's (axis, shape): LayerSetUp's CanonicalAxisIndex CHECKs ``axis`` even for ``num_axes: 0``
    (a 0-axis bottom always fails it)."""
    ndim = len(bottom_shape)
    axis = canonical_axis(axis, ndim, layer, f"{kind}_param.axis")
    if num_axes < -1:
        raise FormatError(f"layer '{layer}': {kind}_param.num_axes must be >= -1, got {num_axes}")
    end = ndim if num_axes == -1 else axis + num_axes
    if end > ndim:
        raise FormatError(f"layer '{layer}': {kind} blob over axes {axis}..{end - 1} exceeds the bottom's "
                          f"{ndim} axes (shape {tuple(bottom_shape)})")
    return axis, tuple(bottom_shape[axis:end])


def _second_bottom_axis(layer: str, shapes, axis: int, kind: str) -> int:
    """Reshape's axis for a blob given as bottom 1: 0 when that blob is a scalar (0 axes), whatever ``axis``
    says (Caffe skips CanonicalAxisIndex then), else ``axis`` canonicalised on bottom 0."""
    first, second = shapes[0], shapes[1]
    if not len(second):
        return 0
    ndim = len(first)
    axis = canonical_axis(axis, ndim, layer, f"{kind}_param.axis")
    if tuple(first[axis:axis + len(second)]) != tuple(second):
        raise FormatError(f"layer '{layer}': second bottom shape {tuple(second)} must equal the first bottom's "
                          f"axes {axis}..{axis + len(second) - 1} (first bottom shape {tuple(first)})")
    return axis


def _affine_shapes(layer, bottoms, p, kind: str, extra_bias: bool) -> tuple[int, Shapes]:
    """Scale/Bias's shape rule: the top is bottom 0's shape; with one bottom the learned blob spans
    ``axis .. axis+num_axes-1`` of it, with two the second bottom is that blob (which must match);
    ``extra_bias``: Scale's ``bias_term`` adds a blob of the same shape.  Returns (axis, shapes)."""
    if len(bottoms) == 2:
        axis = _second_bottom_axis(layer.name, bottoms, p.axis, kind)
        shape, blobs = tuple(bottoms[1]), []
        if extra_bias:  # Scale's inner BiasLayer is set up on bottom 0 alone: its LayerSetUp CHECKs the axis
            canonical_axis(p.axis, len(bottoms[0]), layer.name, f"{kind}_param.axis")
    else:
        axis, shape = _param_shape(layer.name, bottoms[0], p.axis, p.num_axes, kind)
        blobs = [shape]
    if extra_bias:
        blobs.append(shape)
    return axis, Shapes([tuple(bottoms[0])], blobs)


def _broadcast(value: torch.Tensor, ndim: int, axis: int) -> torch.Tensor:
    return value.reshape(broadcast_view(value.shape, ndim, axis))


def _fitted(value: torch.Tensor, x: torch.Tensor, axis: int, layer: str, what: str, field: str) -> torch.Tensor:
    """``value`` viewed to broadcast over ``x``, after what Scale/Bias's Reshape does on every forward (a net fed
    another shape at run time does not re-run the shape rule): the axis is ``axis`` (the parameter, negative
    counting from the end) canonicalised on ``x``'s axes now, or 0 for a scalar blob, and CHECK_EQ(bottom[0]->
    shape(axis + i), blob->shape(i)) for each of the blob's axes.  A FormatError naming ``field`` for an axis out
    of range, a ShapeMismatchError (not torch's broadcasting RuntimeError) for a dimension that differs."""
    if not value.dim():
        return value
    axis = canonical_axis(axis, x.dim(), layer, field)
    if tuple(x.shape[axis:axis + value.dim()]) != tuple(value.shape):
        raise ShapeMismatchError(f"layer '{layer}': {what} of shape {tuple(value.shape)} does not match the bottom "
                                 f"{tuple(x.shape)} from axis {axis} (Caffe's Reshape CHECKs each dimension)")
    return _broadcast(value, x.dim(), axis)


@register_layer("Scale")
class Scale(CaffeLayer):
    """``y = x ⊙ γ (+ β)``, γ broadcast over axes ``axis .. axis+num_axes-1`` of x.

    One bottom: γ is learned, blob 0, shape ``x.shape[axis : axis+num_axes]`` (``scale_param``: axis 1,
    num_axes 1, -1 = to the end, 0 = a scalar), filler ``scale_param.filler`` else constant 1.
    Two bottoms: γ is the second bottom, whose shape must equal ``x.shape[axis : axis+γ.ndim]``.
    ``bias_term`` (false) adds a learned β of γ's shape (filler ``bias_filler``, else constant 0),
    which is blob 1 with one bottom and blob 0 with two (Caffe's order)."""

    bottoms = BlobCount(1, 2)
    tops = ONE
    in_caffe_1_0 = True

    @classmethod
    def infer(cls, layer, bottoms):
        return _affine_shapes(layer, bottoms, layer.scale_param, "scale", layer.scale_param.bias_term)[1]

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        p = param.scale_param
        axis, shapes = _affine_shapes(param, self.bottom_shapes, p, "scale", p.bias_term)
        self.__dict__.update(axis=axis, axis_param=int(p.axis), scale_filler=layer_filler(p, "filler", constant_filler(1.0)),
                             bias_filler=layer_filler(p, "bias_filler", caffe_pb2.FillerParameter()))
        blobs = list(shapes.params)
        self.scale = nn.Parameter(self.new_blob(blobs.pop(0), 1.0)) if len(self.bottom_shapes) == 1 else None
        self.bias = nn.Parameter(self.new_blob(blobs.pop(0))) if p.bias_term else None

    def caffe_blobs(self):
        return [b for b in (self.scale, self.bias) if b is not None]

    def fill(self, generator=None):
        if self.scale is not None:
            fill_blob(self.scale.data, self.scale_filler, generator)
        if self.bias is not None:
            fill_blob(self.bias.data, self.bias_filler, generator)

    def forward_inplace(self, x):
        if self.scale is None:
            return None
        gamma = _fitted(self.scale, x, self.axis_param, self.layer_name, "the scale blob", "scale_param.axis")
        beta = (_fitted(self.bias, x, self.axis_param, self.layer_name, "the bias blob", "scale_param.axis")
                if self.bias is not None else None)
        x.mul_(gamma)
        if beta is not None:
            x.add_(beta)
        return x

    def forward(self, x, *maybe_scale):
        gamma = maybe_scale[0] if maybe_scale else self.scale
        what = "the scale (bottom 1)" if maybe_scale else "the scale blob"
        y = x * _fitted(gamma, x, self.axis_param, self.layer_name, what, "scale_param.axis")
        if self.bias is not None:  # y is fresh; add saves nothing for backward
            y.add_(_fitted(self.bias, x, self.axis_param, self.layer_name, "the bias blob", "scale_param.axis"))
        return (y,)


@register_layer("Bias")
class Bias(CaffeLayer):
    """``y = x + β``, β broadcast over axes ``axis .. axis+num_axes-1`` of x.

    One bottom: β is learned, blob 0, shape ``x.shape[axis : axis+num_axes]`` (``bias_param``: axis 1,
    num_axes 1, -1 = to the end, 0 = a scalar), filler ``bias_param.filler`` else constant 0.
    Two bottoms: β is the second bottom, shape ``x.shape[axis : axis+β.ndim]``."""

    bottoms = BlobCount(1, 2)
    tops = ONE
    in_caffe_1_0 = True

    @classmethod
    def infer(cls, layer, bottoms):
        return _affine_shapes(layer, bottoms, layer.bias_param, "bias", False)[1]

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        p = param.bias_param
        self.axis, shapes = _affine_shapes(param, self.bottom_shapes, p, "bias", False)
        self.axis_param = int(p.axis)
        self.bias = nn.Parameter(self.new_blob(shapes.params[0])) if shapes.params else None
        self.filler = layer_filler(p, "filler", caffe_pb2.FillerParameter())

    def caffe_blobs(self):
        return [self.bias] if self.bias is not None else []

    def fill(self, generator=None):
        if self.bias is not None:
            fill_blob(self.bias.data, self.filler, generator)

    def forward(self, x, *maybe_bias):
        beta = maybe_bias[0] if maybe_bias else self.bias
        what = "the bias (bottom 1)" if maybe_bias else "the bias blob"
        return (x + _fitted(beta, x, self.axis_param, self.layer_name, what, "bias_param.axis"),)


def _std_plus_eps(std: torch.Tensor, eps: float) -> torch.Tensor:
    """``std + eps`` in value, with its gradient scaled by ``std / (std + eps)``.

    Caffe's MVN backward is ``(dy - mean(dy) - y·mean(dy·y)) / (std + eps)``: the exact derivative of
    ``(x - μ)/std`` divided by ``std + eps``.  The exact derivative of ``(x - μ)/(std + eps)`` has
    ``y·(std + eps)/std`` in the last term instead.  Scaling the gradient through ``std`` by
    ``std / (std + eps)`` turns autograd's result into Caffe's (identical when eps = 0)."""
    if eps == 0.0:
        return std
    ratio = (std / (std + eps)).detach()
    scaled = std * ratio
    return scaled + (std + eps - scaled).detach()


@register_layer("MVN")
class MVN(CaffeLayer):
    """Mean-variance normalisation: ``y = (x - μ) / (σ + eps)`` per (sample, channel), or per sample when
    ``across_channels``; without ``normalize_variance`` just ``y = x - μ``.

    ``mvn_param``: normalize_variance true, across_channels false, eps 1e-9.  σ is the biased standard
    deviation ``sqrt(mean((x - μ)²))``.  **eps is added to σ, not to σ²** (Caffe ``MVNLayer``), and Caffe's
    backward, reproduced here, treats ``σ + eps`` as if it were σ in the variance term:
    ``dx = (dy - mean(dy) - y·mean(dy·y)) / (σ + eps)`` (the fixtures' ``mvn_across_eps``, eps 0.01,
    tell the two apart).

    Shape: Caffe's MVNLayer reshapes its top with the legacy accessors, ``(num, channels, height, width)``
    (1 for a missing axis), so the top always has **4 axes**: an ``(N, D)`` bottom gives an ``(N, D, 1, 1)``
    top; a bottom with more than 4 axes fails the legacy accessors' CHECK (a FormatError)."""

    bottoms = tops = ONE
    in_caffe_1_0 = True

    @classmethod
    def infer(cls, layer, bottoms):
        """``(num, channels, height, width)`` of the bottom (see the class docstring).  Forward_cpu divides the
        count by its row count in int (``N``, or ``N·C`` unless across_channels): no row is a division by zero
        (a crash in Caffe, a FormatError here)."""
        shape = legacy_shape(bottoms[0], f"layer '{layer.name}' (MVN)")
        rows = shape[0] if layer.mvn_param.across_channels else shape[0] * shape[1]
        if not rows:
            raise FormatError(f"layer '{layer.name}' (MVN): input {tuple(bottoms[0])} has no row to normalise "
                              f"({'N' if layer.mvn_param.across_channels else 'N·C'} = 0), and Caffe's Forward "
                              f"divides its count by it (an integer division by zero)")
        return Shapes([shape])

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        p = param.mvn_param
        self.normalize_variance = bool(p.normalize_variance)
        self.across_channels = bool(p.across_channels)
        self.eps = float(p.eps)
        self.rule()

    def forward(self, x):
        shape = legacy_shape(x.shape, f"layer '{self.layer_name}' (MVN)")
        rows = shape[0] if self.across_channels else shape[0] * shape[1]
        if not rows:  # fed an empty batch (or no channel): Caffe's dim = count / num divides by zero
            raise ShapeMismatchError(f"layer '{self.layer_name}' (MVN): input {tuple(x.shape)} has no row to "
                                     f"normalise, and Caffe's Forward divides its count by it")
        flat = x.reshape(rows, -1)
        centred = flat - flat.mean(dim=1, keepdim=True)
        if self.normalize_variance:
            std = torch.sqrt((centred * centred).mean(dim=1, keepdim=True))
            centred = centred / _std_plus_eps(std, self.eps)
        return (centred.reshape(shape),)


@register_layer("LRN")
class LRN(CaffeLayer):
    """Local response normalisation over 4-axis bottoms (``lrn_param``: local_size n = 5 (odd),
    alpha 1, beta 0.75, k 1, norm_region ACROSS_CHANNELS).

    * ACROSS_CHANNELS: ``y = x / (k + α/n · Σ x²)^β``, the sum over the n channels centred on the
      channel, zero-padded ((n-1)/2 each side).
    * WITHIN_CHANNEL, as Caffe composes it (square → AVE pool n×n, stride 1, pad (n-1)/2 → Power →
      product): ``y = x / (1 + α · mean_{n×n} x²)^β`` where the mean always divides by n² (the
      zero-padded window never leaves [-pad, H+pad)).  **k is ignored** (Caffe's Power layer uses
      shift 1).

    Backward is the exact gradient.  ACROSS_CHANNELS takes it from Caffe's own formula
    (``LRNLayer::CrossChannelBackward``), with ``s`` the scale and ``y = x · s^-β`` the top:

        dx = dy · s^-β − (2αβ/n) · x · Σ_window (dy · y / s)

    (the window sum zero-padded as the forward's), from the saved ``s`` and ``s^-β`` (Caffe raises ``s`` to
    ``-β`` a second time; autograd's ``pow`` backward would too, and keep a padded copy per shifted
    channel: the formula is ~3x cheaper), computed in blocks of samples (:mod:`caffe_compat.layers.
    cache_blocking`).  Caffe reads ``y`` from its *top data*: when a later layer rewrites that top in place
    (e.g. an in-place PReLU after the LRN), Caffe differentiates with the rewritten values (a stale top).
    That Caffe quirk is not reproduced (``y`` is recomputed from the saved bottom); the layer-zoo fixture
    shows it (``tests/layers/test_normalization.py::test_lrn_across_then_in_place_prelu_matches_caffe``
    rebuilds Caffe's numbers from ours).  Nets that keep the LRN top intact (GoogLeNet, VGG_CNN_M_1024: a
    pooling or convolution reads it) are not affected.

    A ``channels_last`` bottom gives a ``channels_last`` top and bottom diff (what the convolutions around
    it use), computed in NCHW between two transposes (:mod:`caffe_compat.layers.layout`): the same bits as
    from an NCHW bottom (``pow`` computed NHWC rounded 2 of 630 elements of a test batch differently, by its
    place in a SIMD vector), at ~4% of a GoogLeNet training step at batch 8 on the CPU."""

    bottoms = tops = ONE
    in_caffe_1_0 = True
    infer = classmethod(same_as_bottom)

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        p = param.lrn_param
        self.size = int(p.local_size)
        if self.size > INT32_MAX:  # Caffe's size_ is an int: 2^32 - 1 reads as -1, which its odd CHECK refuses
            raise FormatError(f"layer '{self.layer_name}' (LRN): local_size {self.size} must be at most {INT32_MAX} "
                              f"(Caffe holds it as int)")
        if self.size % 2 != 1:
            raise FormatError(f"layer '{self.layer_name}': LRN only supports odd local_size, got {self.size}")
        self.alpha, self.beta, self.k = float(p.alpha), float(p.beta), float(p.k)
        self.within_channel = p.norm_region == caffe_pb2.LRNParameter.WITHIN_CHANNEL
        if len(self.bottom_shapes[0]) != 4:
            raise FormatError(f"layer '{self.layer_name}': LRN needs a 4-axis bottom (N, C, H, W), "
                              f"got shape {self.bottom_shapes[0]}")

    def forward(self, x):
        if x.dim() != 4:
            raise FormatError(f"layer '{self.layer_name}': LRN needs a 4-axis bottom, got shape {tuple(x.shape)}")
        if torch.onnx.is_in_onnx_export() and not self.within_channel and x.shape[1] <= ONNX_BAND_CHANNELS:
            return (_across_channels_for_onnx(x, self.size, self.alpha, self.beta, self.k),)
        if not self.within_channel and caffe_backward_applies(x):
            return (_CrossChannelLRN.apply(x, self.size, self.alpha, self.beta, self.k),)
        if is_channels_last(x) and writes_into_views(x):  # NCHW passes (the NCHW bits), the top in x's layout
            return (to_channels_last(self._normalise_batch(to_contiguous(x))),)
        return (self._normalise_batch(x),)

    def _normalise_batch(self, x):
        return in_blocks(self._normalise, x) if blocking_applies(x) else self._normalise(x)

    def _normalise(self, x):
        if self.within_channel:
            if not x.shape[2] or not x.shape[3]:  # an empty plane: Caffe's inner pooling gives an empty top too
                return x * 1.0  # (torch's avg_pool2d refuses H = 0 or W = 0 unless N = 0)
            pad = (self.size - 1) // 2
            window_mean = F.avg_pool2d(x * x, self.size, stride=1, padding=pad, count_include_pad=True)
            scale = 1.0 + self.alpha * window_mean
        else:
            scale = _across_scale(x, self.size, self.alpha, self.k)
        if not torch.is_grad_enabled():
            return scale.pow_(-self.beta).mul_(x)
        return x * torch.pow(scale, -self.beta)


#: Most channels for which an ONNX export writes the ACROSS_CHANNELS window sum as a ``C × C`` band convolution.
ONNX_BAND_CHANNELS = 1024


def _across_channels_for_onnx(x: torch.Tensor, size: int, alpha: float, beta: float, k: float) -> torch.Tensor:
    """ACROSS_CHANNELS LRN in the ops ONNX Runtime runs fast (what an ONNX export of the port records).

    ``k + α/n · Σ x²``, the sum over the ``size`` channels centred on each channel, is a 1×1 convolution of
    ``x²`` with the ``C × C`` band ``|c − c'| <= (size − 1)/2`` (zero padding for free): in float32 the
    band holds α/n and the bias k, in float16 (``--fp16``, where α/n = 2e-5 would be a subnormal weight)
    the band holds ones and α/n, k follow.  ``s^−β`` for β = 0.5, 0.75, 1 is taken with square roots and
    one division (``x / (√s · √√s)``), other β with ``pow``.  A convolution sums the window in its own
    order, so the scale is within a few float32 ulps of the port's (which adds the shifted channels one by
    one, as Caffe).  Why not the port's own ops: exported as they are, the padded copy, the channel slices
    and ``pow`` kept ONNX Runtime's convolutions from staying in its blocked channel layout (a reorder
    before and after every LRN); ONNX's own ``LRN`` operator was slower still (GoogLeNet's norm2 at batch
    32: 0.83 s in ONNX Runtime against 0.30 s for the port)."""
    channels = int(x.shape[1])
    index = np.arange(channels)
    # built in NumPy: a constant of the exported graph, not a chain of traced index ops
    band = torch.from_numpy(np.abs(index[:, None] - index[None, :]) <= (size - 1) // 2)
    band = band.to(device=x.device, dtype=x.dtype)[:, :, None, None]
    if x.dtype == torch.float32:  # (ONNX Runtime did not fold a Mul and an Add after the convolution into it)
        bias = torch.from_numpy(np.full(channels, k, dtype=np.float32)).to(x.device)
        scale = F.conv2d(x * x, band * (alpha / size), bias)
    else:
        scale = F.conv2d(x * x, band) * (alpha / size) + k
    if beta == 1.0:
        return x / scale
    if beta in (0.5, 0.75):
        root = torch.sqrt(scale)
        return x / (root if beta == 0.5 else root * torch.sqrt(root))
    return x * torch.pow(scale, -beta)


def _channel_window_sum(like: torch.Tensor, write, size: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Per channel, the sum of some terms (shaped as ``like``) over the ``size`` channels centred on it
    (zero-padded): the ``size`` channel-shifted slices of the padded terms added in order, the first two
    into a fresh tensor (or ``out``) (3x faster than ``avg_pool3d`` on CPU).  ``write(dest)`` writes the
    terms into ``dest``, or returns them for ``dest=None``: in eager mode without autograd they go straight
    into the padded buffer (no separate tensor, no padding copy), else through ``F.pad``."""
    channels = like.shape[1]
    # A window wider than 2C - 1 covers every channel from each one, as 2C - 1 does (the rest is padding): the
    # same sums without a padded buffer (and a loop) of local_size channels (2^31 - 1 asked for 4 TB).
    size = min(size, 2 * channels - 1) if channels else size
    pad = (size - 1) // 2
    if writes_into_views(like):
        n, _, height, width = like.shape
        padded = like.new_empty((n, channels + 2 * pad, height, width))
        padded[:, :pad] = 0
        padded[:, channels + pad:] = 0
        write(padded[:, pad:pad + channels])
    else:
        padded = F.pad(write(None), (0, 0, 0, 0, pad, pad))
    if size == 1:
        return padded.clone() if out is None else out.copy_(padded)
    total = torch.add(padded[:, 0:channels], padded[:, 1:1 + channels], out=out)
    for shift in range(2, size):
        total.add_(padded[:, shift:shift + channels])
    return total


def _across_scale(x: torch.Tensor, size: int, alpha: float, k: float, out: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """ACROSS_CHANNELS scale ``k + α/n · Σ_window x²`` (in place on the window sum: add/mul/add save no
    operand for autograd, so this stays differentiable), into ``out`` when given."""
    def squares(dest):
        return x * x if dest is None else torch.mul(x, x, out=dest)

    return _channel_window_sum(x, squares, size, out).mul_(alpha / size).add_(k)


class _CrossChannelLRN(torch.autograd.Function):
    """ACROSS_CHANNELS LRN whose backward is Caffe's formula (see :class:`LRN`)."""

    @staticmethod
    def forward(ctx, x, size, alpha, beta, k):
        ctx.size, ctx.coefficient = size, 2.0 * alpha * beta / size
        ctx.channels_last = is_channels_last(x)
        if ctx.channels_last:  # NCHW passes: an elementwise pow rounds by its place in a SIMD vector
            x = to_contiguous(x)
            return to_channels_last(_CrossChannelLRN._top(ctx, x, size, alpha, beta, k))
        return _CrossChannelLRN._top(ctx, x, size, alpha, beta, k)

    @staticmethod
    def _top(ctx, x, size, alpha, beta, k):
        if not blocking_applies(x):
            scale = _across_scale(x, size, alpha, k)
            power = torch.pow(scale, -beta)
            ctx.save_for_backward(x, scale, power)
            return x * power
        top, scale, power = (torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(3))
        block = samples_per_block(x)
        for i in range(0, x.shape[0], block):  # the same ops per block of samples, in cache
            part = slice(i, i + block)
            _across_scale(x[part], size, alpha, k, out=scale[part])
            torch.pow(scale[part], -beta, out=power[part])
            torch.mul(x[part], power[part], out=top[part])
        ctx.save_for_backward(x, scale, power)
        return top

    @staticmethod
    def backward(ctx, top_diff):
        x, scale, power = ctx.saved_tensors

        def bottom_diff(x, top_diff, scale, power):
            def ratio(dest):  # Caffe: top_diff · top_data / scale
                numerator = top_diff * (x * power)
                return numerator / scale if dest is None else torch.div(numerator, scale, out=dest)

            accum = _channel_window_sum(x, ratio, ctx.size)
            return (top_diff * power).add_(x * accum, alpha=-ctx.coefficient)

        if ctx.channels_last:
            top_diff = to_contiguous(top_diff)
        diff = in_blocks(bottom_diff, x, top_diff, scale, power) if blocking_applies(x) else \
            bottom_diff(x, top_diff, scale, power)
        return (to_channels_last(diff) if ctx.channels_last else diff), None, None, None, None

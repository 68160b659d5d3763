"""Caffe's element-wise activation layers (neuron layers): one bottom, one top of the same shape.

Every port returns a new tensor (never writes its input), so a prototxt that runs a layer in place
(``top == bottom``) keeps a valid autograd graph; the net only rebinds the blob name.

Where a gradient sits on a boundary (ReLU/ELU at 0, AbsVal's ``sign(0)``, Clip's bounds, Power's
special cases, Log's reciprocal, BNLL's overflow guard) the port computes Caffe's hand-written backward
explicitly (:mod:`caffe_compat.layers.caffe_backward`) around torch's forward, so it never rests on the
derivative torch happens to pick at a kink; PReLU's ``torch.where`` routes the gradient by Caffe's own
``x > 0`` test.  Elsewhere (Sigmoid, TanH, Exp, Swish, Dropout) autograd's derivative is Caffe's
formula.  ``Threshold`` has no backward in Caffe (its top is detached here).  ``Dropout`` reads the
layer's mode at call time (``mode_phase``: the torch ``training`` flag, initialised from the phase):
training drops (Caffe's TRAIN), eval is the identity (Caffe's TEST; Caffe scales at train time).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from caffe_compat.errors import FormatError, ShapeMismatchError
from caffe_compat.layers.caffe_backward import caffe_abs, caffe_relu, with_caffe_backward
from caffe_compat.layers.facts import ONE, Shapes, broadcast_view, legacy_shape, same_as_bottom
from caffe_compat.layers.geometry import need_axes
from caffe_compat.layers.fillers import constant_filler, fill_blob, layer_filler
from caffe_compat.layers.registry import CaffeLayer, register_layer


class NeuronLayer(CaffeLayer):
    """Base of the one-bottom, one-top, same-shape layers (Caffe's ``NeuronLayer``)."""

    bottoms = tops = ONE
    in_caffe_1_0 = True
    infer = classmethod(same_as_bottom)

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.activation(x),)


@register_layer("ReLU")
class ReLU(NeuronLayer):
    """``y = max(x, 0) + negative_slope · min(x, 0)`` (``relu_param.negative_slope``, default 0).

    Backward, as Caffe's: ``dy · ((x > 0) + negative_slope · (x <= 0))``, so ``negative_slope`` (0 by
    default) at exactly ``x = 0``; computed explicitly (:func:`~caffe_compat.layers.caffe_backward.caffe_relu`)."""

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        self.negative_slope = float(param.relu_param.negative_slope)

    def activation(self, x):
        return caffe_relu(x, self.negative_slope)

    def forward_inplace(self, x):
        if self.negative_slope == 0.0:
            return torch.relu_(x)
        return F.leaky_relu_(x, self.negative_slope)


@register_layer("PReLU")
class PReLU(NeuronLayer):
    """``y = max(x, 0) + a_c · min(x, 0)`` with a learned slope per channel (axis 1), or one slope
    when ``prelu_param.channel_shared``.

    Blob 0 is the slope: shape ``(C,)``, or shape ``()`` (a 0-axis blob, as Caffe makes it) when
    shared.  Filler: ``prelu_param.filler`` if set, else constant 0.25.  Gradients, as Caffe's:
    ``dy · ((x > 0) + a_c · (x <= 0))`` (``a_c`` at exactly 0) and, for the slope, ``Σ dy · x`` over the
    positions with ``x <= 0``; ``torch.where(x > 0, ...)`` routes them by that very test.  Bottoms need at
    least 2 axes (Caffe's check) and at most 4: Caffe reads C with the legacy ``channels()``, whose CHECK
    refuses a blob of more than 4 axes (in LayerSetUp and again in each Forward).  Fed fewer channels at
    run time than at setup, Caffe's loop uses the first slopes (its Reshape checks no count) and so does this
    port; more channels, where Caffe reads past the slope blob, are a ShapeMismatchError."""

    @classmethod
    def infer(cls, layer, bottoms):
        """The bottom's shape; blob 0 the slope, ``(C,)`` or ``()`` when shared."""
        b0 = tuple(bottoms[0])
        need_axes(layer, bottoms, 2, exact=False, what=": PReLU needs a bottom with >= 2 axes (Caffe's CHECK)")
        legacy_shape(b0, f"layer '{layer.name}' (PReLU)")
        return Shapes([b0], [() if layer.prelu_param.channel_shared else (b0[1],)])

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        self.channel_shared = bool(param.prelu_param.channel_shared)
        self.slope = nn.Parameter(self.new_blob(self.rule().params[0], 0.25))
        self.filler = layer_filler(param.prelu_param, "filler", constant_filler(0.25))

    def caffe_blobs(self):
        return [self.slope]

    def fill(self, generator=None):
        fill_blob(self.slope.data, self.filler, generator)

    def activation(self, x):
        if x.dim() > 4:
            legacy_shape(x.shape, f"layer '{self.layer_name}' (PReLU)")
        if x.dim() < 2:
            raise ShapeMismatchError(f"layer '{self.layer_name}' (PReLU): a bottom of shape {tuple(x.shape)}; "
                                     f"PReLU needs >= 2 axes (Caffe's CHECK in Reshape)")
        if self.channel_shared:
            return torch.where(x > 0, x, x * self.slope)
        slope, channels = self.slope, x.shape[1]
        if channels != slope.shape[0]:  # Caffe checks nothing: its loop indexes slope[c] for the bottom's c
            if channels > slope.shape[0]:
                raise ShapeMismatchError(f"layer '{self.layer_name}' (PReLU): the bottom has {channels} channels, "
                                         f"the slope blob {slope.shape[0]} (Caffe would read past its slopes)")
            slope = slope[:channels]
        return torch.where(x > 0, x, x * slope.reshape(broadcast_view(slope.shape, x.dim(), 1)))


@register_layer("ELU")
class ELU(NeuronLayer):
    """``y = x`` if ``x > 0`` else ``alpha · (exp(x) - 1)`` (``elu_param.alpha``, default 1).

    Backward, as Caffe's: ``dy · ((x > 0) + (alpha + y) · (x <= 0))``, so ``alpha`` at exactly ``x = 0``."""

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        self.alpha = float(param.elu_param.alpha)

    def activation(self, x):
        return with_caffe_backward(x, self._elu, self._bottom_diff)

    def _elu(self, x):
        return F.elu(x, self.alpha)

    def _bottom_diff(self, top_diff, x):
        y = self._elu(x)
        return top_diff * ((x > 0).to(x.dtype) + (self.alpha + y) * (x <= 0).to(x.dtype))


@register_layer("Sigmoid")
class Sigmoid(NeuronLayer):
    """``y = 1 / (1 + exp(-x))`` (Caffe evaluates it as ``0.5 · tanh(0.5 x) + 0.5``; same value to
    float rounding)."""

    def activation(self, x):
        return torch.sigmoid(x)


@register_layer("TanH")
class TanH(NeuronLayer):
    """``y = tanh(x)``."""

    def activation(self, x):
        return torch.tanh(x)


@register_layer("AbsVal")
class AbsVal(NeuronLayer):
    """``y = |x|``; gradient ``sign(x) · dy`` with ``sign(0) = 0`` (as Caffe's ``caffe_cpu_sign``),
    computed explicitly.  Not in place: Caffe's AbsValLayer CHECKs that its top is not its bottom (its
    backward reads the bottom)."""

    refuses_in_place = True

    def activation(self, x):
        return caffe_abs(x)


@register_layer("Power")
class Power(NeuronLayer):
    """``y = (shift + scale · x) ^ power`` (``power_param``: power 1, scale 1, shift 0).

    As Caffe: ``power == 0`` or ``scale == 0`` gives the constant ``1`` / ``shift ^ power`` with zero
    gradient, and ``power == 1`` the gradient ``scale · dy``.  Otherwise the backward is Caffe's, with its
    special cases (``d = power · scale``):

    * ``power == 2``: ``dy · (d · scale · x + d · shift)``;
    * ``shift == 0``: ``dy · power · y / x``, which is NaN (0/0) at ``x = 0`` for ``power > 0`` and
      ±inf for ``power < 0`` (where the true derivative is 0 or inf): Caffe's value, reproduced;
    * else: ``dy · d · y / (shift + scale · x)``, likewise NaN/inf where the base is 0."""

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        p = param.power_param
        self.power, self.scale, self.shift = float(p.power), float(p.scale), float(p.shift)

    def activation(self, x):
        if self.power == 0.0 or self.scale == 0.0:
            if self.power == 0.0:
                return torch.full_like(x, 1.0)
            # in the blob's dtype, as Caffe's pow(shift, power): NaN for a negative shift and a fractional power,
            # inf for 0 to a negative power or an overflow (math.pow raised ValueError / OverflowError there)
            return torch.full_like(x, self.shift).pow_(self.power)
        if self.power == 1.0:
            return self._base(x)
        return with_caffe_backward(x, self._power, self._bottom_diff)

    def _base(self, x):
        base = x if self.scale == 1.0 else x * self.scale
        return base + self.shift if self.shift != 0.0 else base

    def _power(self, x):
        return torch.pow(self._base(x), self.power)

    def _bottom_diff(self, top_diff, x):
        diff_scale = self.power * self.scale
        if self.power == 2.0:
            local = x * (diff_scale * self.scale)
            if self.shift != 0.0:
                local = local + diff_scale * self.shift
        elif self.shift == 0.0:
            local = self._power(x) / x * self.power
        else:
            local = self._power(x) / self._base(x)
            if diff_scale != 1.0:
                local = local * diff_scale
        return top_diff * local


def _blob_type(x: torch.Tensor):
    """Caffe's Dtype for ``x``: double for float64 blobs, else float."""
    return np.float64 if x.dtype == torch.float64 else np.float32


def _log_base(layer: str, field: str, base: float, dtype) -> float:
    """Exp/LogLayer::LayerSetUp's ``log_base`` in Dtype: 1 for base -1, else ``log(base)`` (the float
    overload for float), after Caffe's CHECKs: base > 0 (NaN fails it) and a finite log."""
    if base != -1.0 and not base > 0.0:
        raise FormatError(f"layer '{layer}': {field} must be strictly positive or -1, got {base}")
    if base == -1.0:
        return dtype(1)
    log_base = dtype(math.log(dtype(base)))
    if math.isinf(log_base):
        raise FormatError(f"layer '{layer}': {field} {base} has an infinite log (Caffe's CHECK)")
    return log_base


def _outer_scale(base, shift, dtype):
    """ExpLayer's ``outer_scale_``: 1 for shift 0, else ``exp(shift)`` for base -1, ``pow(base, shift)``
    otherwise, in Dtype (an overflow is inf, as Caffe's)."""
    if shift == 0:
        return dtype(1)
    try:
        return dtype(math.exp(shift) if base == -1 else math.pow(base, shift))
    except OverflowError:
        return dtype(math.inf)


@register_layer("Exp")
class Exp(NeuronLayer):
    """``y = base ^ (shift + scale · x)`` (``exp_param``: base -1 meaning e, scale 1, shift 0).

    Evaluated as Caffe does: ``outer · exp(inner · x)`` with ``inner = ln(base) · scale`` and
    ``outer = base ^ shift`` (``e ^ shift`` for base -1), both computed once in the blob's type (Dtype),
    as LayerSetUp does.  ``base`` must be positive or -1, with a finite log."""

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        p = param.exp_param
        self.constants = {}  # Dtype -> (inner_scale, outer_scale)
        for dtype in (np.float32, np.float64):
            base, scale, shift = dtype(p.base), dtype(p.scale), dtype(p.shift)
            log_base = _log_base(self.layer_name, "exp_param.base", float(base), dtype)
            self.constants[dtype] = (float(log_base * scale), float(_outer_scale(base, shift, dtype)))

    def activation(self, x):
        inner_scale, outer_scale = self.constants[_blob_type(x)]
        y = torch.exp(x * inner_scale if inner_scale != 1.0 else x)
        return y if outer_scale == 1.0 else y * outer_scale


@register_layer("Log")
class Log(NeuronLayer):
    """``y = log_base(shift + scale · x)`` (``log_param``: base -1 meaning e, scale 1, shift 0).

    Backward, as Caffe's: ``dy · (scale / ln(base)) · (shift + scale · x)^-1`` (inf where the inner value
    is 0, NaN for ``dy = 0`` there).  ``1 / ln(base)`` and ``scale / ln(base)`` are LayerSetUp's, computed
    once in the blob's type (Dtype) from ``ln(base)`` in Dtype (for float, base 10 gives 0.43429446, not
    the double 1/ln 10 rounded, 0.4342945); base must be positive or -1, and not 1 (``1/ln 1`` is inf).

    BVLC master's ``LogLayer``.  The FAPPY authors' fork has **no** Log layer (its proto keeps
    ``LogParameter``), so a net using it cannot run on their Caffe; it is ported for other models."""

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        p = param.log_param
        self.constants = {}  # Dtype -> (base_scale, backward_num_scale), LayerSetUp's Dtype arithmetic
        for dtype in (np.float32, np.float64):
            log_base = _log_base(self.layer_name, "log_param.base", float(dtype(p.base)), dtype)
            if log_base == 0:  # base 1: Caffe's CHECK(!isinf(base_scale_)) on 1 / log(1)
                raise FormatError(f"layer '{self.layer_name}': log_param.base 1 gives 1/log(base) = inf (Caffe's "
                                  f"CHECK)")
            self.constants[dtype] = (float(dtype(1) / log_base), float(dtype(p.scale) / log_base))
        self.scale, self.shift = float(p.scale), float(p.shift)

    def activation(self, x):
        return with_caffe_backward(x, self._log, self._bottom_diff)

    def _inner(self, x):
        inner = x if self.scale == 1.0 else x * self.scale
        return inner + self.shift if self.shift != 0.0 else inner

    def _log(self, x):
        base_scale = self.constants[_blob_type(x)][0]
        y = torch.log(self._inner(x))
        return y if base_scale == 1.0 else y * base_scale

    def _bottom_diff(self, top_diff, x):
        local = self._inner(x).reciprocal()
        num_scale = self.constants[_blob_type(x)][1]
        return top_diff * (local if num_scale == 1.0 else local * num_scale)


@register_layer("BNLL")
class BNLL(NeuronLayer):
    """Binomial normal log-likelihood ``y = log(1 + exp(x))`` in the overflow-free form
    (Caffe: ``x + log(1 + exp(-x))`` for ``x > 0``, else ``log(1 + exp(x))``).

    ``softplus`` computes the same stable form (it returns ``x`` above 20, where
    ``log(1 + exp(-x)) < 2e-9`` vanishes in float32 as it does in Caffe).  Backward, as Caffe's:
    ``dy · e / (e + 1)`` with ``e = exp(min(x, 50))`` (the guard keeps it 1, not inf/inf, for large x),
    computed explicitly rather than softplus's own cut at 20."""

    BNLL_THRESHOLD = 50.0

    def activation(self, x):
        return with_caffe_backward(x, F.softplus, self._bottom_diff)

    def _bottom_diff(self, top_diff, x):
        expval = torch.exp(x.clamp(max=self.BNLL_THRESHOLD))
        return top_diff * expval / (expval + 1.0)


@register_layer("Threshold")
class Threshold(NeuronLayer):
    """``y = 1`` if ``x > threshold`` else ``0`` (strict: ``x == threshold`` gives 0;
    ``threshold_param.threshold`` default 0).  Caffe has no backward for it: the top is detached."""

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        self.threshold = float(param.threshold_param.threshold)

    def activation(self, x):
        return (x.detach() > self.threshold).to(x.dtype)


@register_layer("Dropout")
class Dropout(NeuronLayer):
    """Inverted dropout: at TRAIN ``y = x · m / (1 - ratio)`` with ``m ~ Bernoulli(1 - ratio)`` per
    element (``dropout_param.dropout_ratio``, default 0.5); at TEST the identity (Caffe scales at train
    time, not at test time).

    TRAIN vs TEST is read at call time from the torch ``training`` flag (``self.mode_phase``), which
    starts as ``phase == "train"``: ``.eval()`` on a TRAIN-phase net makes Dropout the identity,
    ``.train()`` on a TEST-phase net makes it drop (registry docstring).  ``self.generator`` (a
    ``torch.Generator`` on the input's device, default None = torch's global RNG) drives the mask,
    and the last TRAIN mask is kept in ``self.last_mask`` (boolean).

    The ratio is not checked at setup: Caffe's ``DCHECK`` s (0 < ratio < 1) are compiled out of a release
    build, so any ratio builds and TEST is the identity.  TRAIN draws the mask with
    ``caffe_rng_bernoulli(1 - ratio)``, which CHECKs ``0 <= 1 - ratio <= 1`` (a FormatError at the forward
    here), and ratio 1 keeps nothing and scales by ``1/0 = inf``: ``x · 0 · inf`` is NaN, as Caffe's."""

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        self.ratio = float(param.dropout_param.dropout_ratio)
        self.generator: torch.Generator | None = None
        self.last_mask: torch.Tensor | None = None

    def activation(self, x):
        if not self.training or self.ratio == 0.0:
            return x
        if not 0.0 <= 1.0 - self.ratio <= 1.0:  # caffe_rng_bernoulli's CHECK_GE(p, 0), CHECK_LE(p, 1)
            raise FormatError(f"layer '{self.layer_name}': dropout_ratio {self.ratio} gives a keep probability "
                              f"1 - ratio outside [0, 1] (Caffe's caffe_rng_bernoulli CHECK at a TRAIN forward)")
        keep = torch.rand(x.shape, generator=self.generator, device=x.device, dtype=torch.float32) >= self.ratio
        self.last_mask = keep
        scale = math.inf if self.ratio == 1.0 else 1.0 / (1.0 - self.ratio)  # Caffe's scale_ = 1. / (1. - ratio)
        return x * keep.to(x.dtype) * scale


@register_layer("Swish")
class Swish(NeuronLayer):
    """``y = x · sigmoid(beta · x)`` (``swish_param.beta``, default 1; BVLC master's ``SwishLayer``)."""

    in_caffe_1_0 = False  # BVLC master, after 1.0

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        self.beta = float(param.swish_param.beta)

    def activation(self, x):
        return x * torch.sigmoid(x * self.beta if self.beta != 1.0 else x)


@register_layer("Clip")
class Clip(NeuronLayer):
    """``y = min(max(x, min), max)`` (``clip_param.min``/``max``, both required; BVLC master's
    ``ClipLayer``).  Gradient passes where ``min <= x <= max`` (inclusive at both bounds, as Caffe),
    computed explicitly: ``clamp``'s own gradient at the bounds is torch's choice (0 since torch 2.14)."""

    in_caffe_1_0 = False  # BVLC master, after 1.0

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        p = param.clip_param
        if not (p.HasField("min") and p.HasField("max")):
            raise FormatError(f"layer '{self.layer_name}': Clip needs clip_param.min and clip_param.max")
        self.min, self.max = float(p.min), float(p.max)
        if self.min > self.max:
            raise FormatError(f"layer '{self.layer_name}': clip_param.min {self.min} > max {self.max}")

    def activation(self, x):
        return with_caffe_backward(x, self._clip, self._bottom_diff)

    def _clip(self, x):
        return torch.clamp(x, self.min, self.max)

    def _bottom_diff(self, top_diff, x):
        return top_diff * ((x >= self.min) & (x <= self.max)).to(top_diff.dtype)

"""Caffe's general-purpose layers: Eltwise, Softmax, Reduction, ArgMax, Embed, Accuracy, Parameter.

Index-valued tops (ArgMax indices, Accuracy) are float tensors like every Caffe blob and carry no
gradient (Caffe has no backward for ArgMax/Accuracy, nor into Embed's index bottom).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from caffe_compat.errors import DataError, FormatError, ShapeMismatchError
from caffe_compat.layers.caffe_backward import caffe_abs, caffe_backward_applies
from caffe_compat.layers.facts import NONE, ONE, BlobCount, Shapes, canonical_axis, count, same_as_bottom
from caffe_compat.layers.fillers import fill_blob, layer_filler
from caffe_compat.layers.registry import CaffeLayer, register_layer
from caffe_compat.losses.static_form import asserted_in_graph
from caffe_compat.proto import caffe_pb2

_Eltwise = caffe_pb2.EltwiseParameter
_Reduction = caffe_pb2.ReductionParameter


@register_layer("Eltwise")
class Eltwise(CaffeLayer):
    """Element-wise combination of >= 2 same-shape bottoms (``eltwise_param.operation``, default SUM).

    * SUM: ``y = Σ_i c_i x_i`` with ``coeff`` (one per bottom, default all 1).
    * PROD: ``y = Π_i x_i``.  The gradient to ``x_i`` is ``dy · Π_{j≠i} x_j`` with ``stable_prod_grad``
      (the default; autograd's product of the others), else Caffe's ``dy · (y / x_i)``, computed as Caffe
      does: NaN where ``x_i = 0`` (0/0), and ±inf/NaN where another input overflows the product.
    * MAX: ``y = max_i x_i`` with Caffe's argmax routing: between bottoms 0 and 1 a tie goes to bottom
      1 (``a > b ? a : b``), later bottoms replace the running max only when strictly greater.  The
      gradient flows to that single bottom per element.
    ``coeff`` must have one value per bottom whatever the operation; with PROD coefficients are an
    error, with MAX they are accepted and ignored (Caffe's two CHECKs in LayerSetUp: the count, then
    "not PROD"; its MAX forward never reads them)."""

    bottoms = BlobCount.at_least(2)
    tops = ONE
    in_caffe_1_0 = True

    @classmethod
    def infer(cls, layer, bottoms):
        """Bottom 0's shape; every bottom must have it (Caffe's CHECK in Reshape)."""
        for shape in bottoms[1:]:
            if tuple(shape) != tuple(bottoms[0]):
                raise FormatError(f"layer '{layer.name}': Eltwise bottoms must have equal shapes, got "
                                  f"{tuple(bottoms[0])} and {tuple(shape)}")
        return Shapes([tuple(bottoms[0])])

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        p = param.eltwise_param
        self.operation = p.operation
        self.stable_prod_grad = bool(p.stable_prod_grad)
        self.coeffs = [float(c) for c in p.coeff]
        if self.coeffs and len(self.coeffs) != len(self.bottom_shapes):
            raise FormatError(f"layer '{self.layer_name}': Eltwise has {len(self.coeffs)} coeff(s) for "
                              f"{len(self.bottom_shapes)} bottoms")
        if self.coeffs and self.operation == _Eltwise.PROD:
            raise FormatError(f"layer '{self.layer_name}': Eltwise only takes coefficients for SUM")
        self.rule()

    def forward(self, *bottoms):
        if self.operation == _Eltwise.PROD:
            if not self.stable_prod_grad and any(caffe_backward_applies(b) for b in bottoms):
                return (_QuotientProd.apply(*bottoms),)
            y = _product(bottoms)
        elif self.operation == _Eltwise.SUM:
            coeffs = self.coeffs or [1.0] * len(bottoms)
            terms = [b if c == 1.0 else b * c for b, c in zip(bottoms, coeffs)]
            y = terms[0]
            for t in terms[1:]:
                y = y + t
        else:
            a, b = bottoms[0], bottoms[1]
            y = torch.where(a > b, a, b)
            for nxt in bottoms[2:]:
                y = torch.where(nxt > y, nxt, y)
        return (y,)


def _product(bottoms) -> torch.Tensor:
    """``x_0 · x_1 · …`` in Caffe's order."""
    y = bottoms[0] * bottoms[1]
    for b in bottoms[2:]:
        y = y * b
    return y


class _QuotientProd(torch.autograd.Function):
    """Eltwise PROD with ``stable_prod_grad: false``: Caffe's bottom diff ``(top / bottom_i) · top_diff``."""

    @staticmethod
    def forward(ctx, *bottoms):
        top = _product(bottoms)
        ctx.save_for_backward(top, *bottoms)
        return top

    @staticmethod
    def backward(ctx, top_diff):
        top, *bottoms = ctx.saved_tensors
        return tuple(top / b * top_diff if need else None for b, need in zip(bottoms, ctx.needs_input_grad))


@register_layer("Softmax")
class Softmax(CaffeLayer):
    """``y = exp(x - max) / Σ exp(x - max)`` along ``softmax_param.axis`` (default 1)."""

    bottoms = tops = ONE
    in_caffe_1_0 = True
    infer = classmethod(same_as_bottom)

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        self.axis = canonical_axis(param.softmax_param.axis, len(self.bottom_shapes[0]), self.layer_name,
                                   "softmax_param.axis")

    def forward(self, x):
        return (torch.softmax(x, dim=self.axis),)


@register_layer("Reduction")
class Reduction(CaffeLayer):
    """Reduce every axis from ``axis`` on (``reduction_param``: operation SUM, axis 0, coeff 1); the top
    has shape ``bottom.shape[:axis]`` (a scalar for axis 0).

    SUM ``coeff·Σx``, ASUM ``coeff·Σ|x|`` (gradient ``sign(x)``, 0 at 0), SUMSQ ``coeff·Σx²``,
    MEAN ``Σx · (coeff / n)``: Caffe divides its Dtype ``coeff_`` by n once at Reshape and scales the sum
    by it (the gradient is ``dy · (coeff / n)``), which rounds differently from ``Σx / n · coeff``.  A
    0-axis bottom fails CanonicalAxisIndex's CHECK (a FormatError)."""

    bottoms = tops = ONE
    in_caffe_1_0 = True

    @staticmethod
    def reduced_axis(layer, shape) -> int:
        ndim = len(shape)
        return canonical_axis(layer.reduction_param.axis, ndim, layer.name, "reduction_param.axis")

    @classmethod
    def infer(cls, layer, bottoms):
        """``shape[:axis]``."""
        return Shapes([tuple(bottoms[0][:cls.reduced_axis(layer, bottoms[0])])])

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        p = param.reduction_param
        self.axis = self.reduced_axis(param, self.bottom_shapes[0])
        self.operation = p.operation
        self.coeff = float(p.coeff)

    def forward(self, x):
        flat = x.flatten(self.axis)  # not reshape(..., -1): ambiguous for an empty outer part
        if self.operation == _Reduction.ASUM:
            y = caffe_abs(flat).sum(-1)
        elif self.operation == _Reduction.SUMSQ:
            y = (flat * flat).sum(-1)
        else:
            y = flat.sum(-1)
        coeff = self.coeff
        if self.operation == _Reduction.MEAN:  # coeff_ /= dim_ in Dtype
            dtype = np.float64 if x.dtype == torch.float64 else np.float32
            coeff = float(dtype(coeff) / dtype(flat.shape[-1]))
        return (y if coeff == 1.0 else y * coeff,)


def _caffe_topk(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last axis in the order of ``std::partial_sort`` with ``std::greater`` on
    ``(value, index)`` pairs: larger value first, and among equal values the **larger index** first."""
    n = values.shape[-1]
    flipped = values.flip(-1)
    sorted_values, order = torch.sort(flipped, dim=-1, descending=True, stable=True)
    return sorted_values[..., :k], (n - 1 - order[..., :k])


@register_layer("ArgMax")
class ArgMax(CaffeLayer):
    """Indices (or values) of the ``top_k`` largest entries (``argmax_param``: out_max_val false,
    top_k 1, axis unset).

    * with ``axis``: along that axis; the top is the bottom's shape with ``shape[axis] = top_k``, holding
      indices, or **only values** when ``out_max_val``.
    * without ``axis``: over each sample's flattened ``count(1)`` values; the top has
      ``max(3, ndim)`` axes ``(N, 1, top_k, 1, ...)`` with indices, or ``(N, 2, top_k, 1, ...)`` with
      indices then values when ``out_max_val``.
    Ties are ordered as Caffe's ``partial_sort`` of (value, index) pairs with ``std::greater``: among
    equal values the larger index comes first.  No gradient (Caffe has no backward)."""

    bottoms = tops = ONE
    in_caffe_1_0 = True

    @staticmethod
    def top_shape(layer, shape) -> tuple[int, ...]:
        """The top's shape (see the class docstring); FormatError unless ``1 <= top_k <=`` the values
        compared (Caffe's CHECKs)."""
        p = layer.argmax_param
        axis = canonical_axis(p.axis, len(shape), layer.name, "argmax_param.axis") if p.HasField("axis") else None
        if axis is None and not shape:  # Blob::count(1) CHECKs start_axis <= num_axes()
            raise FormatError(f"layer '{layer.name}' (ArgMax): without argmax_param.axis the input needs at least "
                              f"one axis (Caffe reads count(1)), got a 0-axis blob")
        available = shape[axis] if axis is not None else count(shape, 1)
        if p.top_k < 1 or p.top_k > available:
            raise FormatError(f"layer '{layer.name}': top_k {p.top_k} must be in [1, {available}]")
        if axis is not None:
            top = list(shape)
            top[axis] = p.top_k
            return tuple(top)
        top = [1] * max(3, len(shape))
        top[0], top[1], top[2] = shape[0], 2 if p.out_max_val else 1, p.top_k
        return tuple(top)

    @classmethod
    def infer(cls, layer, bottoms):
        return Shapes([cls.top_shape(layer, tuple(bottoms[0]))])

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        p = param.argmax_param
        shape = self.bottom_shapes[0]
        self.out_max_val = bool(p.out_max_val)
        self.top_k = int(p.top_k)
        self.axis = canonical_axis(p.axis, len(shape), self.layer_name, "argmax_param.axis") \
            if p.HasField("axis") else None
        self.built_top = self.top_shape(param, shape)

    def _top_shape(self, shape) -> tuple[int, ...]:
        if tuple(shape) == self.bottom_shapes[0]:
            return self.built_top  # no protobuf read (a compiled forward cannot trace one)
        return self.top_shape(self.param, tuple(shape))

    def forward(self, x):
        x = x.detach()
        if self.axis is not None:
            values, index = _caffe_topk(x.movedim(self.axis, -1), self.top_k)
            out = values if self.out_max_val else index.to(x.dtype)
            return (out.movedim(-1, self.axis).contiguous(),)
        rows = x.flatten(1) if x.dim() > 1 else x.unsqueeze(1)  # not reshape(N, -1): ambiguous for an empty batch
        values, index = _caffe_topk(rows, self.top_k)
        parts = [index.to(x.dtype), values] if self.out_max_val else [index.to(x.dtype)]
        return (torch.stack(parts, dim=1).reshape(self._top_shape(x.shape)),)


@register_layer("Embed")
class Embed(CaffeLayer):
    """Look-up table: ``y[..., :] = W[int(x[...]), :] (+ b)``; top shape ``bottom.shape + (num_output,)``.

    ``embed_param``: input_dim K, num_output N, bias_term true, weight_filler / bias_filler (unset:
    constant 0).  Blob 0: W (K, N); blob 1: b (N,).  Indices come as floats and are truncated toward
    zero (``static_cast<int>``); an index outside [0, K) raises :class:`DataError` (Caffe only
    DCHECKs).  The index bottom gets no gradient (Caffe cannot backpropagate to it); repeated indices
    accumulate into W's gradient."""

    bottoms = tops = ONE
    in_caffe_1_0 = True

    @classmethod
    def infer(cls, layer, bottoms):
        """``bottom.shape + (num_output,)``; blobs W ``(input_dim, num_output)`` and b ``(num_output,)``."""
        p = layer.embed_param
        if p.input_dim < 1 or p.num_output < 1:
            raise FormatError(f"layer '{layer.name}': Embed needs input_dim > 0 and num_output > 0")
        params = [(p.input_dim, p.num_output)] + ([(p.num_output,)] if p.bias_term else [])
        return Shapes([tuple(bottoms[0]) + (p.num_output,)], params)

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        p = param.embed_param
        self.input_dim, self.num_output = int(p.input_dim), int(p.num_output)
        if self.input_dim < 1 or self.num_output < 1:
            raise FormatError(f"layer '{self.layer_name}': Embed needs input_dim > 0 and num_output > 0")
        self.weight = nn.Parameter(self.new_blob((self.input_dim, self.num_output)))
        self.bias = nn.Parameter(self.new_blob((self.num_output,))) if p.bias_term else None
        self.weight_filler = layer_filler(p, "weight_filler")
        self.bias_filler = layer_filler(p, "bias_filler")

    def caffe_blobs(self):
        return [b for b in (self.weight, self.bias) if b is not None]

    def fill(self, generator=None):
        fill_blob(self.weight.data, self.weight_filler, generator)
        if self.bias is not None:
            fill_blob(self.bias.data, self.bias_filler, generator)

    def forward(self, x):
        index = x.detach().to(torch.int64)  # truncation toward zero, like static_cast<int>
        inside = ((index >= 0) & (index < self.input_dim)).all()
        if not asserted_in_graph(inside, f"layer '{self.layer_name}': an Embed index is outside [0, {self.input_dim})") \
                and not bool(inside):
            bad = x[(index < 0) | (index >= self.input_dim)].flatten()[0].item()
            raise DataError(f"layer '{self.layer_name}': Embed index {bad} is outside [0, {self.input_dim})")
        y = F.embedding(index, self.weight)
        if self.bias is not None:
            y = y + self.bias
        return (y,)


@register_layer("Accuracy")
class Accuracy(CaffeLayer):
    """Top-k classification accuracy of scores (bottom 0) against labels (bottom 1).

    ``accuracy_param``: top_k 1, axis 1 (the class axis), ignore_label unset.  Scores are read as
    (outer, C, inner) around the axis and labels hold outer·inner values (truncated to int).  A
    position is correct when ``#{k : score_k >= score_label} - 1 < top_k`` (Caffe master's count, so a
    tie with the true class counts against it).  Top 0 (scalar): correct / counted (0 when nothing is
    counted; ignored labels are not counted).  Optional top 1 (C,): per-class accuracy (0 for a class
    that never occurs).  Labels outside [0, C) raise :class:`DataError`.  No gradient."""

    bottoms = BlobCount.exact(2)
    tops = BlobCount(1, 2)
    in_caffe_1_0 = True

    @classmethod
    def infer(cls, layer, bottoms):
        """A scalar, and ``(C,)`` for the per-class top; Caffe's CHECKs on top_k and the label count.

        Caffe bounds ``top_k`` by ``count(scores) / count(labels)`` (integer division), the number of classes
        when the label count is right; not by ``C · inner``, which would let ``top_k > C`` through for
        spatial scores."""
        p = layer.accuracy_param
        scores, labels = tuple(bottoms[0]), tuple(bottoms[1])
        if count(labels) and p.top_k > count(scores) // count(labels):
            raise FormatError(f"layer '{layer.name}': top_k {p.top_k} must be less than or equal to the number of "
                              f"classes ({count(scores) // count(labels)} = {count(scores)} scores / "
                              f"{count(labels)} labels)")
        axis = canonical_axis(p.axis, len(scores), layer.name, "accuracy_param.axis")
        if count(scores, 0, axis) * count(scores, axis + 1) != count(labels):
            raise FormatError(f"layer '{layer.name}': {count(labels)} labels for scores of shape {scores} "
                              f"(need outer·inner = {count(scores, 0, axis) * count(scores, axis + 1)})")
        return Shapes([(), (scores[axis],)][:max(1, len(layer.top))])

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        p = param.accuracy_param
        scores = self.bottom_shapes[0]
        self.top_k = int(p.top_k)
        self.axis = canonical_axis(p.axis, len(scores), self.layer_name, "accuracy_param.axis")
        self.ignore_label = int(p.ignore_label) if p.HasField("ignore_label") else None
        self.num_labels = scores[self.axis]
        self.rule()
        self.num_tops = max(1, len(param.top))

    def forward(self, scores, labels):
        scores = scores.detach()
        shape = scores.shape
        num_labels = shape[self.axis]  # Caffe's Forward reads it from the bottom; Reshape CHECKs top_k <= it
        if num_labels < self.top_k:
            raise ShapeMismatchError(f"layer '{self.layer_name}': top_k {self.top_k} must be less than or equal to "
                                     f"the number of classes, got scores {tuple(shape)}")
        s = scores.reshape(count(shape, 0, self.axis), num_labels, count(shape, self.axis + 1))
        lab = labels.detach().reshape(s.shape[0], s.shape[2]).to(torch.int64)
        valid = torch.ones_like(lab, dtype=torch.bool) if self.ignore_label is None else lab != self.ignore_label
        outside = (((lab < 0) | (lab >= num_labels)) & valid).any()
        message = f"layer '{self.layer_name}': a label is outside [0, {num_labels})"
        if not asserted_in_graph(~outside, message) and bool(outside):
            raise DataError(message)
        safe = torch.where(valid, lab, torch.zeros_like(lab))
        true_score = torch.gather(s, 1, safe.unsqueeze(1))
        better = (s >= true_score).sum(dim=1) - 1
        correct = (better < self.top_k) & valid
        n_valid = valid.sum()
        accuracy = torch.where(n_valid > 0, correct.sum().to(scores.dtype) / n_valid.clamp(min=1),
                               torch.zeros((), dtype=scores.dtype, device=scores.device))
        if self.num_tops == 1:
            return (accuracy,)
        classes = torch.zeros(num_labels, dtype=scores.dtype, device=scores.device)
        # every position adds its 0/1 (counts of whole numbers: exact in any order), no data-dependent shape
        totals = classes.index_add(0, safe.flatten(), valid.flatten().to(scores.dtype))
        hits = classes.index_add(0, safe.flatten(), correct.flatten().to(scores.dtype))
        per_class = torch.where(totals > 0, hits / totals.clamp(min=1), classes)
        return (accuracy, per_class)


@register_layer("Parameter")
class Parameter(CaffeLayer):
    """No bottom; its single top is its learnable blob 0 of shape ``parameter_param.shape``
    (zero-initialised; Caffe's ParameterLayer has no filler)."""

    bottoms = NONE
    tops = ONE
    in_caffe_1_0 = True

    @classmethod
    def infer(cls, layer, bottoms):
        """The top is blob 0: ``parameter_param.shape``."""
        shape = tuple(int(d) for d in layer.parameter_param.shape.dim)
        return Shapes([shape], [shape])

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        self.blob = nn.Parameter(self.new_blob(self.rule().params[0]))

    def caffe_blobs(self):
        return [self.blob]

    def forward(self):
        return (self.blob,)

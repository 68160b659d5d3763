"""Caffe's built-in loss layers, ported to match the authors' Caffe fork (BVLC master, 2017+).

Every port returns the **unweighted** loss as a 0-d tensor (Caffe's scalar loss top); ``loss_weight``
is applied by the net's objective, and Caffe puts it into the top diff, so it scales the gradients.
Label bottoms are read as Caffe reads them, ``static_cast<int>(label)`` (truncation toward zero), and
never receive a gradient (Caffe: "cannot backpropagate to label inputs").  Class labels outside
``[0, C)`` (other than ``ignore_label``) raise :class:`DataError` (Caffe only DCHECKs them and reads
out of bounds in a release build); the check costs one host sync per forward.

Normalisers, as Caffe's ``LossLayer::GetNormalizer`` (``outer`` = number of positions before the
class axis, ``inner`` = positions after it)::

    FULL -> outer*inner   VALID -> #non-ignored labels   BATCH_SIZE -> outer   NONE -> 1
    normaliser = max(1, that)

=========================  ======================================================  ==================
layer                      loss                                                    normaliser
=========================  ======================================================  ==================
ContrastiveLoss            sim: d²; else max(m - d, 0)² (legacy: max(m - d², 0))   2N
EuclideanLoss              Σ (a - b)²                                              2N
SoftmaxWithLoss            -log max(softmax(x)_y, FLT_MIN)                          VALID (default)
SigmoidCrossEntropyLoss    -[x(t - [x>=0]) - log(1 + exp(x - 2x[x>=0]))]           BATCH_SIZE (default)
HingeLoss                  Σ max(0, 1 - δ_{k=y} x_k + δ_{k≠y} x_k) (L1) or its squares (L2)   N
InfogainLoss               -Σ_l H[y, l] log max(softmax(x)_l, 1e-20)                VALID (default)
MultinomialLogisticLoss    -log max(p_y, 1e-20)                                    N
=========================  ======================================================  ==================

Caffe's backward passes differ from the derivative of its forward in three places, reproduced here:
the clipped logs (Softmax/Infogain/MultinomialLogistic) keep the gradient of the unclipped quantity
(``prob - onehot``, ``-1/max(p, 1e-20)``), and the non-legacy ContrastiveLoss divides by ``d + 1e-4``
instead of ``d``.  Legacy ``normalize: true/false`` means VALID/BATCH_SIZE when ``normalization`` is
unset.  ``SoftmaxWithLoss``/``InfogainLoss`` accept a second top (the probabilities); this Caffe cannot
actually instantiate ``SoftmaxWithLoss`` with two tops (its internal Softmax copy fails the
loss_weight-count check), we support it anyway, and like Caffe (which never reads that top's diff)
the prob top is detached.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import torch

from caffe_compat.errors import CaffeCompatError, DataError, FormatError, ShapeMismatchError
from caffe_compat.layers.caffe_backward import caffe_relu
from caffe_compat.layers.facts import BlobCount, Shapes, canonical_axis, legacy_shape
from caffe_compat.layers.facts import count as _count
from caffe_compat.layers.registry import CaffeLayer, register_layer
from caffe_compat.losses.static_form import asserted_in_graph
from caffe_compat.proto import caffe_pb2

_Norm = caffe_pb2.LossParameter
FLT_MIN = 1.1754943508222875e-38  # std::numeric_limits<float>::min(), SoftmaxWithLoss's log clip
LOG_THRESHOLD = 1e-20  # kLOG_THRESHOLD of InfogainLoss and MultinomialLogisticLoss


# --------------------------------------------------------------------------- shared helpers

def normalization_mode(param, default: int) -> int:
    """The layer's NormalizationMode: ``normalization`` if set, else legacy ``normalize``
    (true → VALID, false → BATCH_SIZE), else ``default``."""
    lp = param.loss_param
    if lp.HasField("normalization"):
        return lp.normalization
    if lp.HasField("normalize"):
        return _Norm.VALID if lp.normalize else _Norm.BATCH_SIZE
    return default


def get_normalizer(mode: int, outer: int, inner: int, valid_count: torch.Tensor | int | None):
    """Caffe's ``GetNormalizer``: FULL outer·inner, VALID the valid count (outer·inner when no label is
    ignorable), BATCH_SIZE outer, NONE 1; always at least 1.  A tensor count stays a tensor (no sync)."""
    if mode == _Norm.VALID and valid_count is not None:
        if isinstance(valid_count, torch.Tensor):
            return valid_count.clamp(min=1)
        return max(1, int(valid_count))
    value = {_Norm.FULL: outer * inner, _Norm.VALID: outer * inner, _Norm.BATCH_SIZE: outer, _Norm.NONE: 1}[mode]
    return max(1, value)


def clamp_keep_grad(x: torch.Tensor, min_value: float) -> torch.Tensor:
    """``max(x, min_value)`` in value, identity in gradient: the clipped logs of Caffe's losses whose
    backward ignores the clip."""
    return x + (x.clamp(min=min_value) - x).detach()


def int_labels(label: torch.Tensor) -> torch.Tensor:
    """``static_cast<int>(label)``: truncation toward zero, as int64 indices."""
    return label.detach().to(torch.long)


class _LossLayer(CaffeLayer):
    """Common checks of Caffe's ``LossLayer``: two bottoms with the same first dimension."""

    is_loss = True
    bottoms = BlobCount.exact(2)
    tops = BlobCount(0, 1)
    in_caffe_1_0 = True
    refuses_forced_backward = (1,)  # LossLayer::AllowForceBackward: no diff for the labels
    #: Its Reshape reads bottom 0's axes after LossLayer::Reshape made top 0 a scalar: in place (top 0 is bottom
    #: 0, one Blob) that bottom has 0 axes by then, and the read CHECK-fails (see ``infer``).
    reshape_reads_axes_after_loss_shape: bool = False

    @classmethod
    def infer(cls, layer, bottoms):
        """A scalar loss; Caffe's LossLayer CHECK: data and label have the same first dimension (read with
        ``shape(0)``, whose axis CHECK refuses a 0-axis bottom).  In place (top 0 named as bottom 0), Caffe's
        ``LossLayer::Reshape`` reshapes that shared Blob to the 0-axis loss before the type's own Reshape reads
        its axes (``reshape_reads_axes_after_loss_shape``): a CHECK failure at setup, a FormatError here."""
        if cls.reshape_reads_axes_after_loss_shape and layer.top[:1] and layer.top[0] == layer.bottom[0]:
            raise FormatError(f"layer '{layer.name}' ({layer.type}): computed in place (top '{layer.top[0]}' is "
                              f"bottom 0): Caffe's LossLayer::Reshape makes that blob the 0-axis loss before "
                              f"{layer.type}'s Reshape reads its axes, a CHECK failure")
        s0, s1 = tuple(bottoms[0]), tuple(bottoms[1])
        if not s0 or not s1:
            raise FormatError(f"layer '{layer.name}' ({layer.type}): LossLayer reads each bottom's first dimension, "
                              f"got a 0-axis bottom ({s0} and {s1})")
        if s0[:1] != s1[:1]:
            raise FormatError(f"layer '{layer.name}': the data and label should have the same first "
                              f"dimension, got {s0} and {s1}")
        return Shapes([()])

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        self.rule()

    def _bad(self, message: str) -> CaffeCompatError:
        return FormatError(f"layer '{self.layer_name}' ({self.caffe_type}): {message}")


def _check_class_labels(layer: str, labels: torch.Tensor, num_classes: int, valid: torch.Tensor | None) -> None:
    """A label outside [0, C) that is not the ignore_label raises DataError naming it (Caffe reads outside its
    probabilities); in the static form an assertion in the graph."""
    bad = (labels < 0) | (labels >= num_classes)
    if valid is not None:
        bad = bad & valid
    fine = ~bad.any()
    if asserted_in_graph(fine, f"layer '{layer}': a label is outside [0, {num_classes}) (and not the ignore_label)"):
        return
    if not bool(fine):
        first = labels[bad][0].item()
        raise DataError(f"layer '{layer}': label {first} is outside [0, {num_classes}) "
                        f"(and not the ignore_label)")


# --------------------------------------------------------------------------- pair / regression losses

@register_layer("ContrastiveLoss")
class ContrastiveLossLayer(_LossLayer):
    """Hadsell-Chopra-LeCun contrastive loss over bottoms ``a``, ``b`` (N×C…) and ``sim`` (N).

    ``L = 1/(2N) Σ_i [sim_i] d_i² + [¬sim_i] max(margin - d_i, 0)²`` with ``d_i = |a_i - b_i|``;
    ``legacy_version: true`` uses ``max(margin - d_i², 0)`` instead.  Defaults: margin 1, legacy false.
    Shapes, as Caffe's LayerSetUp CHECKs them through the legacy accessors: ``a`` and ``b`` are
    ``(N, C[, 1, 1])`` with the same C (a feature map with height or width above 1 is refused, not
    flattened), ``sim`` is ``(N[, 1, 1, 1])``.
    Quirks: a pair is similar when ``static_cast<int>(sim) != 0`` (2 and -1 are similar, 0.7 is not);
    the non-legacy gradient is ``-(margin - d)/(d + 1e-4) (a - b)/N`` (Caffe's epsilon, not the exact
    derivative), zero unless ``margin - d > 0`` (legacy: ``margin - d² > 0``), strictly, as Caffe's
    ``mdist > 0`` test (:func:`~caffe_compat.layers.caffe_backward.caffe_relu`).
    """

    bottoms = BlobCount.exact(3)

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        p = param.contrastive_loss_param
        self.margin, self.legacy = float(p.margin), bool(p.legacy_version)
        a, b, sim = self.bottom_shapes
        where = f"layer '{self.layer_name}' (ContrastiveLoss)"
        (_, ca, ha, wa), (_, cb, hb, wb), (_, cs, hs, ws) = (legacy_shape(s, where) for s in (a, b, sim))
        if ca != cb or (ha, wa, hb, wb) != (1, 1, 1, 1):  # Caffe's LayerSetUp CHECKs (legacy accessors)
            raise self._bad(f"bottoms a {a} and b {b} must be (N, C, 1, 1) features with the same C")
        if (cs, hs, ws) != (1, 1, 1):
            raise self._bad(f"the similarity bottom {sim} must be (N, 1, 1, 1)")
        if _count(sim) != (a[0] if a else 1):
            raise self._bad(f"the similarity bottom {sim} must hold one value per pair ({a[0]})")

    def forward(self, a, b, sim):
        n = a.shape[0]
        # Caffe subtracts the bottoms' memory element by element (caffe_sub over count): (N, C, 1) and (N, C) pair
        # up as two (N, C) tables, never broadcast against each other.  reshape(0, -1) is ambiguous: flatten.
        rows = [t.flatten(1) if t.dim() > 1 else t.unsqueeze(1) for t in (a, b)]
        diff = rows[0] - rows[1]
        similar = int_labels(sim).reshape(n) != 0
        dist_sq = (diff * diff).sum(dim=1)
        if self.legacy:
            far = caffe_relu(self.margin - dist_sq)
        else:
            d = torch.sqrt(dist_sq.detach())
            # value d, gradient (a - b)/(d + 1e-4): Caffe's backward
            dist = d + (dist_sq - dist_sq.detach()) / (2 * (d + 1e-4))
            far = caffe_relu(self.margin - dist) ** 2
        loss = torch.where(similar, dist_sq, far).sum() / n / 2
        return (loss,)


@register_layer("EuclideanLoss")
class EuclideanLoss(_LossLayer):
    """``L = 1/(2N) Σ (a - b)²`` (N = first dimension).  Both bottoms are differentiable (Caffe allows
    force_backward to the target too); the bottoms need equal counts per sample, not equal shapes.  Caffe
    takes N from the legacy ``num()`` (of each bottom, in Backward), so neither may have more than 4 axes."""

    reshape_reads_axes_after_loss_shape = True  # Reshape's bottom[0]->count(1): CHECK_LE(1, num_axes())

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        a, b = self.bottom_shapes
        if _count(a, 1) != _count(b, 1):
            raise self._bad(f"inputs must have the same dimension, got {a} and {b}")
        for shape in (a, b):
            legacy_shape(shape, f"layer '{self.layer_name}' (EuclideanLoss)")

    def forward(self, a, b):
        n = a.shape[0]
        rows = [t.flatten(1) if t.dim() > 1 else t.unsqueeze(1) for t in (a, b)]  # reshape(0, -1) is ambiguous
        diff = rows[0] - rows[1]
        return ((diff * diff).sum() / n / 2,)  # an empty batch: Caffe's 0 / 0 = NaN


# --------------------------------------------------------------------------- classification losses

class _ClassAxisLoss(_LossLayer):
    """Shared shape logic of SoftmaxWithLoss and InfogainLoss: scores with the class axis ``axis``,
    labels holding one value per outer×inner position, optional ``ignore_label``, optional prob top."""

    tops = BlobCount(0, 2)
    default_normalization = _Norm.VALID
    log_threshold = FLT_MIN
    reshape_reads_axes_after_loss_shape = True  # the inner Softmax's Reshape: CanonicalAxisIndex on 0 axes

    def _axis(self) -> int:
        raise NotImplementedError

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        scores, label = self.bottom_shapes[:2]
        self.axis = canonical_axis(self._axis(), len(scores), self.layer_name)
        self.num_classes = scores[self.axis]
        outer, inner = _count(scores, 0, self.axis), _count(scores, self.axis + 1)
        if outer * inner != _count(label):
            raise self._bad(f"number of labels must match number of predictions; e.g., if the class axis == 1 "
                            f"and prediction shape is (N, C, H, W), label count (number of labels) must be N*H*W, "
                            f"with integer values in {{0, 1, ..., C-1}}; got scores {scores}, labels {label}")
        lp = param.loss_param
        self.ignore_label = int(lp.ignore_label) if lp.HasField("ignore_label") else None
        self.normalization = normalization_mode(param, self.default_normalization)
        self.with_prob = len(param.top) >= 2

    @classmethod
    def infer(cls, layer, bottoms):
        """A scalar loss, and the probabilities (bottom 0's shape) as an optional second top."""
        super().infer(layer, bottoms)
        return Shapes([(), tuple(bottoms[0])][:max(1, len(layer.top))])

    def _class_weights(self, labels: torch.Tensor, valid: torch.Tensor, bottoms) -> torch.Tensor:
        """Per position (M, C) weights W of ``-Σ_l W_l log p_l``."""
        raise NotImplementedError

    def forward(self, scores, label, *extra):
        c = scores.shape[self.axis]
        outer, inner = _count(scores.shape, 0, self.axis), _count(scores.shape, self.axis + 1)
        # (outer, C, inner) -> (M, C) rows in Caffe's (i, j) order
        x = scores.reshape(outer, c, inner).transpose(1, 2).flatten(0, 1)  # not reshape(-1, c): ambiguous for C = 0
        labels = int_labels(label).reshape(-1)
        valid = None if self.ignore_label is None else labels != self.ignore_label
        _check_class_labels(self.layer_name, labels, c, valid)
        if valid is not None:
            labels = torch.where(valid, labels, torch.zeros_like(labels))
        log_p = clamp_keep_grad(torch.log_softmax(x, dim=1), math.log(self.log_threshold))
        weights = self._class_weights(labels, valid, extra).to(x.dtype)
        if valid is not None:
            weights = weights * valid.unsqueeze(1).to(x.dtype)
        count = valid.sum() if valid is not None else None
        # Caffe's ``loss = 0; loss -= ...``: 0 - sum, so no position (an empty batch, all ignored) is +0.0, not
        # the -0.0 of -(sum); the normaliser is at least 1
        loss = (0.0 - (weights * log_p).sum()) / get_normalizer(self.normalization, outer, inner, count)
        if not self.with_prob:
            return (loss,)
        return (loss, torch.softmax(scores.detach(), dim=self.axis))


@register_layer("SoftmaxWithLoss")
class SoftmaxWithLoss(_ClassAxisLoss):
    """Softmax over ``softmax_param.axis`` (default 1) then ``-log max(p_y, FLT_MIN)`` per position,
    summed over non-ignored positions and divided by the normaliser (default VALID; legacy ``normalize``).
    Gradient ``(p - onehot(y)) / normaliser``, zero at ignored positions (Caffe's, ignoring the clip).
    Optional second top: the probabilities (see the module docstring: not instantiable in this Caffe)."""

    param_message = "softmax_param"  # the class axis; loss_param holds the normalisation, as for every loss

    def _axis(self) -> int:
        return int(self.param.softmax_param.axis)

    def _class_weights(self, labels, valid, extra):  # one-hot; torch's one_hot refuses num_classes 0
        return labels.unsqueeze(1) == torch.arange(self.num_classes, device=labels.device)


@register_layer("InfogainLoss")
class InfogainLoss(_ClassAxisLoss):
    """This fork's InfogainLoss: raw scores, an internal softmax over ``infogain_loss_param.axis``
    (default 1), ``L = -Σ_positions Σ_l H[y, l] log max(p_l, 1e-20) / normaliser`` (default VALID,
    ``ignore_label`` honoured).  Gradient ``(p Σ_l H[y, l] - H[y, :]) / normaliser``.

    H (C×C) comes from a third bottom (never differentiated: Caffe aborts) or from the BlobProto file
    ``infogain_loss_param.source``.  Caffe opens ``source`` relative to the working directory; pass
    ``source_dir`` (e.g. the prototxt's folder) to resolve a relative path against it instead.
    """

    bottoms = BlobCount(2, 3)
    log_threshold = LOG_THRESHOLD

    def __init__(self, param, bottom_shapes, phase: str = "test", source_dir: str | os.PathLike | None = None):
        super().__init__(param, bottom_shapes, phase)
        c = self.num_classes
        if len(self.bottom_shapes) == 3:
            if _count(self.bottom_shapes[2]) != c * c:
                raise self._bad(f"the infogain bottom {self.bottom_shapes[2]} must hold {c}x{c} values")
            self.register_buffer("infogain", None, persistent=False)
        else:
            h = self._read_source(source_dir)
            if h.size != c * c:
                raise self._bad(f"infogain matrix from '{param.infogain_loss_param.source}' has shape "
                                f"{h.shape}, expected {c}x{c} for {c} classes")
            self.register_buffer("infogain", torch.from_numpy(np.ascontiguousarray(h, np.float32).reshape(c, c)),
                                 persistent=False)

    def _axis(self) -> int:
        return int(self.param.infogain_loss_param.axis)

    def _read_source(self, source_dir) -> np.ndarray:
        source = self.param.infogain_loss_param.source
        if not source:
            raise self._bad("needs infogain_loss_param.source or a third bottom with the infogain matrix H")
        path = Path(source)
        if not path.is_absolute() and source_dir is not None:
            path = Path(source_dir) / path
        from caffe_compat.io.blobs import read_blob  # io has no torch; imported lazily to keep imports cheap

        try:
            return read_blob(path)
        except CaffeCompatError as exc:
            raise type(exc)(f"layer '{self.layer_name}' (InfogainLoss) infogain source: {exc}") from None

    def _class_weights(self, labels, valid, extra):
        c = self.num_classes
        h = extra[0].detach().reshape(c, c) if extra else self.infogain
        return h.to(labels.device)[labels]


@register_layer("SigmoidCrossEntropyLoss")
class SigmoidCrossEntropyLoss(_LossLayer):
    """``L = -Σ [x (t - [x>=0]) - log(1 + exp(x - 2x[x>=0]))] / normaliser`` over non-ignored elements
    (Caffe's overflow-safe form of -t log σ(x) - (1-t) log(1-σ(x)); soft targets allowed).  An element is
    ignored when ``static_cast<int>(t) == ignore_label``.  Default normalization is BATCH_SIZE in this fork
    (outer = first dimension), legacy ``normalize: true`` means VALID.  Gradient ``(σ(x) - t)/normaliser``."""

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        x, t = self.bottom_shapes
        if _count(x) != _count(t):
            raise self._bad(f"SIGMOID_CROSS_ENTROPY_LOSS layer inputs must have the same count, got {x} and {t}")
        lp = param.loss_param
        self.ignore_label = int(lp.ignore_label) if lp.HasField("ignore_label") else None
        self.normalization = normalization_mode(param, _Norm.BATCH_SIZE)

    def forward(self, x, target):
        t = target.detach().reshape(x.shape).to(x.dtype)
        pos = (x >= 0).to(x.dtype).detach()
        elem = -(x * (t - pos) - torch.log1p(torch.exp(x - 2 * x * pos)))
        outer = x.shape[0] if x.dim() else 1
        inner = x.numel() // max(outer, 1)
        if self.ignore_label is None:
            return (elem.sum() / get_normalizer(self.normalization, outer, inner, None),)
        valid = int_labels(target).reshape(x.shape) != self.ignore_label
        loss = torch.where(valid, elem, torch.zeros_like(elem)).sum()
        return (loss / get_normalizer(self.normalization, outer, inner, valid.sum()),)


@register_layer("HingeLoss")
class HingeLoss(_LossLayer):
    """One-vs-all hinge loss: ``z_ik = max(0, 1 - x_ik)`` for k = y_i, ``max(0, 1 + x_ik)`` otherwise;
    L1 (default) ``Σ z / N``, L2 ``Σ z² / N``.  Gradient at a kink is 0 (Caffe's ``sign(0) = 0``),
    computed explicitly (:func:`~caffe_compat.layers.caffe_backward.caffe_relu`).  N is the legacy
    ``num()`` (at most 4 axes); ``y_i`` is the label blob's i-th value in memory, for i < N: Caffe checks
    only the labels' first dimension (LossLayer), so a ``(N, k)`` label blob gives its first N values."""

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        x, label = self.bottom_shapes
        legacy_shape(x, f"layer '{self.layer_name}' (HingeLoss)")
        if not x[0]:  # dim = count / num: Caffe's integer division by zero
            raise self._bad(f"an empty batch {x} divides by num() = 0")
        if _count(label) < x[0]:
            raise self._bad(f"needs one label per sample, got scores {x} and labels {label}")
        self.squared = param.hinge_loss_param.norm == caffe_pb2.HingeLossParameter.L2

    def forward(self, x, label):
        n = x.shape[0]
        if not n:  # fed an empty batch: Caffe's dim = count / num() divides by zero
            raise ShapeMismatchError(f"layer '{self.layer_name}' (HingeLoss): an empty batch {tuple(x.shape)} "
                                     f"divides by num() = 0")
        scores = x.reshape(n, -1)
        labels = int_labels(label).reshape(-1)[:n]
        _check_class_labels(self.layer_name, labels, scores.shape[1], None)
        sign = 1 - 2 * torch.nn.functional.one_hot(labels, scores.shape[1]).to(scores.dtype)
        z = caffe_relu(1 + sign * scores)  # Caffe: sign(0) = 0, no gradient at the kink
        return (((z * z) if self.squared else z).sum() / n,)


@register_layer("MultinomialLogisticLoss")
class MultinomialLogisticLoss(_LossLayer):
    """``L = -Σ_i log max(p_{i, y_i}, 1e-20) / N`` on probabilities (N×C×1×1).  A zero probability costs
    -log(1e-20) = 46.05, and Caffe's gradient ``-1 / max(p, 1e-20) / N`` stays (huge, -1e20/N) where the
    clip is active, instead of the clipped function's zero derivative.  Both bottoms go through Caffe's
    legacy accessors (``num()``; the labels' ``channels() == height() == width() == 1``): at most 4 axes.
    Forward computes ``count / num()`` in int, so an empty batch is a division by zero (a FormatError)."""

    def __init__(self, param, bottom_shapes, phase: str = "test"):
        super().__init__(param, bottom_shapes, phase)
        p, label = self.bottom_shapes
        if not legacy_shape(p, f"layer '{self.layer_name}' (MultinomialLogisticLoss)")[0]:  # num() in Forward
            raise self._bad(f"has an empty batch ({p}): Caffe's Forward divides the count by num() = 0 (an integer "
                            f"division by zero)")
        # Reshape CHECKs the labels' legacy channels(), height(), width() == 1
        if legacy_shape(label, f"layer '{self.layer_name}' (MultinomialLogisticLoss)")[1:] != (1, 1, 1):
            raise self._bad(f"needs one label per sample, got probabilities {p} and labels {label}")

    def forward(self, prob, label):
        n = prob.shape[0]
        if not n:  # fed an empty batch: Caffe's dim = count / num() divides by zero
            raise ShapeMismatchError(f"layer '{self.layer_name}' (MultinomialLogisticLoss): an empty batch "
                                     f"{tuple(prob.shape)} divides by num() = 0")
        p = prob.reshape(n, -1)
        labels = int_labels(label).reshape(n, 1)
        _check_class_labels(self.layer_name, labels, p.shape[1], None)
        picked = clamp_keep_grad(p.gather(1, labels), LOG_THRESHOLD)
        return (-torch.log(picked).sum() / n,)

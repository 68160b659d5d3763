"""Caffe's update rules as ``torch.optim.Optimizer`` subclasses (``SGDSolver::ApplyUpdate`` and family).

One ``step()`` is Caffe's ``ApplyUpdate`` after the diffs (``p.grad``) were accumulated:

1. ``ClipGradients`` (when ``clip_gradients >= 0``): the L2 norm over **all** parameters of the raw,
   accumulated diffs (not yet divided by ``iter_size``, no weight decay); above the threshold every
   diff is multiplied by ``clip_gradients / norm``.
2. per parameter, in Caffe's order: ``Normalize`` (diff × float(1/iter_size) when iter_size > 1),
   ``Regularize`` (L2: ``diff += decay·w``; L1: ``diff += decay·sign(w)``; ``decay = weight_decay ·
   decay_mult``; another ``regularization_type`` is an error only where some blob's decay is not 0, as
   Caffe's LOG(FATAL) sits inside ``if (local_decay)``; it is raised before anything is changed),
   ``ComputeUpdateValue`` with ``local_rate = rate · lr_mult`` (the rules below), then
   ``Net::Update``: ``w -= diff``.  As in Caffe, the diff (``p.grad``) holds the update value afterwards.

``lr_mult``/``decay_mult`` are read from attributes of the tensors (CaffeNet sets them), default 1.
Tensors without a gradient (lr_mult 0, BatchNorm statistics) count with a zero diff: their history
evolves as in Caffe (weight decay still feeds it) but, with ``local_rate = 0``, their values do not
change.  The group's ``lr`` is the rate from the lr policy (:mod:`caffe_compat.solver.lr_policy`).

History blobs (the ``.solverstate`` ``history`` field) are ``history_blobs()``: Caffe's layout, set by
set: one blob per parameter for SGD/Nesterov/AdaGrad/RMSProp, then for AdaDelta/Adam a second set
(AdaDelta: E[g²] then E[Δx²]; Adam: m then v).  All arithmetic is float32 like Caffe's (hyper-
parameters rounded to float32, ``local_rate`` a float32 product).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from caffe_compat.errors import FormatError

__all__ = ["AdaDelta", "AdaGrad", "Adam", "CaffeOptimizer", "Nesterov", "RMSProp", "SGD", "UPDATE_RULES",
           "make_optimizer"]


def _f32(value) -> float:
    return float(np.float32(value))


class CaffeOptimizer(torch.optim.Optimizer):
    """Base: clipping, iter_size normalisation, regularisation, history layout (see module docstring).

    ``params``: tensors in Caffe's ``learnable_params`` order (or param groups).  Options (per group):
    ``lr`` (the policy's rate), ``weight_decay``, ``regularization_type`` ("L2"/"L1"), plus the rule's
    own hyper-parameters.  Global options: ``iter_size``, ``clip_gradients`` (< 0: off).  ``iter`` is
    Caffe's ``iter_`` (updates applied so far; Adam's t = iter + 1); ``step()`` increments it.
    ``last_clip`` is ``(l2norm, scale)`` when the last step clipped, else None.
    """

    caffe_type = ""
    history_sets = 1

    def __init__(self, params, lr: float = 0.01, weight_decay: float = 0.0, regularization_type: str = "L2",
                 iter_size: int = 1, clip_gradients: float = -1.0, **hyper):
        if int(iter_size) < 1:
            raise FormatError(f"iter_size must be >= 1, got {iter_size}")
        defaults = dict(lr=lr, weight_decay=weight_decay, regularization_type=regularization_type, **hyper)
        super().__init__(params, defaults)
        self.iter_size = int(iter_size)
        self.clip_gradients = float(clip_gradients)
        self.iter = 0
        self.last_clip: tuple[float, float] | None = None
        for group in self.param_groups:
            self.check_group(group)

    # ----------------------------------------------------------------------------- rule interface

    def check_group(self, group: dict) -> None:
        """Raise FormatError where Caffe's solver constructor CHECKs fail."""

    def update_value(self, p: torch.Tensor, diff: torch.Tensor, history: list[torch.Tensor], local_rate: float,
                     group: dict) -> torch.Tensor:
        """Caffe's ``ComputeUpdateValue``: the value to subtract from ``p`` (may be ``diff`` itself)."""
        raise NotImplementedError

    # ----------------------------------------------------------------------------- history

    @property
    def params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def _history(self, p: torch.Tensor) -> list[torch.Tensor]:
        state = self.state[p]
        if "history" not in state:
            state["history"] = [torch.zeros_like(p, memory_format=torch.contiguous_format)
                                for _ in range(self.history_sets)]
        return state["history"]

    def history_blobs(self) -> list[torch.Tensor]:
        """The history tensors in the ``.solverstate`` order (set-major: all params of set 0, then set 1)."""
        params = self.params
        return [self._history(p)[k] for k in range(self.history_sets) for p in params]

    @torch.no_grad()
    def set_history(self, blobs) -> None:
        """Load history arrays/tensors in ``history_blobs()`` order (e.g. from a Caffe ``.solverstate``)."""
        blobs = list(blobs)
        params = self.params
        if len(blobs) != self.history_sets * len(params):
            raise FormatError(f"{self.caffe_type} solver state: expected {self.history_sets * len(params)} history "
                              f"blobs ({self.history_sets} per learnable blob, {len(params)} blobs), got {len(blobs)}")
        for n, value in enumerate(blobs):
            k, i = divmod(n, len(params))
            target = self._history(params[i])[k]
            value = torch.as_tensor(np.asarray(value) if not torch.is_tensor(value) else value)
            if value.numel() != target.numel():
                raise FormatError(f"{self.caffe_type} solver state: history blob {n} has {value.numel()} values, "
                                  f"the parameter it belongs to has shape {tuple(target.shape)}")
            target.copy_(value.reshape(target.shape).to(target.dtype))

    # ----------------------------------------------------------------------------- Caffe's ApplyUpdate

    @torch.no_grad()
    def clip(self, diffs: list[torch.Tensor]) -> None:
        """Caffe's ``ClipGradients`` on the accumulated diffs (in place)."""
        self.last_clip = None
        if self.clip_gradients < 0 or not diffs:
            return
        sumsq = torch.stack([d.float().pow(2).sum() for d in diffs]).sum()
        norm = _f32(math.sqrt(float(sumsq)))
        if norm > self.clip_gradients:
            scale = _f32(np.float32(self.clip_gradients) / np.float32(norm))
            for d in diffs:
                d.mul_(scale)
            self.last_clip = (norm, scale)

    @staticmethod
    def _decay(group: dict, p: torch.Tensor) -> float:
        """Caffe's ``local_decay``: ``weight_decay · decay_mult`` as a float product."""
        return _f32(np.float32(group["weight_decay"]) * np.float32(getattr(p, "decay_mult", 1.0)))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        entries = []
        for group in self.param_groups:
            for p in group["params"]:
                diff = p.grad if p.grad is not None else torch.zeros_like(p)
                entries.append((group, p, diff))
        for group, p, _ in entries:  # Caffe's Regularize: LOG(FATAL) only for a blob whose decay is not 0
            if group["regularization_type"] not in ("L2", "L1") and self._decay(group, p):
                raise FormatError(f"Unknown regularization type: {group['regularization_type']!r} (Caffe knows L2 "
                                  f"and L1)")
        self.clip([d for _, _, d in entries])
        normalizer = _f32(np.float32(1.0) / np.float32(self.iter_size))
        for group, p, diff in entries:
            if self.iter_size > 1:
                diff.mul_(normalizer)
            decay = self._decay(group, p)
            if decay:
                if group["regularization_type"] == "L2":
                    diff.add_(p, alpha=decay)
                else:
                    diff.add_(torch.sign(p), alpha=decay)
            lr_mult = float(getattr(p, "lr_mult", 1.0))
            local_rate = _f32(np.float32(group["lr"]) * np.float32(lr_mult))
            value = self.update_value(p, diff, self._history(p), local_rate, group)
            if value is not diff:
                diff.copy_(value)
            if lr_mult != 0.0:
                p.sub_(diff)
        self.iter += 1
        return loss


class SGD(CaffeOptimizer):
    """Caffe SGD: ``h ← momentum·h + local_rate·diff``; ``w ← w − h`` (the rate lives in the history, so a
    rate change does not rescale the momentum already accumulated, unlike ``torch.optim.SGD``)."""

    caffe_type = "SGD"

    def __init__(self, params, lr: float = 0.01, momentum: float = 0.0, **kwargs):
        super().__init__(params, lr=lr, momentum=momentum, **kwargs)

    def update_value(self, p, diff, history, local_rate, group):
        h = history[0]
        h.mul_(_f32(group["momentum"])).add_(diff, alpha=local_rate)
        return h


class Nesterov(CaffeOptimizer):
    """Caffe Nesterov: ``h' ← momentum·h + local_rate·diff``; update ``(1+momentum)·h' − momentum·h``."""

    caffe_type = "Nesterov"

    def __init__(self, params, lr: float = 0.01, momentum: float = 0.0, **kwargs):
        super().__init__(params, lr=lr, momentum=momentum, **kwargs)

    def update_value(self, p, diff, history, local_rate, group):
        m = _f32(group["momentum"])
        h = history[0]
        previous = h.clone()
        h.mul_(m).add_(diff, alpha=local_rate)
        return previous.mul_(-m).add_(h, alpha=_f32(np.float32(1.0) + np.float32(m)))


class AdaGrad(CaffeOptimizer):
    """Caffe AdaGrad: ``h ← h + diff²``; update ``local_rate · diff / (sqrt(h) + delta)``.  Caffe refuses
    a non-zero momentum."""

    caffe_type = "AdaGrad"

    def __init__(self, params, lr: float = 0.01, delta: float = 1e-8, momentum: float = 0.0, **kwargs):
        super().__init__(params, lr=lr, delta=delta, momentum=momentum, **kwargs)

    def check_group(self, group):
        if group["momentum"] != 0:
            raise FormatError("Momentum cannot be used with AdaGrad (Caffe requires momentum 0)")

    def update_value(self, p, diff, history, local_rate, group):
        h = history[0]
        h.add_(diff * diff)
        return diff / (h.sqrt() + _f32(group["delta"])) * local_rate


class RMSProp(CaffeOptimizer):
    """Caffe RMSProp: ``h ← (1−rms_decay)·diff² + rms_decay·h``; update ``local_rate · diff / (sqrt(h) +
    delta)``.  Momentum must be 0 and 0 <= rms_decay < 1 (Caffe's CHECK_EQ, CHECK_GE and CHECK_LT)."""

    caffe_type = "RMSProp"

    def __init__(self, params, lr: float = 0.01, rms_decay: float = 0.99, delta: float = 1e-8,
                 momentum: float = 0.0, **kwargs):
        super().__init__(params, lr=lr, rms_decay=rms_decay, delta=delta, momentum=momentum, **kwargs)

    def check_group(self, group):
        if group["momentum"] != 0:
            raise FormatError("Momentum cannot be used with RMSProp (Caffe requires momentum 0)")
        if not 0.0 <= group["rms_decay"] < 1.0:
            raise FormatError(f"rms_decay must lie in [0, 1) (Caffe: 'rms_decay should lie between 0 and 1.'), got "
                              f"{group['rms_decay']}")

    def update_value(self, p, diff, history, local_rate, group):
        decay = np.float32(group["rms_decay"])
        h = history[0]
        h.mul_(_f32(decay)).add_(diff * diff, alpha=_f32(np.float32(1.0) - decay))
        return diff / (h.sqrt() + _f32(group["delta"])) * local_rate


class AdaDelta(CaffeOptimizer):
    """Caffe AdaDelta (momentum = ρ): ``g2 ← (1−ρ)·diff² + ρ·g2``; ``u = diff · sqrt((x2 + δ)/(g2 + δ))``;
    ``x2 ← (1−ρ)·u² + ρ·x2``; update ``local_rate · u``.  History: all g2, then all x2."""

    caffe_type = "AdaDelta"
    history_sets = 2

    def __init__(self, params, lr: float = 1.0, momentum: float = 0.95, delta: float = 1e-8, **kwargs):
        super().__init__(params, lr=lr, momentum=momentum, delta=delta, **kwargs)

    def update_value(self, p, diff, history, local_rate, group):
        rho = np.float32(group["momentum"])
        delta = _f32(group["delta"])
        g2, x2 = history
        one_minus = _f32(np.float32(1.0) - rho)
        g2.mul_(_f32(rho)).add_(diff * diff, alpha=one_minus)
        u = diff * ((x2 + delta) / (g2 + delta)).sqrt()
        x2.mul_(_f32(rho)).add_(u * u, alpha=one_minus)
        return u.mul_(local_rate)


class Adam(CaffeOptimizer):
    """Caffe Adam (momentum = β1, momentum2 = β2, delta = ε): ``m ← β1·m + (1−β1)·diff``;
    ``v ← β2·v + (1−β2)·diff²``; update ``local_rate · c · m / (sqrt(v) + ε)`` with the bias correction
    ``c = sqrt(1 − β2^t) / (1 − β1^t)``, t = iter + 1 (Caffe folds the correction into the rate and adds
    ε to the *uncorrected* sqrt(v)).  History: all m, then all v."""

    caffe_type = "Adam"
    history_sets = 2

    def __init__(self, params, lr: float = 0.001, momentum: float = 0.9, momentum2: float = 0.999,
                 delta: float = 1e-8, **kwargs):
        super().__init__(params, lr=lr, momentum=momentum, momentum2=momentum2, delta=delta, **kwargs)

    def update_value(self, p, diff, history, local_rate, group):
        beta1, beta2 = np.float32(group["momentum"]), np.float32(group["momentum2"])
        t = self.iter + 1
        correction = _f32(math.sqrt(1.0 - math.pow(float(beta2), t)) / (1.0 - math.pow(float(beta1), t)))
        m, v = history
        m.mul_(_f32(beta1)).add_(diff, alpha=_f32(np.float32(1.0) - beta1))
        v.mul_(_f32(beta2)).add_(diff * diff, alpha=_f32(np.float32(1.0) - beta2))
        scale = _f32(np.float32(local_rate) * np.float32(correction))
        return m / (v.sqrt() + _f32(group["delta"])) * scale


UPDATE_RULES = {cls.caffe_type: cls for cls in (SGD, Nesterov, AdaGrad, RMSProp, AdaDelta, Adam)}


def make_optimizer(param, params) -> CaffeOptimizer:
    """The update rule named by SolverParameter ``param.type`` over ``params`` (Caffe order), configured
    with the solver's momentum/momentum2/delta/rms_decay, weight_decay, regularization_type, iter_size and
    clip_gradients.  The rate starts at ``base_lr``; the Solver sets it from the lr policy each step."""
    kind = param.type or "SGD"
    cls = UPDATE_RULES.get(kind)
    if cls is None:
        raise FormatError(f"unknown solver type {kind!r}; Caffe knows {', '.join(UPDATE_RULES)}")
    common = dict(lr=_f32(param.base_lr), weight_decay=_f32(param.weight_decay),
                  regularization_type=param.regularization_type, iter_size=param.iter_size,
                  clip_gradients=_f32(param.clip_gradients))
    if cls in (SGD, Nesterov):
        extra = dict(momentum=_f32(param.momentum))
    elif cls is AdaGrad:
        extra = dict(delta=_f32(param.delta), momentum=_f32(param.momentum))
    elif cls is RMSProp:
        extra = dict(rms_decay=_f32(param.rms_decay), delta=_f32(param.delta), momentum=_f32(param.momentum))
    elif cls is AdaDelta:
        extra = dict(momentum=_f32(param.momentum), delta=_f32(param.delta))
    else:
        extra = dict(momentum=_f32(param.momentum), momentum2=_f32(param.momentum2), delta=_f32(param.delta))
    params = list(params)  # a net without learnable blobs trains in Caffe (ApplyUpdate updates nothing)
    return cls(params if params else [{"params": []}], **common, **extra)

"""Caffe's learning-rate policies (``SGDSolver::GetLearningRate``), evaluated at Caffe's ``iter_``.

With ``it`` the iteration count *before* the update's increment (``iter_`` when ``ApplyUpdate`` runs):

=========  ===================================================================================
fixed      ``base_lr``
step       ``base_lr · gamma ^ floor(it / stepsize)``; ``current_step = floor(it / stepsize)``
exp        ``base_lr · gamma ^ it``
inv        ``base_lr · (1 + gamma · it) ^ (-power)``
multistep  ``base_lr · gamma ^ current_step``; **one** ``current_step += 1`` per call while
           ``it >= stepvalue[current_step]`` holds (an ``if``, not a ``while``, as in Caffe)
poly       ``base_lr · (1 - it / max_iter) ^ power``
sigmoid    ``base_lr / (1 + exp(-gamma · (it - stepsize)))``
=========  ===================================================================================

Arithmetic: Caffe stores ``base_lr``, ``gamma`` and ``power`` as protobuf ``float``; ``pow``/``exp`` run
in double and the result is stored in a float ``Dtype rate``.  We do the same: float32 inputs, double
arithmetic, float32 result.  Caffe's CHECKs: ``step`` and ``sigmoid`` need ``stepsize > 0``, every
policy but ``fixed`` and ``poly`` needs ``gamma >= 0``.  ``current_step`` is the state Caffe keeps in the
``.solverstate`` (only ``step`` and ``multistep`` change it); when ``multistep`` advances it, Caffe logs
``MultiStep Status: Iteration <it>, step = <current_step>``.
"""

from __future__ import annotations

import logging
import math

import numpy as np

from caffe_compat.errors import FormatError

__all__ = ["POLICIES", "learning_rate"]

log = logging.getLogger("caffe_compat.solver")

POLICIES = ("fixed", "step", "exp", "inv", "multistep", "poly", "sigmoid")


def _f32(value) -> float:
    return float(np.float32(value))


def learning_rate(param, it: int, current_step: int = 0) -> tuple[float, int]:
    """``(rate, current_step)`` for SolverParameter ``param`` at iteration ``it`` (Caffe's ``iter_``).

    ``current_step`` is the value before the call (0 for a fresh solver; the restored one after a
    resume); the returned one is what Caffe keeps afterwards.  An unknown policy or an invalid setting
    raises :class:`~caffe_compat.errors.FormatError` where Caffe's CHECKs abort.
    """
    policy = param.lr_policy or ""
    base_lr = _f32(param.base_lr)
    gamma = _f32(param.gamma)
    power = _f32(param.power)
    it = int(it)
    if policy == "fixed":
        rate = base_lr
    elif policy == "step":
        if param.stepsize <= 0:
            raise FormatError(f"lr_policy 'step' needs stepsize > 0, got {param.stepsize}")
        _require_gamma(gamma, policy)
        current_step = it // int(param.stepsize)
        rate = base_lr * math.pow(gamma, current_step)
    elif policy == "exp":
        _require_gamma(gamma, policy)
        rate = base_lr * math.pow(gamma, it)
    elif policy == "inv":
        _require_gamma(gamma, policy)
        rate = base_lr * math.pow(_f32(1.0 + _f32(gamma * it)), -power)
    elif policy == "multistep":
        steps = list(param.stepvalue)
        if current_step < len(steps) and it >= steps[current_step]:
            current_step += 1
            log.info("MultiStep Status: Iteration %d, step = %d", it, current_step)
        _require_gamma(gamma, policy)
        rate = base_lr * math.pow(gamma, current_step)
    elif policy == "poly":
        if param.max_iter <= 0:
            raise FormatError(f"lr_policy 'poly' needs max_iter > 0, got {param.max_iter}")
        rate = base_lr * math.pow(_f32(1.0 - _f32(_f32(it) / _f32(param.max_iter))), power)
    elif policy == "sigmoid":
        _require_gamma(gamma, policy)
        if param.stepsize <= 0:
            raise FormatError(f"lr_policy 'sigmoid' needs stepsize > 0, got {param.stepsize}")
        rate = base_lr * (1.0 / (1.0 + math.exp(-gamma * (_f32(it) - _f32(param.stepsize)))))
    else:
        raise FormatError(f"unknown lr_policy {policy!r}; Caffe knows {', '.join(POLICIES)}")
    return _f32(rate), int(current_step)


def _require_gamma(gamma: float, policy: str) -> None:
    if gamma < 0:
        raise FormatError(f"lr_policy {policy!r} needs gamma >= 0, got {gamma}")

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

Arithmetic, as Caffe's ``float`` build computes it (the ``pow``/``exp`` Caffe calls are the C++ overloads,
since ``mkl_alternate.hpp`` includes ``<math.h>``, which brings ``std::pow``/``std::exp`` into the global
namespace):

* ``step``, ``exp``, ``multistep``: ``pow(float gamma, int n)`` is the double ``pow``; ``base_lr · that``
  in double, rounded once to the float ``rate``;
* ``inv``, ``poly``: the base (``1 + gamma·it``, ``1 - it/max_iter``) is float arithmetic and
  ``pow(float, float)`` is ``powf``: a float result, then a float product with ``base_lr``;
* ``sigmoid``: ``-gamma·(it - stepsize)`` in float, ``expf``, then ``1 + e``, ``1/…`` and ``base_lr·…``
  each rounded to float.

``powf``/``expf`` are the C library's (glibc's, as in the Linux builds; through ctypes), else the double
function rounded to float (which differs in about 1 case in 1,500).  As in C, an overflow is ``inf``
(``sigmoid`` far before ``stepsize``: ``expf`` overflows and the rate is 0) and ``poly`` past ``max_iter``
with a non-integer ``power`` is NaN, never a Python exception.

Caffe's CHECKs: ``step`` and ``sigmoid`` need ``stepsize > 0``, every policy but ``fixed`` and ``poly``
needs ``gamma >= 0`` (``poly`` with ``max_iter <= 0``, a NaN rate in Caffe, is refused here too).
``current_step`` is the state Caffe keeps in the ``.solverstate`` (only ``step`` and ``multistep`` change
it); when ``multistep`` advances it, Caffe logs ``MultiStep Status: Iteration <it>, step = <current_step>``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

import numpy as np

from caffe_compat.errors import FormatError

__all__ = ["POLICIES", "learning_rate"]

log = logging.getLogger("caffe_compat.solver")

POLICIES = ("fixed", "step", "exp", "inv", "multistep", "poly", "sigmoid")


def _f32(value) -> float:
    with np.errstate(over="ignore"):
        return float(np.float32(value))


def _pow(x: float, y: float) -> float:
    """C's double ``pow`` (NaN/inf where ``math.pow`` raises)."""
    with np.errstate(all="ignore"):
        return float(np.power(np.float64(x), np.float64(y)))


def _libm_float_functions():
    """The C library's ``powf`` and ``expf``, else None."""
    try:
        libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
        powf, expf = libm.powf, libm.expf
    except (OSError, AttributeError):
        return None
    powf.argtypes, powf.restype = [ctypes.c_float, ctypes.c_float], ctypes.c_float
    expf.argtypes, expf.restype = [ctypes.c_float], ctypes.c_float
    return powf, expf


_LIBM = _libm_float_functions()


def _powf(x: float, y: float) -> float:
    """``powf``: C's float ``pow``."""
    return float(_LIBM[0](x, y)) if _LIBM else _f32(_pow(x, y))


def _expf(x: float) -> float:
    """``expf``: C's float ``exp`` (inf on overflow)."""
    if _LIBM:
        return float(_LIBM[1](x))
    with np.errstate(all="ignore"):
        return _f32(np.exp(np.float64(x)))


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
        rate = base_lr * _pow(gamma, current_step)
    elif policy == "exp":
        _require_gamma(gamma, policy)
        rate = base_lr * _pow(gamma, it)
    elif policy == "inv":
        _require_gamma(gamma, policy)
        rate = base_lr * _powf(_f32(1.0 + _f32(gamma * _f32(it))), -power)
    elif policy == "multistep":
        steps = list(param.stepvalue)
        if current_step < len(steps) and it >= steps[current_step]:
            current_step += 1
            log.info("MultiStep Status: Iteration %d, step = %d", it, current_step)
        _require_gamma(gamma, policy)
        rate = base_lr * _pow(gamma, current_step)
    elif policy == "poly":
        if param.max_iter <= 0:
            raise FormatError(f"lr_policy 'poly' needs max_iter > 0, got {param.max_iter}")
        rate = base_lr * _powf(_f32(1.0 - _f32(_f32(it) / _f32(param.max_iter))), power)
    elif policy == "sigmoid":
        _require_gamma(gamma, policy)
        if param.stepsize <= 0:
            raise FormatError(f"lr_policy 'sigmoid' needs stepsize > 0, got {param.stepsize}")
        rate = base_lr * _f32(1.0 / _f32(1.0 + _expf(_f32(-gamma * _f32(_f32(it) - _f32(param.stepsize))))))
    else:
        raise FormatError(f"unknown lr_policy {policy!r}; Caffe knows {', '.join(POLICIES)}")
    return _f32(rate), int(current_step)


def _require_gamma(gamma: float, policy: str) -> None:
    if gamma < 0:
        raise FormatError(f"lr_policy {policy!r} needs gamma >= 0, got {gamma}")

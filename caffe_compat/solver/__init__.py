"""Caffe's solvers in PyTorch: lr policies, update rules, the Solver (step/solve/snapshot/restore), a
training loop and DDP helpers.

pycaffe names: ``get_solver(path)`` builds the solver named by the file's ``type``; ``SGDSolver(path)``,
``NesterovSolver``, ``AdaGradSolver``, ``RMSPropSolver``, ``AdaDeltaSolver``, ``AdamSolver`` force their
rule whatever the file says (as pycaffe's classes do).
"""

from __future__ import annotations

from caffe_compat.solver.lr_policy import POLICIES, learning_rate
from caffe_compat.solver.observers import SolverObserver
from caffe_compat.solver.solver import Solver, learnable_blobs
from caffe_compat.solver.updates import (UPDATE_RULES, AdaDelta, AdaGrad, Adam, CaffeOptimizer, Nesterov, RMSProp,
                                         SGD, make_optimizer)


def get_solver(solver, weights=None, device=None) -> Solver:
    """pycaffe's ``caffe.get_solver``: the solver of the file's ``type``."""
    return Solver(solver, weights=weights, device=device)


def _forced(kind: str):
    def make(solver, weights=None, device=None) -> Solver:
        return Solver(solver, weights=weights, device=device, solver_type=kind)

    make.__name__ = f"{kind}Solver"
    make.__doc__ = f"pycaffe's ``caffe.{kind}Solver(path)``: a Solver using Caffe's {kind} rule."
    return make


SGDSolver = _forced("SGD")
NesterovSolver = _forced("Nesterov")
AdaGradSolver = _forced("AdaGrad")
RMSPropSolver = _forced("RMSProp")
AdaDeltaSolver = _forced("AdaDelta")
AdamSolver = _forced("Adam")

__all__ = ["POLICIES", "UPDATE_RULES", "AdaDelta", "AdaDeltaSolver", "AdaGrad", "AdaGradSolver", "Adam", "AdamSolver",
           "CaffeOptimizer", "Nesterov", "NesterovSolver", "RMSProp", "RMSPropSolver", "SGD", "SGDSolver", "Solver",
           "SolverObserver", "get_solver", "learnable_blobs", "learning_rate", "make_optimizer"]

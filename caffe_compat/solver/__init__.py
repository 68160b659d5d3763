"""Caffe's solvers in PyTorch: lr policies, update rules, the Solver (step/solve/snapshot/restore), a
training loop and DDP helpers.

``Solver(path)`` runs the rule named by the file's ``type``; ``Solver(path, solver_type="Adam")`` forces
one.  pycaffe's names for these (``get_solver``, ``SGDSolver``, ``NesterovSolver``, ``AdaGradSolver``,
``RMSPropSolver``, ``AdaDeltaSolver``, ``AdamSolver``, whose nets answer pycaffe's ``Net`` names) are the
facade's: :mod:`caffe_compat.pycaffe` (also ``caffe_compat.SGDSolver`` etc.).
"""

from __future__ import annotations

from caffe_compat.solver.lr_policy import POLICIES, learning_rate
from caffe_compat.solver.observers import SolverObserver
from caffe_compat.solver.solver import Solver, learnable_blobs, zero_inputs
from caffe_compat.solver.updates import (UPDATE_RULES, AdaDelta, AdaGrad, Adam, CaffeOptimizer, Nesterov, RMSProp,
                                         SGD, make_optimizer)

__all__ = ["POLICIES", "UPDATE_RULES", "AdaDelta", "AdaGrad", "Adam", "CaffeOptimizer", "Nesterov", "RMSProp", "SGD",
           "Solver", "SolverObserver", "learnable_blobs", "learning_rate", "make_optimizer", "zero_inputs"]

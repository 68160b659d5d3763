"""caffe-compat: Caffe's files, layers, losses and solvers, faithful in numbers, on PyTorch and ONNX.

The file readers need no deep-learning stack: ``read_net``, ``read_solver``, ``read_blob``,
``read_solverstate``, ``write_net``, ``write_blob`` come from :mod:`caffe_compat.io`.  The torch side
(``load_net``, the pycaffe-compatible ``Net``, solvers) is imported on first use.

``caffe_compat.install_alias()`` makes ``import caffe`` (and ``caffe.io``, ``caffe.proto``, ...) resolve to
caffe_compat for unchanged pycaffe scripts (:mod:`caffe_compat.alias`; ``caffe-compat run SCRIPT.py`` does it
for a script).  It is never installed by default.
"""

from __future__ import annotations

import importlib

from caffe_compat.alias import install_alias, uninstall_alias
from caffe_compat.io import read_blob, read_net, read_solver, read_solverstate, read_weights, write_blob, write_net

__version__ = "0.1.0"

# name -> module providing it, imported lazily so that `import caffe_compat` needs no torch.
_LAZY = {
    "load_net": "caffe_compat.net",
    "compile_net": "caffe_compat.net",
    "CaffeNet": "caffe_compat.net",
    "load_checkpoint": "caffe_compat.checkpoint",
    "save_checkpoint": "caffe_compat.checkpoint",
    "Solver": "caffe_compat.solver",
    "get_solver": "caffe_compat.pycaffe",
    "get_solver_from_file": "caffe_compat.pycaffe",
    "SolverParameter": "caffe_compat.pycaffe",
    "NetParameter": "caffe_compat.pycaffe",
    "NetState": "caffe_compat.pycaffe",
    "SGDSolver": "caffe_compat.pycaffe",
    "NesterovSolver": "caffe_compat.pycaffe",
    "AdaGradSolver": "caffe_compat.pycaffe",
    "RMSPropSolver": "caffe_compat.pycaffe",
    "AdaDeltaSolver": "caffe_compat.pycaffe",
    "AdamSolver": "caffe_compat.pycaffe",
    "Net": "caffe_compat.pycaffe",
    "TRAIN": "caffe_compat.pycaffe",
    "TEST": "caffe_compat.pycaffe",
    "set_mode_cpu": "caffe_compat.pycaffe",
    "set_mode_gpu": "caffe_compat.pycaffe",
    "set_device": "caffe_compat.pycaffe",
    "set_random_seed": "caffe_compat.pycaffe",
    "Layer": "caffe_compat.pycaffe",
    "NetSpec": "caffe_compat.pycaffe",
    "params": "caffe_compat.pycaffe",  # caffe.layers is caffe_compat.pycaffe.layers (caffe_compat.layers: the ports)
    "to_proto": "caffe_compat.pycaffe",
    "coord_map": "caffe_compat.pycaffe",
    "Classifier": "caffe_compat.pycaffe",
    "Detector": "caffe_compat.pycaffe",
    "register_python_layer": "caffe_compat.layers.python_user",
    "allow_python_imports": "caffe_compat.layers.python_user",
    "disallow_python_imports": "caffe_compat.layers.python_user",
    "layer_type_list": "caffe_compat.pycaffe",
    "has_nccl": "caffe_compat.pycaffe",
    "NCCL": "caffe_compat.pycaffe",
    "solver_count": "caffe_compat.pycaffe",
    "solver_rank": "caffe_compat.pycaffe",
    "set_solver_count": "caffe_compat.pycaffe",
    "set_solver_rank": "caffe_compat.pycaffe",
    "set_multiprocess": "caffe_compat.pycaffe",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'caffe_compat' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = ["install_alias", "uninstall_alias", "read_blob", "read_net", "read_solver", "read_solverstate",
           "read_weights", "write_blob", "write_net", *_LAZY]

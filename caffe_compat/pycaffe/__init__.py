"""The pycaffe-compatible facade: ``import caffe_compat as caffe`` runs old pycaffe scripts on the core
(:class:`~caffe_compat.net.CaffeNet`, :class:`~caffe_compat.solver.Solver`), which never imports this
package.

::

    import caffe_compat as caffe
    caffe.set_mode_gpu(); caffe.set_device(0)
    net = caffe.Net("deploy.prototxt", "weights.caffemodel", caffe.TEST)
    net.blobs["data"].data[...] = transformer.preprocess("data", image)
    prob = net.forward()["prob"]
    solver = caffe.SGDSolver("solver.prototxt"); solver.net.copy_from("init.caffemodel"); solver.step(1)

pycaffe's surface, one module per concern (each docstring says what it reproduces and what not):

* :mod:`~caffe_compat.pycaffe._mode`: ``TRAIN``, ``TEST``, ``set_mode_cpu``, ``set_mode_gpu``,
  ``set_device``, ``set_random_seed`` (process-wide, read when a net is built).
* :mod:`~caffe_compat.pycaffe.blob`: ``Blob`` and ``ParamBlob``, numpy ``data``/``diff`` over torch
  tensors, with Caffe's host/device synchronisation on CUDA.
* :mod:`~caffe_compat.pycaffe.net`: ``caffe.Net`` (blobs, params, forward/backward with Caffe's diff
  rules, reshape, copy_from, save, set_input_arrays).
* :mod:`~caffe_compat.pycaffe.layer`: ``caffe.Layer``, the Python-layer base class, and ``net.layers[i]``.
* :mod:`~caffe_compat.pycaffe.solver`: ``get_solver``, ``SGDSolver`` ... ``AdamSolver``, whose
  ``solver.net`` / ``solver.test_nets`` answer pycaffe's ``Net`` names (``SolverNet``).
* :mod:`~caffe_compat.pycaffe.net_spec`: ``NetSpec``, ``layers``, ``params``, ``to_proto``;
  :mod:`~caffe_compat.pycaffe.coord_map`: ``coord_map_from_to``, ``crop``.
* :mod:`~caffe_compat.pycaffe.classifier` / :mod:`~caffe_compat.pycaffe.detector`: ``Classifier``,
  ``Detector``.
* User Python layers: ``register_python_layer``, ``allow_python_imports``
  (:mod:`caffe_compat.layers.python_user`).

This package holds pycaffe's names; ``caffe_compat`` re-exports them at the top level, where ``caffe.io``
and ``caffe.draw`` are :mod:`caffe_compat.io` and :mod:`caffe_compat.draw`.
"""

from __future__ import annotations

from caffe_compat.pycaffe._mode import (_MODE, TEST, TRAIN, current_device, set_device, set_mode_cpu,  # noqa: F401
                                        set_mode_gpu, set_random_seed)
from caffe_compat.pycaffe.blob import Blob, ParamBlob
from caffe_compat.pycaffe.layer import Layer
from caffe_compat.pycaffe.net import Net
from caffe_compat.layers.python_user import allow_python_imports, register_python_layer
from caffe_compat.pycaffe import coord_map  # noqa: F401  (caffe.coord_map)
from caffe_compat.pycaffe.classifier import Classifier
from caffe_compat.pycaffe.detector import Detector
from caffe_compat.pycaffe.net_spec import NetSpec, layers, params, to_proto
from caffe_compat.pycaffe.solver import (AdaDeltaSolver, AdaGradSolver, AdamSolver, NesterovSolver, PycaffeSolver,
                                         RMSPropSolver, SGDSolver, SolverNet, get_solver)

__all__ = ["TRAIN", "TEST", "Net", "Blob", "ParamBlob", "Layer", "SolverNet", "PycaffeSolver", "get_solver",
           "SGDSolver", "NesterovSolver", "AdaGradSolver", "RMSPropSolver", "AdaDeltaSolver", "AdamSolver",
           "set_mode_cpu", "set_mode_gpu", "set_device", "set_random_seed", "NetSpec", "layers", "params", "to_proto",
           "coord_map", "Classifier", "Detector", "register_python_layer", "allow_python_imports"]

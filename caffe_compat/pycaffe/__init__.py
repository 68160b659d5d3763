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
* :mod:`~caffe_compat.pycaffe.net`: ``caffe.Net`` (blobs, params, layers, forward/backward and their
  ranges with Caffe's diff rules, reshape); its weights (:mod:`~caffe_compat.pycaffe.net_params`:
  copy_from, save, save_hdf5/load_hdf5, share_with, clear_param_diffs, set_input_arrays), batches
  (:mod:`~caffe_compat.pycaffe.net_batch`) and backward ranges (:mod:`~caffe_compat.pycaffe.net_backward`).
* :mod:`~caffe_compat.pycaffe.layer`: ``caffe.Layer``, the Python-layer base class, and ``net.layers[i]``.
* :mod:`~caffe_compat.pycaffe.solver`: ``get_solver``, ``SGDSolver`` ... ``AdamSolver`` (classes with the
  base ``Solver``; ``get_solver`` gives the class of the file's ``type``), whose ``solver.net`` /
  ``solver.test_nets`` are pycaffe ``Net`` s over the trained CaffeNets (``SolverNet``).
* :mod:`~caffe_compat.pycaffe.net_spec`: ``NetSpec``, ``layers``, ``params``, ``to_proto``;
  :mod:`~caffe_compat.pycaffe.coord_map`: ``coord_map_from_to``, ``crop``.
* :mod:`~caffe_compat.pycaffe.classifier` / :mod:`~caffe_compat.pycaffe.detector`: ``Classifier``,
  ``Detector``.
* User Python layers: ``register_python_layer``, ``allow_python_imports``
  (:mod:`caffe_compat.layers.python_user`).
* :mod:`~caffe_compat.pycaffe._caffe`: ``layer_type_list``, ``solver_count``/``solver_rank`` and their
  setters, ``set_multiprocess``, ``has_nccl``, ``NCCL``, ``Timer``, ``init_log``, ``log``, ``__version__``.
* :mod:`~caffe_compat.pycaffe.io`: pycaffe's ``caffe.io`` names (Transformer, the BlobProto and Datum
  converters).

This package is what ``import caffe`` gives under the alias (:mod:`caffe_compat.alias`): pycaffe's
top-level names, ``caffe.io`` (:mod:`caffe_compat.pycaffe.io`), ``caffe.proto`` (:mod:`caffe_compat.proto`),
and ``layers``, ``params``, ``NetSpec``, ``to_proto`` (``net_spec``), ``coord_map``, ``Classifier``,
``Detector``.  ``caffe_compat`` also re-exports the names at its top
level, where ``caffe_compat.io`` is the file-format package (it holds the same pycaffe io helpers).
"""

from __future__ import annotations

from caffe_compat import proto  # noqa: F401  (caffe.proto.caffe_pb2)
from caffe_compat.pycaffe import io  # noqa: F401  (caffe.io)
from caffe_compat.pycaffe._caffe import (NCCL, Timer, __version__, has_nccl, init_log, layer_type_list,  # noqa: F401
                                         log, multiprocess, set_multiprocess, set_solver_count, set_solver_rank,
                                         solver_count, solver_rank)
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
                                         RMSPropSolver, SGDSolver, Solver, SolverNet, get_solver,
                                         get_solver_from_file)

#: the messages Caffe's OpenCL-branch pycaffe exports at its top level (``caffe.SolverParameter()`` ...)
NetParameter, NetState, SolverParameter = proto.caffe_pb2.NetParameter, proto.caffe_pb2.NetState, \
    proto.caffe_pb2.SolverParameter

__all__ = ["TRAIN", "TEST", "Net", "Blob", "ParamBlob", "Layer", "SolverNet", "Solver", "PycaffeSolver", "get_solver",
           "SGDSolver", "NesterovSolver", "AdaGradSolver", "RMSPropSolver", "AdaDeltaSolver", "AdamSolver",
           "set_mode_cpu", "set_mode_gpu", "set_device", "set_random_seed", "NetSpec", "layers", "params", "to_proto",
           "coord_map", "Classifier", "Detector", "register_python_layer", "allow_python_imports", "layer_type_list",
           "has_nccl", "NCCL", "solver_count", "solver_rank", "set_solver_count", "set_solver_rank",
           "set_multiprocess", "Timer", "init_log", "log", "io", "proto", "get_solver_from_file", "SolverParameter",
           "NetParameter", "NetState"]

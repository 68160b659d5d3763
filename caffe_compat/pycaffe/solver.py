"""pycaffe's solvers over the core :class:`caffe_compat.solver.Solver`: ``caffe.get_solver(path)`` (the rule
of the file's ``type``), ``caffe.SGDSolver(path)``, ``NesterovSolver``, ``AdaGradSolver``,
``RMSPropSolver``, ``AdaDeltaSolver``, ``AdamSolver`` (that rule whatever the file says, as pycaffe's
classes do), so that old solver scripts run::

    solver = caffe.SGDSolver("solver.prototxt")
    solver.net.copy_from("init.caffemodel")
    for batch, labels in batches:
        solver.net.blobs["data"].data[...] = batch
        solver.net.blobs["label"].data[...] = labels
        solver.step(1)
        print(solver.net.blobs["loss"].data)

They are :class:`PycaffeSolver` s: core Solvers (training is the core's, number for number) whose nets,
``solver.net`` and ``solver.test_nets[i]``, are :class:`SolverNet` s: CaffeNets (everything a CaffeNet
offers is unchanged, ``params``/``layers``/``forward``/``phase`` included) that also answer pycaffe's
``Net`` names CaffeNet lacks:

* ``blobs``: pycaffe's ``net.blobs`` (every blob, Caffe's order).  An Input blob's ``data`` *is* the
  solver's input array (``solver.inputs[name]``, ``solver.test_inputs[i][name]``): ``data[...] = x`` feeds
  the next ``solver.step`` / ``solver.test`` as Caffe's input blobs do; ``reshape`` replaces it by zeros of
  the new shape.  Any other blob's ``data`` is a host copy of its value after the last forward (a solver
  step's last sub-batch, a test iteration, or the net's own ``forward()``), zeros before the first;
  writing to it changes nothing.  Blob ``diff`` is not kept (use ``params[layer][i].grad`` or
  :class:`~caffe_compat.pycaffe.net.Net`).
* ``forward()`` with an Input top not given reads it from the input arrays (pycaffe's ``net.forward()``
  reads the input blobs).
* ``copy_from(path)``, ``save(path)``, ``set_input_arrays(data, labels)`` (MemoryData), ``inputs``,
  ``outputs``, ``top_names``, ``bottom_names``, ``_layer_names``.

Their ``params`` are torch tensors, as on any CaffeNet: pycaffe's ``params[l][i].data[...] = array`` and
``.diff`` need :class:`~caffe_compat.pycaffe.net.Net`.

Keeping the last forward's blobs is the view's cost, not the core's: like Caffe, which keeps every blob
allocated, a SolverNet keeps them (detached) until its next forward starts, so peak memory does not grow;
``keep_blobs = False`` keeps none (those blobs then read as zeros).  A compiled forward
(``solver.forward_fn``) runs no Python of the net, so the solver's forward watcher records it.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import numpy as np
import torch

from caffe_compat.errors import CaffeCompatError
from caffe_compat.net import CaffeNet
from caffe_compat.pycaffe.blob import Blob, reshape_argument
from caffe_compat.pycaffe.net import set_input_arrays_of
from caffe_compat.solver import Solver, zero_inputs

__all__ = ["PycaffeSolver", "SolverNet", "get_solver", "SGDSolver", "NesterovSolver", "AdaGradSolver",
           "RMSPropSolver", "AdaDeltaSolver", "AdamSolver"]


class SolverNet(CaffeNet):
    """A pycaffe solver's TRAIN or TEST net: a :class:`~caffe_compat.net.CaffeNet` plus pycaffe's ``Net``
    names (see the module docstring).  ``input_arrays`` are the arrays fed to its Input tops: those of the
    solver it belongs to (:meth:`attach_solver`), else its own zero-filled ones."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._solver = None  # weakref to the solver whose inputs this net reads
        self._test_index: int | None = None  # None: the solver's TRAIN net
        self._own_inputs: dict | None = None
        self.keep_blobs = True
        self._last_blobs: dict = {}
        self._host_values: dict = {}

    def attach_solver(self, solver: Solver, test_index: int | None = None) -> None:
        """Read the input arrays from ``solver``: its ``inputs`` (TRAIN net) or ``test_inputs[test_index]``."""
        self._solver, self._test_index = weakref.ref(solver), test_index

    @property
    def input_arrays(self) -> dict:
        """Input top -> the float32 array its forwards read (the solver's, see :meth:`attach_solver`)."""
        solver = self._solver() if self._solver is not None else None
        if solver is not None:
            return solver.inputs if self._test_index is None else solver.test_inputs[self._test_index]
        if self._own_inputs is None:
            self._own_inputs = zero_inputs(self)
        return self._own_inputs

    @input_arrays.setter
    def input_arrays(self, value: dict) -> None:
        solver = self._solver() if self._solver is not None else None
        if solver is None:
            self._own_inputs = value
        elif self._test_index is None:
            solver.inputs = value
        else:
            solver.test_inputs[self._test_index] = value

    # ------------------------------------------------------------------------------ forward

    def forward(self, **inputs):
        """CaffeNet's forward; an Input top not given is read from ``input_arrays`` (pycaffe's
        ``net.forward()`` reads the input blobs).  The blobs are kept for ``blobs`` (when not compiling)."""
        if not torch.compiler.is_compiling():
            self.forget_blobs()
            for name in self.input_names:
                if name not in inputs:
                    inputs[name] = self.input_array(name)
        blobs = super().forward(**inputs)
        if not torch.compiler.is_compiling():
            self.record_blobs(blobs)
        return blobs

    def forget_blobs(self) -> None:
        """Drop the last forward's blobs (done when a forward starts)."""
        self._last_blobs, self._host_values = {}, {}

    def record_blobs(self, blobs) -> None:
        """Keep ``blobs`` (detached) as the values ``self.blobs[...].data`` shows (unless ``keep_blobs``
        is false)."""
        self._last_blobs, self._host_values = {}, {}
        if self.keep_blobs:
            self._last_blobs = {name: value.detach() for name, value in blobs.items()}

    # ------------------------------------------------------------------------------ pycaffe names

    def input_array(self, name: str) -> np.ndarray:
        """The float32 numpy array fed to Input top ``name`` (a value of another kind put in
        ``input_arrays`` is converted once, in place in the dict)."""
        arrays = self.input_arrays
        try:
            value = arrays[name]
        except KeyError:
            raise CaffeCompatError(f"net '{self.name}': '{name}' is not an input blob; the inputs are "
                                   f"{self.input_names}") from None
        if not (isinstance(value, np.ndarray) and value.dtype == np.float32 and value.flags["C_CONTIGUOUS"]
                and value.flags["WRITEABLE"]):
            if torch.is_tensor(value):
                value = value.detach().to("cpu")
            value = np.array(value, dtype=np.float32, order="C")
            arrays[name] = value
        return value

    def _host_value(self, name: str) -> np.ndarray:
        value = self._host_values.get(name)
        if value is None:
            last = self._last_blobs.get(name)
            if last is None:
                value = np.zeros(self.blob_shapes[name], dtype=np.float32)
            else:
                value = last.to("cpu", torch.float32).numpy().copy()
            self._host_values[name] = value
        return value

    @property
    def blobs(self) -> OrderedDict:
        return OrderedDict((name, _SolverBlob(self, name)) for name in self.blob_shapes)

    @property
    def inputs(self) -> list[str]:
        return self.input_names

    @property
    def outputs(self) -> list[str]:
        return self.output_names

    @property
    def top_names(self) -> OrderedDict:
        return OrderedDict((s.name, list(s.tops)) for s in self.steps)

    @property
    def bottom_names(self) -> OrderedDict:
        return OrderedDict((s.name, list(s.bottoms)) for s in self.steps)

    @property
    def _layer_names(self) -> list[str]:
        return self.layer_names

    def copy_from(self, path) -> None:
        """Load weights by layer name from a caffemodel (``CopyTrainedLayersFrom``)."""
        self.load_caffemodel(str(path))

    def save(self, path) -> None:
        """Write the weights as a binary caffemodel."""
        self.save_caffemodel(str(path))

    def set_input_arrays(self, data, labels) -> None:
        """Feed the first layer, a MemoryData layer (pycaffe's checks: float32, C-contiguous, 4-D data)."""
        set_input_arrays_of(self, data, labels)


class _SolverBlob(Blob):
    """``SolverNet.blobs[name]`` (see :class:`SolverNet`): a view, the values live in the net."""

    def __init__(self, net: SolverNet, name: str):  # noqa: the base class's storage is not used
        self.name = name
        self._net = net

    @property
    def _is_input(self) -> bool:
        return self.name in self._net.input_arrays

    @property
    def data(self) -> np.ndarray:
        if self._is_input:
            return self._net.input_array(self.name)
        return self._net._host_value(self.name)

    @property
    def diff(self) -> np.ndarray:
        raise CaffeCompatError(f"blob '{self.name}': a solver's net keeps no blob diffs; read the parameter "
                               f"gradients as solver.net.params[layer][i].grad, or use caffe_compat.Net for "
                               f"forward/backward with blob diffs")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    def reshape(self, *shape) -> None:
        """An Input blob: new zero-filled input array of that shape (the next forward runs with it)."""
        shape = reshape_argument(self.name, shape)
        if not self._is_input:
            raise CaffeCompatError(f"blob '{self.name}' is not an input of the solver's net; only input blobs "
                                   f"({self._net.input_names}) can be reshaped")
        self._net.input_arrays[self.name] = np.zeros(shape, dtype=np.float32)

    def _realloc(self, shape) -> None:
        raise CaffeCompatError("a solver net's blob has no storage of its own")

    def __repr__(self) -> str:
        return f"Blob({self.name!r}, shape={self.shape})"


class _CompiledForwardRecorder:
    """The forward observer of a :class:`PycaffeSolver`: a compiled TRAIN forward (``forward_fn``) runs none of
    :meth:`SolverNet.forward`'s Python, so its blobs are dropped and recorded here (an eager forward
    recorded them itself)."""

    @staticmethod
    def before_forward(solver, net) -> None:
        if isinstance(net, SolverNet):
            net.forget_blobs()

    @staticmethod
    def after_forward(solver, net, blobs) -> None:
        if isinstance(net, SolverNet) and not net._last_blobs:
            net.record_blobs(blobs)


class PycaffeSolver(Solver):
    """A core :class:`~caffe_compat.solver.Solver` whose nets are :class:`SolverNet` s reading this solver's
    ``inputs`` / ``test_inputs`` (see the module docstring).  Same arguments as the core Solver."""

    net_class = SolverNet

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.net.attach_solver(self)
        for i, net in enumerate(self.test_nets):
            net.attach_solver(self, i)
        self.observers.append(_CompiledForwardRecorder())


def get_solver(solver, weights=None, device=None) -> PycaffeSolver:
    """pycaffe's ``caffe.get_solver``: the solver of the file's ``type``."""
    return PycaffeSolver(solver, weights=weights, device=device)


def _forced(kind: str):
    def make(solver, weights=None, device=None) -> PycaffeSolver:
        return PycaffeSolver(solver, weights=weights, device=device, solver_type=kind)

    make.__name__ = make.__qualname__ = f"{kind}Solver"
    make.__doc__ = f"pycaffe's ``caffe.{kind}Solver(path)``: a solver using Caffe's {kind} rule."
    return make


SGDSolver = _forced("SGD")
NesterovSolver = _forced("Nesterov")
AdaGradSolver = _forced("AdaGrad")
RMSPropSolver = _forced("RMSProp")
AdaDeltaSolver = _forced("AdaDelta")
AdamSolver = _forced("Adam")

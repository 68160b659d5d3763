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
        print(solver.net.blobs["loss"].data, solver.net.params["conv1"][0].diff.std())

They derive from :class:`Solver` (``caffe.Solver``, also named ``PycaffeSolver``), a core Solver (training
is the core's, number for number) whose ``solver.net`` and ``solver.test_nets[i]`` are :class:`SolverNet` s,
pycaffe ``caffe.Net`` s (:class:`~caffe_compat.pycaffe.net.Net`: numpy ``data``/``diff``, ``layers``,
``forward``/``backward`` with ranges, ...) over the CaffeNets the core trains (``net.torch_net``).
What Caffe does and this reproduces:

* An Input blob's ``data`` *is* the solver's input array (``solver.inputs[name]``,
  ``solver.test_inputs[i][name]``), and so is the top of a DummyData layer with a constant filler (Caffe
  fills it once: what a script writes there, labels say, is what training reads); ``data[...] = x`` feeds
  the next ``step``/``test``; ``reshape`` gives zeros of the new shape and re-infers the net's shapes.
* After ``step()`` every blob holds the last forward of the step (its last sub-batch) and its ``diff``;
  after ``test(i)`` the TEST net's blobs hold its last test iteration.  ``keep_blobs = False`` keeps none
  (no copy, no blob diff).  A compiled forward (``solver.forward_fn``) is recorded by a forward watcher.
* ``params[layer][i].data``/``.diff`` are the tensors the solver updates and their gradients: written
  between steps they take effect (``apply_update()`` after setting ``diff`` by hand updates with it; the
  diffs keep their memory across steps, holding Caffe's update values after one).
* The TEST nets share the TRAIN net's parameter memory from the start (Caffe's
  ``ShareTrainedLayersWith``, which ``Test`` re-applies); ``share_weights(net)`` makes another net share
  them too.
* The nets outlive the solver (``del solver`` leaves ``solver.net`` working on its last input arrays).
* The nets' layer callbacks (``solver.net.before_forward(fn)`` ...) are called as Caffe's ``Step`` and
  ``Test`` call them: around each layer of every TRAIN forward and backward, and of every TEST forward.  With
  forward callbacks the TRAIN forward runs eagerly (not ``forward_fn``); with backward callbacks the backward
  runs layer by layer from the loss tops' diffs (``loss_weight``), and diffs a callback writes are what the
  lower layers and the update read.  ``solver.net.after_backward(nccl)`` (Caffe's ``train.py``) adds none:
  ``caffe.NCCL`` reduces in ``on_gradients_ready``.
* ``add_callback(on_start, on_gradients_ready)`` (two callables, or one object with those methods, e.g.
  ``caffe.NCCL``), ``apply_update()``, ``iter``, ``step``, ``solve(resume_file=None)``, ``restore``,
  ``snapshot``, ``test``, ``param``.
* The device is the process-wide mode when the solver is built (``caffe.set_mode_gpu()`` /
  ``set_device``, CPU by default), as pycaffe's solvers run in ``Caffe::mode()``: the file's
  ``solver_mode``/``device_id`` are not read (only ``caffe train`` reads them).
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from caffe_compat.errors import CaffeCompatError
from caffe_compat.io import read_net
from caffe_compat.io.blobs import set_packed_floats
from caffe_compat.net import CaffeNet
from caffe_compat.pycaffe._mode import current_device
from caffe_compat.pycaffe.blob import Blob, _Synced, grad_of
from caffe_compat.pycaffe.net import Net
from caffe_compat.pycaffe.net_backward import backward_layers
from caffe_compat.pycaffe.net_params import share_trained_layers
from caffe_compat.solver import Solver as CoreSolver

__all__ = ["Solver", "PycaffeSolver", "SolverNet", "get_solver", "get_solver_from_file", "SGDSolver", "NesterovSolver",
           "AdaGradSolver", "RMSPropSolver", "AdaDeltaSolver", "AdamSolver"]


class _BuiltNet(CaffeNet):
    """The CaffeNet a pycaffe solver builds: it keeps the NetParameter it was built from (the view rebuilds
    from it when an input is reshaped)."""

    def __init__(self, net, **kwargs):
        super().__init__(net, **kwargs)
        self.source_param = read_net(net)


class _ArrayBlob(Blob):
    """A blob whose ``data`` is an array of the solver's input dicts (see :class:`SolverNet`)."""

    def __init__(self, name: str, net: "SolverNet"):
        self.name = name
        self._owner = weakref.ref(net)
        self._diff = _Synced(torch.zeros(self._array().shape, dtype=torch.float32))

    def _array(self) -> np.ndarray:
        return self._owner().input_array(self.name)

    @property
    def data(self) -> np.ndarray:
        return self._array()

    @property
    def _data(self) -> _Synced:
        return _Synced(torch.from_numpy(self._array()))

    @property
    def diff(self) -> np.ndarray:
        if self._diff.shape != self._array().shape:
            self._diff = _Synced(torch.zeros(self._array().shape, dtype=torch.float32))
        return self._diff.host().numpy()

    def _realloc(self, shape) -> None:
        self._owner().input_arrays[self.name] = np.zeros(shape, dtype=np.float32)
        self._diff = _Synced(torch.zeros(shape, dtype=torch.float32))

    _reshape_memory = _realloc  # the script's array is replaced by zeros of the new shape


class SolverNet(Net):
    """A pycaffe solver's TRAIN or TEST net (see the module docstring): a pycaffe ``Net`` over the core's
    CaffeNet, plus the CaffeNet names the core Solver calls on its nets (it is called like one)."""

    keep_blobs = True

    @classmethod
    def of_solver(cls, solver: "PycaffeSolver", cnet: _BuiltNet, test_index: int | None = None) -> "SolverNet":
        arrays = solver.inputs if test_index is None else solver.test_inputs[test_index]
        seed = max(int(solver.param.random_seed), 0)
        net = cls.over(cnet, cnet.source_param, seed, _solver=weakref.ref(solver), _test_index=test_index,
                       _arrays=arrays, _last_blobs={})
        for name in net._kept_tops:  # Caffe fills constant DummyData tops once: the solver feeds them
            if name not in arrays:
                arrays[name] = net._blob_map[name].data.copy()
        net._sync_blobs_with_net()
        return net

    @property
    def input_arrays(self) -> dict:
        """Blob -> the float32 array the forwards read (the solver's ``inputs`` / ``test_inputs[i]``; after
        the solver is gone, the last ones)."""
        solver = self._solver()
        if solver is not None:
            self._arrays = solver.inputs if self._test_index is None else solver.test_inputs[self._test_index]
        return self._arrays

    @input_arrays.setter
    def input_arrays(self, value: dict) -> None:
        solver = self._solver()
        if solver is not None and self._test_index is None:
            solver.inputs = value
        elif solver is not None:
            solver.test_inputs[self._test_index] = value
        self._arrays = value

    def input_array(self, name: str) -> np.ndarray:
        """The float32 array fed to ``name`` (another kind of value in the dict is converted once, in place)."""
        arrays = self.input_arrays
        value = arrays[name]
        if not (isinstance(value, np.ndarray) and value.dtype == np.float32 and value.flags["C_CONTIGUOUS"]
                and value.flags["WRITEABLE"]):
            if torch.is_tensor(value):
                value = value.detach().to("cpu")
            value = np.array(value, dtype=np.float32, order="C")
            arrays[name] = value
        return value

    def _new_blob(self, name: str, shape) -> Blob:
        if name in getattr(self, "_arrays", {}):
            return _ArrayBlob(name, self)
        return super()._new_blob(name, shape)

    def _sync_blobs_with_net(self) -> None:
        arrays = getattr(self, "_arrays", {})
        for name in list(getattr(self, "_blob_map", {})):
            if name in arrays and not isinstance(self._blob_map[name], _ArrayBlob):
                del self._blob_map[name]
        super()._sync_blobs_with_net()

    def _feed_tensor(self, name: str) -> torch.Tensor:
        if name in self.input_arrays:
            return torch.from_numpy(self.input_array(name)).to(self._device)
        return super()._feed_tensor(name)

    def _blob_reshaped(self, name: str) -> None:
        """A solver's net re-infers its shapes at once (the solver's forward, compiled or graph-replayed, runs on
        the core's CaffeNet, which a rebuild in the middle of a step would replace)."""
        if name in self.input_arrays and name not in self._cnet.input_names:
            return  # a constant DummyData top: the next forward reads the new array
        super()._blob_reshaped(name)
        try:
            self.reshape()
        except CaffeCompatError:
            pass  # the inputs disagree for now (two reshaped one after the other): applied (or raised) later

    def _replace_cnet(self, new: CaffeNet) -> None:
        new.source_param = self._cnet.source_param
        self._cnet = new

    # ------------------------------------------------------------------------------ the core's names

    def __call__(self, **inputs):
        hooks = self._forward_hooks()
        blobs = self._cnet(**inputs) if hooks is None else self._cnet.run(inputs, step_hooks=hooks)
        self.record(blobs)
        return blobs

    def objective(self, blobs):
        return self._cnet.objective(blobs)

    def to_netparameter(self):
        self._upload_params()
        return self._cnet.to_netparameter()

    def load_caffemodel(self, model, strict: bool = False) -> None:
        self._cnet.load_caffemodel(model, strict=strict)
        self._forget_param_mirrors()

    def load_caffemodels(self, models, strict: bool = False) -> None:
        self._cnet.load_caffemodels(models, strict=strict)
        self._forget_param_mirrors()

    output_names = property(lambda self: self._cnet.output_names)
    input_names = property(lambda self: self._cnet.input_names)
    feedable_names = property(lambda self: self._cnet.feedable_names)
    loss_weights = property(lambda self: self._cnet.loss_weights)
    blob_shapes = property(lambda self: self._cnet.blob_shapes)
    steps = property(lambda self: self._cnet.steps)
    #: Caffe's ``set_debug_info``: the solver sets its TRAIN net's at every iteration (``caffe_compat.net_debug``)
    debug_info = property(lambda self: self._cnet.debug_info,
                          lambda self, value: setattr(self._cnet, "debug_info", bool(value)))
    layer_names = property(lambda self: self._cnet.layer_names)

    # ------------------------------------------------------------------------------ the last forward

    def record(self, blobs) -> None:
        """Keep a forward's blobs (and ask autograd for their diffs) until :meth:`materialize`."""
        if not self.keep_blobs or torch.compiler.is_compiling():
            self._last_blobs = {}
            return
        if torch.is_grad_enabled():
            for tensor in blobs.diff_targets.values():
                if tensor.requires_grad and not tensor.is_leaf:
                    tensor.retain_grad()
        self._last_blobs = blobs

    def materialize(self) -> None:
        """Copy the recorded forward's values and diffs into the blobs (Caffe's memory after the step)."""
        blobs, self._last_blobs = self._last_blobs, {}
        if not blobs:
            return
        arrays = self.input_arrays
        for name, value in blobs.items():
            if name in self._blob_map and name not in arrays:
                self._blob_map[name]._data.assign(value.detach())
        for name, target in getattr(blobs, "diff_targets", {}).items():
            grad = target.grad if target.requires_grad else None
            if grad is not None and name in self._blob_map:
                self._blob_map[name]._diff.assign(grad)
        self._last = None  # the step's graph is freed: backward() needs a new forward


class _ForwardRecorder:
    """The forward observer of a :class:`PycaffeSolver` (:mod:`caffe_compat.solver.observers`): a compiled
    TRAIN forward (``forward_fn``) runs none of :meth:`SolverNet.__call__`, so its blobs are recorded here
    (an eager forward recorded them itself)."""

    @staticmethod
    def after_forward(solver, net, blobs) -> None:
        if isinstance(net, SolverNet) and net._last_blobs is not blobs:
            net.record(blobs)



class Solver(CoreSolver):
    """pycaffe's ``Solver``, the base class of ``SGDSolver`` ... ``AdamSolver`` (``PycaffeSolver`` is
    another name of it): a core :class:`~caffe_compat.solver.Solver` whose nets are :class:`SolverNet` s
    (see the module docstring).  Same arguments as the core Solver; built directly it runs the rule of the
    file's ``type``, as an instance of this base."""

    net_class = _BuiltNet

    def __init__(self, solver, weights=None, device=None, **kwargs):
        if device is None:  # pycaffe: Caffe's process-wide mode (set_mode_gpu / set_device), not solver_mode
            device = current_device()
        super().__init__(solver, weights=weights, device=device, **kwargs)
        train = SolverNet.of_solver(self, self.net)
        tests = [SolverNet.of_solver(self, net, i) for i, net in enumerate(self.test_nets)]
        for view in tests:
            share_trained_layers(train.torch_net, view.torch_net)
        self.net, self.test_nets = train, tests
        self.observers.append(_ForwardRecorder())

    def _views(self) -> list[SolverNet]:
        return [self.net, *self.test_nets]

    # ------------------------------------------------------------------------------ pycaffe's methods

    def add_callback(self, on_start, on_gradients_ready=None):
        """Caffe's solver callback: ``on_start()`` before each iteration's forward/backward,
        ``on_gradients_ready()`` before its update (two callables, or one object with both methods); an
        observer of the core solver."""
        if on_gradients_ready is None:
            if not (callable(getattr(on_start, "on_start", None))
                    and callable(getattr(on_start, "on_gradients_ready", None))):
                raise CaffeCompatError("add_callback: give two callables (on_start, on_gradients_ready) or an "
                                       "object with on_start() and on_gradients_ready() methods")
            on_start, on_gradients_ready = on_start.on_start, on_start.on_gradients_ready
        if not (callable(on_start) and callable(on_gradients_ready)):
            raise CaffeCompatError("add_callback: on_start and on_gradients_ready must be callables")
        return super().add_callback(on_start, on_gradients_ready)

    def share_weights(self, net) -> None:
        """Make ``net`` (a ``caffe.Net``) share this solver's TRAIN net parameters (same-named layers)."""
        target = getattr(net, "torch_net", net)
        if not isinstance(target, CaffeNet):
            raise CaffeCompatError(f"share_weights: expected a caffe.Net, got {type(net).__name__}")
        self.net._upload_params()
        share_trained_layers(self.net.torch_net, target)

    def apply_update(self) -> float:
        """Caffe's ``ApplyUpdate`` with the current diffs (every parameter has one, zero unless set)."""
        for view in self._views():
            view._upload_params()
        for p in self.net.torch_net.parameters():
            grad_of(p)
        rate = super().apply_update()
        for view in self._views():
            view._forget_param_mirrors()
        return rate

    def step(self, iters: int = 1) -> float:
        """Caffe's ``Step``; the parameter diffs keep their memory and the blobs show the last forward."""
        for view in self._views():
            view._upload_params()
        params = list(self.net.torch_net.parameters())
        grads = {id(p): grad_of(p) for p in params}
        try:
            return super().step(iters)
        finally:
            with torch.no_grad():
                for p in params:  # the step's zero_grad(set_to_none) made new .grad tensors: keep the old memory
                    old = grads[id(p)]
                    if p.grad is not None and p.grad is not old:
                        old.copy_(p.grad)
                    elif p.grad is None:
                        old.zero_()
                    p.grad = old
            for view in self._views():
                view._forget_param_mirrors()
            self.net.materialize()

    def solve(self, resume_file=None) -> None:
        super().solve(resume_file)
        self.net.materialize()

    def test(self, index: int = 0):
        scores = super().test(index)
        self.test_nets[index].materialize()
        return scores

    def restore(self, state_file) -> None:
        self.net._upload_params()
        super().restore(state_file)
        for view in self._views():
            view._forget_param_mirrors()

    def snapshot(self):
        self.net._upload_params()
        return super().snapshot()

    # ------------------------------------------------------------------------------ the core's hooks

    def _train_forward(self, inputs: dict):
        """With layer callbacks on the TRAIN net, its eager forward calling them (a ``forward_fn`` runs none)."""
        if self.net._has_forward_callbacks or self.net._has_backward_callbacks:
            return self.net(**inputs)
        return super()._train_forward(inputs)

    def _train_backward(self, objective: torch.Tensor, blobs) -> None:
        """With backward callbacks on the TRAIN net, Caffe's ``Backward`` one layer at a time calling them, from
        the loss tops' diffs (their ``loss_weight``, as ``Net::SetLossWeights`` set them); else the whole
        net's autograd backward."""
        net = self.net
        if not net._has_backward_callbacks:
            return super()._train_backward(objective, blobs)
        if self.grad_scaler is not None:
            raise CaffeCompatError("backward layer callbacks: the layer-by-layer backward they need does not "
                                   "apply fp16's gradient scaling (train in fp32 or bf16, or remove them)")
        net._last = blobs
        try:
            backward_layers(net, 0, len(net.steps) - 1, net._callbacks["before_backward"],
                            net._callbacks["after_backward"])
        finally:
            net._last = None

    def _share_weights(self, test_net) -> None:
        """Caffe's ``ShareTrainedLayersWith`` at each ``Test``: the TEST net shares the TRAIN net's tensors."""
        if share_trained_layers(self.net.torch_net, test_net.torch_net):
            test_net._forget_param_mirrors()

    def _add_diffs(self, net_param) -> None:
        params = self.net.torch_net.params
        for layer in net_param.layer:
            for blob, tensor in zip(layer.blobs, params.get(layer.name, [])):
                diff = tensor.grad if tensor.grad is not None else torch.zeros_like(tensor)
                set_packed_floats(blob, diff.detach().to("cpu", torch.float32).reshape(-1).numpy(), "diff")


#: the name this base had before it was pycaffe's ``Solver``
PycaffeSolver = Solver


class _RuleSolver(Solver):
    """The common part of pycaffe's ``SGDSolver`` ... ``AdamSolver``: each runs its class's rule
    (``solver_type``) whatever the file's ``type``.  None derives from another (in pycaffe's bindings each
    has the base ``Solver`` only: a NesterovSolver is not an SGDSolver)."""

    solver_type: str

    def __init__(self, solver, weights=None, device=None):
        super().__init__(solver, weights=weights, device=device, solver_type=self.solver_type)


def _rule_class(kind: str) -> type[_RuleSolver]:
    """pycaffe's ``caffe.<kind>Solver``, a class of its own (``isinstance`` and ``type(s).__name__`` as in
    pycaffe)."""
    doc = f"pycaffe's ``caffe.{kind}Solver(path)``: Caffe's {kind} rule whatever the file's ``type``."
    return type(f"{kind}Solver", (_RuleSolver,), {"solver_type": kind, "__doc__": doc, "__module__": __name__,
                                                  "__qualname__": f"{kind}Solver"})


SGDSolver = _rule_class("SGD")
NesterovSolver = _rule_class("Nesterov")
AdaGradSolver = _rule_class("AdaGrad")
RMSPropSolver = _rule_class("RMSProp")
AdaDeltaSolver = _rule_class("AdaDelta")
AdamSolver = _rule_class("Adam")


#: the file's ``type`` -> the pycaffe class of that solver
SOLVER_CLASSES: dict[str, type[Solver]] = {
    cls.solver_type: cls for cls in (SGDSolver, NesterovSolver, AdaGradSolver, RMSPropSolver, AdaDeltaSolver,
                                     AdamSolver)}


def get_solver(solver, weights=None, device=None) -> Solver:
    """pycaffe's ``caffe.get_solver``: the solver of the file's ``type`` (the legacy ``solver_type`` enum
    upgraded), an instance of that type's class (an Adam file gives an ``AdamSolver``), as Caffe's
    ``SolverRegistry`` makes it.  The file is read once: the solver is built, then takes the class of the
    type it resolved (the classes differ only in the type their constructor forces)."""
    made = Solver(solver, weights=weights, device=device)
    made.__class__ = SOLVER_CLASSES.get(made.param.type or "SGD", Solver)
    return made


def get_solver_from_file(path, weights=None, device=None) -> Solver:
    """``caffe.get_solver_from_file(path)``, the spelling of Caffe's OpenCL branch (whose ``get_solver`` takes a
    ``SolverParameter``; this one takes either): :func:`get_solver` of the file."""
    return get_solver(path, weights=weights, device=device)

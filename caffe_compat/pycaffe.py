"""The pycaffe-compatible facade: ``import caffe_compat as caffe`` runs old pycaffe scripts on CaffeNet.

::

    import caffe_compat as caffe
    caffe.set_mode_gpu(); caffe.set_device(0)
    net = caffe.Net("deploy.prototxt", "weights.caffemodel", caffe.TEST)   # or Net(proto, caffe.TEST, weights=...)
    net.blobs["data"].reshape(1, 3, 224, 224)
    net.blobs["data"].data[...] = transformer.preprocess("data", image)
    prob = net.forward()["prob"]

What is reproduced from pycaffe / Caffe:

* ``net.blobs``: every blob in Caffe's creation order (automatic Split tops included), each a :class:`Blob`
  whose ``data``/``diff`` are numpy arrays with a **stable memory**: ``forward()`` copies its results into
  them, and what ``forward()`` returns are these very arrays (as in pycaffe, copy them to keep them past
  the next forward).  A blob written in place holds the value after the last in-place layer.
* ``blob.reshape(*shape)`` on a net input re-infers every shape (the net is rebuilt with the new Input shape,
  keeping the same parameter tensors); when the inputs are inconsistent for a moment (two inputs reshaped
  one after the other) the new shapes are applied at ``net.reshape()`` / the next ``forward()``.
* ``backward()`` follows Caffe's ``Net::Backward``: the top gradients are the current ``.diff`` of the output
  blobs; a loss top's diff is initialised to its ``loss_weight`` (Caffe's ``SetLossWeights``).  Blobs whose
  diff Caffe computes are overwritten; the others keep their diff.  **Parameter diffs accumulate** over
  backward calls (Caffe only clears them in the Solver).  A net with neither a loss nor ``force_backward``
  has nothing to back-propagate (Caffe skips every layer): ``backward()`` then changes nothing and warns.
* ``net.params[layer][i].data`` / ``.diff``: on CPU, numpy views of the torch parameter and of its
  ``.grad`` (writing ``data[...] = w`` changes the net).
* Modes: ``set_mode_gpu()`` makes nets built afterwards run on ``cuda:<set_device>`` when CUDA is available
  (else a warning and CPU).  On CUDA, ``.data``/``.diff`` are **host copies** kept by a small
  synchronisation scheme (Caffe's SyncedMemory): reading fetches the device value and hands the host copy
  to the caller, who may write into it; before the next forward/backward/save every host copy that was
  handed out is uploaded again.  Device-side changes made behind the facade (e.g. a solver step on the
  CaffeNet) are seen by the next ``.data`` read, not by arrays fetched before.
* ``set_random_seed(seed)`` seeds the fillers of nets built afterwards and torch's global RNG (Dropout).
  Without it fillers use seed 0 (deterministic), where Caffe would seed from the clock.

The solver's nets (``solver.net``, ``solver.test_nets[i]``) are :class:`SolverNet`: CaffeNets (everything a
CaffeNet offers is unchanged, ``params``/``layers``/``forward``/``phase`` included) with pycaffe's other
names added: ``blobs`` (an Input blob's ``data`` *is* the solver's input array, so ``data[...] = x`` feeds
the next ``solver.step``; other blobs hold the last forward's values), ``copy_from``, ``save``,
``set_input_arrays``, ``inputs``, ``outputs``, ``top_names``, ``bottom_names``.  Their ``params`` are torch
tensors, as on any CaffeNet: pycaffe's ``params[l][i].data[...] = array`` and ``.diff`` need :class:`Net`.

Not reproduced: ``backward(start=..., end=...)`` and ``forward(start=...)`` past an in-place chain start
(``start`` works for layers that read blobs already computed); ``Layer`` is pycaffe's Python-layer base
class for porting code, but a Python layer still needs a registered native port to run (see
:mod:`caffe_compat.layers.registry`).
"""

from __future__ import annotations

import warnings
import weakref
from collections import OrderedDict

import numpy as np
import torch

from caffe_compat.errors import CaffeCompatError, FormatError, ShapeMismatchError
from caffe_compat.io import read_net
from caffe_compat.net import CaffeNet
from caffe_compat.net_graph import PHASE_NAMES, phase_value
from caffe_compat.proto import caffe_pb2

__all__ = ["TRAIN", "TEST", "Net", "Blob", "ParamBlob", "Layer", "SolverNet", "set_mode_cpu", "set_mode_gpu",
           "set_device", "set_random_seed"]

TRAIN = caffe_pb2.TRAIN  # 0, as pycaffe's caffe.TRAIN
TEST = caffe_pb2.TEST    # 1, as pycaffe's caffe.TEST

_MODE = {"gpu": False, "device": 0, "seed": None}


def set_mode_cpu() -> None:
    """Nets built from now on run on the CPU."""
    _MODE["gpu"] = False


def set_mode_gpu() -> None:
    """Nets built from now on run on CUDA device ``set_device`` (CPU with a warning when CUDA is missing)."""
    _MODE["gpu"] = True


def set_device(device_id: int) -> None:
    """The CUDA device used in GPU mode (Caffe's ``caffe.set_device``)."""
    device_id = int(device_id)
    if device_id < 0:
        raise CaffeCompatError(f"set_device: device id must be >= 0, got {device_id}")
    if torch.cuda.is_available() and device_id >= torch.cuda.device_count():
        raise CaffeCompatError(f"set_device: device {device_id} does not exist ({torch.cuda.device_count()} "
                               f"CUDA device(s))")
    _MODE["device"] = device_id


def set_random_seed(seed: int) -> None:
    """Seed the fillers of nets built afterwards and torch's RNG (Dropout masks)."""
    _MODE["seed"] = int(seed)
    torch.manual_seed(int(seed))


def current_device() -> torch.device:
    """The device the mode selects now (CPU when GPU mode is on but CUDA is unavailable, with a warning)."""
    if not _MODE["gpu"]:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        warnings.warn("caffe_compat: set_mode_gpu() was called but CUDA is not available; running on the CPU",
                      RuntimeWarning, stacklevel=3)
        return torch.device("cpu")
    return torch.device("cuda", _MODE["device"])


def reshape_argument(name: str, shape: tuple) -> tuple[int, ...]:
    """pycaffe's ``blob.reshape(n, c, h, w)`` or ``blob.reshape((n, c, h, w))`` as a tuple of ints."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    shape = tuple(int(d) for d in shape)
    if any(d < 0 for d in shape):
        raise ShapeMismatchError(f"blob '{name}': negative dimension in {shape}")
    return shape


class _Synced:
    """One array on host and device (Caffe's SyncedMemory): ``head`` says where the newest value is.

    On CPU host and device are the same tensor.  On CUDA: ``host()`` returns the host copy the caller may
    write to (fetched when the device is newer) and moves the head to the host; ``device()`` uploads a
    host head first; ``assign()`` stores a new device value."""

    def __init__(self, value: torch.Tensor):
        self._dev = value
        self._host = value if value.device.type == "cpu" else None
        self.head = "synced"
        self.source = None  # the tensor a parameter mirror follows

    @property
    def on_cpu(self) -> bool:
        return self._dev.device.type == "cpu"

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._dev.shape)

    def host(self) -> torch.Tensor:
        if self.on_cpu:
            return self._dev
        if self._host is None or tuple(self._host.shape) != self.shape:
            self._host = torch.empty(self.shape, dtype=self._dev.dtype).pin_memory()
            self.head = "device"
        if self.head == "device":
            self._host.copy_(self._dev)
        self.head = "host"
        return self._host

    def device(self) -> torch.Tensor:
        if self.head == "host" and not self.on_cpu:
            self._dev.copy_(self._host)
        self.head = "synced" if self.head == "host" else self.head
        return self._dev

    def assign(self, value: torch.Tensor) -> None:
        value = value.detach()
        if tuple(value.shape) != self.shape or value.dtype != self._dev.dtype:
            self._dev = value.clone() if self.on_cpu else value
            self._host = self._dev if self.on_cpu else None
        elif self.on_cpu:
            if value.data_ptr() != self._dev.data_ptr():
                self._dev.copy_(value)
        else:
            self._dev = value
        self.head = "device" if not self.on_cpu else "synced"

    def fill(self, value: float) -> None:
        self.device().fill_(value)
        if not self.on_cpu:
            self.head = "device"


class Blob:
    """pycaffe's Blob: ``data`` and ``diff`` numpy arrays (see the module docstring for CPU/GPU), ``shape``,
    ``count``, ``num/channels/height/width`` (legacy 4-D accessors) and ``reshape``."""

    def __init__(self, name: str, shape, device: torch.device, owner: "Net"):
        self.name = name
        self._owner = weakref.ref(owner)
        self._data = _Synced(torch.zeros(tuple(shape), dtype=torch.float32, device=device))
        self._diff = _Synced(torch.zeros(tuple(shape), dtype=torch.float32, device=device))

    @property
    def data(self) -> np.ndarray:
        return self._data.host().numpy()

    @property
    def diff(self) -> np.ndarray:
        return self._diff.host().numpy()

    @property
    def shape(self) -> tuple[int, ...]:
        return self._data.shape

    @property
    def count(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def _legacy(self, axis: int) -> int:
        if len(self.shape) > 4:
            raise CaffeCompatError(f"blob '{self.name}' has {len(self.shape)} axes; the legacy accessors need <= 4")
        return ((1,) * 4 + self.shape)[-4:][axis] if len(self.shape) < 4 else self.shape[axis]

    num = property(lambda self: self._legacy(0))
    channels = property(lambda self: self._legacy(1))
    height = property(lambda self: self._legacy(2))
    width = property(lambda self: self._legacy(3))

    def reshape(self, *shape) -> None:
        """New shape (zeros).  On a net input, the net's shapes are re-inferred (see the module docstring)."""
        shape = reshape_argument(self.name, shape)
        self._realloc(shape)
        owner = self._owner()
        if owner is not None:
            owner._blob_reshaped(self.name)

    def _realloc(self, shape) -> None:
        device = self._data._dev.device
        self._data = _Synced(torch.zeros(shape, dtype=torch.float32, device=device))
        self._diff = _Synced(torch.zeros(shape, dtype=torch.float32, device=device))

    def __repr__(self) -> str:
        return f"Blob({self.name!r}, shape={self.shape})"


class ParamBlob:
    """One learnable (or statistics) blob of a layer, pycaffe's ``net.params[layer][i]``: ``data`` and
    ``diff`` share memory with the torch tensor and its ``.grad`` on CPU (host copies on CUDA)."""

    def __init__(self, owner: "Net", module_key: str, index: int):
        self._owner = weakref.ref(owner)
        self._key, self._index = module_key, index

    @property
    def tensor(self) -> torch.Tensor:
        """The torch tensor (``nn.Parameter`` or buffer) inside the CaffeNet."""
        return self._owner()._cnet.layers[self._key].caffe_blobs()[self._index]

    def _mirror(self, kind: str) -> _Synced:
        owner = self._owner()
        tensor = self.tensor
        key = (self._key, self._index, kind)
        source = tensor if kind == "data" else _grad_of(tensor)
        mirror = owner._param_mirrors.get(key)
        if mirror is None or mirror.source is not source:  # first use, or the tensor was replaced
            mirror = _Synced(source.detach())
            mirror.source = source
            mirror.head = "device"
            owner._param_mirrors[key] = mirror
        return mirror

    @property
    def data(self) -> np.ndarray:
        return self._mirror("data").host().numpy()

    @property
    def diff(self) -> np.ndarray:
        return self._mirror("diff").host().numpy()

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    @property
    def count(self) -> int:
        return int(self.tensor.numel())

    def __repr__(self) -> str:
        return f"ParamBlob({self._key!r}[{self._index}], shape={self.shape})"


def _grad_of(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's ``.grad``, created as zeros when absent (Caffe's diff exists from the start)."""
    if tensor.grad is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # .grad of a buffer / frozen parameter: allowed, just unusual
            tensor.grad = torch.zeros_like(tensor.detach())
    return tensor.grad


class LayerView:
    """pycaffe's ``net.layers[i]``: ``type``, ``name``, ``blobs`` (its parameter blobs)."""

    def __init__(self, name: str, type_: str, blobs: list):
        self.name, self.type, self.blobs = name, type_, blobs

    def __repr__(self) -> str:
        return f"Layer({self.name!r}, type={self.type!r})"


class Layer:
    """pycaffe's ``caffe.Layer`` base class of Python layers (``setup``, ``reshape``, ``forward``,
    ``backward`` over lists of :class:`Blob`, ``param_str``, ``phase``, ``blobs``).  Provided so that old
    layer code imports; caffe-compat never instantiates Python layers named by a model file: register a
    native port instead (:func:`caffe_compat.layers.register_layer`)."""

    def __init__(self, param_str: str = "", phase: int = TEST):
        self.param_str, self.phase, self.blobs = param_str, phase, []

    def setup(self, bottom, top):
        pass

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        raise NotImplementedError(f"{type(self).__name__}.forward is not implemented")

    def backward(self, top, propagate_down, bottom):
        raise NotImplementedError(f"{type(self).__name__}.backward is not implemented")


def _looks_like_phase(value) -> bool:
    return isinstance(value, int) or (isinstance(value, str) and value.lower() in ("train", "test"))


def _parse_net_args(args, phase, weights):
    """pycaffe's two signatures: ``Net(file, phase, ...)`` and ``Net(file, weights, phase)``."""
    if len(args) == 1 and phase is not None and weights is None and not _looks_like_phase(args[0]):
        weights = args[0]  # Net(file, weights, phase=TEST)
    elif len(args) == 1:
        if phase is not None:
            raise CaffeCompatError("Net(): phase given twice")
        phase = args[0]
    elif len(args) == 2:
        if weights is not None or phase is not None:
            raise CaffeCompatError("Net(file, weights, phase): weights/phase given twice")
        weights, phase = args
    elif len(args) > 2:
        raise CaffeCompatError(f"Net(): expected (file, phase) or (file, weights, phase), got {len(args) + 1} "
                               f"positional arguments")
    if phase is None:
        raise CaffeCompatError("Net(): the phase (caffe.TRAIN or caffe.TEST) is required, as in pycaffe")
    return PHASE_NAMES[phase_value(phase)], weights


class Net:
    """pycaffe's ``caffe.Net`` over a :class:`~caffe_compat.net.CaffeNet` (``net.torch_net``)."""

    def __init__(self, network_file, *args, phase=None, weights=None, level: int = 0, stages=()):
        phase, weights = _parse_net_args(args, phase, weights)
        self._source = read_net(str(network_file) if not isinstance(network_file, caffe_pb2.NetParameter)
                                else network_file)
        self._phase, self._level, self._stages = phase, int(level), tuple(stages)
        self._seed = _MODE["seed"] if _MODE["seed"] is not None else 0
        self._device = current_device()
        cnet = CaffeNet(self._source, phase=phase, level=self._level, stages=self._stages, seed=self._seed,
                        weights=str(weights) if weights is not None else None)
        self._cnet = cnet.to(self._device)
        self._param_mirrors: dict = {}
        self._pending_inputs: set[str] = set()
        self._last = None
        self._warned_no_backward = False
        self._blobs: OrderedDict[str, Blob] = OrderedDict()
        self._sync_blobs_with_net()

    # ------------------------------------------------------------------------------ structure

    @property
    def torch_net(self) -> CaffeNet:
        """The underlying CaffeNet (an ``nn.Module``)."""
        return self._cnet

    @property
    def blobs(self) -> OrderedDict:
        return self._blobs

    @property
    def params(self) -> OrderedDict:
        out = OrderedDict()
        for step in self._cnet.steps:
            if step.module_key is not None:
                n = len(self._cnet.layers[step.module_key].caffe_blobs())
                if n:
                    out[step.name] = [ParamBlob(self, step.module_key, i) for i in range(n)]
        return out

    @property
    def layers(self) -> list[LayerView]:
        params = self.params
        return [LayerView(s.name, s.type, params.get(s.name, []) if s.module_key is not None else [])
                for s in self._cnet.steps]

    @property
    def _layer_names(self) -> list[str]:
        return self._cnet.layer_names

    @property
    def top_names(self) -> OrderedDict:
        return OrderedDict((s.name, list(s.tops)) for s in self._cnet.steps)

    @property
    def bottom_names(self) -> OrderedDict:
        return OrderedDict((s.name, list(s.bottoms)) for s in self._cnet.steps)

    @property
    def inputs(self) -> list[str]:
        return self._cnet.input_names

    @property
    def outputs(self) -> list[str]:
        return self._cnet.output_names

    @property
    def phase(self) -> int:
        return phase_value(self._phase)

    def _sync_blobs_with_net(self) -> None:
        """One Blob per blob of the CaffeNet, in its order; existing blobs keep their memory when the shape
        is unchanged.  Loss tops get ``loss_weight`` as diff (Caffe's SetLossWeights)."""
        old = self._blobs
        self._blobs = OrderedDict()
        for name, shape in self._cnet.blob_shapes.items():
            blob = old.get(name)
            if blob is None:
                blob = Blob(name, shape, self._device, self)
            elif blob.shape != tuple(shape):
                blob._realloc(tuple(shape))
            self._blobs[name] = blob
        for name, weight in self._cnet.loss_weights.items():
            self._blobs[name]._diff.fill(weight)

    # ------------------------------------------------------------------------------ reshaping

    def _blob_reshaped(self, name: str) -> None:
        if name in self._cnet.input_names:
            self._pending_inputs.add(name)
            try:
                self.reshape()
            except CaffeCompatError:
                pass  # the inputs disagree for now; applied (or raised) at reshape()/forward()

    def reshape(self) -> None:
        """Apply the input shapes set by ``blob.reshape`` to the whole net (pycaffe's ``net.reshape()``)."""
        if not self._pending_inputs:
            return
        shapes = {n: self._blobs[n].shape for n in self._cnet.input_names}
        source = caffe_pb2.NetParameter()
        source.CopyFrom(self._source)
        for layer in source.layer:
            if layer.type == "Input" and any(t in shapes for t in layer.top):
                given = [list(s.dim) for s in layer.input_param.shape]
                per_top = given * len(layer.top) if len(given) == 1 else given
                del layer.input_param.shape[:]
                for top, dims in zip(layer.top, per_top):
                    layer.input_param.shape.add().dim.extend(shapes.get(top, dims))
        new = CaffeNet(source, phase=self._phase, level=self._level, stages=self._stages, seed=self._seed)
        new = new.to(self._device)
        _transplant_state(self._cnet, new)
        self._cnet = new
        self._source = source
        self._pending_inputs.clear()
        self._last = None
        self._sync_blobs_with_net()

    # ------------------------------------------------------------------------------ weights

    def _upload_params(self) -> None:
        for mirror in self._param_mirrors.values():
            mirror.device()

    def _forget_param_mirrors(self) -> None:
        for mirror in self._param_mirrors.values():
            mirror.head = "device"

    def copy_from(self, path) -> None:
        """Load weights by layer name from a caffemodel (``CopyTrainedLayersFrom``)."""
        self._upload_params()
        self._cnet.load_caffemodel(str(path))
        self._forget_param_mirrors()

    def save(self, path) -> None:
        """Write the weights as a binary caffemodel (``Net::ToProto``, Split layers included, as Caffe)."""
        self._upload_params()
        self._cnet.save_caffemodel(str(path))

    def set_input_arrays(self, data, labels) -> None:
        """Feed the first layer, a MemoryData layer (pycaffe's checks: float32, C-contiguous, 4-D data)."""
        _set_input_arrays(self._cnet, data, labels)

    # ------------------------------------------------------------------------------ forward / backward

    @property
    def _needs_backward(self) -> bool:
        return self._cnet.force_backward or bool(self._cnet.loss_weights)

    def _step_index(self, name: str) -> int:
        try:
            return self._cnet.layer_names.index(name)
        except ValueError:
            raise FormatError(f"no layer named '{name}' in net '{self._cnet.name}'") from None

    def forward(self, blobs=None, start=None, end=None, **kwargs) -> dict:
        """pycaffe's ``net.forward``: keyword inputs are copied into the input blobs first; returns
        ``{blob: data}`` for the outputs (or ``end``'s tops) plus ``blobs``."""
        blobs = list(blobs or [])
        if kwargs:
            if set(kwargs) != set(self.inputs):
                raise CaffeCompatError(f"forward(): input blob arguments {sorted(kwargs)} do not match the net "
                                       f"inputs {self.inputs}")
            for name, value in kwargs.items():
                value = np.asarray(value)
                if value.shape[:1] != self._blobs[name].shape[:1]:
                    raise ShapeMismatchError(f"forward(): input '{name}' is not batch sized: {value.shape[:1]} vs "
                                             f"{self._blobs[name].shape[:1]} (reshape the blob first)")
                self._blobs[name].data[...] = value
        if self._pending_inputs:
            self.reshape()
        self._upload_params()
        steps = self._cnet.steps
        first = 0 if start is None else self._step_index(start)
        last = len(steps) - 1 if end is None else self._step_index(end)
        if start is None:
            feed = {n: self._blobs[n]._data.device() for n in self._cnet.input_names}
        else:
            feed, produced = {}, set()
            for step in steps[first:last + 1]:
                for b in step.bottoms:
                    if b not in produced and b not in feed:
                        feed[b] = self._blobs[b]._data.device()
                produced.update(step.tops)
        with torch.set_grad_enabled(self._needs_backward):
            result = self._cnet.run(feed, start=start, end=end)
        for name, tensor in result.items():
            self._blobs[name]._data.assign(tensor)
        self._last = result
        outputs = set((list(steps[last].tops) if end is not None else self.outputs) + blobs)
        return {name: self._blobs[name].data for name in outputs}

    def backward(self, diffs=None, start=None, end=None, **kwargs) -> dict:
        """pycaffe's ``net.backward``: keyword top diffs are copied into the output blobs first; every
        computed blob diff is written and parameter diffs accumulate.  Returns ``{blob: diff}`` for the
        inputs plus ``diffs``."""
        if start is not None or end is not None:
            raise CaffeCompatError("backward(start=..., end=...) is not supported; run the whole backward")
        diffs = list(diffs or [])
        if kwargs:
            if set(kwargs) != set(self.outputs):
                raise CaffeCompatError(f"backward(): top diff arguments {sorted(kwargs)} do not match the net "
                                       f"outputs {self.outputs}")
            for name, value in kwargs.items():
                value = np.asarray(value)
                if value.shape[:1] != self._blobs[name].shape[:1]:
                    raise ShapeMismatchError(f"backward(): diff '{name}' is not batch sized")
                self._blobs[name].diff[...] = value
        outputs = set(self.inputs + diffs)
        if self._last is None:
            raise CaffeCompatError("backward() needs a forward() first")
        if not self._needs_backward:
            if not self._warned_no_backward:
                warnings.warn(f"net '{self._cnet.name}' has no loss and no force_backward: Caffe computes no "
                              f"gradient, so backward() changes nothing", RuntimeWarning, stacklevel=2)
                self._warned_no_backward = True
            return {name: self._blobs[name].diff for name in outputs}
        self._upload_params()
        last = self._last
        top_diffs = {n: self._blobs[n]._diff.device() for n in self.outputs
                     if n in last and last[n].requires_grad}
        params = [p for p in self._cnet.parameters() if p.requires_grad]
        before = {id(p): _grad_of(p) for p in params}
        computed = self._cnet.backward(last, top_diffs, loss=False)
        with torch.no_grad():
            for p in params:  # keep the .grad tensors (and the numpy views on them) in place
                old = before[id(p)]
                if p.grad is not old:
                    old.copy_(p.grad)
                    p.grad = old
        self._forget_param_mirrors()
        for name, grad in computed.items():
            target = last.diff_targets.get(name)
            if target is not None and target.requires_grad:
                self._blobs[name]._diff.assign(grad)
        return {name: self._blobs[name].diff for name in outputs}

    def __repr__(self) -> str:
        return f"Net({self._cnet.name!r}, phase={self._phase!r}, device={self._device}, blobs={len(self._blobs)})"


def _set_input_arrays(cnet: CaffeNet, data, labels) -> None:
    """pycaffe's ``Net::set_input_arrays`` on ``cnet``: its first layer must be MemoryData; float32,
    C-contiguous arrays, 4-D data, labels one per row."""
    first = cnet.steps[0] if cnet.steps else None
    if first is None or first.type != "MemoryData":
        raise CaffeCompatError("set_input_arrays may only be called if the first layer is a MemoryData layer")
    data, labels = np.asarray(data), np.asarray(labels)
    for what, arr in (("data", data), ("labels", labels)):
        if arr.dtype != np.float32:
            raise CaffeCompatError(f"set_input_arrays: {what} must be float32, got {arr.dtype}")
        if not arr.flags["C_CONTIGUOUS"]:
            raise CaffeCompatError(f"set_input_arrays: {what} must be C contiguous")
    if data.ndim != 4:
        raise ShapeMismatchError(f"set_input_arrays: data must be 4-d, got shape {data.shape}")
    if labels.ndim == 1:
        labels = labels[:, None, None, None]
    cnet.layers[first.module_key].set_input_arrays(data, labels)


class SolverNet(CaffeNet):
    """A solver's TRAIN or TEST net: a :class:`~caffe_compat.net.CaffeNet` (unchanged: ``params`` are torch
    tensors, ``layers`` the port modules, ``forward`` returns torch blobs, ``phase`` is ``"train"``/``"test"``)
    plus pycaffe's ``Net`` names that CaffeNet lacks, so that old solver scripts run:

    * ``input_arrays``: each Input top -> a float32 numpy array, zero-filled like a fresh Caffe blob (the
      solver's ``inputs`` / ``test_inputs[i]``); a forward not given an Input top reads it from here.
    * ``blobs``: pycaffe's ``net.blobs`` (every blob, Caffe's order).  An Input blob's ``data`` is its array
      in ``input_arrays`` (``blobs['data'].data[...] = x`` feeds the next ``solver.step`` exactly like
      ``solver.inputs['data'][...] = x``; ``reshape`` replaces it by zeros of the new shape).  Any other
      blob's ``data`` is a host copy of its value after the last forward (solver step, test, or
      ``forward()``), zeros before the first; writing to it changes nothing.  Blob ``diff`` is not kept
      (use ``params[layer][i].grad`` or :class:`Net`).  Like Caffe, which keeps every blob allocated, the
      net keeps the last forward's blobs (detached) until the next forward starts, so peak memory does
      not grow; ``keep_blobs = False`` keeps none (then those blobs read as zeros).
    * ``copy_from(path)``, ``save(path)``, ``set_input_arrays(data, labels)``, ``inputs``, ``outputs``,
      ``top_names``, ``bottom_names``, ``_layer_names``.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.input_arrays: dict = {name: np.zeros(self.blob_shapes[name], dtype=np.float32)
                                   for name in self.input_names}
        self.keep_blobs = True
        self._last_blobs: dict = {}
        self._host_values: dict = {}

    # ------------------------------------------------------------------------------ forward

    def forward(self, **inputs):
        """CaffeNet's forward; an Input top not given is read from ``input_arrays`` (pycaffe's
        ``net.forward()`` reads the input blobs)."""
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
        try:
            value = self.input_arrays[name]
        except KeyError:
            raise CaffeCompatError(f"net '{self.name}': '{name}' is not an input blob; the inputs are "
                                   f"{self.input_names}") from None
        if not (isinstance(value, np.ndarray) and value.dtype == np.float32 and value.flags["C_CONTIGUOUS"]
                and value.flags["WRITEABLE"]):
            if torch.is_tensor(value):
                value = value.detach().to("cpu")
            value = np.array(value, dtype=np.float32, order="C")
            self.input_arrays[name] = value
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
        _set_input_arrays(self, data, labels)


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


def _transplant_state(old: CaffeNet, new: CaffeNet) -> None:
    """Give ``new`` (same layers, other input shapes) the very tensors of ``old``'s blobs and the state of
    its data layers, so that views on parameters and their gradients stay valid."""
    for key, module in new.layers.items():
        previous = old.layers[key]
        old_blobs, new_blobs = previous.caffe_blobs(), module.caffe_blobs()
        for i, (a, b) in enumerate(zip(old_blobs, new_blobs)):
            if tuple(a.shape) != tuple(b.shape):
                raise ShapeMismatchError(f"layer '{module.layer_name}': blob {i} would change shape from "
                                         f"{tuple(a.shape)} to {tuple(b.shape)} with the new input shape")
        for i, blob in enumerate(old_blobs):
            module.share_caffe_blob(i, blob)
        for attr in ("_data", "_labels", "position", "_generator", "generator", "order", "_stream"):
            if attr in previous.__dict__:
                setattr(module, attr, previous.__dict__[attr])

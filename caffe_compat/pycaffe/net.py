"""pycaffe's ``caffe.Net`` over a :class:`~caffe_compat.net.CaffeNet`: ``import caffe_compat as caffe`` runs
old pycaffe inference and fine-tuning scripts.

::

    import caffe_compat as caffe
    caffe.set_mode_gpu(); caffe.set_device(0)
    net = caffe.Net("deploy.prototxt", "weights.caffemodel", caffe.TEST)   # or Net(proto, caffe.TEST, weights=...)
    net.blobs["data"].reshape(1, 3, 224, 224)
    net.blobs["data"].data[...] = transformer.preprocess("data", image)
    prob = net.forward()["prob"]

What is reproduced from pycaffe / Caffe:

* Both constructors, ``Net(file, phase, weights=..., level=..., stages=...)`` and ``Net(file, weights,
  phase)``; the device and filler seed are those of the mode when the net is built
  (:mod:`caffe_compat.pycaffe._mode`).
* ``net.blobs``: every blob in Caffe's creation order (automatic Split tops included), each a
  :class:`~caffe_compat.pycaffe.blob.Blob` whose ``data``/``diff`` keep their memory: ``forward()`` copies
  its results into them, and what ``forward()`` returns are these very arrays (as in pycaffe, copy them to
  keep them past the next forward).  A blob written in place holds the value after the last in-place layer.
* ``blob.reshape(*shape)`` on a net input re-infers every shape (the net is rebuilt with the new Input shape,
  keeping the same parameter tensors); when the inputs are inconsistent for a moment (two inputs reshaped
  one after the other) the new shapes are applied at ``net.reshape()`` / the next ``forward()``.
* ``backward()`` follows Caffe's ``Net::Backward``: the top gradients are the current ``.diff`` of the output
  blobs; a loss top's diff is initialised to its ``loss_weight`` (Caffe's ``SetLossWeights``).  Blobs whose
  diff Caffe computes are overwritten; the others keep their diff.  **Parameter diffs accumulate** over
  backward calls (Caffe only clears them in the Solver).  A net with neither a loss nor ``force_backward``
  has nothing to back-propagate (Caffe skips every layer): ``backward()`` then changes nothing and warns.
* ``net.params[layer][i].data`` / ``.diff`` (:class:`~caffe_compat.pycaffe.blob.ParamBlob`), ``layers``,
  ``_layer_names``, ``top_names``, ``bottom_names``, ``inputs``, ``outputs``, ``phase``, ``copy_from``,
  ``save``, ``set_input_arrays`` (MemoryData, with pycaffe's checks: :func:`set_input_arrays_of`).

Not reproduced: ``backward(start=..., end=...)`` and ``forward(start=...)`` past an in-place chain start
(``start`` works for layers that read blobs already computed).
"""

from __future__ import annotations

import warnings
from collections import OrderedDict

import numpy as np
import torch

from caffe_compat.errors import CaffeCompatError, FormatError, ShapeMismatchError
from caffe_compat.io import read_net
from caffe_compat.net import CaffeNet
from caffe_compat.net_graph import PHASE_NAMES, phase_value
from caffe_compat.proto import caffe_pb2
from caffe_compat.pycaffe._mode import current_device, filler_seed
from caffe_compat.pycaffe.blob import Blob, ParamBlob, grad_of
from caffe_compat.pycaffe.layer import LayerView

__all__ = ["Net", "set_input_arrays_of"]


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
        self._seed = filler_seed()
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
        set_input_arrays_of(self._cnet, data, labels)

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
        before = {id(p): grad_of(p) for p in params}
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


def set_input_arrays_of(cnet: CaffeNet, data, labels) -> None:
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

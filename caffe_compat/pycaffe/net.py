"""pycaffe's ``caffe.Net`` over a :class:`~caffe_compat.net.CaffeNet`: ``import caffe`` (the alias,
:mod:`caffe_compat.alias`) or ``import caffe_compat as caffe`` runs old pycaffe inference and fine-tuning
scripts.

::

    import caffe
    caffe.set_mode_gpu(); caffe.set_device(0)
    net = caffe.Net("deploy.prototxt", "weights.caffemodel", caffe.TEST)   # or Net(proto, caffe.TEST, weights=...)
    net.blobs["data"].reshape(1, 3, 224, 224)
    net.blobs["data"].data[...] = transformer.preprocess("data", image)
    prob = net.forward()["prob"]

What is reproduced from pycaffe / Caffe:

* Every constructor form, ``Net(file, phase)``, ``Net(file, weights, phase)``, ``Net(file, phase,
  weights=..., level=..., stages=...)``; the device and filler seed are those of the mode when the net is
  built (:mod:`caffe_compat.pycaffe._mode`).  A net or weights file that cannot be opened is a
  RuntimeError (:class:`~caffe_compat.errors.NetFileMissingError`), as pycaffe's ``CheckFile`` raises.
* ``net.blobs``: every blob in Caffe's creation order (automatic Split tops included), each a
  :class:`~caffe_compat.pycaffe.blob.Blob` whose ``data``/``diff`` keep their memory: ``forward()`` copies
  its results into them, and what ``forward()`` returns are these very arrays (as in pycaffe, copy them to
  keep them past the next forward).  A blob written in place holds the value after the last in-place layer.
  The tops of a DummyData layer with a constant filler are filled once, at construction, and then read
  from the blobs (Caffe does not refill them): what a script writes into them (labels) is what the
  following forwards use.
* ``blob.reshape(*shape)`` on a net input reshapes that blob alone (Caffe's ``Blob::Reshape``); the other
  blobs keep their shapes until ``net.reshape()`` or the next ``forward()`` re-infers every shape (the net is
  rebuilt with the new Input shapes, keeping the same parameter tensors and its Python layers' objects,
  which are reshaped, not set up again, as Caffe's ``Net::Reshape``), so a Python layer's ``reshape`` runs
  as often as in Caffe for ``blob.reshape(...); net.reshape(); net.forward()``.  ``net.reshape()`` of a
  net with Python layers reshapes it even when no input changed (their ``reshape`` may shape their tops
  otherwise now).  A solver's nets (:mod:`caffe_compat.pycaffe.solver`) still re-infer at once.
* ``forward(blobs=None, start=None, end=None, **inputs)`` / ``_forward(start_index, end_index)``: Caffe's
  ``ForwardFromTo``; with ``start`` the layers read the blobs' stored data; returns ``{blob: data}`` for
  the outputs (``end``'s tops when given) plus ``blobs``.  A ``start``/``end`` (of ``backward`` too) naming
  no layer is a ValueError (:class:`~caffe_compat.errors.LayerNameError`), as pycaffe's ``list.index``.
* ``backward(diffs=None, start=None, end=None, **top_diffs)`` / ``_backward(start_index, end_index)``:
  Caffe's ``Net::Backward`` / ``BackwardFromTo``: the top gradients are the current ``.diff`` of the blobs;
  a loss top's diff is initialised to its ``loss_weight`` (Caffe's ``SetLossWeights``).  Blobs whose diff
  Caffe computes are overwritten; the others keep their diff.  **Parameter diffs accumulate** over
  backward calls (``clear_param_diffs()`` or the Solver clears them).  A net with neither a loss nor
  ``force_backward`` has nothing to back-propagate (Caffe skips every layer): ``backward()`` then changes
  nothing and warns.  Ranges: :mod:`caffe_compat.pycaffe.net_backward`.  Returns ``{blob: diff}`` for the
  inputs (``end``'s bottoms when given) plus ``diffs``.
* Layer callbacks, ``before_forward(fn)``, ``after_forward(fn)``, ``before_backward(fn)``,
  ``after_backward(fn)`` (``Net::add_before_forward`` ... as ``_caffe.cpp`` binds them): each ``fn(i)`` is
  called with the layer index (``_layer_names`` numbering, Split layers counted) just before / after layer
  ``i``'s Forward or Backward, in the order registered, for the layers a run visits: ascending over
  ``forward``'s range, descending over ``backward``'s; Caffe's ``BackwardFromTo`` calls them for every layer
  of the range, those that need no backward included (and so does a net with nothing to back-propagate).
  Weights a ``before_forward(i)`` callback writes are what layer ``i`` reads.  In ``after_forward(i)`` layer
  ``i``'s tops are in ``blobs`` (an in-place top: the value after layer ``i``);
  in ``after_backward(i)`` its bottoms' diffs and its parameter diffs.  While backward callbacks are
  registered the backward runs one layer at a time (one vector-Jacobian product per layer instead of one for
  the whole range), and diffs a callback writes are what the next layers read; without callbacks nothing
  changes.  What a forward callback writes into a blob's ``data`` is that blob's value for the rest of the
  run (layer ``i``'s bottoms are checked before it runs, its tops after its ``after_forward`` callbacks), as
  Caffe's layers read the blob's memory.  A solver's ``step``/``solve``/``test`` call them too
  (:mod:`caffe_compat.pycaffe.solver`).
* pycaffe's private members scripts use: ``_blobs`` (the blobs in blob order), ``_blob_loss_weights`` (a
  list in blob order), ``_inputs``/``_outputs`` (blob indices), ``_top_ids(i)``/``_bottom_ids(i)`` (blob
  indices of layer ``i``'s tops/bottoms; an in-place top is its bottom's blob), ``_set_input_arrays(data,
  labels)`` (labels already n × 1 × 1 × 1).
* ``net.params[layer][i].data`` / ``.diff`` (:class:`~caffe_compat.pycaffe.blob.ParamBlob`, valid as long
  as someone holds them, even after the net is gone), ``layers`` (``type``, ``name``, ``blobs``,
  ``reshape(bottom, top)``, ``setup`` (a built-in's: a TypeError); a user Python layer's also the user
  object's methods and attributes, as pycaffe hands back that object), ``layer_dict``, ``_layer_names``,
  ``top_names``, ``bottom_names``, ``inputs``, ``outputs``, ``blob_loss_weights``, ``_blob_names``, ``name``,
  ``phase``.
* Weights (:mod:`caffe_compat.pycaffe.net_params`): ``copy_from``, ``save``, ``save_hdf5``, ``load_hdf5``,
  ``share_with``, ``clear_param_diffs``, ``set_input_arrays``; batches
  (:mod:`caffe_compat.pycaffe.net_batch`): ``forward_all``, ``forward_backward_all``.
"""

from __future__ import annotations

import os
import warnings
from collections import OrderedDict

import numpy as np
import torch

from caffe_compat.errors import (CaffeCompatError, LayerNameError, LayerSetupError, NetFileMissingError,
                                 ShapeMismatchError)
from caffe_compat.io import read_net
from caffe_compat.io.path_or_text import is_path
from caffe_compat.layers.python_user import Layer, UserPythonLayer, keeping_user_objects
from caffe_compat.net import CaffeNet
from caffe_compat.net_graph import PHASE_NAMES, phase_value
from caffe_compat.net_log import quiet
from caffe_compat.proto import caffe_pb2
from caffe_compat.pycaffe._mode import current_device, filler_seed
from caffe_compat.pycaffe.blob import Blob, ParamBlob, grad_of
from caffe_compat.pycaffe.net_backward import backward_layers, backward_range
from caffe_compat.pycaffe.net_batch import NetBatchMixin
from caffe_compat.pycaffe.net_params import NetParamsMixin, is_hdf5_weights, set_input_arrays_of, transplant_state

__all__ = ["Net", "NetLayer", "set_input_arrays_of"]

_CALLBACKS = ("before_forward", "after_forward", "before_backward", "after_backward")


def _looks_like_phase(value) -> bool:
    return isinstance(value, int) or (isinstance(value, str) and value.lower() in ("train", "test"))


def _check_file(value) -> None:
    """pycaffe's ``CheckFile``: a file name that cannot be opened for reading is a RuntimeError, raised
    before anything is built (prototxt text and parsed messages, which we also accept, are not checked)."""
    if isinstance(value, caffe_pb2.NetParameter) or not is_path(value):
        return
    if not os.path.exists(value):  # stat only: a FIFO is never opened here (the readers refuse it)
        raise NetFileMissingError(f"{os.fspath(value)}: no such file")
    if not os.access(value, os.R_OK):
        raise NetFileMissingError(f"{os.fspath(value)}: cannot be opened for reading")


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


class NetLayer:
    """pycaffe's ``net.layers[i]``: ``type``, ``name``, ``blobs`` (its parameter blobs), ``setup(bottom, top)``
    (see :meth:`setup`) and ``reshape(bottom, top)``, which sets the top blobs' shapes from the bottoms' by the
    layer's shape rule (Caffe's ``Layer::Reshape``).

    For a user Python layer pycaffe hands back the user's own ``caffe.Layer`` object, so scripts call its
    methods and read or set its attributes (``solver.net.layers[0].set_roidb(roidb)``, ``.param_str``):
    every other attribute is the user object's, read and written there, and ``setup``/``reshape`` are its own; its
    ``__class__`` is the user's class, so ``isinstance(net.layers[0], MyDataLayer)`` holds as in pycaffe.
    A built-in layer's ``__class__`` is ``caffe.Layer``: pycaffe wraps every ``net.layers`` entry in the one
    ``Layer`` class _caffe.cpp registers, so ``isinstance(net.layers[i], caffe.Layer)`` holds for all."""

    _OWN = ("_net", "_index", "_user", "name", "type", "blobs")

    def __init__(self, net: "Net", index: int):
        step = net._cnet.steps[index]
        self._net, self._index = net, index
        self.name, self.type = step.name, step.type
        self.blobs = net._layer_param_blobs(step)
        module = net._cnet.layers[step.module_key] if step.module_key is not None else None
        self._user = module.user if isinstance(module, UserPythonLayer) else None

    @property
    def __class__(self):
        user = self.__dict__.get("_user")
        return Layer if user is None else type(user)

    def __getattr__(self, name: str):
        user = self.__dict__.get("_user")
        if user is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(user, name)

    def __setattr__(self, name: str, value) -> None:
        user = self.__dict__.get("_user")
        if name in self._OWN or user is None:
            object.__setattr__(self, name, value)
        else:
            setattr(user, name, value)

    def setup(self, bottom, top) -> None:
        """pycaffe's ``Layer.setup`` (Caffe's ``LayerSetUp``): a user Python layer's own ``setup``; a built-in
        layer's raises :class:`~caffe_compat.errors.LayerSetupError` (a TypeError, as pycaffe's for Python
        lists), its port being set up once, when the net is built.  pycaffe's layers have no ``forward`` /
        ``backward`` (_caffe.cpp binds ``blobs``, ``setup``, ``reshape`` and ``type``): a built-in's are
        AttributeErrors here too."""
        if self._user is not None:
            self._user.setup(bottom, top)
            return
        raise LayerSetupError(f"layer '{self.name}' ({self.type}): a built-in layer is set up when the net is built; "
                              f"caffe-compat cannot run its LayerSetUp again (use net.reshape() or "
                              f"net.layers[i].reshape(bottom, top) for new shapes)")

    def reshape(self, bottom, top) -> None:
        if self._user is not None:
            self._user.reshape(bottom, top)
            return
        step = self._net._cnet.steps[self._index]
        shapes = [tuple(b.shape) for b in bottom]
        if step.module_key is None:  # a Split: every top has the bottom's shape
            tops = [shapes[0]] * len(top)
        else:
            layer = self._net._cnet.layers[step.module_key]
            inferred = type(layer).infer(layer.param, shapes)
            if inferred is None:
                raise CaffeCompatError(f"layer '{self.name}' ({self.type}): its port has no shape rule to reshape by")
            tops = list(inferred.tops)
        if len(tops) != len(top):
            raise CaffeCompatError(f"layer '{self.name}' ({self.type}): {len(top)} tops given, it has {len(tops)}")
        for blob, shape in zip(top, tops):
            blob.reshape(*shape)

    def __repr__(self) -> str:
        return f"Layer({self.name!r}, type={self.type!r})"


class Net(NetParamsMixin, NetBatchMixin):
    """pycaffe's ``caffe.Net`` over a :class:`~caffe_compat.net.CaffeNet` (``net.torch_net``)."""

    def __init__(self, network_file, *args, phase=None, weights=None, level: int = 0, stages=()):
        phase, weights = _parse_net_args(args, phase, weights)
        _check_file(network_file)
        if weights is not None:
            _check_file(weights)
        source = read_net(str(network_file) if not isinstance(network_file, caffe_pb2.NetParameter)
                          else network_file)
        seed, device = filler_seed(), current_device()
        hdf5 = weights is not None and is_hdf5_weights(weights)  # CopyTrainedLayersFrom reads HDF5 too
        cnet = CaffeNet(source, phase=phase, level=int(level), stages=tuple(stages), seed=seed,
                        weights=str(weights) if weights is not None and not hdf5 else None)
        self._attach(cnet.to(device), source, phase, int(level), tuple(stages), seed, device)
        if hdf5:
            self.load_hdf5(weights)

    @classmethod
    def over(cls, cnet: CaffeNet, source: caffe_pb2.NetParameter, seed: int = 0, **extra) -> "Net":
        """The pycaffe view of an existing CaffeNet (its state already in ``source``), e.g. a solver's net."""
        net = cls.__new__(cls)
        for name, value in extra.items():
            setattr(net, name, value)
        net._attach(cnet, source, cnet.phase, None, (), seed, cnet._device())
        return net

    def _attach(self, cnet, source, phase, level, stages, seed, device) -> None:
        self._cnet, self._source = cnet, source
        self._phase, self._level, self._stages = phase, level, stages
        self._seed, self._device = seed, device
        self._param_mirrors: dict = {}
        self._pending_inputs: set[str] = set()
        self._last = None
        self._warned_no_backward = False
        self._callbacks: dict[str, list] = {kind: [] for kind in _CALLBACKS}
        self._blob_map: OrderedDict[str, Blob] = OrderedDict()
        self._sync_blobs_with_net()
        self._fill_kept_tops()

    # ------------------------------------------------------------------------------ structure

    @property
    def torch_net(self) -> CaffeNet:
        """The underlying CaffeNet (an ``nn.Module``)."""
        return self._cnet

    @property
    def name(self) -> str:
        return self._cnet.name

    @property
    def blobs(self) -> OrderedDict:
        return self._blob_map

    @property
    def _blob_names(self) -> list[str]:
        return list(self._blob_map)

    @property
    def blob_loss_weights(self) -> OrderedDict:
        """Every blob -> its loss weight (0 for blobs that are not part of the objective)."""
        return OrderedDict((name, float(self._cnet.loss_weights.get(name, 0.0))) for name in self._blob_map)

    def _layer_param_blobs(self, step) -> list:
        if step.module_key is None:
            return []
        n = len(self._cnet.layers[step.module_key].caffe_blobs())
        return [ParamBlob(self, step.module_key, i) for i in range(n)]

    @property
    def params(self) -> OrderedDict:
        out = OrderedDict()
        for step in self._cnet.steps:
            blobs = self._layer_param_blobs(step)
            if blobs:
                out[step.name] = blobs
        return out

    @property
    def layers(self) -> list[NetLayer]:
        return [NetLayer(self, i) for i in range(len(self._cnet.steps))]

    @property
    def layer_dict(self) -> OrderedDict:
        """Layer name -> ``net.layers[i]`` (pycaffe's ``layer_dict``)."""
        return OrderedDict(zip(self._layer_names, self.layers))

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

    # pycaffe's private members (the _caffe.cpp bindings its pycaffe.py builds the public ones from), which
    # scripts reach for too: views on the above, blob indices in ``_blob_names`` order.

    @property
    def _blobs(self) -> list[Blob]:
        """The blobs in blob order (``Net::blobs()``): ``net._blobs[i]`` is ``net.blobs[net._blob_names[i]]``."""
        return list(self._blob_map.values())

    @property
    def _blob_loss_weights(self) -> list[float]:
        """Every blob's loss weight, in blob order (``Net::blob_loss_weights()``)."""
        return list(self.blob_loss_weights.values())

    def _blob_indices(self, names) -> list[int]:
        index = {name: i for i, name in enumerate(self._blob_map)}
        return [index[name] for name in names]

    @property
    def _inputs(self) -> list[int]:
        """Blob indices of ``inputs`` (``Net::input_blob_indices()``)."""
        return self._blob_indices(self.inputs)

    @property
    def _outputs(self) -> list[int]:
        """Blob indices of ``outputs`` (``Net::output_blob_indices()``)."""
        return self._blob_indices(self.outputs)

    def _top_ids(self, i: int) -> list[int]:
        """Blob indices of layer ``i``'s tops (``Net::top_ids``; an in-place top is its bottom's blob)."""
        return self._blob_indices(self._cnet.steps[self._layer_index(i)].tops)

    def _bottom_ids(self, i: int) -> list[int]:
        """Blob indices of layer ``i``'s bottoms (``Net::bottom_ids``)."""
        return self._blob_indices(self._cnet.steps[self._layer_index(i)].bottoms)

    def _sync_blobs_with_net(self) -> None:
        """One Blob per blob of the CaffeNet, in its order; existing blobs keep their memory when the shape
        is unchanged.  Loss tops get ``loss_weight`` as diff (Caffe's SetLossWeights)."""
        old = self._blob_map
        self._blob_map = OrderedDict()
        for name, shape in self._cnet.blob_shapes.items():
            blob = old.get(name)
            if blob is None:
                blob = self._new_blob(name, shape)
            elif blob.shape != tuple(shape):
                blob._realloc(tuple(shape))
            self._blob_map[name] = blob
        for name, weight in self._cnet.loss_weights.items():
            self._blob_map[name]._diff.fill(weight)

    def _new_blob(self, name: str, shape) -> Blob:
        return Blob(name, shape, self._device, self)

    @property
    def _kept_tops(self) -> list[str]:
        """Tops of DummyData layers with a constant filler: filled once, then read from the blobs."""
        kept = []
        for step in self._cnet.steps:
            if step.type == "DummyData" and step.module_key is not None:
                refill = getattr(self._cnet.layers[step.module_key], "refill", [True] * len(step.tops))
                kept += [top for top, again in zip(step.tops, refill) if not again]
        return kept

    def _fill_kept_tops(self) -> None:
        """Caffe's DummyData setup fill of the constant tops (no random draw: the value is the filler's)."""
        kept = set(self._kept_tops)
        for step in self._cnet.steps:
            if step.type != "DummyData" or step.module_key is None:
                continue
            fillers = self._cnet.layers[step.module_key].fillers
            for top, filler in zip(step.tops, fillers):
                if top in kept:
                    self._blob_map[top]._data.fill(float(filler.value))

    def _feed_tensor(self, name: str) -> torch.Tensor:
        return self._blob_map[name]._data.device()

    # ------------------------------------------------------------------------------ reshaping

    def _blob_reshaped(self, name: str) -> None:
        """An input blob took a new shape: Caffe's ``Blob::Reshape`` changes that blob alone; the net takes the
        new shapes at ``net.reshape()`` or the next ``forward()`` (``Net::Reshape`` / each layer's Reshape)."""
        if name in self._cnet.input_names:
            self._pending_inputs.add(name)

    def reshape(self) -> None:
        """Apply the input shapes set by ``blob.reshape`` to the whole net (pycaffe's ``net.reshape()``).
        Caffe's ``Net::Reshape`` calls every layer's Reshape, a Python layer's ``reshape`` too: a net with
        Python layers is reshaped even when no input changed, so tops a Python layer now shapes otherwise
        (a data layer whose batch size the script changed) and every blob after them take their new shapes."""
        if not self._pending_inputs and not any(isinstance(m, UserPythonLayer) for m in self._cnet.layers.values()):
            return
        shapes = {n: self._blob_map[n].shape for n in self._cnet.input_names}
        source = caffe_pb2.NetParameter()
        source.CopyFrom(self._source)
        for layer in source.layer:
            if layer.type == "Input" and any(t in shapes for t in layer.top):
                given = [list(s.dim) for s in layer.input_param.shape]
                per_top = given * len(layer.top) if len(given) == 1 else given
                del layer.input_param.shape[:]
                for top, dims in zip(layer.top, per_top):
                    layer.input_param.shape.add().dim.extend(shapes.get(top, dims))
        users = {m.layer_name: m.user for m in self._cnet.layers.values() if isinstance(m, UserPythonLayer)}
        with keeping_user_objects(users), quiet():  # Caffe reshapes its layers: no set-up again, no Net::Init lines
            new = CaffeNet(source, phase=self._phase, level=self._level, stages=self._stages, seed=self._seed)
        new = new.to(self._device)
        transplant_state(self._cnet, new)
        self._replace_cnet(new)
        self._source = source
        self._pending_inputs.clear()
        self._last = None
        self._sync_blobs_with_net()

    def _replace_cnet(self, new: CaffeNet) -> None:
        self._cnet = new

    # ------------------------------------------------------------------------------ forward / backward

    @property
    def _needs_backward(self) -> bool:
        return self._cnet.force_backward or bool(self._cnet.loss_weights)

    def _step_index(self, name: str) -> int:
        try:
            return self._cnet.layer_names.index(name)
        except ValueError:
            raise LayerNameError(f"no layer named '{name}' in net '{self._cnet.name}'") from None

    def _layer_index(self, index: int) -> int:
        index = int(index)
        if not 0 <= index < len(self._cnet.steps):
            raise CaffeCompatError(f"net '{self._cnet.name}': layer index {index} out of range "
                                   f"(0..{len(self._cnet.steps) - 1})")
        return index

    def _layer_name(self, index: int) -> str:
        return self._cnet.steps[self._layer_index(index)].name

    def _set_from_kwargs(self, kwargs: dict, names: list[str], field: str, what: str) -> None:
        if set(kwargs) != set(names):
            raise CaffeCompatError(f"{what}(): blob arguments {sorted(kwargs)} do not match the net's "
                                   f"{'inputs' if field == 'data' else 'outputs'} {names}")
        for name, value in kwargs.items():
            value = np.asarray(value)
            if value.shape[:1] != self._blob_map[name].shape[:1]:
                raise ShapeMismatchError(f"{what}(): '{name}' is not batch sized: {value.shape[:1]} vs "
                                         f"{self._blob_map[name].shape[:1]} (reshape the blob first)")
            getattr(self._blob_map[name], field)[...] = value

    def forward(self, blobs=None, start=None, end=None, **kwargs) -> dict:
        """pycaffe's ``net.forward``: keyword inputs are copied into the input blobs first; returns
        ``{blob: data}`` for the outputs (or ``end``'s tops) plus ``blobs``."""
        blobs = list(blobs or [])
        if kwargs:
            self._set_from_kwargs(kwargs, self.inputs, "data", "forward")
        if self._pending_inputs:
            self.reshape()
        self._upload_params()
        steps = self._cnet.steps
        first = 0 if start is None else self._step_index(start)
        last = len(steps) - 1 if end is None else self._step_index(end)
        if start is None:
            feed = {n: self._feed_tensor(n) for n in self._cnet.input_names + self._kept_tops}
        else:
            feed, produced = {}, set()
            for step in steps[first:last + 1]:
                for b in step.bottoms:
                    if b not in produced and b not in feed:
                        feed[b] = self._feed_tensor(b)
                produced.update(step.tops)
            for name in self._kept_tops:
                if name not in feed and name in produced:
                    feed[name] = self._feed_tensor(name)
        with torch.set_grad_enabled(self._needs_backward):
            result = self._cnet.run(feed, start=start, end=end, step_hooks=self._forward_hooks())
        for name, tensor in result.items():
            self._blob_map[name]._data.assign(tensor)
        self._refetch_python_blobs()
        self._last = result
        outputs = set((list(steps[last].tops) if end is not None else self.outputs) + blobs)
        return {name: self._blob_map[name].data for name in outputs}

    def _refetch_python_blobs(self) -> None:
        """On CUDA ``net.params`` are host copies: after a forward the next read of a Python layer's blob
        fetches the device value, which the layer may have written (a copy the script wrote since the
        last upload stays the newest)."""
        for key, mirror in self._param_mirrors.items():
            module = self._cnet.layers[key[0]] if key[0] in self._cnet.layers else None
            if isinstance(module, UserPythonLayer) and key[2] == "data" and mirror.head != "host":
                mirror.head = "device"

    def _forward(self, start: int, end: int) -> None:
        """pycaffe's ``net._forward(start_index, end_index)`` (Caffe's ``ForwardFromTo``)."""
        self.forward(start=self._layer_name(start), end=self._layer_name(end))

    def backward(self, diffs=None, start=None, end=None, **kwargs) -> dict:
        """pycaffe's ``net.backward``: keyword top diffs are copied into the output blobs first; every
        computed blob diff is written and parameter diffs accumulate.  Returns ``{blob: diff}`` for the
        inputs (or ``end``'s bottoms) plus ``diffs``."""
        diffs = list(diffs or [])
        if kwargs:
            self._set_from_kwargs(kwargs, self.outputs, "diff", "backward")
        steps = self._cnet.steps
        last = len(steps) - 1 if start is None else self._step_index(start)
        first = 0 if end is None else self._step_index(end)
        outputs = set((list(steps[first].bottoms) if end is not None else self.inputs) + diffs)
        before, after = self._callbacks["before_backward"], self._callbacks["after_backward"]
        if not self._needs_backward:
            if not self._warned_no_backward:
                warnings.warn(f"net '{self._cnet.name}' has no loss and no force_backward: Caffe computes no "
                              f"gradient, so backward() changes nothing", RuntimeWarning, stacklevel=2)
                self._warned_no_backward = True
            for index in range(last, first - 1, -1):  # Caffe visits the layers, running no Backward
                for fn in before + after:
                    fn(index)
            return {name: self._blob_map[name].diff for name in outputs}
        self._upload_params()
        debug = self._last.debug if self._last is not None else None
        if debug is not None:
            debug.forget_bottom_diffs()
        if before or after:
            if first <= last:
                backward_layers(self, first, last, before, after)
        else:
            full = start is None and end is None and self._last is not None and \
                not self._last.step_outputs.keys() ^ set(range(len(steps)))
            if full:
                self._backward_all()
            elif first <= last:
                backward_range(self, first, last)
        if debug is not None and first <= last:  # BackwardFromTo's BackwardDebugInfo lines (net_debug)
            debug.log_backward(first, last)
        return {name: self._blob_map[name].diff for name in outputs}

    # ------------------------------------------------------------------------------ layer callbacks

    def before_forward(self, fn) -> None:
        """Call ``fn(i)`` just before layer ``i``'s forward (``Net::add_before_forward``), see the module
        docstring."""
        self._callbacks["before_forward"].append(fn)

    def after_forward(self, fn) -> None:
        """Call ``fn(i)`` just after layer ``i``'s forward, its tops already in ``blobs``."""
        self._callbacks["after_forward"].append(fn)

    def before_backward(self, fn) -> None:
        """Call ``fn(i)`` just before layer ``i``'s backward (``Net::add_before_backward``)."""
        self._callbacks["before_backward"].append(fn)

    def after_backward(self, fn) -> None:
        """Call ``fn(i)`` just after layer ``i``'s backward, its bottoms' diffs already in ``blobs`` (a
        ``caffe.NCCL``, which reduces once the whole backward is done, is not called)."""
        if not getattr(fn, "reduces_at_gradients_ready", False):
            self._callbacks["after_backward"].append(fn)

    @property
    def _has_forward_callbacks(self) -> bool:
        return bool(self._callbacks["before_forward"] or self._callbacks["after_forward"])

    @property
    def _has_backward_callbacks(self) -> bool:
        return bool(self._callbacks["before_backward"] or self._callbacks["after_backward"])

    def _forward_hooks(self):
        """The CaffeNet run's ``step_hooks`` for the forward callbacks (None, costing nothing, without any):
        after layer ``i`` its tops are copied into the blobs before the ``after_forward`` callbacks; what the
        callbacks write into a blob's ``data`` is written into the run's tensor of that blob (Caffe's blob
        memory), checked for layer ``i``'s bottoms before it runs and for its tops after it ran."""
        if not self._has_forward_callbacks:
            return None
        before, after = self._callbacks["before_forward"], self._callbacks["after_forward"]
        steps = self._cnet.steps

        def run_before(index: int, blobs) -> None:
            for fn in before:
                fn(index)
            self._upload_params()  # weights a callback wrote (a host copy on CUDA) are what the layer reads
            self._take_written(steps[index].bottoms, blobs)

        def run_after(index: int, blobs) -> None:
            for top in steps[index].tops:
                self._blob_map[top]._data.assign(blobs[top])
            for fn in after:
                fn(index)
            self._take_written(steps[index].tops, blobs)

        return run_before, run_after

    def _take_written(self, names, blobs) -> None:
        """Blob data a callback changed becomes the run's value of that blob, in place (Caffe's layers read
        and back-propagate through the blob's memory, so the later layers, and the backward of those that
        read it, see the written values); unchanged blobs are left alone."""
        for name in dict.fromkeys(names):
            value, blob = blobs.get(name), self._blob_map.get(name)
            if not torch.is_tensor(value) or blob is None:
                continue
            stored = blob._data.device()
            if stored.data_ptr() == value.data_ptr() or tuple(stored.shape) != tuple(value.shape):
                continue
            stored = stored.to(value.dtype)
            if not torch.equal(stored, value.detach()):
                value.data.copy_(stored)

    def _backward(self, start: int, end: int) -> None:
        """pycaffe's ``net._backward(start_index, end_index)`` (Caffe's ``BackwardFromTo``, start >= end)."""
        self.backward(start=self._layer_name(start), end=self._layer_name(end))

    def _backward_all(self) -> None:
        """The whole net's backward on the last (full) forward's graph."""
        last = self._last
        top_diffs = {n: self._blob_map[n]._diff.device() for n in self.outputs
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
                self._blob_map[name]._diff.assign(grad)

    def __repr__(self) -> str:
        return f"Net({self._cnet.name!r}, phase={self._phase!r}, device={self._device}, blobs={len(self._blob_map)})"

"""CaffeNet: a Caffe NetParameter (prototxt + optional caffemodel) as a ``torch.nn.Module``.

Building follows Caffe's ``Net::Init``:

1. ``FilterNet``: layers whose include/exclude NetStateRules the state (phase, level, stages) meets
   (:mod:`caffe_compat.net_graph`); the phase is fixed here, at construction.
2. ``InsertSplits``: a blob read by several layers gets an automatic Split layer whose tops are named
   ``<blob>_<producer>_<top index>_split_<k>``; they appear in the blobs like in pycaffe's ``net.blobs``.
3. Each layer is the registered port (:mod:`caffe_compat.layers`) built with its bottom shapes; the top
   shapes come from the port's ``output_shapes()``.  Learnable blobs are initialised with the layers'
   Caffe fillers from a seeded ``torch.Generator`` (an unset filler is constant 0, as in Caffe), then a
   caffemodel, when given, overwrites them by layer **name** (Caffe's ``CopyTrainedLayersFrom``).  The
   layers the caffemodel supplies are not filled first (they draw nothing from the generator: Caffe
   fills them from its own RNG, which no port reproduces, so only the final values matter), and the
   caffemodel is read in place (:mod:`caffe_compat.io.weights`).

Forward, the objective and backward are :mod:`caffe_compat.net_run`'s: a forward returns :class:`Blobs`,
every blob as pycaffe's ``net.blobs`` shows it after the pass, with Caffe's in-place semantics (and under
``torch.compile``, one graph for the whole net: see that module).

Parameters: ``net.params`` maps layer name -> that layer's blobs in Caffe order (pycaffe's
``net.params``; BatchNorm statistics are buffers but still listed).  Every blob carries ``lr_mult`` and
``decay_mult`` from its ParamSpec (default 1/1; blobs that are buffers, e.g. BatchNorm statistics, get
lr_mult 0 as Caffe's BatchNorm forces).  A parameter with ``lr_mult == 0`` gets ``requires_grad=False``:
Caffe then computes no diff for it (its diff stays 0).  ``ParamSpec.name`` shares a blob between layers:
both layers hold the *same* Parameter (gradients add up, as in Caffe where data and diff are shared).

Phase vs ``.train()/.eval()``: the Caffe phase (with level and stages) is fixed at construction and
decides which layers exist (include/exclude NetStateRules); ``.train()``/``.eval()`` never change that
layer set, nor ``net.phase``/``layer.phase`` (build a second net with the other phase, sharing weights
via ``load_state_dict``, for the other phase's layers).  The torch ``training`` flag starts as
``phase == "train"`` and decides the phase-dependent *behaviour* of the ports, as PyTorch users
expect: ``.eval()`` gives Caffe's TEST behaviour (Dropout is the identity; BatchNorm without an
explicit ``use_global_stats`` normalises with the stored global statistics and updates nothing; Data/
ImageData take the centre crop), ``.train()`` Caffe's TRAIN behaviour (Dropout drops; BatchNorm uses
batch statistics and updates its moving averages; random crops).  So with the flag left as built, every
layer computes exactly what Caffe computes in that phase.  Kept in both modes, as in Caffe: an explicit
``batch_norm_param { use_global_stats: ... }``; Caffe's quirk of drawing ``mirror`` in TEST too; and a
layer whose own ``phase`` field differs from the net's (a prototxt pinning, say, a BatchNorm to TEST in
a TRAIN net): ``train()``/``eval()`` leave such a layer in its own phase.  A layer whose ``phase`` equals
the net's follows the mode whether the prototxt wrote it or not (Caffe's ``ToProto``, and so saved
prototxts and checkpoints, write every layer's phase).

``force_backward: true``: inputs fed to a forward are made to require grad (if they do not already) so
that the input diffs exist, as with Caffe's force_backward.  Without it, input diffs are returned only
when the caller's input tensors require grad.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from caffe_compat.collector import collection_paused
from caffe_compat.errors import CaffeCompatError, FormatError, ShapeMismatchError, naming_file
from caffe_compat.io import read_net
from caffe_compat.io.weights import read_weights
from caffe_compat.layers import layer_class
from caffe_compat.layers.registry import blobs_overwritten
from caffe_compat.net_graph import PHASE_NAMES, filter_net, insert_splits, make_state, net_outputs
from caffe_compat.net_log import log_net_init
from caffe_compat.net_run import (Blobs, DataAheadOfGraph, GraphSegments, LayerStep, NetExecution, breaking_step,
                                  compile_net, data_steps, graph_breaking_step, step_whose_port_says, traces_whole,
                                  with_data_tops)
from caffe_compat.net_shapes import BudgetTracker, budget_tracker, layer_shapes
from caffe_compat.net_weights import (CaffemodelWeights, copy_weights_files, overwritten_layers,
                                      trained_layer_pairs)
from caffe_compat.proto import caffe_pb2

log = logging.getLogger("caffe_compat.net")

__all__ = ["Blobs", "CaffeNet", "DataAheadOfGraph", "GraphSegments", "LayerStep", "breaking_step", "compile_net",
           "copy_weights_files", "data_steps", "graph_breaking_step", "load_net", "step_whose_port_says",
           "traces_whole", "trained_layer_pairs", "with_data_tops"]


_DEFAULT_SPEC = caffe_pb2.ParamSpec()  # read only


def is_parameter(tensor) -> bool:
    """``isinstance(tensor, nn.Parameter)``, answered from the exact type for the two kinds a port's blobs
    are (Parameter's own isinstance check is Python code, ~1.5 us for a buffer; a net has hundreds)."""
    kind = type(tensor)
    return kind is nn.Parameter or (kind is not torch.Tensor and isinstance(tensor, nn.Parameter))


#: Names a ``ModuleDict`` key cannot take: its own attributes and methods (``add_module`` refuses them).
_MODULE_DICT_ATTRIBUTES = frozenset(dir(nn.ModuleDict()))


def module_key(layer_name: str, taken: set[str]) -> str:
    """A ``ModuleDict`` key from a Caffe layer name: ``/`` and ``.`` become ``__``; made unique, and kept off
    the ModuleDict's own attribute names (a layer named ``items`` or ``train`` gets ``items_2``)."""
    key = layer_name.replace("/", "__").replace(".", "__") or "_"
    candidate, n = key, 2
    while candidate in taken or candidate in _MODULE_DICT_ATTRIBUTES:
        candidate, n = f"{key}_{n}", n + 1
    return candidate


def _as_netparameter(net) -> caffe_pb2.NetParameter:
    """A (copied, upgraded to V2) NetParameter from a message, a path, bytes or prototxt text."""
    return read_net(net)


class CaffeNet(CaffemodelWeights, NetExecution, nn.Module):
    """A Caffe net as a torch module (see the module docstring for the semantics).

    ``net``: a NetParameter, a prototxt path or prototxt text (legacy formats are upgraded).
    ``phase``: ``"train"`` or ``"test"``; ``level``/``stages``: the NetState (``stages`` are added to the
    net's own ``state.stage``, ``level`` replaces its level when given).  ``weights``: caffemodel path or
    NetParameter copied in by layer name (name mismatches warn, or raise with ``strict=True``: see
    :meth:`load_caffemodel`).  ``seed``: seed of the generator used by the fillers.  ``fill=False``: the blobs
    are left uninitialised (no filler runs; for a caller that overwrites every one, as ``load_checkpoint``).
    """

    def __init__(self, net, phase: str = "test", level: int | None = None, stages=(), weights=None, seed: int = 0,
                 strict: bool = False, fill: bool = True):
        super().__init__()
        with collection_paused():  # every object built survives: collecting meanwhile finds nothing
            source = _as_netparameter(net)
            state = make_state(source, phase, level, stages)
            self.phase = PHASE_NAMES[state.phase]
            self.state = state
            self.name = source.name
            self.force_backward = bool(source.force_backward)
            self.debug_info = bool(source.debug_info)  # Caffe's debug_info_: log per-layer lines (net_debug)
            filtered = filter_net(source, state)
            self.net_param = insert_splits(filtered)
            self.layers = nn.ModuleDict()
            self.steps: list[LayerStep] = []
            self.blob_shapes: OrderedDict[str, tuple[int, ...]] = OrderedDict()
            self.loss_weights: OrderedDict[str, float] = OrderedDict()
            self._saved_params: list[caffe_pb2.LayerParameter] = []  # layer params as Caffe's ToProto writes them
            self._blob_specs: dict[tuple[str, int], tuple[float, float]] = {}  # (module key, i) -> (lr, decay)
            self._shared: list[tuple[str, int, str, int]] = []  # (sharer key, i, owner key, owner i)
            inferred, budget = budget_tracker(self.net_param, f"net '{self.name}'", lenient=True)
            stored = None if weights is None else read_weights(weights)
            if fill:
                blobs_of = self._build(filtered, overwritten_layers(filtered.layer, stored), inferred, budget)
                self.reinitialize(seed, skip=self._supplied_by(stored, blobs_of))
            else:  # the caller overwrites every blob (a checkpoint's state_dict): allocate, draw and write nothing
                blobs_of = self._build(filtered, frozenset(layer.name for layer in filtered.layer), inferred, budget)
            log_net_init(self, source)  # Caffe's Net::Init lines, when the net logger listens
            if stored is not None:
                self._load_stored([(weights, stored)], strict, blobs_of)
            self._set_built_modes()

    # ------------------------------------------------------------------------------ building

    def _build(self, filtered: caffe_pb2.NetParameter, overwritten: frozenset[str], inferred=None,
               budget: BudgetTracker | None = None) -> dict[str, list[torch.Tensor]]:
        """Build every layer in order; the layers named in ``overwritten`` get uninitialised blobs (the
        caffemodel about to be copied in overwrites them all: ``overwritten_layers``).  ``inferred``: the
        memory-budget inference of ``self.net_param`` (one entry per layer), whose shape rule answers the
        ports reuse where their bottoms' shapes are the ones it assumed; ``budget``: its tracker, told what the
        inference could not know (a data layer's tops, the layers after it) before it is allocated.  Returns every
        port's ``caffe_blobs()`` by module key, shares applied (what the rest of construction reads, asked once)."""
        blobs_of: dict[str, list[torch.Tensor]] = {}
        rules = [None] * len(self.net_param.layer) if inferred is None else [
            entry.rule for entry in inferred]
        user_layers = [(layer.name, layer.type) for layer in filtered.layer]
        next_user = 0
        producers: dict[str, str] = {}
        owners: dict[str, tuple[str, int, caffe_pb2.ParamSpec]] = {}
        keys: set[str] = set()
        saved_net = caffe_pb2.NetParameter()  # one copy of every layer (what Caffe's ToProto writes), not one each
        saved_net.layer.extend(self.net_param.layer)
        blob_shapes, default_phase, layer_modules = self.blob_shapes, self.phase, self.layers._modules
        for index, (layer, saved) in enumerate(zip(self.net_param.layer, saved_net.layer)):
            name, type_ = layer.name, layer.type
            bottoms, tops = tuple(layer.bottom), tuple(layer.top)
            automatic = not (next_user < len(user_layers) and user_layers[next_user] == (name, type_))
            if not automatic:
                next_user += 1
            phase = PHASE_NAMES.get(layer.phase, default_phase) if layer.HasField("phase") else default_phase
            bottom_shapes = [blob_shapes[b] for b in bottoms]  # insert_splits checked they exist
            if automatic:
                key, module = None, None
                top_shapes = [bottom_shapes[0]] * len(tops)
            else:
                cls = layer_class(layer)
                rule = rules[index]
                if inferred is not None and inferred[index].bottom_shapes != bottom_shapes:
                    # a data layer's top the inference could not know: ask the port, and budget the answer
                    # before anything of this layer is allocated
                    rule = None
                    if budget is not None:
                        try:
                            rule = layer_shapes(layer, bottom_shapes)
                        except FormatError:
                            pass  # the port's build reports it, in its own words
                    if rule is not None and len(rule.tops) == len(tops) and None not in rule.tops:
                        budget.learn(name, dict(zip(tops, rule.tops)), rule.params)
                    else:
                        rule = None
                if name in overwritten:
                    with blobs_overwritten():
                        module = cls.build(layer, bottom_shapes, phase, rule)
                else:
                    module = cls.build(layer, bottom_shapes, phase, rule)
                key = module_key(name, keys)
                keys.add(key)
                layer_modules[key] = module  # what ModuleDict's add_module checks, module_key guarantees
                top_shapes = [tuple(int(d) for d in s) for s in module.output_shapes()]
                if len(top_shapes) != len(tops):
                    raise FormatError(f"layer '{name}' ({type_}): {len(tops)} tops given, the layer "
                                      f"produces {len(top_shapes)}")
            if budget is not None and inferred[index].top_shapes != top_shapes:
                # tops the inference could not know (a data layer's, unknown before its source was opened: a huge
                # batch_size; a Split after it): budgeted before the first batch
                budget.learn(name, dict(zip(tops, top_shapes)))
            for j, top in enumerate(tops):
                in_place = j < len(bottoms) and bottoms[j] == top
                if top in blob_shapes and not in_place:
                    raise FormatError(f"layer '{name}': top blob '{top}' is produced by multiple sources "
                                      f"(already produced by layer '{producers[top]}')")
                producers[top] = name
                blob_shapes[top] = top_shapes[j]
            weights = self._loss_weights_of(layer, module, saved)
            for top, w in zip(tops, weights):
                if w:
                    self.loss_weights[top] = self.loss_weights.get(top, 0.0) + w
            propagate = tuple(layer.propagate_down)
            if propagate and len(propagate) != len(bottoms):
                raise FormatError(f"layer '{name}': propagate_down must be unspecified or given once per "
                                  f"bottom ({len(bottoms)}), got {len(propagate)}")
            propagate = propagate or (True,) * len(bottoms)
            if module is not None:
                blobs_of[key] = self._bind_params(layer, key, module, saved, owners, blobs_of)
            self._saved_params.append(saved)
            self.steps.append(LayerStep(name, type_, bottoms, tops, key, phase, weights, propagate))
        self._apply_specs(blobs_of)  # once, after every share is known (per layer it made building O(layers^2))
        return blobs_of

    @staticmethod
    def _loss_weights_of(layer, module, saved) -> tuple[float, ...]:
        if layer.loss_weight:
            if len(layer.loss_weight) != len(layer.top):
                raise FormatError(f"layer '{layer.name}': loss_weight must be unspecified or given once per top "
                                  f"({len(layer.top)}), got {len(layer.loss_weight)}")
            return tuple(float(w) for w in layer.loss_weight)
        if module is not None and module.is_loss and layer.top:
            saved.loss_weight.append(1.0)  # what Caffe's LossLayer::LayerSetUp adds
            return (1.0,) + (0.0,) * (len(layer.top) - 1)
        return (0.0,) * len(layer.top)

    def _bind_params(self, layer, key, module, saved, owners, blobs_of) -> list[torch.Tensor]:
        """Record the ParamSpecs of ``module``'s blobs and share those a named spec owns elsewhere; returns
        the module's blobs as they are then (``blobs_of``: the blobs of the modules bound before)."""
        blobs = module.caffe_blobs()
        shared = False
        for i, blob in enumerate(blobs):
            learnable = is_parameter(blob)
            if i < len(layer.param):
                spec = layer.param[i]
            elif learnable:
                spec = _DEFAULT_SPEC
            else:  # Caffe's BatchNorm masks its statistics with lr_mult 0
                spec = caffe_pb2.ParamSpec(lr_mult=0.0)
                saved.param.add().lr_mult = 0.0
            lr, decay = (float(spec.lr_mult), float(spec.decay_mult)) if learnable else (0.0, float(spec.decay_mult))
            if spec.name and spec.name in owners:
                owner_key, owner_i, owner_spec = owners[spec.name]
                owner_blob = blobs_of[owner_key][owner_i]
                self._check_share(layer.name, spec, tuple(blob.shape), tuple(owner_blob.shape), owner_key)
                owner_lr, owner_decay = self._blob_specs[(owner_key, owner_i)]
                if spec.HasField("lr_mult"):
                    if owner_spec.HasField("lr_mult") and owner_lr != lr:
                        raise FormatError(f"layer '{layer.name}': shared param '{spec.name}' has lr_mult {lr}, its "
                                          f"owner has {owner_lr}")
                    owner_lr = lr
                if spec.HasField("decay_mult"):
                    if owner_spec.HasField("decay_mult") and owner_decay != decay:
                        raise FormatError(f"layer '{layer.name}': shared param '{spec.name}' has decay_mult {decay}, "
                                          f"its owner has {owner_decay}")
                    owner_decay = decay
                self._blob_specs[(owner_key, owner_i)] = (owner_lr, owner_decay)
                self._blob_specs[(key, i)] = (owner_lr, owner_decay)
                module.share_caffe_blob(i, owner_blob)
                shared = True
                self._shared.append((key, i, owner_key, owner_i))
                for k2, i2, ok, oi in self._shared:  # keep every sharer of this owner in step
                    if (ok, oi) == (owner_key, owner_i):
                        self._blob_specs[(k2, i2)] = (owner_lr, owner_decay)
            else:
                if spec.name:
                    owners[spec.name] = (key, i, spec)
                self._blob_specs[(key, i)] = (lr, decay)
        return module.caffe_blobs() if shared else blobs

    def _check_share(self, layer_name, spec, shape, owner_shape, owner_key) -> None:
        if shape == owner_shape:
            return
        if spec.share_mode == caffe_pb2.ParamSpec.PERMISSIVE and int(np.prod(shape)) == int(np.prod(owner_shape)):
            raise FormatError(f"layer '{layer_name}': PERMISSIVE sharing of param '{spec.name}' between shapes "
                              f"{shape} and {owner_shape} is not supported (same count, different shape)")
        raise ShapeMismatchError(f"layer '{layer_name}': cannot share param '{spec.name}' owned by layer "
                                 f"'{self._name_of(owner_key)}': shape {shape} vs the owner's {owner_shape}")

    def _name_of(self, key: str) -> str:
        for step in self.steps:
            if step.module_key == key:
                return step.name
        return key

    def _apply_specs(self, blobs_of: dict | None = None) -> None:
        """Each blob's ``lr_mult``/``decay_mult`` from the recorded specs (``blobs_of``: the ports' blobs by
        module key when known; otherwise each port is asked once)."""
        blobs_of = self._blobs_by_key(blobs_of)
        for (key, i), (lr, decay) in self._blob_specs.items():
            blob = blobs_of[key][i]
            blob.lr_mult, blob.decay_mult = lr, decay
            if lr == 0.0 and is_parameter(blob):
                blob.requires_grad_(False)

    #: Caffe computes in IEEE float32.  On Ampere and newer GPUs PyTorch lets cuDNN convolutions use TF32
    #: (products with a 10-bit mantissa: 2.6e-3 relative error on the GoogLeNet fixture), so moving a
    #: CaffeNet to CUDA turns TF32 off process-wide (``torch.backends.cudnn.allow_tf32`` and
    #: ``torch.backends.cuda.matmul.allow_tf32``).  Set ``allow_tf32 = True`` on the net (or the class)
    #: before moving it to keep PyTorch's faster default; autocast (bf16/fp16) is unaffected.
    allow_tf32 = False

    def train(self, mode: bool = True) -> "CaffeNet":
        """Set the torch mode of every port (their phase-dependent behaviour: module docstring), except that
        a layer whose own phase differs from the net's keeps that phase's mode.  Never changes the layer set."""
        super().train(mode)
        for step in getattr(self, "steps", ()):
            if step.module_key is not None and step.phase != self.phase:
                self.layers[step.module_key].train(step.phase == "train")
        return self

    def _set_built_modes(self) -> None:
        """What ``self.train(self.phase == "train")`` sets, without visiting every port: each port was built
        with its own phase's flag (``CaffeLayer.__init__``), so only the net, its ModuleDict and the ports
        that hold submodules or define their own ``train`` are set (a test compares every flag)."""
        self.training = self.layers.training = self.phase == "train"
        for module in self.layers._modules.values():
            if module._modules or type(module).train is not nn.Module.train:
                module.train(module.training)

    def _apply(self, fn, *args, **kwargs):
        # .to()/.cuda()/.half() replace buffers by new tensors: rebind shared buffers and their attributes.
        result = super()._apply(fn, *args, **kwargs)
        self._state_storage = None
        for key, i, owner_key, owner_i in self._shared:
            self.layers[key].share_caffe_blob(i, self.layers[owner_key].caffe_blobs()[owner_i])
        if hasattr(self, "_blob_specs"):
            self._apply_specs()
        if not self.allow_tf32 and self._device().type == "cuda":
            torch.backends.cudnn.allow_tf32 = False
            torch.backends.cuda.matmul.allow_tf32 = False
        return result

    # ------------------------------------------------------------------------------ introspection

    def layer(self, name: str) -> nn.Module:
        """The port of the layer called ``name`` (Caffe name)."""
        for step in reversed(self.steps):
            if step.name == name and step.module_key is not None:
                return self.layers[step.module_key]
        raise KeyError(f"no layer named '{name}' in net '{self.name}'")

    @property
    def layer_names(self) -> list[str]:
        """Every layer in execution order, automatic Split layers included (pycaffe's ``_layer_names``)."""
        return [s.name for s in self.steps]

    @property
    def module_names(self) -> OrderedDict:
        """Caffe layer name -> key in ``self.layers`` (and in ``state_dict()``: ``layers.<key>.<blob>``)."""
        return OrderedDict((s.name, s.module_key) for s in self.steps if s.module_key is not None)

    @property
    def params(self) -> OrderedDict:
        """Layer name -> its blobs in Caffe order, for layers with blobs (pycaffe's ``net.params``)."""
        out = OrderedDict()
        for step in self.steps:
            if step.module_key is not None:
                blobs = self.layers[step.module_key].caffe_blobs()
                if blobs:
                    out[step.name] = list(blobs)
        return out

    @property
    def input_names(self) -> list[str]:
        """Tops of the Input layers, in order (pycaffe's ``net.inputs``)."""
        return [t for s in self.steps if s.type == "Input" for t in s.tops]

    @property
    def feedable_names(self) -> list[str]:
        """Tops of every layer without bottoms (Input, MemoryData, DummyData, ...): what forward accepts."""
        return [t for s in self.steps if not s.bottoms for t in s.tops]

    @property
    def output_names(self) -> list[str]:
        """Blobs no layer consumes afterwards, sorted by name (:func:`~caffe_compat.net_graph.net_outputs`)."""
        return net_outputs((step.bottoms, step.tops) for step in self.steps)

    def _device(self) -> torch.device:
        for tensor in self.parameters():
            return tensor.device
        for tensor in self.buffers():
            return tensor.device
        return torch.device("cpu")

    def fuse_for_inference(self, keep=(), memory_format="auto"):
        """A new inference-only :class:`~caffe_compat.fuse.FusedNet` with BatchNorm/Scale/Bias (+ Eltwise
        shortcut) + ReLU folded into the convolutions; this net is left unchanged (see :mod:`caffe_compat.fuse`)."""
        from caffe_compat.fuse import fuse_for_inference

        return fuse_for_inference(self, keep=keep, memory_format=memory_format)

    def extra_repr(self) -> str:
        return f"name={self.name!r}, phase={self.phase!r}, layers={len(self.steps)}, blobs={len(self.blob_shapes)}"


def load_net(prototxt, weights=None, phase: str = "test", level: int | None = None, stages=(),
             seed: int = 0, strict: bool = False, fuse: bool = False):
    """``CaffeNet`` from a prototxt (path, text or NetParameter) and an optional caffemodel.  Layers of the
    caffemodel the net lacks, and net layers with blobs it does not cover, give one
    :class:`~caffe_compat.errors.WeightsMismatchWarning`; ``strict=True`` makes that a FormatError.
    ``fuse=True``: the net in eval mode, fused for inference (:mod:`caffe_compat.fuse`; not bit-faithful)."""
    try:
        net = CaffeNet(prototxt, phase=phase, level=level, stages=stages, weights=weights, seed=seed, strict=strict)
    except CaffeCompatError as exc:  # a setup error names the layer: the file too, when it came from one
        path = prototxt if isinstance(prototxt, (str, os.PathLike)) and os.path.isfile(prototxt) else None
        raise naming_file(exc, path, weights if isinstance(weights, (str, os.PathLike)) else None) from exc
    return net.eval().fuse_for_inference() if fuse else net

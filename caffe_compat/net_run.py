"""Running a :class:`~caffe_compat.net.CaffeNet`: forward (whole net or a layer range), the objective and
Caffe's backward, and :class:`Blobs`, what a forward returns.

Forward (``net(**inputs)`` or ``net.forward(**inputs)``) returns :class:`Blobs`, an ordered dict of
**every** blob in Caffe's creation order holding what ``net.blobs[name].data`` would show: a blob
rewritten in place (ReLU, Dropout, Scale, ...) holds the value after the last in-place layer.  With
autograd on, no real in-place tensor op is used: each layer output is a new tensor, so autograd is
exact.  Caffe's diff of a blob is the gradient with respect to the output of the *first* layer of its
in-place chain; ``Blobs.diff_targets`` holds those tensors and ``backward`` returns every blob's diff.
Without autograd (``torch.no_grad()`` / ``torch.inference_mode()``, the way to run inference) a layer
that is in-place in the prototxt and offers ``forward_inplace`` (ReLU, BatchNorm with global
statistics, Scale) overwrites its bottom as Caffe does, when that tensor was made in this run and no
other blob, view, fed input or weight shares its storage; memory-bound Pooling/LRN then run in blocks of
a few samples (:mod:`caffe_compat.layers.cache_blocking`).  The blobs hold the same values either way.

Under ``torch.compile`` (``torch.compiler.is_compiling()``) the storage bookkeeping that decides those
eager in-place writes (``Blobs`` counting storages by ``data_ptr``, :meth:`NetExecution._may_overwrite`)
is inactive and every layer returns a new tensor, as with autograd on: Caffe's in-place semantics are
the *values* (a blob shows the last in-place layer's output; its diff is taken at the chain's first
output), and those are what the traced graph computes; the compiler plans buffer reuse itself.  The
steps are built once per net (plain frozen records), so the compiled net does not recompile from one
step to the next at the same shapes.  :func:`compile_net` makes one graph where the net allows and
``fullgraph`` graphs between the layers that do not (data layers ahead, :class:`DataAheadOfGraph`;
user Python layers and torchrun's gathers between, :class:`GraphSegments`).

Loss: a loss layer's top 0 has loss_weight 1 unless the prototxt says otherwise; any top with an
explicit non-zero ``loss_weight`` counts.  ``net.objective(blobs) = Σ loss_weight · sum(top)``.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from caffe_compat.errors import CaffeCompatError, FormatError

__all__ = ["Blobs", "DataAheadOfGraph", "GraphSegments", "LayerStep", "NetExecution", "breaking_step", "compile_net",
           "data_steps", "graph_breaking_step", "step_whose_port_says", "traces_whole", "with_data_tops"]


@dataclass(frozen=True)
class LayerStep:
    """One layer of the built net, in execution order (Caffe's ``net.layers``, Split layers included)."""

    name: str
    type: str
    bottoms: tuple[str, ...]
    tops: tuple[str, ...]
    module_key: str | None  # key in ``CaffeNet.layers``; None for an automatic Split layer
    phase: str
    loss_weights: tuple[float, ...]  # one per top; 0.0 = not part of the objective
    propagate_down: tuple[bool, ...]  # one per bottom


class Blobs(OrderedDict):
    """Every blob after a forward pass, name -> tensor (post in-place value, pycaffe's ``net.blobs``).

    ``diff_targets``: name -> tensor whose gradient is Caffe's diff of that blob (the output of the first
    layer of an in-place chain).  ``loss_terms``: ``(top name, loss_weight, tensor)`` of the objective.
    ``step_outputs``: step index -> the tops that step produced (every version of an in-place blob), kept
    when autograd is on (pycaffe's backward ranges read them).
    """

    def __init__(self, *args, **kwargs):
        self.storage_refs: Counter[int] = Counter()  # storage address -> how many blobs hold it
        self.source_tops: set[str] = set()  # tops of bottomless layers (inputs, data layers)
        super().__init__(*args, **kwargs)
        self.diff_targets: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.loss_terms: list[tuple[str, float, torch.Tensor]] = []
        self.step_outputs: dict[int, tuple] = {}  # step index -> the tensors it produced
        self.debug = None  # the run's DebugPass while the net logs Caffe's debug_info lines (net_debug)

    def __setitem__(self, name, value):
        if torch.compiler.is_compiling():  # no eager in-place writes under compile: nothing to count
            super().__setitem__(name, value)
            return
        old = self.get(name)
        if torch.is_tensor(old):
            self.storage_refs[old.untyped_storage().data_ptr()] -= 1
        if torch.is_tensor(value):
            self.storage_refs[value.untyped_storage().data_ptr()] += 1
        super().__setitem__(name, value)

    def __delitem__(self, name):
        old = self[name]
        if torch.is_tensor(old) and not torch.compiler.is_compiling():
            self.storage_refs[old.untyped_storage().data_ptr()] -= 1
        super().__delitem__(name)


class NetExecution:
    """Forward, objective and backward of a :class:`~caffe_compat.net.CaffeNet` (a mixin of it; it reads the
    net's ``steps``, ``layers``, ``force_backward``, ``feedable_names`` and ``blob_shapes``)."""

    #: Caffe's ``debug_info_``: while set (and someone listens) every run logs Caffe's per-layer debug lines
    #: (:mod:`caffe_compat.net_debug`); a NetParameter's ``debug_info`` sets it, a solver sets its TRAIN net's.
    debug_info: bool = False

    def forward(self, **inputs) -> Blobs:
        """Run the whole net; ``inputs`` feed tops of bottomless layers by blob name.  Returns every blob."""
        return self.run(inputs)

    def run(self, inputs: dict | None = None, start: str | None = None, end: str | None = None,
            input_grad: bool | None = None, step_hooks: tuple | None = None) -> Blobs:
        """Run layers ``start`` .. ``end`` (Caffe layer names, inclusive; default all).  ``inputs`` feed
        tops of bottomless layers; with ``start`` they may name any blob the run reads.  ``input_grad``
        (default: the net's ``force_backward``) makes fed floating-point tensors require grad.
        ``step_hooks``: ``(before, after)``, called as ``before(index, blobs)`` just before a step runs and
        ``after(index, blobs)`` once its tops are in ``blobs`` (pycaffe's layer callbacks)."""
        names = [s.name for s in self.steps]
        first = 0 if start is None else self._step_index(start, names)
        last = len(self.steps) - 1 if end is None else self._step_index(end, names)
        # A compiled graph cannot make new leaf tensors: under torch.compile the caller's inputs keep their
        # requires_grad (pass them requiring grad for their diffs) and data-layer tops get no diff.
        want_grad = ((self.force_backward if input_grad is None else input_grad) and torch.is_grad_enabled()
                     and not torch.compiler.is_compiling())
        inputs = self._checked_inputs(inputs, start is None, want_grad)
        debug = self.debug_pass()
        if debug is None:
            return self._run_steps(inputs, inputs if start is not None else {}, first, last, want_grad,
                                   step_hooks=step_hooks)
        blobs = Blobs()
        blobs.debug = debug
        try:
            return self._run_steps(inputs, inputs if start is not None else {}, first, last, want_grad, blobs,
                                   step_hooks=_with_debug(debug, step_hooks))
        finally:
            debug.flush_forward()

    def debug_pass(self):
        """A :class:`~caffe_compat.net_debug.DebugPass` for a run of this net while its ``debug_info`` flag is
        set (Caffe's ``debug_info_``) and someone listens, else None."""
        if not self.debug_info or torch.compiler.is_compiling():
            return None
        from caffe_compat.net_debug import DebugPass, listening

        if not listening():
            return None
        return DebugPass(self, backward=torch.is_grad_enabled())

    def _checked_inputs(self, inputs: dict | None, from_start: bool, want_grad: bool) -> dict:
        """``inputs`` as tensors on the net's device (requiring grad when ``want_grad``), after checking their
        names: the feedable blobs for a run from the start, any blob for a run from a later layer."""
        inputs = dict(inputs or {})
        allowed = set(self.feedable_names) if from_start else set(self.blob_shapes)
        unknown = [n for n in inputs if n not in allowed]
        if unknown:
            raise FormatError(f"net '{self.name}': cannot feed {unknown}; feedable blobs are "
                              f"{self.feedable_names if from_start else sorted(allowed)}")
        device = self._device()
        for n, value in list(inputs.items()):
            if not torch.is_tensor(value):
                value = torch.as_tensor(np.asarray(value, dtype=np.float32), device=device)
            if want_grad and value.is_floating_point() and not value.requires_grad:
                value = value.detach().requires_grad_()
            inputs[n] = value
        return inputs

    def _run_steps(self, inputs: dict, seeded: dict, first: int, last: int, want_grad: bool,
                   blobs: Blobs | None = None, step_hooks: tuple | None = None) -> Blobs:
        """Steps ``first`` .. ``last`` (indices, inclusive) into ``blobs`` (default: a new table), after the
        ``seeded`` blobs (values of blobs made before ``first``); ``inputs`` feed the tops of bottomless
        layers.  What :meth:`run` does once it has checked and converted its arguments."""
        blobs = Blobs() if blobs is None else blobs
        for n, value in seeded.items():
            blobs[n] = value
            blobs.diff_targets[n] = value
        before, after = step_hooks if step_hooks is not None else (None, None)
        for index, step in enumerate(self.steps[first:last + 1], first):
            if before is not None:
                before(index, blobs)
            outs = self._run_step(step, blobs, inputs, want_grad)
            if torch.is_grad_enabled() and not torch.compiler.is_compiling():  # for backward ranges only
                blobs.step_outputs[index] = outs
            if not step.bottoms:
                blobs.source_tops.update(step.tops)
            for top, out, weight in zip(step.tops, outs, step.loss_weights):
                if top not in blobs.diff_targets:
                    blobs.diff_targets[top] = out
                blobs[top] = out
                if weight:
                    blobs.loss_terms.append((top, weight, out))
            if after is not None:
                after(index, blobs)
        return blobs

    @staticmethod
    def _step_index(name: str, names: list[str]) -> int:
        try:
            return names.index(name)
        except ValueError:
            raise FormatError(f"no layer named '{name}'") from None

    def _run_step(self, step: LayerStep, blobs: Blobs, inputs: dict, want_grad: bool) -> tuple:
        if step.module_key is None:  # Caffe's Split: one distinct autograd node per top, so each has a diff
            source = blobs[step.bottoms[0]]
            return tuple(source.view_as(source) for _ in step.tops)
        if not step.bottoms and step.tops and all(t in inputs for t in step.tops):
            return tuple(inputs[t] for t in step.tops)
        try:
            bottoms = [blobs[b] for b in step.bottoms]
        except KeyError as exc:
            raise FormatError(f"layer '{step.name}': bottom blob {exc} has no value in this run (feed it)") from None
        bottoms = [b if keep else b.detach() for b, keep in zip(bottoms, step.propagate_down)]
        layer = self.layers[step.module_key]
        if self._may_overwrite(step, bottoms, blobs, inputs):
            out = layer.forward_inplace(bottoms[0])
            if out is not None:
                return (out,)
        if (layer.is_loss or any(step.loss_weights)) and bottoms and _autocasting(bottoms[0]):
            outs = _in_float32(layer, bottoms)
        else:
            outs = layer(*bottoms)
        if torch.is_tensor(outs):
            outs = (outs,)
        outs = list(outs)
        if len(outs) != len(step.tops):
            raise CaffeCompatError(f"layer '{step.name}' ({step.type}) returned {len(outs)} tops, expected "
                                   f"{len(step.tops)}")
        for k, out in enumerate(outs):
            if not step.bottoms:
                if step.tops[k] in inputs:
                    out = inputs[step.tops[k]]
                elif want_grad and out.is_floating_point() and not out.requires_grad:
                    out = out.detach().requires_grad_()
            elif any(out is b for b in bottoms) or any(out is o for o in outs[:k]):
                out = out.view_as(out)  # an identity top still gets its own autograd node (its own diff)
            outs[k] = out
        return tuple(outs)

    def _may_overwrite(self, step: LayerStep, bottoms: list, blobs: Blobs, inputs: dict) -> bool:
        """True when an in-place prototxt layer may write its bottom as Caffe does: no autograd, and the
        bottom is a tensor this run made that no other blob, input, weight, buffer or view shares."""
        if (torch.is_grad_enabled() or len(bottoms) != 1 or step.tops != step.bottoms
                or torch.compiler.is_compiling() or torch.onnx.is_in_onnx_export() or torch.jit.is_tracing()):
            return False
        bottom = bottoms[0]
        if bottom._base is not None or bottom.requires_grad or bottom.numel() == 0:
            return False
        storage = bottom.untyped_storage().data_ptr()
        if step.bottoms[0] in blobs.source_tops or blobs.storage_refs[storage] != 1:
            return False
        fed = (v.untyped_storage().data_ptr() for v in inputs.values() if torch.is_tensor(v))
        return storage not in self._weight_storage() and storage not in set(fed)

    def _weight_storage(self) -> set[int]:
        """Storage addresses of every parameter and buffer (cached; ``_apply``/``load_state_dict`` reset it)."""
        cached = getattr(self, "_state_storage", None)
        if cached is None:
            cached = {t.untyped_storage().data_ptr() for t in [*self.parameters(), *self.buffers()]}
            self._state_storage = cached
        return cached

    def load_state_dict(self, *args, **kwargs):
        self._state_storage = None
        return super().load_state_dict(*args, **kwargs)

    def objective(self, blobs) -> torch.Tensor:
        """Σ loss_weight · sum(top) over the loss tops of a forward pass (0 when the net has no loss)."""
        if isinstance(blobs, Blobs):
            terms = [(w, t) for _, w, t in blobs.loss_terms]
        else:
            terms = [(w, blobs[n]) for n, w in self.loss_weights.items() if n in blobs]
        if not terms:
            return torch.zeros((), device=self._device())
        total = terms[0][0] * terms[0][1].sum()
        for w, t in terms[1:]:
            total = total + w * t.sum()
        return total

    def backward(self, blobs: Blobs, top_diffs: dict | None = None, loss: bool = True,
                 retain_graph: bool = True) -> OrderedDict:
        """Caffe's backward after ``blobs = net.forward(...)``: the gradient of the objective (loss tops
        weighted by loss_weight, unless ``loss=False``) plus ``Σ <blob, top_diffs[blob]>`` for given diffs
        (a diff given for a loss top replaces its loss weight, like setting its diff in pycaffe).
        Parameter gradients are **accumulated** into ``.grad`` (Caffe accumulates param diffs).  Returns
        every blob's diff (zeros where no gradient flows), keyed like ``blobs``."""
        top_diffs = dict(top_diffs or {})
        outputs, grads = [], []
        if loss:
            for name, weight, tensor in blobs.loss_terms:
                if name not in top_diffs and tensor.requires_grad:
                    outputs.append(tensor)
                    grads.append(torch.full_like(tensor, weight))
        for name, diff in top_diffs.items():
            tensor = blobs[name]
            diff = torch.as_tensor(np.asarray(diff) if not torch.is_tensor(diff) else diff)
            diff = diff.to(device=tensor.device, dtype=tensor.dtype).reshape(tensor.shape)
            if tensor.requires_grad:
                outputs.append(tensor)
                grads.append(diff)
        targets = [(n, t) for n, t in blobs.diff_targets.items() if t.requires_grad]
        params = [p for p in self.parameters() if p.requires_grad]
        results = [None] * (len(targets) + len(params))
        if outputs:
            results = torch.autograd.grad(outputs, [t for _, t in targets] + params, grads, allow_unused=True,
                                          retain_graph=retain_graph)
        with torch.no_grad():
            for p, g in zip(params, results[len(targets):]):
                if g is not None:
                    p.grad = g.clone() if p.grad is None else p.grad + g
        found = {n: g for (n, _), g in zip(targets, results[:len(targets)])}
        diffs = OrderedDict()
        for name, tensor in blobs.items():
            g = found.get(name)
            diffs[name] = g if g is not None else torch.zeros_like(tensor)
        return diffs



def _with_debug(debug, step_hooks):
    """The step hooks of a run with debug lines: Caffe's ``ForwardDebugInfo`` runs after the layer's Forward,
    before the ``after_forward`` callbacks."""
    before, after = step_hooks if step_hooks is not None else (None, None)

    def debug_before(index, blobs):
        if before is not None:
            before(index, blobs)
        debug.before(index, blobs)

    def debug_after(index, blobs):
        debug.after(index, blobs)
        if after is not None:
            after(index, blobs)

    return debug_before, debug_after


def _autocasting(tensor: torch.Tensor) -> bool:
    return tensor.device.type != "meta" and torch.is_autocast_enabled(tensor.device.type)  # (meta: no autocast)


def _in_float32(layer, bottoms: list) -> tuple:
    """A loss layer under autocast runs in float32 (as PyTorch's autocast runs its own losses): its
    float16/bfloat16 bottoms are cast up.  A float16 loss would overflow under GradScaler's first
    scale (65536 > float16's 65504), so every first fp16 update would be skipped."""
    low = (torch.float16, torch.bfloat16)
    with torch.autocast(bottoms[0].device.type, enabled=False):
        return layer(*[b.float() if torch.is_tensor(b) and b.dtype in low else b for b in bottoms])


def traces_whole(net) -> bool:
    """Whether ``torch.compile(net, fullgraph=True)`` applies: every bottomless layer is an ``Input`` (a data
    layer reads its files in Python inside forward) and no layer ``breaks_graph`` (a user Python layer: an
    autograd adapter around the user's NumPy code; a distributed run's gather of a pair layer's bottoms)."""
    return graph_breaking_step(net.steps, net.layers) is None


def _reads_batches(step) -> bool:
    """A bottomless layer other than ``Input`` (Data, ImageData, HDF5Data, the label-shuffling layer, ...):
    it reads its batches in Python."""
    return step.module_key is not None and not step.bottoms and step.type != "Input"


def data_steps(net) -> list:
    """The net's layers that read their batches in Python (:func:`_reads_batches`), in net order."""
    return [s for s in net.steps if _reads_batches(s)]


def graph_breaking_step(steps, layers):
    """The first of ``steps`` (``layers``: the net's modules by key) that keeps them from being one graph
    (see :func:`traces_whole`), or None."""
    for step in steps:
        if _reads_batches(step) or _breaks_graph(step, layers):
            return step
    return None


def _breaks_graph(step, layers) -> bool:
    """The step's port says ``breaks_graph`` (a user Python layer, HDF5Output, a distributed run's gather)."""
    return _port_says(step, layers, "breaks_graph")


def _port_says(step, layers, fact: str) -> bool:
    """The step has a port and it declares the registry fact ``fact`` (``breaks_graph``, ...) true."""
    return step.module_key is not None and getattr(layers[step.module_key], fact, False)


def step_whose_port_says(net, fact: str):
    """The net's first layer whose port declares the registry fact ``fact`` true, or None."""
    return next((step for step in net.steps if _port_says(step, net.layers, fact)), None)


def breaking_step(net):
    """The net's first layer whose port ``breaks_graph``, or None: what keeps the net from one graph once
    its data layers run ahead of it (:func:`with_data_tops`)."""
    return step_whose_port_says(net, "breaks_graph")


def with_data_tops(net, inputs: dict, sources=None) -> dict:
    """``inputs`` with the tops of every data layer (``sources``, default :func:`data_steps`) they do not
    give, each layer run eagerly, in net order, as the net would run it."""
    fed = dict(inputs)
    for step in data_steps(net) if sources is None else sources:
        if not all(top in fed for top in step.tops):
            fed.update(zip(step.tops, net._run_step(step, Blobs(), {}, False)))
    return fed


def compile_net(net, **options):
    """The net's forward through ``torch.compile``, as one graph where it can be (no graph break: what CUDA
    graphs and whole-step fusion need):

    * :func:`traces_whole`: ``torch.compile(net, fullgraph=True, **options)``;
    * else the data layers (the authors' train nets: a Data or label-shuffling layer ahead of everything)
      run eagerly ahead of the rest (:class:`DataAheadOfGraph`; a forward fed a data layer's tops skips
      that layer), and the rest is one compiled graph fed their tops, or, where layers ``breaks_graph``
      (a user Python layer; HDF5Output's file write; under torchrun, the gathers of the pair layers),
      :class:`GraphSegments`: one ``fullgraph`` graph for each run of layers between them, those layers
      eagerly in between.

    Compiling the whole net with such layers inside broke the graph at each of them, and Dynamo then
    compiled the blob table's ``__setitem__`` once per blob name until its recompile limit (8): under
    torchrun the pair layers' gathers made every step recompile and fall back to eager code."""
    if traces_whole(net):
        return torch.compile(net, fullgraph=True, **options)
    sources = data_steps(net)
    if breaking_step(net) is None:
        graph = torch.compile(net, fullgraph=True, **options)
    else:
        graph = GraphSegments(net, **options)
    return DataAheadOfGraph(net, graph, sources) if sources else graph


class DataAheadOfGraph:
    """A compiled net whose data layers run eagerly before the graph: ``forward(**inputs)`` runs every data
    layer whose tops ``inputs`` do not give (in net order, as the net would), then the compiled net fed
    all of them.  Called like the net; ``net`` and ``graph`` are the two parts."""

    def __init__(self, net, graph, sources):
        self.net, self.graph, self.sources = net, graph, sources

    def __call__(self, **inputs):
        return self.graph(**with_data_tops(self.net, inputs, self.sources))


class GraphSegments:
    """A net's forward as compiled graphs between the layers that ``breaks_graph``, which run eagerly in
    between: called like the net (``**inputs``, the data layers' tops fed or read as the net would), it
    returns the same :class:`Blobs`.  Each graph is ``torch.compile(..., fullgraph=True, **options)`` of
    one run of layers, fed the blobs it reads from earlier layers (a fixed set of names, so the graphs do
    not recompile from one step to the next); ``parts`` lists ``(first, last, graph or None)`` step ranges.
    As in one compiled graph, fed inputs keep their ``requires_grad`` and no layer writes its bottom in place."""

    def __init__(self, net, **options):
        self.net = net
        self.parts: list[tuple[int, int, object]] = []
        self._reads: list[tuple[str, ...]] = []
        start = 0
        for index in [i for i, step in enumerate(net.steps) if _breaks_graph(step, net.layers)] + [len(net.steps)]:
            if start < index:
                self.parts.append((start, index - 1, torch.compile(self._runner(start, index - 1), fullgraph=True,
                                                                   **options)))
                self._reads.append(self._read_before_made(start, index - 1))
            if index < len(net.steps):
                self.parts.append((index, index, None))
                self._reads.append(())
            start = index + 1

    def _runner(self, first: int, last: int):
        net = self.net

        def run_part(inputs: dict, seeded: dict) -> Blobs:
            return net._run_steps(inputs, seeded, first, last, False)
        return run_part

    def _read_before_made(self, first: int, last: int) -> tuple[str, ...]:
        """The blobs steps ``first`` .. ``last`` read before one of them makes them (made by earlier steps)."""
        made, reads = set(), []
        for step in self.net.steps[first:last + 1]:
            reads.extend(b for b in step.bottoms if b not in made and b not in reads)
            made.update(step.tops)
        return tuple(reads)

    def __call__(self, **inputs) -> Blobs:
        net = self.net
        inputs = net._checked_inputs(inputs, True, False)
        blobs = Blobs()
        for (first, last, graph), reads in zip(self.parts, self._reads):
            if graph is None:
                net._run_steps(inputs, {}, first, last, False, blobs=blobs)
                continue
            missing = [name for name in reads if name not in blobs]
            if missing:
                raise FormatError(f"net '{net.name}': blob '{missing[0]}' has no value when layer "
                                  f"'{net.steps[first].name}' and those after it run (feed it)")
            part = graph(inputs, {name: blobs[name] for name in reads})
            for name, value in part.items():
                blobs[name] = value
            for name, value in part.diff_targets.items():
                blobs.diff_targets.setdefault(name, value)
            blobs.loss_terms.extend(part.loss_terms)
            blobs.source_tops.update(part.source_tops)
        return blobs

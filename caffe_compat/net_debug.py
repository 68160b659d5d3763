"""Caffe's ``debug_info``: the per-layer lines a ``Net`` logs while its ``debug_info_`` flag is set.

What Caffe logs (``net.cpp``), reproduced line for line:

* after each layer's Forward (``ForwardDebugInfo``), one line per top, then one per blob of the layer::

      [Forward] Layer <layer>, top blob <top> data: <m>
      [Forward] Layer <layer>, param blob <name> data: <m>

  ``<name>``: the blob's ``ParamSpec.name``, else its index in the layer;
* after each layer's Backward (``BackwardDebugInfo``; only layers that need backward), one line per bottom
  that needs a diff, then one per blob whose diff the layer computes (``param_propagate_down``)::

      [Backward] Layer <layer>, bottom blob <bottom> diff: <m>
      [Backward] Layer <layer>, param blob <index> diff: <m>

* after a whole-net backward (``Net::Backward``, what a solver iteration runs; pycaffe's ``backward`` calls
  ``BackwardFromTo`` and has no such line), at glog's ERROR level, over the blobs the net owns::

      [Backward] All net params (data, diff): L1 norm = (<Σ|data|>, <Σ|diff|>); L2 norm = (<..>, <..>)

``<m>`` is ``asum / count`` (the mean absolute value) as a float printed the way glog prints one (``%g``);
each line starts with four spaces.  Which layers, bottoms and blobs "need backward" is ``Net::Init``'s
analysis (:func:`backward_needs`): a bottom needs a diff when a learnable blob (``lr_mult != 0``) lies below
it, or ``propagate_down`` says so, and only when the layer's tops reach a loss; ``force_backward`` turns
every layer and blob on, and every bottom but those the port refuses (a loss layer's labels,
``CaffeLayer.refuses_forced_backward``).  Caffe's quirk kept: the ``lr_mult`` is read from the net's
layer parameter, so a BatchNorm layer whose prototxt gives no ``param`` needs backward and logs its three
statistics' (zero) diffs.

When: a ``NetParameter``'s ``debug_info: true`` sets the flag of that net (pycaffe nets, ``caffe test``, a
solver's TEST nets); a solver sets its TRAIN net's flag at every iteration to ``display && debug_info``
(``Solver::Step``), so the paper solvers (``display: 1``, ``debug_info: true``) log every iteration.  The
lines go to the ``caffe_compat.net`` logger and are computed only while it is enabled for INFO (what
``--caffe-log``, pycaffe's ``caffe.init_log`` or a program's logging set-up does); nobody listening costs
nothing.  Each pass computes its means on the device and fetches them in one transfer when the pass is over,
then logs its lines in Caffe's order (a forward that fails logs the layers before the failure).

Numbers: the sums are float32, as Caffe's ``asum``, but torch's summation order is not OpenBLAS's, so the
sixth digit may differ on large blobs; the division by the count is float32 as Caffe's ``Dtype`` division.  An
empty blob prints ``-nan`` (``0.0f / 0`` on x86 is the negative default NaN, which glibc prints with its
sign).  Limits: a diff is logged only where autograd computes one (a bottom ``propagate_down: true`` asks for
but whose tensor needs no gradient has no line); a blob shared by several layers (``ParamSpec.name``) shows
its whole-pass diff on each sharer's line (Caffe's running sum differs on all but the lowest sharer);
iterations replayed as CUDA graphs (``--cuda-graphs``) log nothing, and a compiled TRAIN forward
(``--compile``) runs eagerly in the iterations that log.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import numpy as np
import torch

from caffe_compat.io.glog import g6

__all__ = ["BackwardNeeds", "DebugPass", "backward_needs", "caffe_float", "listening", "loss_reach"]

log = logging.getLogger("caffe_compat.net")


def listening() -> bool:
    """Whether debug lines would be seen: the net logger is enabled for INFO, and no graph is being traced."""
    return log.isEnabledFor(logging.INFO) and not torch.compiler.is_compiling()


#: A float as glog's ``operator<<`` prints it (``%g``, NaN with its sign): the solver's lines use it too.
caffe_float = g6


def _mean_text(total: float, count: int) -> str:
    """``asum / count`` in float32 (Caffe's ``Dtype`` division), printed as glog does."""
    if count == 0:
        return "-nan"  # 0.0f / 0 on x86: the default NaN, sign bit set
    return caffe_float(float(np.float32(total) / np.float32(count)))


@dataclass(frozen=True)
class BackwardNeeds:
    """``Net::Init``'s backward flags, one entry per step (layer, Split layers included)."""

    layer: tuple[bool, ...]               # layer_need_backward_
    bottom: tuple[tuple[bool, ...], ...]  # bottom_need_backward_
    param: tuple[tuple[bool, ...], ...]   # the layer's param_propagate_down, one per blob


def backward_needs(net) -> BackwardNeeds:
    """Which layers need backward, which bottoms get a diff and which blobs' diffs each layer computes, as
    ``Net::Init`` decides (see the module docstring); cached on the net (its layers are fixed; ``force_backward``,
    which a script may set after building, is part of the key)."""
    force = bool(net.force_backward)
    cached = net.__dict__.get("_backward_needs")
    if cached is not None and cached[0] == force:
        return cached[1]
    layer_need, bottom_need, param_down = loss_reach(net)
    if force:
        for i, step in enumerate(net.steps):
            layer_need[i] = True
            refused = () if step.module_key is None else net.layers[step.module_key].refuses_forced_backward
            bottom_need[i] = [need or j not in refused for j, need in enumerate(bottom_need[i])]
            param_down[i] = [True] * len(param_down[i])
    needs = BackwardNeeds(tuple(layer_need), tuple(map(tuple, bottom_need)), tuple(map(tuple, param_down)))
    net.__dict__["_backward_needs"] = (force, needs)
    return needs


def loss_reach(net) -> tuple[list[bool], list[list[bool]], list[list[bool]]]:
    """``Net::Init``'s flags before ``force_backward`` is applied (what its "needs backward computation" lines
    report): per step, whether the layer needs backward, per bottom whether it gets a diff, per blob whether
    the layer computes its diff."""
    steps, params = net.steps, net.net_param.layer
    blob_need: dict[str, bool] = {}
    layer_need, bottom_need, param_down = [], [], []
    for step, layer in zip(steps, params):  # forward: a blob needs a diff when a learnable blob lies below it
        need, bottoms = False, []
        for j, bottom in enumerate(step.bottoms):
            below = blob_need.get(bottom, False)
            need |= below
            bottoms.append(bool(layer.propagate_down[j]) if layer.propagate_down else below)
        downs = [(layer.param[i].lr_mult if i < len(layer.param) else 1.0) != 0
                 for i in range(len(net.step_blobs(step)))]
        need |= any(downs)
        layer_need.append(need)
        bottom_need.append(bottoms)
        param_down.append(downs)
        if need:
            blob_need.update(dict.fromkeys(step.tops, True))
    under_loss: set[str] = set()
    skipped: set[str] = set()
    for i in range(len(steps) - 1, -1, -1):  # backward: only what reaches a loss
        step = steps[i]
        contributes, skip_down = False, True
        for top, weight in zip(step.tops, step.loss_weights):
            contributes = contributes or bool(weight) or top in under_loss
            skip_down = skip_down and top in skipped
            if contributes and not skip_down:
                break
        if layer_need[i] and skip_down:
            layer_need[i] = False
            bottom_need[i] = [False] * len(step.bottoms)
        if not contributes:
            layer_need[i] = False
        for j, bottom in enumerate(step.bottoms):
            if contributes:
                under_loss.add(bottom)
            else:
                bottom_need[i][j] = False
            if not bottom_need[i][j]:
                skipped.add(bottom)
    return layer_need, bottom_need, param_down


def _display_name(layer, index: int) -> str:
    """``param_display_names_``: the ParamSpec's name, else the blob's index."""
    name = layer.param[index].name if index < len(layer.param) else ""
    return name or str(index)


def _values(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    return tensor if tensor.dtype in (torch.float32, torch.float64) else tensor.float()


def _abs_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Caffe's ``asum``, in the blob's float type (a float64 accumulator was 7-15 times slower on the CPU)."""
    return _values(tensor).abs().sum()


def _l2(tensor: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(_values(tensor), 2)


class DebugPass:
    """The debug lines of one pass of ``net``: ``before``/``after`` are step hooks of ``NetExecution.run``
    (``after`` logs the step's tops and blobs; ``before`` hooks the bottoms whose diffs the backward lines
    report, when ``backward``); :meth:`flush_forward` logs the forward lines, :meth:`log_backward` the
    backward ones once the gradients are in."""

    def __init__(self, net, backward: bool):
        self.net = net
        self.needs = backward_needs(net) if backward else None
        self._forward: list[tuple[str, object, int]] = []  # (text, abs sum tensor, count)
        self._bottom_sums: dict[tuple[int, int], tuple[torch.Tensor, int]] = {}

    # ------------------------------------------------------------------------------ forward

    def before(self, index: int, blobs) -> None:
        needs = self.needs
        if needs is None or not needs.layer[index]:
            return
        for j, bottom in enumerate(self.net.steps[index].bottoms):
            tensor = blobs.get(bottom)
            if needs.bottom[index][j] and torch.is_tensor(tensor) and tensor.requires_grad:
                tensor.register_hook(functools.partial(self._keep_bottom_diff, (index, j)))

    def forget_bottom_diffs(self) -> None:
        """Drop the bottom diffs of an earlier backward (before another backward of the same forward)."""
        self._bottom_sums.clear()

    def _keep_bottom_diff(self, key: tuple[int, int], grad: torch.Tensor) -> None:
        self._bottom_sums[key] = (_abs_sum(grad), grad.numel())

    def after(self, index: int, blobs) -> None:
        step = self.net.steps[index]
        for top in step.tops:
            tensor = blobs[top]
            self._forward.append((f"    [Forward] Layer {step.name}, top blob {top} data: ", _abs_sum(tensor),
                                  tensor.numel()))
        layer = self.net.net_param.layer[index]
        for i, blob in enumerate(self.net.step_blobs(step)):
            self._forward.append((f"    [Forward] Layer {step.name}, param blob {_display_name(layer, i)} data: ",
                                  _abs_sum(blob), blob.numel()))

    def flush_forward(self) -> None:
        """Log the forward lines collected so far (one transfer from the device), in layer order."""
        entries, self._forward = self._forward, []
        for (text, _, count), total in zip(entries, _host([s for _, s, _ in entries])):
            log.info("%s%s", text, _mean_text(total, count))

    # ------------------------------------------------------------------------------ backward

    def log_backward(self, first: int = 0, last: int | None = None, whole: bool = False,
                     diff_scale: float = 1.0) -> None:
        """Log ``BackwardDebugInfo`` for steps ``last`` down to ``first`` (default: all), then, for a whole-net
        backward (``whole``), the ``All net params`` line.  ``diff_scale`` undoes a gradient scaler's factor."""
        needs = self.needs if self.needs is not None else backward_needs(self.net)
        steps = self.net.steps
        last = len(steps) - 1 if last is None else last
        entries: list[tuple[str, object, int]] = []
        for index in range(last, first - 1, -1):
            if not needs.layer[index]:
                continue
            step = steps[index]
            for j, bottom in enumerate(step.bottoms):
                kept = self._bottom_sums.get((index, j))
                if needs.bottom[index][j] and kept is not None:
                    entries.append((f"    [Backward] Layer {step.name}, bottom blob {bottom} diff: ", *kept))
            for i, blob in enumerate(self.net.step_blobs(step)):
                if needs.param[index][i]:
                    grad = blob.grad
                    entries.append((f"    [Backward] Layer {step.name}, param blob {i} diff: ",
                                    _abs_sum(grad) if grad is not None else 0.0, blob.numel()))
        owned = _owned_blobs(self.net) if whole else []
        norms: list = []
        for blob in owned:  # per blob: asum and L2 norm of data and diff (squared on the host)
            grad = blob.grad
            norms += [_abs_sum(blob), _l2(blob)] + ([_abs_sum(grad), _l2(grad)] if grad is not None else [0.0, 0.0])
        values = _host([total for _, total, _ in entries] + norms)
        for (text, _, count), total in zip(entries, values):
            log.info("%s%s", text, _mean_text(total * diff_scale, count))
        if whole:
            self._log_norms(values[len(entries):], diff_scale)

    @staticmethod
    def _log_norms(values: list[float], diff_scale: float) -> None:
        """``Net::Backward``'s line: each blob's asum/sumsq (float) summed in a float ``Dtype`` accumulator."""
        f32 = np.float32
        asum_data = asum_diff = sumsq_data = sumsq_diff = f32(0.0)
        for k in range(0, len(values), 4):
            asum_data = f32(asum_data + f32(values[k]))
            sumsq_data = f32(sumsq_data + f32(values[k + 1] ** 2))
            asum_diff = f32(asum_diff + f32(values[k + 2] * diff_scale))
            sumsq_diff = f32(sumsq_diff + f32((values[k + 3] * diff_scale) ** 2))
        log.error("    [Backward] All net params (data, diff): L1 norm = (%s, %s); L2 norm = (%s, %s)",
                  caffe_float(float(asum_data)), caffe_float(float(asum_diff)),
                  caffe_float(float(np.sqrt(sumsq_data))), caffe_float(float(np.sqrt(sumsq_diff))))


def _host(values: list) -> list[float]:
    """Every 0-d tensor (or number) of ``values`` as a Python float, in one transfer per device."""
    tensors = [v for v in values if torch.is_tensor(v)]
    if not tensors:
        return [float(v) for v in values]
    fetched = iter(torch.stack([t.to(tensors[0].device) for t in tensors]).cpu().tolist())
    return [next(fetched) if torch.is_tensor(v) else float(v) for v in values]


def _owned_blobs(net) -> list[torch.Tensor]:
    """``learnable_params_``: every blob of every layer once, those shared from another layer's left out."""
    sharers = net.shared_blobs()
    seen, owned = set(), []
    for step in net.steps:
        for i, blob in enumerate(net.step_blobs(step)):
            if (step.module_key, i) not in sharers and id(blob) not in seen:
                seen.add(id(blob))
                owned.append(blob)
    return owned

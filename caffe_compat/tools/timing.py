"""``caffe time``: per-layer forward and backward milliseconds of a net, averaged over iterations.

As Caffe's ``time()`` (``tools/caffe.cpp``): the net is built in the TRAIN phase unless told otherwise
(data layers read their sources, Input blobs hold zeros or the values fed), one forward and one backward
pass run first (allocation, warm-up; ``Initial loss``), then ``iterations`` times every layer's forward in
order and every layer's backward in reverse order are timed one by one (Split layers included, with the
names Caffe gives them).  Reported: each layer's mean forward / backward time, the mean forward pass
and backward pass (timed around the whole loops, so at least the sum of their layers), the mean
forward-backward iteration and the total.

Each layer runs on detached copies of its bottoms, so its backward is its own autograd graph: a layer's
backward time is that of computing its bottom and parameter diffs from its top diffs (the loss weight on
loss tops, zeros where nothing flows back, as in Caffe) and nothing else.  A layer whose tops need no
diff (data layers, layers below every learnable blob without ``force_backward``) takes no backward time,
as Caffe's ``Backward`` skips it.  On CUDA the device is synchronised around every timed span.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from caffe_compat.errors import CaffeCompatError
from caffe_compat.io.glog import g6
from caffe_compat.tools.netsetup import as_tensors, synchronize

__all__ = ["LayerTiming", "TimingResult", "time_net"]


@dataclass
class LayerTiming:
    name: str
    type: str
    forward_ms: float
    backward_ms: float


@dataclass
class TimingResult:
    iterations: int
    device: str
    initial_loss: float
    layers: list[LayerTiming]
    forward_ms: float  # mean forward pass
    backward_ms: float  # mean backward pass
    forward_backward_ms: float  # mean iteration (total time / iterations)
    total_ms: float
    iteration_ms: list[float] = field(default_factory=list)

    def caffe_lines(self) -> list[str]:
        """Caffe's summary lines, from ``Average time per layer:`` to ``*** Benchmark ends ***``."""
        lines = ["Average time per layer: "]
        for layer in self.layers:
            lines.append(f"{layer.name:>10}\tforward: {g6(layer.forward_ms)} ms.")
            lines.append(f"{layer.name:>10}\tbackward: {g6(layer.backward_ms)} ms.")
        lines += [f"Average Forward pass: {g6(self.forward_ms)} ms.",
                  f"Average Backward pass: {g6(self.backward_ms)} ms.",
                  f"Average Forward-Backward: {g6(self.forward_backward_ms)} ms.",
                  f"Total Time: {g6(self.total_ms)} ms.",
                  "*** Benchmark ends ***"]
        return lines

    def as_dict(self) -> dict:
        return {"iterations": self.iterations, "device": self.device, "initial_loss": self.initial_loss,
                "layers": [vars(layer) for layer in self.layers], "forward_ms": self.forward_ms,
                "backward_ms": self.backward_ms, "forward_backward_ms": self.forward_backward_ms,
                "total_ms": self.total_ms, "iteration_ms": self.iteration_ms}


class _Timer:
    def __init__(self, device: torch.device):
        self.device = device

    def now(self) -> float:
        synchronize(self.device)
        return time.perf_counter()


def _forward(net, fed: dict, timer: _Timer, forward: list[float]):
    """One forward, layer by layer on detached bottoms; returns per layer ``(bottom leaves, tops)``."""
    from caffe_compat.net import Blobs

    values: dict[str, torch.Tensor] = {}
    records = []
    for k, step in enumerate(net.steps):
        local = Blobs()
        leaves = []
        for name in step.bottoms:
            source = values[name]
            leaf = source.detach()
            if source.requires_grad:
                leaf.requires_grad_()
            local[name] = leaf
            leaves.append(leaf)
        start = timer.now()
        outs = net._run_step(step, local, fed, net.force_backward)
        forward[k] += timer.now() - start
        values.update(zip(step.tops, outs))
        records.append((leaves, outs))
    loss = sum((w * values[top].detach().sum()).item() for step in net.steps
               for top, w in zip(step.tops, step.loss_weights) if w)
    return records, float(loss)


def _backward(net, records, timer: _Timer, backward: list[float]) -> None:
    diffs: dict[str, torch.Tensor] = {}
    for k in range(len(net.steps) - 1, -1, -1):
        step = net.steps[k]
        leaves, outs = records[k]
        tops = []
        for top, out, weight in zip(step.tops, outs, step.loss_weights):
            diff = diffs.pop(top, None)
            if out.requires_grad:
                tops.append((out, diff if diff is not None else (torch.full_like(out, weight) if weight
                                                                  else torch.zeros_like(out))))
        params = []
        if step.module_key is not None:
            params = [p for p in net.layers[step.module_key].parameters() if p.requires_grad]
        targets = [leaf for leaf in leaves if leaf.requires_grad] + params
        if not tops or not targets:
            continue
        start = timer.now()
        grads = torch.autograd.grad([t for t, _ in tops], targets, [d for _, d in tops], allow_unused=True)
        backward[k] += timer.now() - start
        grads = iter(grads)
        for name, leaf in zip(step.bottoms, leaves):
            if not leaf.requires_grad:
                continue
            grad = next(grads)
            if grad is not None:
                diffs[name] = diffs[name] + grad if name in diffs else grad


def time_net(net, iterations: int = 50, inputs: dict | None = None,
             on_iteration: Callable[[int, float], None] | None = None,
             on_initial: Callable[[float], None] | None = None) -> TimingResult:
    """Time ``net`` as ``caffe time`` does (module docstring).  ``inputs``: ``{blob: array}`` fed to its
    Input blobs at every iteration.  ``on_initial(loss)`` is called after the clean forward and backward,
    ``on_iteration(j, ms)`` after iteration ``j`` (1-based)."""
    iterations = int(iterations)
    if iterations < 1:
        raise CaffeCompatError(f"iterations must be >= 1, got {iterations}")
    device = net._device()
    fed = as_tensors(inputs or {}, device)
    if net.force_backward:
        fed = {n: v.requires_grad_() if v.is_floating_point() else v for n, v in fed.items()}
    timer = _Timer(device)
    count = len(net.steps)
    scratch = [0.0] * count
    with torch.enable_grad():
        records, initial_loss = _forward(net, fed, timer, scratch)  # Caffe's clean forward and backward
        _backward(net, records, timer, scratch)
        del records
        if on_initial is not None:
            on_initial(initial_loss)
        forward, backward = [0.0] * count, [0.0] * count
        forward_total = backward_total = 0.0
        per_iteration = []
        total_start = timer.now()
        for j in range(iterations):
            start = timer.now()
            records, _ = _forward(net, fed, timer, forward)
            middle = timer.now()
            _backward(net, records, timer, backward)
            del records
            end = timer.now()
            forward_total += middle - start
            backward_total += end - middle
            per_iteration.append((end - start) * 1000.0)
            if on_iteration is not None:
                on_iteration(j + 1, per_iteration[-1])
        total = (timer.now() - total_start) * 1000.0
    layers = [LayerTiming(step.name, step.type, forward[k] * 1000.0 / iterations, backward[k] * 1000.0 / iterations)
              for k, step in enumerate(net.steps)]
    return TimingResult(iterations=iterations, device=str(device), initial_loss=initial_loss, layers=layers,
                        forward_ms=forward_total * 1000.0 / iterations, backward_ms=backward_total * 1000.0 / iterations,
                        forward_backward_ms=total / iterations, total_ms=total, iteration_ms=per_iteration)

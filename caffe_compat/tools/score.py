"""``caffe test``: score a net — N forward passes of its TEST phase, every output blob's values per batch
and their means, printed as Caffe prints them.

Caffe's ``test()`` (``tools/caffe.cpp``) loads the net in the TEST phase with the weights, runs
``Forward`` ``-iterations`` times and logs, for every element of every output blob (the blobs no layer
consumes, sorted by name):

* ``Batch <i>, <name> = <value>`` for each batch ``i`` (0-based);
* ``Loss: <mean of the forward losses>``;
* ``<name> = <mean>`` with `` (* <loss_weight> = <loss_weight · mean> loss)`` appended for loss outputs.

Sums are float32 as Caffe's (``vector<float>``), divided by the iteration count; numbers are printed as
iostream prints floats (6 significant digits).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from caffe_compat.errors import CaffeCompatError
from caffe_compat.io.glog import g6
from caffe_compat.tools.netsetup import as_tensors

__all__ = ["ScoreOutput", "ScoreResult", "score_net"]


@dataclass
class ScoreOutput:
    """One element of an output blob: its blob, index inside the blob, mean over the batches, loss weight."""

    name: str
    index: int
    mean: float
    loss_weight: float

    def caffe_line(self) -> str:
        extra = ""
        if self.loss_weight:
            weighted = np.float32(self.loss_weight) * np.float32(self.mean)
            extra = f" (* {g6(self.loss_weight)} = {g6(weighted)} loss)"
        return f"{self.name} = {g6(self.mean)}{extra}"

    def as_dict(self) -> dict:
        return {"name": self.name, "index": self.index, "mean": self.mean, "loss_weight": self.loss_weight}


@dataclass
class ScoreResult:
    iterations: int
    device: str
    loss: float
    outputs: list[ScoreOutput]
    batches: list[list[tuple[str, float]]] = field(default_factory=list)

    def caffe_lines(self) -> list[str]:
        """Caffe's lines after the batches: ``Loss: ...`` and one ``name = mean`` per output element."""
        return [f"Loss: {g6(self.loss)}"] + [o.caffe_line() for o in self.outputs]

    def as_dict(self) -> dict:
        return {"iterations": self.iterations, "device": self.device, "loss": self.loss,
                "outputs": [o.as_dict() for o in self.outputs],
                "batches": [[{"name": n, "value": v} for n, v in batch] for batch in self.batches]}


def batch_lines(index: int, values: list[tuple[str, float]]) -> list[str]:
    """Caffe's ``Batch <i>, <name> = <value>`` lines of one batch."""
    return [f"Batch {index}, {name} = {g6(value)}" for name, value in values]


@torch.no_grad()
def score_net(net, iterations: int = 50, inputs: dict | None = None,
              on_batch: Callable[[int, list[tuple[str, float]]], None] | None = None,
              keep_batches: bool = True) -> ScoreResult:
    """Forward ``net`` ``iterations`` times (data layers advance; ``inputs`` — ``{blob: array}`` — feed
    Input blobs the same values every time) and average every output element as ``caffe test`` does.
    ``on_batch(i, [(name, value), ...])`` is called after each batch (the CLI prints Caffe's lines there);
    ``keep_batches=False`` does not keep the per-batch values in the result."""
    iterations = int(iterations)
    if iterations < 1:
        raise CaffeCompatError(f"iterations must be >= 1, got {iterations}")
    names = net.output_names
    if not names:
        raise CaffeCompatError(f"net '{net.name}' has no output blobs to score")
    device = net._device()
    fed = as_tensors(inputs or {}, device)
    weights = net.loss_weights
    sums: list[np.ndarray] | None = None
    loss = np.float32(0.0)
    batches = []
    for i in range(iterations):
        blobs = net(**fed)
        loss = np.float32(loss + np.float32(float(net.objective(blobs))))
        values = [blobs[name].detach().float().reshape(-1).cpu().numpy() for name in names]
        if sums is None:
            sums = [v.astype(np.float32).copy() for v in values]
        else:
            for total, v in zip(sums, values):
                total += v  # float32, as Caffe's vector<float>
        flat = [(name, float(x)) for name, v in zip(names, values) for x in v.tolist()]
        if keep_batches:
            batches.append(flat)
        if on_batch is not None:
            on_batch(i, flat)
    count = np.float32(iterations)
    outputs = [ScoreOutput(name, k, float(np.float32(total[k]) / count), float(weights.get(name, 0.0)))
               for name, total in zip(names, sums) for k in range(total.size)]
    return ScoreResult(iterations=iterations, device=str(device), loss=float(loss / count), outputs=outputs,
                       batches=batches)

"""A function recorded once as a CUDA graph and replayed, and a small least-recently-used cache of them.

A computation made of many small kernels spends its time launching them one by one from Python; recorded
as a CUDA graph it launches them at once (the authors' FAPPY layer, :mod:`caffe_compat.losses.fappy`, is
~150 small kernels per call: launched one by one they take ~2.5 ms on an H100 whose kernels need ~0.3 ms).  The graph
holds fixed shapes and no host synchronisation, so the function must be written for that.

* :class:`GraphedFunction`: ``fn(*inputs)`` (tensors in, a tuple of tensors out) recorded on copies of
  the first inputs, after two warm-up calls on a side stream; calls copy new inputs of the same shapes
  in and replay.  The outputs are the graph's own buffers, overwritten by the next replay: clone what
  you keep.
* :class:`GraphCache`: one graph per key, function, device and input shapes and dtypes, at most
  ``capacity`` kept, the least recently used dropped first.
* :func:`can_replay`: whether a tensor's computation can go through a graph now (on CUDA, and not
  while a graph is being captured on the current stream).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

__all__ = ["GraphCache", "GraphedFunction", "can_replay"]


def can_replay(t: torch.Tensor) -> bool:
    """``t`` lives on CUDA and no graph is being captured on the current stream."""
    return t.is_cuda and not torch.cuda.is_current_stream_capturing()


class GraphedFunction:
    """``fn(*inputs)`` recorded once as a CUDA graph and replayed on copies of new inputs of the same
    shapes (see the module docstring)."""

    def __init__(self, fn: Callable, *inputs: torch.Tensor):
        device = inputs[0].device
        self.inputs = [t.clone() for t in inputs]
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up: cuBLAS handles and cached tensors made outside the capture
            for _ in range(2):
                fn(*self.inputs)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = fn(*self.inputs)

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        for static, value in zip(self.inputs, inputs):
            static.copy_(value)
        self.graph.replay()
        return self.out


class GraphCache:
    """Graphs by ``(key, device, input shapes and dtypes)``, at most ``capacity``, least recently used
    dropped first."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.graphs: dict = {}  # insertion order = use order, oldest first

    def replay(self, key: Hashable, fn: Callable, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``fn(*inputs)`` through the graph cached for ``key`` and these inputs, recorded on a miss (``fn``
        is used only then; ``key`` must tell the functions apart)."""
        full_key = (key, inputs[0].device) + tuple((t.shape, t.dtype) for t in inputs)
        graph = self.graphs.pop(full_key, None) or GraphedFunction(fn, *inputs)
        self.graphs[full_key] = graph
        while len(self.graphs) > self.capacity:
            self.graphs.pop(next(iter(self.graphs)))
        return graph(*inputs)

    def clear(self) -> None:
        self.graphs.clear()

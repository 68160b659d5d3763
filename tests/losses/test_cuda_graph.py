"""The generic CUDA-graph cache FAPPY replays its layer through: replays equal eager calls, least
recently used graphs go first, and nothing is graphed off CUDA."""

from __future__ import annotations

import pytest
import torch

from caffe_compat.losses.cuda_graph import GraphCache, can_replay

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


def _fn(x: torch.Tensor, y: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, ...]:
    return (x @ y * scale, (x.abs() + 1).log().sum())


def test_cpu_tensors_are_not_graphed():
    assert not can_replay(torch.zeros(2))


@needs_cuda
def test_replays_equal_eager_calls_and_the_oldest_graph_goes_first():
    cache = GraphCache(capacity=2)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(3):  # new inputs, same shapes: one graph, replayed
        x, y = (torch.randn(8, 8, device="cuda", generator=gen) for _ in range(2))
        got = [t.clone() for t in cache.replay("f", _fn, x, y)]
        for a, b in zip(got, _fn(x, y)):
            torch.testing.assert_close(a, b)
    assert len(cache.graphs) == 1 and can_replay(x)
    cache.replay("f", _fn, torch.ones(4, 4, device="cuda"), torch.ones(4, 4, device="cuda"))  # other shapes
    cache.replay("f", _fn, x, y)  # used again: now the most recent
    cache.replay("g", lambda a, b: _fn(a, b, scale=2.0), x, y)  # another key, same shapes
    assert len(cache.graphs) == 2
    # the (4, 4) graph, least recently used, was dropped
    assert [(key[0], key[2][0]) for key in cache.graphs] == [("f", torch.Size([8, 8])), ("g", torch.Size([8, 8]))]
    torch.testing.assert_close(cache.replay("g", None, x, y)[0], x @ y * 2.0)  # cached: fn not needed

"""FAPPY's optimised caffe-mode layer gives the same loss and diff, bit for bit, as the layer before the
speed work (``tests/losses/fappy_frozen.py``), on the benchmark's inputs and on inputs built to hit
the corner cases: cosines on bin edges and tied, every delta from 2 down to 1e-6 (every table/search
split of the levels), lone labels, no positive pair, tiny batches."""

from __future__ import annotations

import warnings

import pytest
import torch

from caffe_compat.losses import fappy
from caffe_compat.losses.fappy import FAPPYLoss, caffe_levels, fappy_caffe_forward_backward
from caffe_compat.losses.fappy_rows import _from_matrix, _from_vector
from caffe_compat.losses.pairwise import cosine_matrix
from tests.losses import fappy_frozen

DELTAS = [2.0, 0.3, 1e-2, 3e-3, 1e-3, 1e-4, 1e-6]


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().reshape(-1)
    return t.view(torch.int64 if t.dtype == torch.float64 else torch.int32)


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return torch.equal(_bits(a), _bits(b))


def _batch(b, dim, run, seed):
    gen = torch.Generator().manual_seed(seed)
    labels = torch.arange(b) // run
    centres = torch.randn(int(labels.max()) + 1, 16, generator=gen)
    z = centres[labels] + 1.5 * torch.randn(b, 16, generator=gen)
    return z @ torch.randn(16, dim, generator=gen), labels.to(torch.float32)


@pytest.mark.parametrize("delta", DELTAS)
@pytest.mark.parametrize("b,dim,run", [(128, 512, 10), (150, 64, 16), (40, 32, 3), (9, 8, 4)])
def test_layer_matches_the_frozen_layer_bitwise(b, dim, run, delta):
    for seed in range(3):
        x, labels = _batch(b, dim, run, seed)
        s = _from_matrix(cosine_matrix(x))
        levels = caffe_levels(delta)
        loss, h = fappy._caffe(s, labels, levels)
        ref_loss, ref_h = fappy_frozen._caffe(s, labels, levels)
        assert _same(loss, ref_loss) and _same(h, ref_h)


@pytest.mark.parametrize("delta", DELTAS)
def test_forward_backward_on_bin_edges_and_ties_matches_the_frozen_layer(delta):
    for seed, (b, run) in enumerate([(64, 8), (33, 5), (20, 20), (12, 1), (2, 2)]):
        gen = torch.Generator().manual_seed(seed)
        m = b * (b - 1) // 2
        cos = (torch.round(torch.randn(m, generator=gen) * 32) / 32).clamp(-1.0, 31 / 32)  # many ties, on edges
        labels = torch.arange(b) // run
        loss, diff = fappy_caffe_forward_backward(cos, labels, delta)
        ref_loss, e = fappy_frozen._caffe(_from_vector(cos, b), labels, caffe_levels(delta))
        iu, ju = torch.triu_indices(b, b, 1)
        ref_diff = torch.zeros(m, dtype=torch.float64) if e is None else e[iu, ju]
        assert _same(loss, ref_loss.float()) and _same(diff, ref_diff.float())


@pytest.mark.parametrize("delta", [1e-2, 1e-3, 1e-4])
def test_module_gradient_matches_the_frozen_layer_bitwise(delta):
    x, labels = _batch(128, 512, 10, 0)
    x.requires_grad_()
    loss = FAPPYLoss(delta)(x, labels)
    loss.backward()
    with torch.no_grad():
        sim = cosine_matrix(x)
        ref_loss, e = fappy_frozen._caffe(_from_matrix(sim), labels, caffe_levels(delta))
        ref_grad = fappy._cosine_backward(x, sim, e.to(x.dtype))
    assert _same(loss, ref_loss.to(x.dtype)) and _same(x.grad, ref_grad)



def test_the_geometry_caches_step_aside_under_compile(monkeypatch):
    """``_pair_geometry`` and ``_widths`` are cached in eager mode and traced as plain functions under
    ``torch.compile``: Dynamo warned (``functools.lru_cache``-wrapped function) at each when it had to trace
    through the cache, which a ``train --compile`` of a FAPPY net printed.  ``FAPPYLoss`` traces as one graph
    (the static form, as the layer port under compile) and gives eager's loss and gradient bit for bit."""
    from caffe_compat.losses import fappy_rows

    monkeypatch.setattr(torch._dynamo.utils, "warn_once_cache", set(), raising=False)  # Dynamo warns once a process
    torch._dynamo.reset()
    loss = FAPPYLoss(delta=1e-2)
    x, labels = _batch(12, 8, 3, seed=4)
    before = fappy_rows._pair_geometry.cache_info(), fappy_rows._widths.cache_info()
    traced_x = x.clone().requires_grad_()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        traced = torch.compile(loss, fullgraph=True, backend="aot_eager")(traced_x, labels)
        traced.backward()
    assert [str(w.message) for w in caught if "lru_cache" in str(w.message)] == []
    assert (fappy_rows._pair_geometry.cache_info(), fappy_rows._widths.cache_info()) == before  # not consulted
    eager_x = x.clone().requires_grad_()
    eager = loss(eager_x, labels)
    eager.backward()
    assert torch.equal(_bits(traced), _bits(eager)) and torch.equal(_bits(traced_x.grad), _bits(eager_x.grad))
    assert fappy_rows._widths.cache_info().currsize >= 1  # the eager call used the cache

"""Candidate selection of the k-NN engine: NumPy bound-and-gather path vs ``torch.topk`` (the CUDA path).

The candidate values must be exactly the top-c multiset (ties included), and every retrieval result
(neighbours, similarities, MAP@R, precision@1, Recall@K) must be identical whichever path selects.
"""

import numpy as np
import pytest
import torch

from caffe_compat.evaluate import select
from caffe_compat.evaluate.knn import topk_neighbours
from caffe_compat.evaluate.map_at_r import ranking_scores
from caffe_compat.evaluate.recall import recall_at_k


@pytest.fixture(autouse=True)
def numpy_for_every_c(monkeypatch):
    monkeypatch.setattr(select, "MIN_NUMPY_CANDIDATES", 1)  # exercise the NumPy path for small c too


@pytest.fixture
def torch_path(monkeypatch):
    def use_torch():
        monkeypatch.setattr(select, "NUMPY_ON_CPU", False)
    return use_torch


def _tie_heavy(n, prototypes, dim=16, seed=7):
    rng = np.random.default_rng(seed)
    protos = rng.normal(size=(prototypes, dim))
    return protos[rng.integers(0, prototypes, n)].astype(np.float32)


def _blocks():
    rng = np.random.default_rng(0)
    yield torch.from_numpy(rng.normal(size=(40, 3000)).astype(np.float32))          # long rows: group bound
    yield torch.from_numpy(rng.integers(0, 4, size=(30, 900)).astype(np.float32))   # massive ties: fallback
    yield torch.from_numpy(rng.normal(size=(50, 130)).astype(np.float32))           # short rows: argpartition


@pytest.mark.parametrize("c", [1, 7, 60])
def test_row_candidates_hold_the_exact_top_c_values(c):
    for block in _blocks():
        want = torch.topk(block, min(c, block.shape[1]), dim=1).values
        values, columns = select.select_top(*select.row_candidates(block, c), min(c, block.shape[1]))
        assert torch.equal(torch.sort(values, 1, descending=True).values, want)
        assert torch.equal(block.gather(1, columns), values)


@pytest.mark.parametrize("c", [1, 7, 60])
def test_column_candidates_with_a_floor_hold_every_entry_that_can_enter_the_list(c):
    rng = np.random.default_rng(1)
    for block in _blocks():
        block = block.t().contiguous()[:, :200]                     # items are columns
        kept = torch.from_numpy(rng.choice(block.numpy().ravel(), size=(block.shape[1], c)))
        floor = kept.min(dim=1).values
        values, rows, active = select.column_candidates(block, c, floor)
        assert set(torch.nonzero(block.amax(0) > floor)[:, 0].tolist()) <= set(active.tolist())
        merged = kept.clone()  # the columns left out cannot change their lists
        merged[active] = select.merge_top(kept[active], torch.zeros_like(kept[active], dtype=torch.int64),
                                          values, rows, c)[0]
        union = torch.cat([kept, block.t()], 1)
        assert torch.equal(torch.sort(merged, 1, descending=True).values, torch.topk(union, c, dim=1).values)
        assert torch.equal(block.t()[active].gather(1, rows).masked_fill(values == -np.inf, -np.inf), values)


@pytest.mark.parametrize("n,prototypes", [(600, 4), (900, 30), (800, None)])
@pytest.mark.parametrize("budget", [1, 10**12])
def test_numpy_and_torch_selection_give_identical_results(n, prototypes, budget, torch_path):
    x = (_tie_heavy(n, prototypes) if prototypes else
         np.random.default_rng(5).normal(size=(n, 24)).astype(np.float32))
    labels = np.arange(n) % 30
    ks = [1, 59, n // 3]
    ours = [topk_neighbours(x, k, budget_bytes=budget) for k in ks]
    scores = ranking_scores(x, labels, budget_bytes=budget)
    recall = recall_at_k(x, labels, (1, 4, 16), budget_bytes=budget)
    gallery = [topk_neighbours(x[:300], 40, reference=x, budget_bytes=budget)]
    torch_path()
    for k, (sims, idx) in zip(ks, ours):
        ref_sims, ref_idx = topk_neighbours(x, k, budget_bytes=budget)
        assert torch.equal(idx, ref_idx) and torch.equal(sims, ref_sims)
    assert ranking_scores(x, labels, budget_bytes=budget) == scores
    assert recall_at_k(x, labels, (1, 4, 16), budget_bytes=budget) == recall
    ref = topk_neighbours(x[:300], 40, reference=x, budget_bytes=budget)
    assert torch.equal(gallery[0][1], ref[1]) and torch.equal(gallery[0][0], ref[0])

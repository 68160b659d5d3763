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


def _floor_spy(monkeypatch):
    """Record what every floor-only gather returned (None: too many entries, the other paths ran)."""
    results = []
    original = select._above_floor

    def spy(*args, **kwargs):
        results.append(original(*args, **kwargs))
        return results[-1]

    monkeypatch.setattr(select, "_above_floor", spy)
    return results


@pytest.mark.parametrize("c", [1, 6, 60])
@pytest.mark.parametrize("rank", [2, 12, 2000])
def test_floor_only_gather_keeps_the_exact_top_c_of_items_and_kept_lists(c, rank, monkeypatch):
    """Rows and columns with kept lists whose floor is the item's ``rank``-th largest entry: few entries
    lie above it (the floor-only gather runs) for rank 2 and 12, most of them for rank 2000 (the
    fallback); either way the merged lists hold the exact top-c values of item ∪ kept list."""
    rng = np.random.default_rng(3)
    block = torch.from_numpy(rng.normal(size=(300, 3000)).astype(np.float32))
    results = _floor_spy(monkeypatch)
    for items in (block, block.t()):                                    # rows, then columns
        kept = torch.from_numpy(rng.normal(size=(items.shape[0], c)).astype(np.float32))
        floor = torch.topk(items, min(rank, items.shape[1]), dim=1).values[:, -1]
        kept = torch.maximum(kept - kept.amin(1, keepdim=True) + floor[:, None], floor[:, None])  # min = floor
        if items is block:
            values, index = select.row_candidates(block, c, floor)
            active = torch.arange(block.shape[0])
        else:
            values, index, active = select.column_candidates(block, c, floor)
        assert torch.equal(items[active].gather(1, index).masked_fill(values == -np.inf, -np.inf), values)
        merged = kept.clone()
        merged[active] = select.merge_top(kept[active], torch.zeros_like(kept[active], dtype=torch.int64),
                                          values, index, c)[0]
        union = torch.cat([kept, items], 1)
        assert torch.equal(torch.sort(merged, 1, descending=True).values, torch.topk(union, c, dim=1).values)
    taken = [r is not None for r in results]
    assert taken == [rank < 2000] * 2


def test_later_panels_select_above_their_floors(monkeypatch):
    """Self-retrieval in several panels: the panels after the first gather only the entries above
    their floors (no group bound, no transposed copy) and the neighbours are those of ``torch.topk``."""
    x = np.random.default_rng(11).normal(size=(1500, 24)).astype(np.float32)
    results = _floor_spy(monkeypatch)
    ours = topk_neighbours(x, 5, budget_bytes=1)                         # panels of one 256-row tile
    assert sum(r is not None for r in results) >= 8                      # 5 later panels, rows and columns
    monkeypatch.setattr(select, "NUMPY_ON_CPU", False)
    ref = topk_neighbours(x, 5, budget_bytes=1)
    assert torch.equal(ours[1], ref[1]) and torch.equal(ours[0], ref[0])

"""The k-NN scheme is picked by size: small sets (CUB) use the stored half matrix
(:mod:`caffe_compat.evaluate.stored`), large ones (SOP) the panels of :func:`~caffe_compat.evaluate.knn.self_topk`.
Both must give the same neighbours, similarities and metrics, bit for bit, ties included."""

import numpy as np
import pytest
import torch

from caffe_compat.evaluate import stored
from caffe_compat.evaluate.inputs import as_features
from caffe_compat.evaluate.knn import DEFAULT_BUDGET_BYTES, Tiles, exact_topk, self_similarity, self_topk, topk_neighbours
from caffe_compat.evaluate.map_at_r import precision_at_1, ranking_scores


def _data(kind, n, seed=0):
    rng = np.random.default_rng(seed)
    if kind == "random":
        return rng.normal(size=(n, 24)).astype(np.float32)
    if kind.startswith("prototypes"):  # massive exact ties: every item equals one of a few prototypes
        protos = rng.normal(size=(int(kind.split("-")[1]), 16))
        return protos[rng.integers(0, len(protos), n)].astype(np.float32)
    # half the items random, half copies of 3 prototypes: light and tie-heavy rows side by side
    x = rng.normal(size=(n, 16)).astype(np.float32)
    x[::2] = rng.normal(size=(3, 16)).astype(np.float32)[rng.integers(0, 3, len(x[::2]))]
    return x


def _topk(x, k, budget):
    parts = list(self_topk(as_features(x), k, budget_bytes=budget))
    return [p[0] for p in parts], torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts])


def test_the_scheme_follows_the_size():
    assert stored.stored_plan(5924, 59, DEFAULT_BUDGET_BYTES) == 16            # CUB: stored half matrix
    assert stored.stored_plan(5924, 1, DEFAULT_BUDGET_BYTES) == 16
    assert stored.stored_plan(60502, 11, DEFAULT_BUDGET_BYTES) is None         # SOP: panels
    assert stored.stored_plan(700, 699, 10**12) is None                         # k too large for a bound
    assert stored.stored_plan(700, 40, 10**12) == 4                             # fewer items: smaller groups
    assert stored.stored_plan(255, 5, 10**12) is None                           # one unpadded tile: no strips
    assert stored.stored_plan(5924, 59, 64 * 2**20) is None                     # the budget is honoured
    assert stored.stored_plan(stored.MAX_ITEMS, 5, 2**40) == 16                 # indices fit the sort keys
    assert stored.stored_plan(stored.MAX_ITEMS + 1, 5, 2**40) is None


@pytest.mark.parametrize("kind,n", [("random", 700), ("random", 300), ("prototypes-4", 600),
                                    ("prototypes-30", 900), ("mixed", 800), ("random", 200)])
@pytest.mark.parametrize("k", [1, 5, 40, 61])
def test_stored_scheme_equals_panels_and_brute_force(kind, n, k, monkeypatch):
    x = _data(kind, n)
    group = stored.stored_plan(n, k, 10**12)
    starts, sims, idx = _topk(x, k, 10**12)
    if group is not None:
        assert starts == [0]
    monkeypatch.setattr(stored, "stored_plan", lambda n, k, budget: None)
    _, ref_sims, ref_idx = _topk(x, k, 1)
    assert torch.equal(idx, ref_idx) and torch.equal(sims, ref_sims)
    whole = self_similarity(Tiles(as_features(x)), 0, n)
    whole.fill_diagonal_(float("-inf"))
    brute_sims, brute_idx = exact_topk(whole, k)
    assert torch.equal(idx, brute_idx) and torch.equal(sims, brute_sims)


@pytest.mark.parametrize("kind", ["random", "prototypes-4", "prototypes-30", "mixed"])
def test_metrics_equal_across_schemes_with_lone_queries(kind, monkeypatch):
    n = 900
    x = _data(kind, n, seed=3)
    labels = np.arange(n) % 40
    labels[:7] = 1000 + np.arange(7)  # lone queries: left out of MAP@R and precision@1
    assert stored.stored_plan(n, int(np.bincount(labels).max()) - 1, DEFAULT_BUDGET_BYTES) is not None
    scores = ranking_scores(x, labels)
    p1 = precision_at_1(x, labels)
    neighbours = topk_neighbours(x, 30)
    monkeypatch.setattr(stored, "stored_plan", lambda n, k, budget: None)
    assert ranking_scores(x, labels) == scores
    assert precision_at_1(x, labels) == p1
    ref = topk_neighbours(x, 30)
    assert torch.equal(neighbours[0], ref[0]) and torch.equal(neighbours[1], ref[1])


@pytest.mark.parametrize("kind,n", [("random", 700), ("prototypes-4", 600), ("mixed", 800)])
def test_large_k_ranks_whole_rows_with_the_half_matrix_results(kind, n, monkeypatch):
    """From ROWS_SCHEME_MIN_K neighbours on, the CPU ranks whole rows (similarity_blocks; the column top-k of
    the half matrix costs more than the matmul it saves there): the same neighbours, similarities and metrics
    as the half matrix, bit for bit, ties included, and those of brute force."""
    from caffe_compat.evaluate import knn

    x = _data(kind, n, seed=5)
    k = knn.ROWS_SCHEME_MIN_K + 7
    labels = np.arange(n) % 3  # R = n/3 - 1 >= ROWS_SCHEME_MIN_K: MAP@R takes the whole-row road too
    blocks = []
    monkeypatch.setattr(knn, "similarity_blocks", lambda *a, _real=knn.similarity_blocks, **kw: blocks.append(1) or
                        _real(*a, **kw))
    starts, sims, idx = _topk(x, k, 1)
    scores = ranking_scores(x, labels)
    assert starts == list(range(0, n, 256)) and len(blocks) == 2  # one call each; 256-row chunks at budget 1
    monkeypatch.setattr(knn, "ROWS_SCHEME_MIN_K", 10**9)
    _, ref_sims, ref_idx = _topk(x, k, 1)
    assert torch.equal(idx, ref_idx) and torch.equal(sims, ref_sims)
    assert ranking_scores(x, labels) == scores and len(blocks) == 2
    whole = self_similarity(Tiles(as_features(x)), 0, n)
    whole.fill_diagonal_(float("-inf"))
    brute_sims, brute_idx = exact_topk(whole, k)
    assert torch.equal(idx, brute_idx) and torch.equal(sims, brute_sims)


def test_tie_heavy_items_dropped_early_still_rank_exactly(monkeypatch):
    # with k = 2 the cap is 20 candidates: the entries of tie-heavy items are dropped while strips are
    # read (more than 2 · n · cap held), their rows then ranked whole
    x = _data("prototypes-4", 1100, seed=5)
    _, sims, idx = _topk(x, 2, 10**12)
    whole = self_similarity(Tiles(as_features(x)), 0, len(x))
    whole.fill_diagonal_(float("-inf"))
    brute_sims, brute_idx = exact_topk(whole, 2)
    assert torch.equal(idx, brute_idx) and torch.equal(sims, brute_sims)
    # the truly nearest: their float64 similarities are each row's two largest.  Copies of one prototype tie
    # in exact arithmetic, but a GEMM may round a copy's dot product an ulp apart by its position in a tile
    # (AVX-512 kernels do, in float32 and float64 alike), so the copies' order is no index order; the values
    # agree within the float64 GEMM's rounding of 16-term dot products of unit vectors (16·2^-53 < 2^-48)
    p = x.astype(np.float64) / np.linalg.norm(x.astype(np.float64), axis=1, keepdims=True)
    s = p @ p.T
    np.fill_diagonal(s, -np.inf)
    chosen, best = np.take_along_axis(s, idx.numpy(), 1), -np.sort(-s, axis=1)[:, :2]
    assert np.all(np.abs(chosen - best) <= 2.0 ** -48)
    monkeypatch.setattr(stored, "stored_plan", lambda n, k, budget: None)
    _, ref_sims, ref_idx = _topk(x, 2, 1)
    assert torch.equal(idx, ref_idx) and torch.equal(sims, ref_sims)


def test_candidates_ranked_by_one_key_sort_keep_order_ties_and_signed_zeros():
    # per item: (similarity desc, column asc) over its candidates, -0.0 tied with +0.0 and read back with
    # its sign; items with count 0 (ranked on whole rows elsewhere) get zero rows
    rng = np.random.default_rng(7)
    n, k = 40, 5
    counts = rng.integers(k, 3 * k, n)
    counts[[3, 17]] = 0
    pool = np.array([0.5, -0.0, 0.0, -0.25, 1.0, -1.0, np.finfo(np.float32).min, 2e-45, -2e-45], np.float32)
    items = np.repeat(np.arange(n), counts).astype(np.int32)
    neighbours = np.concatenate([rng.choice(stored.MAX_ITEMS, c, replace=False) for c in counts]).astype(np.int32)
    values = rng.choice(pool, len(items)).astype(np.float32)
    shuffle = rng.permutation(len(items))
    sims, columns = stored._ranked(items[shuffle], neighbours[shuffle], values[shuffle], counts, k)
    for item in range(n):
        mine = np.flatnonzero(items == item)
        if counts[item] == 0:
            assert not sims[item].any() and not columns[item].any()
            continue
        by_rank = sorted(mine, key=lambda e: (-float(values[e]), neighbours[e]))[:k]  # -0.0 == 0.0: a tie
        assert columns[item].tolist() == neighbours[by_rank].tolist()
        assert sims[item].numpy().view(np.int32).tolist() == values[by_rank].view(np.int32).tolist()


def test_the_triangle_buffer_outlives_its_mapping_handle_and_small_ones_are_plain():
    big = stored._huge_page_floats(3 * 2**20)  # 12 MB: mapped, huge pages advised
    big[:] = torch.arange(len(big), dtype=torch.float32)
    import gc

    gc.collect()
    assert big[-1] == len(big) - 1 and big.dtype == torch.float32 and big.numpy().flags.writeable
    small = stored._huge_page_floats(1000)
    assert small.shape == (1000,) and small.dtype == torch.float32

"""The k-NN engine: order keys, deterministic ties, query masking by index, chunking invariance."""

import numpy as np
import pytest
import torch

from caffe_compat.errors import CaffeCompatError
from caffe_compat.evaluate.knn import chunk_rows, order_keys, topk_neighbours


def test_order_keys_rank_by_similarity_then_lower_index():
    sims = torch.tensor([[0.5, -0.0, 0.0, -1.0, 0.5, -0.25, -0.5, -0.125]])
    order = torch.argsort(order_keys(sims), dim=1, descending=True)
    assert order.tolist() == [[0, 4, 1, 2, 7, 5, 6, 3]]


def test_identical_features_rank_by_index_with_self_masked():
    x = np.ones((4, 3), dtype=np.float32)
    sims, idx = topk_neighbours(x, 3)
    assert idx.tolist() == [[1, 2, 3], [0, 2, 3], [0, 1, 3], [0, 1, 2]]
    torch.testing.assert_close(sims, torch.ones(4, 3), rtol=0, atol=1e-6)
    assert len(set(sims.flatten().tolist())) == 1  # identical rows: exact ties


def test_duplicate_of_query_is_kept_and_query_itself_is_not():
    # x0 == x1: each must find the other at rank 0, never itself.
    x = np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.6, 0.8]], dtype=np.float32)
    sims, idx = topk_neighbours(x, 3)
    assert idx.tolist() == [[1, 3, 2], [0, 3, 2], [3, 0, 1], [2, 0, 1]]
    np.testing.assert_allclose(sims.numpy(), [[1, 0.6, 0], [1, 0.6, 0], [0.8, 0, 0], [0.8, 0.6, 0.6]], atol=1e-7)


def test_query_against_gallery_and_cosine_normalisation():
    gallery = np.array([[0.0, 3.0], [2.0, 0.0], [1.0, 1.0]])
    query = np.array([[10.0, 0.1], [-1.0, 0.0]])
    sims, idx = topk_neighbours(query, 3, reference=gallery)
    assert idx.tolist() == [[1, 2, 0], [0, 2, 1]]
    q = query / np.linalg.norm(query, axis=1, keepdims=True)
    g = gallery / np.linalg.norm(gallery, axis=1, keepdims=True)
    np.testing.assert_allclose(sims.numpy(), np.take_along_axis(q @ g.T, idx.numpy(), 1), atol=1e-6)


@pytest.mark.parametrize("budget", [1, 40_000, 10**9])
def test_chunking_gives_identical_neighbours(budget):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(257, 24)).astype(np.float32)
    ref_sims, ref_idx = topk_neighbours(x, 20, budget_bytes=10**12)
    sims, idx = topk_neighbours(x, 20, budget_bytes=budget)
    assert torch.equal(idx, ref_idx)
    assert torch.equal(sims, ref_sims)  # bitwise: every row comes from the same 256-row matmul
    # brute force in float64
    xn = x / np.linalg.norm(x, axis=1, keepdims=True)
    s = xn.astype(np.float64) @ xn.T.astype(np.float64)
    np.fill_diagonal(s, -np.inf)
    assert np.array_equal(np.argsort(-s, axis=1, kind="stable")[:, :20], idx.numpy())


def test_chunk_rows_respects_budget():
    assert chunk_rows(60_502, 256 * 2**20) == 184  # 256 MiB / (60,502 · 24 B), raised to 1 tile of 256 rows
    assert chunk_rows(1000, 1) == 1
    with pytest.raises(CaffeCompatError):
        chunk_rows(10, 0)


def test_bad_input_raises_clear_errors():
    with pytest.raises(CaffeCompatError, match="k must be"):
        topk_neighbours(np.ones((3, 2)), 3)
    with pytest.raises(CaffeCompatError, match="NaN"):
        topk_neighbours(np.array([[1.0, np.nan], [0.0, 1.0]]), 1)
    with pytest.raises(CaffeCompatError, match="shape"):
        topk_neighbours(np.ones(5), 1)
    with pytest.raises(CaffeCompatError, match="dimension"):
        topk_neighbours(np.ones((3, 2)), 1, reference=np.ones((3, 4)))


@pytest.mark.parametrize("k", [1, 7, 39, 40, 41, 199])
@pytest.mark.parametrize("budget", [1, 100_000, 10**12])
def test_massive_ties_match_stable_brute_force(k, budget):
    # 200 items drawn from 5 prototypes: each row has 5 runs of exactly equal similarities, so every k
    # cuts through a tie on some rows (exercising the exact fallback) and inside ties on others
    rng = np.random.default_rng(7)
    prototypes = rng.normal(size=(5, 16))
    which = rng.integers(0, 5, 200)
    x = prototypes[which]
    _, idx = topk_neighbours(x, k, budget_bytes=budget)
    p = prototypes / np.linalg.norm(prototypes, axis=1, keepdims=True)
    s = (p @ p.T)[which][:, which]
    np.fill_diagonal(s, -np.inf)
    assert np.array_equal(idx.numpy(), np.argsort(-s, axis=1, kind="stable")[:, :k])


def test_self_similarity_is_exactly_symmetric_and_independent_of_row_grouping():
    from caffe_compat.evaluate.knn import Tiles, self_similarity

    x = torch.nn.functional.normalize(torch.from_numpy(np.random.default_rng(4).normal(size=(600, 20)).astype(np.float32)))
    tiles = Tiles(x)
    whole = self_similarity(tiles, 0, 600)
    assert torch.equal(whole, whole.t())
    torch.testing.assert_close(whole, x @ x.t(), rtol=0, atol=1e-6)
    assert torch.equal(self_similarity(tiles, 256, 600, 256), whole[256:, 256:])
    assert torch.equal(self_similarity(tiles, 256, 512), whole[256:512])


@pytest.mark.parametrize("n", [2, 31, 255])
def test_a_set_within_one_tile_is_its_own_unpadded_tile(n):
    """Fewer than 256 items: one (n, D) @ (D, n) product (no 256-row padding: ~0.5 ms, what PML takes to evaluate 20
    items), symmetrised; every scheme and budget ranks from it.  From 256 items on the last tile is padded."""
    from caffe_compat.evaluate.knn import TILE_ROWS, Tiles, exact_topk, self_similarity, self_topk

    x = torch.nn.functional.normalize(torch.from_numpy(np.random.default_rng(n).normal(size=(n, 12)).astype(np.float32)))
    tiles = Tiles(x)
    assert tiles.count == 1 and tiles[0].shape == (n, 12)
    product = x @ x.t()
    whole = product.triu() + product.triu(1).t()
    assert torch.equal(self_similarity(tiles, 0, n), whole)
    whole.fill_diagonal_(float("-inf"))
    k = min(5, n - 1)
    ref_sims, ref_idx = exact_topk(whole, k)
    for budget in (1, 10**12):
        parts = list(self_topk(x, k, budget_bytes=budget))
        assert torch.equal(torch.cat([i for _, _, i in parts]), ref_idx)
        assert torch.equal(torch.cat([v for _, v, _ in parts]), ref_sims)
    for rows in (TILE_ROWS, TILE_ROWS + 1, 2 * TILE_ROWS + 3):
        padded = Tiles(torch.zeros(rows, 12))
        assert padded[padded.count - 1].shape == (TILE_ROWS, 12)


def _scheme(monkeypatch, scheme):
    """Make :func:`self_topk` take ``scheme`` at every k on the CPU: the half matrix's panels (or the stored
    half matrix where it fits) or whole rows (:data:`~caffe_compat.evaluate.knn.ROWS_SCHEME_MIN_K`)."""
    from caffe_compat.evaluate import knn

    monkeypatch.setattr(knn, "ROWS_SCHEME_MIN_K", 1 if scheme == "rows" else 10**9)


@pytest.mark.parametrize("scheme", ["panels", "rows"])
@pytest.mark.parametrize("k", [1, 40, 699])
@pytest.mark.parametrize("budget", [1, 10**12])
def test_self_topk_over_panels_equals_exact_topk_of_the_whole_matrix(k, budget, scheme, monkeypatch):
    # budget 1: panels (or row chunks) of one tile, so rows get candidates handed down from up to two panels above
    from caffe_compat.evaluate.knn import Tiles, exact_topk, self_similarity, self_topk

    _scheme(monkeypatch, scheme)

    x = torch.nn.functional.normalize(torch.from_numpy(np.random.default_rng(8).normal(size=(700, 16)).astype(np.float32)))
    whole = self_similarity(Tiles(x), 0, 700)
    whole.fill_diagonal_(float("-inf"))
    ref_sims, ref_idx = exact_topk(whole, k)
    parts = list(self_topk(x, k, budget_bytes=budget))
    assert [start for start, _, _ in parts] == ([0, 256, 512] if budget == 1 else [0])
    assert torch.equal(torch.cat([i for _, _, i in parts]), ref_idx)
    assert torch.equal(torch.cat([v for _, v, _ in parts]), ref_sims)


@pytest.mark.parametrize("scheme", ["panels", "rows"])
@pytest.mark.parametrize("k", [1, 150, 151, 599])
def test_massive_ties_across_panels_match_stable_brute_force(k, scheme, monkeypatch):
    _scheme(monkeypatch, scheme)
    rng = np.random.default_rng(9)
    prototypes = rng.normal(size=(4, 16))
    which = rng.integers(0, 4, 600)
    _, idx = topk_neighbours(prototypes[which], k, budget_bytes=1)
    p = prototypes / np.linalg.norm(prototypes, axis=1, keepdims=True)
    s = (p @ p.T)[which][:, which]
    np.fill_diagonal(s, -np.inf)
    assert np.array_equal(idx.numpy(), np.argsort(-s, axis=1, kind="stable")[:, :k])

"""Self-retrieval k-NN for sets whose half similarity matrix fits the memory budget (CUB size).

:func:`caffe_compat.evaluate.knn.self_topk` picks this scheme by size: on the CPU, for 256 items or more and
fewer than :data:`~caffe_compat.evaluate.knn.ROWS_SCHEME_MIN_K` neighbours, when :func:`stored_plan` finds a group size
and the stored upper triangle with its temporaries fits ``budget_bytes`` (CUB, 5,924 items: ~95 MB; SOP,
60,502 items, never: it keeps the panel scheme).
Results are identical to the panel scheme's, bit for bit (tests/evaluate/test_eval_stored.py):

* the similarities are the same fixed-shape ``(256, D) @ (D, 256)`` tile products of the upper
  triangle (:func:`caffe_compat.evaluate.knn.self_similarity`), each computed once and *stored*
  (in one buffer of transparent huge pages where the OS has them): strip ``i`` holds ``S[tile i, 256·i : N]``;
* pass 1 (on each strip as it is made, while it is in cache): a lower bound ``tau`` of every item's k-th largest similarity,
  the k-th largest of ``G = N_pad / g`` maxima of disjoint groups of its entries (``g`` = 2..16).
  An item's entries are its row in its own strip (groups: ``g`` strided columns) and its column in the
  strips above (groups: ``g`` consecutive rows), so both directions are cheap reductions over
  contiguous memory and no strip is transposed. k distinct entries reach ``tau``, so ``tau`` is at most
  the k-th largest; with ``G >= 4k`` groups it keeps ~k + 5 entries per item on generic data;
* pass 2: every entry ``>= tau`` of its item (rows and columns of the strips, compared against the
  thresholds of both of its items). This holds *every* entry whose similarity reaches the item's
  k-th largest, ties included, so the exact top-k by (similarity desc, index asc) is read from the
  candidates alone, by their :func:`~caffe_compat.evaluate.knn.order_keys`;
* the candidates of all items are ranked by one sort of packed 64-bit keys (item, similarity, index:
  :func:`_ranked`), so the scheme serves up to :data:`MAX_ITEMS` items;
* an item with more than ``2k + 16`` candidates (tie-heavy data) gets its exact top-k from its whole
  row, assembled from the stored strips.
"""

from __future__ import annotations

import mmap

import numpy as np
import torch

#: Largest group size of the bound (entries per group); halved until there are >= 4k groups.
MAX_GROUP = 16
#: Groups per neighbour wanted for a tight bound.
GROUPS_PER_NEIGHBOUR = 4
#: Candidates per item above which the item is ranked on its whole row: ``2k + WIDTH_SLACK``.
WIDTH_SLACK = 16
#: Most items of the scheme: an item and a column index fit 15 bits each in :func:`_ranked`'s sort keys.
MAX_ITEMS = 2**15

_TILE = 256
_HUGE_PAGE = 2 * 2**20


def stored_plan(n: int, k: int, budget_bytes: int) -> int | None:
    """The group size ``g`` for ``n`` items and ``k`` neighbours, or None when the scheme does not
    apply (fewer than 256 items: one unpadded tile, :class:`~caffe_compat.evaluate.knn.Tiles`, where its strips are
    whole padded tiles; too few groups for a useful bound; or more memory than ``budget_bytes``)."""
    if n < _TILE:
        return None
    tiles = -(-n // _TILE)
    padded = tiles * _TILE
    group = MAX_GROUP
    while group > 1 and padded // group < GROUPS_PER_NEIGHBOUR * k:
        group //= 2
    if group < 2 or n > MAX_ITEMS:
        return None
    cap = 2 * k + WIDTH_SLACK
    need = (
        tiles * (tiles + 1) // 2 * _TILE * _TILE * 4   # the stored upper triangle (float32)
        + 2 * n * (padded // group) * 4                  # group maxima and their partitioned copy
        + _TILE * padded * 25                            # one strip's worst case: mask, hits, their rows and columns
        + n * cap * 84                                   # candidates held, concatenated, sorted; keys; the table
    )
    return group if need <= budget_bytes else None


def _huge_page_floats(count: int) -> torch.Tensor:
    """An uninitialised float32 buffer of ``count`` values, backed by transparent huge pages where the OS
    offers them (Linux ``madvise``): the stored triangle (~140 MB at CUB size) is then mapped in ~70 faults
    of 2 MiB instead of ~35,000 of 4 KiB (~2.5 µs each on a VM: ~0.08 s of a ~0.4 s evaluation).
    Elsewhere, an ordinary ``torch.empty``. The tensor keeps its mapping alive."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or count * 4 < 2 * _HUGE_PAGE:
        return torch.empty(count, dtype=torch.float32)
    region = mmap.mmap(-1, count * 4, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(advice)
    except OSError:  # huge pages switched off: plain pages, the same memory
        pass
    return torch.frombuffer(region, dtype=torch.float32)


def _strips(tiles, group: int) -> tuple[list[torch.Tensor], np.ndarray]:
    """Strip ``i``: ``S[tile i, 256·i : N_pad]`` from the fixed-shape tile products; the query's own
    entry, padded rows and padded columns are ``-inf``.  With them, the group maxima of every item
    (:func:`_bounds`), taken from each strip as soon as it is made (while it is still in cache)."""
    n, count = tiles.n, tiles.count
    padded = count * _TILE
    per_tile = _TILE // group
    maxima = np.empty((padded, padded // group), dtype=np.float32)
    store = _huge_page_floats(_TILE * _TILE * count * (count + 1) // 2)
    strips, used = [], 0
    for i in range(count):
        width = padded - i * _TILE
        strip = store[used : used + _TILE * width].view(_TILE, width)
        used += _TILE * width
        block = tiles[i] @ tiles[i].t()
        strip[:, :_TILE] = block.triu() + block.triu(1).t()
        for j in range(i + 1, count):
            torch.matmul(tiles[i], tiles[j].t(), out=strip[:, (j - i) * _TILE : (j - i + 1) * _TILE])
        own = torch.arange(_TILE)
        strip[own, own] = float("-inf")
        if padded > n:
            strip[:, n - i * _TILE :] = float("-inf")
            if i == count - 1:
                strip[n - i * _TILE :] = float("-inf")
        # group maxima: the strip's rows (g strided columns each), and its columns past the diagonal
        # tile, the items below (g consecutive rows each)
        values = strip.numpy()
        values.reshape(_TILE, group, width // group).max(axis=1, out=maxima[i * _TILE : (i + 1) * _TILE, i * per_tile :])
        if width > _TILE:
            below = values[:, _TILE:].reshape(per_tile, group, width - _TILE).max(axis=1)
            maxima[(i + 1) * _TILE :, i * per_tile : (i + 1) * per_tile] = below.T
        strips.append(strip)
    return strips, maxima


def _bounds(maxima: np.ndarray, n: int, k: int) -> np.ndarray:
    """Per item, the k-th largest of its ``N_pad / group`` group maxima (rows of ``maxima``)."""
    groups = maxima.shape[1]
    tau = np.partition(maxima[:n], groups - k, axis=1)[:, groups - k]
    # -inf entries (the query itself, padding) never count: every item has >= k finite entries
    return np.maximum(tau, np.finfo(np.float32).min)


def _candidates(strips: list[np.ndarray], tau: np.ndarray, n: int, cap: int):
    """``(items, neighbours, values, counts)``: every entry ``>= tau`` of its item, both directions,
    except those of items found to have more than ``cap`` (their ``counts`` say so: they are ranked on
    their whole rows); entries of such items are dropped as soon as they would hold memory."""
    padded_tau = np.full(len(strips) * _TILE, np.inf, dtype=np.float32)
    padded_tau[:n] = tau
    counts = np.zeros(n, dtype=np.int64)
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    held = 0

    def keep(items, neighbours, values):
        nonlocal held, parts
        counts[:] += np.bincount(items, minlength=n)
        parts.append((items, neighbours, values))
        held += len(items)
        if held > 2 * n * cap:  # tie-heavy items: their entries go, their counts stay
            heavy = counts > cap
            parts = [(i[m], j[m], v[m]) for i, j, v in parts for m in [~heavy[i]]]
            held = sum(len(i) for i, _, _ in parts)

    for i, strip in enumerate(strips):
        base, width = i * _TILE, strip.shape[1]
        flat = strip.reshape(-1)
        hits = np.flatnonzero(strip >= padded_tau[base : base + _TILE, None])  # rows: items of tile i
        row, column = np.divmod(hits.astype(np.int32), np.int32(width))
        keep(row + np.int32(base), column + np.int32(base), flat[hits])
        if width > _TILE:  # columns beyond the diagonal tile: items below, neighbours in tile i
            hits = np.flatnonzero(strip[:, _TILE:] >= padded_tau[base + _TILE :][None, :])
            row, column = np.divmod(hits.astype(np.int32), np.int32(width - _TILE))
            keep(column + np.int32(base + _TILE), row + np.int32(base), flat[row * width + column + _TILE])
    light = [(i[m], j[m], v[m]) for i, j, v in parts for m in [counts[i] <= cap]]
    return (*(np.concatenate([part[at] for part in light]) for at in range(3)), counts)


def _whole_rows(strips: list[torch.Tensor], tile: int, n: int) -> torch.Tensor:
    """Rows of tile ``tile`` of the full matrix (columns ``0:n``), from the stored strips."""
    padded = len(strips) * _TILE
    rows = strips[tile].new_empty((_TILE, padded))
    rows[:, tile * _TILE :] = strips[tile]
    for i in range(tile):
        offset = (tile - i) * _TILE
        rows[:, i * _TILE : (i + 1) * _TILE] = strips[i][:, offset : offset + _TILE].t()
    return rows[:, :n]


_INDEX_BITS = 15


def _ranked(items: np.ndarray, neighbours: np.ndarray, values: np.ndarray, counts: np.ndarray, k: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each item's top-k ``(similarities, columns)`` among its candidates, best first, ties by lower column:
    one ascending sort of the int64 keys ``item · 2^48 + (2^32 − 1 − u) · 2^16 + column · 2 + z``, where
    ``u`` is the similarity's order-preserving unsigned bits (``-0.0`` folded onto ``+0.0``, as
    :func:`~caffe_compat.evaluate.knn.order_keys`) and ``z`` marks a ``-0.0`` so that the value read back from
    the key keeps its bits.  Candidate columns differ within an item, so keys are unique and the order
    exact; items whose ``counts`` are 0 (ranked on whole rows instead) get zero rows, overwritten later."""
    bits = values.view(np.int32)
    negative_zero = (bits == np.int32(-(2**31))).astype(np.int64)
    bits = bits & np.int32(-1 - (negative_zero.astype(np.int32) << 31))  # -0.0 -> +0.0 (clear the sign)
    unsigned = (bits ^ ((bits >> 31) & np.int32(0x7FFFFFFF))).astype(np.int64) + 2**31  # float order
    shift = _INDEX_BITS + 1
    keys = (items.astype(np.int64) << (32 + shift)) | ((2**32 - 1 - unsigned) << shift)
    keys |= (neighbours.astype(np.int64) << 1) | negative_zero
    keys.sort()
    n = len(counts)
    starts = np.cumsum(counts) - counts
    light = np.flatnonzero(counts)
    best = keys[starts[light, None] + np.arange(k)]
    columns = np.zeros((n, k), dtype=np.int64)
    columns[light] = (best >> 1) & (2**_INDEX_BITS - 1)
    ordered = (2**32 - 1 - ((best >> shift) & (2**32 - 1)) - 2**31).astype(np.int32)
    bits = ordered ^ ((ordered >> 31) & np.int32(0x7FFFFFFF))
    bits |= ((best & 1) << 31).astype(np.int32)  # -0.0 back
    sims = np.zeros((n, k), dtype=np.float32)
    sims[light] = bits.view(np.float32)
    return torch.from_numpy(sims), torch.from_numpy(columns)


def stored_topk(tiles, k: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact self-retrieval top-k ``(similarities, columns)`` of all ``tiles.n`` items, best first,
    ties by lower index (see the module docstring)."""
    from caffe_compat.evaluate.knn import exact_topk

    n = tiles.n
    strips, maxima = _strips(tiles, group)
    arrays = [s.numpy() for s in strips]
    tau = _bounds(maxima, n, k)
    cap = 2 * k + WIDTH_SLACK
    items, neighbours, values, counts = _candidates(arrays, tau, n, cap)
    heavy = counts > cap
    sims, columns = _ranked(items, neighbours, values, np.where(heavy, 0, counts), k)
    heavy_rows = np.flatnonzero(heavy)
    for tile in np.unique(heavy_rows // _TILE).tolist():
        rows = heavy_rows[heavy_rows // _TILE == tile]
        whole = _whole_rows(strips, tile, n)[torch.from_numpy(rows - tile * _TILE)]
        where = torch.from_numpy(rows)
        sims[where], columns[where] = exact_topk(whole, k)
    return sims, columns

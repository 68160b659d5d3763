"""Self-retrieval k-NN for sets whose half similarity matrix fits the memory budget (CUB size).

:func:`caffe_compat.evaluate.knn.self_topk` picks this scheme by size: on the CPU, when
:func:`stored_plan` finds a group size and the stored upper triangle with its temporaries fits
``budget_bytes`` (CUB, 5,924 items: ~95 MB; SOP, 60,502 items, never: it keeps the panel scheme).
Results are identical to the panel scheme's, bit for bit (tests/evaluate/test_eval_stored.py):

* the similarities are the same fixed-shape ``(256, D) @ (D, 256)`` tile products of the upper
  triangle (:func:`caffe_compat.evaluate.knn.self_similarity`), each computed once and *stored*:
  strip ``i`` holds ``S[tile i, 256·i : N]``;
* pass 1 (while the strips are made): a lower bound ``tau`` of every item's k-th largest similarity,
  the k-th largest of ``G = N_pad / g`` maxima of disjoint groups of its entries (``g`` = 2..16).
  An item's entries are its row in its own strip (groups: ``g`` strided columns) and its column in the
  strips above (groups: ``g`` consecutive rows), so both directions are cheap reductions over
  contiguous memory and no strip is transposed. k distinct entries reach ``tau``, so ``tau`` is at most
  the k-th largest; with ``G >= 4k`` groups it keeps ~k + 5 entries per item on generic data;
* pass 2: every entry ``>= tau`` of its item (rows and columns of the strips, compared against the
  thresholds of both of its items). This holds *every* entry whose similarity reaches the item's
  k-th largest, ties included, so the exact top-k by (similarity desc, index asc) is read from the
  candidates alone, by their :func:`~caffe_compat.evaluate.knn.order_keys`;
* an item with more than ``2k + 16`` candidates (tie-heavy data) gets its exact top-k from its whole
  row, assembled from the stored strips.
"""

from __future__ import annotations

import numpy as np
import torch

#: Largest group size of the bound (entries per group); halved until there are >= 4k groups.
MAX_GROUP = 16
#: Groups per neighbour wanted for a tight bound.
GROUPS_PER_NEIGHBOUR = 4
#: Candidates per item above which the item is ranked on its whole row: ``2k + WIDTH_SLACK``.
WIDTH_SLACK = 16

_TILE = 256


def stored_plan(n: int, k: int, budget_bytes: int) -> int | None:
    """The group size ``g`` for ``n`` items and ``k`` neighbours, or None when the scheme does not
    apply (too few groups for a useful bound, or more memory than ``budget_bytes``)."""
    tiles = -(-n // _TILE)
    padded = tiles * _TILE
    group = MAX_GROUP
    while group > 1 and padded // group < GROUPS_PER_NEIGHBOUR * k:
        group //= 2
    if group < 2:
        return None
    cap = 2 * k + WIDTH_SLACK
    need = (
        tiles * (tiles + 1) // 2 * _TILE * _TILE * 4   # the stored upper triangle (float32)
        + 2 * n * (padded // group) * 4                  # group maxima and their partitioned copy
        + _TILE * padded * 25                            # one strip's worst case: mask, hits, their rows and columns
        + n * cap * 84                                   # candidates held, concatenated, sorted; keys; the table
    )
    return group if need <= budget_bytes else None


def _strips(tiles) -> list[torch.Tensor]:
    """Strip ``i``: ``S[tile i, 256·i : N_pad]`` from the fixed-shape tile products; the query's own
    entry, padded rows and padded columns are ``-inf``."""
    n, count = tiles.n, tiles.count
    padded = count * _TILE
    strips = []
    for i in range(count):
        strip = tiles.x.new_empty((_TILE, padded - i * _TILE))
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
        strips.append(strip)
    return strips


def _bounds(strips: list[np.ndarray], n: int, k: int, group: int) -> np.ndarray:
    """Per item (padded to whole tiles), the k-th largest of its ``N_pad / group`` group maxima."""
    count = len(strips)
    padded = count * _TILE
    per_tile = _TILE // group
    maxima = np.empty((padded, padded // group), dtype=np.float32)
    for i, strip in enumerate(strips):
        rows = slice(i * _TILE, (i + 1) * _TILE)
        width = strip.shape[1]
        strip.reshape(_TILE, group, width // group).max(axis=1, out=maxima[rows, i * per_tile :])
        if width > _TILE:
            below = strip[:, _TILE:].reshape(per_tile, group, width - _TILE).max(axis=1)
            maxima[(i + 1) * _TILE :, i * per_tile : (i + 1) * per_tile] = below.T
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


def stored_topk(tiles, k: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact self-retrieval top-k ``(similarities, columns)`` of all ``tiles.n`` items, best first,
    ties by lower index (see the module docstring)."""
    from caffe_compat.evaluate.knn import exact_topk, order_keys

    n = tiles.n
    strips = _strips(tiles)
    arrays = [s.numpy() for s in strips]
    tau = _bounds(arrays, n, k, group)
    cap = 2 * k + WIDTH_SLACK
    items, neighbours, values, counts = _candidates(arrays, tau, n, cap)
    heavy = counts > cap
    light_counts = np.where(heavy, 0, counts)
    order = np.argsort(items.astype(np.int16) if n < 2**15 else items, kind="stable")  # int16: radix sort
    items, neighbours, values = items[order], neighbours[order], values[order]
    slot = np.arange(len(items)) - np.repeat(np.cumsum(light_counts) - light_counts, light_counts)
    width = int(max(k, light_counts.max()))
    keys = order_keys(torch.from_numpy(values), torch.from_numpy(neighbours.astype(np.int64))).numpy()
    table = np.full((n, width), np.iinfo(np.int64).min, dtype=np.int64)
    table_values = np.zeros((n, width), dtype=np.float32)
    table_columns = np.zeros((n, width), dtype=np.int32)
    table[items, slot], table_values[items, slot], table_columns[items, slot] = keys, values, neighbours
    best = torch.topk(torch.from_numpy(table), k, dim=1, largest=True, sorted=True).indices
    sims = torch.from_numpy(table_values).gather(1, best)
    columns = torch.from_numpy(table_columns).gather(1, best).to(torch.int64)
    heavy_rows = np.flatnonzero(heavy)
    for tile in np.unique(heavy_rows // _TILE).tolist():
        rows = heavy_rows[heavy_rows // _TILE == tile]
        whole = _whole_rows(strips, tile, n)[torch.from_numpy(rows - tile * _TILE)]
        where = torch.from_numpy(rows)
        sims[where], columns[where] = exact_topk(whole, k)
    return sims, columns

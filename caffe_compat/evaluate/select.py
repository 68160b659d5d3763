"""Exact top-c candidate selection for the k-NN engine (:mod:`caffe_compat.evaluate.knn`).

Every function here returns, per *item* (a row of a similarity block, or a column of one), a
``-inf``-padded list of candidate ``(value, index)`` entries whose ``c`` largest values are exactly the
``c`` largest of the item (together with an item's kept list, when a ``floor`` is given). Which of
several *tied* entries is returned may differ from ``torch.topk``'s choice; no caller depends on it:
:func:`caffe_compat.evaluate.knn.rank_candidates` re-ranks the final candidates by exact order keys and
redoes a row exactly whenever a tie reaches its k-th place.

On CUDA (and any non-CPU device), and for fewer than :data:`MIN_NUMPY_CANDIDATES` candidates (SOP's
k + 1 = 6), this is ``torch.topk``. Otherwise, on the CPU ``torch.topk`` costs 10-35 ns per
entry and cannot use a lower bound; here:

1. a lower bound ``tau`` of each item's c-th largest value comes from ``G >= c`` disjoint groups of
   ``g`` entries (strided: group j holds entries j, j + G, j + 2G, ...; leftover entries only loosen
   the bound): their maxima are one vectorised pass, and the c-th largest of the G maxima is a value
   that c distinct entries reach, hence ``<=`` the item's c-th largest. With ``G ~ 4c`` this keeps
   ~1.1-1.5 c entries per item on generic data. ``tau`` is raised to ``floor`` (the c-th largest of the
   item's kept list, which the kept entries alone already reach);
2. the entries ``>= tau`` are gathered (a comparison and ``np.flatnonzero``), so every entry above the
   c-th largest of (item ∪ kept list) is kept, and at least as many entries equal to it as needed;
3. items with more than ``MAX_WIDTH_FACTOR · c`` candidates (tie-heavy data) fall back to
   ``np.argpartition`` (~6x faster than ``torch.topk``) on their whole rows.

With a finite ``floor`` for every item (the panels of :func:`~caffe_compat.evaluate.knn.self_topk` after
the first), the floor alone is tried first, for every c: the items' entries above it are gathered in one
comparison, without a group bound and, for columns, without a transposed copy of the block (an entry
equal to the floor cannot change the top-c values of an item whose kept list already reaches it).  A
panel's entries rarely beat a floor that earlier panels set (about ``c · P / S`` of a column's P entries
after S seen), so this keeps a few entries per item; when it would keep more than
``1 / FLOOR_ONLY_FRACTION`` of the block, the paths above run instead.  On the CPU at SOP size
(60,502 × 512, c = 6, one thread) it cut the selection from ~11.5 s to ~3.3 s (cProfile), and MAP@R
from 29.1 to 20.4 s, of which 15.8 s are the tile products.

Only values are compared, never positions, so the candidate values are those ``torch.topk`` would
give, on any data: the k-NN results do not depend on which path ran.
"""

from __future__ import annotations

import numpy as np
import torch

#: Select on the CPU through NumPy (False: ``torch.topk`` everywhere, as on CUDA; the tests compare both).
NUMPY_ON_CPU = True
#: Fewer candidates than this go to ``torch.topk`` on every device: for small c its partial sort is as
#: fast as the bound-and-gather path and needs no transposed copy (SOP size, c = k + 1 = 6: 5-15% faster).
MIN_NUMPY_CANDIDATES = 16
#: Candidates per item above which an item is selected by ``argpartition`` on its whole entries.
MAX_WIDTH_FACTOR = 4
#: Groups per bound: ``G ~ GROUPS_PER_CANDIDATE · c`` (more: tighter bound, costlier selection of it).
GROUPS_PER_CANDIDATE = 4
#: The floor-only gather is used when it keeps at most ``1 / FLOOR_ONLY_FRACTION`` of a block's entries.
FLOOR_ONLY_FRACTION = 16


def select_top(values: torch.Tensor, indices: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``c`` largest of each row's candidates (unsorted) with their indices."""
    if values.shape[1] == c:
        return values, indices
    if _numpy(values, c):
        values, at = _argpartition(np.ascontiguousarray(values.numpy()), c)
    else:
        values, at = torch.topk(values, c, dim=1, largest=True, sorted=False)
    return values, indices.gather(1, at)


def merge_top(values: torch.Tensor, indices: torch.Tensor, more_values, more_indices, c: int):
    """The ``c`` largest of two candidate lists per row (unsorted)."""
    return select_top(torch.cat([values, more_values], dim=1), torch.cat([indices, more_indices], dim=1), c)


def row_candidates(sims: torch.Tensor, c: int, floor: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates of each row of ``sims`` (indices: columns), see the module docstring."""
    c = min(c, sims.shape[1])
    if _floor_applies(sims, floor):
        found = _above_floor(sims.numpy(), floor.numpy(), along_rows=True)
        if found is not None:
            return found[0], found[1]
    if not _numpy(sims, c):
        return torch.topk(sims, c, dim=1, largest=True, sorted=False)
    values, indices, _ = _candidates(np.ascontiguousarray(sims.numpy()), c, floor)
    return values, indices


def column_candidates(sims: torch.Tensor, c: int, floor: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Candidates of each column of ``sims`` (indices: rows), as ``(M, width)`` lists, and the
    columns that have one above ``floor`` (the others can change nothing in their kept lists)."""
    c = min(c, sims.shape[0])
    if _floor_applies(sims, floor):
        found = _above_floor(sims.numpy(), floor.numpy(), along_rows=False)
        if found is not None:
            return found
    if not _numpy(sims, c):
        active = torch.arange(sims.shape[1], device=sims.device)
        if floor is not None:
            active = torch.nonzero(sims.amax(dim=0) > floor)[:, 0]
            sims = sims.index_select(1, active)
        values, indices = torch.topk(sims, c, dim=0, largest=True, sorted=False)
        return values.t(), indices.t(), active
    values, indices, counts = _candidates(np.ascontiguousarray(sims.numpy().T), c, floor)  # columns as rows
    if floor is None:
        return values, indices, torch.arange(sims.shape[1])
    active = torch.from_numpy(np.flatnonzero(counts))
    return values[active], indices[active], active


def _numpy(t: torch.Tensor, c: int) -> bool:
    return NUMPY_ON_CPU and t.device.type == "cpu" and c >= MIN_NUMPY_CANDIDATES


def _floor_applies(t: torch.Tensor, floor: torch.Tensor | None) -> bool:
    return (NUMPY_ON_CPU and t.device.type == "cpu" and floor is not None and t.numel() > 0
            and bool(torch.isfinite(floor).all()))


def _above_floor(a: np.ndarray, floor: np.ndarray, along_rows: bool):
    """The entries of each item of ``a`` (its rows when ``along_rows``, else its columns) above the item's
    ``floor``, as ``(values, indices, items)``: ``-inf``-padded ``(len(items), width)`` lists of the items
    that have one (every row when ``along_rows``); None when they are more than
    ``1 / FLOOR_ONLY_FRACTION`` of ``a``'s entries.  ``a`` may be a strided view: it is only compared and
    indexed, never copied."""
    above = a > (floor[:, None] if along_rows else floor[None, :])
    flat = np.flatnonzero(above)                                   # row-major: grouped by row
    if len(flat) > a.size // FLOOR_ONLY_FRACTION:
        return None
    row, column = np.divmod(flat, a.shape[1])
    if along_rows:
        items, group, index = np.arange(a.shape[0]), row, column
        counts = np.bincount(row, minlength=a.shape[0])
    else:
        order = np.argsort(column, kind="stable")                 # grouped by column
        row, column = row[order], column[order]
        items, group, counts = np.unique(column, return_inverse=True, return_counts=True)
        index = row
    values, indices = _padded_lists(group, counts, a[row, column], index)
    return values, indices, torch.from_numpy(items)


def _padded_lists(group: np.ndarray, counts: np.ndarray, values: np.ndarray, index: np.ndarray
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(len(counts), max count)`` lists, ``-inf``/0-padded, of entries given grouped by item in order
    (``group``: each entry's item, ``counts``: the entries per item, ``values``/``index``: theirs)."""
    width = int(counts.max()) if len(counts) else 0
    slot = np.arange(len(group)) - np.repeat(np.cumsum(counts) - counts, counts)
    padded = np.full((len(counts), width), -np.inf, dtype=values.dtype)
    indices = np.zeros((len(counts), width), dtype=np.int64)
    padded[group, slot] = values
    indices[group, slot] = index
    return torch.from_numpy(padded), torch.from_numpy(indices)


def _argpartition(a: np.ndarray, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The c largest entries of each row of the C-contiguous ``a`` (unsorted) and their columns."""
    if c == a.shape[1]:
        return torch.from_numpy(a), torch.arange(c).expand(a.shape[0], c)
    columns = np.argpartition(a, a.shape[1] - c, axis=1)[:, a.shape[1] - c :]
    return torch.from_numpy(np.take_along_axis(a, columns, 1)), torch.from_numpy(columns)


def _group_bound(a: np.ndarray, c: int) -> np.ndarray | None:
    """Per row of ``a``, the c-th largest maximum of ``G >= c`` strided groups (None when the rows are
    too short for groups of two)."""
    length = a.shape[1]
    g = length // (GROUPS_PER_CANDIDATE * c)
    if g < 2:
        g = min(2, length // c)
        if g < 2:
            return None
    groups = length // g
    maxima = a[:, :groups].copy()
    for i in range(1, g):
        np.maximum(maxima, a[:, i * groups : (i + 1) * groups], out=maxima)
    return np.partition(maxima, groups - c, axis=1)[:, groups - c]


def _candidates(a: np.ndarray, c: int, floor: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, np.ndarray | None]:
    """``(values, columns, counts)`` for the rows of the C-contiguous ``a``: the entries ``>= tau``
    (module docstring) and their number per row; after the whole-row fallback, ``counts`` is the
    number of entries ``>= floor`` (None without a floor)."""
    rows, length = a.shape
    tau = _group_bound(a, c)
    if floor is not None:
        tau = floor.numpy() if tau is None else np.maximum(tau, floor.numpy())
    if tau is not None:
        flat = np.flatnonzero(a >= tau[:, None])                      # row-major: grouped by row
        row, column = np.divmod(flat, length)
        counts = np.bincount(row, minlength=rows)
        if (int(counts.max()) if rows else 0) <= MAX_WIDTH_FACTOR * c:
            values, columns = _padded_lists(row, counts, a.reshape(-1)[flat], column)
            return values, columns, counts
    values, columns = _argpartition(a, c)
    counts = None if floor is None else np.count_nonzero(a >= floor.numpy()[:, None], axis=1)
    return values, columns, counts

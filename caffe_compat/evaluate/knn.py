"""Exact k-nearest-neighbour engine in cosine space, in bounded memory, on the CPU or CUDA.

Every retrieval metric of :mod:`caffe_compat.evaluate` reads its neighbours from here.

Similarity: ``S[q, r] = <x_q, y_r>`` of L2-normalised rows (float32 matmul on the chosen device).
The ``Nq × Nr`` matrix is never held whole: query rows are processed in chunks so that one chunk's
block, with its order keys, masks and temporaries (:data:`BYTES_PER_ELEMENT` bytes per entry), stays
under ``budget_bytes`` (default 256 MiB; SOP, 60,502 × 60,502, runs in chunks of one 256-row tile). Chunks are
whole numbers of 256-row tiles and each tile is one fixed-shape matmul (:func:`tiled_matmul`), so the
similarities, hence every result, are bitwise identical for any budget (a budget below one tile's
need is raised to one tile).

Self-retrieval (``reference=None``) excludes each query *by index*: its own column is set to ``-inf``
and removed from the positives, so an exact duplicate of the query elsewhere in the set still counts
as a neighbour (unlike "drop the first neighbour", which may drop the duplicate and keep the query).
Its matrix is built from the 256 × 256 tile products of the upper triangle only (:func:`self_similarity`):
``S[q, r] = S[r, q]`` exactly, and :func:`self_topk` finds the k-NN from that half of the products
(half the matmul work), panel by panel, each panel handing its columns' candidates to the rows below.
The scheme is picked by size: when the stored upper triangle fits the budget (CUB, 5,924 items: ~0.2 GB
worst case, ~0.14 GB measured), :mod:`caffe_compat.evaluate.stored` keeps it and selects every item's
candidates in one bound-and-gather pass (no running lists, no column top-k); larger sets (SOP) use the
panels. On the CPU, from :data:`ROWS_SCHEME_MIN_K` neighbours on (large classes: MAP@R asks for R of them,
999 on a CIFAR-10-shaped set of 10 classes × 1,000), each row is ranked over its whole row instead
(:func:`similarity_blocks`, the lower tiles as transposed copies or products): the column top-k the half
matrix needs then costs more than the matmul it saves. A set of fewer than 256 items is its own unpadded
tile (:class:`Tiles`), ranked by one panel. All give bitwise the same results
(tests/evaluate/test_eval_stored.py, test_eval_knn.py).

Ties are broken deterministically, the same way on every device and for every chunk size: items are
ranked by similarity descending, then by reference index ascending. The order is exact: it is that of
the 64-bit keys ``ordered_bits(S) · 2^31 + (2^31 − 1 − r)``, where ``ordered_bits`` maps a float32 to
an int32 of the same order (``-0.0`` is first folded onto ``+0.0``). For speed, ``topk`` ranks keys
only among the float top-(k+1) candidates and redoes a row on its full keys when its k-th and
(k+1)-th candidates tie; the first-match rank counts, and looks at ties only in rows that have one.
The float candidates come from :mod:`caffe_compat.evaluate.select` (on the CPU: a group-maximum lower
bound, then NumPy; the columns of a panel are selected as rows of its transposed copy, never by a
strided top-k): exact top-(k+1) values, so no result depends on which entries of a tie it returns.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from caffe_compat.evaluate.inputs import EvaluationInputError, as_features
from caffe_compat.evaluate.select import column_candidates, merge_top, row_candidates, select_top

DEFAULT_BUDGET_BYTES = 256 * 2**20
BYTES_PER_ELEMENT = 24  # float32 similarity + worst-case exact-tie path (int64 key + int32 temporaries)
_INDEX_SPAN = 2**31
TILE_ROWS = 256  # every similarity row comes from a (256, D) @ (D, M) matmul: chunking cannot change a bit
#                  (a set of fewer items is its own one tile, see Tiles)
PANEL_BYTES_PER_ELEMENT = 12  # self_topk: float32 panel + float32 transposed copy of its active columns + slack
#: :func:`self_topk` on the CPU ranks whole rows from this many neighbours on.  Measured on the team's Intel Xeon VM
#: (one thread; whole rows ÷ half matrix time): D = 512: k = 100: 1.14 (n = 10,000), 1.15 (20,000); k = 150 to 200:
#: 0.91 to 1.01 (n = 3,000 to 20,000); k = 300: 0.85, 0.79 (10,000, 20,000); k = 999: 0.60 (n = 10,000).  At k = 192
#: with D = 64 or 128: 0.53 to 0.71 (n = 5,924 to 20,000).  Below it the crossover falls with D (the matmul saved
#: shrinks) but not cleanly: D = 64, k = 30: 0.73 at n = 10,000, 1.42 at 20,000; the stored half matrix wins at
#: CUB size whatever D (D = 64 to 256, k = 58: 1.68 to 1.90).
ROWS_SCHEME_MIN_K = 192


def chunk_rows(n_columns: int, budget_bytes: int = DEFAULT_BUDGET_BYTES, extra_bytes_per_row: int = 0) -> int:
    """Query rows per chunk so that ``rows · (n_columns · BYTES_PER_ELEMENT + extra)`` <= budget (>= 1)."""
    if budget_bytes <= 0:
        raise EvaluationInputError(f"budget_bytes must be positive, got {budget_bytes}")
    per_row = n_columns * BYTES_PER_ELEMENT + extra_bytes_per_row
    return max(1, int(budget_bytes // per_row))


def order_keys(sims: torch.Tensor, columns: torch.Tensor | None = None) -> torch.Tensor:
    """int64 keys whose descending order is (similarity desc, column asc); ``columns`` default to
    ``0..M-1`` (the columns of ``sims``), else they give each entry's reference index."""
    if columns is None:
        if sims.shape[1] > _INDEX_SPAN:
            raise EvaluationInputError(f"at most 2^31 reference items are supported, got {sims.shape[1]}")
        columns = torch.arange(sims.shape[1], device=sims.device, dtype=torch.int64)
    bits = (sims + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into +0.0
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # flip magnitude bits of negatives: int order == float order
    keys = ordered.to(torch.int64).mul_(_INDEX_SPAN)
    return keys.add_(_INDEX_SPAN - 1 - columns)


def exact_topk(sims: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of each row by (similarity desc, column asc), via :func:`order_keys` on the whole row."""
    _, columns = torch.topk(order_keys(sims), k, dim=1, largest=True, sorted=True)
    return sims.gather(1, columns), columns


def label_members(labels: torch.Tensor, n_codes: int) -> torch.Tensor:
    """``(n_codes, M)`` table: row c lists the indices of the items of label c ascending, padded with -1."""
    order = torch.sort(labels, stable=True).indices
    counts = torch.bincount(labels, minlength=n_codes)
    starts = counts.cumsum(0) - counts
    grouped = labels[order]
    slots = torch.arange(len(order), device=labels.device) - starts[grouped]
    table = torch.full((n_codes, int(counts.max())), -1, dtype=torch.int64, device=labels.device)
    table[grouped, slots] = order
    return table


def tiled_matmul(query: torch.Tensor, reference_t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """``query[start:stop] @ reference_t`` computed tile by tile: every product is one matmul of the
    fixed shape ``(TILE_ROWS, D) @ (D, M)`` over rows ``256·t .. 256·t+255`` of ``query`` (the last tile
    zero-padded), so each row's float32 similarities are bitwise the same whatever the chunking
    (BLAS picks shape-dependent kernels: a 1-row product differs from a 256-row one in the last bit)."""
    if start % TILE_ROWS:
        raise ValueError("chunks must start on a tile boundary")
    out = torch.empty((stop - start, reference_t.shape[1]), dtype=query.dtype, device=query.device)
    for tile in range(start, stop, TILE_ROWS):
        end = min(tile + TILE_ROWS, stop)
        if end - tile == TILE_ROWS:
            torch.matmul(query[tile:end], reference_t, out=out[tile - start : end - start])
        else:
            padded = query.new_zeros((TILE_ROWS, query.shape[1]))
            padded[: end - tile] = query[tile:end]
            out[tile - start : end - start] = (padded @ reference_t)[: end - tile]
    return out


def rank_candidates(values: torch.Tensor, columns: torch.Tensor, k: int, full_rows) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k from each row's float top-(k+1) candidates (any order): sort them by
    :func:`order_keys`; a row whose k-th and (k+1)-th candidates tie (the tie may reach beyond the
    candidates) is redone by :func:`exact_topk` on ``full_rows(rows)``, its whole similarity rows."""
    order = torch.argsort(order_keys(values, columns), dim=1, descending=True)
    values, columns = values.gather(1, order), columns.gather(1, order)
    boundary_tie = values[:, k - 1] == values[:, k]
    values, columns = values[:, :k].contiguous(), columns[:, :k].contiguous()
    if bool(boundary_tie.any()):
        rows = torch.nonzero(boundary_tie)[:, 0]
        values[rows], columns[rows] = exact_topk(full_rows(rows), k)
    return values, columns


class Tiles:
    """The fixed-shape ``(TILE_ROWS, D)`` row tiles of a feature matrix, the last one zero-padded.  A matrix of fewer
    rows is its own one tile, unpadded: its one product ``(n, D) @ (D, n)`` is the only one any chunking of it makes
    (and a padded one cost ~0.5 ms, what pytorch-metric-learning takes for a whole evaluation of 20 items)."""

    def __init__(self, x: torch.Tensor):
        self.x, self.n = x, x.shape[0]
        self.count = -(-self.n // TILE_ROWS)
        if self.n < TILE_ROWS:
            self.last = x
            return
        first = (self.count - 1) * TILE_ROWS
        self.last = x.new_zeros((TILE_ROWS, x.shape[1]))
        self.last[: self.n - first] = x[first:]

    def __getitem__(self, t: int) -> torch.Tensor:
        return self.last if t == self.count - 1 else self.x[t * TILE_ROWS : (t + 1) * TILE_ROWS]

    def span(self, t: int) -> slice:
        """Rows of the matrix that tile ``t`` holds."""
        return slice(t * TILE_ROWS, min(self.n, (t + 1) * TILE_ROWS))


def self_similarity(tiles: Tiles, start: int, stop: int, column_start: int = 0) -> torch.Tensor:
    """Rows ``start:stop``, columns ``column_start:N`` of the self-similarity matrix (starts on tile
    boundaries). For ``i = tile(q) <= j = tile(r)``, ``S[q, r]`` is an entry of the fixed-shape product
    ``tiles[i] @ tiles[j].T``, ``(256, D) @ (D, 256)``; for ``i > j`` it is ``S[r, q]``; a diagonal
    product keeps its upper triangle and mirrors it. So ``S`` is exactly symmetric and its bits do not
    depend on how rows are grouped. Lower tiles are transposed copies of upper ones when both lie
    inside the requested rows and columns, else transposed products (the same bits)."""
    if start % TILE_ROWS or column_start % TILE_ROWS:
        raise ValueError("rows and columns must start on a tile boundary")
    out = tiles.x.new_empty((stop - start, tiles.n - column_start))
    i0, i1, j0 = start // TILE_ROWS, -(-stop // TILE_ROWS), column_start // TILE_ROWS

    def part(i: int, j: int) -> torch.Tensor:
        rows, cols = tiles.span(i), tiles.span(j)
        return out[rows.start - start : rows.stop - start, cols.start - column_start : cols.stop - column_start]

    for i in range(i0, i1):
        for j in range(max(i, j0), tiles.count):
            target = part(i, j)
            if i == j:
                block = tiles[i] @ tiles[i].t()
                block = block.triu() + block.triu(1).t()
                target.copy_(block[: target.shape[0], : target.shape[1]])
            elif target.shape == (TILE_ROWS, TILE_ROWS):
                torch.matmul(tiles[i], tiles[j].t(), out=target)
            else:
                target.copy_((tiles[i] @ tiles[j].t())[: target.shape[0], : target.shape[1]])
        for j in range(j0, min(i, tiles.count)):
            target = part(i, j)
            if j >= i0:
                target.copy_(part(j, i).t())
            else:
                target.copy_((tiles[j] @ tiles[i].t()).t()[: target.shape[0], : target.shape[1]])
    return out


def self_topk(
    x: torch.Tensor, k: int, *, budget_bytes: int = DEFAULT_BUDGET_BYTES
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Exact self-retrieval k-NN (query excluded by index; ties by lower index, as
    :meth:`SimilarityBlock.topk`), yielded as ``(start, similarities, columns)`` for consecutive rows.

    Only the upper triangle of tile products is computed: the rows are cut into panels (whole tiles,
    ``P · N · PANEL_BYTES_PER_ELEMENT`` <= budget); panel ``[a, b)`` computes ``S[a:b, a:N]``.
    Its rows then have every column (those ``< a`` were handed down by the panels above), so their
    float top-(k+1) candidates are final and go through :func:`rank_candidates`. Its columns ``>= b``
    are rows of later panels: each such row ``r`` keeps a running top-(k+1) list, merged with the
    panel's top-(k+1) of ``S[a:b, r]`` when the panel holds a value above the list's current last one
    (else nothing of the panel can enter it). Needs ``1 <= k <= N - 1``.

    Small sets (see :func:`caffe_compat.evaluate.stored.stored_plan`) skip the panels: one part
    ``(0, similarities, columns)`` from :func:`caffe_compat.evaluate.stored.stored_topk`, the same results.
    So does a large ``k`` on the CPU (:data:`ROWS_SCHEME_MIN_K`): each chunk of :func:`similarity_blocks`, whole
    rows, ranked by :meth:`SimilarityBlock.topk`, the same results.
    """
    n = x.shape[0]
    if not 1 <= k <= n - 1:
        raise EvaluationInputError(f"k must be in [1, {n - 1}] here, got {k}")
    if x.device.type == "cpu" and k >= ROWS_SCHEME_MIN_K:  # the column top-k would cost more than the matmul it saves
        for block in similarity_blocks(x, budget_bytes=budget_bytes, extra_bytes_per_row=16 * k):
            yield block.start, *block.topk(k)
        return
    tiles = Tiles(x)
    group = _stored_group(x, n, k, budget_bytes)
    if group is not None:  # small sets (CUB): the stored half matrix, one bound-and-gather pass
        from caffe_compat.evaluate.stored import stored_topk

        yield 0, *stored_topk(tiles, k, group)
        return
    candidates = k + 1
    panel = max(1, int(budget_bytes // (n * PANEL_BYTES_PER_ELEMENT)) // TILE_ROWS) * TILE_ROWS
    kept_values = x.new_full((n, candidates), float("-inf"))  # -inf placeholders never reach the top k
    kept_columns = torch.zeros((n, candidates), dtype=torch.int64, device=x.device)

    def full_rows(first: int):
        def rows_of(rows: torch.Tensor) -> torch.Tensor:  # tie rows are rare: their tiles' strips again
            queries = rows + first
            out = x.new_empty((len(queries), n))
            for t in torch.unique(queries // TILE_ROWS).tolist():
                where = torch.nonzero(queries // TILE_ROWS == t)[:, 0]
                span = tiles.span(t)
                out[where] = self_similarity(tiles, span.start, span.stop)[queries[where] - span.start]
            out[torch.arange(len(queries), device=x.device), queries] = float("-inf")
            return out

        return rows_of

    for start in range(0, n, panel):
        stop = min(start + panel, n)
        sims = self_similarity(tiles, start, stop, start)
        own = torch.arange(stop - start, device=x.device)
        sims[own, own] = float("-inf")
        kept = kept_values[start:stop]
        values, columns = row_candidates(sims, min(candidates, n - start), kept.amin(dim=1))
        values, columns = merge_top(kept, kept_columns[start:stop], values, columns + start, candidates)
        below = sims[:, stop - start :]
        if stop < n:  # column r: row stop + r against this panel
            panel_values, panel_rows, active = column_candidates(
                below, min(candidates, stop - start), kept_values[stop:].amin(dim=1))
            if len(active):
                rows = active + stop
                kept_values[rows], kept_columns[rows] = merge_top(
                    kept_values[rows], kept_columns[rows], panel_values, panel_rows + start, candidates
                )
        del sims, below  # before the consumer runs: at most one panel is alive
        yield start, *rank_candidates(values, columns, k, full_rows(start))


def _stored_group(x: torch.Tensor, n: int, k: int, budget_bytes: int) -> int | None:
    """The group size of :mod:`caffe_compat.evaluate.stored`'s scheme when :func:`self_topk` uses it
    (on the CPU with NumPy selection, when its memory fits ``budget_bytes``), else None."""
    from caffe_compat.evaluate import select
    from caffe_compat.evaluate.stored import stored_plan

    if x.device.type != "cpu" or not select.NUMPY_ON_CPU:
        return None
    return stored_plan(n, k, budget_bytes)


@dataclass
class SimilarityBlock:
    """Rows ``start:start+len(sims)`` of the query-by-reference cosine matrix.

    ``sims`` has ``-inf`` on each row's own column when the query set is the reference set;
    ``self_columns`` then holds those columns (else ``None``). ``members`` is the
    :func:`label_members` table of the reference labels (``None`` without labels).
    """

    start: int
    sims: torch.Tensor
    query_labels: torch.Tensor | None
    reference_labels: torch.Tensor | None
    self_columns: torch.Tensor | None
    members: torch.Tensor | None = None

    def topk(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(similarities, columns)`` of the k best references per row, best first, ties by column.

        Fast path: float top-(k+1) candidates re-sorted by order key; a row whose k-th and (k+1)-th
        candidates tie (the tie may extend beyond the candidates) is redone exactly on its full row."""
        sims = self.sims
        if k + 1 > sims.shape[1]:
            return exact_topk(sims, k)
        values, columns = select_top(*row_candidates(sims, k + 1), k + 1)
        return rank_candidates(values, columns, k, lambda rows: sims[rows])

    def same_label(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Boolean mask of same-label references (of ``rows`` only, if given), the query excluded."""
        if self.query_labels is None or self.reference_labels is None:
            raise EvaluationInputError("labels are needed for label-based neighbour statistics")
        rows = torch.arange(len(self.sims), device=self.sims.device) if rows is None else rows
        same = self.query_labels[rows, None] == self.reference_labels[None, :]
        if self.self_columns is not None:
            same[torch.arange(len(rows), device=same.device), self.self_columns[rows]] = False
        return same

    def first_match_rank(self) -> torch.Tensor:
        """0-based position of the first same-label reference in the tie-broken ranking; -1 if none.

        The best same-label similarity ``b`` (lowest column among equals: ``c``) is read from the
        gathered same-label columns; the rank counts the references with similarity > ``b``, plus,
        only in rows where another-label reference ties with ``b``, those tied ones with column < ``c``."""
        if self.members is None:
            raise EvaluationInputError("labels are needed for label-based neighbour statistics")
        sims = self.sims
        columns = self.members[self.query_labels]
        valid = columns >= 0
        if self.self_columns is not None:
            valid &= columns != self.self_columns[:, None]
        positives = sims.gather(1, columns.clamp_min(0)).masked_fill_(~valid, float("-inf"))
        best, where = positives.max(dim=1, keepdim=True)
        found = valid.any(dim=1)
        rank = torch.count_nonzero(sims > best, dim=1)
        tied = torch.count_nonzero(sims == best, dim=1) > torch.count_nonzero(positives == best, dim=1)
        tied &= found
        if bool(tied.any()):
            rows = torch.nonzero(tied)[:, 0]
            first = columns.gather(1, where)[rows]
            index = torch.arange(sims.shape[1], device=sims.device)[None, :]
            rank[rows] += ((sims[rows] == best[rows]) & (index < first) & ~self.same_label(rows)).sum(dim=1)
        return torch.where(found, rank, torch.full_like(rank, -1))


def similarity_blocks(
    query: torch.Tensor,
    reference: torch.Tensor | None = None,
    *,
    query_labels: torch.Tensor | None = None,
    reference_labels: torch.Tensor | None = None,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
    extra_bytes_per_row: int = 0,
) -> Iterator[SimilarityBlock]:
    """Yield the cosine matrix in row chunks. Inputs are L2-normalised float tensors on one device
    (see :func:`caffe_compat.evaluate.inputs.as_features`); ``reference=None`` means self-retrieval
    with the query excluded by index."""
    exclude_self = reference is None
    if exclude_self:
        reference, reference_labels = query, query_labels
    if query.shape[1] != reference.shape[1]:
        raise EvaluationInputError(f"query dimension {query.shape[1]} != reference dimension {reference.shape[1]}")
    n_query, n_reference = query.shape[0], reference.shape[0]
    members = None
    if query_labels is not None and reference_labels is not None:
        n_codes = int(max(int(query_labels.max()), int(reference_labels.max()))) + 1
        members = label_members(reference_labels, n_codes)
        extra_bytes_per_row += 16 * members.shape[1]
    rows = max(TILE_ROWS, chunk_rows(n_reference, budget_bytes, extra_bytes_per_row) // TILE_ROWS * TILE_ROWS)
    reference_t = reference.t()
    tiles = Tiles(query) if exclude_self else None
    for start in range(0, n_query, rows):
        stop = min(start + rows, n_query)
        sims = self_similarity(tiles, start, stop) if exclude_self else tiled_matmul(query, reference_t, start, stop)
        self_columns = None
        if exclude_self:
            self_columns = torch.arange(start, stop, device=sims.device)
            sims[torch.arange(stop - start, device=sims.device), self_columns] = float("-inf")
        labels = None if query_labels is None else query_labels[start:stop]
        yield SimilarityBlock(start, sims, labels, reference_labels, self_columns, members)


def topk_neighbours(
    features,
    k: int,
    reference=None,
    *,
    device=None,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact cosine k-NN: ``(similarities, indices)`` of shape ``(N, k)``, best first.

    ``reference=None`` searches ``features`` among themselves, each query excluded by index (so
    ``k <= N - 1``); otherwise ``features`` are the queries and ``reference`` the gallery. Ties:
    lower reference index first. Runs on ``device`` (default: the features' device) in chunks whose
    working set stays under ``budget_bytes``.
    """
    query = as_features(features, device)
    gallery = None if reference is None else as_features(reference, query.device, name="reference")
    available = query.shape[0] - 1 if gallery is None else gallery.shape[0]
    if not 1 <= int(k) <= available:
        raise EvaluationInputError(f"k must be in [1, {available}] here, got {k}")
    if gallery is None:
        parts = list(self_topk(query, int(k), budget_bytes=budget_bytes))
        return torch.cat([v for _, v, _ in parts]), torch.cat([i for _, _, i in parts])
    values, indices = [], []
    for block in similarity_blocks(query, gallery, budget_bytes=budget_bytes, extra_bytes_per_row=16 * int(k)):
        v, i = block.topk(int(k))
        values.append(v)
        indices.append(i)
    return torch.cat(values), torch.cat(indices)

"""FAPPY's batch layout and level counts, vectorised (used by :mod:`caffe_compat.losses.fappy`).

Implementation: no histogram of ``2/d`` bins is built.  A negative in bin ``u >= t`` adds 1 to
``Σ_{u>=t} h[u]`` and one in bin ``t − 1`` its right weight, so every tail sum needs only the number
of the row's negatives below bins t−1, t, t+1 and the sums of their right weights.  The cosines are
held as the symmetric (B,B) matrix; one sort per row puts the row's negatives first (ascending), its
positive partners next.  As ``floor((s + 1)/d) < v  <=>  s + 1 < v·d`` exactly for power-of-two widths,
one batched ``searchsorted`` of the thresholds ``v·d`` in the sorted rows finds those counts for every
positive pair's two rows at every level, and per-row prefix sums of ``s + 1`` give the weight sums.
The levels with fewer than 8·B bins (all of them for Δ = 1e-2 at B = 128, those down to 2^-8 for
smaller Δ) answer the same queries by a gather in a per-row prefix count of the entries' bins at the
finest of these widths (``u < v  <=>  u_fine < v·2^k``); only the finer levels search (a wider table
measured slower in a whole forward+backward: its cumulative sum and cache footprint outweigh the
searches it saves).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from caffe_compat.losses.loss_errors import LossInputError
from caffe_compat.losses.pairwise import pair_index, upper_pairs


# ----------------------------------------------------------------------------------- batch layout

def _flat_inputs(cosine: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate shapes as Caffe's LayerSetUp does: cosine (M,) or (M,1,1,1), labels (B,) or (B,1,1,1)."""
    if not torch.is_tensor(cosine) or not cosine.is_floating_point():
        raise LossInputError("FAPPY: the cosine input must be a floating-point tensor")
    if cosine.dim() not in (1, 4) or (cosine.dim() == 4 and tuple(cosine.shape[1:]) != (1, 1, 1)):
        raise LossInputError(f"FAPPY: cosine must have shape (M,) or (M,1,1,1), got {tuple(cosine.shape)}")
    labels = torch.as_tensor(labels, device=cosine.device)
    if labels.dim() not in (1, 4) or (labels.dim() == 4 and tuple(labels.shape[1:]) != (1, 1, 1)):
        raise LossInputError(f"FAPPY: labels must have shape (B,) or (B,1,1,1), got {tuple(labels.shape)}")
    labels = labels.reshape(-1)
    b = labels.numel()
    if cosine.shape[0] != b * (b - 1) // 2:
        raise LossInputError(
            f"FAPPY: {cosine.shape[0]} cosines do not match {b} labels (expected B(B-1)/2 = {b * (b - 1) // 2})")
    return cosine.reshape(-1), labels


def _cached_in_eager_mode(maxsize: int):
    """``functools.lru_cache(maxsize)`` for eager calls; under ``torch.compile`` the function itself is traced
    (its tensors become constants of the graph either way, and Dynamo warns each time it has to trace
    through a cache wrapper: a ``train --compile`` of a FAPPY net printed two such warnings)."""
    def wrap(fn):
        cached = functools.lru_cache(maxsize=maxsize)(fn)

        @functools.wraps(fn)
        def call(*args):
            return fn(*args) if torch.compiler.is_compiling() else cached(*args)

        call.cache_info, call.cache_clear = cached.cache_info, cached.cache_clear
        return call
    return wrap


@_cached_in_eager_mode(maxsize=32)
def _pair_geometry(b: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per batch size and device (cached): ``iu``, ``ju`` of the pairs i<j in Caffe's order and the
    (B,B) map ``pair_of[i, j] = pair_of[j, i]`` = k of pair k, M on the diagonal."""
    iu, ju = upper_pairs(b, device=device)
    r = torch.arange(b, device=device)
    lo, hi = torch.minimum(r[:, None], r[None, :]), torch.maximum(r[:, None], r[None, :])
    return iu, ju, torch.where(lo == hi, b * (b - 1) // 2, pair_index(lo, hi, b))


@_cached_in_eager_mode(maxsize=64)
def _widths(levels: tuple[float, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The (L,) float64 bin widths and the (3,1) bin offsets -1, 0, 1 (cached)."""
    return (torch.tensor(levels, dtype=torch.float64, device=device),
            torch.tensor([[-1.0], [0.0], [1.0]], dtype=torch.float64, device=device))


def _from_vector(cos: torch.Tensor, b: int) -> torch.Tensor:
    """The symmetric (B,B) float64 cosine matrix of the M pair cosines, 0 on the diagonal."""
    pair_of = _pair_geometry(b, cos.device)[2]
    return torch.cat([cos.double(), cos.new_zeros(1, dtype=torch.float64)])[pair_of]


def _from_matrix(sim: torch.Tensor) -> torch.Tensor:
    """The same from a (B,B) cosine matrix, of which only the upper triangle (the pairs i<j) is read."""
    upper = sim.to(torch.float64, copy=True).triu_(1)
    return upper + upper.mT


@dataclass
class _Rows:
    """Level-independent geometry of one batch (no gradient except ``s1``, ``cum`` and ``sp``).

    Row r of ``s1`` lists, ascending, ``1 + s`` for the cosines s of r to the negatives the layer
    reads (the *entries*, ``s1 <= 2``), then 4.0 for each positive partner of r, then inf; one sort
    per row.  Ascending entries have non-decreasing bins at every level.  The K *slots* of row r are
    its positive partners (K = the largest number of them; padding where not ``slot_ok``)."""

    s1: torch.Tensor        # (B,B) float64 sorted keys
    order: torch.Tensor     # (B,B) column (partner) of each sorted key
    past: torch.Tensor      # (B,B) bool: not an entry (s1 > 2: a positive partner or an unread cosine)
    cum: torch.Tensor       # (B,B+1) float64 prefix sums of s1 (valid up to the last entry)
    n_ent: torch.Tensor     # (B,) number of entries (= |N_r| wherever the layer reads row r)
    n_neg: torch.Tensor     # (B,) |N_r|
    inv_neg: torch.Tensor   # (B,) float64 1/|N_r| (inf when r has no negative)
    slot: torch.Tensor      # (B,K) position of each positive partner in the sorted row
    slot_ok: torch.Tensor   # (B,K) bool: a real slot
    sp: torch.Tensor        # (B,K) float64 cosine of each slot's positive pair
    gap: torch.Tensor       # (B,K) float64 1 - sp, -inf on padding: the pair is used at d iff gap >= d


def _argsort_rows(key: torch.Tensor) -> torch.Tensor:
    """Row-wise argsort.  On the CPU through NumPy, whose vectorised sort is several times faster than
    ``torch.sort`` on rows of this size; the order of equal keys never matters to the loss."""
    if key.device.type == "cpu" and not torch.compiler.is_compiling():
        return torch.from_numpy(np.argsort(key.numpy(), axis=1))
    return torch.argsort(key, dim=1)


def _rows(s: torch.Tensor, labels: torch.Tensor, k: int | None = None) -> _Rows | None:
    """``s``: symmetric (B,B) float64 cosines.  None when the batch has no positive pair.

    ``k``: the number of slots per row; by default the largest number of positive partners (read
    from the device), else a fixed bound such as B − 1 (no host synchronisation, never None)."""
    b = labels.numel()
    same = labels[:, None] == labels[None, :]
    neg = ~same
    pos = same.fill_diagonal_(False)
    sd = s.detach()
    readable = (sd >= -1.0).logical_and_(sd < 1.0).logical_and_(neg)  # the others are never read (see _check_readable)
    key = torch.where(readable, s + 1.0, math.inf).masked_fill_(pos, 4.0)
    order = _argsort_rows(key.detach())
    s1 = key.gather(1, order)
    n_ent, n_pos, n_neg = readable.sum(1), pos.sum(1), neg.sum(1)
    if k is None:
        k = int(n_pos.max()) if b else 0
        if k == 0:
            return None
    # prefix sums; only the thresholds of slots a level does not use (masked) reach past the entries
    cum = torch.nn.functional.pad(s1, (1, 0)).cumsum_(1)
    ar = torch.arange(k, device=s.device)
    slot = (n_ent[:, None] + ar).clamp_max(b - 1)
    slot_ok = ar < n_pos[:, None]
    sp = s.gather(1, order.gather(1, slot))
    return _Rows(s1, order, s1.detach() > 2.0, cum, n_ent, n_neg, n_neg.to(torch.float64).reciprocal_(), slot,
                 slot_ok, sp, torch.where(slot_ok, 1.0 - sp.detach(), -math.inf))


def _unreadable(rows: _Rows, finest: float) -> torch.Tensor:
    """0-d bool on the device: some cosine the layer reads is out of Caffe's bounds (see below)."""
    # a used slot (not 1 − s < d, so NaN is used) must have s >= -1, and all of its row's negatives must
    # be entries; on a short row ``s >= inf`` fails for every used slot (s = inf gives 1 − s = −inf)
    lowest = torch.where(rows.n_ent < rows.n_neg, math.inf, -1.0)
    return ~((rows.gap < finest) | (rows.sp.detach() >= lowest[:, None])).all()


def _check_readable(s: torch.Tensor, labels: torch.Tensor, rows: _Rows, finest: float) -> None:
    """Raise where Caffe would read out of bounds: every cosine the layer touches must be a number in
    [-1, 1], and a negative one below 1.  The finest level reads a superset of the coarser ones: a row
    is read when one of its positive pairs is used there (not ``1 - s < d``, so NaN is used), and then
    all its negatives must be entries."""
    if not bool(_unreadable(rows, finest)):
        return
    b, sd, row_used = labels.numel(), s.detach(), (~(rows.gap < finest)).any(1)
    upper = torch.ones(b, b, dtype=torch.bool, device=s.device).triu(1)
    same = labels[:, None] == labels[None, :]
    bad_pos = upper & same & ~((1.0 - sd) < finest) & ~(sd >= -1.0)
    bad_neg = upper & ~same & (row_used[:, None] | row_used[None, :]) & ~((sd >= -1.0) & (sd < 1.0))
    what, bad = ("positive", bad_pos) if bool(bad_pos.any()) else ("negative", bad_neg)
    i, j = (int(v) for v in bad.nonzero()[0])      # the first in Caffe's row-major pair order
    raise LossInputError(
        f"FAPPY: {what} pair ({i}, {j}) (cosine index {pair_index(i, j, b)}) has cosine {float(sd[i, j])!r}; the "
        "Caffe layer reads its histogram out of bounds (segfault) for NaN, values below -1 and negative-pair values "
        ">= 1 (zero feature row? duplicated sample with two labels?)")


# -------------------------------------------------------------------------------------- levels

@dataclass
class _Levels:
    """Per row, level and slot (last axis): the quantities of Eq. 7 for the slot's row r."""

    widths: torch.Tensor   # (L,) float64 bin widths d
    active: torch.Tensor   # (B,L,K) bool: a real slot and not (1 - s < d)
    lh: torch.Tensor       # (B,L,K) float64 (b_{t+1} - s)/d, 0 where inactive
    rh: torch.Tensor       # (B,L,K) float64 (s - b_t)/d, 0 where inactive
    tail_ge: torch.Tensor  # (B,L,K) Σ_{u>=t} h_r[u]
    tail_gt: torch.Tensor  # (B,L,K) Σ_{u>t} h_r[u]
    at_t: torch.Tensor     # (B,L,K) h_r[t] (the difference of the two, without the cancellation)
    lo: torch.Tensor       # (B,L·3·K) number of the row's entries in bins < t-1, < t, < t+1

    def level_sums(self) -> torch.Tensor:
        """(L,) Σ over the pairs used at each level of P_ij(d): each slot adds its row's share (summed
        slot-major, (B,K,L): the layer's round-off is that of this order)."""
        p = self.lh * self.tail_ge + self.rh * self.tail_gt
        return torch.where(self.active, p, 0.0).mT.contiguous().sum((0, 1))


def _levels(rows: _Rows, levels: list[float]) -> _Levels:
    """Tail sums of the soft histograms of every slot's row at its pair's bin, at every bin width.

    A cosine s lies at x = (s + 1)/d, in bin u = floor(x), with right weight x − u and left weight
    1 − (x − u).  With s1 = s + 1 computed in double like Caffe and d a power of two,
    ``u < v  <=>  s1 < v·d`` exactly, so one batched ``searchsorted`` of the thresholds ``v·d`` in the
    sorted rows counts, for all levels at once, the ``lo_v`` entries of a row below bin v, for
    v = t−1, t, t+1.  With ``X_v = Σ_{entries below bin v} (x − v) = cum[lo_v]/d − v·lo_v`` the tails
    are ``|N|·Σ_{u>=t} h[u] = n + X_t − X_{t−1}`` (the entries of bins >= t, plus the right weights of
    bin t−1) and ``|N|·Σ_{u>t} h[u] = n + X_{t+1} − X_t``.  Slots a level does not use get harmless
    (masked) values, padding slots included.  Everything is laid out level by level, (B,L,K) and
    (B,L,3,K), the order in which :func:`~caffe_compat.losses.fappy._caffe_on_rows` adds at the counts
    (searching slot by slot is at most ~10% faster, less than the transposition it would then need)."""
    d, shifts = _widths(tuple(levels), rows.s1.device)
    d_col = d[:, None]                          # d against (B,L,K)
    b = rows.sp.shape[0]
    x = (rows.sp + 1.0)[:, None, :] / d_col     # (B,L,K); powers of two: exactly Caffe's (s + 1.0) / d
    active = rows.gap[:, None, :] >= d_col
    t = torch.floor(x.detach()).nan_to_num_(0.0)  # a NaN cosine (unused, or raised on later) must still index
    frac = x - t
    rh = torch.where(active, frac, 0.0)
    lh = torch.where(active, 1.0 - frac, 0.0)
    bins = t[:, :, None, :] + shifts                                # (B,L,3,K) bins v = t-1, t, t+1
    d_col = d_col[:, :, None]                                       # d against (B,L,3,K)
    # the coarse levels' counts from a table of the bins of width d_table (the finest level with fewer
    # than _TABLE_COLUMNS_PER_ROW·B bins), the finer levels' by binary search
    n_table = sum(1 for w in levels if int(round(2.0 / w)) + 1 < _TABLE_COLUMNS_PER_ROW * b)
    if n_table:
        table_bins = int(round(2.0 / levels[n_table - 1])) + 1      # u = 0 .. 2/d_table
        lo = _counts_below_from_table(rows, bins[:, :n_table], d_col[:n_table] / levels[n_table - 1],
                                      levels[n_table - 1], table_bins)
    thr = bins.mul_(d_col)                                          # thresholds v·d
    if n_table < len(levels):
        found = torch.searchsorted(rows.s1.detach(), thr[:, n_table:].reshape(b, -1).contiguous())
        lo = found if not n_table else torch.cat([lo, found], 1)
    # X_v = (cum[lo_v] - v·d·lo_v)/d (v·d·lo_v is exact, so one rounding): X_{t-1}, X_t, X_{t+1}
    xs = rows.cum.gather(1, lo).view(thr.shape).addcmul_(thr, lo.view(thr.shape), value=-1.0).div_(d_col)
    xs = xs.diff(dim=2)                                          # X_t - X_{t-1}, X_{t+1} - X_t
    inv = rows.inv_neg[:, None, None]
    at_t = (xs[:, :, 0] - xs[:, :, 1]).mul_(inv)
    tails = xs.add_(rows.n_ent[:, None, None, None]).mul_(inv[..., None])
    return _Levels(d, active, lh, rh, tails[:, :, 0], tails[:, :, 1], at_t, lo)


#: Levels with fewer than this many bins per batch row take their counts from a per-row table of the
#: bins of the finest of them (O(B·bins) <= O(8 B²) memory, a gather per query), the finer levels
#: from binary searches (~25 ns a query).
_TABLE_COLUMNS_PER_ROW = 8


def _counts_below_from_table(rows: _Rows, bins: torch.Tensor, scale: torch.Tensor, finest: float,
                             finest_bins: int) -> torch.Tensor:
    """``searchsorted(s1, v·d)`` for the (B,…) bins ``v`` through the finest width ``d_min``: with
    ``u_fine = floor(s1/d_min)`` and ``d = d_min·2^k`` (``scale`` = 2^k), ``s1 < v·d  <=>
    u_fine < v·2^k`` exactly, so one exclusive prefix count per row of the entries' finest bins answers
    every level.  Queries beyond the last bin count every entry, below bin 0 none."""
    b = rows.s1.shape[0]
    # s1 >= 0, so the conversion truncates = floors; the non-entries (4 and inf, at least 2·(2/d_min)) clamp
    # to the overflow column finest_bins, the entries (s1 <= 2) stay below it
    u_fine = (rows.s1.detach() * (1.0 / finest)).clamp_(max=finest_bins).long()
    table = torch.zeros(b, finest_bins + 2, dtype=torch.long, device=u_fine.device)
    table[:, 1:].scatter_add_(1, u_fine, torch.ones_like(u_fine))
    below = table[:, :finest_bins + 1].cumsum_(1)                  # below[:, c] = #entries with u_fine < c
    v_fine = (bins * scale).clamp_(0, finest_bins).long()          # (bins are never NaN, see _levels)
    return below.gather(1, v_fine.view(b, -1))

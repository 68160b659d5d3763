"""Frozen copy of FAPPY's caffe-mode layer as it was before the speed work (commit 6859f19:
``caffe_compat/losses/fappy_rows.py`` and ``_caffe``/``_caffe_on_rows`` of ``fappy.py``), kept only as
the reference of ``test_fappy_speedups.py``: the optimised layer must give the same loss and diff bit
for bit. Not imported by the package."""

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


@functools.lru_cache(maxsize=32)
def _pair_geometry(b: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per batch size and device (cached): ``iu``, ``ju`` of the pairs i<j in Caffe's order and the
    (B,B) map ``pair_of[i, j] = pair_of[j, i]`` = k of pair k, M on the diagonal."""
    iu, ju = upper_pairs(b, device=device)
    r = torch.arange(b, device=device)
    lo, hi = torch.minimum(r[:, None], r[None, :]), torch.maximum(r[:, None], r[None, :])
    return iu, ju, torch.where(lo == hi, b * (b - 1) // 2, pair_index(lo, hi, b))


@functools.lru_cache(maxsize=64)
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
    entry: torch.Tensor     # (B,B) bool: a real entry
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
    if key.device.type == "cpu":
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
    readable = neg & (sd >= -1.0) & (sd < 1.0)       # the others are never read (see _check_readable)
    key = (s + 1.0).masked_fill_(~readable, math.inf).masked_fill_(pos, 4.0)
    order = _argsort_rows(key.detach())
    s1 = key.gather(1, order)
    n_ent, n_pos, n_neg = readable.sum(1), pos.sum(1), neg.sum(1)
    if k is None:
        k = int(n_pos.max()) if b else 0
        if k == 0:
            return None
    # prefix sums; only the thresholds of slots a level does not use (masked) reach past the entries
    cum = torch.cat([s1.new_zeros(b, 1), s1], 1).cumsum_(1)
    ar = torch.arange(k, device=s.device)
    slot = (n_ent[:, None] + ar).clamp_max(b - 1)
    slot_ok = ar < n_pos[:, None]
    sp = s.gather(1, order.gather(1, slot))
    return _Rows(s1, order, s1.detach() <= 2.0, cum, n_ent, n_neg, 1.0 / n_neg.to(torch.float64), slot,
                 slot_ok, sp, torch.where(slot_ok, 1.0 - sp.detach(), -math.inf))


def _unreadable(rows: _Rows, finest: float) -> torch.Tensor:
    """0-d bool on the device: some cosine the layer reads is out of Caffe's bounds (see below)."""
    used = ~(rows.gap < finest)
    return (used & ~(rows.sp.detach() >= -1.0)).any() | (used.any(1) & (rows.n_ent < rows.n_neg)).any()


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
    """Per row, slot and level (last axis): the quantities of Eq. 7 for the slot's row r."""

    widths: torch.Tensor   # (L,) float64 bin widths d
    active: torch.Tensor   # (B,K,L) bool: a real slot and not (1 - s < d)
    lh: torch.Tensor       # (B,K,L) float64 (b_{t+1} - s)/d, 0 where inactive
    rh: torch.Tensor       # (B,K,L) float64 (s - b_t)/d, 0 where inactive
    tail_ge: torch.Tensor  # (B,K,L) Σ_{u>=t} h_r[u]
    tail_gt: torch.Tensor  # (B,K,L) Σ_{u>t} h_r[u]
    at_t: torch.Tensor     # (B,K,L) h_r[t] (the difference of the two, without the cancellation)
    lo: torch.Tensor       # (B,K·3·L) number of the row's entries in bins < t-1, < t, < t+1

    def level_sums(self) -> torch.Tensor:
        """(L,) Σ over the pairs used at each level of P_ij(d): each slot adds its row's share."""
        p = self.lh * self.tail_ge + self.rh * self.tail_gt
        return torch.where(self.active, p, 0.0).sum((0, 1))


def _levels(rows: _Rows, levels: list[float]) -> _Levels:
    """Tail sums of the soft histograms of every slot's row at its pair's bin, at every bin width.

    A cosine s lies at x = (s + 1)/d, in bin u = floor(x), with right weight x − u and left weight
    1 − (x − u).  With s1 = s + 1 computed in double like Caffe and d a power of two,
    ``u < v  <=>  s1 < v·d`` exactly, so one batched ``searchsorted`` of the thresholds ``v·d`` in the
    sorted rows counts, for all levels at once, the ``lo_v`` entries of a row below bin v, for
    v = t−1, t, t+1.  With ``X_v = Σ_{entries below bin v} (x − v) = cum[lo_v]/d − v·lo_v`` the tails
    are ``|N|·Σ_{u>=t} h[u] = n + X_t − X_{t−1}`` (the entries of bins >= t, plus the right weights of
    bin t−1) and ``|N|·Σ_{u>t} h[u] = n + X_{t+1} − X_t``.  Slots a level does not use get harmless
    (masked) values, padding slots included.  The queries are laid out slot by slot: consecutive
    binary searches then take similar paths, ~1.5x faster than level by level (branch prediction)."""
    d, shifts = _widths(tuple(levels), rows.s1.device)
    b = rows.sp.shape[0]
    x = (rows.sp + 1.0)[:, :, None] / d         # (B,K,L); powers of two: exactly Caffe's (s + 1.0) / d
    active = rows.gap[:, :, None] >= d
    t = torch.floor(x.detach())
    frac = x - t
    rh = torch.where(active, frac, 0.0)
    lh = torch.where(active, 1.0 - frac, 0.0)
    bins = t[:, :, None, :] + shifts                                # (B,K,3,L) bins v = t-1, t, t+1
    finest_bins = int(round(2.0 / levels[-1])) + 1                  # u_fine = 0 .. 2/d_min
    if finest_bins < _TABLE_COLUMNS_PER_ROW * b:
        lo = _counts_below_from_table(rows, bins, d / levels[-1], levels[-1], finest_bins)
        thr = bins.mul_(d)
    else:
        thr = bins.mul_(d)                                          # thresholds v·d
        lo = torch.searchsorted(rows.s1.detach(), thr.view(b, -1))
    # X_v = (cum[lo_v] - v·d·lo_v)/d (v·d·lo_v is exact): X_{t-1}, X_t, X_{t+1}
    xs = rows.cum.gather(1, lo).view(thr.shape).sub_(thr.mul_(lo.view(thr.shape))).div_(d)
    xs = xs.diff(dim=2)                                          # X_t - X_{t-1}, X_{t+1} - X_t
    inv = rows.inv_neg[:, None, None]
    at_t = (xs[:, :, 0] - xs[:, :, 1]).mul_(inv)
    tails = xs.add_(rows.n_ent[:, None, None, None]).mul_(inv[..., None])
    return _Levels(d, active, lh, rh, tails[:, :, 0], tails[:, :, 1], at_t, lo)


#: Below this many finest-level bins per batch row, counts come from a per-row table of the finest
#: bins (O(B·bins) <= O(B²) memory, a gather per query) rather than from binary searches.
_TABLE_COLUMNS_PER_ROW = 8


def _counts_below_from_table(rows: _Rows, bins: torch.Tensor, scale: torch.Tensor, finest: float,
                             finest_bins: int) -> torch.Tensor:
    """``searchsorted(s1, v·d)`` for the (B,K,3,L) bins ``v`` through the finest width ``d_min``: with
    ``u_fine = floor(s1/d_min)`` and ``d = d_min·2^k`` (``scale`` = 2^k), ``s1 < v·d  <=>
    u_fine < v·2^k`` exactly, so one exclusive prefix count per row of the entries' finest bins answers
    every level.  Queries beyond the last bin count every entry, below bin 0 none."""
    b = rows.s1.shape[0]
    u_fine = torch.floor(rows.s1.detach() / finest).clamp_(max=finest_bins).long()  # non-entries -> overflow
    u_fine.masked_fill_(~rows.entry, finest_bins)
    table = torch.zeros(b, finest_bins + 2, dtype=torch.long, device=u_fine.device)
    table[:, 1:].scatter_add_(1, u_fine, torch.ones_like(u_fine))
    below = table[:, :finest_bins + 1].cumsum_(1)                  # below[:, c] = #entries with u_fine < c
    v_fine = torch.nan_to_num(bins * scale, nan=0.0).clamp_(0, finest_bins).long()
    return below.gather(1, v_fine.view(b, -1))


# ------------------------------------------------------------------ fappy.py: the layer

def _suffix_products(x: torch.Tensor) -> torch.Tensor:
    """``out[l] = x[l] · x[l+1] · … · x[-1]``."""
    return torch.flip(torch.cumprod(torch.flip(x, [0]), 0), [0])


def _caffe(s: torch.Tensor, labels: torch.Tensor, levels: list[float]
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The C++ layer on the symmetric (B,B) float64 cosines ``s`` (no gradient): ``(loss, H)`` with the
    diff of pair (i, j) at ``H[i, j]`` and ``H[j, i]`` (0 on the diagonal; None when the diff is zero).

    The level loop ``L <- (L + R_d)/c_d/2`` unrolls to ``L = Σ_d R_d · W_d`` with
    ``W_d = Π_{d' <= d} 1/(2 c_{d'})`` (``c`` = 1 where zero); the diff is the same combination of the
    levels' raw diffs: ``-(h_i[t] + h_j[t])/d`` for a positive pair (each slot adds its row's share),
    ``+lh/(d|N|)`` for a negative in bin t-1 and ``+rh/(d|N|)`` for one in bin t (the C++ adds and
    subtracts ``(lh [+ rh])/d/|N|`` on its left/right bin lists; the other bins cancel), applied as range
    additions on the sorted rows: +lh from the first entry of bin t-1, +(rh − lh) from bin t, −rh from
    bin t+1, then one cumulative sum per row."""
    rows = _rows(s, labels) if levels else None
    if rows is None:
        return s.new_zeros(()), None
    _check_readable(s, labels, rows, levels[-1])
    # A pair used at d is used at every finer width, so the levels no pair uses are the coarsest ones;
    # they add nothing, and the weights of the finer levels do not involve them: skip them.
    widest = float(rows.gap.max())
    levels = [d for d in levels if d <= widest]
    if not levels:
        return s.new_zeros(()), None
    return _caffe_on_rows(s, rows, levels)


def _caffe_on_rows(s: torch.Tensor, rows: _Rows, levels: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """``_caffe`` once the rows are laid out: loss and H at the given widths (no host synchronisation)."""
    lv = _levels(rows, levels)
    count = lv.active.sum((0, 1), dtype=torch.float64) * 0.5             # pairs used per level
    weight = _suffix_products(torch.where(count > 0, 0.5 / count, 0.5))
    loss = torch.dot(lv.level_sums(), weight)

    b, k = lv.lh.shape[:2]
    scale = weight / lv.widths
    lh, rh = (lv.lh * scale).mT, (lv.rh * scale).mT                            # (B,L,K)
    # added level by level, coarsest first: the small coarse-level steps are not lost against the
    # large fine-level ones where they meet (half the round-off of slot by slot)
    at = lv.lo.view(b, k, 3, len(levels)).permute(0, 3, 2, 1).reshape(b, -1)
    ramp = s.new_zeros(b, b + 1).scatter_add_(1, at, torch.stack([lh, rh - lh, -rh], 2).view(b, -1))
    ent = ramp[:, :b].cumsum_(1).mul_(rows.inv_neg[:, None]).masked_fill_(~rows.entry, 0.0)
    pos = (torch.where(lv.active, lv.at_t, 0.0) * scale).sum(2).neg()           # (B,K), 0 on padding
    ent.scatter_add_(1, rows.slot, pos)
    h = s.new_zeros(b, b)                     # E (the sorted rows put back in place), then E + Eᵀ
    h.scatter_add_(1, rows.order, ent).mT.scatter_add_(1, rows.order, ent)
    return loss, h.fill_diagonal_(0.0)



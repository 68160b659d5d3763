"""FAPPY: deep metric learning with FAlse Positive ProbabilitY (Zhong, Li, Li, ICONIP 2017).

For a positive pair (i, j) with cosine ``s = s_ij`` and a bin width ``d``, the cosine axis [-1, 1] is
cut into bins of width ``d`` with edges ``b_t = d·t − 1``.  Every cosine ``x`` is spread over the two
edges around it with triangular weights (Eq. 3): bin ``u = floor((x + 1)/d)`` gets
``(b_{u+1} − x)/d`` and bin ``u+1`` gets ``(x − b_u)/d``.  With ``t`` the bin of ``s``,
``lh = (b_{t+1} − s)/d``, ``rh = (s − b_t)/d`` and ``h_i``, ``h_j`` the histograms of the cosines of
i and j to the N negatives (samples whose label differs from i's), each divided by ``|N|``
(Eqs. 4-5), the false positive probability is (Eq. 7)::

    P_ij(d) = lh · Σ_{u>=t} (h_i[u] + h_j[u]) + rh · Σ_{u>t} (h_i[u] + h_j[u]).

A pair is used at width d only if ``1 − s >= d``.  The widths are ``d = 2, 1, 1/2, …`` down to the
smallest power-of-two fraction of 2 that is ``>= delta``, and the levels are fused by halving:

* ``mode="paper"`` (Algorithm 1 as printed)::

      L <- 0;  repeat  L <- (L + Σ_{pairs used at d} P_ij(d) / C) / 2;  d <- d/2  until d < Δmin

  with ``C`` the number of *all* positive pairs of the batch.  It is a do-while loop, so the level
  d = 2 always runs, even for Δmin > 2.  Gradients come from autograd.

* ``mode="caffe"`` (the authors' ``FAPPYLossLayer``, reproduced exactly)::

      L <- 0;  for (double d = 2.0; d >= delta; d /= 2.0)
                   L <- L + Σ_{pairs used at d} P_ij(d);  if c_d != 0: L <- L / c_d;  L <- L / 2

  with ``c_d`` the number of pairs *used at this level*.  The running total, earlier levels included,
  is divided by each level's count, so the finest level dominates (the paper divides only the
  level's own sum, by the fixed count C).  No level runs when delta > 2 (loss 0).  The gradient is
  the layer's own analytic diff (computed in Forward; Backward multiplies it by the top diff =
  loss_weight): ``−(h_i[t] + h_j[t])/d`` for s_ij, ``+rh/(d|N|)`` for a negative cosine in bin t,
  ``+lh/(d|N|)`` for one in bin t−1, zero otherwise, normalised like the loss.  Away from bin edges
  and from ``1 − s = d`` this is the exact derivative of the loss (``gradcheck`` in the tests); on an
  edge it is the one-sided derivative of the bin ``floor`` picks.

The difference between the two modes is therefore only the fusion: per-level normaliser (``c_d``,
applied to the running total) versus fixed ``C`` (applied to the level's sum), and zero versus at
least one level for delta > 2.  With one positive pair never skipped they coincide.

Caffe quirks reproduced by ``mode="caffe"``:

* the bin width passed to a level is ``float(d)`` (exact: a power of two); ``delta`` is a proto
  ``float``, so it is rounded to float32 before the ``d >= delta`` test;
* skip test ``1.0 − s < d`` and bin ``floor((s + 1.0)/d)`` in double from the float cosine, so cosines
  on a bin edge fall in the upper bin exactly as in Caffe;
* triangular weights ``(b_{u+1} − x)/d`` and ``(x − b_u)/d`` with ``b_u = d·u − 1`` (Caffe rounds
  them to float32 and accumulates in float32; here they and every sum are float64, which reproduces
  Caffe's loss to ≤ 8.8e-6 relative and its diff to ≤ 6e-8 absolute on the fixtures, the same
  agreement as a literal float64 transcription of the C++);
* histograms scaled by ``1/|N|``; one label only (|N| = 0) gives ``0·inf = NaN`` in the loss and
  in the diff of every positive pair used at some level; no positive pair gives 0;
* loss top unweighted, diff × loss_weight through ``grad_output``.

Undefined inputs (Caffe writes outside its histogram and segfaults, or indexes with a NaN): a cosine
that the layer reads and that is NaN, below −1, or — for a negative pair — ``>= 1``, raises
:class:`LossInputError` instead (both modes).  The paper mode returns NaN for a single-label batch,
like Caffe, and 0 when the batch has no positive pair (Algorithm 1 would divide 0 by 0).

Implementation: no histogram of ``2/d`` bins is built.  A negative in bin ``u >= t`` adds 1 to
``Σ_{u>=t} h[u]`` and one in bin ``t − 1`` its right weight, so every tail sum needs only the number
of the row's negatives below bins t−1, t, t+1 and the sums of their right weights.  Each row's
negative cosines are sorted once; with integer keys ``row·2^31 + floor((s + 1)·2^29)`` (exact for
power-of-two widths >= 2^-29) a single ``searchsorted`` finds those counts for all pairs and all
levels, and per-row cumulative sums of ``s + 1`` give the weight sums.  No Python loop at all;
memory O(B² + L·P) with L ≤ 30 levels and P positive pairs.  The Caffe diff is assembled the same
way, the negatives' share as range additions on the sorted entries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from caffe_compat.losses.batch_input import check_batch
from caffe_compat.losses.loss_errors import LossInputError
from caffe_compat.losses.pairwise import cosine_matrix, upper_pairs

#: The finest bin width supported: below it Caffe's ``int`` bin index and histogram size overflow.
MIN_BIN_WIDTH = 2.0 ** -29
MODES = ("caffe", "paper")


# ----------------------------------------------------------------------------------------- levels

def _check_delta(delta: float) -> float:
    delta = float(delta)
    if not math.isfinite(delta) or delta <= 0.0:
        raise LossInputError(f"FAPPY: delta must be a finite number > 0 (Caffe loops forever otherwise), got {delta!r}")
    return delta


def caffe_levels(delta: float) -> list[float]:
    """Bin widths of ``for (double d = 2.0; d >= delta; d /= 2.0)`` with ``delta`` a proto float."""
    delta = float(np.float32(_check_delta(delta)))
    levels, d = [], 2.0
    while d >= delta:
        levels.append(d)
        d /= 2.0
    if levels and levels[-1] < MIN_BIN_WIDTH:
        raise LossInputError(f"FAPPY: delta {delta!r} is below the supported minimum {MIN_BIN_WIDTH!r}")
    return levels


def paper_levels(delta_min: float) -> list[float]:
    """Bin widths of Algorithm 1's ``repeat … Δ <- Δ/2 until Δ < Δmin`` (the level 2 always runs)."""
    delta_min = _check_delta(delta_min)
    levels, d = [], 2.0
    while True:
        levels.append(d)
        d /= 2.0
        if d < delta_min:
            break
    if levels[-1] < MIN_BIN_WIDTH:
        raise LossInputError(f"FAPPY: delta {delta_min!r} is below the supported minimum {MIN_BIN_WIDTH!r}")
    return levels


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


@dataclass
class _Layout:
    """Level-independent geometry of one batch (no gradient).

    Row r of the (B,B) *entry* matrices lists the cosines of r to its negatives that the layer reads,
    ascending, then padding; ascending cosines have non-decreasing bins at every level.  The end points
    of the positive pairs are sorted the same way, so that the ``searchsorted`` queries of one level and
    bin offset come in ascending order (cache-friendly)."""

    m: int
    pos: torch.Tensor        # (P,) indices of the positive pairs in the cosine vector
    ends: torch.Tensor       # (2P,) end points (rows) of the positive pairs, by row, then by cosine
    end_of: torch.Tensor     # (2,P) position in ``ends`` of the pairs' rows i (0) and j (1)
    ent_pair: torch.Tensor   # (B,B) cosine index of each entry, M for padding
    ent_valid: torch.Tensor  # (B,B) bool: a real entry
    n_ent: torch.Tensor      # (B,) float64 number of entries (= |N_r| wherever the layer reads row r)
    inv_neg: torch.Tensor    # (B,) float64 1/|N_r| (inf when r has no negative)


def _layout(cos: torch.Tensor, labels: torch.Tensor) -> _Layout:
    b, m, dev = labels.numel(), cos.numel(), cos.device
    iu, ju = upper_pairs(b, device=dev)
    pos = torch.nonzero(labels[iu] == labels[ju]).reshape(-1)
    pair_of = torch.full((b, b), m, dtype=torch.long, device=dev)
    ar = torch.arange(m, device=dev)
    pair_of[iu, ju] = ar
    pair_of[ju, iu] = ar
    s64 = torch.cat([cos.detach().double(), cos.new_zeros(1, dtype=torch.float64)])[pair_of]
    neg = labels[:, None] != labels[None, :]
    readable = neg & (s64 >= -1.0) & (s64 < 1.0)     # the others are never read (see _check_readable)
    order = torch.sort(torch.where(readable, s64, math.inf), dim=1).indices
    valid = torch.gather(readable, 1, order)
    ent_pair = torch.where(valid, torch.gather(pair_of, 1, order), m)
    ends = torch.cat([iu[pos], ju[pos]])
    s_end = torch.cat([s64[iu[pos], ju[pos]]] * 2)
    perm = torch.sort(ends * 4.0 + (s_end + 1.0), stable=True).indices    # by row, then by cosine
    end_of = torch.empty_like(perm)
    end_of[perm] = torch.arange(perm.numel(), device=dev)
    return _Layout(m, pos, ends[perm], end_of.reshape(2, -1), ent_pair, valid,
                   readable.sum(1).to(torch.float64), 1.0 / neg.sum(1).to(torch.float64))


def _check_readable(cos64: torch.Tensor, labels: torch.Tensor, lay: _Layout, finest: float) -> None:
    """Raise where Caffe would read out of bounds: every cosine the layer touches must be a number in
    [-1, 1], and a negative one below 1.  The finest level reads a superset of the coarser ones."""
    b = labels.numel()
    sp = cos64[lay.pos]
    used = ~((1.0 - sp) < finest)
    bad_pos = used & ~(sp >= -1.0)
    rows = torch.zeros(b, dtype=torch.long, device=cos64.device)
    rows = rows.index_add(0, lay.ends, torch.cat([used, used]).long()) > 0
    iu, ju = upper_pairs(b, device=cos64.device)
    neg_pair = labels[iu] != labels[ju]
    bad_neg = neg_pair & (rows[iu] | rows[ju]) & ~((cos64 >= -1.0) & (cos64 < 1.0))
    if bool(bad_pos.any() | bad_neg.any()):
        if bool(bad_pos.any()):
            k = int(lay.pos[bad_pos.nonzero()[0, 0]])
            what = "positive"
        else:
            k = int(bad_neg.nonzero()[0, 0])
            what = "negative"
        i, j = int(iu[k]), int(ju[k])
        raise LossInputError(
            f"FAPPY: {what} pair ({i}, {j}) (cosine index {k}) has cosine {float(cos64[k])!r}; the Caffe layer "
            "reads its histogram out of bounds (segfault) for NaN, values below -1 and negative-pair values "
            ">= 1 (zero feature row? duplicated sample with two labels?)")


# -------------------------------------------------------------------------------------- levels

@dataclass
class _Levels:
    """Per level (first axis) and positive pair: the quantities of Eq. 7."""

    widths: torch.Tensor   # (L,1) float64 bin widths d
    active: torch.Tensor   # (L,P) bool: not (1 - s < d)
    lh: torch.Tensor       # (L,P) float64 (b_{t+1} - s)/d, zero where inactive
    rh: torch.Tensor       # (L,P) float64 (s - b_t)/d, zero where inactive
    tail_ge: torch.Tensor  # (L,2,P) Σ_{u>=t} h_r[u] for r = i (index 0) and r = j (index 1)
    tail_gt: torch.Tensor  # (L,2,P) Σ_{u>t} h_r[u]
    at_t: torch.Tensor     # (L,2,P) h_r[t]
    lo: torch.Tensor       # (L,3,2P) number of the row's entries in bins < t-1, < t, < t+1 (``ends`` order)
    rows: torch.Tensor     # (L,3,2P) the row of each end point, broadcast

    def pair_values(self) -> torch.Tensor:
        """(L,P) P_ij(d), zero for the pairs a level skips."""
        p = self.lh * self.tail_ge.sum(1) + self.rh * self.tail_gt.sum(1)
        return torch.where(self.active, p, torch.zeros_like(p))


_ROW = 2 ** 31          # row r's integer keys lie in [r·2^31, (r+1)·2^31)
_GRID = 2.0 ** 29       # the finest supported bin width is 2^-29: v·d·2^29 is an integer


def _levels(lay: _Layout, levels: list[float], cos64: torch.Tensor) -> _Levels:
    """Tail sums of the soft histograms of every positive pair's two rows, at every bin width.

    ``cos64``: the cosines in float64 (carrying the autograd graph in the paper mode).  A cosine s lies
    at x = (s + 1)/d, in bin u = floor(x), with right weight x − u and left weight 1 − (x − u).  With
    s1 = s + 1 computed in double like Caffe and d a power of two >= 2^-29,
    ``u < v  <=>  s1 < v·d  <=>  floor(s1·2^29) < v·d·2^29`` exactly, so one ``searchsorted`` of integer
    keys ``row·2^31 + floor(s1·2^29)`` counts, for all levels at once, a row's entries below any bin;
    the right weights of bin v sum to ``(Σ_{bin v} s1)/d − v·count``."""
    dev = cos64.device
    b = lay.ent_pair.shape[0]
    s1 = torch.cat([cos64, cos64.new_zeros(1)])[lay.ent_pair] + 1.0                     # (B,B)
    row = torch.arange(b, device=dev)
    grid = torch.where(lay.ent_valid, torch.floor(s1.detach() * _GRID), _ROW - 1.0).to(torch.long)
    keys = (row[:, None] * _ROW + grid).reshape(-1)              # ascending: by row, then cosine
    cum = torch.cat([s1.new_zeros(b, 1), torch.cumsum(torch.where(lay.ent_valid, s1, 0.0), 1)], 1)

    widths = torch.tensor(levels, dtype=torch.float64, device=dev)[:, None]
    s_pos = cos64[lay.pos]
    sp = s_pos.detach()
    active = ~((1.0 - sp)[None, :] < widths)
    xp = (s_pos + 1.0)[None, :] / widths       # powers of two: exactly Caffe's (s + 1.0) / d
    t = torch.where(active, torch.floor(xp.detach()), 0.0)
    zero = torch.zeros((), dtype=torch.float64, device=dev)
    rh = torch.where(active, xp - t, zero)
    lh = torch.where(active, 1.0 - (xp - t), zero)

    shifts = torch.tensor([-1.0, 0.0, 1.0], dtype=torch.float64, device=dev)[None, :, None]
    t_end = torch.zeros((len(levels), 2 * t.shape[1]), dtype=torch.float64, device=dev)
    t_end[:, lay.end_of.reshape(-1)] = torch.cat([t, t], 1)
    bins = t_end[:, None, :] + shifts                                                       # (L,3,2P)
    steps = (widths * _GRID).to(torch.long)[:, :, None]                                     # d·2^29
    queries = lay.ends * _ROW + bins.clamp_min(0.0).to(torch.long) * steps
    lo = torch.searchsorted(keys, queries) - lay.ends * b                                   # per-row counts
    c = cum[lay.ends, lo]
    lo_f = lo.to(torch.float64)
    count_below, count_at = lo_f[:, 1] - lo_f[:, 0], lo_f[:, 2] - lo_f[:, 1]
    r_below = (c[:, 1] - c[:, 0]) / widths - (bins[:, 0] * count_below)     # Σ right weights, bin t-1
    r_at = (c[:, 2] - c[:, 1]) / widths - (bins[:, 1] * count_at)           # Σ right weights, bin t
    n_row = lay.n_ent[lay.ends]
    inv = lay.inv_neg[lay.ends]
    tail_ge = inv * ((n_row - lo_f[:, 1]) + r_below)
    tail_gt = inv * ((n_row - lo_f[:, 2]) + r_at)
    at_t = inv * ((count_at - r_at) + r_below)       # left weights of bin t + right weights of bin t-1
    return _Levels(widths, active, lh, rh, tail_ge[:, lay.end_of], tail_gt[:, lay.end_of], at_t[:, lay.end_of],
                   lo, lay.ends.expand(len(levels), 3, -1))


# ------------------------------------------------------------------------------------ the losses

def _prepare(cos: torch.Tensor, labels: torch.Tensor, levels: list[float]) -> _Layout:
    lay = _layout(cos, labels)
    if lay.pos.numel() and levels:
        _check_readable(cos.detach().double(), labels, lay, levels[-1])
    return lay


def _suffix_products(x: torch.Tensor) -> torch.Tensor:
    """``out[l] = x[l] · x[l+1] · … · x[-1]``."""
    return torch.flip(torch.cumprod(torch.flip(x, [0]), 0), [0])


def fappy_caffe_forward_backward(cosine: torch.Tensor, labels: torch.Tensor, delta: float
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The authors' ``FAPPYLoss`` Forward: ``(loss, dloss/dcosine)`` exactly as the C++ computes them.

    ``cosine``: the M = B(B-1)/2 pair cosines in Caffe's i<j row-major order, shape (M,) or (M,1,1,1);
    ``labels``: (B,) or (B,1,1,1); ``delta``: ``fappy_loss_param.delta``.  Returns the unweighted loss
    (0-d, cosine's dtype) and the diff (cosine's shape and dtype) before the loss weight is applied.
    Bins and skips are decided in double from the given cosines, as in the C++; weights and sums are
    float64 (Caffe: float32), which agrees with Caffe to ~1e-5 relative on the loss.  No autograd graph.

    The level loop ``L <- (L + R_d)/c_d/2`` unrolls to ``L = Σ_d R_d · W_d`` with
    ``W_d = Π_{d' <= d} 1/(2 c_{d'})`` (``c`` = 1 where zero); the diff is the same combination of the
    levels' raw diffs: ``-(h_i[t] + h_j[t])/d`` for a positive pair, ``+lh/(d|N|)`` for a negative in
    bin t-1 and ``+rh/(d|N|)`` for one in bin t (the C++ adds and subtracts ``(lh [+ rh])/d/|N|`` on its
    left/right bin lists; the other bins cancel), applied as range additions on the sorted entries."""
    cos, lab = _flat_inputs(cosine, labels)
    levels = caffe_levels(delta)
    with torch.no_grad():
        lay = _prepare(cos, lab, levels)
        if lay.pos.numel() == 0 or not levels:
            return cos.new_zeros(()), torch.zeros_like(cosine)
        lv = _levels(lay, levels, cos.detach().double())
        count = lv.active.sum(1).to(torch.float64)
        weight = _suffix_products(torch.where(count > 0, 0.5 / count, torch.full_like(count, 0.5)))
        loss = (lv.pair_values().sum(1) * weight).sum()

        scale = weight[:, None] / lv.widths                                      # (L,1)
        pos_diff = torch.where(lv.active, -lv.at_t.sum(1), 0.0) * scale
        lh = torch.empty((len(levels), 2 * lay.pos.numel()), dtype=torch.float64, device=cos.device)
        rh = torch.empty_like(lh)
        lh[:, lay.end_of.reshape(-1)] = (lv.lh * scale).repeat(1, 2)           # (L,2P) in ``ends`` order
        rh[:, lay.end_of.reshape(-1)] = (lv.rh * scale).repeat(1, 2)
        b = lay.ent_pair.shape[0]
        ramp = torch.zeros(b * (b + 1), dtype=torch.float64, device=cos.device)
        ramp.index_add_(0, (lv.rows * (b + 1) + lv.lo).reshape(-1), torch.stack([lh, rh - lh, -rh], 1).reshape(-1))
        ent_diff = torch.cumsum(ramp.reshape(b, b + 1), 1)[:, :b] * lay.inv_neg[:, None]
        diff = torch.zeros(lay.m + 1, dtype=torch.float64, device=cos.device)
        diff.index_add_(0, lay.pos, pos_diff.sum(0)).index_add_(0, lay.ent_pair.reshape(-1), ent_diff.reshape(-1))
        return loss.to(cos.dtype), diff[: lay.m].to(cos.dtype).reshape(cosine.shape)


class _FAPPYCaffe(torch.autograd.Function):
    """Forward: loss and the C++ diff; backward: that diff times grad_output (= Caffe's loss_weight)."""

    @staticmethod
    def forward(ctx, cosine, labels, delta):
        loss, diff = fappy_caffe_forward_backward(cosine, labels, delta)
        ctx.save_for_backward(diff)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        (diff,) = ctx.saved_tensors
        return diff * grad_output, None, None


def fappy_caffe(cosine: torch.Tensor, labels: torch.Tensor, delta: float) -> torch.Tensor:
    """The authors' ``FAPPYLoss`` layer: scalar loss, differentiable w.r.t. ``cosine`` with exactly the
    layer's analytic diff as gradient (see the module docstring for the formula and the quirks)."""
    return _FAPPYCaffe.apply(cosine, labels, delta)


def fappy_paper(cosine: torch.Tensor, labels: torch.Tensor, delta_min: float) -> torch.Tensor:
    """Algorithm 1 of the paper as printed, differentiable by autograd (computed in float64, returned
    in the cosine's dtype).  Same inputs as :func:`fappy_caffe`."""
    cos, lab = _flat_inputs(cosine, labels)
    levels = paper_levels(delta_min)
    lay = _prepare(cos, lab, levels)
    count = lay.pos.numel()
    if count == 0:
        return cos[:0].sum()  # 0, attached to the graph
    lv = _levels(lay, levels, cos.double())
    n = len(levels)      # L <- (L + R_d / C) / 2, unrolled: R_d weighs 2^-(levels from d to the end) / C
    weight = torch.tensor([0.5 ** (n - k) / count for k in range(n)], dtype=torch.float64, device=cos.device)
    loss = (lv.pair_values().sum(1) * weight).sum()
    return loss.to(cos.dtype)


class FAPPYLoss(nn.Module):
    """FAPPY loss on a batch of embeddings: ``FAPPYLoss(delta=1e-4, mode="caffe")(embeddings, labels)``.

    The cosines are those of the authors' ``CosineSimilarityBatch`` layer,
    ``s_ij = <x_i, x_j> / sqrt(|x_i|²|x_j|²)`` for i<j in row-major order, then
    :func:`fappy_caffe` (``mode="caffe"``, the C++ layer with its accumulating normalisation and its
    analytic gradient) or :func:`fappy_paper` (``mode="paper"``, Algorithm 1 with autograd).  See the
    module docstring for the formula, the exact difference of the two modes and every Caffe quirk.
    ``delta`` defaults to 1e-4, the authors' setting (the proto default is 0.001).
    """

    def __init__(self, delta: float = 1e-4, mode: str = "caffe"):
        super().__init__()
        if mode not in MODES:
            raise LossInputError(f"FAPPYLoss: mode must be one of {MODES}, got {mode!r}")
        (caffe_levels if mode == "caffe" else paper_levels)(delta)  # validate now
        self.delta = float(delta)
        self.mode = mode

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        labels = check_batch(embeddings, labels, "FAPPYLoss")
        iu, ju = upper_pairs(embeddings.shape[0], device=embeddings.device)
        cosine = cosine_matrix(embeddings)[iu, ju]
        loss_fn = fappy_caffe if self.mode == "caffe" else fappy_paper
        return loss_fn(cosine, labels, self.delta)

    def extra_repr(self) -> str:
        return f"delta={self.delta}, mode={self.mode!r}"

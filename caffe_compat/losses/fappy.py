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

Implementation: the pair rows and level counts are in :mod:`caffe_compat.losses.fappy_rows` (no histogram of
``2/d`` bins is built; one sort per row, batched searches for every level).  No Python loop at all; memory O(L·B·K) with L ≤ 30 levels and K the largest number of positive
partners of a sample (≤ B).  The Caffe diff is assembled the same way, the negatives' share as range
additions on the sorted rows, and handed back as a (B,B) matrix.  Levels that no pair uses (the
coarsest ones) are skipped in the caffe mode: they add nothing and do not enter the finer levels'
weights.  For speed at small batches: few large temporaries (in-place updates; the CPU allocator
otherwise returns and re-faults pages on every call), the row sort on the CPU by NumPy, and
level-independent work done once.  On CUDA the whole caffe-mode computation (cosines, layer,
gradient) is recorded once per batch shape as a CUDA graph (fixed B − 1 slots per row, every level,
no host synchronisation) and replayed: ~150 kernels launched at once instead of one by one from
Python (``USE_CUDA_GRAPHS = False`` turns it off; the graphs: :mod:`caffe_compat.losses.cuda_graph`).
Under ``torch.compile`` both modes take that static form (B − 1 slots, every level; the paper mode's
``C`` a tensor), so ``FAPPYLoss`` traces as one graph, its bounds check an assertion in the graph.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
from torch import nn

from caffe_compat.losses.batch_input import check_batch, reject_pml_arguments
from caffe_compat.losses.cuda_graph import GraphCache, can_replay
from caffe_compat.losses.fappy_rows import (_flat_inputs, _pair_geometry, _from_vector, _from_matrix, _Rows, _rows, _unreadable, _check_readable, _levels)
from caffe_compat.losses.loss_errors import LossInputError
from caffe_compat.losses.pairwise import cosine_matrix, matmul_lifting_subnormals
from caffe_compat.losses.static_form import static_form

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


# ------------------------------------------------------------------------------------ the losses

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
    # 1/(2 c_d) = 1/(slots used at d), each used pair having two slots; 1/2 where no pair is used
    weight = _suffix_products(lv.active.sum((0, 2), dtype=torch.float64).clamp_min_(2.0).reciprocal_())
    loss = torch.dot(lv.level_sums(), weight)

    b = lv.lh.shape[0]
    scale = (weight / lv.widths)[:, None]
    lh, rh = lv.lh * scale, lv.rh * scale                                      # (B,L,K)
    # added level by level, coarsest first: the small coarse-level steps are not lost against the
    # large fine-level ones where they meet (half the round-off of slot by slot)
    ramp = s.new_zeros(b, b + 1).scatter_add_(1, lv.lo, torch.stack([lh, rh - lh, -rh], 2).view(b, -1))
    ent = ramp[:, :b].cumsum_(1).mul_(rows.inv_neg[:, None]).masked_fill_(rows.past, 0.0)
    # (B,K), 0 on padding; summed slot-major, (B,K,L): the layer's round-off is that of this order
    pos = (torch.where(lv.active, lv.at_t, 0.0) * scale).mT.contiguous().sum(2).neg()
    ent.scatter_add_(1, rows.slot, pos)
    e = s.new_zeros(b, b).scatter_add_(1, rows.order, ent)  # E: the sorted rows put back in place (0 + E)
    return loss, (e + e.mT).fill_diagonal_(0.0)


def _caffe_static(sim: torch.Tensor, labels: torch.Tensor, levels: list[float]
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_caffe`` on a (B,B) cosine matrix with fixed shapes and no host synchronisation, so that a
    CUDA graph can hold it: B − 1 slots per row and every level (an unused coarse level adds nothing
    and leaves the finer levels' weights alone, so the numbers are those of ``_caffe``).  Returns
    ``(loss, H, unreadable)``; the caller raises when ``unreadable`` is set."""
    s = _from_matrix(sim)
    rows = _rows(s, labels, k=labels.numel() - 1)
    loss, h = _caffe_on_rows(s, rows, levels)
    return loss, h, _unreadable(rows, levels[-1])


#: Graphs kept (one per function, batch shape, dtypes, device and delta), least recently used dropped first.
MAX_GRAPHS = 8
#: Replay the caffe-mode layer as a CUDA graph on CUDA devices (set False to launch kernel by kernel).
USE_CUDA_GRAPHS = True
_CACHE = GraphCache(MAX_GRAPHS)
_GRAPHS = _CACHE.graphs  # the cached graphs (the tests look at them)


def _graph_applies(t: torch.Tensor, labels: torch.Tensor, levels: list[float]) -> bool:
    return USE_CUDA_GRAPHS and bool(levels) and labels.numel() >= 2 and can_replay(t)


def _replay(fn, levels: list[float], *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    _CACHE.capacity = MAX_GRAPHS  # (read at each call, as a module setting)
    return _CACHE.replay((fn.__name__, tuple(levels)), functools.partial(fn, levels=levels), *inputs)


#: What a compiled graph asserts (no host synchronisation to name the pair, as the eager path does).
_UNREADABLE = ("FAPPY: a cosine the layer reads is NaN, below -1, or >= 1 for a negative pair (the Caffe layer "
               "reads its histogram out of bounds)")


def _caffe_matrix(sim: torch.Tensor, labels: torch.Tensor, levels: list[float]
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``_caffe(_from_matrix(sim), labels, levels)``; on CUDA through a cached CUDA graph; under
    ``torch.compile`` the static form, its bounds check an assertion in the graph (no host sync)."""
    if static_form(sim) and levels and labels.numel() >= 2:
        loss, h, unreadable = _caffe_static(sim, labels, levels)
        torch._assert_async(~unreadable, _UNREADABLE)
        return loss, h
    if _graph_applies(sim, labels, levels):
        loss, h, unreadable = _replay(_caffe_static, levels, sim, labels)
        if not bool(unreadable):
            return loss.clone(), h.clone()
    return _caffe(_from_matrix(sim), labels, levels)  # (when unreadable: raises, naming the pair)


def _cosine_backward(x: torch.Tensor, sim: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """CosineSimilarityBatch's backward: ``dX`` for the diff ``H`` of every pair at (i, j) and (j, i)
    (zero diagonal), ``S`` the cosines, ``xy = X·Xᵀ``: from ``S_ij = xy_ij / sqrt(xy_ii xy_jj)``,
    ``dx_i = Σ_j H_ij (x_j / sqrt(xy_ii xy_jj) − S_ij x_i / xy_ii)``, i.e. ``dX = A·X`` with
    ``A_ij = H_ij / (|x_i| |x_j|)`` off the diagonal and ``A_ii = −Σ_j H_ij S_ij / |x_i|²``: one matmul
    (autograd through ``X·Xᵀ`` takes two); the coarse levels' shares in ``H`` are float32 subnormals at
    small Δ, whose x86 stall :func:`~caffe_compat.losses.pairwise.matmul_lifting_subnormals` avoids."""
    r = torch.linalg.vector_norm(x, dim=1).reciprocal()                     # 1/|x_i|
    a = h * (r[:, None] * r[None, :])
    a.diagonal().sub_((h * sim).sum(1) * (r * r))
    return matmul_lifting_subnormals(a, x)


def _embeddings_static(x: torch.Tensor, labels: torch.Tensor, levels: list[float]
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cosines, the layer and the gradient for the embeddings (loss weight 1), graph-capturable."""
    sim = cosine_matrix(x)
    loss, h, unreadable = _caffe_static(sim, labels, levels)
    return loss.to(x.dtype), _cosine_backward(x, sim, h.to(x.dtype)), unreadable


def _paper(s: torch.Tensor, labels: torch.Tensor, levels: list[float], like: torch.Tensor) -> torch.Tensor:
    """Algorithm 1 on the symmetric (B,B) float64 cosines ``s`` (autograd), in ``like``'s dtype."""
    if static_form(s) and labels.numel() >= 2:
        return _paper_static(s, labels, levels, like)
    rows = _rows(s, labels)
    if rows is None:
        return like[:0].sum()  # 0, attached to the graph
    _check_readable(s, labels, rows, levels[-1])
    return _paper_total(rows, levels, int(rows.slot_ok.sum()) // 2, like)  # C: each positive pair has two slots


def _paper_static(s: torch.Tensor, labels: torch.Tensor, levels: list[float], like: torch.Tensor) -> torch.Tensor:
    """``_paper`` with fixed shapes and no host synchronisation (what ``torch.compile(fullgraph=True)``
    traces): B − 1 slots per row, ``C`` a tensor, 0 without a positive pair (every level's sum is 0 then),
    the bounds check an assertion in the graph."""
    rows = _rows(s, labels, k=labels.numel() - 1)
    torch._assert_async(~_unreadable(rows, levels[-1]), _UNREADABLE)
    return _paper_total(rows, levels, (rows.slot_ok.sum() // 2).clamp_min(1).to(torch.float64), like)


def _paper_total(rows: _Rows, levels: list[float], count, like: torch.Tensor) -> torch.Tensor:
    """Algorithm 1's ``L <- (L + R_d / C) / 2`` unrolled: R_d weighs 2^-(levels from d to the end) / C
    (``count``: C, an int or a 0-d float64 tensor; the division is the same float64 rounding either way)."""
    n = len(levels)
    halvings = torch.tensor([0.5 ** (n - k) for k in range(n)], dtype=torch.float64, device=rows.s1.device)
    return (_levels(rows, levels).level_sums() * (halvings / count)).sum().to(like.dtype)


def fappy_caffe_forward_backward(cosine: torch.Tensor, labels: torch.Tensor, delta: float
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The authors' ``FAPPYLoss`` Forward: ``(loss, dloss/dcosine)`` exactly as the C++ computes them.

    ``cosine``: the M = B(B-1)/2 pair cosines in Caffe's i<j row-major order, shape (M,) or (M,1,1,1);
    ``labels``: (B,) or (B,1,1,1); ``delta``: ``fappy_loss_param.delta``.  Returns the unweighted loss
    (0-d, cosine's dtype) and the diff (cosine's shape and dtype) before the loss weight is applied.
    Bins and skips are decided in double from the given cosines, as in the C++; weights and sums are
    float64 (Caffe: float32), which agrees with Caffe to ~1e-5 relative on the loss.  No autograd graph."""
    cos, lab = _flat_inputs(cosine, labels)
    levels = caffe_levels(delta)
    b = lab.numel()
    with torch.no_grad():
        loss, e = _caffe(_from_vector(cos.detach(), b), lab, levels)
        if e is None:
            return loss.to(cos.dtype), torch.zeros_like(cosine)
        iu, ju, _ = _pair_geometry(b, cos.device)
        diff = e[iu, ju]
    return loss.to(cos.dtype), diff.to(cos.dtype).reshape(cosine.shape)


class _SavedGradient(torch.autograd.Function):
    """Caffe's loss layers compute their diff in Forward; backward scales it by grad_output (the top
    diff, i.e. loss_weight)."""

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        (grad,) = ctx.saved_tensors
        return grad * grad_output, None, None


class _FAPPYCaffe(_SavedGradient):
    """Forward: loss and the C++ diff; backward: that diff times grad_output (= Caffe's loss_weight).

    ``sim`` is the (B,B) cosine matrix of which the upper triangle (the pairs i<j) is read; the
    gradient is the diff on the upper triangle and 0 elsewhere."""

    @staticmethod
    def forward(ctx, sim, labels, delta):
        with torch.no_grad():
            loss, e = _caffe_matrix(sim.detach(), labels, caffe_levels(delta))
            grad = torch.zeros_like(sim) if e is None else e.triu_(1).to(sim.dtype)
        ctx.save_for_backward(grad)
        return loss.to(sim.dtype)


class _FAPPYCaffeEmbeddings(_SavedGradient):
    """``FAPPYLoss(mode="caffe")`` from the embeddings in one node: CosineSimilarityBatch, then the C++
    FAPPY layer, whose diff (computed in Forward, as in Caffe) goes through CosineSimilarityBatch's
    backward formula (:func:`_cosine_backward`) at once; backward scales that gradient by grad_output
    (Caffe's loss_weight).  No autograd graph for the cosine matrix; on CUDA one graph replay; under
    ``torch.compile`` the static form (no host synchronisation: one graph, ``fullgraph=True``)."""

    @staticmethod
    def forward(ctx, x, labels, delta):
        levels = caffe_levels(delta)
        grad = None
        if static_form(x) and levels and labels.numel() >= 2:
            loss, grad, unreadable = _embeddings_static(x, labels, levels)
            torch._assert_async(~unreadable, _UNREADABLE)
        elif _graph_applies(x, labels, levels):
            loss, grad, unreadable = _replay(_embeddings_static, levels, x, labels)
            if bool(unreadable):
                grad = None  # the eager path below raises, naming the pair
            else:
                loss, grad = loss.clone(), grad.clone()
        if grad is None:
            sim = cosine_matrix(x)
            loss, e = _caffe(_from_matrix(sim), labels, levels)
            grad = torch.zeros_like(x) if e is None else _cosine_backward(x, sim, e.to(x.dtype))
        ctx.save_for_backward(grad)
        return loss.to(x.dtype)


def _upper_to_matrix(cos: torch.Tensor, b: int) -> torch.Tensor:
    """(B,B) matrix with the M pair cosines on the upper triangle (differentiable)."""
    iu, ju, _ = _pair_geometry(b, cos.device)
    return cos.new_zeros(b, b).index_put((iu, ju), cos)


def fappy_caffe(cosine: torch.Tensor, labels: torch.Tensor, delta: float) -> torch.Tensor:
    """The authors' ``FAPPYLoss`` layer: scalar loss, differentiable w.r.t. ``cosine`` with exactly the
    layer's analytic diff as gradient (see the module docstring for the formula and the quirks)."""
    cos, lab = _flat_inputs(cosine, labels)
    return _FAPPYCaffe.apply(_upper_to_matrix(cos, lab.numel()), lab, delta)


def fappy_paper(cosine: torch.Tensor, labels: torch.Tensor, delta_min: float) -> torch.Tensor:
    """Algorithm 1 of the paper as printed, differentiable by autograd (computed in float64, returned
    in the cosine's dtype).  Same inputs as :func:`fappy_caffe`."""
    cos, lab = _flat_inputs(cosine, labels)
    return _paper(_from_vector(cos, lab.numel()), lab, paper_levels(delta_min), cos)


class FAPPYLoss(nn.Module):
    """FAPPY loss on a batch of embeddings: ``FAPPYLoss(delta=1e-4, mode="caffe")(embeddings, labels)``.

    The cosines are those of the authors' ``CosineSimilarityBatch`` layer,
    ``s_ij = <x_i, x_j> / sqrt(|x_i|²|x_j|²)`` for i<j in row-major order, then
    :func:`fappy_caffe` (``mode="caffe"``, the C++ layer with its accumulating normalisation and its
    analytic gradient) or :func:`fappy_paper` (``mode="paper"``, Algorithm 1 with autograd).  See the
    module docstring for the formula, the exact difference of the two modes and every Caffe quirk.
    In the caffe mode the cosines and the layer form one autograd node, whose backward applies
    CosineSimilarityBatch's backward formula to the layer's diff (one matmul, see
    ``_FAPPYCaffeEmbeddings``); the result is the chain rule through :func:`fappy_caffe`.
    ``delta`` defaults to 1e-4, the authors' setting (the proto default is 0.001).
    PML's ``indices_tuple``, ``ref_emb`` and ``ref_labels`` raise ``LossArgumentError`` (both modes).
    """

    def __init__(self, delta: float = 1e-4, mode: str = "caffe"):
        super().__init__()
        if mode not in MODES:
            raise LossInputError(f"FAPPYLoss: mode must be one of {MODES}, got {mode!r}")
        (caffe_levels if mode == "caffe" else paper_levels)(delta)  # validate now
        self.delta = float(delta)
        self.mode = mode

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor, indices_tuple=None, ref_emb=None,
                ref_labels=None) -> torch.Tensor:
        reject_pml_arguments(f"FAPPYLoss (mode={self.mode!r})", "the false positive probabilities use every positive "
                             "pair and every negative of the batch, as the Caffe layer", indices_tuple=indices_tuple,
                             ref_emb=ref_emb, ref_labels=ref_labels)
        labels = check_batch(embeddings, labels, "FAPPYLoss")
        if self.mode == "caffe":
            return _FAPPYCaffeEmbeddings.apply(embeddings, labels, self.delta)
        sim = cosine_matrix(embeddings)      # its upper triangle: the cosines of the pairs i<j
        return _paper(_from_matrix(sim), labels, paper_levels(self.delta), sim)

    def extra_repr(self) -> str:
        return f"delta={self.delta}, mode={self.mode!r}"

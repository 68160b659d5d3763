"""Pairwise similarities, label masks and pair sets shared by every metric-learning loss.

One place for the batch geometry: cosine matrices (Caffe's ``CosineSimilarityBatch`` formula),
(squared) Euclidean distance matrices, the i<j pair enumeration Caffe uses, and same/different-label
masks.  Losses import from here and nowhere else for these quantities.

Pair sets.  A loss works on a :class:`PairSelection`: ``(B, R)`` matrices of pair *counts*, row = query
(anchor), column = reference sample (the batch itself, R = B, unless a reference set is given).  The
same sets written as pytorch-metric-learning's index tuples, ``(a1, p, a2, n)`` for pairs and
``(a, p, n)`` for triplets, are converted here in both directions as PML's
``lmu.convert_to_pairs`` / ``lmu.convert_to_triplets`` do: a triplet tuple read as pairs is
``(a, p, a, n)`` (every occurrence counted), a pair tuple read as triplets is every ``(a1[i], p[i],
n[j])`` with ``a1[i] == a2[j]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def cosine_matrix(x: torch.Tensor) -> torch.Tensor:
    """``S[i, j] = <x_i, x_j> / sqrt(|x_i|^2 |x_j|^2)``: the square root of the *product* of squared
    norms, exactly as the FAPPY authors' ``CosineSimilarityBatch`` computes it (a zero row gives NaN,
    as in Caffe)."""
    xy = x @ x.t()
    sq = torch.diagonal(xy)
    return xy / torch.sqrt(sq[:, None] * sq[None, :])


#: 2^24 lifts every nonzero float32 subnormal (>= 2^-149) into the normal range (>= 2^-125).
_SUBNORMAL_LIFT = 2.0 ** 24


def matmul_lifting_subnormals(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for a float32 ``a`` that may hold subnormal numbers, without the x86 stall.

    x86 cores handle a subnormal operand by a microcode assist, ~100x the cost of a normal
    multiply-add: FAPPY's layer diff at Δ = 1e-4 carries the coarse levels' shares divided by
    ``2·c_d`` up to 15 times, so ~20% of its (B,B) entries are subnormal, and the (128,128)·(128,512)
    product took 5.2 ms instead of 0.2 ms on an Intel Xeon.  Here, on the CPU, ``a`` is scaled by 2^24
    (exact: a power of two), multiplied, and the product scaled back by 2^-24.  A GEMM's multiply-adds
    are fused, so each product enters its sum unrounded either way: the result is the plain product
    bit for bit wherever the plain GEMM's running sums stayed normal, and where they did not (a row of
    ``a`` that is subnormal throughout) it is the more accurate one, rounded once at the end.  Nothing
    is flushed to zero, no floating-point mode is changed.  The scaling is skipped (plain ``a @ b``)
    when ``a`` has no subnormal entry, when the scaled sums could overflow (bounded by
    ``max|a|·2^24·K·max|b|``, NaN included), off the CPU (GPUs take subnormals at full speed) and
    under ``torch.compile``."""
    if (a.dtype != torch.float32 or a.device.type != "cpu" or a.dim() != 2 or b.dim() != 2
            or torch.compiler.is_compiling()):
        return a @ b
    if not _holds_subnormal(a):
        return a @ b
    bound = float(a.abs().amax()) * _SUBNORMAL_LIFT * a.shape[1] * float(b.abs().amax())
    if not bound < torch.finfo(torch.float32).max / 2:
        return a @ b
    return torch.mm(a * _SUBNORMAL_LIFT, b).mul_(1.0 / _SUBNORMAL_LIFT)


def _holds_subnormal(t: torch.Tensor) -> bool:
    """Whether ``t`` holds a nonzero number below the smallest normal one (NumPy on the CPU: a quarter of
    PyTorch's per-op cost on a FAPPY layer diff)."""
    if t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64) and not torch.compiler.is_compiling():
        magnitude = np.abs(t.detach().numpy())
        return bool(np.logical_and(magnitude < np.finfo(magnitude.dtype).tiny, magnitude > 0).any())
    magnitude = t.abs()
    return bool(((magnitude < torch.finfo(t.dtype).tiny) & (magnitude > 0)).any())


class _Lift:
    """What one backward through :func:`lifting_subnormal_grads` decided: whether its gradient was lifted."""

    def __init__(self):
        self.lifted = False


class _LiftOutputGrad(torch.autograd.Function):
    """Identity forward (a copy: the caller's tensor, whose retained gradient stays the unscaled one);
    backward: the output's gradient times 2^24 when it holds float32 subnormals and no entry above 2^24."""

    @staticmethod
    def forward(ctx, y, lift):
        ctx.lift = lift
        return y.clone()

    @staticmethod
    def backward(ctx, grad):
        lift = ctx.lift
        lift.lifted = (grad.dtype == torch.float32 and _holds_subnormal(grad)
                       and float(grad.abs().amax()) <= _SUBNORMAL_LIFT)
        return (grad * _SUBNORMAL_LIFT if lift.lifted else grad), None


class _UnliftInputGrad(torch.autograd.Function):
    """Identity forward (a view, read by ``fn`` alone); backward: the input's gradient times 2^-24 when the
    output's was lifted."""

    @staticmethod
    def forward(ctx, x, lift):
        ctx.lift = lift
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad * (1.0 / _SUBNORMAL_LIFT) if ctx.lift.lifted else grad), None


def lifting_subnormal_grads(fn, x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` whose backward runs on the output's gradient lifted out of the float32 subnormal range.

    A backward is linear in the gradient it receives.  When that gradient holds subnormal numbers (FAPPY's
    layer diff at Δ = 1e-4, see :func:`matmul_lifting_subnormals`) every GEMM of autograd's chain stalls on
    them: CosineSimilarityBatch + FAPPYLoss as two layers took 9.6 ms per forward and backward at B = 128,
    D = 512 on an Intel Xeon, against 3.4 ms for the fused loss.  Here, on the CPU, that gradient is
    multiplied by 2^24 before the chain and ``x``'s share by 2^-24 after it; scaling by a power of two is
    exact and commutes with every rounding of the (linear) chain, so ``x``'s gradient is autograd's own bit
    for bit wherever autograd's intermediates stay normal (where they do not, the lifted chain rounds them
    above the subnormal range), whatever kernels PyTorch picks.  Only this path's share of ``x``'s gradient
    is scaled back (the scaling sits on a private view of ``x``).  Without subnormals or with an entry above
    2^24 (the lifted chain then stays below 2^48 where the plain one stays below 2^24) nothing is scaled; the
    two autograd nodes and the check cost ~0.1 ms on the CPU.  Off the CPU (GPUs take subnormals at full
    speed), under compile and without autograd ``fn(x)`` runs alone."""
    if x.device.type != "cpu" or torch.compiler.is_compiling() or not (x.requires_grad and torch.is_grad_enabled()):
        return fn(x)
    lift = _Lift()
    return _LiftOutputGrad.apply(fn(_UnliftInputGrad.apply(x, lift)), lift)


def unit_rows(x: torch.Tensor | None, normalize: bool = True) -> torch.Tensor | None:
    """``x`` with L2-normalised rows when ``normalize`` (``F.normalize``), else ``x``; None stays None."""
    return torch.nn.functional.normalize(x, dim=1) if normalize and x is not None else x


def normalized_cosine_matrix(x: torch.Tensor, y: torch.Tensor | None = None, eps: float = 1e-12) -> torch.Tensor:
    """Cosine matrix of L2-normalised rows of ``x`` against those of ``y`` (default ``x``)
    (``F.normalize`` convention: a zero row gives zeros)."""
    xn = torch.nn.functional.normalize(x, dim=1, eps=eps)
    yn = xn if y is None else torch.nn.functional.normalize(y, dim=1, eps=eps)
    return xn @ yn.t()


def squared_euclidean_matrix(x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
    """``D[i, j] = |x_i - y_j|^2`` by the Gram expansion, clamped at 0 against round-off."""
    y = x if y is None else y
    xx = (x * x).sum(1)
    yy = (y * y).sum(1)
    return (xx[:, None] + yy[None, :] - 2.0 * (x @ y.t())).clamp_min(0.0)


def euclidean_matrix(x: torch.Tensor, y: torch.Tensor | None = None, eps: float = 1e-12) -> torch.Tensor:
    """``D[i, j] = sqrt(|x_i - y_j|^2 + eps)``: eps keeps the gradient finite on the diagonal."""
    return torch.sqrt(squared_euclidean_matrix(x, y) + eps)


def label_masks(labels: torch.Tensor, ref_labels: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positive, negative)`` boolean masks: same label, different label.

    Without ``ref_labels`` the B×B masks of the batch, the diagonal (a sample with itself) excluded from
    the positives; with ``ref_labels`` the B×R masks against a reference set, nothing excluded (PML's
    cross-batch convention: the reference set is other samples)."""
    labels = labels.reshape(-1)
    if ref_labels is not None:
        same = labels[:, None] == ref_labels.reshape(-1)[None, :]
        return same, ~same
    same = labels[:, None] == labels[None, :]
    eye = torch.eye(len(labels), dtype=torch.bool, device=labels.device)
    return same & ~eye, ~same


def upper_pairs(batch_size: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices ``(i, j)`` of the pairs i<j in Caffe's row-major order: pair k = B·i − i(i+1)/2 + (j−i−1)."""
    ij = torch.triu_indices(batch_size, batch_size, offset=1, device=device)
    return ij[0], ij[1]


def pair_index(i: torch.Tensor, j: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Row-major index k of the pair (i, j), i<j (the inverse of :func:`upper_pairs`)."""
    return batch_size * i - i * (i + 1) // 2 + (j - i - 1)


@dataclass(frozen=True)
class PairSelection:
    """Pairs as ``(B, R)`` count matrices (row = anchor): ``pos`` positives, ``neg`` negatives."""

    pos: torch.Tensor
    neg: torch.Tensor


def one_minus_mean_ap(ap: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """A list-wise AP loss (FastAP, Smooth-AP): ``1 − mean(ap[valid])``, or 0 when no anchor is valid (times
    the 0/1 flag: the gradient is 0 then, the loss still attached to the graph).  The invalid anchors are
    masked rather than dropped (no boolean indexing: its length would be read on the host, which CUDA-graph
    capture cannot hold); their terms are zeros either way."""
    n_valid = valid.sum()
    mean_ap = torch.where(valid, ap, 0.0).sum() / n_valid.clamp_min(1)
    return (1.0 - mean_ap) * (n_valid > 0).to(ap.dtype)


def select_pairs(miner, embeddings: torch.Tensor, labels: torch.Tensor, ref: torch.Tensor | None = None,
                 ref_labels: torch.Tensor | None = None) -> PairSelection:
    """The pairs a loss uses: the miner's selection (its count matrices: ``miner.selection`` of our
    miners, which builds no index tuple; or those of the index tuple a foreign miner returns), or every
    positive and negative pair (against ``ref`` when given)."""
    if miner is None:
        pos, neg = label_masks(labels, ref_labels)
        return PairSelection(pos.to(embeddings.dtype), neg.to(embeddings.dtype))
    from caffe_compat.losses.miners import Miner  # (miners imports this module)

    # our miners hand over the counts alone (no index tuple: nothing read on the host), a foreign one its tuple
    mine = miner.selection if isinstance(miner, Miner) else miner
    selection = mine(embeddings, labels) if ref is None else mine(embeddings, labels, ref, ref_labels)
    if not hasattr(selection, "pos"):  # a PML-shaped tuple, e.g. from a pytorch-metric-learning miner
        n_ref = embeddings.shape[0] if ref is None else ref.shape[0]
        return selection_from_tuple(selection, embeddings.shape[0], n_ref, embeddings.dtype)
    return PairSelection(selection.pos.to(embeddings.dtype), selection.neg.to(embeddings.dtype))


def pair_counts(rows: torch.Tensor, cols: torch.Tensor, shape: tuple[int, int], dtype) -> torch.Tensor:
    """``(B, R)`` matrix counting each ``(rows[k], cols[k])`` (repeated pairs count repeatedly)."""
    counts = torch.zeros(shape, dtype=dtype, device=rows.device)
    return counts.index_put_((rows, cols), torch.ones(rows.shape, dtype=dtype, device=rows.device), accumulate=True)


def pairs_of_counts(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, cols)`` long tensors of a count matrix, row-major, a pair counted k times listed k times."""
    rows, cols = torch.nonzero(counts > 0, as_tuple=True)
    times = counts[rows, cols].round().long()
    return rows.repeat_interleave(times), cols.repeat_interleave(times)


def as_pairs(indices_tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(a1, p, a2, n)`` of a pair or triplet tuple (PML's ``convert_to_pairs``)."""
    if len(indices_tuple) == 4:
        return tuple(indices_tuple)
    a, p, n = indices_tuple
    return a, p, a, n


def as_triplets(indices_tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(a, p, n)`` of a triplet or pair tuple (PML's ``convert_to_triplets``: every positive pair with
    every negative pair of the same anchor, in PML's order)."""
    if len(indices_tuple) == 3:
        return tuple(indices_tuple)
    a1, p, a2, n = indices_tuple
    i, j = torch.where(a1[:, None] == a2[None, :])
    return a1[i], p[i], n[j]


def selection_from_tuple(indices_tuple, n_query: int, n_ref: int, dtype) -> PairSelection:
    """The ``(n_query, n_ref)`` count matrices of a pair or triplet tuple."""
    a1, p, a2, n = as_pairs(indices_tuple)
    shape = (n_query, n_ref)
    return PairSelection(pair_counts(a1, p, shape, dtype), pair_counts(a2, n, shape, dtype))


TRIPLET_SETS = ("all", "semihard", "hard")


def in_triplet_set(d_ap: torch.Tensor, d_an: torch.Tensor, margin: float, triplets: str) -> torch.Tensor:
    """Which triplets belong to the set ``triplets``: ``"all"`` every one, ``"semihard"``
    ``d_ap < d_an ≤ d_ap + margin``, ``"hard"`` ``d_an ≤ d_ap`` (PML's ``TripletMarginMiner`` types)."""
    if triplets == "semihard":
        return (d_ap < d_an) & (d_an <= d_ap + margin)
    if triplets == "hard":
        return d_an <= d_ap
    return torch.ones_like(d_ap, dtype=torch.bool)

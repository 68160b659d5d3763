"""MAX pooling's Caffe choice (the mask, the backward's routing) on the CPU, in NumPy.

The same scan as :func:`caffe_compat.layers.pooling.max_pool_winners` (module docstring there: the first
element in scan order equal to the window's maximum ``m`` over its non-NaN elements, none where
``m <= -FLT_MAX``), written for the CPU's strengths, with the same int64 result bit for bit:

* one NHWC copy of the bottom, padded with -inf (the channels then lie contiguous under every window
  offset): with no column of padding, one ``cv2.transpose`` of each sample's ``C x H·W`` plane; with
  some, of each row (``C x W``) when a row holds at least :data:`ROW_TRANSPOSE_MIN` values, else NumPy's
  strided copy (per-row calls cost ~3 µs each: the digits net's 64 x 16 x 32 x 32 bottom took 2.6 ms
  row by row, 0.6 ms by sample);
* NaN is left in the copy: it never wins ``>`` and the running maxima are ``fmax``, which ignores it;
* Caffe's loop run separably (:func:`_scan`): per row of the copy, each window's first maximum over its
  columns, then per window the first row whose maximum is strictly greater than those above, which is
  the first maximum in row-major scan order; the comparisons through NumPy (PyTorch's CPU comparison
  into ``bool`` does not vectorise: ~1.2 ns an element here, NumPy's ~0.4 ns on the strided views);
* each window's *slot*, 1 + its winner's offset (0: nothing above -FLT_MAX), goes back to NCHW as uint8 (a
  quarter of an int64 transpose), then one table lookup (OpenCV's ``LUT``, into int32) gives ``dh·W + dw``
  of the offset, plus the window's corner; slot 0 looks up a large negative value, clipped to -1;
* the backward adds each top diff to its element in the outputs' order (``scatter_add_``); an output that
  selected nothing adds +0.0 (its diff's bits ANDed away, :func:`_keep_bits`).

GoogLeNet's pooling bottoms at batch 8: 1.8-2.2x faster than the PyTorch form (e.g. ``pool2``, one
192 x 56 x 56 sample: 4.3 → 2.2 ms).  The separable scan and the table lookup made a training pass
(forward + backward, batch 8, one thread) of GoogLeNet's stride-1 inception poolings 1.23-1.36x faster than
comparing all nine offsets per window, its stride-2 poolings 1.02-1.04x.  Used for float32 and float64
CPU tensors in eager mode (:func:`applies`); the PyTorch form serves the rest (CUDA, other dtypes, compile,
tracing, export).

Windows that tile the bottom (stride = kernel, no padding, no partial window: the 2 x 2 / 2 poolings of
VGG-style nets and of the digits net) take a shorter road in training (:func:`tiles`): one copy puts
each window offset in a contiguous row (:func:`_offset_planes`), and Caffe's loop runs over those rows
as written, ``if (bottom > top)`` from -FLT_MAX, with the top's sign of a zero maximum taken from the
winner itself (:func:`_tiled_scan`); every element belongs to one window, so the backward is a masked
copy of ``0 + top_diff`` per offset into that offset's elements, no index at all
(:func:`_tiled_bottom_diff`).
``benchmarks/bench_pooling.py``: the digits net's poolings train 1.3-1.6x faster than through the general
scan (``pool1``, 64 x 16 x 32 x 32: 4.85 → 3.00 ms forward + backward).
"""

from __future__ import annotations

import cv2
import numpy as np
import torch

from caffe_compat.layers.cache_blocking import samples_per_block, writes_into_views
from caffe_compat.layers.layout import is_channels_last, to_channels_last, to_contiguous

#: Values per row (``C·W``) from which a padded bottom is transposed row by row by OpenCV rather than copied by
#: NumPy (measured: NumPy's strided copy is faster below ~8,000, OpenCV's per-row calls above).
ROW_TRANSPOSE_MIN = 8192
#: Below any flat index plus any window corner: slot 0 (nothing selected) lands below -1, then clips to -1
#: (the int32 one for OpenCV's lookup table: planes of fewer than 2^30 elements).
_NONE_SELECTED = -(1 << 40)
_NONE_SELECTED_32 = -(1 << 30)


def applies(x: torch.Tensor) -> bool:
    """True for a float32/float64 4-axis CPU tensor in eager mode (see the module docstring)."""
    return (x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and x.dim() == 4
            and x.numel() > 0 and writes_into_views(x))


def _padded_nhwc(x: np.ndarray, pad, ends) -> np.ndarray:
    """``(N, H + pads, W + pads, C)`` copy of the NCHW ``x``, -inf around it."""
    n, c, height, width = x.shape
    out = np.empty((n, pad[0] + height + ends[0], pad[1] + width + ends[1], c), dtype=x.dtype)
    out[:, :pad[0]] = -np.inf
    out[:, pad[0] + height:] = -np.inf
    out[:, :, :pad[1]] = -np.inf
    out[:, :, pad[1] + width:] = -np.inf
    inner = out[:, pad[0]:pad[0] + height, pad[1]:pad[1] + width]
    if x.flags.c_contiguous and not pad[1] and not ends[1]:  # a sample's rows are contiguous in ``out`` too
        for i in range(n):
            rows = out[i, pad[0]:pad[0] + height].reshape(height * width, c)  # a view: whole rows of ``out``
            cv2.transpose(x[i].reshape(c, height * width), dst=rows)
    elif x.flags.c_contiguous and width * c >= ROW_TRANSPOSE_MIN:
        for i in range(n):
            for h in range(height):
                cv2.transpose(x[i, :, h, :], dst=inner[i, h])
    else:  # short rows, already NHWC (channels_last), or any other strides: NumPy's copy
        np.copyto(inner, x.transpose(0, 2, 3, 1))
    return out


def _bits(dtype: np.dtype):
    """The integer type of ``dtype``'s width (a float's bits; -0.0 is its minimum)."""
    return np.int32 if np.dtype(dtype).itemsize == 4 else np.int64


def _keep_bits(bits: np.ndarray, keep: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``bits`` (a float array's integer view) where ``keep``, else 0, the bits of +0.0: an AND with all ones or
    none (``np.where`` takes ~5x as long)."""
    ones = np.negative(keep.view(np.int8)).astype(bits.dtype)  # True (1) -> -1: every bit
    return np.bitwise_and(bits, ones, out=out)


def _first_maxima(candidates, start: float, signed_zeros: bool, firsts=None, step: int = 1, dtype=np.uint8):
    """Caffe's ``if (candidate > best) { best = candidate; mask = index; }`` over ``candidates`` (arrays of one
    shape, in scan order) from ``best = start``: ``(best, slot)``, ``slot`` the winner's index + 1, 0 where
    nothing is above ``start`` (NaN never wins, a tie keeps the earlier).  ``firsts``: per candidate the slot
    of its own winner within it (the second stage of a separable scan), the slot is then
    ``k·step + firsts[k]``.  A later winner's slot is larger, so ``slot`` is the running maximum of
    ``slot·won``; ``best`` is the running ``fmax`` (NaN ignored): the winner's value, though for a zero
    maximum its sign is NumPy's choice, so with ``signed_zeros`` (the candidates may hold a -0.0) a zero
    maximum is copied from its winner, candidate ``(slot − 1) // step``."""
    best = np.full(candidates[0].shape, start, candidates[0].dtype)
    slot = np.zeros(best.shape, dtype)
    won, term = np.empty(best.shape, bool), np.empty(best.shape, dtype)
    for k, candidate in enumerate(candidates):
        np.greater(candidate, best, out=won)
        np.fmax(best, candidate, out=best)
        if firsts is None:
            np.multiply(won, dtype(k + 1), out=term)
        else:
            np.add(firsts[k], dtype(k * step), out=term)
            np.multiply(term, won, out=term)
        np.maximum(slot, term, out=slot)
    if signed_zeros:
        zero, winner = best == 0, (slot.astype(np.intp) - 1) // step
        for k, candidate in enumerate(candidates):
            np.copyto(best, candidate, where=zero & (winner == k))
    return best, slot


def _holds_negative_zero(values: np.ndarray) -> bool:
    """Whether a float array holds a -0.0: its bit pattern is the least integer of the float's width."""
    ints = _bits(values.dtype)
    return values.view(ints).min() == np.iinfo(ints).min


def _scan(x: torch.Tensor, kernel, stride, pad, out, ends, max_start: float, nhwc: bool = False):
    """``(top, slot)``: the windows' Caffe maxima (``max_start`` where nothing is above it), NHWC ``(N, out_h,
    out_w, C)``; per output 1 + the offset of its winner in scan order (0: none), NCHW ``(N, C,
    out_h·out_w)`` uint8 (int32 above 255 offsets), or with ``nhwc`` as the scan leaves it, ``(N, out_h·out_w, C)``.

    Separable, as the scan order is row-major: per row of the padded copy, each window's first maximum
    over its ``k_w`` columns (value and column); then per window the first of its ``k_h`` rows whose
    maximum is strictly greater than the rows' above.  For stride 1 every row's maxima serve ``k_h``
    windows (3 x 3: 3 + 3 comparisons a window instead of 9).  Where the bottom holds a -0.0, a zero
    maximum takes its winner's own bits."""
    n, c = x.shape[:2]
    padded = _padded_nhwc(x.detach().numpy(), pad, ends)
    (kh, kw), (sh, sw), (oh, ow) = kernel, stride, out
    dtype = np.uint8 if kh * kw <= 255 else np.int32
    signed = _holds_negative_zero(padded)
    columns = [padded[:, :, dw:dw + (ow - 1) * sw + 1:sw] for dw in range(kw)]      # (N, H', out_w, C)
    row_top, row_slot = _first_maxima(columns, max_start, signed, dtype=dtype)
    rows = [slice(dh, dh + (oh - 1) * sh + 1, sh) for dh in range(kh)]
    top, slot = _first_maxima([row_top[:, r] for r in rows], max_start, signed, [row_slot[:, r] for r in rows], kw,
                              dtype)
    if nhwc:
        return top, slot.reshape(n, oh * ow, c)
    slot_nchw = np.empty((n, c, oh * ow), dtype)
    for i in range(n):
        cv2.transpose(slot[i].reshape(oh * ow, c), dst=slot_nchw[i])
    return top, slot_nchw


def tiles(kernel, stride, pad, out, size) -> bool:
    """Whether the windows tile a ``size`` (H, W) bottom: stride = kernel, no padding and ``out · kernel = size``
    on both axes (no partial window from Caffe's rounding up), so each element lies in exactly one window."""
    return (tuple(stride) == tuple(kernel) and not any(pad) and kernel[0] * kernel[1] <= 255
            and all(o * k == s for o, k, s in zip(out, kernel, size)))


def _offset_planes(x: torch.Tensor, kernel, out) -> np.ndarray:
    """``(k_h·k_w, N·C·out_h·out_w)`` copy of the tiled NCHW ``x``: row ``k`` holds every window's element at
    offset ``k`` (row-major in the window), the windows in the top's NCHW order."""
    windows = x.detach().reshape(-1, kernel[0], out[1], kernel[1]).permute(1, 3, 0, 2)
    return windows.contiguous().view(kernel[0] * kernel[1], -1).numpy()


def _tiled_scan(x: torch.Tensor, kernel, out, max_start: float, top: np.ndarray) -> np.ndarray:
    """Caffe's MAX forward over tiling windows: writes the top (the flat NCHW ``top``) and returns each window's
    slot, 1 + the winner's offset (0: nothing above -FLT_MAX), uint8 ``(N, C, out_h·out_w)``: Caffe's loop
    over the offset rows (:func:`_first_maxima`); where the bottom holds a -0.0, a zero maximum takes its
    winner's own bits."""
    planes = _offset_planes(x, kernel, out)
    best, slot = _first_maxima(planes, max_start, _holds_negative_zero(planes))
    top[:] = best
    return slot.reshape(x.shape[0], x.shape[1], -1)


def _tiled_bottom_diff(top_diff: np.ndarray, slot: np.ndarray, kernel, out, grad: torch.Tensor) -> None:
    """Caffe's MAX backward over tiling windows into ``grad`` ``(n, C, H·W)``: Caffe zeroes the bottom diff and
    adds each top diff to its winner, so a winner gets ``0 + top_diff`` (-0 becomes +0, NaN stays) and every
    other element +0.  Per offset, the bits of ``0 + top_diff`` are kept where the slot names it (an AND with
    all ones or zero), written straight into that offset's elements of ``grad``."""
    ints = _bits(top_diff.dtype)
    rows = (-1, out[1])
    diff = (top_diff.reshape(-1) + top_diff.dtype.type(0)).view(ints).reshape(rows)
    won = np.empty(diff.shape, bool)
    slots = slot.reshape(rows)
    windows = grad.numpy().view(ints).reshape(-1, kernel[0], out[1], kernel[1])
    for k in range(kernel[0] * kernel[1]):
        np.equal(slots, k + 1, out=won)
        _keep_bits(diff, won, out=windows[:, k // kernel[1], :, k % kernel[1]])


def _flat_index(slot: np.ndarray, kernel, stride, pad, out, width: int, none: int = -1, nhwc: bool = False
                ) -> np.ndarray:
    """The int64 ``h·W + w`` of each slot's element (1 + the winner's offset), ``none`` for slot 0,
    ``(N, C, out_h·out_w)`` (``nhwc``: ``(N, out_h·out_w, C)``): a table lookup (``dh·W + dw`` of the offset)
    plus the window's corner."""
    count = kernel[0] * kernel[1]
    offset = np.arange(-1, count)                                          # the offset each slot stands for
    table = (offset // kernel[1]) * width + offset % kernel[1]
    corner = (np.arange(out[0])[:, None] * stride[0] - pad[0]) * width + np.arange(out[1]) * stride[1] - pad[1]
    corner = corner.reshape(-1, 1) if nhwc else corner.reshape(-1)  # along the outputs' axis
    if slot.dtype == np.uint8 and slot.size:  # OpenCV's table lookup into int32 (~8x NumPy's fancy indexing)
        table[0] = _NONE_SELECTED_32
        offsets = cv2.LUT(slot.reshape(-1, slot.shape[-1]), np.pad(table, (0, 255 - count)).astype(np.int32))
        flat = np.add(offsets.reshape(slot.shape), corner, dtype=np.int64)
    else:
        table[0] = _NONE_SELECTED
        flat = table[slot]  # fancy indexing: np.take converts a uint8 index to intp first, ~6x slower
        flat += corner
    return np.maximum(flat, none, out=flat)


def _bottom_diff(top_diff: np.ndarray, slot: np.ndarray, kernel, stride, pad, out, width: int, grad: torch.Tensor,
                 nhwc: bool = False):
    """Caffe's MAX pooling backward for a block into ``grad`` ``(n, C, H·W)``: each top diff added to the element
    its slot names, in the order of the outputs (``scatter_add_``, as ``max_pool_bottom_diff``).  An output
    that selected nothing adds +0 to element 0 instead (a sum that starts at +0 is never -0: no bit changes).
    ``nhwc``: the slot, the top diff and ``grad`` are ``(n, out_h·out_w, C)``, ``(n, out_h, out_w, C)`` and
    ``(n, H·W, C)`` (a channel's diffs are added in the same order: the same bits)."""
    index = _flat_index(slot, kernel, stride, pad, out, width, none=0, nhwc=nhwc)
    source = _keep_bits(top_diff.reshape(slot.shape).view(_bits(top_diff.dtype)), slot != 0).view(top_diff.dtype)
    grad.zero_().scatter_add_(1 if nhwc else 2, torch.from_numpy(index), torch.from_numpy(source))


def winners(x: torch.Tensor, kernel, stride, pad, out, ends, max_start: float) -> torch.Tensor:
    """``max_pool_winners(x, kernel, stride, pad, out)`` (int64, ``(N, C, out_h, out_w)``); ``ends``: the
    padding after each axis that puts every window inside, ``max_start``: Caffe's -FLT_MAX."""
    flat = _flat_index(_scan(x, kernel, stride, pad, out, ends, max_start)[1], kernel, stride, pad, out, x.shape[3])
    return torch.from_numpy(flat).view(*x.shape[:2], out[0], out[1])


class MaxPoolRouted(torch.autograd.Function):
    """Training-time MAX pooling on the CPU that keeps Caffe's choice from the forward, as Caffe keeps its mask:
    the forward's scan keeps each window's slot, and the backward only looks the slots up and adds each top
    diff to its element (:func:`_bottom_diff`, :func:`_tiled_bottom_diff`); the bottom itself is not kept.
    The top is Caffe's (``pooling.caffe_maxima``): the maxima of the window's non-NaN elements, at least
    -FLT_MAX.  Both passes run in blocks of samples (:mod:`~caffe_compat.layers.cache_blocking`).

    A ``channels_last`` bottom gives an NHWC top and bottom diff (the layout of the convolutions around it):
    the general scan's NHWC maxima go straight into the top, its slots stay NHWC and the backward adds
    along the NHWC rows, with no transpose either way (the same additions per channel, in the same order:
    the same bits); the tiling road converts its NCHW results (:mod:`~caffe_compat.layers.layout`)."""

    @staticmethod
    def forward(ctx, x, geometry):
        kernel, stride, pad, out, ends, max_start = geometry
        block = samples_per_block(x)
        tiled = tiles(kernel, stride, pad, out, x.shape[2:])
        nhwc = is_channels_last(x) and not tiled  # the scan's maxima are NHWC already: no transpose
        top = torch.empty((x.shape[0], x.shape[1], out[0], out[1]), dtype=x.dtype,
                          memory_format=torch.channels_last if nhwc else torch.contiguous_format)
        slots = []
        for i in range(0, x.shape[0], block):
            if tiled:
                slots.append(_tiled_scan(x[i:i + block], kernel, out, max_start, top[i:i + block].view(-1).numpy()))
                continue
            best, slot = _scan(x[i:i + block], kernel, stride, pad, out, ends, max_start, nhwc)
            if nhwc:
                np.copyto(top[i:i + block].permute(0, 2, 3, 1).numpy(), best)
            else:
                rows = top[i:i + block].view(len(best), x.shape[1], -1).numpy()
                for j in range(len(best)):
                    cv2.transpose(best[j].reshape(out[0] * out[1], -1), dst=rows[j])
            slots.append(slot)
        ctx.slot = slots[0] if len(slots) == 1 else np.concatenate(slots)
        ctx.geometry, ctx.size, ctx.block, ctx.tiled = geometry[:4], tuple(x.shape[2:]), block, tiled
        ctx.channels_last, ctx.nhwc = is_channels_last(x), nhwc
        return to_channels_last(top) if ctx.channels_last and not nhwc else top

    @staticmethod
    def backward(ctx, top_diff):
        slot, block, (height, width) = ctx.slot, ctx.block, ctx.size
        kernel, out = ctx.geometry[0], ctx.geometry[3]
        if torch.is_grad_enabled():  # create_graph: the diff must stay differentiable in top_diff (PyTorch's form)
            from caffe_compat.layers.pooling import max_pool_bottom_diff  # (pooling imports this module)

            nchw_slot = np.ascontiguousarray(slot.transpose(0, 2, 1)) if ctx.nhwc else slot
            winner = torch.from_numpy(_flat_index(nchw_slot, *ctx.geometry, width))
            return max_pool_bottom_diff(top_diff, winner.view(*nchw_slot.shape[:2], *out), ctx.size), None
        if ctx.nhwc:  # NHWC throughout: the top diff read and the bottom diff written in the net's layout
            diff = to_channels_last(top_diff.detach()).permute(0, 2, 3, 1).numpy()
            grad = torch.empty((len(slot), slot.shape[2], height, width), dtype=top_diff.dtype,
                               memory_format=torch.channels_last)
            rows = grad.permute(0, 2, 3, 1).view(len(slot), height * width, -1)
            for i in range(0, len(slot), block):
                _bottom_diff(diff[i:i + block], slot[i:i + block], *ctx.geometry, width, rows[i:i + block], nhwc=True)
            return grad, None
        diff = to_contiguous(top_diff.detach()).numpy()
        grad = top_diff.new_empty((slot.shape[0], slot.shape[1], height * width))
        for i in range(0, len(slot), block):
            if ctx.tiled:
                _tiled_bottom_diff(diff[i:i + block], slot[i:i + block], kernel, out, grad[i:i + block])
            else:
                _bottom_diff(diff[i:i + block], slot[i:i + block], *ctx.geometry, width, grad[i:i + block])
        grad = grad.view(len(slot), slot.shape[1], height, width)
        return (to_channels_last(grad) if ctx.channels_last else grad), None

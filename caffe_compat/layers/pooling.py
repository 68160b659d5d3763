"""Pooling layers: Pooling (MAX/AVE) and SPP, with Caffe's output sizes, divisors and tie rule.

* **Pooling** MAX/AVE with Caffe's output size ``ceil((in + 2p − k)/s) + 1``, minus one when padded and
  ``(out − 1)·s >= in + p`` (``round_mode: FLOOR`` uses floor).  Quirks reproduced:
  - "padded" is Caffe's ``pad_h_ || pad_w_``: when either pad is nonzero the clip is tested on both
    axes, also on one whose own pad is 0 (11×11, kernel 2, stride 4, ``pad_h: 1 pad_w: 0`` → 3×3, not
    3×4; see :func:`caffe_compat.layers.geometry.pooled_hw`);
  - MAX never selects padding; a window lying wholly past the end (possible without padding, when
    ceil rounding starts the last window at ``in``) gives Caffe's −FLT_MAX and mask −1, and
    the AVE of such a window Caffe's 0/0 = NaN;
  - AVE divides by the window clipped to ``[−p, in + p)``: padding counts, the overhang past ``in + p``
    does not; with ``p = 0`` a partial last window divides by its in-range size;
  - two implementations with the same values: when PyTorch's own ceil/floor-mode output size equals
    Caffe's and ``p ≤ k/2``, eager mode calls ``max_pool2d``/``avg_pool2d`` with ``padding``/``ceil_mode``
    directly (PyTorch's clipped divisor is Caffe's; NCHW MAX pooling runs on a ``channels_last`` copy,
    ~5× faster on CPU); otherwise, and always under ONNX export, the explicit form: the input padded
    (−inf for MAX, zeros for AVE, also on the right for the ceil overhang), plain pooling with no
    padding and no ceil_mode, AVE times ``k_h·k_w / divisor`` from a constant divisor map (exports as
    Pad + MaxPool/AveragePool + Mul, which ONNX Runtime computes exactly);
  - ``global_pooling`` pools the whole plane (pad 0, stride 1 required, as in Caffe);
  - STOCHASTIC builds (LayerSetUp accepts it, without padding) and its forward raises a FormatError: Caffe's CPU
    ``Forward_cpu`` is ``NOT_IMPLEMENTED`` there, so a net with it loads (for net surgery, say) but cannot run;
  - a second top on MAX pooling is Caffe's mask: the flat index ``h·W + w`` of the maximum, as float;
  - MAX ties: Caffe scans each window row by row and takes an element only when it is strictly greater
    than the maximum so far (from −FLT_MAX), so among equal maxima the **first** in scan order wins, in
    every window it lies in (overlapping windows included).  The mask top and the gradient (which goes to
    that element only, accumulated over the windows that chose it) come from that explicit scan
    (:func:`max_pool_winners`), never from ``max_pool2d``'s indices, so they do not rest on torch's
    tie-breaking.  The top values are Caffe's too (:func:`caffe_maxima`): NaN is never taken, and a window
    with nothing above -FLT_MAX gives -FLT_MAX (PyTorch's ``max_pool2d`` passes NaN on and gives -inf there;
    an ONNX export keeps that).  On the CPU in eager mode
    the scan runs in NumPy (:mod:`caffe_compat.layers.pooling_numpy`), and in training the forward makes the
    choice and keeps it, as Caffe keeps its mask (``MaxPoolRouted``); both give the same bits as the PyTorch
    form, which serves CUDA, compile, tracing and export.
* **SPP** (spatial pyramid pooling): Caffe's own Pooling at ``2^i`` bins per axis for each pyramid level,
  flattened and concatenated (see :class:`SPP`).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from caffe_compat.errors import FormatError, MemoryBudgetError, ShapeMismatchError
from caffe_compat.io.safe_open import memory_budget
from caffe_compat.layers.cache_blocking import blocking_applies, in_blocks, layout_of
from caffe_compat.layers.layout import to_channels_last, to_contiguous
from caffe_compat.layers import pooling_numpy
from caffe_compat.layers.caffe_backward import caffe_backward_applies, with_caffe_backward
from caffe_compat.layers.facts import ONE, BlobCount, Shapes
from caffe_compat.layers.geometry import need_axes, pool_geometry, pooled_hw
from caffe_compat.layers.registry import CaffeLayer, register_layer


# ---------------------------------------------------------------------------- pooling


def ave_pool_divisor(size: int, out: int, kernel: int, stride: int, pad: int) -> list[int]:
    """Caffe's AVE divisor per output position along one axis: the window clipped to ``[−pad, size + pad)``."""
    return [min(i * stride - pad + kernel, size + pad) - (i * stride - pad) for i in range(out)]


# Caffe's initial maximum, -FLT_MAX (for double blobs too): only a strictly greater value is ever selected.
_CAFFE_MAX_START = -torch.finfo(torch.float32).max


def _max_start(dtype: torch.dtype) -> float:
    """-FLT_MAX, or the lowest finite value of a narrower type (bf16 and fp16 under autocast cannot hold
    -FLT_MAX; their lowest finite value plays its part: only padding's -inf stays below it)."""
    return max(_CAFFE_MAX_START, -torch.finfo(dtype).max)


def _window_slices(offset_h: int, offset_w: int, stride, out) -> tuple:
    """Index of the (N, C, out_h, out_w) elements at window offset ``(offset_h, offset_w)`` of a padded plane."""
    return (slice(None), slice(None), slice(offset_h, offset_h + (out[0] - 1) * stride[0] + 1, stride[0]),
            slice(offset_w, offset_w + (out[1] - 1) * stride[1] + 1, stride[1]))


def _padded_extent(size: int, out: int, kernel: int, stride: int, pad: int) -> int:
    """Padding after the end of one axis so that every window ``[i·stride − pad, … + kernel)`` lies inside."""
    return max(0, (out - 1) * stride + kernel - pad - size)


def max_pool_winners(x: torch.Tensor, kernel, stride, pad, out) -> torch.Tensor:
    """Caffe's MAX pooling choice for every output (N, C, out_h, out_w): the flat index ``h·W + w`` of the
    selected bottom element (int64), or -1 where nothing is selected; this is Caffe's mask.

    Caffe's scan: the window clipped to the image, row by row, keeping an element only when it is strictly
    greater than the maximum so far, which starts at -FLT_MAX.  So among equal maxima the first in scan
    order wins, padding and NaN are never selected, and a window with nothing above -FLT_MAX selects
    nothing.  Equivalently, and so computed: the window's maximum ``m`` over its non-NaN elements (NaN read
    as -inf, padding -inf; one ``max_pool2d``, whose *values* are unambiguous), then the first offset in
    scan order whose element equals ``m``, selected when ``m`` > -FLT_MAX.  The first match is kept as the
    running maximum of ``(k_h·k_w − offset)·match`` in uint8, one comparison and one cheap maximum per
    offset (a masked write per offset cost 3× as much), with no data-dependent branch (compiles whole)."""
    height, width = int(x.shape[2]), int(x.shape[3])
    if (height, width) == tuple(kernel) and tuple(out) == (1, 1) and not any(pad):
        return _plane_winner(x)
    ends = [_padded_extent(*a) for a in zip((height, width), out, kernel, stride, pad)]
    if pooling_numpy.applies(x):  # the same scan, ~2x faster on the CPU (see that module)
        return pooling_numpy.winners(x, kernel, stride, pad, out, ends, _max_start(x.dtype))
    pads = (pad[1], ends[1], pad[0], ends[0])
    clean = torch.nan_to_num(x, nan=-math.inf, posinf=math.inf, neginf=-math.inf)  # NaN is never selected
    layout = torch.contiguous_format
    if clean.device.type == "cpu":  # NHWC max pooling is ~5x faster on CPU; every pass below runs in it
        layout = torch.channels_last
        clean = to_channels_last(clean)
    padded = F.pad(clean, pads, value=-math.inf) if any(pads) else clean
    best = F.max_pool2d(padded, kernel, stride)[:, :, :out[0], :out[1]].contiguous(memory_format=layout)
    n = kernel[0] * kernel[1]
    code_dtype = torch.uint8 if n <= 255 else torch.int32
    code = torch.zeros_like(best, dtype=code_dtype)  # k_h·k_w − the first matching offset; 0 where none
    for k in range(n):
        dh, dw = divmod(k, kernel[1])
        match = padded[_window_slices(dh, dw, stride, out)] == best
        code = torch.maximum(code, (match.view(torch.uint8) if n <= 255 else match.to(code_dtype)).mul(n - k))
    code.mul_((best > _max_start(best.dtype)).to(code_dtype))  # nothing above -FLT_MAX: nothing selected
    # the flat index h·W + w: the window's corner plus the first match's offset (dh·W + dw, dh = first // k_w)
    code = to_contiguous(code).long()
    first = n - code
    corner = ((torch.arange(out[0], device=x.device)[:, None] * stride[0] - pad[0]) * width
              + torch.arange(out[1], device=x.device) * stride[1] - pad[1])
    flat = torch.div(first, kernel[1], rounding_mode="floor").mul_(width - kernel[1]).add_(first).add_(corner)
    return flat.masked_fill_(code == 0, -1)  # dh·W + (first − dh·k_w) + the corner; -1: nothing selected


def caffe_maxima(pool: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """Caffe's MAX pooling values from ``pool``, a max pooling that passes NaN on (PyTorch's, an ONNX MaxPool).

    Caffe's top starts at -FLT_MAX and takes an element only when it is strictly greater, so NaN is never
    taken and a window of nothing above -FLT_MAX (NaN, -inf, -FLT_MAX, padding) gives -FLT_MAX:
    ``top = max(-FLT_MAX, maximum of the window's non-NaN elements)``.  In eager mode on the CPU ``pool``'s
    top is kept when its sum is finite (then it holds no NaN and no -inf: the usual case costs one sum of
    the top), else pooled again; on other devices, under compile and under tracing the bottom is pooled once
    with NaN read as -inf (no host synchronisation), and the top raised to -FLT_MAX.  An ONNX export keeps
    ``pool``'s values (an exported MaxPool passes NaN on)."""

    def caffe_pool(t: torch.Tensor) -> torch.Tensor:
        if torch.onnx.is_in_onnx_export() or not t.is_floating_point():
            return pool(t)
        if t.device.type == "cpu" and not torch.jit.is_tracing() and not torch.compiler.is_compiling():
            top = pool(t)
            if bool(torch.isfinite(top.sum())):
                return top
        clean = torch.nan_to_num(t, nan=-math.inf, posinf=math.inf, neginf=-math.inf)
        return pool(clean).clamp_min(_max_start(t.dtype))

    return caffe_pool


def _plane_winner(x: torch.Tensor) -> torch.Tensor:
    """:func:`max_pool_winners` for one window covering each whole plane (global pooling), vectorised: the
    first position of the plane's maximum (NaN ignored), -1 when that maximum is not above -FLT_MAX."""
    flat = x.flatten(2)
    clean = torch.where(flat.isnan(), -math.inf, flat)
    top = clean.amax(dim=2, keepdim=True)
    position = torch.arange(flat.shape[2], device=x.device)
    first = torch.where(clean == top, position, flat.shape[2]).amin(dim=2, keepdim=True)
    return torch.where(top > _max_start(top.dtype), first, -1).unsqueeze(-1)


def max_pool_bottom_diff(top_diff: torch.Tensor, winner: torch.Tensor, size) -> torch.Tensor:
    """Caffe's MAX pooling backward: each top diff is added to the bottom element its window selected
    (``winner`` from :func:`max_pool_winners`), none where nothing was; ``size`` is the bottom's (H, W)."""
    n, c = top_diff.shape[0], top_diff.shape[1]
    picked = winner >= 0
    grad = top_diff.new_zeros(n, c, size[0] * size[1])
    grad.scatter_add_(2, torch.where(picked, winner, 0).flatten(2), torch.where(picked, top_diff, 0.0).flatten(2))
    return grad.view(n, c, size[0], size[1])


@register_layer("Pooling")
class Pooling(CaffeLayer):
    """Caffe Pooling, MAX and AVE (see module docstring for the output size and divisor quirks)."""

    MAX, AVE, STOCHASTIC = 0, 1, 2
    bottoms = ONE
    tops = BlobCount(1, 2)  # MAX may add the mask top; AVE has one (checked in __init__)
    in_caffe_1_0 = True

    @classmethod
    def infer(cls, layer, bottoms):
        """``(N, C, H', W')`` with Caffe's pooled size (:func:`~caffe_compat.layers.geometry.pooled_hw`), for
        every top (MAX's mask has the top's shape); global pooling gives ``(N, C, 1, 1)``.  A pooled size of
        0 (e.g. input 1, kernel 3, stride 2) is Caffe's empty top; a negative one fails its Blob::Reshape
        CHECK (a FormatError)."""
        need_axes(layer, bottoms, 4, what=" (N, C, H, W), as Caffe's PoolingLayer requires")
        n, c, h, w = bottoms[0]
        g = pool_geometry(layer, (h, w))
        out = (1, 1) if g.global_pooling else pooled_hw((h, w), g.kernel, g.stride, g.pad, g.ceil_mode)
        if min(out) < 0:  # Caffe's Blob::Reshape CHECK_GE(dim, 0) on the top's dims
            raise FormatError(f"layer '{layer.name}' (Pooling): kernel {g.kernel} with pad {g.pad} does not fit the "
                              f"{h}x{w} input (pooled size {out[0]}x{out[1]})")
        return Shapes([(n, c, *out)] * max(1, len(layer.top)))

    def __init__(self, param, bottom_shapes, phase="test"):
        super().__init__(param, bottom_shapes, phase)
        p = param.pooling_param
        shape = self.bottom_shapes[0]
        if len(shape) != 4:
            raise FormatError(f"layer '{self.layer_name}' (Pooling): the input must have 4 axes, got shape {shape}")
        if p.pool not in (self.MAX, self.AVE, self.STOCHASTIC):
            raise FormatError(f"layer '{self.layer_name}': unknown pooling method {p.pool}")
        self.method = int(p.pool)
        self.global_pooling = bool(p.global_pooling)
        geometry = pool_geometry(param, shape[2:])
        if min(geometry.kernel) < 1 or min(geometry.stride) < 1:
            raise FormatError(f"layer '{self.layer_name}': kernel and stride must be positive")
        self.kernel, self.stride, self.pad = geometry.kernel, geometry.stride, geometry.pad
        self.ceil_mode = geometry.ceil_mode
        if not self.global_pooling:
            self._check_overhang(shape)
        if len(param.top) > (2 if self.method == self.MAX else 1):
            raise FormatError(f"layer '{self.layer_name}': {('MAX', 'AVE', 'STOCHASTIC')[self.method]} pooling "
                              f"has at most {2 if self.method == self.MAX else 1} tops, got {len(param.top)}")
        self.num_tops = max(1, len(param.top))

    def _check_overhang(self, shape) -> None:
        """MemoryBudgetError before the forward pads the input so that Caffe's last windows, starting past its
        end, lie inside it (:meth:`_explicit_pool`): a stride of 10^6 on an 8 x 8 input asked for 52 TB."""
        out = pooled_hw(shape[2:], self.kernel, self.stride, self.pad, self.ceil_mode)
        extent = [size + p + _padded_extent(size, o, k, s, p)
                  for size, o, k, s, p in zip(shape[2:], out, self.kernel, self.stride, self.pad)]
        needed = 4 * shape[0] * shape[1] * extent[0] * extent[1]
        if needed > 16 * 4 * math.prod(shape) + (64 << 20) and needed > memory_budget(fraction=1.0):
            raise MemoryBudgetError(f"layer '{self.layer_name}' (Pooling): kernel {self.kernel}, stride "
                                    f"{self.stride} and pad {self.pad} on the {shape[2]}x{shape[3]} input need it "
                                    f"padded to {extent[0]}x{extent[1]} ({needed / 2 ** 30:.3g} GiB), more than the "
                                    f"memory available; set CAFFE_COMPAT_MEMORY_BUDGET to allow more")

    def geometry_for(self, height: int, width: int):
        """(kernel, stride, pad, out) for an input plane of ``height × width``."""
        if self.global_pooling:
            return (height, width), (1, 1), (0, 0), (1, 1)
        out = pooled_hw((height, width), self.kernel, self.stride, self.pad, self.ceil_mode)
        return self.kernel, self.stride, self.pad, out

    def forward(self, x):
        if self.method == self.STOCHASTIC:
            raise FormatError(f"layer '{self.layer_name}': STOCHASTIC pooling cannot run: Caffe's CPU forward is "
                              f"NOT_IMPLEMENTED (the layer builds, as in Caffe)")
        if x.dim() != 4:
            raise ShapeMismatchError(f"layer '{self.layer_name}': pooling needs a 4-D input, got {tuple(x.shape)}")
        height, width = int(x.shape[2]), int(x.shape[3])
        kernel, stride, pad, out = self.geometry_for(height, width)
        if not (x.shape[1] and out[0] and out[1]):  # no channel or a pooled size 0: Caffe's loops run zero times,
            top = x.flatten()[:0].reshape(x.shape[0], x.shape[1], *out)  # an empty top (torch's pooling refuses)
            return (top,) if self.num_tops == 1 else (top, top.detach())
        exporting = torch.onnx.is_in_onnx_export()
        torch_form = not exporting and self._torch_matches(height, width, kernel, stride, pad, out)
        if exporting and self.method == self.MAX and self._onnx_max_pool_matches(height, width, kernel, stride, pad, out):
            def pool(t):  # an ONNX MaxPool with pads and ceil_mode: no Pad/Slice around it (see the method)
                return F.max_pool2d(t, kernel, stride, pad, ceil_mode=self.ceil_mode)
        elif torch_form:
            def pool(t):
                return self._torch_pool(t, kernel, stride, pad)[0]
        else:
            def pool(t):
                return self._explicit_pool(t, kernel, stride, pad, out)[0]
        if self.method == self.AVE:
            return (pool(x),)
        pool = caffe_maxima(pool)
        if torch_form and caffe_backward_applies(x) and pooling_numpy.applies(x.detach()) and not self.global_pooling:
            # training on the CPU: Caffe's choice made in the forward, from the copy the pooling makes anyway
            ends = [_padded_extent(*a) for a in zip((height, width), out, kernel, stride, pad)]
            geometry = (kernel, stride, pad, out, ends, _max_start(x.dtype))
            top = pooling_numpy.MaxPoolRouted.apply(x, geometry)
            if self.num_tops == 1:
                return (top,)
            return top, max_pool_winners(x.detach(), kernel, stride, pad, out).to(x.dtype)

        def diff(bottom, top_diff):
            return max_pool_bottom_diff(top_diff, max_pool_winners(bottom, kernel, stride, pad, out), (height, width))

        def bottom_diff(top_diff, bottom):  # the routing's ~30 passes stay in cache a block of samples at a time
            routed = in_blocks(diff, bottom, top_diff) if blocking_applies(bottom) else diff(bottom, top_diff)
            return routed.contiguous(memory_format=layout_of(bottom))  # channels_last training stays NHWC

        top = with_caffe_backward(x, pool, bottom_diff)
        if self.num_tops == 1:
            return (top,)
        return top, max_pool_winners(x.detach(), kernel, stride, pad, out).to(x.dtype)

    def _window_counts(self, size: int, k: int, s: int, p: int) -> tuple[int, int]:
        """Windows along one axis of ``size`` under PyTorch's rule (``padding=p``, ``ceil_mode``): the count
        before and after PyTorch drops a last window that would start in the right padding."""
        span = size + 2 * p - k
        count = (-(-span // s) if self.ceil_mode else span // s) + 1
        return count, count - 1 if self.ceil_mode and (count - 1) * s >= size + p else count

    def _torch_matches(self, height, width, kernel, stride, pad, out) -> bool:
        """True when PyTorch's pooling with ``padding=pad, ceil_mode`` gives Caffe's output size."""
        return all(2 * p <= k and self._window_counts(size, k, s, p)[1] == o
                   for size, k, s, p, o in zip((height, width), kernel, stride, pad, out))

    def _onnx_max_pool_matches(self, height, width, kernel, stride, pad, out) -> bool:
        """True when an exported ONNX ``MaxPool`` with symmetric ``pads`` and ``ceil_mode`` pools Caffe's windows,
        whichever reading of ONNX's ceil-mode size rule the runtime follows (dropping, or not, a last window
        that would start in the right padding): PyTorch's size is Caffe's and no such window arises.  Then
        the export records one MaxPool instead of a ``-FLT_MAX`` Pad, a MaxPool and a Slice (which kept ONNX
        Runtime's convolutions from staying in its blocked layout: a reorder around every pooling).  The
        values are the same for finite inputs; a window whose real elements are all -inf gives -inf there
        (padding is skipped, not read as -FLT_MAX), where Caffe gives -FLT_MAX."""
        return not self.global_pooling and all(
            2 * p <= k and self._window_counts(size, k, s, p) == (o, o)
            for size, k, s, p, o in zip((height, width), kernel, stride, pad, out))

    def _torch_pool(self, x, kernel, stride, pad):
        if self.method == self.AVE:
            return (F.avg_pool2d(x, kernel, stride, pad, ceil_mode=self.ceil_mode, count_include_pad=True),)
        if x.is_contiguous() and not x.is_contiguous(memory_format=torch.channels_last):
            def through_nhwc(chunk):
                nhwc = to_channels_last(chunk)
                return to_contiguous(F.max_pool2d(nhwc, kernel, stride, pad, ceil_mode=self.ceil_mode))
            return (in_blocks(through_nhwc, x) if blocking_applies(x) else through_nhwc(x),)
        return (F.max_pool2d(x, kernel, stride, pad, ceil_mode=self.ceil_mode),)

    def _explicit_pool(self, x, kernel, stride, pad, out):
        height, width = int(x.shape[2]), int(x.shape[3])
        # Extra right/bottom padding so that plain floor-mode pooling yields Caffe's (ceil) output count.
        extra = [_padded_extent(*a) for a in zip((height, width), out, kernel, stride, pad)]
        pads = (pad[1], extra[1], pad[0], extra[0])
        if self.method == self.MAX:
            # -FLT_MAX is Caffe's initial maximum: a window lying wholly in the overhang (possible without
            # padding when the last window starts at or past the end) yields it, as in Caffe, with mask -1.
            lowest = torch.finfo(x.dtype).min if x.is_floating_point() else -math.inf
            padded = F.pad(x, pads, value=lowest) if any(pads) else x
            return (_first_windows(F.max_pool2d(padded, kernel, stride), out),)
        padded = F.pad(x, pads) if any(pads) else x
        mean = _first_windows(F.avg_pool2d(padded, kernel, stride, count_include_pad=True), out)
        rows = ave_pool_divisor(height, out[0], kernel[0], stride[0], pad[0])
        cols = ave_pool_divisor(width, out[1], kernel[1], stride[1], pad[1])
        full = kernel[0] * kernel[1]
        if all(r == kernel[0] for r in rows) and all(c == kernel[1] for c in cols):
            return (mean,)
        # An empty window (divisor 0) gives Caffe's 0 / 0 = NaN.
        scale = torch.tensor([[full / (r * c) if r * c else math.nan for c in cols] for r in rows],
                             dtype=x.dtype, device=x.device)
        return (mean * scale,)

    def extra_repr(self):
        method = "MAX" if self.method == self.MAX else "AVE"
        if self.global_pooling:
            return f"{super().extra_repr()}, pool={method}, global_pooling=True"
        return (f"{super().extra_repr()}, pool={method}, kernel={self.kernel}, stride={self.stride}, pad={self.pad}, "
                f"round_mode={'CEIL' if self.ceil_mode else 'FLOOR'}")


def _first_windows(top: torch.Tensor, out) -> torch.Tensor:
    """The first ``out`` windows of each spatial axis of ``top`` (no Slice recorded in an export when they are all)."""
    if tuple(int(d) for d in top.shape[2:]) == tuple(out):
        return top
    return top[:, :, :out[0], :out[1]]


# ---------------------------------------------------------------------------- spatial pyramid pooling


@register_layer("SPP")
class SPP(CaffeLayer):
    """Caffe's SPPLayer (spatial pyramid pooling, He et al. 2014): ``spp_param { pyramid_height P pool }``.

    Level ``i`` (0 ≤ i < P) pools the whole ``H × W`` plane into ``b = 2^i`` bins per axis with Caffe's
    own Pooling layer, built as ``SPPLayer::GetPoolingParam`` does: ``kernel = ceil(H / b)``,
    ``stride = kernel``, ``pad = (kernel·b − H + 1) // 2`` (likewise for W), ``pool`` MAX (default) or AVE.
    Each level's ``(N, C, h_i, w_i)`` output (Caffe's pooled size, so its pad clip applies) is flattened
    to ``(N, C·h_i·w_i)`` and the levels are concatenated: the top is ``(N, C·Σ h_i·w_i)``.  Quirks kept:

    * ``pyramid_height: 1`` skips the flatten and concat (Caffe sets up the one pooling layer on the top
      directly), so the top is the 4-D ``(N, C, 1, 1)``;
    * a level whose pad reaches its kernel (e.g. H = 5 at b = 4: kernel 2, pad 2) is refused, as Caffe's
      Pooling CHECK (``pad < kernel``) aborts the net;
    * STOCHASTIC builds and its forward raises, like Pooling's (Caffe's CPU NOT_IMPLEMENTED);
    * the geometry follows the bottom's size at each forward (Caffe re-sets the levels up on reshape).

    The levels of the setup size are built with the port (a forward at that size builds nothing, so
    ``torch.compile`` traces it as one graph); another size builds its levels at its first forward.
    """

    bottoms = tops = ONE
    in_caffe_1_0 = True

    @staticmethod
    def level_param(layer, level: int, height: int, width: int):
        """The LayerParameter of pyramid level ``level``'s Pooling layer (``SPPLayer::GetPoolingParam``)."""
        from caffe_compat.proto import caffe_pb2

        bins = 2 ** level
        pooling = caffe_pb2.LayerParameter(name=f"{layer.name}/level{level}", type="Pooling")
        p = pooling.pooling_param
        p.kernel_h, p.kernel_w = -(-height // bins), -(-width // bins)
        p.pad_h, p.pad_w = (p.kernel_h * bins - height + 1) // 2, (p.kernel_w * bins - width + 1) // 2
        p.stride_h, p.stride_w = p.kernel_h, p.kernel_w
        p.pool = int(layer.spp_param.pool)
        return pooling

    @classmethod
    def levels(cls, layer, bottom) -> list:
        need_axes(layer, [bottom], 4, what=" (N, C, H, W), as Caffe's SPPLayer requires")
        if min(bottom[2:]) < 1:
            raise FormatError(f"layer '{layer.name}' (SPP): input dimensions cannot be zero, got {tuple(bottom)}")
        if layer.spp_param.pyramid_height < 1:
            raise FormatError(f"layer '{layer.name}' (SPP): spp_param.pyramid_height must be >= 1, got "
                              f"{layer.spp_param.pyramid_height}")
        levels = []
        for i in range(layer.spp_param.pyramid_height):
            bins = 2 ** i
            for size in bottom[2:]:  # Caffe's level Pooling CHECK_LT(pad, kernel), before the pads outgrow uint32
                kernel = -(-size // bins)
                if (kernel * bins - size + 1) // 2 >= kernel:
                    raise FormatError(f"layer '{layer.name}' (SPP): spp_param.pyramid_height "
                                      f"{layer.spp_param.pyramid_height} is too high for the {bottom[2]}x{bottom[3]} "
                                      f"input: level {i} ({bins} bins) would pad its {kernel}-wide windows by "
                                      f"{(kernel * bins - size + 1) // 2}: pad must be smaller than the kernel "
                                      f"(Caffe's Pooling CHECK)")
            levels.append(cls.level_param(layer, i, bottom[2], bottom[3]))
        return levels

    @classmethod
    def infer(cls, layer, bottoms):
        n, c = bottoms[0][:2]
        pooled = [Pooling.infer(level, bottoms).tops[0] for level in cls.levels(layer, tuple(bottoms[0]))]
        if len(pooled) == 1:
            return Shapes([pooled[0]])
        return Shapes([(n, sum(c * h * w for _, _, h, w in pooled))])

    def __init__(self, param, bottom_shapes, phase="test"):
        super().__init__(param, bottom_shapes, phase)
        self._pyramids: dict[tuple[int, int], nn.ModuleList] = {}
        self.rule()
        self._pyramid(*self.bottom_shapes[0][2:])

    def _pyramid(self, height: int, width: int) -> nn.ModuleList:
        key = (height, width)
        if key not in self._pyramids:
            shape = (1, 1, height, width)
            self._pyramids[key] = nn.ModuleList(Pooling(level, [shape], self.phase)
                                                for level in self.levels(self.param, shape))
        return self._pyramids[key]

    def forward(self, x):
        if x.dim() != 4:
            raise ShapeMismatchError(f"layer '{self.layer_name}': SPP needs a 4-D input, got {tuple(x.shape)}")
        pyramid = self._pyramid(int(x.shape[2]), int(x.shape[3]))
        pooled = [level(x)[0] for level in pyramid]
        if len(pooled) == 1:
            return (pooled[0],)
        return (torch.cat([p.flatten(1) for p in pooled], dim=1),)

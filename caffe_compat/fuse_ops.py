"""The modules of a fused inference net (:mod:`caffe_compat.fuse`) and the folding arithmetic.

What is folded, into one convolution (or inner product) step::

    y = act( W' ⋆ x + b'  [+ r] )        W' = W · a (per output channel),  b' = b · a + c

where ``(a, c)`` compose, in prototxt order, the per-channel affine maps of the layers that follow the
convolution on its output:

* **BatchNorm** with global statistics (Caffe's TEST behaviour): ``f = 0 if s == 0 else 1/s`` with ``s`` the
  moving-average factor (blob 2), ``μ = f·blob0``, ``σ = sqrt(f·blob1 + eps)`` with the layer's own eps:
  ``a ← a/σ``, ``c ← (c − μ)/σ``;
* **Scale** with one bottom over axis 1 (one ``γ`` per channel), with or without its bias ``β``:
  ``a ← a·γ``, ``c ← c·γ + β``;  **Bias** with one bottom over axis 1: ``c ← c + β``;

then optionally ``r``, the other bottom of a two-bottom **Eltwise** SUM with unit coefficients (a ResNet
shortcut), and ``act``, a **ReLU** (any ``negative_slope``).  ``a`` and ``c`` are computed in float64 from
the float32 blobs and the products ``W·a``, ``b·a + c`` are rounded to float32 once, so every folded weight
is within half an ulp of the exact product.  A chain whose ``a`` or ``c`` is not finite (``σ = 0`` with
``eps = 0``) is not folded.

The error against the unfused net comes from (i) that rounding of the folded weights (≤ 2⁻²⁴ relative per
weight) and (ii) a different order of the float32 additions of a dot product of length ``K`` (``C/group ·
kh · kw`` for a convolution, the input count for an inner product), each of them bounded by Higham's
``γ_K = K·u/(1 − K·u)``, ``u = 2⁻²⁴``, times ``Σ|w'|·|x|``.  :func:`step_error_bound` gives that bound
elementwise for one step; see :mod:`caffe_compat.fuse` for the measured whole-net figures.

Execution on CPU: the folded weights are reordered once per input shape for oneDNN (channels_last inputs;
contiguous ones use the plain weights) and the convolution,
the bias, the shortcut addition and the activation run as one oneDNN primitive
(``torch.ops.mkldnn._convolution_pointwise``; PyTorch's own fused-convolution op, used by inductor).
Elsewhere (CUDA, a PyTorch build without it, under ONNX export or tracing, or with autograd on) the same
module runs ``F.conv2d`` + add + ReLU, which ONNX export writes as Conv (+ Add) (+ Relu/LeakyRelu).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["AffineFold", "FusedConvolution", "FusedInnerProduct", "UNIT_ROUNDOFF", "step_error_bound"]

#: float32's unit roundoff u = 2⁻²⁴.
UNIT_ROUNDOFF = 2.0 ** -24


class AffineFold:
    """The per-channel affine map ``z -> a ⊙ z + c`` accumulated along a chain (float64)."""

    def __init__(self, channels: int):
        self.a = torch.ones(channels, dtype=torch.float64)
        self.c = torch.zeros(channels, dtype=torch.float64)
        self.m = torch.zeros(channels, dtype=torch.float64)  # bound on the unfused chain's constant terms

    def batch_norm(self, mean, variance, factor, eps: float) -> None:
        s = float(factor.detach().double().reshape(-1)[0])
        f = 0.0 if s == 0 else 1.0 / s
        mu = mean.detach().double().cpu() * f
        sigma = torch.sqrt(variance.detach().double().cpu() * f + eps)
        self.a, self.c, self.m = self.a / sigma, (self.c - mu) / sigma, (self.m + mu.abs()) / sigma

    def scale(self, gamma, beta=None) -> None:
        g = gamma.detach().double().cpu().reshape(-1)
        self.a, self.c, self.m = self.a * g, self.c * g, self.m * g.abs()
        if beta is not None:
            self.bias(beta)

    def bias(self, beta) -> None:
        beta = beta.detach().double().cpu().reshape(-1)
        self.c, self.m = self.c + beta, self.m + beta.abs()

    def finite(self) -> bool:
        return bool(torch.isfinite(self.a).all() and torch.isfinite(self.c).all())

    def apply(self, weight: torch.Tensor, bias: torch.Tensor | None, out_axis: int = 0):
        """``(W·a, b·a + c, |a|·|b| + m)`` rounded to the weight's dtype once (a along ``out_axis`` of W); the
        third is a bound on every constant term the unfused chain adds (for :func:`step_error_bound`)."""
        shape = [1] * weight.dim()
        shape[out_axis] = -1
        w = (weight.detach().double().cpu() * self.a.reshape(shape)).to(weight.dtype)
        b = self.c if bias is None else bias.detach().double().cpu() * self.a + self.c
        m = self.m if bias is None else bias.detach().double().cpu().abs() * self.a.abs() + self.m
        dev, dt = weight.device, weight.dtype
        return w.to(dev), b.to(dt).to(dev), m.to(dt).to(dev)


def _mkldnn_op():
    ops = getattr(torch.ops, "mkldnn", None)
    try:
        return ops._convolution_pointwise, ops._reorder_convolution_weight
    except (AttributeError, RuntimeError):
        return None


_MKLDNN = _mkldnn_op() if torch.backends.mkldnn.is_available() else None


def _traced() -> bool:
    return torch.onnx.is_in_onnx_export() or torch.jit.is_tracing()


class FusedConvolution(nn.Module):
    """One step ``act(W' ⋆ x + b' [+ r])`` (see the module docstring); ``forward(x)`` or ``forward(x, r)``.

    ``activation``: None, or the ReLU's ``negative_slope`` (0.0 = plain ReLU).  ``residual``: a second
    bottom is added before the activation."""

    def __init__(self, weight, bias, stride, pad, dilation, group, activation=None, residual=False,
                 bias_magnitude=None, pad_input=None):
        super().__init__()
        self.pad_input = pad_input  # x -> x with Caffe's overhang zeros appended (see Convolution), or None
        self.register_buffer("weight", weight.detach().clone())
        self.register_buffer("bias", bias.detach().clone())
        magnitude = bias.abs() if bias_magnitude is None else bias_magnitude
        self.register_buffer("bias_magnitude", magnitude.detach().clone(), persistent=False)
        self.stride, self.pad, self.dilation = tuple(stride), tuple(pad), tuple(dilation)
        self.group = int(group)
        self.activation = activation
        self.residual = bool(residual)
        self._packed: dict = {}

    def _plain(self, x, other=None):
        y = F.conv2d(x, self.weight, self.bias, self.stride, self.pad, self.dilation, self.group)
        if other is not None:
            y = y + other
        return self._activate(y)

    def _activate(self, y):
        if self.activation is None:
            return y
        if self.activation == 0.0:
            return torch.relu(y) if _traced() else torch.relu_(y)
        return F.leaky_relu(y, self.activation) if _traced() else F.leaky_relu_(y, self.activation)

    def _packed_weight(self, shape):
        version = 0 if self.weight.is_inference() else self.weight._version  # inference tensors have none
        key = (tuple(shape), version, self.weight.data_ptr(), self.weight.dtype)
        packed = self._packed.get(key)
        if packed is None:
            packed = _MKLDNN[1](self.weight, list(self.pad), list(self.stride), list(self.dilation), self.group,
                                list(shape))
            self._packed = {key: packed}  # one input shape at a time
        return packed

    def forward(self, x, other=None):
        if self.pad_input is not None:  # Caffe's output size: an overhang of less than a stride reads zeros
            x = self.pad_input(x)
        fast = (_MKLDNN is not None and x.device.type == "cpu" and x.dtype == torch.float32
                and self.weight.dtype == torch.float32 and not _traced()
                and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)))
        if not fast:
            return self._plain(x, other)
        pointwise = _MKLDNN[0]
        # oneDNN's reordered weight makes a channels_last output: used for channels_last inputs only.
        weight = self._packed_weight(x.shape) if _format_of(x) is torch.channels_last else self.weight
        attr = "none" if self.activation is None else ("relu" if self.activation == 0.0 else "leaky_relu")
        scalars = [] if self.activation in (None, 0.0) else [self.activation]
        pad, stride, dilation = list(self.pad), list(self.stride), list(self.dilation)
        if other is None:
            return pointwise(x, weight, self.bias, pad, stride, dilation, self.group, attr, scalars, "")
        other = other.contiguous(memory_format=_format_of(x))
        unary = None if self.activation is None else attr
        return pointwise.binary(x, other, weight, self.bias, pad, stride, dilation, self.group, "add", None, unary,
                                scalars, "")

    def _apply(self, fn, *args, **kwargs):
        self._packed = {}
        return super()._apply(fn, *args, **kwargs)

    def extra_repr(self):
        act = "" if self.activation is None else f", relu(negative_slope={self.activation})"
        return (f"{tuple(self.weight.shape)}, stride={self.stride}, pad={self.pad}, dilation={self.dilation}, "
                f"group={self.group}{', + residual' if self.residual else ''}{act}")


def _format_of(x):
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
        return torch.channels_last
    return torch.contiguous_format


class FusedInnerProduct(nn.Module):
    """``act(x_flat · W'ᵀ + b')`` (Caffe's InnerProduct with the following affine layers folded in)."""

    def __init__(self, weight, bias, axis: int, transpose: bool, activation=None, bias_magnitude=None):
        super().__init__()
        self.register_buffer("weight", weight.detach().clone())
        self.register_buffer("bias", bias.detach().clone())
        magnitude = bias.abs() if bias_magnitude is None else bias_magnitude
        self.register_buffer("bias_magnitude", magnitude.detach().clone(), persistent=False)
        self.axis, self.transpose, self.activation = int(axis), bool(transpose), activation

    def forward(self, x):
        flat = x.reshape(*x.shape[:self.axis], -1)
        y = flat.matmul(self.weight) + self.bias if self.transpose else F.linear(flat, self.weight, self.bias)
        if self.activation is None:
            return y
        if self.activation == 0.0:
            return torch.relu(y) if _traced() else torch.relu_(y)
        return F.leaky_relu(y, self.activation) if _traced() else F.leaky_relu_(y, self.activation)

    def extra_repr(self):
        act = "" if self.activation is None else f", relu(negative_slope={self.activation})"
        return f"{tuple(self.weight.shape)}, axis={self.axis}, transpose={self.transpose}{act}"


def step_error_bound(module, x: torch.Tensor, other: torch.Tensor | None = None) -> torch.Tensor:
    """Elementwise bound on |fused − unfused| for one fused step fed the unfused bottom ``x``:

        2 · γ_(K+8) · (|W'| ⋆ |x| + B + |r|),   γ_n = n·u / (1 − n·u)

    where B bounds every constant the unfused chain adds (``|a|·|b| + Σ`` of the BatchNorm means and
    Scale/Bias offsets carried through the chain, ``bias_magnitude``).  Both results are float32
    evaluations of the same exact value: each evaluation's dot product (K terms, in its own order) is
    within γ_K of it times the magnitudes; the folded weights' rounding (≤ u each), the unfused
    statistics (``f·blob``, ``+ eps``, ``sqrt``: ≤ 3u) and its chain of subtract, divide, multiply, add
    (≤ 4u) are covered by the ``+ 8``; the shortcut addition by the ``|r|`` term; ReLU is 1-Lipschitz."""
    x = x.double()
    w, b = module.weight.double().abs(), module.bias_magnitude.double().abs()
    if isinstance(module, FusedConvolution):
        k = module.weight.shape[1] * module.weight.shape[2] * module.weight.shape[3]
        magnitude = F.conv2d(x.abs(), w, b, module.stride, module.pad, module.dilation, module.group)
    else:
        flat = x.reshape(*x.shape[:module.axis], -1).abs()
        k = flat.shape[-1]
        magnitude = flat.matmul(w) + b if module.transpose else F.linear(flat, w, b)
    if other is not None:
        magnitude = magnitude + other.double().abs()
    n = k + 8
    gamma = n * UNIT_ROUNDOFF / (1 - n * UNIT_ROUNDOFF)
    return 2 * gamma * magnitude



def _channels_last_cpu(x) -> bool:
    return (x.dim() == 4 and x.device.type == "cpu" and not _traced() and not torch.is_grad_enabled()
            and x.is_contiguous(memory_format=torch.channels_last))


class FusedLRN(nn.Module):
    """Caffe's LRN ACROSS_CHANNELS on a ``channels_last`` CPU blob: ``y = x · (k + α/n · Σ x²)^−β`` computed on
    blocks of ~1 MB of (pixel, channel) rows, so the passes stay in the cache, with the window sum in the
    port's order (zero-padded shifts added one by one) and ``s^−0.75`` as ``rsqrt(s)·sqrt(rsqrt(s))``
    (``s^−0.5``, ``s^−1`` likewise; other β: ``pow``), a few ulp from ``pow``.  Otherwise (another
    layout or device, WITHIN_CHANNEL, export) it is the port itself."""

    BLOCK = 262144  # floats per block of rows

    def __init__(self, port):
        super().__init__()
        self.port = port

    def forward(self, x):
        port = self.port
        if port.within_channel or not _channels_last_cpu(x):
            return port(x)[0]
        n, c, h, w = x.shape
        rows = x.permute(0, 2, 3, 1).reshape(-1, c)
        out = torch.empty_like(rows)
        pad = (port.size - 1) // 2
        step = max(1, self.BLOCK // max(c, 1))
        for start in range(0, rows.shape[0], step):
            block = rows[start:start + step]
            padded = F.pad(block * block, (pad, pad))
            window = padded[:, 0:c].clone()
            for shift in range(1, port.size):
                window.add_(padded[:, shift:shift + c])
            scale = _negative_power(window.mul_(port.alpha / port.size).add_(port.k), port.beta)
            torch.mul(scale, block, out=out[start:start + step])
        return out.view(n, h, w, c).permute(0, 3, 1, 2)


def _negative_power(s, beta: float):
    """``s^−β`` in place for the common β without ``pow``'s cost (within a few ulp of ``pow``)."""
    if beta == 0.75:
        r = torch.rsqrt_(s)
        return r.mul_(torch.sqrt(r))
    if beta == 0.5:
        return torch.rsqrt_(s)
    if beta == 1.0:
        return torch.reciprocal_(s)
    return s.pow_(-beta)


class FusedPooling(nn.Module):
    """Caffe's Pooling (one top) on a ``channels_last`` CPU batch, one sample at a time into one
    ``channels_last`` output (the window passes stay in the cache; the values are the port's: the same
    op per sample).  Otherwise the port itself."""

    def __init__(self, port):
        super().__init__()
        self.port = port

    def forward(self, x):
        port = self.port
        if x.shape[0] < 2 or not _channels_last_cpu(x):
            return port(x)[0]
        first = port(x[0:1])[0]
        out = torch.empty((x.shape[0], *first.shape[1:]), dtype=first.dtype,
                          memory_format=torch.channels_last)
        out[0:1] = first
        for i in range(1, x.shape[0]):
            out[i:i + 1] = port(x[i:i + 1])[0]
        return out

"""Caffe's hand-written backward passes, for the ports whose gradient sits on a boundary.

At a kink (ReLU at 0, Clip at its bounds, ``|x|`` at 0), at a tie (MAX pooling) or behind an overflow
guard (BNLL's 50, Power's ``y / x``), the value autograd's derivative takes is an implementation detail of
torch, and it changes between releases: torch 2.14's ``clamp`` passes no gradient at its bounds, where
2.13's did and Caffe's ClipLayer does.  A port that must give Caffe's gradient there keeps torch's forward
(its values stay bit-identical) and takes its bottom diff from Caffe's own formula through
:func:`with_caffe_backward`.  Without autograd (inference, ONNX export) the forward runs alone.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


class _CaffeBackward(torch.autograd.Function):
    """``value(x)`` forward; backward ``bottom_diff(top_diff, saved)`` with ``saved`` the bottom, or the
    top when ``keep_top`` (for a formula that reads only the top, so the bottom need not stay alive)."""

    @staticmethod
    def forward(ctx, x, value, bottom_diff, keep_top):
        top = value(x)
        ctx.bottom_diff = bottom_diff
        ctx.save_for_backward(top if keep_top else x)
        return top

    @staticmethod
    def backward(ctx, top_diff):
        (saved,) = ctx.saved_tensors
        return ctx.bottom_diff(top_diff, saved), None, None, None


def caffe_backward_applies(x: Tensor) -> bool:
    """Whether autograd will differentiate through ``x`` here (not exporting): when a port's Caffe backward
    (an autograd Function) must replace autograd's own derivative."""
    return x.requires_grad and torch.is_grad_enabled() and not torch.onnx.is_in_onnx_export()


def with_caffe_backward(x: Tensor, value: Callable[[Tensor], Tensor],
                        bottom_diff: Callable[[Tensor, Tensor], Tensor], keep_top: bool = False) -> Tensor:
    """``value(x)``, whose gradient is ``bottom_diff(top_diff, x)`` (``(top_diff, top)`` with ``keep_top``)
    instead of autograd's derivative of ``value``."""
    if not caffe_backward_applies(x):
        return value(x)
    return _CaffeBackward.apply(x, value, bottom_diff, keep_top)


def as_float_mask(compare, x: Tensor, bound: float, like: Tensor) -> Tensor:
    """``compare(x, bound)`` as a new tensor of ``like``'s dtype (``x`` and ``like`` have one shape), 1 where true,
    0 where false (Caffe's ``Dtype(x > bound)``).  Written straight in that dtype: on the CPU PyTorch's
    comparisons vectorise only when the result has the operands' floating type (a ``bool`` result, then
    promoted in a product, costs a non-vectorised pass and a cast copy, ~1.6x the time of ReLU's whole
    backward).  In ``x``'s layout: ``like`` may be a strided slice (a Concat's diff), whose ``empty_like`` is
    NCHW; an NHWC ``x`` then gave a mixed-layout pass and an NCHW diff (channels_last GoogLeNet training,
    batch 8: 1.09 → 1.03 s a step)."""
    return compare(x, bound, out=torch.empty_like(x, dtype=like.dtype))


def caffe_sign(x: Tensor) -> Tensor:
    """Caffe's ``caffe_sign``: ``(0 < x) - (x < 0)``, so ``sign(0) = 0`` (and 0 for NaN)."""
    return as_float_mask(torch.gt, x, 0.0, x).sub_(as_float_mask(torch.lt, x, 0.0, x))


def caffe_abs(x: Tensor) -> Tensor:
    """``|x|`` with Caffe's gradient ``sign(x) · dy`` (AbsVal, Reduction ASUM): 0 at ``x = 0``."""
    return with_caffe_backward(x, torch.abs, lambda dy, bottom: dy * caffe_sign(bottom))


def caffe_relu(x: Tensor, negative_slope: float = 0.0) -> Tensor:
    """``max(x, 0) + negative_slope · min(x, 0)`` with Caffe's ReLU gradient
    ``dy · ((x > 0) + negative_slope · (x <= 0))``: ``negative_slope`` (0 by default) at ``x = 0``.

    For ``negative_slope >= 0`` the top has the bottom's sign (``y > 0`` exactly where ``x > 0``), so the
    mask is read from the top and the bottom need not be kept, as with ``torch.relu``."""
    slope = float(negative_slope)

    def value(t):
        return torch.relu(t) if slope == 0.0 else F.leaky_relu(t, slope)

    def bottom_diff(dy, t):  # the factor built in dy's dtype, then times dy (a product commutes bit for bit)
        factor = as_float_mask(torch.gt, t, 0.0, dy)
        if slope != 0.0:
            factor.add_(as_float_mask(torch.le, t, 0.0, dy).mul_(slope))
        return factor.mul_(dy)

    return with_caffe_backward(x, value, bottom_diff, keep_top=slope >= 0.0)

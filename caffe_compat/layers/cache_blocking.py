"""Sample-by-sample evaluation of memory-bound layers during inference.

Pooling through a ``channels_last`` copy and LRN make several full passes over their input.  For a large
batch those passes stream the whole blob through memory each time (GoogLeNet's ``conv2/norm2`` at
batch 32 is 77 MB); one sample at a time they stay in the CPU cache and reuse the same scratch memory,
which is 2-3× faster on CPU.  Every op is per sample, so the values are those of the whole-batch
call, except that an elementwise ``pow`` may round its last bit differently where a sample ends inside
a SIMD vector (≤ 1 ulp; seen on LRN WITHIN_CHANNEL).  Only used without autograd and outside ONNX
export / tracing, where a loop would be recorded.
"""

from __future__ import annotations

from typing import Callable

import torch


def blocking_applies(x: torch.Tensor) -> bool:
    """True when ``x`` should be processed sample by sample: a CPU batch, no autograd, not exporting and not
    being compiled (a compiler plans its own loops; an unrolled batch loop would pin the batch size)."""
    return (x.dim() >= 1 and x.shape[0] > 1 and x.device.type == "cpu" and not torch.is_grad_enabled()
            and not torch.onnx.is_in_onnx_export() and not torch.jit.is_tracing()
            and not torch.compiler.is_compiling())


def per_sample(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` computed one sample (``x[i:i+1]``) at a time into one output tensor."""
    first = fn(x[0:1])
    out = torch.empty((x.shape[0], *first.shape[1:]), dtype=first.dtype, device=first.device)
    out[0:1] = first
    for i in range(1, x.shape[0]):
        out[i:i + 1] = fn(x[i:i + 1])
    return out

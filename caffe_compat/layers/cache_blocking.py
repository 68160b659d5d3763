"""Block-by-block evaluation of memory-bound layers without autograd (inference; during training the
forward of the Caffe-backward autograd Functions and MAX pooling's backward routing).

Pooling through a ``channels_last`` copy and LRN make several full passes over their input.  For a large
batch those passes stream the whole blob through memory each time (GoogLeNet's ``conv2/norm2`` at
batch 32 is 77 MB); a few samples at a time (blocks of about :data:`BLOCK_BYTES`) they stay in the CPU
cache and reuse the same scratch memory, which is 2-3× faster on CPU.  Small samples go in blocks of
several: one call per sample costs more than it saves below ~100 KB a sample (the toy digits net's
16 KB pool3 bottoms at batch 64: 4-6× the whole-batch time).  Every op is per sample, so the values are
those of the whole-batch call, except that an elementwise ``pow`` may round its last bit differently
where a block ends inside a SIMD vector (≤ 1 ulp; seen on LRN WITHIN_CHANNEL).  Only used outside ONNX
export / tracing, where a loop would be recorded.
"""

from __future__ import annotations

from typing import Callable

import torch


def blocking_applies(x: torch.Tensor) -> bool:
    """True when ``x`` should be processed in blocks of samples: a CPU batch, no autograd, not exporting and not
    being compiled (a compiler plans its own loops; an unrolled batch loop would pin the batch size)."""
    return (x.dim() >= 1 and x.shape[0] > 1 and x.device.type == "cpu" and not torch.is_grad_enabled()
            and not torch.onnx.is_in_onnx_export() and not torch.jit.is_tracing()
            and not torch.compiler.is_compiling())


def writes_into_views(t: torch.Tensor) -> bool:
    """True when a result computed from ``t`` may be written straight into a slice of a preallocated
    buffer (``out=``): eager mode, no autograd recording ``t``, not exporting, tracing or compiling."""
    return not ((torch.is_grad_enabled() and t.requires_grad) or torch.onnx.is_in_onnx_export()
                or torch.jit.is_tracing() or torch.compiler.is_compiling())


def is_channels_last(x: torch.Tensor) -> bool:
    """A 4-axis tensor laid out NHWC and not also NCHW (a 1×1 plane or a single channel is both): the layout
    a layer's top and bottom diff keep, so that the next layer gets what ``channels_last`` training gave it
    (a mixed pair of layouts costs PyTorch's strided loops and a conversion in every convolution)."""
    return x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()


def layout_of(x: torch.Tensor) -> torch.memory_format:
    """``torch.channels_last`` for an NHWC ``x`` (:func:`is_channels_last`), else ``torch.contiguous_format``."""
    return torch.channels_last if is_channels_last(x) else torch.contiguous_format


#: Bytes of input per block: about what stays in a core's L2 cache with the block's copies (1-2 MB on the
#: CPUs measured); a sample larger than this is a block of its own.
BLOCK_BYTES = 2**20


def samples_per_block(x: torch.Tensor) -> int:
    """How many whole samples of ``x`` make one block: ``max(1, BLOCK_BYTES // bytes of a sample)``."""
    return max(1, BLOCK_BYTES // max(1, x[0].numel() * x.element_size()))


def in_blocks(fn: Callable[..., torch.Tensor], x: torch.Tensor, *more: torch.Tensor) -> torch.Tensor:
    """``fn(x, *more)`` computed on blocks of whole samples (``x[i:i+b]`` and the same samples of each of
    ``more``; ``b = max(1, BLOCK_BYTES // x's sample bytes)``) into one output tensor, in the layout of the
    first block's result; one call on the whole batch when it fits one block."""
    block = samples_per_block(x)
    if block >= x.shape[0]:
        return fn(x, *more)
    first = fn(x[0:block], *(m[0:block] for m in more))
    out = torch.empty((x.shape[0], *first.shape[1:]), dtype=first.dtype, device=first.device,
                      memory_format=layout_of(first))
    out[0:block] = first
    for i in range(block, x.shape[0], block):
        out[i:i + block] = fn(x[i:i + block], *(m[i:i + block] for m in more))
    return out

"""NCHW <-> NHWC (``channels_last``) copies of CPU batches through OpenCV's blocked transpose.

Pooling runs in NHWC on the CPU (PyTorch's NHWC max pooling is ~5x its NCHW one) and so converts its
bottom and its top, and MAX pooling's Caffe backward its routing, every call.  PyTorch's strided copy does
that conversion at ~1.5 GB/s here; ``cv2.transpose`` of each sample's ``(C, H·W)`` matrix into the
``(H·W, C)`` rows of the other layout moves the same bytes ~10x faster (GoogLeNet's ``conv1`` sample,
64 × 112 × 112 float32: 2.1 → 0.2 ms).  A transpose is a copy: the values are the same bits.  Used in eager
mode only (:func:`~caffe_compat.layers.cache_blocking.writes_into_views`), for 4-axis contiguous tensors of
the dtypes the installed OpenCV transposes (:func:`opencv_dtypes`: OpenCV 4.5.4 has no float16 transpose);
otherwise, and under tracing, export or compile, PyTorch's own copy.
"""

from __future__ import annotations

import functools

import cv2
import numpy as np
import torch

from caffe_compat.layers.cache_blocking import is_channels_last, writes_into_views  # noqa: F401 (re-exported)

#: The dtypes OpenCV has a matrix type for (not int64, bfloat16 or bool).  OpenCV 4.5.4 refuses to transpose
#: float16 (``CV_16F``), 4.11 does it: each is tried once on the installed OpenCV (:func:`opencv_dtypes`).
_CANDIDATE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.uint8, torch.int8, torch.int16, torch.int32)


@functools.lru_cache(maxsize=1)
def opencv_dtypes() -> frozenset:
    """The candidate dtypes whose 2 x 3 matrix the installed OpenCV transposes into a given array."""
    accepted = set()
    for dtype in _CANDIDATE_DTYPES:
        source = torch.arange(6, dtype=dtype).reshape(2, 3).numpy()
        target = np.empty((3, 2), dtype=source.dtype)
        try:
            cv2.transpose(source, dst=target)
        except cv2.error:
            continue
        if np.array_equal(target, source.T):
            accepted.add(dtype)
    return frozenset(accepted)


def _opencv_applies(x: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and x.dim() == 4 and x.numel() > 0 and writes_into_views(x)
            and x.dtype in opencv_dtypes())


def to_channels_last(x: torch.Tensor) -> torch.Tensor:
    """``x.contiguous(memory_format=torch.channels_last)``: a new NHWC copy of an NCHW-contiguous ``x``."""
    if x.is_contiguous(memory_format=torch.channels_last) or not (x.is_contiguous() and _opencv_applies(x)):
        return x.contiguous(memory_format=torch.channels_last)
    n, c, h, w = x.shape
    out = torch.empty_like(x, memory_format=torch.channels_last)
    _transpose_samples(x.detach().numpy().reshape(n, c, h * w), out.permute(0, 2, 3, 1).numpy().reshape(n, h * w, c))
    return out


def to_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x.contiguous()``: a new NCHW copy of a ``channels_last`` ``x``."""
    if x.is_contiguous() or not (x.is_contiguous(memory_format=torch.channels_last) and _opencv_applies(x)):
        return x.contiguous()
    n, c, h, w = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _transpose_samples(x.detach().permute(0, 2, 3, 1).numpy().reshape(n, h * w, c), out.numpy().reshape(n, c, h * w))
    return out


def _transpose_samples(source, target) -> None:
    """``target[i] = source[i].T`` for every sample, written in place by OpenCV."""
    for i in range(len(source)):
        cv2.transpose(source[i], dst=target[i])

"""A decoded ``H x W x C`` image as ``C x H x W`` planes, the layout of a Datum and of Caffe's blobs.

Caffe's ``CVMatToDatum`` and the readers that hand a decoded image to ``DataTransformer``'s Datum path move
each interleaved pixel's channels into their planes.  NumPy's copy of ``image.transpose(2, 0, 1)`` does
that element by element with a 3-byte stride (67 µs for a 256 x 256 x 3 image on the team's Intel Xeon
VM); OpenCV's ``split`` into the planes does it with vector shuffles (19 µs).  Bytes are only moved, so
the values are the same.

The planes are laid out with their starts :data:`SKEW` bytes apart modulo 64: OpenCV's ``split`` switches
to non-temporal (cache-bypassing) stores when its outputs are all 64-byte aligned or all misaligned alike
(``vecsplit_`` in ``split.simd.hpp``), which would send the planes to memory just before the transformer
reads them.  :func:`skewed_planes` is that layout, also used for the transformer's own scratch planes
(:mod:`caffe_compat.data.hwc_crop`).
"""

from __future__ import annotations

import cv2
import numpy as np

__all__ = ["SKEW", "chw_planes", "skewed_planes", "split_into"]

#: Bytes between successive planes' offsets from a 64-byte boundary: never all alike for up to 4 planes.
SKEW = 16


def skewed_planes(channels: int, height: int, width: int, dtype=np.uint8) -> np.ndarray:
    """A new ``(channels, height, width)`` array, each plane C-contiguous, plane ``c`` starting ``SKEW·c``
    bytes past a 64-byte boundary (a view with a plane stride of ``height·width·itemsize + SKEW`` bytes)."""
    itemsize = np.dtype(dtype).itemsize
    plane = height * width * itemsize
    stride = plane + SKEW
    block = np.empty(channels * stride + 64, np.uint8)
    first = -block.ctypes.data % 64
    rows = block[first:first + channels * stride].reshape(channels, stride)
    return rows[:, :plane].view(dtype).reshape(channels, height, width)


def chw_planes(image: np.ndarray) -> np.ndarray:
    """``image`` (``H x W x C``, or ``H x W`` for one channel) as ``C x H x W``: the values of
    ``np.ascontiguousarray(image.transpose(2, 0, 1))``, split into :func:`skewed_planes` by OpenCV for 2 to
    4 channels of a type OpenCV holds (8, 16 and 32-bit integers, float32, float64), else NumPy's copy."""
    if image.ndim == 2:
        return np.ascontiguousarray(image)[None]
    height, width, channels = image.shape
    if not 2 <= channels <= 4 or image.dtype not in _OPENCV_DTYPES or image.size == 0:
        return np.ascontiguousarray(image.transpose(2, 0, 1))
    planes = skewed_planes(channels, height, width, image.dtype)
    split_into(np.ascontiguousarray(image), planes)
    return planes


def split_into(image: np.ndarray, planes: np.ndarray) -> None:
    """``cv2.split`` of the interleaved ``H x W x C`` ``image`` into ``planes`` (``C x H x W``, each plane
    C-contiguous); should OpenCV write its planes elsewhere (never seen), they are copied in."""
    targets = list(planes)
    written = cv2.split(image, targets)
    if [w.ctypes.data for w in written] != [t.ctypes.data for t in targets]:
        np.copyto(planes, np.stack(written))


_OPENCV_DTYPES = tuple(np.dtype(t) for t in (np.uint8, np.int8, np.uint16, np.int16, np.int32, np.float32,
                                             np.float64))

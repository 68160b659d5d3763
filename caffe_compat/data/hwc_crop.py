"""The crop window of an ``H x W x C`` uint8 image as ``C`` contiguous uint8 planes, mirrored or not.

Why: :meth:`caffe_compat.data.transformer.DataTransformer.transform` (the cv::Mat path) used to convert the
crop to float32 straight from the interleaved image (``image.transpose(2, 0, 1)``, a 3-byte stride).  numpy
does that strided uint8 -> float32 cast element by element: ~80 µs of the ~120 µs a 224 x 224 x 3 crop took,
on a par with a third of the JPEG decode.  Here OpenCV does the byte work (``cv2.flip`` of the window when
mirrored, then ``cv2.split`` into the planes, ~25 µs together) and the transformer casts each contiguous
plane (a vectorised numpy loop), so the float work becomes a few contiguous passes.  Bytes are only moved,
never computed on, so the values are the ones the strided cast gave.

The planes (and the mirrored window) live in per-thread scratch arrays, reused for every image of the
same shape (``cv2.split`` into arrays it allocates itself took 3x as long: fresh pages).  The planes'
addresses are deliberately misaligned by different amounts (:func:`caffe_compat.io.planes.skewed_planes`):
OpenCV's ``split`` switches to non-temporal (cache-bypassing) stores when its outputs are all 64-byte
aligned or all misaligned alike, which sends the planes to memory just before the cast reads them (~200 µs
instead of ~11 µs for a 224 x 224 x 3 window, row by row, measured with OpenCV 4.14).  A caller uses the
planes before its next call on the same thread.  Images of more than 4 channels return None
(the caller keeps the strided numpy cast).
"""

from __future__ import annotations

import threading

import cv2
import numpy as np

from caffe_compat.io.planes import skewed_planes, split_into

_LOCAL = threading.local()
_MAX_SHAPES = 4  # scratch sets kept per thread (a data set mixes few crop shapes)


def _scratch(height: int, width: int, channels: int) -> tuple[list[np.ndarray], np.ndarray]:
    """This thread's planes (``channels`` arrays ``height x width``) and mirror window for the shape."""
    cache = getattr(_LOCAL, "cache", None)
    if cache is None:
        cache = _LOCAL.cache = {}
    key = (height, width, channels)
    found = cache.get(key)
    if found is None:
        if len(cache) >= _MAX_SHAPES:
            cache.clear()
        planes = list(skewed_planes(channels, height, width))  # plane c starts SKEW * c bytes past a 64-byte boundary
        found = cache[key] = (planes, np.empty((height, width, channels), np.uint8))
    return found


def crop_planes(image_hwc: np.ndarray, h_off: int, w_off: int, height: int, width: int,
                mirror: bool) -> list[np.ndarray] | None:
    """``[image_hwc[h_off:h_off+height, w_off:w_off+width, c]`` for each channel ``c``], each a C-contiguous
    ``height x width`` uint8 array (left-right mirrored when ``mirror``), or None for more than 4 channels.
    One channel without a mirror gives the window itself (a view); otherwise per-thread scratch arrays
    (valid until this thread's next call)."""
    channels = image_hwc.shape[2]
    if channels > 4:
        return None
    window = image_hwc[h_off:h_off + height, w_off:w_off + width]
    if not window.flags.c_contiguous and window.strides[1:] != (channels, 1):  # OpenCV would copy it anyway
        window = np.ascontiguousarray(window)
    planes, mirrored = _scratch(height, width, channels)
    if channels == 1:
        if not mirror:
            return [window[:, :, 0]]
        return [cv2.flip(window[:, :, 0], 1, dst=planes[0])]
    if mirror:
        window = cv2.flip(window, 1, dst=mirrored)
    return list(cv2.split(window, planes))


def _float_scratch(height: int, width: int, channels: int) -> np.ndarray:
    """This thread's float32 ``height x width x channels`` array (the interleaved crop before its split)."""
    cache = getattr(_LOCAL, "floats", None)
    if cache is None or cache.shape != (height, width, channels):
        cache = _LOCAL.floats = np.empty((height, width, channels), np.float32)
    return cache


def stream_crop(image_hwc: np.ndarray, h_off: int, w_off: int, height: int, width: int, mirror: bool,
                mean_values: np.ndarray, scale: np.float32, out: np.ndarray) -> bool:
    """Write ``(crop - mean_values) * scale`` (float32, mirrored when ``mirror``) into the ``C x height x width``
    array ``out`` with OpenCV's cache-bypassing stores; False (nothing written) unless ``2 <= C <= 4``.

    Why: a batch row (600 KB at 224 x 224 x 3) written with ordinary stores fills the core's 2 MB cache
    with lines nobody reads before the batch is done, pushing out the JPEG decoder's working set; on the
    benchmark machine that cost a batch ~50 µs per image more than a loop that rewrites one image array
    still in cache.  ``cv2.split`` of an interleaved float32 image stores non-temporally when its outputs
    are equally aligned (``vecsplit_``; a channel of ``out`` is ``height * width * 4`` bytes, a multiple
    of 64 when ``height * width`` is one of 16, as 224 x 224; otherwise the stores are ordinary, the
    values the same).  The arithmetic is done first, in this thread's cached float32 scratch, in Caffe's
    order and precision: ``cv2.subtract`` of the uint8 window and a scalar into float32 (``dtype``) casts
    each byte and subtracts the float32 mean in one pass, ``float32(pixel) - mean`` rounded once
    (checked against numpy over every byte value in ``tests/data/test_hwc_crop.py``; a separate cast pass
    cost ~25 µs of a 224 x 224 x 3 crop), then numpy multiplies by the float32 scale."""
    channels = image_hwc.shape[2]
    if not 2 <= channels <= 4 or not out.flags.c_contiguous:
        return False
    window = image_hwc[h_off:h_off + height, w_off:w_off + width]
    if mirror:
        window = cv2.flip(window, 1, dst=_scratch(height, width, channels)[1])
    floats = _float_scratch(height, width, channels)
    if mean_values.size:  # the cast and the subtraction in one pass over the window
        mean = [float(v) for v in mean_values] if mean_values.size > 1 else [float(mean_values[0])] * channels
        cv2.subtract(window, (*mean, *(0.0,) * (4 - channels)), dst=floats, dtype=cv2.CV_32F)
    else:
        np.copyto(floats, window, casting="unsafe")  # what astype(np.float32) computes
    if scale != 1:
        floats *= scale
    split_into(floats, out)
    return True

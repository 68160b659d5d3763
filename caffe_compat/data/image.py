"""Image decoding exactly as Caffe's ``ReadImageToCVMat`` (``util/io.cpp``) does it, with OpenCV.

``cv::imread(path, is_color ? IMREAD_COLOR : IMREAD_GRAYSCALE)`` gives BGR (or one grey channel)
uint8; if both ``new_height > 0`` and ``new_width > 0`` the image is resized with
``cv::resize(img, Size(new_width, new_height))``, i.e. the default ``INTER_LINEAR``.  If only one of
the two is positive nothing is resized (Caffe's rule).  Caffe logs an error and returns an empty
Mat for an unreadable file; here that is a :class:`~caffe_compat.errors.DataError`, and so is any
``cv2.error`` OpenCV raises on a hostile file (a decoder's failure, an image too large to allocate), with
the file and the field or list that named it.  Before OpenCV sees the file, the decoded size its header
declares is compared with the memory budget (:func:`caffe_compat.io.image_header.check_decode_budget`): a
small file declaring 60000 x 60000 pixels is a :class:`~caffe_compat.errors.MemoryBudgetError`.

The result is always ``H x W x C`` uint8 (``C`` = 3 colour, 1 grey), the layout
:meth:`caffe_compat.data.transformer.DataTransformer.transform` takes.
"""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np

from caffe_compat.errors import DataError, MemoryBudgetError
from caffe_compat.io.datum_lmdb import cv_reason
from caffe_compat.io.image_header import check_decode_budget, imread
from caffe_compat.io.safe_open import check_regular_file, memory_budget


def resize_within_budget(image: np.ndarray, height: int, width: int, where: str) -> np.ndarray:
    """``cv::resize`` to ``height × width`` (bilinear, as Caffe's ReadImageToCVMat), after checking that the
    result fits the memory budget; a DataError naming ``where`` otherwise, or when OpenCV cannot allocate it."""
    need = int(height) * int(width) * (image.shape[2] if image.ndim == 3 else 1) * image.itemsize
    if need > memory_budget():
        raise MemoryBudgetError(f"{where}: resizing to new_height {height} x new_width {width} needs {need} bytes, more "
                        f"than the memory budget of {memory_budget()} bytes")
    try:
        return cv2.resize(image, (int(width), int(height)))
    except (cv2.error, OverflowError) as exc:
        raise DataError(f"{where}: cannot resize the image to new_height {height} x new_width {width} "
                        f"({cv_reason(exc)})") from None


def load_image_bgr(path: str | Path, color: bool = True, new_height: int = 0, new_width: int = 0,
                   what: str | None = None) -> np.ndarray:
    """Decode ``path`` like Caffe's ``ReadImageToCVMat(path, new_height, new_width, color)``; a path that
    is not a regular file (a FIFO, a device) raises NotRegularFileError naming ``what`` named it."""
    check_regular_file(path, what)
    named = f" (named by {what})" if what else ""
    flag = cv2.IMREAD_COLOR if color else cv2.IMREAD_GRAYSCALE
    check_decode_budget(path, f"{path}{named}", flag)  # the decoded size from the header, before OpenCV allocates it
    try:
        image = imread(path, flag)
    except cv2.error as exc:
        raise DataError(f"{path}{named}: OpenCV could not decode the image ({cv_reason(exc)})") from None
    if image is None:
        reason = "file not found" if not Path(path).is_file() else "OpenCV could not decode it"
        raise DataError(f"{path}{named}: could not open or find the image ({reason})")
    if new_height > 0 and new_width > 0:
        image = resize_within_budget(image, new_height, new_width, f"{path}{named}")
    if image.ndim == 2:
        image = image[:, :, None]
    return image

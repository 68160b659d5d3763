"""Image decoding exactly as Caffe's ``ReadImageToCVMat`` (``util/io.cpp``) does it, with OpenCV.

``cv::imread(path, is_color ? IMREAD_COLOR : IMREAD_GRAYSCALE)`` gives BGR (or one grey channel)
uint8; if both ``new_height > 0`` and ``new_width > 0`` the image is resized with
``cv::resize(img, Size(new_width, new_height))``, i.e. the default ``INTER_LINEAR``.  If only one of
the two is positive nothing is resized (Caffe's rule).  Caffe logs an error and returns an empty
Mat for an unreadable file; here that is a :class:`~caffe_compat.errors.DataError`.

The result is always ``H x W x C`` uint8 (``C`` = 3 colour, 1 grey), the layout
:meth:`caffe_compat.data.transformer.DataTransformer.transform` takes.
"""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np

from caffe_compat.errors import DataError
from caffe_compat.io.safe_open import check_regular_file


def load_image_bgr(path: str | Path, color: bool = True, new_height: int = 0, new_width: int = 0,
                   what: str | None = None) -> np.ndarray:
    """Decode ``path`` like Caffe's ``ReadImageToCVMat(path, new_height, new_width, color)``; a path that
    is not a regular file (a FIFO, a device) raises NotRegularFileError naming ``what`` named it."""
    check_regular_file(path, what)
    flag = cv2.IMREAD_COLOR if color else cv2.IMREAD_GRAYSCALE
    image = cv2.imread(str(path), flag)
    if image is None:
        reason = "file not found" if not Path(path).is_file() else "OpenCV could not decode it"
        raise DataError(f"{path}: could not open or find the image ({reason})")
    if new_height > 0 and new_width > 0:
        image = cv2.resize(image, (int(new_width), int(new_height)))
    if image.ndim == 2:
        image = image[:, :, None]
    return image

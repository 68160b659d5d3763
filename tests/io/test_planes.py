"""``caffe_compat.io.planes``: an ``H x W x C`` image as ``C x H x W`` planes split by OpenCV, the bytes of
NumPy's ``ascontiguousarray(image.transpose(2, 0, 1))`` exactly, in planes skewed against OpenCV's
non-temporal stores; and the readers that use it (encoded Datums, convert_imageset's raw Datums)."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from caffe_compat.io import decode_datum, make_datum
from caffe_compat.io.planes import SKEW, chw_planes, skewed_planes


def _reference(image):
    return np.ascontiguousarray((image[:, :, None] if image.ndim == 2 else image).transpose(2, 0, 1))


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.uint16, np.int16, np.int32, np.float32, np.float64])
@pytest.mark.parametrize("channels", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("height, width", [(7, 5), (256, 256), (1, 9)])
def test_the_planes_hold_numpys_transposed_bytes(dtype, channels, height, width):
    rng = np.random.RandomState(channels + height)
    image = rng.randint(-100, 200, (height, width, channels)).astype(dtype)
    if np.dtype(dtype).kind == "f":
        image[0, 0, 0] = -0.0
        image.flat[-1] = np.nan
    planes = chw_planes(image)
    want = _reference(image)
    assert planes.shape == want.shape and planes.dtype == want.dtype
    assert planes.tobytes() == want.tobytes()  # bit for bit (-0.0 and NaN included)
    offsets = {plane.ctypes.data % 64 for plane in planes}
    if 2 <= channels <= 4:  # OpenCV's split into skewed planes: each plane on its own offset
        assert len(offsets) == channels and all(plane.flags.c_contiguous for plane in planes)


def test_a_crop_view_a_grey_image_and_an_empty_one():
    rng = np.random.RandomState(0)
    big = rng.randint(0, 256, (20, 30, 3)).astype(np.uint8)
    crop = big[3:17, 5:26]  # not contiguous
    assert chw_planes(crop).tobytes() == _reference(crop).tobytes()
    grey = big[:, :, 0].copy()
    assert chw_planes(grey).shape == (1, 20, 30) and chw_planes(grey).tobytes() == grey.tobytes()
    empty = np.zeros((0, 4, 3), np.uint8)
    assert chw_planes(empty).shape == (3, 0, 4)


@pytest.mark.parametrize("channels, dtype", [(1, np.uint8), (3, np.uint8), (4, np.float32), (2, np.float64)])
def test_skewed_planes_start_skew_bytes_apart(channels, dtype):
    planes = skewed_planes(channels, 16, 16, dtype)  # 16 x 16 planes: every plane a multiple of 64 bytes
    assert planes.shape == (channels, 16, 16) and planes.dtype == dtype
    base = planes[0].ctypes.data % 64
    assert [(plane.ctypes.data - planes[0].ctypes.data) % 64 for plane in planes] == [
        SKEW * c % 64 for c in range(channels)]
    assert base == 0 and all(plane.flags.c_contiguous for plane in planes)


@pytest.mark.parametrize("flag_name, force", [("IMREAD_COLOR", {"force_color": True}), ("IMREAD_UNCHANGED", {})])
def test_an_encoded_datum_decodes_to_numpys_transposed_pixels(flag_name, force):
    rng = np.random.RandomState(1)
    image = rng.randint(0, 256, (12, 9, 4 if flag_name == "IMREAD_UNCHANGED" else 3)).astype(np.uint8)
    ok, png = cv2.imencode(".png", image)
    assert ok
    pixels = decode_datum(make_datum(png.tobytes(), 3, encoded=True), **force)
    decoded = cv2.imdecode(png, getattr(cv2, flag_name))
    assert pixels.tobytes() == _reference(decoded).tobytes()
    raw = make_datum(pixels, 3)  # convert_imageset's raw Datum from the planes: NumPy's bytes
    assert raw.data == _reference(decoded).tobytes() and (raw.channels, raw.height, raw.width) == pixels.shape


def test_planes_opencv_wrote_elsewhere_are_copied_in(monkeypatch):
    """``split_into``'s guard: should OpenCV hand back planes of its own, their values still land in ours."""
    from caffe_compat.io import planes as planes_module

    monkeypatch.setattr(planes_module.cv2, "split", lambda image, targets: [image[:, :, c].copy()
                                                                           for c in range(image.shape[2])])
    image = np.random.RandomState(3).randint(0, 256, (5, 6, 3)).astype(np.uint8)
    assert chw_planes(image).tobytes() == _reference(image).tobytes()

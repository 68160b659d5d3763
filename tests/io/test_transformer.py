"""caffe.io.Transformer / load_image: pycaffe's order of operations on hand-computed cases."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

import caffe_compat as caffe
from caffe_compat.errors import CaffeCompatError


def test_load_image_is_rgb_float_in_unit_range(tmp_path):
    bgr = np.zeros((2, 3, 3), np.uint8)
    bgr[0, 0] = (10, 20, 255)  # blue 10, green 20, red 255
    path = tmp_path / "x.png"
    cv2.imwrite(str(path), bgr)
    img = caffe.io.load_image(str(path))
    assert img.dtype == np.float32 and img.shape == (2, 3, 3)
    np.testing.assert_allclose(img[0, 0], [1.0, 20 / 255, 10 / 255], rtol=1e-6)
    grey = caffe.io.load_image(str(path), color=False)
    assert grey.shape == (2, 3, 1)
    assert grey[0, 0, 0] == pytest.approx(0.2125 * 1.0 + 0.7154 * 20 / 255 + 0.0721 * 10 / 255, rel=1e-6)


def test_preprocess_order_and_deprocess_inverse():
    t = caffe.io.Transformer({"data": (1, 3, 4, 5)})
    t.set_transpose("data", (2, 0, 1))
    t.set_channel_swap("data", (2, 1, 0))
    t.set_raw_scale("data", 255)
    t.set_mean("data", np.array([104.0, 117.0, 123.0]))
    t.set_input_scale("data", 0.5)
    x = np.random.RandomState(0).rand(4, 5, 3).astype(np.float32)
    expected = (x.transpose(2, 0, 1)[[2, 1, 0]] * 255 - np.array([104.0, 117.0, 123.0])[:, None, None]) * 0.5
    np.testing.assert_allclose(t.preprocess("data", x), expected, rtol=1e-6)
    np.testing.assert_allclose(t.deprocess("data", t.preprocess("data", x)), x, atol=1e-5)


def test_mean_shape_checked():
    t = caffe.io.Transformer({"data": (1, 3, 4, 5)})
    with pytest.raises(CaffeCompatError, match="Mean shape incompatible"):
        t.set_mean("data", np.zeros((3, 6, 6)))
    with pytest.raises(CaffeCompatError, match="Mean channels incompatible"):
        t.set_mean("data", np.zeros(4))


def test_resize_to_blob_size_preserves_constant_and_range():
    t = caffe.io.Transformer({"data": (1, 3, 8, 8)})
    t.set_transpose("data", (2, 0, 1))
    out = t.preprocess("data", np.full((4, 4, 3), 0.25, np.float32))
    assert out.shape == (3, 8, 8) and np.allclose(out, 0.25)

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


def test_load_image_grey_of_a_colour_image_is_scikit_images_float64_luminance(tmp_path):
    """pycaffe's load_image(color=False) is skimage's imread(as_grey=True): rgb2gray on img_as_float's float64
    values (x * (1 / 255.)), 0.2125 R + 0.7154 G + 0.0721 B summed in float64, then astype(float32)."""
    rgb = np.random.RandomState(7).randint(0, 256, (16, 16, 3)).astype(np.uint8)
    path = tmp_path / "c.png"
    cv2.imwrite(str(path), rgb[:, :, ::-1])
    unit = rgb.astype(np.float64) * (1 / 255.)
    expected = (0.2125 * unit[..., 0] + 0.7154 * unit[..., 1] + 0.0721 * unit[..., 2]).astype(np.float32)
    grey = caffe.io.load_image(str(path), color=False)
    assert grey.dtype == np.float32 and grey.shape == (16, 16, 1)
    assert np.array_equal(grey[:, :, 0], expected)


def test_load_image_errors_are_oserrors_as_pycaffes(tmp_path):
    """pycaffe's skimage/PIL reader raised IOError (FileNotFoundError for a missing path); scripts skip bad
    images with ``except IOError``."""
    from caffe_compat.errors import DataError

    with pytest.raises(FileNotFoundError, match="missing.png: no such file") as missing:
        caffe.io.load_image(str(tmp_path / "missing.png"))
    assert isinstance(missing.value, DataError)
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"not an image at all")
    with pytest.raises(IOError, match="bad.jpg: cannot read image") as unreadable:
        caffe.io.load_image(str(bad))
    assert isinstance(unreadable.value, DataError) and not isinstance(unreadable.value, FileNotFoundError)
    assert str(unreadable.value).startswith(str(bad))


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


def test_a_float64_mean_is_subtracted_in_float64_as_pycaffe():
    """pycaffe keeps the mean's dtype: ``caffe_in -= mean`` rounds the float64 difference once to float32,
    and deprocess adds it back the same way to a copy of the data in the data's own dtype."""
    mean = np.array([104.00698793, 116.66876762, 122.67891434])  # np.load(ilsvrc_2012_mean.npy).mean(1).mean(1)
    t = caffe.io.Transformer({"data": (1, 3, 8, 8)})
    t.set_transpose("data", (2, 0, 1))
    t.set_channel_swap("data", (2, 1, 0))
    t.set_raw_scale("data", 255)
    t.set_mean("data", mean)
    assert t.mean["data"].dtype == np.float64 and t.mean["data"].shape == (3, 1, 1)
    x = np.random.RandomState(0).rand(8, 8, 3).astype(np.float32)
    scaled = x.transpose(2, 0, 1)[[2, 1, 0]] * np.float32(255)  # float32, as pycaffe's in-place raw scale
    expected = (scaled.astype(np.float64) - mean[:, None, None]).astype(np.float32)
    out = t.preprocess("data", x)
    assert out.dtype == np.float32 and np.array_equal(out, expected)
    back = ((out.astype(np.float64) + mean[:, None, None]).astype(np.float32) / np.float32(255))[[2, 1, 0]]
    restored = t.deprocess("data", out[None])
    assert restored.dtype == np.float32 and np.array_equal(restored, back.transpose(1, 2, 0))
    assert t.deprocess("data", out[None].astype(np.float64)).dtype == np.float64


def test_preprocess_scales_a_float32_image_at_blob_size_in_place_as_pycaffe():
    """pycaffe's preprocess starts from ``data.astype(np.float32, copy=False)`` and applies raw_scale, mean and
    input_scale in place: a float32 H×W×C image already at the blob size, transposed (a view) but not
    channel-swapped (a copy), is itself changed, so preprocessing it a second time scales it again.  A
    channel swap, a resize or another dtype leave the caller's array alone.  Before, ours always copied."""
    t = caffe.io.Transformer({"data": (1, 3, 2, 2)})
    t.set_transpose("data", (2, 0, 1))
    t.set_raw_scale("data", 255)
    t.set_mean("data", np.array([1.0, 2.0, 3.0]))
    x = np.full((2, 2, 3), 0.5, np.float32)
    first = t.preprocess("data", x)
    assert np.array_equal(first[:, 0, 0], [126.5, 125.5, 124.5])
    assert np.array_equal(x[0, 0], [126.5, 125.5, 124.5])  # the caller's image now holds the result
    assert np.array_equal(t.preprocess("data", x)[:, 0, 0], [126.5 * 255 - 1, 125.5 * 255 - 2, 124.5 * 255 - 3])
    t.set_channel_swap("data", (2, 1, 0))
    y = np.full((2, 2, 3), 0.5, np.float32)
    t.preprocess("data", y)
    assert np.all(y == 0.5)
    z = np.full((2, 2, 3), 0.5, np.float64)
    t.preprocess("data", z)
    assert np.all(z == 0.5)


def test_subclasses_reach_pycaffes_private_input_check():
    """Scripts subclass Transformer and call pycaffe's name-mangled check, _Transformer__check_input."""
    class Cropper(caffe.io.Transformer):
        def set_crop(self, in_, size):
            caffe.io.Transformer._Transformer__check_input(self, in_)
            self.crop = {in_: size}

    t = Cropper({"data": (1, 3, 8, 8)})
    t.set_crop("data", 4)
    assert t.crop == {"data": 4}
    with pytest.raises(Exception, match="label is not one of the net inputs") as raised:
        t.set_crop("label", 4)
    assert isinstance(raised.value, CaffeCompatError)


def test_mean_shape_checked():
    """pycaffe raises ValueError here (scripts catch it), ours is also a CaffeCompatError."""
    t = caffe.io.Transformer({"data": (1, 3, 4, 5)})
    for mean, message in ((np.zeros((3, 6, 6)), "Mean shape incompatible"), (np.zeros(4), "Mean channels incompatible"),
                          (np.zeros((1, 1, 3, 4, 5)), "Mean shape invalid")):
        with pytest.raises(ValueError, match=message) as raised:
            t.set_mean("data", mean)
        assert isinstance(raised.value, CaffeCompatError)


def test_resize_to_blob_size_preserves_constant_and_range():
    t = caffe.io.Transformer({"data": (1, 3, 8, 8)})
    t.set_transpose("data", (2, 0, 1))
    out = t.preprocess("data", np.full((4, 4, 3), 0.25, np.float32))
    assert out.shape == (3, 8, 8) and np.allclose(out, 0.25)


# ------------------------------------------------------------- pycaffe's other caffe.io helpers

def _ramp_image(length: int) -> np.ndarray:  # values 0..length-1 along the width, 1 row, 1 channel
    return np.arange(length, dtype=np.float32).reshape(1, length, 1)


@pytest.mark.parametrize("order", [0, 1])
def test_resize_image_of_a_constant_image_is_the_constant(order):
    out = caffe.io.resize_image(np.full((4, 5, 3), 0.3, np.float64), (7, 9), interp_order=order)
    assert out.dtype == np.float32 and out.shape == (7, 9, 3) and np.all(out == np.float32(0.3))


def test_resize_image_samples_at_half_pixel_centres():
    """Bilinear 2x of a ramp 0..3: output o samples x = (o + 0.5)/2 - 0.5 (scikit-image's and OpenCV's
    convention); the outermost samples (x = -0.25, 3.25) take the edge value (OpenCV replicates it;
    pycaffe's scikit-image mode='constant' blends them with the minimum: the documented difference)."""
    up = caffe.io.resize_image(_ramp_image(4), (1, 8))[0, :, 0]
    expected = np.clip(np.arange(8) / 2 - 0.25, 0, 3)
    np.testing.assert_allclose(up, expected, atol=1e-6)
    down = caffe.io.resize_image(_ramp_image(8), (1, 4))[0, :, 0]  # x = 2o + 0.5, no anti-aliasing
    np.testing.assert_allclose(down, np.arange(4) * 2 + 0.5, atol=1e-6)
    nearest = caffe.io.resize_image(_ramp_image(4), (1, 8), interp_order=0)[0, :, 0]
    np.testing.assert_array_equal(nearest, np.repeat(np.arange(4), 2))
    shape = caffe.io.resize_image(np.random.RandomState(0).rand(5, 6, 4), (10, 3)).shape
    assert shape == (10, 3, 4)  # any channel count


@pytest.mark.parametrize("channels", [2, 4])
def test_resize_image_of_other_channel_counts_samples_corner_aligned_as_scipy_zoom(channels):
    """pycaffe resizes images of other than 1 or 3 channels with scipy.ndimage.zoom: output (i, j) samples
    the input at (i (H-1)/(H'-1), j (W-1)/(W'-1)), corners on corners.  A plane 10 y + x (and its
    multiples per channel) is reproduced exactly by bilinear sampling: 4x5 -> 7x9 samples y = i/2, x = j/2."""
    y, x = np.mgrid[0:4, 0:5].astype(np.float32)
    image = np.stack([(10 * y + x) * (c + 1) for c in range(channels)], axis=-1)
    out = caffe.io.resize_image(image, (7, 9))
    i, j = np.mgrid[0:7, 0:9]
    expected = np.stack([(10 * i / 2 + j / 2) * (c + 1) for c in range(channels)], axis=-1)
    assert out.dtype == np.float32 and out.shape == (7, 9, channels)
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-4)
    nearest = caffe.io.resize_image(image, (7, 9), interp_order=0)
    assert np.array_equal(nearest[-1, -1], image[-1, -1]) and np.array_equal(nearest[0, 0], image[0, 0])
    constant = caffe.io.resize_image(np.full((3, 3, channels), 2.5), (5, 5))
    assert np.all(constant == np.float32(2.5))


def test_resize_image_rejects_bad_input():
    with pytest.raises(CaffeCompatError, match="interp_order must be 0.*or 1"):
        caffe.io.resize_image(np.zeros((2, 2, 3)), (4, 4), interp_order=3)
    with pytest.raises(CaffeCompatError, match="H x W x K"):
        caffe.io.resize_image(np.zeros((2, 2)), (4, 4))
    with pytest.raises(CaffeCompatError, match="positive"):
        caffe.io.resize_image(np.zeros((2, 2, 1)), (0, 4))


def _coded_image(height, width, channels, base=0):  # value = base + 100·y + 10·x + k
    y, x, k = np.meshgrid(np.arange(height), np.arange(width), np.arange(channels), indexing="ij")
    return (base + 100 * y + 10 * x + k).astype(np.float64)


@pytest.mark.parametrize("height, width, crop, centre", [
    (5, 6, (3, 4), (1, 1)),
    (6, 7, (3, 4), (1, 1)),  # pycaffe: centre (3, 3.5) - crop/2 (1.5, 2) = (1.5, 1.5), truncated to (1, 1)
    (7, 9, (2, 2), (2, 3)),  # (3.5, 4.5) - (1, 1) = (2.5, 3.5) -> (2, 3)
])
def test_oversample_gives_corners_centre_and_mirrors_in_pycaffe_order(height, width, crop, centre):
    images = [_coded_image(height, width, 2), _coded_image(height, width, 2, base=1000)]
    crops = caffe.io.oversample(images, crop)
    ch, cw = crop
    assert crops.dtype == np.float32 and crops.shape == (20, ch, cw, 2)
    origins = [(0, 0), (0, width - cw), (height - ch, 0), (height - ch, width - cw), centre]
    for n, base in enumerate((0, 1000)):
        for k, (y, x) in enumerate(origins):
            expected = _coded_image(ch, cw, 2, base=base + 100 * y + 10 * x)
            np.testing.assert_array_equal(crops[10 * n + k], expected)
            np.testing.assert_array_equal(crops[10 * n + 5 + k], expected[:, ::-1, :])
    assert caffe.io.oversample(np.stack(images), crop).shape == (20, ch, cw, 2)  # an (N, H, W, K) array works


def test_oversample_rejects_bad_input():
    with pytest.raises(CaffeCompatError, match="does not fit"):
        caffe.io.oversample([np.zeros((4, 4, 3))], (5, 2))
    with pytest.raises(CaffeCompatError, match="image 1 has shape"):
        caffe.io.oversample([np.zeros((4, 4, 3)), np.zeros((5, 4, 3))], (2, 2))
    with pytest.raises(CaffeCompatError, match="H x W x K"):
        caffe.io.oversample([np.zeros((4, 4))], (2, 2))


def test_blobproto_round_trip_with_a_legacy_mean_file():
    from caffe_compat.io.protofiles import read_message
    from caffe_compat.proto import caffe_pb2
    from tests.conftest import fixture_path

    blob = read_message(fixture_path("data/mean.binaryproto"), caffe_pb2.BlobProto(), binary=True)
    assert blob.HasField("num") and not blob.shape.dim  # a legacy 4-D blob, as compute_image_mean writes
    mean = caffe.io.blobproto_to_array(blob)
    expected = np.load(fixture_path("data/source_images.npz"))["mean"]
    assert mean.dtype == np.float64 and mean.shape == (1, 3, 16, 20)  # pycaffe: np.array(blob.data)
    np.testing.assert_array_equal(mean[0], expected)
    diff = np.arange(mean.size, dtype=np.float32).reshape(mean.shape)
    again = caffe.io.array_to_blobproto(mean, diff)
    assert list(again.shape.dim) == [1, 3, 16, 20] and not again.HasField("num")
    np.testing.assert_array_equal(caffe.io.blobproto_to_array(again), mean)
    np.testing.assert_array_equal(caffe.io.blobproto_to_array(again, return_diff=True), diff)
    with pytest.raises(CaffeCompatError, match=r"holds 0 diff values"):
        caffe.io.blobproto_to_array(blob, return_diff=True)
    with pytest.raises(CaffeCompatError, match="diff has shape"):
        caffe.io.array_to_blobproto(mean, diff[0])


def test_blobprotovector_string_round_trip():
    arrays = [np.arange(6, dtype=np.float32).reshape(2, 3), np.float32(2.5) * np.ones((1, 2, 1, 2)), np.float32(7.0)]
    data = caffe.io.arraylist_to_blobprotovector_str(arrays)
    assert isinstance(data, bytes)
    back = caffe.io.blobprotovector_str_to_arraylist(data)
    assert [a.shape for a in back] == [(2, 3), (1, 2, 1, 2), ()]
    for got, want in zip(back, arrays):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(CaffeCompatError, match="not a serialised BlobProtoVector"):
        caffe.io.blobprotovector_str_to_arraylist(b"\xff\xff\xff")


@pytest.mark.parametrize("image", [np.random.default_rng(0).random((4, 5, 3)), np.full((4, 5, 3), 0.3)])
def test_resize_image_beyond_the_memory_budget_is_refused(monkeypatch, image):
    """new_dims (10^6, 10^6) raised OpenCV's cv2.error (Insufficient memory, 4 TB); here (2000, 2000), 48 MB,
    against a budget of 1 MB (a constant image too: its np.full allocated the result without OpenCV)."""
    from caffe_compat.errors import MemoryBudgetError

    monkeypatch.setenv("CAFFE_COMPAT_MEMORY_BUDGET", "1M")
    with pytest.raises(MemoryBudgetError, match=r"resize_image: new_dims \(2000, 2000\) of a 3-channel image"):
        caffe.io.resize_image(image, (2000, 2000))

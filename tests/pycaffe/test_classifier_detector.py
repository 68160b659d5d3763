"""caffe.Classifier and caffe.Detector on a tiny net with known weights: per-window / per-crop channel
means through an InnerProduct, against numbers computed here by hand from the images."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from caffe_compat.errors import CaffeCompatError
from caffe_compat.pycaffe.classifier import Classifier, forward_all
from caffe_compat.pycaffe.detector import Detector, SelectiveSearchUnavailable
from caffe_compat.pycaffe.net import Net
from caffe_compat.pycaffe._mode import TEST

W = np.array([[1.0, -2.0, 0.5], [0.25, 1.0, -1.0]], dtype=np.float32)
B = np.array([0.1, -0.3], dtype=np.float32)
MEAN_BGR = np.array([30.0, 60.0, 90.0], dtype=np.float32)


def _model(tmp_path, batch: int, size: int):
    proto = tmp_path / f"deploy_{batch}_{size}.prototxt"
    proto.write_text(f'layer {{ name: "data" type: "Input" top: "data" input_param {{ shape {{ dim: {batch} dim: 3 '
                     f'dim: {size} dim: {size} }} }} }}\n'
                     'layer { name: "pool" type: "Pooling" bottom: "data" top: "pool" '
                     'pooling_param { pool: AVE global_pooling: true } }\n'
                     'layer { name: "score" type: "InnerProduct" bottom: "pool" top: "score" '
                     'inner_product_param { num_output: 2 } }\n')
    net = Net(str(proto), TEST)
    net.params["score"][0].data[...] = W
    net.params["score"][1].data[...] = B
    weights = tmp_path / f"w_{batch}_{size}.caffemodel"
    net.save(str(weights))
    return str(proto), str(weights)


def _expected(crop_rgb: np.ndarray, input_scale: float = 1.0) -> np.ndarray:
    """The net's output for one H×W×3 RGB crop in [0, 1] after swap to BGR, x255, -mean, x input_scale."""
    bgr = crop_rgb[:, :, ::-1].astype(np.float64) * 255.0 - MEAN_BGR
    return W.astype(np.float64) @ (bgr.mean(axis=(0, 1)) * input_scale) + B


def _images(n: int, size: int, seed: int = 0):
    rng = np.random.RandomState(seed)
    return [rng.uniform(0, 1, (size, size, 3)).astype(np.float32) for _ in range(n)]


def test_classifier_oversamples_ten_crops_and_averages(tmp_path):
    proto, weights = _model(tmp_path, batch=3, size=4)  # 2 images x 10 crops = 20: 7 batches, the last padded
    clf = Classifier(proto, weights, image_dims=(6, 6), mean=MEAN_BGR, raw_scale=255, channel_swap=(2, 1, 0),
                     input_scale=0.5)
    assert list(clf.crop_dims) == [4, 4] and tuple(clf.image_dims) == (6, 6)
    images = _images(2, 6)
    predictions = clf.predict(images)
    assert predictions.shape == (2, 2)
    for image, prediction in zip(images, predictions):
        offsets = [(0, 0), (0, 2), (2, 0), (2, 2), (1, 1)]  # corners and centre; mirrors have the same means
        expected = np.mean([_expected(image[y:y + 4, x:x + 4], 0.5) for y, x in offsets], axis=0)
        np.testing.assert_allclose(prediction, expected, rtol=1e-4, atol=1e-4)


def test_classifier_centre_crop_and_default_image_dims(tmp_path):
    proto, weights = _model(tmp_path, batch=2, size=4)
    clf = Classifier(proto, weights, image_dims=(8, 8), mean=MEAN_BGR, raw_scale=255, channel_swap=(2, 1, 0))
    images = _images(3, 8, seed=1)
    predictions = clf.predict(images, oversample=False)
    assert predictions.shape == (3, 2)
    for image, prediction in zip(images, predictions):
        np.testing.assert_allclose(prediction, _expected(image[2:6, 2:6]), rtol=1e-4, atol=1e-4)
    same_size = Classifier(proto, weights, mean=MEAN_BGR, raw_scale=255, channel_swap=(2, 1, 0))
    small = _images(1, 4, seed=2)
    np.testing.assert_allclose(same_size.predict(small, oversample=False)[0], _expected(small[0]), rtol=1e-4,
                               atol=1e-4)


def test_forward_all_pads_the_last_batch_and_drops_the_padding(tmp_path):
    proto, weights = _model(tmp_path, batch=4, size=2)
    net = Net(proto, weights, TEST)
    data = np.arange(6 * 3 * 2 * 2, dtype=np.float32).reshape(6, 3, 2, 2)
    out = forward_all(net, data=data)["score"]
    expected = data.mean(axis=(2, 3)) @ W.T + B
    np.testing.assert_allclose(out, expected, rtol=1e-5)
    assert out.shape == (6, 2)


def test_the_generic_forward_all_of_a_net_with_batch_size_0_is_a_zero_division_error():
    # classifier.forward_all on a net without its own forward_all took range(0, total, 0): range()'s ValueError
    class Bare:
        blobs = {"data": np.zeros((0, 3), np.float32)}

        def forward(self, blobs=None, **feed):
            raise AssertionError("no batch to run")

    with pytest.raises(ZeroDivisionError, match="input blob 'data' has batch size 0"):
        forward_all(Bare(), data=np.ones((4, 3), np.float32))


def _png(tmp_path, rgb: np.ndarray) -> str:
    path = str(tmp_path / "image.png")
    cv2.imwrite(path, np.round(rgb[:, :, ::-1] * 255).astype(np.uint8))
    return path


def test_detector_windows_in_order_with_their_predictions(tmp_path):
    proto, weights = _model(tmp_path, batch=2, size=4)
    rgb = np.random.RandomState(3).randint(0, 256, (12, 10, 3)).astype(np.float32) / 255
    path = _png(tmp_path, rgb)
    det = Detector(proto, weights, mean=MEAN_BGR, raw_scale=255, channel_swap=(2, 1, 0))
    windows = [np.array([0, 0, 4, 4]), np.array([5, 3, 9, 7]), np.array([8, 6, 12, 10])]
    detections = det.detect_windows([(path, windows)])
    assert [d["filename"] for d in detections] == [path] * 3
    for detection, window in zip(detections, windows):
        assert detection["window"] is window
        y0, x0, y1, x1 = window
        np.testing.assert_allclose(detection["prediction"], _expected(rgb[y0:y1, x0:x1]), rtol=1e-4, atol=1e-4)
    with pytest.raises(SelectiveSearchUnavailable, match="detect_windows") as info:
        det.detect_selective_search([path])
    assert isinstance(info.value, (CaffeCompatError, NotImplementedError))


def test_detector_context_padding_closed_form(tmp_path):
    proto, weights = _model(tmp_path, batch=1, size=8)
    det = Detector(proto, weights, mean=MEAN_BGR, raw_scale=255, channel_swap=(2, 1, 0), context_pad=2)
    assert list(det.crop_dims) == [8, 8, 3]
    np.testing.assert_allclose(det.crop_mean.reshape(3), MEAN_BGR[::-1] / 255)  # back in RGB, raw scale
    im = np.random.RandomState(4).uniform(0, 1, (16, 16, 3)).astype(np.float32)
    # inside: window (4,4,7,7) grows by 8/(8-4) = 2 around its centre (6, 6): rows and columns 2..9
    np.testing.assert_allclose(det.crop(im, np.array([4, 4, 7, 7])), im[2:10, 2:10], atol=1e-5)
    # at the corner: grown box (-2,-2,6,6), 2 rows/cols outside -> mean padding, the image part 0..5 unscaled
    crop = det.crop(im, np.array([0, 0, 3, 3]))
    np.testing.assert_allclose(crop[2:, 2:], im[0:6, 0:6], atol=1e-5)
    padded = det.transformer.preprocess("data", crop)[:, :2, :]
    np.testing.assert_allclose(padded, 0, atol=1e-4)  # the padding preprocesses to the mean, i.e. 0
    no_context = Detector(proto, weights, context_pad=None)
    np.testing.assert_array_equal(no_context.crop(im, np.array([1, 2, 5, 9])), im[1:5, 2:9])
    zero_mean = Detector(proto, weights, context_pad=2)
    np.testing.assert_array_equal(zero_mean.crop(im, np.array([0, 0, 3, 3]))[:2], 0)


def test_detector_context_padding_keeps_a_float64_mean(tmp_path):
    """pycaffe's crop_mean is the Transformer's mean copied in its dtype (float64 here), so the padding of a
    context crop is float64 m/255 until preprocess rounds it: float32(m/255) x 255 in float32, minus m in float64."""
    proto, weights = _model(tmp_path, batch=1, size=8)
    mean = np.array([104.00698793, 116.66876762, 122.67891434])
    det = Detector(proto, weights, mean=mean, raw_scale=255, channel_swap=(2, 1, 0), context_pad=2)
    assert det.crop_mean.dtype == np.float64
    np.testing.assert_array_equal(det.crop_mean.reshape(3), mean[::-1] / 255)
    im = np.random.RandomState(4).uniform(0, 1, (16, 16, 3)).astype(np.float32)
    crop = det.crop(im, np.array([0, 0, 3, 3]))
    assert crop.dtype == np.float64
    padded = det.transformer.preprocess("data", crop)[:, :2, :]
    raw = (mean / 255).astype(np.float32) * np.float32(255)
    expected = (raw.astype(np.float64) - mean).astype(np.float32)
    assert expected.any()  # not 0: the round trip through float32 leaves a residue pycaffe leaves too
    np.testing.assert_array_equal(padded, np.broadcast_to(expected[:, None, None], padded.shape))

"""The transformer's OpenCV crop paths (caffe_compat.data.hwc_crop) give the numpy path's bytes exactly.

Reference: ``DataTransformer.transform_chw`` on the same pixels laid out C x H x W, which keeps the
element-wise numpy arithmetic (cast, subtract, scale) the Caffe fixtures are checked against in
test_data_transformer.py.
"""

from __future__ import annotations

import itertools
import threading

import cv2
import numpy as np
import pytest

from caffe_compat.data.hwc_crop import _scratch, crop_planes, stream_crop
from caffe_compat.data.transformer import DataTransformer


def _reference(transformer, image_hwc, seed):
    chw = np.ascontiguousarray(image_hwc.transpose(2, 0, 1))
    return transformer.transform_chw(chw, np.random.RandomState(seed))


@pytest.mark.parametrize("channels", [1, 2, 3, 4, 5])
def test_hwc_path_equals_the_numpy_path_bit_for_bit(channels):
    rs = np.random.RandomState(channels)
    height, width = 9, 12
    image = rs.randint(0, 256, (height, width + 3, channels)).astype(np.uint8)[:, 2:2 + width]  # not contiguous
    means = {"none": {}, "one": {"mean_value": [100.3]},
             "each": {"mean_value": list(rs.uniform(0, 255, channels))},
             "file": {"mean_file": rs.uniform(0, 255, (channels, height, width)).astype(np.float32)}}
    cases = 0
    for mirror, crop, mean, scale, phase in itertools.product((False, True), (0, 7), means, (1.0, 0.017),
                                                              ("TRAIN", "TEST")):
        transformer = DataTransformer(crop_size=crop, mirror=mirror, scale=scale, phase=phase, **means[mean])
        for seed in range(4):
            want = _reference(transformer, image, seed)
            assert transformer.transform(image, np.random.RandomState(seed)).tobytes() == want.tobytes()
            for streaming in (False, True):  # into the middle row of a batch: its neighbours stay untouched
                batch = np.full((3, *want.shape), 7.0, np.float32)
                got = transformer.transform(image, np.random.RandomState(seed), out=batch[1], streaming=streaming)
                assert got is batch[1] or np.shares_memory(got, batch[1])
                assert batch[1].tobytes() == want.tobytes()
                assert (batch[0] == 7).all() and (batch[2] == 7).all()
            cases += 1
    assert cases == 2 * 2 * 4 * 2 * 2 * 4


def test_a_224_crop_of_a_decoded_jpeg_streams_into_a_batch_row_like_the_numpy_path(tmp_path):
    rs = np.random.RandomState(0)
    path = tmp_path / "x.jpg"
    assert cv2.imwrite(str(path), rs.randint(0, 256, (256, 256, 3)).astype(np.uint8))
    image = cv2.imread(str(path), cv2.IMREAD_COLOR)
    transformer = DataTransformer(crop_size=224, mirror=True, mean_value=(104, 117, 123), scale=0.5)
    batch = np.empty((4, 3, 224, 224), np.float32)
    for k in range(4):
        transformer.transform(image, np.random.RandomState(k), out=batch[k], streaming=True)
        assert batch[k].tobytes() == _reference(transformer, image, k).tobytes()


@pytest.mark.parametrize("channels", [2, 3, 4])
def test_opencv_casts_bytes_and_subtracts_a_float32_mean_as_numpy_does(channels):
    # stream_crop lets cv2.subtract do Caffe's float32(pixel) - mean from the uint8 window in one pass
    # (dtype=CV_32F): every byte value, odd means, a window with a row stride (a crop), 2 to 4 channels
    rs = np.random.RandomState(channels)
    values = np.arange(256, dtype=np.uint8)
    for trial in range(300):
        mean = rs.uniform(-300, 300, channels) if trial % 2 else rs.uniform(0, 255, channels) / 3
        mean = mean.astype(np.float32)
        image = np.empty((16, 20, channels), np.uint8)
        image[:, 2:18] = values.reshape(16, 16, 1)[:, :, [0] * channels]
        window = image[:, 2:18]
        out = np.full((16, 16, channels), np.nan, np.float32)
        got = cv2.subtract(window, (*map(float, mean), *(0.0,) * (4 - channels)), dst=out, dtype=cv2.CV_32F)
        assert got is out
        want = window.astype(np.float32) - mean  # numpy: the float32 cast, then a float32 subtraction
        assert want.dtype == np.float32 and out.tobytes() == want.tobytes()


@pytest.mark.parametrize("channels", [2, 3, 4])
def test_planes_are_misaligned_by_different_amounts_so_opencv_keeps_them_in_cache(channels):
    planes, _ = _scratch(224, 224, channels)
    assert len({plane.ctypes.data % 64 for plane in planes}) == channels
    assert all(plane.flags.c_contiguous and plane.shape == (224, 224) for plane in planes)


def test_crop_planes_and_stream_crop_decline_what_they_do_not_handle():
    image = np.zeros((8, 8, 5), np.uint8)
    assert crop_planes(image, 0, 0, 4, 4, False) is None
    mean, scale = np.zeros(0, np.float32), np.float32(1)
    assert not stream_crop(image, 0, 0, 4, 4, False, mean, scale, np.zeros((5, 4, 4), np.float32))
    assert not stream_crop(np.zeros((8, 8, 1), np.uint8), 0, 0, 4, 4, False, mean, scale,
                           np.zeros((1, 4, 4), np.float32))
    assert not stream_crop(np.zeros((8, 8, 3), np.uint8), 0, 0, 4, 4, False, mean, scale,
                           np.zeros((3, 4, 8), np.float32)[:, :, ::2])  # a strided out


def test_threads_use_their_own_scratch():
    rs = np.random.RandomState(2)
    images = [rs.randint(0, 256, (40, 40, 3)).astype(np.uint8) for _ in range(8)]
    transformer = DataTransformer(crop_size=32, mirror=True, mean_value=(1.5, 2.5, 3.5), phase="TRAIN")
    want = [[_reference(transformer, image, seed).tobytes() for seed in range(20)] for image in images]
    failures = []

    def work(k):
        for _ in range(5):
            for seed in range(20):
                out = np.empty((3, 32, 32), np.float32)
                transformer.transform(images[k], np.random.RandomState(seed), out=out, streaming=bool(seed % 2))
                if out.tobytes() != want[k][seed]:
                    failures.append((k, seed))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []

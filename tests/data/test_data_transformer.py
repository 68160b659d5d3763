"""DataTransformer and load_image_bgr against real Caffe's Data-layer outputs (tests/fixtures/data).

The fixtures are two TEST-phase forward passes of a Data layer (batch 4) over 6 LMDB records:
``data_iter0`` = records 0..3, ``data_iter1`` = records 4, 5, 0, 1 (wrap-around).  The transform
parameters below are copied by eye from each ``<case>.prototxt``.
"""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from caffe_compat.data.image import load_image_bgr
from caffe_compat.data.transformer import DataTransformer
from caffe_compat.errors import DataError, FormatError
from tests.conftest import fixture_path

RECORDS = {0: [0, 1, 2, 3], 1: [4, 5, 0, 1]}


def _source():
    z = np.load(fixture_path("data/source_images.npz"))
    return z["images_chw_bgr_uint8"], z["labels"], z["mean"]


def _params(case: str, mean: np.ndarray) -> dict:
    return {
        "raw_meanfile_crop12_scale0.5": dict(crop_size=12, mean_file=mean, scale=0.5),
        "raw_meanvalue3_crop12_scale0.017": dict(crop_size=12, mean_value=[104, 117, 123], scale=0.017),
        "raw_meanvalue1_nocrop": dict(mean_value=110.5),
        "raw_no_transform": {},
        "png_meanfile_crop12": dict(crop_size=12, mean_file=mean),
        "jpeg_meanvalue3_crop13": dict(crop_size=13, mean_value=[104, 117, 123]),
    }[case]


@pytest.mark.parametrize(
    "case",
    [
        "raw_meanfile_crop12_scale0.5",
        "raw_meanvalue3_crop12_scale0.017",
        "raw_meanvalue1_nocrop",
        "raw_no_transform",
        "png_meanfile_crop12",
    ],
)
def test_lossless_cases_match_caffe_bit_for_bit(case):
    images, labels, mean = _source()
    expected = np.load(fixture_path(f"data/{case}.npz"))
    transformer = DataTransformer(phase="TEST", **_params(case, mean))
    for iteration, records in RECORDS.items():
        got = np.stack([transformer.transform_chw(images[r]) for r in records])
        want = expected[f"data_iter{iteration}"]
        assert got.dtype == np.float32 and got.shape == want.shape
        assert np.array_equal(got, want), f"{case} iter {iteration}: max |diff| {np.abs(got - want).max()}"
        assert np.array_equal(labels[records].astype(np.float32), expected[f"label_iter{iteration}"])


def test_jpeg_crop13_matches_caffe_on_caffes_decoded_pixels():
    _, _, mean = _source()
    decoded = np.load(fixture_path("data/jpeg_no_transform.npz"))
    pixels = np.concatenate([decoded["data_iter0"], decoded["data_iter1"][:2]])
    assert np.array_equal(pixels, np.round(pixels)) and pixels.min() >= 0 and pixels.max() <= 255
    pixels = pixels.astype(np.uint8)
    expected = np.load(fixture_path("data/jpeg_meanvalue3_crop13.npz"))
    transformer = DataTransformer(phase="TEST", **_params("jpeg_meanvalue3_crop13", mean))
    for iteration, records in RECORDS.items():
        got = np.stack([transformer.transform_chw(pixels[r]) for r in records])
        assert np.array_equal(got, expected[f"data_iter{iteration}"])


def test_hwc_path_through_opencv_png_matches_caffe(tmp_path):
    images, _, mean = _source()
    expected = np.load(fixture_path("data/png_meanfile_crop12.npz"))
    transformer = DataTransformer(phase="TEST", crop_size=12, mean_file=mean[None])
    blobs = []
    for i, image in enumerate(images):
        path = tmp_path / f"img{i}.png"
        assert cv2.imwrite(str(path), np.ascontiguousarray(image.transpose(1, 2, 0)))
        loaded = load_image_bgr(path)
        assert loaded.shape == (16, 20, 3) and loaded.dtype == np.uint8
        blobs.append(transformer.transform(loaded))
    assert np.array_equal(np.stack([blobs[r] for r in RECORDS[0]]), expected["data_iter0"])
    assert np.array_equal(np.stack([blobs[r] for r in RECORDS[1]]), expected["data_iter1"])


def test_train_crop_and_mirror_follow_caffes_draw_order():
    images, _, mean = _source()
    image = images[2]
    transformer = DataTransformer(crop_size=11, mirror=True, mean_file=mean, scale=0.25, phase="TRAIN", seed=5)
    shadow = np.random.RandomState(5)
    seen_offsets, seen_mirror = set(), set()
    for _ in range(300):
        got = transformer.transform_chw(image)
        mirror = bool(shadow.randint(2))
        h_off = shadow.randint(16 - 11 + 1)
        w_off = shadow.randint(20 - 11 + 1)
        window = (slice(None), slice(h_off, h_off + 11), slice(w_off, w_off + 11))
        want = (image[window].astype(np.float32) - mean[window]) * np.float32(0.25)
        if mirror:
            want = want[:, :, ::-1]
        assert np.array_equal(got, want)
        seen_offsets.add((h_off, w_off))
        seen_mirror.add(mirror)
    assert seen_offsets == {(h, w) for h in range(6) for w in range(10)}
    assert seen_mirror == {False, True}


def test_test_phase_centre_crop_and_caffes_random_mirror_quirk():
    images, _, _ = _source()
    image = images[0]
    plain = DataTransformer(crop_size=13, phase="TEST").transform_chw(image)
    assert np.array_equal(plain, image[:, 1:14, 3:16].astype(np.float32))
    mirrored = DataTransformer(crop_size=13, mirror=True, phase="TEST", seed=0)
    outputs = [mirrored.transform_chw(image) for _ in range(40)]
    flips = [np.array_equal(o, plain[:, :, ::-1]) for o in outputs]
    keeps = [np.array_equal(o, plain) for o in outputs]
    assert all(f or k for f, k in zip(flips, keeps))
    assert 5 < sum(flips) < 35  # mirror is random in TEST as well (BVLC Caffe)


def test_single_mean_value_is_replicated_and_scale_comes_after_the_mean():
    image = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(3, 2, 4) * 7
    got = DataTransformer(mean_value=[3.5], scale=0.5, phase="TEST").transform_chw(image)
    assert np.array_equal(got, (image.astype(np.float32) - np.float32(3.5)) * np.float32(0.5))
    hwc = np.ascontiguousarray(image.transpose(1, 2, 0))
    assert np.array_equal(DataTransformer(mean_value=[3.5], scale=0.5, phase=1).transform(hwc), got)


def test_parameter_and_shape_errors():
    images, _, mean = _source()
    with pytest.raises(FormatError, match="mean_file and mean_value"):
        DataTransformer(mean_file=mean, mean_value=[1.0])
    with pytest.raises(FormatError, match="1 mean_value or as many as channels: 3"):
        DataTransformer(mean_value=[1.0, 2.0], phase="TEST").transform_chw(images[0])
    with pytest.raises(DataError, match="smaller than crop_size 17"):
        DataTransformer(crop_size=17, phase="TEST").transform_chw(images[0])
    with pytest.raises(DataError, match="mean_file has shape"):
        DataTransformer(mean_file=mean[:, :12, :12], crop_size=12, phase="TEST").transform_chw(images[0])
    with pytest.raises(DataError, match="unsigned byte"):
        DataTransformer().transform(images[0].transpose(1, 2, 0).astype(np.float32))
    with pytest.raises(FormatError, match="phase"):
        DataTransformer(phase="VAL")


def test_load_image_bgr_resize_gray_and_missing(tmp_path):
    rng = np.random.RandomState(0)
    image = rng.randint(0, 256, size=(16, 20, 3)).astype(np.uint8)
    path = tmp_path / "a.png"
    cv2.imwrite(str(path), image)
    assert np.array_equal(load_image_bgr(path), image)
    resized = load_image_bgr(path, new_height=10, new_width=30)
    assert resized.shape == (10, 30, 3)
    assert np.array_equal(resized, cv2.resize(image, (30, 10), interpolation=cv2.INTER_LINEAR))
    assert np.array_equal(load_image_bgr(path, new_height=10, new_width=0), image)  # Caffe: both or none
    gray = load_image_bgr(path, color=False)
    assert gray.shape == (16, 20, 1)
    assert np.abs(gray[:, :, 0].astype(int) - cv2.cvtColor(image, cv2.COLOR_BGR2GRAY).astype(int)).max() <= 1
    with pytest.raises(DataError, match="missing.jpg"):
        load_image_bgr(tmp_path / "missing.jpg")

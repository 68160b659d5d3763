"""make-lmdb / compute-mean (Caffe's convert_imageset / compute_image_mean) on generated images."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from caffe_compat.cli import main
from caffe_compat.data.imageset import compute_image_mean, convert_imageset, read_list_file
from caffe_compat.errors import DataError
from caffe_compat.io import iter_lmdb, read_blob
from caffe_compat.proto import caffe_pb2


@pytest.fixture
def images(tmp_path):
    rng = np.random.RandomState(3)
    root = tmp_path / "img"
    root.mkdir()
    lines, pixels = [], []
    for i in range(5):
        image = rng.randint(0, 256, size=(6, 7, 3)).astype(np.uint8)
        cv2.imwrite(str(root / f"a{i}.png"), image)
        lines.append(f"a{i}.png {i % 2}")
        pixels.append(image)
    (tmp_path / "list.txt").write_text("\n".join(lines) + "\n")
    return tmp_path, pixels


def test_raw_lmdb_keys_labels_and_pixels(images):
    tmp, pixels = images
    n = convert_imageset(tmp / "list.txt", tmp / "img", tmp / "db", progress=False)
    assert n == 5
    records = list(iter_lmdb(tmp / "db"))
    assert [k for k, _, _ in records] == [f"{i:08d}_a{i}.png" for i in range(5)]
    for (key, img, label), src, i in zip(records, pixels, range(5)):
        np.testing.assert_array_equal(img, src.transpose(2, 0, 1))
        assert label == i % 2


def test_encoded_stores_file_bytes_unchanged(images):
    tmp, _ = images
    convert_imageset(tmp / "list.txt", tmp / "img", tmp / "db", encoded=True, progress=False)
    _, datum, _ = next(iter_lmdb(tmp / "db", decode=False))
    assert isinstance(datum, caffe_pb2.Datum) and datum.encoded
    assert datum.data == (tmp / "img" / "a0.png").read_bytes()


def test_resize_uses_opencv_bilinear(images):
    tmp, pixels = images
    convert_imageset(tmp / "list.txt", tmp / "img", tmp / "db", resize=(4, 5), progress=False)
    _, img, _ = next(iter_lmdb(tmp / "db"))
    np.testing.assert_array_equal(img, cv2.resize(pixels[0], (5, 4)).transpose(2, 0, 1))


def test_compute_mean_is_float32_average(images, tmp_path):
    tmp, pixels = images
    convert_imageset(tmp / "list.txt", tmp / "img", tmp / "db", progress=False)
    assert main(["compute-mean", str(tmp / "db"), str(tmp / "mean.binaryproto")]) == 0
    mean = read_blob(tmp / "mean.binaryproto")
    expected = np.zeros((3, 6, 7), np.float32)
    for p in pixels:
        expected += p.transpose(2, 0, 1).astype(np.float32)
    np.testing.assert_array_equal(mean, (expected / np.float32(5))[None])
    np.testing.assert_array_equal(compute_image_mean(tmp / "db"), mean)
    blob = caffe_pb2.BlobProto.FromString((tmp / "mean.binaryproto").read_bytes())
    assert (blob.num, blob.channels, blob.height, blob.width) == (1, 3, 6, 7)


def test_list_file_errors_name_line(tmp_path):
    bad = tmp_path / "list.txt"
    bad.write_text("a.png 0\nb.png x\n")
    with pytest.raises(DataError, match=r"list.txt:2: label 'x' is not an integer"):
        read_list_file(bad)


def test_cli_make_lmdb_refuses_existing_output(images, capsys):
    tmp, _ = images
    assert main(["make-lmdb", str(tmp / "list.txt"), str(tmp / "img"), str(tmp / "db")]) == 0
    assert main(["make-lmdb", str(tmp / "list.txt"), str(tmp / "img"), str(tmp / "db")]) == 2
    assert "already exists" in capsys.readouterr().err


def test_cli_make_toy_data_cub(tmp_path):
    from caffe_compat.data import read_cub200

    assert main(["make-toy-data", "cub", str(tmp_path / "CUB_200_2011"), "--size", "32"]) == 0
    train = read_cub200(tmp_path / "CUB_200_2011", "train")
    test = read_cub200(tmp_path / "CUB_200_2011", "test")
    assert train and test and not ({r.label for r in train} & {r.label for r in test})

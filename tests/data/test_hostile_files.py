"""Foreign exceptions from h5py and OpenCV on hostile files become typed errors (issue #19): a corrupt
or truncated HDF5 file, a group or a string dataset where a top's dataset should be, a gzip "bomb" whose
declared size exceeds the memory budget, an image OpenCV cannot decode or a resize it cannot allocate."""

from __future__ import annotations

import re

import cv2
import numpy as np
import pytest

from caffe_compat.data.hdf5 import read_hdf5_tops
from caffe_compat.data.image import load_image_bgr
from caffe_compat.errors import CaffeCompatError, DataError, FormatError

h5py = pytest.importorskip("h5py")
WHERE = "layer 'h5' (HDF5Data)"
WHERE_RE = re.escape(WHERE)


@pytest.fixture
def h5file(tmp_path):
    path = tmp_path / "a.h5"
    with h5py.File(path, "w") as f:
        f["data"] = np.arange(12, dtype=np.float64).reshape(4, 3)
        f["label"] = np.arange(4)
        f.create_group("group")
        f["names"] = np.array([b"abc", b"def"])
        f.create_dataset("bomb", shape=(200_000, 100_000), dtype="f8", compression="gzip", chunks=(1000, 1000))
    return path


def test_valid_datasets_read_as_float32(h5file):
    data, label = read_hdf5_tops(h5file, ["data", "label"], WHERE)
    assert data.dtype == label.dtype == np.float32
    np.testing.assert_array_equal(data, np.arange(12).reshape(4, 3))
    np.testing.assert_array_equal(label, np.arange(4))


@pytest.mark.parametrize("top, error, message", [
    ("missing", DataError, "has no dataset 'missing'"),
    ("group", FormatError, "'group' is a Group, not a dataset"),
    ("names", FormatError, "dataset 'names' holds |S3 values"),
    ("bomb", DataError, r"dataset 'bomb' of shape \(200000, 100000\) \(float64\) needs 240000000000 bytes"
                        r".*memory budget"),
])
def test_wrong_datasets_are_typed_errors_naming_file_and_dataset(h5file, top, error, message):
    with pytest.raises(error, match=f"{WHERE_RE}: .*{message}"):
        read_hdf5_tops(h5file, [top], WHERE)


def test_the_budget_counts_every_dataset_before_reading(h5file):
    # as stored plus as float32: data 12 * (8 + 4) = 144 bytes fits in 150, label's 48 more do not
    assert len(read_hdf5_tops(h5file, ["data"], WHERE, max_bytes=150)) == 1
    with pytest.raises(DataError, match="dataset 'label' .* more than the memory budget of 150 bytes"):
        read_hdf5_tops(h5file, ["data", "label"], WHERE, max_bytes=150)


@pytest.mark.parametrize("damage", ["truncated", "random_tail", "zeroed_superblock", "not_hdf5"])
def test_damaged_hdf5_files_are_data_errors_naming_the_file(h5file, tmp_path, damage):
    raw = h5file.read_bytes()
    broken = tmp_path / "broken.h5"
    rng = np.random.RandomState(3)
    broken.write_bytes({"truncated": raw[:len(raw) // 3],
                        "random_tail": raw[:600] + rng.bytes(len(raw) - 600),
                        "zeroed_superblock": bytes(64) + raw[64:],
                        "not_hdf5": b"not an hdf5 file"}[damage])
    with pytest.raises(CaffeCompatError, match=f"{WHERE_RE}: .*broken.h5") as info:
        read_hdf5_tops(broken, ["data", "label"], WHERE, named_by="files.txt")
    assert isinstance(info.value, (DataError, FormatError))


def test_hdf5_data_layer_reports_a_bomb_and_a_corrupt_file(h5file, tmp_path, monkeypatch):
    from caffe_compat.net import CaffeNet

    monkeypatch.chdir(tmp_path)
    text = ('layer { name: "h5" type: "HDF5Data" top: "bomb" hdf5_data_param { source: "files.txt" '
            'batch_size: 2 } }')
    (tmp_path / "files.txt").write_text("a.h5\n")
    with pytest.raises(DataError, match=r"layer 'h5' \(HDF5Data\): a.h5: dataset 'bomb' .* memory budget"):
        CaffeNet(text.encode())
    (tmp_path / "a.h5").write_bytes(h5file.read_bytes()[:700])
    with pytest.raises(DataError, match=r"layer 'h5' \(HDF5Data\): cannot read a.h5"):
        CaffeNet(text.encode())


def test_undecodable_image_and_unallocatable_resize_are_data_errors(tmp_path):
    garbage = tmp_path / "garbage.png"
    garbage.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(100))
    with pytest.raises(DataError, match="garbage.png: could not open or find the image"):
        load_image_bgr(garbage)
    # the list entry (or field) that named it, as every other refusal of this function says
    with pytest.raises(DataError, match=r"garbage.png \(named by list.txt:3\): could not open or find the image"):
        load_image_bgr(garbage, what="list.txt:3")
    good = tmp_path / "good.png"
    assert cv2.imwrite(str(good), np.zeros((4, 5, 3), np.uint8))
    assert load_image_bgr(good, new_height=6, new_width=7).shape == (6, 7, 3)
    with pytest.raises(DataError, match=r"good.png \(named by list.txt:1\): resizing to new_height 1000000 x "
                                        r"new_width 1000000 needs 3000000000000 bytes, more than the memory budget"):
        load_image_bgr(good, new_height=10 ** 6, new_width=10 ** 6, what="list.txt:1")


def test_opencv_errors_while_decoding_are_data_errors(tmp_path, monkeypatch):
    good = tmp_path / "good.png"
    assert cv2.imwrite(str(good), np.zeros((4, 5, 3), np.uint8))

    def failing_imread(*args):
        raise cv2.error("OpenCV(4) loadsave.cpp: error: (-4:Insufficient memory) Failed to allocate")

    monkeypatch.setattr(cv2, "imread", failing_imread)
    with pytest.raises(DataError, match=r"good.png \(named by x\): OpenCV could not decode the image \(.*Insufficient"):
        load_image_bgr(good, what="x")


def test_bool_and_enum_datasets_are_refused_like_caffe(tmp_path):
    """Caffe's hdf5_load_nd_dataset reads only the H5T_FLOAT and H5T_INTEGER classes and LOG(FATAL)s
    "Unsupported datatype class: H5T_ENUM" otherwise; h5py stores a numpy bool array as an H5T_ENUM.  Before,
    ours read a bool label dataset as 0/1 floats.  Integers and float16 (H5T_FLOAT) still read as float32."""
    path = tmp_path / "kinds.h5"
    with h5py.File(path, "w") as f:
        f["flags"] = np.array([True, False, True])
        f["codes"] = np.array([1, 2, 1], dtype=h5py.enum_dtype({"A": 1, "B": 2}, basetype="i1"))
        f["ints"] = np.array([1, -2, 3], dtype=np.int16)
        f["halves"] = np.array([0.5, 1.5, -2], dtype=np.float16)
    for name, dtype in (("flags", "bool"), ("codes", "int8")):
        with pytest.raises(FormatError, match=f"{WHERE_RE}: .*dataset '{name}' holds {dtype} values \\(H5T_ENUM\\), "
                                              f"Caffe reads only H5T_FLOAT and H5T_INTEGER"):
            read_hdf5_tops(path, [name], WHERE)
    ints, halves = read_hdf5_tops(path, ["ints", "halves"], WHERE)
    assert ints.tolist() == [1, -2, 3] and halves.tolist() == [0.5, 1.5, -2] and halves.dtype == np.float32

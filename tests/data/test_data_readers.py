"""Native-layout readers on generated toy trees, and their error messages."""

from __future__ import annotations

import collections
import shutil

import cv2
import numpy as np
import pytest
import torch

from caffe_compat.data import (
    Cub200,
    DataTransformer,
    StanfordOnlineProducts,
    VehicleID,
    categories_of,
    labels_of,
    make_toy_data,
    read_cub200,
    read_sop,
    read_vehicle_models,
    read_vehicleid,
)
from caffe_compat.errors import DataError


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    base = tmp_path_factory.mktemp("toy")
    return {kind: make_toy_data(kind, base / kind, seed=3) for kind in ("cub", "sop", "vehicleid")}


def _copy(tree, tmp_path):
    target = tmp_path / "copy"
    shutil.copytree(tree, target)
    return target


def test_cub_split_is_class_disjoint_first_half_train(trees):
    train, test = read_cub200(trees["cub"], "train"), read_cub200(trees["cub"], "test")
    assert len(train) == len(test) == 10 * 12
    assert sorted(set(labels_of(train))) == list(range(1, 11))
    assert sorted(set(labels_of(test))) == list(range(11, 21))
    assert len(read_cub200(trees["cub"], "all")) == 240
    assert [r.image_id for r in train[:3]] == ["1", "2", "3"]
    assert all(r.path.is_file() and r.path.suffix == ".jpg" for r in train + test)
    # class folder and label agree, as in the real tree (001.Black_footed_Albatross/...)
    assert all(int(r.path.parent.name.split(".")[0]) == r.label for r in train + test)
    assert set(categories_of(train)) == {-1}


def test_cub_accepts_the_parent_directory(trees, tmp_path):
    parent = tmp_path / "datasets"
    shutil.copytree(trees["cub"], parent / "CUB_200_2011")
    assert [r.image_id for r in read_cub200(parent, "test")] == [r.image_id for r in read_cub200(trees["cub"], "test")]


def test_sop_splits_and_super_classes(trees):
    train, test = read_sop(trees["sop"], "train"), read_sop(trees["sop"], "test")
    assert not set(labels_of(train)) & set(labels_of(test))
    assert len(set(labels_of(train))) == len(set(labels_of(test))) == 30
    assert set(categories_of(train)) == set(categories_of(test)) == set(range(1, 11))
    counts = collections.Counter(labels_of(train).tolist() + labels_of(test).tolist())
    assert min(counts.values()) >= 2 and max(counts.values()) <= 6
    assert all(r.path.parent.name == f"digit{r.category - 1}_final" and r.path.suffix == ".JPG" for r in train)
    ids = [int(r.image_id) for r in train + test]
    assert ids == list(range(1, len(ids) + 1))


def test_vehicleid_lists_sizes_and_models(trees):
    train = read_vehicleid(trees["vehicleid"], "train")
    sets = {s: read_vehicleid(trees["vehicleid"], s) for s in ("small", "medium", "large")}
    assert len(set(labels_of(train))) == 40 and len(train) == 320
    assert [len(set(labels_of(sets[s]))) for s in ("small", "medium", "large")] == [8, 16, 24]
    assert not set(labels_of(train)) & set(labels_of(sets["large"]))
    assert set(labels_of(sets["small"])) < set(labels_of(sets["medium"])) < set(labels_of(sets["large"]))
    models = read_vehicle_models(trees["vehicleid"])
    cats = categories_of(train)
    assert (cats >= 0).sum() == 160 and (cats < 0).sum() == 160  # half labelled
    assert all(r.category == models.get(r.label, -1) for r in train)
    assert all(r.path.name == f"{r.image_id}.jpg" and r.path.parent.name == "image" for r in train)
    assert set(categories_of(read_vehicleid(trees["vehicleid"], "train", with_models=False))) == {-1}


def test_dataset_wrappers_decode_and_transform(trees):
    transformer = DataTransformer(crop_size=48, mean_value=[104, 117, 123], phase="TEST")
    for dataset in (
        Cub200(trees["cub"], "train", transformer),
        StanfordOnlineProducts(trees["sop"], "test", transformer),
        VehicleID(trees["vehicleid"], "small", transformer),
    ):
        image, label = dataset[3]
        record = dataset.records[3]
        assert isinstance(image, torch.Tensor) and image.dtype == torch.float32 and image.shape == (3, 48, 48)
        assert label == record.label
        raw = cv2.imread(str(record.path), cv2.IMREAD_COLOR).transpose(2, 0, 1).astype(np.float32)
        want = raw[:, 8:56, 8:56] - np.array([104, 117, 123], np.float32)[:, None, None]
        assert np.array_equal(image.numpy(), want)
    resized = Cub200(trees["cub"], "test", new_height=40, new_width=50)
    assert resized[0][0].shape == (3, 40, 50)


def _malform(path, line_number, text):
    lines = path.read_text().splitlines()
    lines[line_number - 1] = text
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize(
    "kind, relative, line, text, reader",
    [
        ("cub", "images.txt", 7, "7", lambda root: read_cub200(root, "train")),
        ("cub", "image_class_labels.txt", 5, "5 x", lambda root: read_cub200(root, "train")),
        ("cub", "classes.txt", 2, "2", lambda root: read_cub200(root)),
        ("sop", "Ebay_test.txt", 4, "12 3 4", lambda root: read_sop(root, "test")),
        ("sop", "Ebay_train.txt", 9, "9 1 one digit0_final/x.JPG", lambda root: read_sop(root, "train")),
        ("vehicleid", "train_test_split/train_list.txt", 11, "0000011", lambda root: read_vehicleid(root)),
        ("vehicleid", "train_test_split/test_list_1600.txt", 3, "0000323 4 5", lambda root: read_vehicleid(root, "medium")),
        ("vehicleid", "attribute/model_attr.txt", 2, "1 b", lambda root: read_vehicleid(root, "small")),
    ],
)
def test_malformed_line_names_file_and_line(trees, tmp_path, kind, relative, line, text, reader):
    root = _copy(trees[kind], tmp_path)
    _malform(root / relative, line, text)
    with pytest.raises(DataError) as info:
        reader(root)
    assert f"{root / relative}:{line}:" in str(info.value)


@pytest.mark.parametrize("kind, read", [
    ("cub", lambda root: read_cub200(root, "test")),
    ("sop", lambda root: read_sop(root, "test")),
    ("vehicleid", lambda root: read_vehicleid(root, "small")),
])
def test_list_files_saved_on_windows_read_alike(trees, tmp_path, kind, read):
    """A UTF-8 byte-order mark, CRLF line ends and trailing blank lines (an editor on Windows) change no record."""
    root = _copy(trees[kind], tmp_path)
    for path in root.rglob("*.txt"):
        path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes().replace(b"\n", b"\r\n") + b"\r\n\r\n")
    def rows(records, base):
        return [(r.path.relative_to(base), r.label, r.image_id, r.category) for r in records]

    assert rows(read(root), root) == rows(read(trees[kind]), trees[kind])


def test_sop_header_with_trailing_blanks_or_tabs(trees, tmp_path):
    """Whitespace after ``path`` (or tabs between the names) is still the header; it was refused as
    "expected the header line 'image_id ... path', got 'image_id ... path'"."""
    root = _copy(trees["sop"], tmp_path)
    _malform(root / "Ebay_test.txt", 1, "image_id class_id super_class_id path \t")
    _malform(root / "Ebay_train.txt", 1, "image_id\tclass_id\tsuper_class_id\tpath")
    assert len(read_sop(root, "test")) == len(read_sop(trees["sop"], "test"))
    assert len(read_sop(root, "train")) == len(read_sop(trees["sop"], "train"))


def test_missing_files_and_bad_header(trees, tmp_path):
    root = _copy(trees["sop"], tmp_path)
    _malform(root / "Ebay_train.txt", 1, "image_id class path")
    with pytest.raises(DataError, match=r"Ebay_train.txt:1: expected the header line"):
        read_sop(root, "train")
    (root / "Ebay_test.txt").unlink()
    with pytest.raises(DataError, match=r"Ebay_test.txt: file not found"):
        read_sop(root, "test")
    vroot = _copy(trees["vehicleid"], tmp_path / "v")
    (vroot / "image" / "0000005.jpg").unlink()
    with pytest.raises(DataError, match=r"train_list.txt:5: image file not found: .*0000005.jpg"):
        read_vehicleid(vroot)
    assert len(read_vehicleid(vroot, check_files=False)) == 320
    with pytest.raises(DataError, match="split must be one of"):
        read_vehicleid(vroot, "huge")


def test_inconsistent_ids_are_reported(trees, tmp_path):
    root = _copy(trees["cub"], tmp_path)
    _malform(root / "image_class_labels.txt", 3, "3 99")
    with pytest.raises(DataError, match=r"image_class_labels.txt:3: class id 99 is not in classes.txt"):
        read_cub200(root)
    vroot = _copy(trees["vehicleid"], tmp_path / "v")
    with open(vroot / "attribute" / "model_attr.txt", "a") as handle:
        handle.write("0 7\n")
    with pytest.raises(DataError, match=r"model_attr.txt:\d+: vehicle 0 has model 7 here but 0 earlier"):
        read_vehicle_models(vroot)

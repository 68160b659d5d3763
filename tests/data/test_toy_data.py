"""The embedded toy data: deterministic, real digit images, the documented class construction."""

from __future__ import annotations

import builtins
import filecmp

import cv2
import numpy as np
import pytest
from sklearn.datasets import load_digits

from caffe_compat.data import labels_of, make_toy_data, read_cub200, read_sop
from caffe_compat.data.toy import style_name
from caffe_compat.errors import DataError, MemoryBudgetError


def _tree_files(root):
    return sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file())


def test_same_seed_gives_byte_equal_trees_other_seed_differs(tmp_path):
    a = make_toy_data("sop", tmp_path / "a", seed=1, size=32)
    b = make_toy_data("sop", tmp_path / "b", seed=1, size=32)
    c = make_toy_data("sop", tmp_path / "c", seed=2, size=32)
    files = _tree_files(a)
    assert files == _tree_files(b)
    assert all(filecmp.cmp(a / f, b / f, shallow=False) for f in files)
    assert (a / "Ebay_train.txt").read_text() != (c / "Ebay_train.txt").read_text()


def test_cub_images_are_upscaled_tinted_digit_scans(tmp_path):
    root = make_toy_data("cub", tmp_path / "cub", seed=0, size=32, num_classes=40, images_per_class=5)
    records = read_cub200(root, "all")
    assert len(records) == 200 and len(set(labels_of(records))) == 40
    digits = load_digits()
    used = set()
    for record in records[::7]:
        q = record.label - 1
        digit, style = q % 10, q // 10
        assert record.path.parent.name == f"{q + 1:03d}.Digit{digit}_{style_name(style)}"
        scan = int(record.path.stem.rsplit("_", 1)[1])
        assert digits.target[scan] == digit and scan not in used
        used.add(scan)
        image = cv2.imread(str(record.path))
        assert image.shape == (32, 32, 3)
        gray = cv2.resize((digits.images[scan] * 255 / 16).astype(np.float32), (32, 32), interpolation=cv2.INTER_CUBIC)
        # JPEG keeps the digit: strong correlation of every channel with the upscaled scan
        for channel in range(3):
            if image[:, :, channel].std() > 5:
                assert np.corrcoef(gray.ravel(), image[:, :, channel].ravel())[0, 1] > 0.9


def test_each_scan_is_used_by_one_class_only(tmp_path):
    root = make_toy_data("cub", tmp_path / "cub", size=16, num_classes=160, images_per_class=10)
    stems = [r.path.stem.rsplit("_", 1)[1] for r in read_cub200(root, "all")]
    assert len(stems) == 1600 == len(set(stems))


def test_bad_requests_raise_data_error(tmp_path):
    with pytest.raises(DataError, match="kind must be one of"):
        make_toy_data("imagenet", tmp_path / "x")
    with pytest.raises(DataError, match="only 11 scans are left"):
        make_toy_data("cub", tmp_path / "x", num_classes=160, images_per_class=12)
    with pytest.raises(DataError, match="needs 26..160 classes"):
        make_toy_data("vehicleid", tmp_path / "x", num_classes=20)


def test_missing_scikit_learn_is_a_clear_error(tmp_path, monkeypatch):
    real_import = builtins.__import__

    def no_sklearn(name, *args, **kwargs):
        if name.startswith("sklearn"):
            raise ImportError("No module named 'sklearn'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_sklearn)
    with pytest.raises(DataError, match="needs scikit-learn"):
        make_toy_data("sop", tmp_path / "x")


def test_sop_sizes_and_counts_follow_the_seed(tmp_path):
    root = make_toy_data("sop", tmp_path / "s", seed=4, size=16)
    records = read_sop(root, "train") + read_sop(root, "test")
    counts = np.bincount(labels_of(records))[1:]
    assert len(counts) == 60 and counts.min() >= 2 and counts.max() <= 6 and len(set(counts)) > 1


def test_non_empty_target_is_refused_and_left_untouched(tmp_path, capsys):
    from caffe_compat.cli import main

    target = tmp_path / "CUB_200_2011"
    target.mkdir()
    (target / "images.txt").write_text("1 mine.jpg\n")
    assert main(["make-toy-data", "sop", str(target), "--size", "16"]) == 2
    err = capsys.readouterr().err
    assert f"{target}: the folder exists and is not empty" in err and "Traceback" not in err
    assert [p.name for p in target.iterdir()] == ["images.txt"]
    assert (target / "images.txt").read_text() == "1 mine.jpg\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["CUB_200_2011"]  # no temporary sibling left
    (tmp_path / "file").write_text("x")
    with pytest.raises(DataError, match="exists and is not a directory"):
        make_toy_data("cub", tmp_path / "file")


def test_empty_target_folder_is_filled_and_permissions_are_plain(tmp_path):
    target = tmp_path / "sop"
    target.mkdir()
    root = make_toy_data("sop", target, seed=1, size=16)
    assert root == target
    assert (target / "Ebay_train.txt").read_text().startswith("image_id class_id super_class_id path\n")
    assert len(read_sop(target, "train")) + len(read_sop(target, "test")) == len(list(target.rglob("*.JPG")))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sop"]
    assert target.stat().st_mode & 0o777 == 0o777 & ~_umask()


def _umask():
    from caffe_compat.io.atomic import current_umask

    return current_umask()


def test_failure_midway_leaves_no_partial_tree(tmp_path, monkeypatch):
    import caffe_compat.data.toy as toy

    calls = []
    real_write = toy._write

    def failing_write(path, image):
        calls.append(path)
        if len(calls) == 5:
            raise DataError(f"{path}: OpenCV could not write the image")
        real_write(path, image)

    monkeypatch.setattr(toy, "_write", failing_write)
    with pytest.raises(DataError, match="could not write the image"):
        make_toy_data("cub", tmp_path / "cub", size=16)
    assert len(calls) == 5 and calls[0].is_relative_to(tmp_path) and not calls[0].is_relative_to(tmp_path / "cub")
    assert list(tmp_path.iterdir()) == []  # neither the target nor the temporary sibling exists


@pytest.mark.parametrize("size, error, match", [
    (7, DataError, "8..65500 pixels"),
    (65501, DataError, "8..65500 pixels"),             # libjpeg's largest side
    (2 ** 63, DataError, "8..65500 pixels"),           # was OpenCV's "Can't parse 'dsize'" traceback
    (1000, MemoryBudgetError, "1000 x 1000 pixels needs 16000000 bytes"),
])
def test_an_image_size_out_of_reach_is_refused_before_anything_is_written(tmp_path, monkeypatch, size, error, match):
    """The side must fit a JPEG, and rendering one image (16 bytes a pixel at its peak) the memory budget:
    --size 60000 was killed by the kernel for want of memory (rc 137), 2**63 a traceback from OpenCV."""
    monkeypatch.setenv("CAFFE_COMPAT_MEMORY_BUDGET", "8M")
    with pytest.raises(error, match=match):
        make_toy_data("cub", tmp_path / "toy", size=size)
    assert not (tmp_path / "toy").exists()

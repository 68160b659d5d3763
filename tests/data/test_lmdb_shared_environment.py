"""One LMDB environment cache and one Datum decoder for every reader (Data layer, iter_lmdb, compute-mean).

Regression: after a DatumSource (the Data layer's reader) had opened a database, ``iter_lmdb`` /
``compute_image_mean`` on the same path raised py-lmdb's raw "already open in this process" error, so the
data tests failed or passed depending on the order they ran in.
"""

from __future__ import annotations

import shutil

import cv2
import numpy as np
import pytest

from caffe_compat.cli import main
from caffe_compat.data.imageset import compute_image_mean
from caffe_compat.data.lmdb_source import DatumSource
from caffe_compat.errors import DataError
from caffe_compat.io import iter_lmdb, lmdb_length, make_datum, read_blob, write_lmdb
from caffe_compat.io.datum_lmdb import _ENVIRONMENTS, decode_datum, lmdb_environment
from tests.conftest import fixture_path


def _copy_fixture(tmp_path, name):
    # a private copy: the fixture's own environment may already be pinned by another test in this process
    target = tmp_path / name
    shutil.copytree(fixture_path(f"data/{name}"), target)
    return target


def _expected_mean():
    with np.load(fixture_path("data/source_images.npz")) as z:
        images = z["images_chw_bgr_uint8"]
    total = np.zeros(images.shape[1:], np.float32)
    for image in images:
        total += image.astype(np.float32)
    return images, (total / np.float32(len(images)))[None]


def test_iter_lmdb_and_compute_mean_after_a_datum_source_opened_the_db(tmp_path):
    db = _copy_fixture(tmp_path, "lmdb_raw")
    images, mean = _expected_mean()
    source = DatumSource(db)  # pins the environment for the rest of the process
    assert len(source) == 6
    records = list(iter_lmdb(db))  # used to raise lmdb.Error: ... already open in this process
    assert [k for k, _, _ in records] == [f"{i:08d}" for i in range(6)]
    for (_, image, _), src in zip(records, images):
        np.testing.assert_array_equal(image, src)
    assert lmdb_length(db) == 6
    np.testing.assert_array_equal(compute_image_mean(db), mean)
    assert main(["compute-mean", str(db), str(tmp_path / "mean.binaryproto")]) == 0
    np.testing.assert_array_equal(read_blob(tmp_path / "mean.binaryproto"), mean)
    # the Data layer's source still reads after the borrowed readers finished
    image, label = source.image(5)
    np.testing.assert_array_equal(image, images[5])
    # a second source on the same database shares the cached environment
    assert DatumSource(db)._environment() is source._environment()


def test_datum_source_after_iter_lmdb_and_borrowed_environment_is_closed(tmp_path):
    db = _copy_fixture(tmp_path, "lmdb_png")
    images, mean = _expected_mean()
    before = len(_ENVIRONMENTS)
    np.testing.assert_array_equal(compute_image_mean(db), mean)  # PNG is lossless
    assert len(_ENVIRONMENTS) == before  # borrowed, then closed: nothing left open
    import lmdb

    env = lmdb.open(str(db), readonly=True, lock=False)  # a foreign handle can open it again
    env.close()
    source = DatumSource(db)
    np.testing.assert_array_equal(source.image(2)[0], images[2])
    assert [k for k, _, _ in iter_lmdb(db)] == [f"{i:08d}_img{i}.png" for i in range(6)]


def test_foreign_handle_gives_a_clear_data_error(tmp_path):
    import lmdb

    db = _copy_fixture(tmp_path, "lmdb_raw")
    env = lmdb.open(str(db), readonly=True, lock=False)
    try:
        with pytest.raises(DataError, match="already open in this process through another handle"):
            list(iter_lmdb(db))
    finally:
        env.close()
    assert len(list(iter_lmdb(db))) == 6


def test_recreated_database_at_the_same_path_is_read_fresh(tmp_path):
    db = tmp_path / "db"
    write_lmdb(db, [("a", make_datum(np.full((1, 2, 2), 7, np.uint8), 1))])
    assert DatumSource(db).image(0)[0].tolist() == [[[7, 7], [7, 7]]]
    shutil.rmtree(db)
    write_lmdb(db, [("a", make_datum(np.full((1, 2, 2), 9, np.uint8), 2))])
    image, label = DatumSource(db).image(0)
    assert image.tolist() == [[[9, 9], [9, 9]]] and label == 2
    assert next(iter_lmdb(db))[1].tolist() == [[[9, 9], [9, 9]]]


def _png(image):
    ok, buf = cv2.imencode(".png", image)
    assert ok
    return buf.tobytes()


def test_native_decode_keeps_alpha_like_caffes_imread_unchanged(tmp_path):
    # DecodeDatumToCVMatNative uses cv::imdecode(data, -1): an RGBA PNG keeps its 4 channels
    # (IMREAD_ANYCOLOR would have dropped alpha); force_color -> 3, force_gray -> 1.
    bgra = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4) * 9
    datum = make_datum(_png(bgra), 4, encoded=True)
    native = decode_datum(datum)
    assert native.shape == (4, 2, 3)
    np.testing.assert_array_equal(native, bgra.transpose(2, 0, 1))
    color = decode_datum(datum, force_color=True)
    np.testing.assert_array_equal(color, bgra[:, :, :3].transpose(2, 0, 1))
    gray = decode_datum(datum, force_gray=True)
    assert gray.shape == (1, 2, 3)  # libpng's own grey conversion: within 1 of OpenCV's weights
    assert np.abs(gray[0].astype(int) - cv2.cvtColor(bgra, cv2.COLOR_BGRA2GRAY)).max() <= 1
    db = tmp_path / "rgba"
    write_lmdb(db, [("0", datum)])
    assert next(iter_lmdb(db))[1].shape == DatumSource(db).image(0)[0].shape == (4, 2, 3)


def test_sixteen_bit_png_is_refused_by_every_reader(tmp_path):
    deep = (np.arange(12, dtype=np.uint16).reshape(2, 2, 3) * 5000)
    db = tmp_path / "deep"
    write_lmdb(db, [("0", make_datum(_png(deep), 0, encoded=True))])
    with pytest.raises(DataError, match=r"deep\[0\]: decoded image is uint16; Caffe needs 8-bit"):
        list(iter_lmdb(db))
    with pytest.raises(DataError, match="decoded image is uint16"):
        compute_image_mean(db)
    with pytest.raises(DataError, match="decoded image is uint16"):
        DatumSource(db).image(0)


def test_force_flags_on_raw_records_warn_and_use_the_bytes(tmp_path):
    db = _copy_fixture(tmp_path, "lmdb_raw")
    images, _ = _expected_mean()
    with pytest.warns(UserWarning, match="only apply to encoded Datums"):
        records = list(iter_lmdb(db, force_gray=True))
    np.testing.assert_array_equal(records[0][1], images[0])  # 3 channels as stored, like Caffe


def test_borrowed_environment_closes_after_an_error(tmp_path):
    db = _copy_fixture(tmp_path, "lmdb_raw")
    before = len(_ENVIRONMENTS)
    with pytest.raises(RuntimeError):
        with lmdb_environment(db):
            raise RuntimeError("boom")
    assert len(_ENVIRONMENTS) == before

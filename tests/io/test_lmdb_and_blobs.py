"""LMDB Datum databases and binaryproto blobs against the real-Caffe data fixtures."""

from __future__ import annotations

import numpy as np
import pytest

from caffe_compat.errors import DataError
from caffe_compat.io import (array_to_blob, blob_to_array, iter_lmdb, make_datum, read_blob, write_blob,
                             write_lmdb)
from caffe_compat.proto import caffe_pb2
from tests.conftest import fixture_path


def _source():
    with np.load(fixture_path("data/source_images.npz")) as z:
        return z["images_chw_bgr_uint8"], z["labels"], z["mean"]


def test_raw_lmdb_records_equal_source_images():
    images, labels, _ = _source()
    records = list(iter_lmdb(fixture_path("data/lmdb_raw")))
    assert [k for k, _, _ in records] == [f"{i:08d}" for i in range(6)]
    for (key, image, label), src, lab in zip(records, images, labels):
        assert image.dtype == np.uint8
        np.testing.assert_array_equal(image, src)
        assert label == int(lab)


def test_png_lmdb_decodes_losslessly_and_jpeg_close():
    images, _, _ = _source()
    png = [img for _, img, _ in iter_lmdb(fixture_path("data/lmdb_png"))]
    for img, src in zip(png, images):
        np.testing.assert_array_equal(img, src)
    jpeg = [img for _, img, _ in iter_lmdb(fixture_path("data/lmdb_jpeg"))]
    assert max(int(np.abs(a.astype(int) - b).max()) for a, b in zip(jpeg, images)) <= 29  # 4:2:0 chroma


def test_jpeg_lmdb_equals_caffe_decoded_pixels():
    with np.load(fixture_path("data/jpeg_no_transform.npz")) as z:
        caffe0 = z["data_iter0"]
    ours = np.stack([img for _, img, _ in iter_lmdb(fixture_path("data/lmdb_jpeg"))][:4]).astype(np.float32)
    np.testing.assert_array_equal(ours, caffe0)


def test_force_gray_decodes_one_channel():
    _, img, _ = next(iter_lmdb(fixture_path("data/lmdb_png"), force_gray=True))
    assert img.shape[0] == 1


def test_written_lmdb_reads_back_and_is_valid_datum_bytes(tmp_path):
    images, labels, _ = _source()
    out = tmp_path / "db"
    n = write_lmdb(out, ((f"{i:08d}", make_datum(img, int(lab))) for i, (img, lab) in enumerate(zip(images, labels))))
    assert n == 6
    back = list(iter_lmdb(out))
    for (key, img, lab), src, src_lab in zip(back, images, labels):
        np.testing.assert_array_equal(img, src)
        assert lab == int(src_lab)
    import lmdb

    env = lmdb.open(str(out), readonly=True, lock=False)
    with env.begin() as txn:
        raw = txn.get(b"00000000")
    env.close()
    datum = caffe_pb2.Datum.FromString(raw)
    assert (datum.channels, datum.height, datum.width, datum.encoded) == (3, 16, 20, False)
    assert datum.data == images[0].tobytes()
    with pytest.raises(DataError, match="already exists"):
        write_lmdb(out, [])


def test_mean_binaryproto_legacy_dims():
    _, _, mean = _source()
    array = read_blob(fixture_path("data/mean.binaryproto"))
    assert array.shape == (1, 3, 16, 20)
    np.testing.assert_array_equal(array[0], mean.reshape(3, 16, 20))


def test_written_blob_is_byte_identical_to_caffes_mean(tmp_path):
    mean = read_blob(fixture_path("data/mean.binaryproto"))
    out = tmp_path / "mean.binaryproto"
    write_blob(mean[0], out)
    assert out.read_bytes() == fixture_path("data/mean.binaryproto").read_bytes()


def test_double_blob_roundtrip():
    x = np.arange(6, dtype=np.float64).reshape(2, 3) / 7
    np.testing.assert_array_equal(blob_to_array(array_to_blob(x)), x)


def test_double_data_wins_over_data_as_in_blob_from_proto():
    """Blob::FromProto reads double_data whenever the blob has any (and checks its count), data only otherwise."""
    blob = caffe_pb2.BlobProto()
    blob.shape.dim.extend([2])
    blob.data.extend([5.0, 6.0])
    blob.double_data.extend([0.1, 0.2])
    values = blob_to_array(blob)
    assert values.dtype == np.float64
    np.testing.assert_array_equal(values, [0.1, 0.2])
    blob.double_diff.extend([0.3, 0.4])
    blob.diff.extend([7.0, 8.0])
    np.testing.assert_array_equal(blob_to_array(blob, diff=True), [0.3, 0.4])
    del blob.double_data[1:]  # one double value for two: Caffe's CHECK fails although data fits
    with pytest.raises(Exception, match="holds 1 values"):
        blob_to_array(blob)

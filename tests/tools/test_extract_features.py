"""caffe-compat extract-features (Caffe's extract_features) against the real-Caffe fixtures.

The layer zoo (weights, inputs from its blobs.npz) written as LMDB, npy and HDF5 must hold Caffe's blobs;
the LMDB is read back with the project's own reader (keys ``caffe::format_int(i, 10)``, Datum shape
``channels/height/width`` from the blob).  The Data-layer fixture over two batches must give Caffe's two
batches (LMDB records 0-3, then 4, 5, 0, 1) in order.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from caffe_compat.cli import main
from caffe_compat.io import iter_lmdb
from caffe_compat.tools.features import datum_key
from tests.conftest import fixture_path

ZOO = fixture_path("layer_zoo")


def _read(fmt: str, path, blob: str) -> np.ndarray:
    if fmt == "npy":
        return np.load(path)
    if fmt == "hdf5":
        h5py = pytest.importorskip("h5py")
        with h5py.File(path, "r") as fh:
            return fh[blob][()]
    records = list(iter_lmdb(path))
    assert [key for key, _, _ in records] == [datum_key(i) for i in range(len(records))]
    return np.stack([image for _, image, _ in records])


@pytest.mark.parametrize("fmt", ["lmdb", "npy", "hdf5"])
def test_layer_zoo_features_equal_caffes_blobs(tmp_path, fmt, capsys):
    ref = np.load(ZOO / "blobs.npz")
    out_bn, out_abs = tmp_path / f"bn.{fmt}", tmp_path / f"absval.{fmt}"
    assert main(["extract-features", str(ZOO / "weights.caffemodel"), str(ZOO / "deploy.prototxt"), "bn,absval",
                 f"{out_bn},{out_abs}", "2", fmt, "--input", f"data={ZOO / 'blobs.npz'}", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "Extracted features of 4 query images for feature blob bn" in out
    assert "Successfully extracted the features!" in out
    for blob, path in (("bn", out_bn), ("absval", out_abs)):
        got = _read(fmt, path, blob)
        expected = np.concatenate([ref[blob]] * 2)  # two batches of the same fed input
        if fmt == "lmdb":  # Datum: channels x height x width, 1 for missing axes
            expected = expected.reshape(len(expected), *(list(ref[blob].shape[1:]) + [1, 1])[:3])
        assert got.dtype == np.float32 and got.shape == expected.shape
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([out_bn.name, out_abs.name])  # no temporaries


def test_data_layer_batches_in_caffes_order(tmp_path, monkeypatch):
    folder = fixture_path("data")
    monkeypatch.chdir(folder)
    ref = np.load("raw_no_transform.npz")
    empty = tmp_path / "empty.caffemodel"
    empty.write_bytes(b"")  # an empty NetParameter: the net has no learnable blobs
    assert main(["extract_features", str(empty), "raw_no_transform.prototxt", "data,label",
                 f"{tmp_path / 'data.npy'},{tmp_path / 'label'}", "2", "npy", "CPU", "0"]) == 0  # Caffe: id unread
    np.testing.assert_array_equal(np.load(tmp_path / "data.npy"), np.concatenate([ref["data_iter0"], ref["data_iter1"]]))
    labels = np.load(tmp_path / "label", allow_pickle=False)
    np.testing.assert_array_equal(labels, np.concatenate([ref["label_iter0"], ref["label_iter1"]]))


def test_errors_exit_2_with_one_line(tmp_path, capsys, monkeypatch):
    base = [str(ZOO / "weights.caffemodel"), str(ZOO / "deploy.prototxt")]
    assert main(["extract-features", *base, "nope", str(tmp_path / "x"), "1", "lmdb"]) == 2
    assert main(["extract-features", *base, "bn,absval", str(tmp_path / "x"), "1", "lmdb"]) == 2
    (tmp_path / "exists").mkdir()
    assert main(["extract-features", *base, "bn", str(tmp_path / "exists"), "1", "lmdb"]) == 2
    assert main(["extract-features", *base, "bn", str(tmp_path / "x"), "1", "leveldb"]) == 2
    monkeypatch.setitem(sys.modules, "h5py", None)
    assert main(["extract-features", *base, "bn", str(tmp_path / "x.h5"), "1", "hdf5", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 5 and all(line.startswith("caffe-compat extract-features: error: ") for line in err)
    assert "Unknown feature blob name nope" in err[0] and "must be equal" in err[1]
    assert "already exists" in err[2] and "leveldb is not supported" in err[3] and "pip install h5py" in err[4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists"]


def test_mode_is_gpu_only_as_exactly_GPU_and_the_device_id_is_read_as_atoi(tmp_path, monkeypatch, capsys):
    """Caffe's extract_features: ``strcmp(argv[7], "GPU") == 0`` (so ``gpu`` runs on the CPU), the device id
    after it read with ``atoi`` and ``CHECK_GE(device_id, 0)``; after any other mode nothing more is read."""
    import json

    from caffe_compat.cli.caffe_flags import atoi

    assert [atoi(t) for t in (" 12x", "abc", "-3", "+4", "", "\t7")] == [12, 0, -3, 4, 0, 7]
    monkeypatch.chdir(fixture_path("data"))
    empty = tmp_path / "empty.caffemodel"
    empty.write_bytes(b"")
    base = [str(empty), "raw_no_transform.prototxt", "label"]
    for i, tail in enumerate((["gpu", "0"], ["Gpu"], ["CPU", "abc"])):
        report = tmp_path / f"{i}.json"
        assert main(["extract_features", *base, str(tmp_path / f"label{i}.npy"), "1", "npy", *tail,
                     "--json", str(report), "--no-progress"]) == 0, tail
        assert json.loads(report.read_text())["device"] == "cpu"
    capsys.readouterr()
    assert main(["extract_features", *base, str(tmp_path / "neg.npy"), "1", "npy", "GPU", "-1"]) == 2
    assert "must be >= 0" in capsys.readouterr().err

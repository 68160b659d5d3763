"""List files are read within a bound (issue #19): an ImageData / convert_imageset list, an HDF5Data source
list, a WindowData file and a data set's table larger than a sixteenth of the memory budget
(``CAFFE_COMPAT_MEMORY_BUDGET``) is refused by name before it is read, with a MemoryBudgetError; a
sparse file declaring a terabyte is refused at once (never read), ``/dev/zero`` is refused as not a
regular file (``tests/io/test_regular_files.py::test_dev_zero_as_list``)."""

from __future__ import annotations

import os

import pytest
from google.protobuf import text_format

from caffe_compat.errors import DataError, MemoryBudgetError, NotRegularFileError
from caffe_compat.io.safe_open import LIST_EXPANSION, list_file_limit, read_list_text
from caffe_compat.proto import caffe_pb2

LIMIT = (1 << 20) // LIST_EXPANSION  # with CAFFE_COMPAT_MEMORY_BUDGET=1M


@pytest.fixture
def small_budget(monkeypatch, tmp_path):
    monkeypatch.setenv("CAFFE_COMPAT_MEMORY_BUDGET", "1M")
    monkeypatch.chdir(tmp_path)
    assert list_file_limit() == LIMIT


def _big_list(path, line: str):
    path.write_text(line * (LIMIT // len(line) + 1))
    assert path.stat().st_size > LIMIT
    return path


def _layer(text: str):
    from caffe_compat.layers import layer_class

    param = text_format.Parse(text, caffe_pb2.LayerParameter())
    return layer_class(param)(param, [], "test")


MESSAGE = f"a list file of \\d+ bytes, more than the {LIMIT} bytes allowed"


def test_the_helper_reads_a_small_list_and_refuses_a_big_one(tmp_path, small_budget):
    (tmp_path / "small.txt").write_text("a.png 1\n")
    assert read_list_text(tmp_path / "small.txt") == "a.png 1\n"
    _big_list(tmp_path / "big.txt", "a.png 1\n")
    with pytest.raises(MemoryBudgetError, match=f"big.txt \\(named by the list\\): {MESSAGE}"):
        read_list_text(tmp_path / "big.txt", "the list")


def test_a_sparse_terabyte_list_is_refused_without_reading_it(tmp_path, monkeypatch):
    from caffe_compat.data.imageset import read_list_file

    monkeypatch.delenv("CAFFE_COMPAT_MEMORY_BUDGET", raising=False)
    sparse = tmp_path / "sparse.txt"
    with open(sparse, "wb") as fh:
        fh.truncate(1 << 40)
    with pytest.raises(MemoryBudgetError, match=f"sparse.txt: a list file of {1 << 40} bytes"):
        read_list_file(sparse)


def test_image_data_source(tmp_path, small_budget):
    _big_list(tmp_path / "list.txt", "images/some/long/path/a.png 1\n")
    with pytest.raises(MemoryBudgetError, match=f"layer 'img' \\(ImageData\\): list.txt \\(named by "
                                                f"image_data_param.source\\): {MESSAGE}"):
        _layer('name: "img" type: "ImageData" top: "data" top: "label" image_data_param { source: "list.txt" }')


def test_hdf5_data_source_list(tmp_path, small_budget):
    pytest.importorskip("h5py")
    _big_list(tmp_path / "files.txt", "some/folder/file.h5\n")
    with pytest.raises(MemoryBudgetError, match=f"files.txt \\(named by layer 'h5' \\(HDF5Data\\) "
                                                f"hdf5_data_param.source\\): {MESSAGE}"):
        _layer('name: "h5" type: "HDF5Data" top: "data" hdf5_data_param { source: "files.txt" batch_size: 1 }')


def test_window_data_file(tmp_path, small_budget):
    _big_list(tmp_path / "w.txt", "# 0\nimg.png\n3\n4\n4\n1\n1 1.0 0 0 3 3\n")
    with pytest.raises(MemoryBudgetError, match=f"w.txt \\(named by layer 'w' \\(WindowData\\) "
                                                f"window_data_param.source\\): {MESSAGE}"):
        _layer('name: "w" type: "WindowData" top: "data" top: "label" transform_param { crop_size: 2 } '
               'window_data_param { source: "w.txt" batch_size: 1 }')


def test_convert_imageset_list_and_cli(tmp_path, small_budget, capsys):
    pytest.importorskip("lmdb")
    from caffe_compat.cli import main
    from caffe_compat.data.imageset import convert_imageset

    _big_list(tmp_path / "list.txt", "a.png 1\n")
    with pytest.raises(MemoryBudgetError, match=f"list.txt: {MESSAGE}"):
        convert_imageset(tmp_path / "list.txt", tmp_path, tmp_path / "db", progress=False)
    assert not (tmp_path / "db").exists()
    assert main(["make-lmdb", str(tmp_path / "list.txt"), str(tmp_path), str(tmp_path / "db")]) == 2
    err = capsys.readouterr().err
    assert "list.txt" in err and "more than the" in err and "Traceback" not in err
    assert not (tmp_path / "db").exists()


def test_data_set_table(tmp_path, small_budget):
    from caffe_compat.data.listfile import read_table

    _big_list(tmp_path / "images.txt", "1 some/path.jpg\n")
    with pytest.raises(MemoryBudgetError, match=f"images.txt: {MESSAGE}"):
        read_table(tmp_path / "images.txt", ("image_id", "path"))


def test_a_list_within_the_budget_still_reads(tmp_path, small_budget):
    from caffe_compat.data.imageset import read_list_file

    (tmp_path / "list.txt").write_text("a.png 1\n" * (LIMIT // 8))
    assert len(read_list_file(tmp_path / "list.txt")) == LIMIT // 8


def test_the_budget_error_is_also_a_data_error_and_dev_zero_is_not_a_regular_file(small_budget):
    from caffe_compat.data.imageset import read_list_file

    with pytest.raises(NotRegularFileError, match="/dev/zero: is a character device"):
        read_list_file("/dev/zero")
    assert issubclass(MemoryBudgetError, DataError)
    assert os.path.exists("/dev/zero")

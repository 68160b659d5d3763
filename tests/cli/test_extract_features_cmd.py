"""``extract-features`` checks every output before it writes any: one it cannot write (a folder) was refused
only after the outputs before it had been written."""

from __future__ import annotations

import pytest

from tests.cli.test_cli_errors import run_cli
from tests.cli.test_wrong_files import TRAINABLE
from tests.conftest import fixture_path

WEIGHTS = fixture_path("nets/googlenet_small/weights.caffemodel")  # no layer of the net (a warning): filler values


@pytest.mark.parametrize("db_type", ["npy", "hdf5"])
def test_a_folder_among_the_outputs_writes_none_of_them(tmp_path, db_type):
    if db_type == "hdf5":
        pytest.importorskip("h5py")
    (tmp_path / "net.prototxt").write_text(TRAINABLE)
    (tmp_path / "adir").mkdir()
    done = run_cli("extract_features", WEIGHTS, "net.prototxt", "ip,data", "f.out,adir", 1, db_type,
                   "--no-progress", cwd=tmp_path)
    assert "Traceback" not in done.stderr and done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1] == "caffe-compat extract_features: error: adir: cannot write (Is a directory)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "net.prototxt"]
    assert list((tmp_path / "adir").iterdir()) == []


def test_the_gpu_flag_is_read(tmp_path):
    """``-gpu ID`` (offered by its help as Caffe's flag) chooses the device: on a machine without CUDA it is
    refused as test and time refuse it (it was parsed and never read, and the CPU ran)."""
    import torch

    (tmp_path / "net.prototxt").write_text(TRAINABLE)
    args = [WEIGHTS, "net.prototxt", "ip", "f.npy", 1, "npy"]
    both = run_cli("extract_features", *args, "GPU", "0", "-gpu", "0", "--no-progress", cwd=tmp_path)
    assert both.returncode == 2 and both.stderr.splitlines()[-1] == (
        "caffe-compat extract_features: error: -gpu 0 and the mode GPU (device 0) both choose the device; give one "
        "of them")
    if torch.cuda.is_available():
        return
    done = run_cli("extract_features", *args, "-gpu", "0", "--no-progress", cwd=tmp_path)
    assert "Traceback" not in done.stderr and done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1].startswith("caffe-compat extract_features: error: -gpu 0: CUDA is not available")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["net.prototxt"]


@pytest.mark.parametrize("count", [2 ** 31, 2 ** 63])
def test_a_batch_count_beyond_int_is_refused_in_one_line(tmp_path, count):
    """Caffe reads num_mini_batches into an ``int``: a larger count is refused when the arguments are parsed (its
    message was numpy's OverflowError, "Python int too large to convert to C long", after the net was built)."""
    (tmp_path / "net.prototxt").write_text(TRAINABLE)
    done = run_cli("extract_features", WEIGHTS, "net.prototxt", "ip", "f.npy", count, "npy", "--no-progress",
                   cwd=tmp_path)
    assert "Traceback" not in done.stderr and done.returncode == 2, done.stderr
    assert "out of range for an int32" in done.stderr and "OverflowError" not in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["net.prototxt"]

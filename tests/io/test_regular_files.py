"""Only regular files: a FIFO, a device, a socket or a directory named where a file is expected -- by a net,
a solver, a solverstate, a list, a layer or the command line -- is refused at once with a typed error
naming it (checked with ``os.stat``, so nothing blocks in ``open()`` and ``/dev/zero`` is never read)."""

from __future__ import annotations

import os
import re
import shutil
import threading

import numpy as np
import pytest
from google.protobuf import text_format

from caffe_compat.errors import CaffeCompatError, DataError, FormatError, NotRegularFileError
from caffe_compat.io import read_net, read_solver, read_solverstate, write_blob
from caffe_compat.io.safe_open import check_regular_file, read_regular_bytes, require_regular_file
from caffe_compat.proto import caffe_pb2
from tests.cli.test_cli_errors import run_cli
from tests.conftest import fixture_path

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo (POSIX)")

TIMEOUT = 5.0  # generous on a loaded machine; a regression blocks forever


def _fifo(folder, name="pipe"):
    path = folder / name
    os.mkfifo(path)
    return path


def _unblock(fifo) -> None:
    """Release a reader blocked in open() on ``fifo`` (a regression) so the test fails instead of hanging."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return
    os.close(fd)


def raises_at_once(fifo, call, match: str | None = None, error=NotRegularFileError):
    """``call()`` raises ``error`` (matching ``match``, default the FIFO's name) within TIMEOUT seconds."""
    outcome: dict = {}

    def target():
        try:
            outcome["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - reported below
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(TIMEOUT)
    if thread.is_alive():
        if fifo is not None:
            _unblock(fifo)
        thread.join(TIMEOUT)
        pytest.fail(f"blocked for more than {TIMEOUT}s (opened {fifo} instead of refusing it)")
    exc = outcome.get("error")
    assert exc is not None, f"no error; returned {outcome.get('value')!r}"
    assert isinstance(exc, error), f"{type(exc).__name__}: {exc}"
    assert isinstance(exc, CaffeCompatError)
    pattern = match if match is not None else os.path.basename(str(fifo))
    assert pattern in str(exc), str(exc)
    return exc


# --------------------------------------------------------------------------- the helper

def test_helper_refuses_each_kind_and_passes_missing_and_regular(tmp_path):
    fifo = _fifo(tmp_path)
    assert "FIFO" in str(raises_at_once(fifo, lambda: check_regular_file(fifo, "the field 'x'"), "the field 'x'"))
    assert "directory" in str(raises_at_once(None, lambda: check_regular_file(tmp_path), str(tmp_path)))
    assert "character device" in str(raises_at_once(None, lambda: check_regular_file("/dev/zero"), "/dev/zero"))
    assert check_regular_file(tmp_path / "missing") is None
    (tmp_path / "f").write_bytes(b"12345")
    assert check_regular_file(tmp_path / "f").st_size == 5
    with pytest.raises(NotRegularFileError, match="5 bytes, more than the 4"):
        check_regular_file(tmp_path / "f", max_bytes=4)
    assert read_regular_bytes(tmp_path / "f", max_bytes=5) == b"12345"


def test_require_regular_file_passes_a_file_and_names_a_missing_one_with_the_callers_error(tmp_path):
    regular = tmp_path / "f.bin"
    regular.write_bytes(b"x")
    assert require_regular_file(str(regular), "the input") == regular
    missing = tmp_path / "missing.bin"
    with pytest.raises(CaffeCompatError) as caught:
        require_regular_file(missing)
    assert type(caught.value) is CaffeCompatError and str(caught.value) == f"{missing}: no such file"
    with pytest.raises(FormatError) as caught:
        require_regular_file(missing, "the input", error=FormatError)
    assert type(caught.value) is FormatError and str(caught.value) == f"{missing}: no such file"
    with pytest.raises(DataError) as caught:
        require_regular_file(missing, "--weights", error=DataError, missing=f"run: --weights {missing}: no such file")
    assert type(caught.value) is DataError and str(caught.value) == f"run: --weights {missing}: no such file"
    built = []
    with pytest.raises(DataError, match="^built once$"):
        require_regular_file(missing, error=DataError, missing=lambda: built.append(1) or "built once")
    assert require_regular_file(regular, missing=lambda: built.append(1) or "never") == regular and built == [1]


def test_require_regular_file_refuses_a_fifo_and_a_folder_naming_them(tmp_path):
    fifo = _fifo(tmp_path)
    exc = raises_at_once(fifo, lambda: require_regular_file(fifo, "the field 'x'", error=DataError), "the field 'x'")
    assert str(fifo) in str(exc) and "FIFO" in str(exc)
    exc = raises_at_once(None, lambda: require_regular_file(tmp_path, error=FormatError), str(tmp_path))
    assert "directory" in str(exc)


def test_fifo_as_array_input_and_reproduced_file(tmp_path):
    from caffe_compat.reproduce.training import file_sha256
    from caffe_compat.tools.netsetup import load_inputs

    fifo = _fifo(tmp_path, "x.npy")
    exc = raises_at_once(fifo, lambda: load_inputs([f"data={fifo}"]), f"--input 'data={fifo}'")
    assert "FIFO" in str(exc) and isinstance(exc, DataError)
    assert "FIFO" in str(raises_at_once(fifo, lambda: file_sha256(fifo)))
    with pytest.raises(DataError, match=f"^--input 'data={tmp_path}/y.npy': {tmp_path}/y.npy: no such file$"):
        load_inputs([f"data={tmp_path}/y.npy"])
    with pytest.raises(CaffeCompatError, match=f"^{tmp_path}/y.npy: no such file$"):
        file_sha256(tmp_path / "y.npy")


def test_socket_is_refused(tmp_path):
    import socket

    path = tmp_path / "sock"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(path))
        with pytest.raises(NotRegularFileError, match="socket"):
            read_net(path)


# --------------------------------------------------------------------------- protobuf files

def test_fifo_as_net(tmp_path):
    fifo = _fifo(tmp_path, "net.prototxt")
    raises_at_once(fifo, lambda: read_net(fifo))
    raises_at_once(fifo, lambda: read_net(str(fifo)))


def test_dev_zero_and_directory_as_net(tmp_path):
    raises_at_once(None, lambda: read_net("/dev/zero"), "/dev/zero: is a character device")
    raises_at_once(None, lambda: read_net(tmp_path), "is a directory")


def test_fifo_as_solver_and_solverstate(tmp_path):
    fifo = _fifo(tmp_path)
    raises_at_once(fifo, lambda: read_solver(fifo))
    raises_at_once(fifo, lambda: read_solverstate(fifo))


def _solver(tmp_path, net="net.prototxt"):
    from caffe_compat.solver import Solver

    shutil.copy(fixture_path("solvers/sgd_step_momentum") / "net.prototxt", tmp_path / "net.prototxt")
    path = tmp_path / "solver.prototxt"
    path.write_text(f'net: "{net}"\nbase_lr: 0.01\nlr_policy: "fixed"\nsolver_mode: CPU\n')
    return lambda: Solver(path)


def test_fifo_as_solver_net(tmp_path):
    fifo = _fifo(tmp_path, "pipe.prototxt")
    exc = raises_at_once(fifo, _solver(tmp_path, net=str(fifo)))
    assert "field 'net'" in str(exc)


def test_fifo_as_solverstate_learned_net(tmp_path):
    solver = _solver(tmp_path)()
    fifo = _fifo(tmp_path, "learned.caffemodel")
    state = tmp_path / "run.solverstate"
    state.write_bytes(caffe_pb2.SolverState(iter=1, learned_net=str(fifo)).SerializeToString())
    exc = raises_at_once(fifo, lambda: solver.restore(state))
    assert "learned_net" in str(exc)


def test_fifo_as_weights(tmp_path):
    from caffe_compat.io import read_weights

    fifo = _fifo(tmp_path, "w.caffemodel")
    raises_at_once(fifo, lambda: read_weights(fifo))


def _layer(text: str, phase: str = "test"):
    from caffe_compat.layers import layer_class

    param = text_format.Parse(text, caffe_pb2.LayerParameter())
    return layer_class(param)(param, [], phase)


def test_fifo_as_infogain_source(tmp_path):
    from caffe_compat.layers import layer_class

    fifo = _fifo(tmp_path, "H.binaryproto")
    param = text_format.Parse(f'name: "loss" type: "InfogainLoss" bottom: "s" bottom: "l" top: "loss" '
                              f'infogain_loss_param {{ source: "{fifo}" }}', caffe_pb2.LayerParameter())
    exc = raises_at_once(fifo, lambda: layer_class(param)(param, [(2, 3), (2,)], "train"))
    assert "InfogainLoss" in str(exc)


def test_fifo_as_mean_file(tmp_path, monkeypatch):
    from caffe_compat.export.metadata import read_mean_file

    monkeypatch.chdir(tmp_path)
    fifo = _fifo(tmp_path, "mean.binaryproto")
    images = tmp_path / "list.txt"
    write_blob(np.zeros((1, 3, 4, 4), np.float32), tmp_path / "real.binaryproto")
    images.write_text("a.png 0\n")
    exc = raises_at_once(fifo, lambda: _layer(
        f'name: "img" type: "ImageData" top: "data" top: "label" transform_param {{ mean_file: "{fifo}" }} '
        f'image_data_param {{ source: "list.txt" batch_size: 1 }}'))
    assert "mean_file" in str(exc)
    raises_at_once(fifo, lambda: read_mean_file(fifo, "preprocessing"))


# --------------------------------------------------------------------------- lists and their entries

def test_fifo_as_image_data_source_and_entry(tmp_path, monkeypatch):
    import cv2

    monkeypatch.chdir(tmp_path)
    fifo = _fifo(tmp_path, "list.txt")
    exc = raises_at_once(fifo, lambda: _layer(
        'name: "img" type: "ImageData" top: "data" top: "label" image_data_param { source: "list.txt" }'))
    assert "image_data_param.source" in str(exc) and "ImageData" in str(exc)
    cv2.imwrite(str(tmp_path / "ok.png"), np.zeros((4, 4, 3), np.uint8))
    _fifo(tmp_path, "img.png")
    (tmp_path / "entries.txt").write_text("img.png 1\nok.png 0\n")
    exc = raises_at_once(tmp_path / "img.png", lambda: _layer(
        'name: "img" type: "ImageData" top: "data" top: "label" '
        'image_data_param { source: "entries.txt" batch_size: 1 }'))
    assert "entries.txt entry 1" in str(exc)


def test_dev_zero_as_list(tmp_path, monkeypatch):
    from caffe_compat.data.imageset import read_list_file
    from caffe_compat.data.listfile import read_table

    raises_at_once(None, lambda: read_list_file("/dev/zero"), "/dev/zero")
    raises_at_once(None, lambda: read_table("/dev/zero", ["path", "label"]), "/dev/zero")
    raises_at_once(None, lambda: _layer(
        'name: "img" type: "ImageData" top: "data" top: "label" image_data_param { source: "/dev/zero" }'),
        "/dev/zero")


def test_fifo_as_hdf5_list_and_entry(tmp_path, monkeypatch):
    h5py = pytest.importorskip("h5py")
    monkeypatch.chdir(tmp_path)
    text = 'name: "h5" type: "HDF5Data" top: "data" hdf5_data_param { source: "files.txt" batch_size: 1 }'
    fifo = _fifo(tmp_path, "files.txt")
    raises_at_once(fifo, lambda: _layer(text))
    fifo.unlink()
    with h5py.File(tmp_path / "ok.h5", "w") as f:
        f["data"] = np.zeros((2, 3), np.float32)
    entry = _fifo(tmp_path, "entry.h5")
    (tmp_path / "files.txt").write_text(f"{entry}\nok.h5\n")
    exc = raises_at_once(entry, lambda: _layer(text))
    assert "HDF5Data" in str(exc) and "files.txt" in str(exc)


def test_fifo_in_make_lmdb_list_and_as_list(tmp_path):
    from caffe_compat.data.imageset import convert_imageset

    fifo = _fifo(tmp_path, "list.txt")
    raises_at_once(fifo, lambda: convert_imageset(fifo, tmp_path, tmp_path / "db"))
    _fifo(tmp_path, "img.png")
    (tmp_path / "entries.txt").write_text("img.png 1\n")
    exc = raises_at_once(tmp_path / "img.png",
                         lambda: convert_imageset(tmp_path / "entries.txt", tmp_path, tmp_path / "db2"))
    assert "entries.txt:1" in str(exc)


def test_fifo_as_lmdb_data_file(tmp_path):
    pytest.importorskip("lmdb")
    from caffe_compat.data.imageset import compute_image_mean

    db = tmp_path / "db"
    db.mkdir()
    fifo = _fifo(db, "data.mdb")
    exc = raises_at_once(fifo, lambda: compute_image_mean(db), "data.mdb")
    assert "FIFO" in str(exc)
    raises_at_once(None, lambda: compute_image_mean("/dev/zero"), "/dev/zero")


# --------------------------------------------------------------------------- the command line

@pytest.mark.parametrize("command", [["inspect"], ["compute-mean"], ["make-lmdb"]])
def test_cli_fifo_is_one_line_exit_2(tmp_path, command):
    fifo = _fifo(tmp_path, "net.prototxt")
    extra = {"compute-mean": [tmp_path / "mean.binaryproto"], "make-lmdb": [tmp_path, tmp_path / "db"]}
    args = [*command, fifo, *extra.get(command[0], [])]
    try:
        done = run_cli(*args, cwd=tmp_path)
    finally:
        _unblock(fifo)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1 and str(fifo) in done.stderr and "FIFO" in done.stderr, done.stderr


def test_cli_dev_zero_as_net_is_one_line_exit_2(tmp_path):
    done = run_cli("inspect", "/dev/zero", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and "/dev/zero" in done.stderr, done.stderr



def test_fifo_as_checkpoint_onnx_model_and_log(tmp_path):
    from caffe_compat.checkpoint import load_checkpoint
    from caffe_compat.tools.parse_log import parse_log

    fifo = _fifo(tmp_path, "model.pt")
    raises_at_once(fifo, lambda: load_checkpoint(fifo))
    raises_at_once(fifo, lambda: parse_log(fifo))
    onnx = pytest.importorskip("onnx")  # noqa: F841 - read_metadata needs it
    from caffe_compat.export.metadata import read_metadata

    raises_at_once(fifo, lambda: read_metadata(fifo))


def test_require_regular_file_says_a_path_it_may_not_look_at_is_unreadable(tmp_path, monkeypatch):
    """stat failing with EACCES (a folder on the way without search permission; root is never refused, so the
    refusal is simulated): the caller's error type saying so, not its 'no such file' message."""
    import caffe_compat.io.safe_open as safe_open

    target = tmp_path / "locked" / "net.prototxt"
    real_stat = os.stat

    def stat(path, *args, **kwargs):
        if str(path) == str(target):
            raise PermissionError(13, "Permission denied", str(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(safe_open.os, "stat", stat)
    with pytest.raises(DataError, match=rf"^{re.escape(str(target))} \(named by the net\): cannot be read "
                                         rf"\(Permission denied\)$"):
        safe_open.require_regular_file(target, "the net", error=DataError, missing="gone")
    with pytest.raises(DataError, match="^gone$"):
        safe_open.require_regular_file(tmp_path / "absent", "the net", error=DataError, missing="gone")

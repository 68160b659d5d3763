"""Bad input on the command line: exit status 2, one line on stderr naming the file / layer / field and
what was expected, no traceback, nothing written (``python -m caffe_compat.cli`` in a subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, fixture_path

ZOO = fixture_path("layer_zoo/deploy.prototxt")


def run_cli(*args, cwd=None, env=None, module="caffe_compat.cli") -> subprocess.CompletedProcess:
    """``python -m caffe_compat.cli ARGS`` (or another ``module``) of this checkout, also from another
    ``cwd``; ``env``: extra environment variables."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    environment = {**os.environ, "PYTHONPATH": path, **(env or {})}
    return subprocess.run([sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=120, env=environment)


def assert_usage_error(done: subprocess.CompletedProcess, command: str, message: str) -> None:
    assert "Traceback" not in done.stderr
    assert done.returncode == 2, done.stderr
    assert done.stderr == f"caffe-compat {command}: error: {message}\n"


def _net(layer: str, dims=(2, 6, 5, 5)) -> str:
    shape = " ".join(f"dim: {d}" for d in dims)
    return (f'layer {{ name: "data" type: "Input" top: "data" input_param {{ shape {{ {shape} }} }} }}\n'
            f'layer {{ name: "conv" bottom: "data" top: "conv" {layer} }}\n')


@pytest.mark.parametrize("layer, dims, message", [
    ('type: "Convolution" convolution_param { num_output: 4 kernel_size: 3 }', (2, 6, 5),
     "layer 'conv' (Convolution): input 'data' has shape (2, 6, 5) (3 axes); expected 4 axes (N, C, H, W): "
     "only 2-D convolution is supported"),
    ('type: "Convolution" convolution_param { num_output: 4 kernel_size: 3 group: 0 }', (2, 6, 5, 5),
     "layer 'conv' (Convolution): convolution_param.group must be >= 1, got 0"),
    ('type: "Convolution" convolution_param { num_output: 4 kernel_size: 3 group: 4 }', (2, 6, 5, 5),
     "layer 'conv' (Convolution): the input's 6 channels are not divisible by convolution_param.group 4"),
    ('type: "Deconvolution" convolution_param { num_output: 5 kernel_size: 3 group: 2 }', (2, 6, 5, 5),
     "layer 'conv' (Deconvolution): convolution_param.num_output 5 is not divisible by convolution_param.group 2"),
])
def test_inspect_invalid_convolution(tmp_path, layer, dims, message):
    net = tmp_path / "net.prototxt"
    net.write_text(_net(layer, dims))
    assert_usage_error(run_cli("inspect", net), "inspect", f"{net}: {message}")  # the file too (issue #19)


def test_inspect_reshape_axis_out_of_range(tmp_path):
    text = ZOO.read_text()
    changed = text.replace("reshape_param { shape { dim: 0 dim: 3 dim: -1 dim: 4 } }",
                           "reshape_param { shape { dim: 0 dim: 3 dim: -1 dim: 4 } axis: 9 }")
    assert changed != text
    net = tmp_path / "deploy.prototxt"
    net.write_text(changed)
    assert_usage_error(run_cli("inspect", net), "inspect",
                       f"{net}: layer 'reshape' (Reshape): reshape_param.axis 9 is out of range for the 3-axis input "
                       "(2, 84, 6) (expected -4 to 3)")


def test_inspect_big_prototxt_with_invalid_utf8_names_file_and_offset(tmp_path):
    padding = b"# padding comment\n" * 4000  # 72,000 bytes: past the 64 KiB that content sniffing reads
    head = padding + ZOO.read_bytes()
    net = tmp_path / "big.prototxt"
    net.write_bytes(head + b'layer { name: "caf\xe9" }  # (Latin-1 outside a comment)\n')
    line = head.count(b"\n") + 1
    assert_usage_error(run_cli("inspect", net), "inspect",
                       f"{net}: invalid UTF-8 byte 0xe9 at byte offset {len(head) + 18} (line {line}); "
                       f"a prototxt must be UTF-8 text (other bytes are allowed in # comments only)")
    net.write_bytes(head + b"# caf\xe9 (Latin-1 in a comment: skipped, as Caffe's parser skips it)\n")
    assert run_cli("inspect", net).returncode == 0


def test_inspect_unknown_layer_type_exits_2_naming_layer_and_type(tmp_path):
    net = tmp_path / "typo.prototxt"
    net.write_text(_net('type: "Convolutoin" convolution_param { num_output: 4 kernel_size: 3 }'))
    done = run_cli("inspect", net)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.startswith(f"caffe-compat inspect: error: {net}: layer 'conv': unknown layer type "
                                  f"'Convolutoin'.")  # the file too (issue #19)
    assert done.stdout == ""  # no table printed with '?' shapes


@pytest.mark.parametrize("make_target, reason", [
    (lambda d: "/proc/nonexist/y", "folder /proc/nonexist does not exist; create it first"),
    (lambda d: (d / "a_file").write_text("x") and d / "a_file" / "y.prototxt", "{parent} is not a folder"),
    (lambda d: (d / "out" / "sub").mkdir(parents=True) or d / "out", "Is a directory"),
])
def test_upgrade_to_unwritable_path(tmp_path, make_target, reason):
    source = fixture_path("nets/googlenet_small_v1/deploy_v1.prototxt")
    target = make_target(tmp_path)
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    done = run_cli("upgrade", source, target)
    reason = reason.format(parent=os.path.dirname(target))
    assert_usage_error(done, "upgrade", f"{target}: cannot write ({reason})")
    assert done.stdout == ""
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before  # nothing written, no temporary file left


def test_upgrade_unwritable_solver_output(tmp_path):
    source = fixture_path("solvers/nesterov/solver.prototxt")
    done = run_cli("upgrade", "--solver", source, "/proc/nonexist/solver.prototxt")
    assert_usage_error(done, "upgrade", "/proc/nonexist/solver.prototxt: cannot write (folder /proc/nonexist does "
                                        "not exist; create it first)")


@pytest.mark.parametrize("command", ["test", "time", "extract-features", "export"])
def test_net_setup_errors_name_the_prototxt(tmp_path, command):
    """test, time, extract-features and export name the net file in a setup error, as inspect and convert do
    (they named only the layer)."""
    net = tmp_path / "net.prototxt"
    net.write_text(_net('type: "Convolution" convolution_param { num_output: 4 kernel_size: 3 group: 4 }'))
    weights = fixture_path("solvers/sgd_step_momentum/init.caffemodel")
    args = {"test": ["--model", net], "time": ["--model", net],
            "extract-features": [weights, net, "conv", tmp_path / "f.npy", 1, "npy"],
            "export": [net, "--weights", weights, "-o", tmp_path / "e.onnx"]}[command]
    done = run_cli(command, *args)
    assert "Traceback" not in done.stderr
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"caffe-compat {command}: error: {net}"), done.stderr
    assert "layer 'conv': channels 6 and num_output 4 must be divisible by group 4" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["net.prototxt"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")
@pytest.mark.parametrize("command", ["time", "export"])
def test_a_fifo_as_net_or_weights_is_named_as_such(tmp_path, command):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    args = (["--model", ZOO, "--weights", fifo] if command == "time"
            else [ZOO, "--weights", fifo, "--output", "absval", "-o", tmp_path / "e.onnx"])
    assert_usage_error(run_cli(command, *args), command, f"{fifo}: is a FIFO (named pipe), expected a regular file")


def test_run_and_reproduce_name_a_fifo_as_such(tmp_path):
    """A FIFO given as the script of ``run`` or as ``reproduce --weights`` is named as one (it was 'no such
    file'), before anything is read or written."""
    if not hasattr(os, "mkfifo"):
        pytest.skip("needs os.mkfifo")
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    fifo_error = "is a FIFO (named pipe), expected a regular file"
    assert_usage_error(run_cli("run", fifo), "run", f"{fifo} (named by the script): {fifo_error}")
    done = run_cli("reproduce", "digits", "--weights", fifo, "--out", tmp_path / "out")
    assert_usage_error(done, "reproduce", f"{fifo} (named by --weights): {fifo_error}")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv", [["inspect", ZOO], ["test", "--model", ZOO, "--iterations", "1"],
                                  ["time", "--model", ZOO, "--iterations", "1"],
                                  ["train", "--solver", fixture_path("solvers/nesterov/solver.prototxt"),
                                   "--iters", "1"]])
def test_a_level_outside_int32_exits_2_naming_it(capsys, argv):
    """``--level 99999999999999999999``: protobuf's ValueError (Value out of range) setting NetState.level, a
    traceback from inspect, test, time and train."""
    from caffe_compat.cli import main

    assert main([str(a) for a in argv] + ["--level", "99999999999999999999"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "level must be a 32-bit integer (Caffe's NetState.level), got 99999999999999999999" in err

"""Where commands write: an output whose folder does not exist is refused (exit 2, one line naming the
folder) before anything is read, and no folder is created; ``inspect`` of a net without layers warns and
exits 1."""

from __future__ import annotations

import json

import pytest

from caffe_compat.cli import main
from tests.conftest import fixture_path

NET = fixture_path("nets/googlenet_small/deploy.prototxt")
WEIGHTS = fixture_path("nets/googlenet_small/weights.caffemodel")
SOLVER = fixture_path("solvers/nesterov/solver.prototxt")


def _commands(missing):
    """``(command, argv[, the path refused])`` of every command writing a file or a new folder, its output under
    ``missing`` (the path refused: ``missing/out`` unless given)."""
    out = missing / "out"
    return [
        ("convert", ["convert", NET, WEIGHTS, "-o", out]),
        ("convert", ["convert", "--to-caffe", "model.pt", "-o", out]),
        ("upgrade", ["upgrade", fixture_path("nets/googlenet_small_v1/deploy_v1.prototxt"), out]),
        ("upgrade", ["upgrade", "--solver", SOLVER, out]),
        ("compute-mean", ["compute-mean", "db", out]),
        ("make-lmdb", ["make-lmdb", "list.txt", ".", out]),
        ("make-toy-data", ["make-toy-data", "cub", out]),
        ("export", ["export", NET, "--weights", WEIGHTS, "-o", out]),
        ("evaluate", ["evaluate", "m.onnx", "--dataset", "cub200", "--data-root", ".", "--json", out]),
        ("evaluate", ["evaluate", "m.onnx", "--dataset", "cub200", "--data-root", ".", "--plot", out]),
        ("train", ["train", SOLVER, "--log", out]),
        ("train", ["train", SOLVER, "--caffe-log", out]),
        ("test", ["test", "-model", NET, "-weights", WEIGHTS, "--json", out]),
        ("time", ["time", "-model", NET, "--json", out]),
        ("extract-features", ["extract-features", WEIGHTS, NET, "loss3", out, "1", "npy"]),
        ("extract-features", ["extract-features", WEIGHTS, NET, "loss3", "f.npy", "1", "npy", "--json", out]),
        ("parse-log", ["parse-log", "train.log", missing], missing / "train.log.train"),
        ("parse-log", ["parse-log", "train.log", ".", "--plot", out]),
        ("parse-log", ["parse-log", "train.log", ".", "--json", out]),
        ("draw", ["draw", NET, out]),
    ]


@pytest.mark.parametrize("case", range(len(_commands(fixture_path("nets")))))
def test_an_output_in_a_missing_folder_is_refused_and_no_folder_created(tmp_path, monkeypatch, capsys, case):
    monkeypatch.chdir(tmp_path)
    missing = tmp_path / "missing_dir"
    command, argv, *refused = _commands(missing)[case]
    assert main([str(a) for a in argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    target = refused[0] if refused else missing / "out"
    assert err == (f"caffe-compat {command}: error: {target}: cannot write (folder {missing} does not "
                   "exist; create it first)\n")
    assert list(tmp_path.iterdir()) == []


def test_an_output_under_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "a_file").write_text("x")
    target = tmp_path / "a_file" / "x.pt"
    assert main(["convert", str(NET), str(WEIGHTS), "-o", str(target)]) == 2
    assert capsys.readouterr().err == (f"caffe-compat convert: error: {target}: cannot write ({tmp_path / 'a_file'} "
                                       "is not a folder)\n")


@pytest.mark.parametrize("text", ["", "# only a comment\n", 'name: "nothing"\n'])
def test_inspect_of_a_net_without_layers_warns_and_exits_1(tmp_path, capsys, text):
    net = tmp_path / "empty.prototxt"
    net.write_text(text)
    assert main(["inspect", str(net)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"caffe-compat inspect: warning: {net} defines no layers (an empty net: is it the right file?)\n"
    assert main(["inspect", str(net), "--json"]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out)["layers"] == [] and "defines no layers" in err


def test_inspect_of_a_net_with_layers_still_exits_0(capsys):
    assert main(["inspect", str(NET)]) == 0
    out, err = capsys.readouterr()
    assert err == "" and out.startswith("layer ")

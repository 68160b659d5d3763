"""Files given in the wrong place get a diagnosis, not the first parse error: swapped ``convert`` arguments,
a net given to ``train``, a solver given to ``inspect``, binary files where a text prototxt is expected.
The readers raise the typed error; the command prints it on one line and exits 2."""

from __future__ import annotations

import re

import numpy as np
import pytest

from caffe_compat.errors import FormatError, ParseError
from caffe_compat.io import array_to_blob, read_net, read_solver, write_blob
from caffe_compat.proto import caffe_pb2
from tests.cli.test_cli_errors import assert_usage_error, run_cli
from tests.conftest import REPO, fixture_path

NET = fixture_path("nets/googlenet_small/deploy.prototxt")
WEIGHTS = fixture_path("nets/googlenet_small/weights.caffemodel")
LAYERS = len([layer for layer in read_net(WEIGHTS).layer if layer.name])
TRAINABLE = """name: "tiny"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 4 dim: 3 dim: 6 dim: 6 } shape { dim: 4 }
                     data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 1 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param { num_output: 2 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


def test_convert_with_the_files_swapped_says_so_and_writes_nothing(tmp_path):
    out = tmp_path / "x.pt"
    done = run_cli("convert", WEIGHTS, NET, "-o", out)
    assert_usage_error(done, "convert", f"{WEIGHTS} and {NET} look swapped: {WEIGHTS} is binary (weights) and "
                                        f"{NET} is text (a net prototxt); give the net prototxt first, then the "
                                        "caffemodel")
    assert done.stdout == "" and list(tmp_path.iterdir()) == []


def test_convert_with_a_caffemodel_for_the_net_says_what_it_is(tmp_path):
    done = run_cli("convert", WEIGHTS, WEIGHTS, "-o", tmp_path / "x.pt")
    assert_usage_error(done, "convert", f"{WEIGHTS}: neither a text prototxt nor UTF-8 text: it looks like a "
                                        f"caffemodel (binary NetParameter with {LAYERS} layers); the net "
                                        "definition must be a text prototxt")
    assert list(tmp_path.iterdir()) == []


def test_train_on_a_net_shows_a_minimal_solver_that_trains_it(tmp_path):
    """The suggested solver line, written to a file as the message says, is one ``train`` runs."""
    (tmp_path / "net.prototxt").write_text(TRAINABLE)
    done = run_cli("train", "net.prototxt", cwd=tmp_path)
    suggestion = 'net: "net.prototxt" base_lr: 0.01 lr_policy: "fixed" max_iter: 100'
    assert_usage_error(done, "train", "net.prototxt: this is a net (NetParameter), not a solver; train takes a "
                                      f"solver file naming the net, e.g. a solver.prototxt holding: {suggestion}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["net.prototxt"]
    (tmp_path / "solver.prototxt").write_text(done.stderr.rsplit("holding: ", 1)[1])
    trained = run_cli("train", "solver.prototxt", "--iters", "3", cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr
    assert trained.stdout.startswith("trained 3 iterations")


def test_train_on_a_caffemodel_says_it_is_not_text(tmp_path):
    done = run_cli("train", WEIGHTS)
    assert_usage_error(done, "train", f"{WEIGHTS}: neither a text prototxt nor UTF-8 text: it looks like a caffemodel "
                                      f"(binary NetParameter with {LAYERS} layers); a solver is a text prototxt "
                                      "naming its net (give a caffemodel to train with --weights)")


def test_inspect_on_a_solver_names_its_net():
    solver = REPO / "prototxt" / "cub200" / "solver.prototxt"
    net = read_solver(solver).net
    done = run_cli("inspect", solver)
    assert_usage_error(done, "inspect", f"{solver}: this is a solver (SolverParameter), not a net; its net is '{net}'")


def _binaryproto(path):
    write_blob(np.zeros((1, 3, 4, 5), np.float32), path)


def _solverstate(path):
    state = caffe_pb2.SolverState(iter=7, learned_net="snap_iter_7.caffemodel")
    state.history.append(array_to_blob(np.ones((2, 2), np.float32)))
    path.write_bytes(state.SerializeToString())


@pytest.mark.parametrize("name, make, looks_like", [
    ("mean.binaryproto", _binaryproto, "a .binaryproto (binary BlobProto of shape 1x3x4x5, e.g. a mean file)"),
    ("snap.solverstate", _solverstate, "a .solverstate (binary SolverState at iteration 7)"),
    ("model.pt", lambda p: p.write_bytes(b"PK\x03\x04" + bytes(60)), "a zip archive (a PyTorch .pt checkpoint is one)"),
    ("photo.png", lambda p: p.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(60)), "a PNG image"),
])
def test_a_binary_solver_file_says_what_it_looks_like(tmp_path, name, make, looks_like):
    path = tmp_path / name
    make(path)
    with pytest.raises(ParseError) as caught:
        read_solver(path)
    assert str(caught.value) == (f"{path}: neither a text prototxt nor UTF-8 text: it looks like {looks_like}; a "
                                 "solver is a text prototxt naming its net (give a caffemodel to train with --weights)")


@pytest.mark.parametrize("given", [TRAINABLE, TRAINABLE.encode()])
def test_the_suggested_solver_names_a_net_given_as_text_or_bytes(given):
    with pytest.raises(FormatError, match=re.escape('holding: net: "NET.prototxt" base_lr: 0.01')):
        read_solver(given)


def test_prototxt_errors_of_other_kinds_are_unchanged(tmp_path):
    """A solver with a typo is not mistaken for a net, nor a net with a typo for a solver."""
    solver = tmp_path / "solver.prototxt"
    solver.write_text('net: "net.prototxt"\nbase_lrr: 0.1\n')
    with pytest.raises(ParseError, match="solver.prototxt:2:1: unknown field 'base_lrr' in SolverParameter"):
        read_solver(solver)
    net = tmp_path / "net.prototxt"
    net.write_text('layer { name: "a" type: "Input" top: "a" }\nlayerr { }\n')
    with pytest.raises(ParseError, match="net.prototxt:2:1: unknown field 'layerr' in NetParameter"):
        read_net(net)


def test_make_lmdb_with_caffe_s_argument_order_says_the_two_look_swapped(tmp_path):
    """convert_imageset takes ROOTFOLDER/ LISTFILE DB_NAME; make-lmdb takes LIST ROOT OUT."""
    (tmp_path / "images").mkdir()
    (tmp_path / "list.txt").write_text("a.jpg 0\n")
    done = run_cli("make-lmdb", "images/", "list.txt", "db", cwd=tmp_path)
    assert_usage_error(done, "make-lmdb", "images/ and list.txt look swapped: images/ is a folder and list.txt a "
                                          "file; give the list file first, then the image root folder (Caffe's "
                                          "convert_imageset takes the root first)")
    assert done.stdout == "" and sorted(p.name for p in tmp_path.iterdir()) == ["images", "list.txt"]


def test_a_caffemodel_given_to_snapshot_and_a_solverstate_given_as_weights_say_what_they_are(tmp_path):
    """caffe train -snapshot X.caffemodel (or -weights X.solverstate): the file's kind is named instead of
    'expected 4 history blobs, got 0' or a bare 'Wire format was corrupt'."""
    (tmp_path / "net.prototxt").write_text(TRAINABLE)
    (tmp_path / "solver.prototxt").write_text('net: "net.prototxt"\nbase_lr: 0.1\nlr_policy: "fixed"\nmax_iter: 1\n'
                                              'snapshot_prefix: "s"\n')
    assert run_cli("train", "solver.prototxt", cwd=tmp_path).returncode == 0
    done = run_cli("train", "solver.prototxt", "-snapshot", "s_iter_1.caffemodel", cwd=tmp_path)
    assert_usage_error(done, "train", "s_iter_1.caffemodel: not a .solverstate: it looks like a caffemodel (binary "
                                      "NetParameter with 3 layers); resume from the .solverstate written beside it "
                                      "(-snapshot), or start from these weights with -weights")
    done = run_cli("train", "solver.prototxt", "-weights", "s_iter_1.solverstate", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.startswith("caffe-compat train: error: s_iter_1.solverstate: not a valid binary NetParameter")
    assert done.stderr.endswith("; it looks like a .solverstate (binary SolverState at iteration 1)\n")

"""``caffe-compat train`` takes ``caffe train``'s flags as Caffe's scripts spell them: ``-solver``/``--solver=``
(examples/mnist/train_lenet.sh), ``-weights``, ``-snapshot`` (resume_training.sh), ``-gpu``."""

from __future__ import annotations

import pytest

from caffe_compat.cli import main

NET = """name: "dummy"
layer { name: "data" type: "DummyData" top: "data" top: "label"
  dummy_data_param { shape { dim: 4 dim: 3 } shape { dim: 4 }
    data_filler { type: "gaussian" } data_filler { type: "constant" value: 1 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip"
  inner_product_param { num_output: 2 weight_filler { type: "xavier" } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


@pytest.fixture
def solver_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "net.prototxt").write_text(NET)
    (tmp_path / "solver.prototxt").write_text('net: "net.prototxt"\nbase_lr: 0.1\nlr_policy: "fixed"\n'
                                              'max_iter: 4\nsnapshot: 2\nsnapshot_prefix: "snap/s"\n')
    (tmp_path / "snap").mkdir()
    return tmp_path


def test_caffe_spellings_of_solver_weights_and_snapshot(solver_dir, capsys):
    assert main(["train", "-solver", "solver.prototxt", "--iters", "2"]) == 0
    assert (solver_dir / "snap" / "s_iter_2.solverstate").is_file()
    assert main(["train", "--solver=solver.prototxt", "-snapshot", "snap/s_iter_2.solverstate"]) == 0
    assert "trained 2 iterations" in capsys.readouterr().out
    assert (solver_dir / "snap" / "s_iter_4.solverstate").is_file()
    assert main(["train", "-solver=solver.prototxt", "-weights", "snap/s_iter_4.caffemodel", "--iters", "1"]) == 0
    assert "trained 1 iterations" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    ([], "need a solver definition to train: caffe-compat train SOLVER.prototxt (or -solver SOLVER.prototxt)"),
    (["solver.prototxt", "-solver", "solver.prototxt"],
     "give the solver once: solver.prototxt (positional) or -solver solver.prototxt"),
    (["solver.prototxt", "-snapshot", "snap/s_iter_2.solverstate", "-weights", "w.caffemodel"],
     "give a snapshot to resume training or weights to fine-tune, not both (-snapshot replaces the weights with "
     "the solverstate's)"),
    (["solver.prototxt", "-gpu", "0,1"], "-gpu 0,1: train runs on one device per process; train on several GPUs "
                                         "with torchrun --nproc_per_node N (see caffe-compat train --help)"),
])
def test_missing_or_doubled_solver_snapshot_with_weights_several_gpus_refused(solver_dir, capsys, argv, message):
    assert main(["train", *argv]) == 2
    assert capsys.readouterr().err == f"caffe-compat train: error: {message}\n"
    assert list((solver_dir / "snap").iterdir()) == []

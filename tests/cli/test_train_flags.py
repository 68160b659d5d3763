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
    (["solver.prototxt", "--iters", "-1"], "--iters must be >= 1, got -1 (leave it out to train up to max_iter)"),
    (["solver.prototxt", "-gpu", "0,1"], "-gpu 0,1: train runs on one device per process; train on several GPUs "
                                         "with torchrun --nproc_per_node N (see caffe-compat train --help)"),
])
def test_missing_or_doubled_solver_snapshot_with_weights_several_gpus_refused(solver_dir, capsys, argv, message):
    assert main(["train", *argv]) == 2
    assert capsys.readouterr().err == f"caffe-compat train: error: {message}\n"
    assert list((solver_dir / "snap").iterdir()) == []


def _signal_at(monkeypatch, signum, at_iter):
    """Send ``signum`` to this process once, during the update of iteration ``at_iter`` (a user's Ctrl-C)."""
    import os

    from caffe_compat.solver import Solver

    update, sent = Solver.apply_update, []

    def apply_update(self):
        if self.iter == at_iter and not sent:
            sent.append(signum)
            os.kill(os.getpid(), signum)
        return update(self)

    monkeypatch.setattr(Solver, "apply_update", apply_update)


def test_ctrl_c_stops_after_the_iteration_with_a_snapshot_and_exit_0(solver_dir, monkeypatch, capsys):
    """caffe train's -sigint_effect stop (the default): the run ends after the iteration, Solve's snapshot
    after training is written, exit 0; the snapshot resumes."""
    import signal

    _signal_at(monkeypatch, signal.SIGINT, 2)
    assert main(["train", "solver.prototxt", "--iters", "100"]) == 0
    out = capsys.readouterr().out
    assert "trained 3 iterations" in out and "stopped early" in out
    assert sorted(p.name for p in (solver_dir / "snap").iterdir()) == [
        "s_iter_2.caffemodel", "s_iter_2.solverstate", "s_iter_2.trainstate",
        "s_iter_3.caffemodel", "s_iter_3.solverstate", "s_iter_3.trainstate"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert main(["train", "solver.prototxt", "-snapshot", "snap/s_iter_3.solverstate"]) == 0
    assert "trained 1 iterations" in capsys.readouterr().out


@pytest.mark.parametrize("flags, snapshots", [
    ([], ["s_iter_1", "s_iter_2", "s_iter_4"]),  # SIGHUP's default: snapshot and go on
    (["-sighup_effect", "none"], ["s_iter_2", "s_iter_4"]),
])
def test_sighup_snapshots_and_goes_on(solver_dir, monkeypatch, capsys, flags, snapshots):
    import signal

    _signal_at(monkeypatch, signal.SIGHUP, 0)
    previous = signal.signal(signal.SIGHUP, lambda signum, frame: None)  # a regression must not kill pytest
    try:
        assert main(["train", "solver.prototxt", *flags]) == 0
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert "trained 4 iterations" in capsys.readouterr().out
    assert sorted({p.name.split(".")[0] for p in (solver_dir / "snap").iterdir()}) == snapshots


def test_sigint_effect_none_ignores_ctrl_c(solver_dir, monkeypatch, capsys):
    import signal

    _signal_at(monkeypatch, signal.SIGINT, 1)
    assert main(["train", "solver.prototxt", "-sigint_effect", "none"]) == 0
    out = capsys.readouterr().out
    assert "trained 4 iterations" in out and "stopped early" not in out


def test_solver_solve_honours_the_action_requests(solver_dir):
    """pycaffe's Solver.solve with Caffe's action function: a snapshot request snapshots, a stop ends Solve after
    its snapshot after training."""
    from caffe_compat.solver import Solver

    solver = Solver("solver.prototxt")
    requests = iter(["snapshot", None, "stop"])
    solver.action_request = lambda: next(requests, None)
    solver.solve()
    assert solver.iter == 3 and solver.requested_early_exit
    assert sorted(p.name for p in (solver_dir / "snap").iterdir()) == [
        "s_iter_1.caffemodel", "s_iter_1.solverstate", "s_iter_2.caffemodel", "s_iter_2.solverstate",
        "s_iter_3.caffemodel", "s_iter_3.solverstate"]


LEVELLED = """name: "levelled"
{state}
layer {{ name: "data" type: "DummyData" top: "data" top: "label" include {{ min_level: 1 }}
  dummy_data_param {{ shape {{ dim: 4 dim: 3 }} shape {{ dim: 4 }}
    data_filler {{ type: "gaussian" }} data_filler {{ type: "constant" value: 1 }} }} }}
layer {{ name: "wide" type: "InnerProduct" bottom: "data" top: "ip" include {{ stage: "wide" }}
  inner_product_param {{ num_output: 2 weight_filler {{ type: "xavier" }} }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }}
"""


@pytest.mark.parametrize("state, argv, missing", [
    ("", ["-level", "1", "-stage", "wide"], None),
    ("", ["--level=1", "--stage=other,wide"], None),
    ("", ["-stage", "wide"], "data"),                              # level 0: no data layer
    ("", ["-level", "1"], "ip"),                                   # no stage 'wide': no InnerProduct
    ("state { level: 1 stage: 'wide' }", [], "data"),              # caffe train sets level 0 over the net's 1
    ("state { level: 1 stage: 'wide' }", ["-level", "1"], None),   # the net's stage stays, the flag's level
])
def test_level_and_stage_set_the_train_state_as_caffe_train(tmp_path, monkeypatch, capsys, state, argv, missing):
    """caffe train: ``train_state.set_level(FLAGS_level)`` (always, 0 by default) and ``add_stage`` per -stage,
    merged over the net's own ``state`` when the train net is built."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "net.prototxt").write_text(LEVELLED.format(state=state))
    (tmp_path / "solver.prototxt").write_text('net: "net.prototxt"\nbase_lr: 0.1\nlr_policy: "fixed"\nmax_iter: 1\n'
                                              'snapshot_after_train: false\n')
    assert main(["train", "solver.prototxt", *argv]) == (0 if missing is None else 2)
    out, err = capsys.readouterr()
    if missing is None:
        assert "trained 1 iterations" in out
    else:
        assert f"unknown bottom blob '{missing}'" in err


def test_weights_may_be_an_hdf5_snapshot(solver_dir, capsys):
    """caffe train -weights W: Caffe's CopyTrainedLayersFrom reads an HDF5 weights file (snapshot_format: HDF5
    writes _iter_N.caffemodel.h5) as HDF5; fine-tuning from it is fine-tuning from the same weights."""
    pytest.importorskip("h5py")
    import caffe_compat.pycaffe as caffe

    assert main(["train", "-solver", "solver.prototxt", "--iters", "2"]) == 0
    (solver_dir / "w.caffemodel").write_bytes((solver_dir / "snap" / "s_iter_2.caffemodel").read_bytes())
    caffe.Net("net.prototxt", "w.caffemodel", caffe.TEST).save_hdf5("w.caffemodel.h5")
    finetuned = []
    for weights in ("w.caffemodel", "w.caffemodel.h5"):
        assert main(["train", "-solver", "solver.prototxt", "-weights", weights, "--iters", "2", "--seed", "3",
                     "--deterministic"]) == 0
        finetuned.append((solver_dir / "snap" / "s_iter_2.caffemodel").read_bytes())
    assert finetuned[0] == finetuned[1] and finetuned[0] != (solver_dir / "w.caffemodel").read_bytes()
    capsys.readouterr()


def test_caffe_train_log_lines_around_the_solver(solver_dir, caplog):
    """tools/caffe.cpp train: ``Resuming from <snapshot>`` then Restore (``SGDSolver: restoring history``),
    ``Starting Optimization``, ``Solve`` (``Solving <net>`` ... its ``Optimization Done.``), then the tool's
    own ``Optimization Done.``."""
    import logging

    assert main(["train", "solver.prototxt", "--iters", "2"]) == 0
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="caffe_compat"):
        assert main(["train", "solver.prototxt", "-snapshot", "snap/s_iter_2.solverstate"]) == 0
    wanted = ("Resuming from snap/s_iter_2.solverstate", "SGDSolver: restoring history", "Starting Optimization",
              "Solving dummy", "Optimization Done.")
    lines = [r.getMessage() for r in caplog.records if r.getMessage() in wanted]
    assert lines == [*wanted, "Optimization Done."]

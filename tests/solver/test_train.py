"""The training loop: a DataLoader feeds the same iterations as pycaffe-style feeding, CSV log, seeds,
bf16 autocast and channels_last on CPU, epochs restart, the end-of-training snapshot and summary."""

from __future__ import annotations

import csv
import logging
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from caffe_compat.errors import FormatError, ParseError, WriteError
from caffe_compat.solver import Solver
from caffe_compat.solver.train import train
from tests.solver.caffe_cases import case_dir, feed, load_case, make_solver, param_arrays
from tests.conftest import UNWRITABLE_REASONS, unwritable_log

CASE = "sgd_step_momentum"


def loader(batch_as_tuple=False):
    inputs, _ = load_case(CASE)
    data = torch.tensor(inputs["data"])
    labels = torch.tensor(inputs["label"])
    if batch_as_tuple:
        return [(data[t], labels[t]) for t in range(5)]
    dataset = [{"data": data[t], "label": labels[t]} for t in range(5)]
    return torch.utils.data.DataLoader(dataset, batch_size=None, shuffle=False)


def test_dataloader_run_equals_pycaffe_feeding_and_logs_csv(tmp_path):
    reference = make_solver(CASE)
    for t in range(7):
        feed(reference, CASE, t)  # batches 0..4 then 0, 1 again
        reference.step(1)
    solver = make_solver(CASE)
    summary = train(solver, loader(), iters=7, progress=True, csv_log=tmp_path / "log.csv")
    for key, value in param_arrays(reference).items():
        np.testing.assert_array_equal(param_arrays(solver)[key], value)
    rows = list(csv.DictReader(open(tmp_path / "log.csv")))
    assert [int(r["iter"]) for r in rows] == list(range(7))
    _, trajectory = load_case(CASE)
    np.testing.assert_allclose([float(r["loss"]) for r in rows[:5]], trajectory["loss_blob"], rtol=2e-6)
    assert [f"{float(r['lr']):.6g}" for r in rows[:5]] == [f"{float(x):.6g}" for x in trajectory["lr"]]
    assert summary.iterations == 7 and np.float32(summary.last_loss) == np.float32(rows[-1]["loss"])
    assert np.float32(summary.first_loss) == np.float32(rows[0]["loss"]) and summary.snapshots == []


@pytest.mark.parametrize("target", ["folder", "fifo", "full"])
def test_an_unwritable_csv_log_is_a_write_error(tmp_path, target):
    """csv_log (train --log) that is a folder, a FIFO nobody reads (it blocked for ever) or on a full disk:
    a WriteError naming it (it was an IsADirectoryError or OSError traceback, exit 1)."""
    path = unwritable_log(tmp_path, target)
    reason = UNWRITABLE_REASONS[target]
    with pytest.raises(WriteError, match=rf"^{re.escape(str(path))}: cannot write \({reason}"):
        train(make_solver(CASE), loader(), iters=2, progress=False, csv_log=path)


def test_tuple_batches_and_snapshot_after_train(tmp_path):
    solver = make_solver(CASE, snapshot_prefix=str(tmp_path / "end"))
    solver.param.max_iter = 3
    summary = train(solver, loader(batch_as_tuple=True), progress=False)
    assert summary.iterations == 3 and solver.iter == 3
    assert summary.snapshots == [str(tmp_path / "end_iter_3.caffemodel"), str(tmp_path / "end_iter_3.solverstate")]


def test_summary_lists_periodic_snapshots_too(tmp_path):
    """snapshot: 2, max_iter 4: the snapshot at iteration 2 and the one at 4 (periodic, so no extra
    snapshot_after_train) are both in the summary, in the order written."""
    solver = make_solver(CASE, snapshot_prefix=str(tmp_path / "p"))
    solver.param.max_iter, solver.param.snapshot = 4, 2
    summary = train(solver, loader(), progress=False)
    assert summary.snapshots == [str(tmp_path / f"p_iter_{i}.{ext}") for i in (2, 4)
                                 for ext in ("caffemodel", "solverstate")]
    assert all(Path(p).is_file() for p in summary.snapshots)


def test_weights_or_resume_replace_the_solver_files_weights(tmp_path):
    """caffe train clears the SolverParameter's ``weights`` when given -weights (then adds them) or -snapshot,
    so the solver file's own caffemodels are not read at all (here: one that does not exist)."""
    shutil.copy(case_dir(CASE) / "net.prototxt", tmp_path / "net.prototxt")
    path = tmp_path / "solver.prototxt"
    path.write_text('net: "net.prototxt"\nbase_lr: 0\nlr_policy: "fixed"\nmax_iter: 1\nrandom_seed: 1\n'
                    f'snapshot_prefix: "{tmp_path / "run"}"\nweights: "{tmp_path / "missing.caffemodel"}"\n')
    init = str(case_dir(CASE) / "init.caffemodel")
    summary = train(str(path), loader(), weights=init, progress=False)  # base_lr 0: the weights stay init's
    written = Solver(str(path), weights=summary.snapshots[0], solver_weights=False)
    reference = Solver(str(path), weights=init, solver_weights=False)
    for key, value in param_arrays(reference).items():
        np.testing.assert_array_equal(param_arrays(written)[key], value)
    summary = train(str(path), loader(), resume=summary.snapshots[1], iters=1, progress=False)
    assert summary.iterations == 1
    with pytest.raises(ParseError, match="missing.caffemodel: no such file"):  # nothing replaces them: read
        train(str(path), loader(), progress=False)


def test_training_to_max_iter_ends_as_solver_solve(tmp_path, caplog):
    """Solver::Solve after its Step, at a display iteration (display 1): the snapshot, then one more TRAIN
    forward on the next batch, its loss (average_loss 1) logged as ``Iteration 3, loss = z`` without a speed,
    then "Optimization Done."; an ``iters=`` run (Caffe's Step, not Solve) ends without them."""
    solver = make_solver(CASE, snapshot_prefix=str(tmp_path / "end"))
    solver.param.max_iter = 3
    with caplog.at_level(logging.INFO, logger="caffe_compat"):
        train(solver, loader(), progress=False)
    lines = [r.getMessage() for r in caplog.records]
    final = [line for line in lines if re.fullmatch(r"Iteration 3, loss = \S+", line)]
    done = lines.index("Optimization Done.")
    assert len(final) == 1 and lines[done - 1] == final[0]
    assert [line.split(":")[0] for line in lines[done + 1:]] == ["Training summary"]
    snapshot = next(i for i, line in enumerate(lines) if "end_iter_3.solverstate" in line)
    assert snapshot < lines.index(final[0])
    batch = {k: torch.tensor(v) for k, v in {"data": load_case(CASE)[0]["data"][3],
                                             "label": load_case(CASE)[0]["label"][3]}.items()}
    with torch.no_grad():
        expected = float(solver.net.objective(solver.net(**batch)))
    assert final[0] == f"Iteration 3, loss = {expected:.6g}"
    assert np.float32(solver.smoothed_loss) == np.float32(expected)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="caffe_compat"):
        train(make_solver(CASE), loader(), iters=2, progress=False)
    assert "Optimization Done." not in [r.getMessage() for r in caplog.records]


def _dropout_solver_file(tmp_path) -> str:
    net = (case_dir(CASE) / "net.prototxt").read_text().replace(
        'layer { name: "ip1"',
        'layer { name: "drop" type: "Dropout" bottom: "pool1" top: "pool1" dropout_param { dropout_ratio: 0.5 } }\n'
        'layer { name: "ip1"', 1)
    (tmp_path / "net.prototxt").write_text(net)
    shutil.copy(case_dir(CASE) / "init.caffemodel", tmp_path / "init.caffemodel")
    (tmp_path / "solver.prototxt").write_text('net: "net.prototxt"\nbase_lr: 0.01\nlr_policy: "fixed"\nmomentum: 0.9\n'
                                              'max_iter: 4\nsolver_mode: CPU\nsnapshot_after_train: false\n')
    return str(tmp_path / "solver.prototxt")


def test_deterministic_seed_reproduces_dropout_runs(tmp_path):
    path = _dropout_solver_file(tmp_path)

    def run(seed):
        s = Solver(path, weights=str(tmp_path / "init.caffemodel"), device="cpu")
        train(s, loader(), deterministic=True, seed=seed, progress=False)
        return param_arrays(s)

    a, b, c = run(1), run(1), run(2)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])
    assert any(not np.array_equal(a[key], c[key]) for key in a)  # the dropout masks did change


@pytest.mark.filterwarnings("ignore::caffe_compat.hardware.Bf16SlowerWarning")  # tested in test_bf16_cpu_warning
def test_bf16_autocast_and_channels_last_on_cpu():
    plain = make_solver(CASE)
    train(plain, loader(), iters=3, progress=False)
    nhwc = make_solver(CASE)
    train(nhwc, loader(), iters=3, progress=False, channels_last=True)
    assert nhwc.net.params["conv1"][0].is_contiguous(memory_format=torch.channels_last)
    for key, value in param_arrays(plain).items():
        np.testing.assert_allclose(param_arrays(nhwc)[key], value, rtol=1e-5, atol=1e-6)
    bf16 = make_solver(CASE)
    summary = train(bf16, loader(), iters=3, progress=False, amp="bf16")
    assert bf16.net.params["conv1"][0].dtype == torch.float32  # master weights stay float32
    assert summary.last_loss == pytest.approx(plain.last_loss, rel=3e-2)
    assert summary.last_loss != plain.last_loss  # bf16 arithmetic really ran


def test_bad_amp_name():
    with pytest.raises(FormatError, match="amp must be one of"):
        train(make_solver(CASE), loader(), iters=1, amp="fp8")


def test_input_only_net_without_data_is_refused(tmp_path, monkeypatch, capsys):
    from caffe_compat.cli import main
    from caffe_compat.errors import CaffeCompatError

    monkeypatch.chdir(tmp_path)  # nothing may be written (the fixture's snapshot_prefix is relative)
    solver_file = str(case_dir(CASE) / "solver.prototxt")
    assert main(["train", solver_file, "--iters", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("caffe-compat train: error: ") and "only from Input layers (data, label)" in err
    assert "Python API" in err and "zero-filled" in err
    with pytest.raises(CaffeCompatError, match="Input-only net needs its data fed through the Python API"):
        train(solver_file, iters=1, progress=False)
    assert list(tmp_path.iterdir()) == []
    # with data, the same path trains (and a Solver object is trained on its inputs, the pycaffe way)
    summary = train(solver_file, loader(), iters=2, progress=False, weights=str(case_dir(CASE) / "init.caffemodel"))
    assert summary.iterations == 2
    reference = make_solver(CASE)
    for t in range(2):
        feed(reference, CASE, t)
        reference.step(1)
    assert np.float32(summary.last_loss) == np.float32(reference.last_loss)


def test_train_state_is_refused_for_a_solver_already_built():
    from caffe_compat.errors import CaffeCompatError
    from caffe_compat.proto import caffe_pb2

    with pytest.raises(CaffeCompatError, match="train_state applies while the nets are built"):
        train(make_solver(CASE), loader(), iters=1, progress=False, train_state=caffe_pb2.NetState(level=1))

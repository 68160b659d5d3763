"""Training options: ``--amp fp16`` (autocast + GradScaler) and the ``caffe-compat train`` flags end to end.

fp16: float16 autocast and ``torch.amp.GradScaler`` both run on the CPU with this torch (2.x CPU build), so
the fp16 tests run on the CPU, and on CUDA as well when it is present (the ``DEVICES`` parametrisation of
tests/losses/test_devices.py).  Checked: the steps run with finite losses, the master weights stay float32
and move, the GradScaler state is written in each ``.trainstate`` and restored on resume (3 + 1 iterations
equal 4 uninterrupted ones, scaler included).

CLI: ``caffe-compat train --amp bf16 --channels-last --log ... --tensorboard ...`` on a toy DummyData
solver (the sgd_step_momentum fixture net with its Input layers replaced by a DummyData layer, max_iter 2):
exit 0, the options reach the Solver, the CSV log is written; without tensorboard installed, the warning
that no TensorBoard log is written.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from caffe_compat.cli import main
from caffe_compat.solver import Solver, SolverObserver
from caffe_compat.solver.train import train, train_state_path
from tests.conftest import REPO
from tests.solver.caffe_cases import case_dir, make_solver, param_arrays
from tests.solver.test_train import CASE, loader

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None
SCALER_KEYS = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}


def _fp16_run(device, iters, prefix=None, resume=None):
    """train() with amp='fp16'; returns (solver, losses, scaler state after each iteration)."""
    solver = make_solver(CASE, device=device, **({"snapshot_prefix": str(prefix)} if prefix else {}))
    solver.param.snapshot = 3
    losses, scales = [], []
    solver.observers.append(SolverObserver(
        on_iteration=lambda s: (losses.append(s.last_loss), scales.append(s.grad_scaler.state_dict()))))
    train(solver, loader(), iters=iters, amp="fp16", resume=resume, progress=False)
    return solver, losses, scales


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_autocast_with_grad_scaler_trains(device, tmp_path):
    initial = param_arrays(make_solver(CASE, device=device))
    solver, losses, scales = _fp16_run(device, 4, prefix=tmp_path / "fp16")
    assert isinstance(solver.grad_scaler, torch.amp.GradScaler) and solver.grad_scaler.is_enabled()
    assert solver.autocast_dtype == torch.float16 and solver.iter == 4
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses), losses
    assert solver.net.params["conv1"][0].dtype == torch.float32  # master weights and the update stay float32
    after = param_arrays(solver)
    assert all(np.isfinite(v).all() for v in after.values())
    assert any(not np.array_equal(after[k], initial[k]) for k in initial)  # the updates were applied
    # fp16 arithmetic really ran: the first loss (same weights, same batch) is the float32 one up to fp16 rounding
    plain = make_solver(CASE, device=device)
    train(plain, loader(), iters=1, progress=False)
    assert losses[0] != plain.last_loss and losses[0] == pytest.approx(plain.last_loss, rel=1e-2)
    # the scaler's state goes into the .trainstate written beside the snapshot of iteration 3
    state_path = tmp_path / "fp16_iter_3.solverstate"
    saved = json.loads(open(train_state_path(state_path)).read())["grad_scaler"]
    assert set(saved) == SCALER_KEYS and saved == scales[2]
    assert saved["scale"] > 0 and math.isfinite(saved["scale"])


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_resume_restores_the_grad_scaler(device, tmp_path):
    """3 iterations, snapshot, resume for 1: the same losses, scaler states and weights as 4 uninterrupted."""
    full, full_losses, full_scales = _fp16_run(device, 4, prefix=tmp_path / "full")
    _fp16_run(device, 3, prefix=tmp_path / "part")
    resumed, losses, scales = _fp16_run(device, 1, prefix=tmp_path / "part",
                                        resume=str(tmp_path / "part_iter_3.solverstate"))
    assert resumed.iter == 4
    assert losses == full_losses[3:] and scales == full_scales[3:]
    expected = param_arrays(full)
    for key, value in param_arrays(resumed).items():
        np.testing.assert_array_equal(value, expected[key], err_msg=key)


def test_fp16_first_iteration_is_not_skipped():
    """Loss layers run in float32 under autocast: GradScaler's first scale (65536, above float16's 65504)
    reaches their top without overflowing, so the first fp16 step updates the weights."""
    solver = make_solver(CASE)
    before = param_arrays(solver)
    train(solver, loader(), iters=1, amp="fp16", progress=False)
    # the float32 gradients times 65536 stay below 34600 here: nothing should overflow
    assert solver.grad_scaler.get_scale() == 65536.0
    assert any(not np.array_equal(param_arrays(solver)[k], before[k]) for k in before)


# ------------------------------------------------------------------------------------------------ the CLI

DUMMY = ('layer { name: "data" type: "DummyData" top: "data" top: "label" dummy_data_param { '
         'shape { dim: 4 dim: 3 dim: 10 dim: 10 } shape { dim: 4 } '
         'data_filler { type: "gaussian" std: 1 } data_filler { type: "constant" value: 2 } } }')


def _dummy_solver(tmp_path, max_iter=2, snapshot=0) -> str:
    """The fixture's toy net fed by a DummyData layer (the CLI refuses Input-only nets) and its solver."""
    net = [line for line in (case_dir(CASE) / "net.prototxt").read_text().splitlines() if '"Input"' not in line]
    net.insert(1, DUMMY)
    (tmp_path / "net.prototxt").write_text("\n".join(net) + "\n")
    (tmp_path / "solver.prototxt").write_text(
        f'net: "net.prototxt"\nbase_lr: 0.01\nlr_policy: "fixed"\nmomentum: 0.9\nmax_iter: {max_iter}\n'
        f'snapshot: {snapshot}\nsnapshot_prefix: "{tmp_path / "snap"}"\nsnapshot_after_train: false\n'
        f'random_seed: 1\nsolver_mode: CPU\n')
    return str(tmp_path / "solver.prototxt")


def _rows(path) -> list[dict]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


@pytest.fixture
def seen(monkeypatch):
    """What the Solver that the CLI built was set up with, read at its step() call."""
    record = {}
    original = Solver.step

    def step(self, iters=1):
        record.update(autocast=self.autocast_dtype, memory_format=self.memory_format, scaler=self.grad_scaler,
                      conv_nhwc=self.net.params["conv1"][0].is_contiguous(memory_format=torch.channels_last),
                      device=str(self.device))
        return original(self, iters)

    monkeypatch.setattr(Solver, "step", step)
    return record


def test_cli_amp_bf16_channels_last_tensorboard(tmp_path, monkeypatch, capsys, seen):
    monkeypatch.chdir(tmp_path)
    solver = _dummy_solver(tmp_path)
    args = ["train", solver, "--amp", "bf16", "--channels-last", "--log", str(tmp_path / "log.csv"),
            "--tensorboard", str(tmp_path / "tb"), "--device", "cpu"]
    if HAS_TENSORBOARD:
        status = main(args)
    else:
        with pytest.warns(UserWarning, match="tensorboard is not installed: no TensorBoard log is written"):
            status = main(args)
    out = capsys.readouterr().out
    assert status == 0, out
    assert "trained 2 iterations" in out and "on cpu" in out
    assert seen == {"autocast": torch.bfloat16, "memory_format": torch.channels_last, "scaler": None,
                    "conv_nhwc": True, "device": "cpu"}
    rows = _rows(tmp_path / "log.csv")
    assert list(rows[0]) == ["iter", "loss", "smoothed_loss", "lr", "clip_scale", "seconds"]
    assert [int(r["iter"]) for r in rows] == [0, 1]
    losses = [float(r["loss"]) for r in rows]
    assert all(math.isfinite(v) and v > 0 for v in losses)
    # the loss layer ran in float32 under bf16 autocast: the logged losses are not all bfloat16 numbers
    as_f32 = torch.tensor(losses, dtype=torch.float32)
    assert not torch.equal(as_f32.bfloat16().float(), as_f32), losses
    assert [float(r["lr"]) for r in rows] == pytest.approx([0.01, 0.01])
    if HAS_TENSORBOARD:
        assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    else:
        assert not (tmp_path / "tb").exists()


def test_cli_amp_fp16_saves_the_grad_scaler_in_the_trainstate(tmp_path, monkeypatch, capsys, seen):
    monkeypatch.chdir(tmp_path)
    solver = _dummy_solver(tmp_path, snapshot=2)
    assert main(["train", solver, "--amp", "fp16", "--log", str(tmp_path / "log.csv"), "--device", "cpu"]) == 0
    assert "trained 2 iterations" in capsys.readouterr().out
    assert seen["autocast"] == torch.float16 and isinstance(seen["scaler"], torch.amp.GradScaler)
    assert all(math.isfinite(float(r["loss"])) for r in _rows(tmp_path / "log.csv"))
    state = json.loads((tmp_path / "snap_iter_2.trainstate").read_text())
    assert state["iter"] == 2 and set(state["grad_scaler"]) == SCALER_KEYS
    assert state["grad_scaler"] == seen["scaler"].state_dict()


@pytest.mark.skipif(HAS_TENSORBOARD, reason="tensorboard is installed: the log is written (tested above)")
def test_cli_tensorboard_missing_says_so_on_stderr(tmp_path):
    solver = _dummy_solver(tmp_path)
    command = [sys.executable, "-m", "caffe_compat.cli", "train", solver, "--tensorboard", str(tmp_path / "tb"),
               "--log", str(tmp_path / "log.csv"), "--device", "cpu"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    assert "tensorboard is not installed: no TensorBoard log is written" in done.stderr
    assert "Traceback" not in done.stderr
    assert [int(r["iter"]) for r in _rows(tmp_path / "log.csv")] == [0, 1]
    assert not (tmp_path / "tb").exists()

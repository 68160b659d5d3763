"""The training loop around a :class:`Solver`: devices, mixed precision, logging, data sets.

``train(solver, data=loader, iters=..., device="cuda", amp="bf16", channels_last=True, compile=False,
progress=True, csv_log="train.csv", tensorboard="runs/x", deterministic=True, seed=0)`` runs Caffe's
iterations unchanged (same update rules, lr policy, iter_size, clipping, snapshots) and adds:

* ``data``: an iterable of batches (a DataLoader): dicts ``{blob: tensor}`` or tuples in the order of
  the net's Input tops; restarted when exhausted (epochs).  Without it the solver's own inputs/data
  layers are used.
* ``amp``: ``"bf16"`` or ``"fp16"`` autocast for forward/backward; fp16 adds dynamic loss scaling
  (``torch.amp.GradScaler``; a step whose gradients overflow is skipped, the iteration still counts).
  Parameters, diffs and Caffe's update stay float32.
* ``channels_last``: 4-D parameters and inputs in NHWC memory order (values unchanged).
* ``compile``: the net's forward through ``torch.compile``.
* ``deterministic``: seeds (torch, numpy, random), ``torch.use_deterministic_algorithms``, no cuDNN
  autotuning: two runs with the same seed give the same weights.
* a tqdm bar with loss and lr, a CSV log (``iter, loss, smoothed_loss, lr, clip_scale, seconds``),
  TensorBoard scalars when ``torch.utils.tensorboard`` is importable (else a warning), and a
  :class:`TrainSummary` at the end (also logged).

Iterations run to ``max_iter`` by default; then, as ``Solver::Solve`` does, a snapshot is written when
``snapshot_after_train`` (unless the last iteration just wrote one).
"""

from __future__ import annotations

import csv
import logging
import os
import random
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from caffe_compat.errors import CaffeCompatError, FormatError, TrainingDiverged
from caffe_compat.solver.solver import Solver

__all__ = ["TrainSummary", "set_deterministic", "train"]

log = logging.getLogger("caffe_compat.solver.train")

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class TrainSummary:
    iterations: int
    seconds: float
    iters_per_s: float
    first_loss: float
    last_loss: float
    last_smoothed_loss: float
    last_lr: float
    device: str
    amp: str | None
    snapshots: list[str] = field(default_factory=list)
    diverged_at: int | None = None

    def __str__(self) -> str:
        text = (f"{self.iterations} iterations in {self.seconds:.1f} s ({self.iters_per_s:.2f} it/s) on {self.device}"
                f"{' with ' + self.amp if self.amp else ''}; loss {self.first_loss:.6g} -> {self.last_loss:.6g} "
                f"(smoothed {self.last_smoothed_loss:.6g}), lr {self.last_lr:.6g}")
        if self.snapshots:
            text += f"; snapshots: {', '.join(self.snapshots)}"
        if self.diverged_at is not None:
            text += f"; DIVERGED at iteration {self.diverged_at}"
        return text


def set_deterministic(seed: int) -> None:
    """Seed torch/numpy/random and ask PyTorch for deterministic kernels (cuBLAS workspace set too)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


def _batches(data, names: list[str]):
    """Endless dict batches from an iterable (restarted when exhausted)."""
    while True:
        empty = True
        for batch in data:
            empty = False
            if isinstance(batch, dict):
                yield batch
            else:
                batch = list(batch)
                if len(batch) != len(names):
                    raise CaffeCompatError(f"train: a batch of {len(batch)} items for the net inputs {names}; "
                                           f"yield dicts or one item per input")
                yield dict(zip(names, batch))
        if empty:
            raise CaffeCompatError("train: the data source yielded no batch")


class _Recorder:
    """Iteration hook: progress bar, CSV rows, TensorBoard scalars."""

    def __init__(self, total: int, progress: bool, csv_log, tensorboard):
        self.start = time.perf_counter()
        self.first_loss = None
        self.bar = None
        if progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, unit="it", dynamic_ncols=True)
        self.csv_file = self.writer = None
        if csv_log:
            new = not os.path.exists(csv_log) or os.path.getsize(csv_log) == 0
            self.csv_file = open(csv_log, "a", newline="")
            self.csv = csv.writer(self.csv_file)
            if new:
                self.csv.writerow(["iter", "loss", "smoothed_loss", "lr", "clip_scale", "seconds"])
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional
                warnings.warn("tensorboard is not installed: no TensorBoard log is written", stacklevel=3)
            else:
                self.writer = SummaryWriter(tensorboard)

    def __call__(self, solver: Solver) -> None:
        if self.first_loss is None:
            self.first_loss = solver.last_loss
        clip = solver.optimizer.last_clip
        it = solver.iter - 1  # the iteration just finished (Caffe's numbering in its log)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{solver.smoothed_loss:.4g}", lr=f"{solver.last_lr:.3g}")
        if self.csv_file is not None:
            self.csv.writerow([it, f"{solver.last_loss:.9g}", f"{solver.smoothed_loss:.9g}", f"{solver.last_lr:.9g}",
                               "" if clip is None else f"{clip[1]:.9g}", f"{time.perf_counter() - self.start:.3f}"])
            self.csv_file.flush()
        if self.writer is not None:
            self.writer.add_scalar("train/loss", solver.last_loss, it)
            self.writer.add_scalar("train/smoothed_loss", solver.smoothed_loss, it)
            self.writer.add_scalar("train/lr", solver.last_lr, it)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.csv_file is not None:
            self.csv_file.close()
        if self.writer is not None:
            self.writer.close()


def train(solver, data=None, *, iters: int | None = None, weights=None, resume=None, device=None,
          amp: str | None = None, channels_last: bool = False, compile: bool = False, progress: bool = True,
          csv_log=None, tensorboard=None, deterministic: bool = False, seed: int | None = None,
          test_data=None) -> TrainSummary:
    """Train ``solver`` (a :class:`Solver` or a solver prototxt path) — see the module docstring.

    ``iters``: iterations to run (default: up to ``max_iter``).  ``weights``/``resume``: a caffemodel to
    start from / a ``.solverstate`` to continue.  ``test_data``: one iterable per TEST net.
    """
    if amp is not None and amp not in AMP_DTYPES:
        raise FormatError(f"amp must be one of {sorted(AMP_DTYPES)} or None, got {amp!r}")
    if deterministic:
        set_deterministic(0 if seed is None else int(seed))
    elif seed is not None:
        torch.manual_seed(int(seed))
    if not isinstance(solver, Solver):
        solver = Solver(solver, weights=weights, device=device)
    elif weights is not None:
        for path in Solver._weight_list(weights):
            solver.net.load_caffemodel(path)
    if resume is not None:
        solver.restore(resume)
    if data is not None:
        solver.data_source = _batches(data, solver.net.input_names)
    for i, source in enumerate(test_data or []):
        solver.test_data_sources[i] = _batches(source, solver.test_nets[i].input_names)
    if amp is not None:
        solver.autocast_dtype = AMP_DTYPES[amp]
        if amp == "fp16":
            solver.grad_scaler = torch.amp.GradScaler(solver.device.type)
    if channels_last:
        solver.memory_format = torch.channels_last
        for net in [solver.net] + solver.test_nets:
            net.to(memory_format=torch.channels_last)
    if compile:
        solver.forward_fn = torch.compile(solver.net)
    total = int(solver.param.max_iter) - solver.iter if iters is None else int(iters)
    recorder = _Recorder(max(total, 0), progress, csv_log, tensorboard)
    solver.iteration_hooks.append(recorder)
    snapshots: list[str] = []
    start_iter, start = solver.iter, time.perf_counter()
    diverged = None
    try:
        solver.step(total)
        p = solver.param
        if iters is None and p.snapshot_after_train and (not p.snapshot or solver.iter % p.snapshot != 0):
            snapshots.extend(solver.snapshot())
    except TrainingDiverged as exc:
        diverged = solver.iter
        log.error("%s", exc)
        raise
    finally:
        recorder.close()
        solver.iteration_hooks.remove(recorder)
        seconds = time.perf_counter() - start
        done = solver.iter - start_iter
        summary = TrainSummary(iterations=done, seconds=seconds, iters_per_s=done / seconds if seconds > 0 else 0.0,
                               first_loss=recorder.first_loss if recorder.first_loss is not None else float("nan"),
                               last_loss=solver.last_loss, last_smoothed_loss=solver.smoothed_loss,
                               last_lr=solver.last_lr, device=str(solver.device), amp=amp, snapshots=snapshots,
                               diverged_at=diverged)
        log.info("Training summary: %s", summary)
    return summary

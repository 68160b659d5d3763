"""What :func:`~caffe_compat.solver.train.train` records of a run, as a solver observer: a tqdm progress bar
with loss and lr, a CSV log (``iter, loss, smoothed_loss, lr, clip_scale, seconds``, appended to), TensorBoard
scalars (``train/loss``, ``train/smoothed_loss``, ``train/lr``) when ``torch.utils.tensorboard`` is
importable (else a warning), the first loss and every snapshot written (for the run's summary).
"""

from __future__ import annotations

import csv
import os
import time
import warnings

from caffe_compat.solver.solver import Solver

__all__ = ["Recorder"]

class Recorder:
    """Solver observer: a progress bar over ``total`` iterations (when ``progress``), CSV rows to ``csv_log``,
    TensorBoard scalars to ``tensorboard`` (each when given); ``first_loss`` and ``snapshots`` (the paths of
    every snapshot written, periodic ones included) for the summary.  :meth:`close` when done."""

    def __init__(self, total: int, progress: bool, csv_log, tensorboard):
        self.start = time.perf_counter()
        self.first_loss = None
        self.snapshots: list[str] = []
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
                # stacklevel: Recorder() <- the training loop <- train(): the warning points at train()
                warnings.warn("tensorboard is not installed: no TensorBoard log is written", stacklevel=3)
            else:
                self.writer = SummaryWriter(tensorboard)

    def on_iteration(self, solver: Solver) -> None:
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

    def on_snapshot(self, solver: Solver, model_path, state_path) -> None:
        self.snapshots.extend(str(p) for p in (model_path, state_path) if p)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.csv_file is not None:
            self.csv_file.close()
        if self.writer is not None:
            self.writer.close()

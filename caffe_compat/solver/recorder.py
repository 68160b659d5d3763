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
from pathlib import Path

from caffe_compat.io.atomic import open_log, write_error
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
        self.csv_file = self.writer = None
        self.csv_log = csv_log
        if csv_log:
            self.csv_file = open_log(csv_log, "a", newline="")  # WriteError: a folder, a FIFO without reader
            self.csv = csv.writer(self.csv_file)
            if os.fstat(self.csv_file.fileno()).st_size == 0:  # new or empty (a FIFO: a stream)
                self._write_csv(["iter", "loss", "smoothed_loss", "lr", "clip_scale", "seconds"])
        self.bar = None
        if progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, unit="it", dynamic_ncols=True)
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
            self._write_csv([it, f"{solver.last_loss:.9g}", f"{solver.smoothed_loss:.9g}", f"{solver.last_lr:.9g}",
                             "" if clip is None else f"{clip[1]:.9g}", f"{time.perf_counter() - self.start:.3f}"])
        if self.writer is not None:
            self.writer.add_scalar("train/loss", solver.last_loss, it)
            self.writer.add_scalar("train/smoothed_loss", solver.smoothed_loss, it)
            self.writer.add_scalar("train/lr", solver.last_lr, it)

    def _write_csv(self, row) -> None:
        """One CSV row, flushed; a failed write (a full disk) is a WriteError naming the log, which is then
        closed (the run stops: exit 2, not a traceback)."""
        try:
            self.csv.writerow(row)
            self.csv_file.flush()
        except OSError as exc:
            self._drop_csv()
            raise write_error(Path(self.csv_log), exc) from None

    def _drop_csv(self) -> None:
        file, self.csv_file = self.csv_file, None
        try:
            file.close()
        except OSError:  # its unwritten rows: the error is already raised
            pass

    def on_snapshot(self, solver: Solver, model_path, state_path) -> None:
        self.snapshots.extend(str(p) for p in (model_path, state_path) if p)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.csv_file is not None:
            file, self.csv_file = self.csv_file, None
            try:
                file.close()
            except OSError as exc:
                raise write_error(Path(self.csv_log), exc) from None
        if self.writer is not None:
            self.writer.close()

"""Caffe's ``tools/extra/parse_log.py`` (train and test CSVs from a training log) and the training-curve
PNG of ``tools/extra/plot_training_log.py.example``.

The log is Caffe's (``caffe train ... 2>&1 | tee log``, or glog's ``caffe.INFO``) or ours (``caffe-compat
train --caffe-log LOG``): glog lines with the ``I1124 21:48:49.577123 ...`` prefix or newer glog's
``I20261124 21:48:49.577123 ...`` (:mod:`caffe_compat.io.glog`).  As Caffe's script:

* ``Seconds`` count from the first line containing ``Solving`` (the solver's ``Solving <net>``; without
  one, from the first line with a glog prefix); lines before the first ``Iteration N`` are skipped and
  every line is attributed to the last ``Iteration N`` seen;
* ``LearningRate`` is the last ``lr = x`` seen (Caffe prints it after the outputs, so a row holds the
  previous display's rate); the first row's, still NaN, is copied from the second row;
* ``Train net output #k: name = value`` and ``Test net output #k: name = value`` lines make the rows of
  the train and test tables: columns ``NumIters, Seconds, LearningRate`` then the outputs in the order
  they first appear; one row per display block (``#0``, ``#1``, ... at one iteration), so two test nets
  give two rows per test, as with Caffe's script.

Differences, all additions: an output blob of several elements (``#1: pair_label = 0``, ``#2: pair_label
= 1``, ...) gets one column per element, ``name[0]``, ``name[1]``, ... (Caffe's script overwrites one
column and splits the rows); the last (or only) row is kept (Caffe's script drops a single row that
never completes); ``nan``/``inf`` values are read; an empty table is written as its header; for ``MMDD``
prefixes the year is the ``year`` given (default: the log file's modification year) and increases when
the month goes back (a run over New Year).  The CSVs are written as Caffe's script writes them
(``csv`` module, floats as Python prints them, ``<log name>.train`` / ``<log name>.test``).
"""

from __future__ import annotations

import csv
import datetime as _dt
import io
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from caffe_compat.errors import CaffeCompatError, DataError
from caffe_compat.io.safe_open import read_regular_text
from caffe_compat.io.glog import parse_line

__all__ = ["TrainingLog", "parse_log", "plot_training_log", "save_csv_files"]

_NUMBER = r"([-+]?(?:nan|inf|[\.\deE+-]+))"
_ITERATION = re.compile(r"Iteration (\d+)")
_LEARNING_RATE = re.compile(r"lr = ([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)")
_TRAIN = re.compile(r"Train net output #(\d+): (\S+) = " + _NUMBER, re.IGNORECASE)
_TEST = re.compile(r"Test net output #(\d+): (\S+) = " + _NUMBER, re.IGNORECASE)
BASE_COLUMNS = ("NumIters", "Seconds", "LearningRate")


@dataclass
class TrainingLog:
    """The rows of the train and test tables (dicts keyed by column) and their columns."""

    train: list[dict] = field(default_factory=list)
    test: list[dict] = field(default_factory=list)

    @staticmethod
    def _columns(rows: list[dict]) -> list[str]:
        columns = list(BASE_COLUMNS)
        for row in rows:
            columns += [key for key in row if key not in columns]
        return columns

    @property
    def train_columns(self) -> list[str]:
        return self._columns(self.train)

    @property
    def test_columns(self) -> list[str]:
        return self._columns(self.test)

    def csv_text(self, which: str, delimiter: str = ",") -> str:
        rows = self.train if which == "train" else self.test
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=self._columns(rows), delimiter=delimiter, restval="",
                                lineterminator="\r\n")  # csv.excel's terminator, as Caffe's script writes
        writer.writeheader()
        writer.writerows(rows)
        return out.getvalue()


class _Table:
    """Rows from output lines: one row per display block (``#0``, ``#1``, ... of one net at one
    iteration); a block ends when ``#k`` does not increase or the iteration changes."""

    def __init__(self):
        self.rows: list[dict] = []
        self.block: list[tuple[int, str, float]] = []
        self.head: dict | None = None

    def add(self, iteration, seconds, rate, index, name, value) -> None:
        if self.head is not None and (self.head["NumIters"] != iteration or index <= self.block[-1][0]):
            self._close()
        if self.head is None:
            self.head = {"NumIters": iteration, "Seconds": seconds, "LearningRate": rate}
        self.block.append((index, name, value))

    def _close(self) -> None:
        counts: dict[str, int] = {}
        for _, name, _ in self.block:
            counts[name] = counts.get(name, 0) + 1
        row, seen = dict(self.head), {}
        for _, name, value in self.block:
            if counts[name] > 1:  # a blob of several elements: one column per element
                k = seen[name] = seen.get(name, -1) + 1
                row[f"{name}[{k}]"] = value
            else:
                row[name] = value
        self.rows.append(row)
        self.block, self.head = [], None

    def finish(self) -> list[dict]:
        if self.head is not None:
            self._close()
        if len(self.rows) > 1 and math.isnan(self.rows[0]["LearningRate"]):
            self.rows[0]["LearningRate"] = self.rows[1]["LearningRate"]
        return self.rows


def parse_log(path, year: int | None = None) -> TrainingLog:
    """The train and test tables of the log at ``path`` (module docstring).  A ``year`` outside 1..9999 (the
    dates Python's datetime holds) is a :class:`CaffeCompatError` before the log is read."""
    if year is not None and not 1 <= year <= 9999:
        raise CaffeCompatError(f"--year must be 1 to 9999, got {year}")
    path = Path(path)
    try:
        text = read_regular_text(path, "the log", encoding="utf-8", errors="replace")
        if year is None:
            year = _dt.datetime.fromtimestamp(path.stat().st_mtime).year
    except OSError as exc:
        raise DataError(f"{path}: cannot read the log ({exc.strerror or exc})") from None
    lines = text.splitlines()
    start = None
    first = None
    year_now, last_month = year, None
    stamped = []  # (timestamp, line) of every line with a glog prefix
    for line in lines:
        head = parse_line(line)
        if head is None:
            continue
        if head.year is None:
            if last_month is not None and head.month < last_month:
                year_now += 1
            last_month = head.month
        when = head.timestamp(year_now)
        stamped.append((when, head.message))
        if first is None:
            first = when
        if start is None and "Solving" in head.message:
            start = when
    if not stamped:
        raise DataError(f"{path}: no glog lines (I1124 21:48:49.577 ... or I20261124 21:48:49.577 ...): not a "
                        f"Caffe training log")
    start = start or first
    train, test = _Table(), _Table()
    iteration, rate = -1.0, float("nan")
    for when, message in stamped:
        match = _ITERATION.search(message)
        if match:
            iteration = float(match.group(1))
        if iteration == -1:
            continue
        seconds = (when - start).total_seconds()
        match = _LEARNING_RATE.search(message)
        if match:
            rate = float(match.group(1))
        for regex, table in ((_TRAIN, train), (_TEST, test)):
            match = regex.search(message)
            if match:
                table.add(iteration, seconds, rate, int(match.group(1)), match.group(2), float(match.group(3)))
    return TrainingLog(train=train.finish(), test=test.finish())


def save_csv_files(log: TrainingLog, logfile_path, output_dir, delimiter: str = ",") -> tuple[Path, Path]:
    """``<output_dir>/<log name>.train`` and ``.test`` (atomically); returns both paths."""
    from caffe_compat.io.atomic import write_text_atomic

    name = os.path.basename(os.fspath(logfile_path))
    paths = Path(output_dir) / f"{name}.train", Path(output_dir) / f"{name}.test"
    for which, target in zip(("train", "test"), paths):
        write_text_atomic(target, log.csv_text(which, delimiter))
    return paths


def _is_loss(name: str) -> bool:
    return "loss" in name.lower()


def plot_training_log(log: TrainingLog, path, x: str = "iterations", title: str | None = None) -> Path:
    """A PNG of the training curves: every loss output (train and test share one axis: same unit), the
    other outputs (accuracy, ...) on their own axis, and the learning rate on a third, against
    ``x`` = ``iterations`` or ``seconds``.  Values are drawn as logged (no smoothing); test points are
    marked; the columns of multi-element blobs (``name[k]``) are not drawn.  Written atomically; returns the path."""
    from caffe_compat.errors import CaffeCompatError
    from caffe_compat.io.atomic import atomic_path

    if x not in ("iterations", "seconds"):
        raise CaffeCompatError(f"x must be 'iterations' or 'seconds', got {x!r}")
    if not log.train and not log.test:
        raise DataError("the log has no train or test outputs to plot")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise CaffeCompatError("the training-curve PNG needs matplotlib (pip install matplotlib)") from None
    key = "NumIters" if x == "iterations" else "Seconds"
    series = []  # (panel, label, xs, ys, is_test)
    for kind, rows, columns in (("train", log.train, log.train_columns), ("test", log.test, log.test_columns)):
        for column in columns[len(BASE_COLUMNS):]:
            if column.endswith("]"):  # one element of a multi-element blob: not a training curve
                continue
            points = [(row[key], row[column]) for row in rows if column in row and math.isfinite(row[column])]
            if points:
                panel = "loss" if _is_loss(column) else "outputs"
                series.append((panel, f"{kind} {column}", *zip(*points), kind == "test"))
    rates = [(row[key], row["LearningRate"]) for row in log.train or log.test if math.isfinite(row["LearningRate"])]
    if not series and not rates:
        raise DataError("the log has no scalar outputs or learning rates to plot")
    panels = [p for p in ("loss", "outputs") if any(s[0] == p for s in series)] + (["lr"] if rates else [])
    figure = Figure(figsize=(7.0, 2.6 * len(panels) + 0.6), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, panel in zip(axes, panels):
        if panel == "lr":
            xs, ys = zip(*rates)
            ax.plot(xs, ys, color="tab:gray", drawstyle="steps-post", label="learning rate")
            if min(ys) > 0 and max(ys) / min(ys) >= 100:
                ax.set_yscale("log")
            ax.set_ylabel("learning rate")
        else:
            for _, label, xs, ys, is_test in (s for s in series if s[0] == panel):
                ax.plot(xs, ys, marker="o" if is_test else None, markersize=3, linewidth=1.2, label=label)
            ax.set_ylabel("loss" if panel == "loss" else "output value")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    axes[-1].set_xlabel("iterations" if x == "iterations" else "seconds since Solving")
    axes[0].set_title(title or "training log")
    figure.tight_layout()
    target = Path(path)
    with atomic_path(target) as tmp:
        figure.savefig(tmp, format="png")
    return target

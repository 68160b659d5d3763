"""PNG plots of retrieval results and training: a Recall@K curve (with the seed spread as error bars),
a CMC curve (the FAPPY paper's Fig. 6) and training-loss panels, one per loss.

matplotlib is optional: it is imported inside each function and drawn through its object API on an
Agg canvas (no pyplot, no global backend switch); without it a :class:`CaffeCompatError` says so.
``plot_*`` take one curve or a mapping ``{legend label: curve}``, write the PNG atomically and return
its path; the ``*_figure`` functions build the same :class:`~matplotlib.figure.Figure` without writing.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from caffe_compat.errors import CaffeCompatError
from caffe_compat.evaluate.inputs import EvaluationInputError
from caffe_compat.io.atomic import atomic_path

#: The y axis of a Recall@K plot spans at least this many percentage points ...
MIN_RECALL_SPAN = 25.0
#: ... and at least this many times the longest error bar (see :func:`recall_axis_limits`).
SPREAD_SPAN_FACTOR = 10.0


def _figure(size=(6.0, 4.5)):
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise CaffeCompatError("plots need matplotlib, which is not installed (pip install matplotlib)") from exc
    figure = Figure(figsize=size, dpi=100)
    FigureCanvasAgg(figure)
    return figure


def _named(curves, default: str) -> dict:
    if isinstance(curves, Mapping) and curves and all(isinstance(v, (Mapping, list, tuple, np.ndarray)) or hasattr(v, "numpy") for v in curves.values()):
        return dict(curves)
    return {default: curves}


def _label(axes, title: str, xlabel: str, ylabel: str) -> None:
    axes.set_title(title)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.grid(True, alpha=0.3)
    axes.legend(loc="lower right")


def save_png(figure, path) -> Path:
    """Write ``figure`` as a PNG at ``path``, atomically (a reader never sees half a file)."""
    path = Path(path)
    with atomic_path(path) as tmp:
        figure.savefig(tmp, format="png")
    return path


def recall_axis_limits(values, errors=None) -> tuple[float, float]:
    """The y range (%) of a Recall@K plot, chosen so that differences smaller than the spread never look
    large.  Top: 100 % (a recall's ceiling; higher only where an error bar reaches past it).  Bottom: the
    lowest value minus its error bar, lowered further until the range spans at least
    :data:`MIN_RECALL_SPAN` percentage points and :data:`SPREAD_SPAN_FACTOR` times the longest error bar
    (2 std: mean - std to mean + std), but never below 0.  One point of margin on either side."""
    values = np.asarray(values, dtype=np.float64).reshape(-1)
    errors = np.zeros_like(values) if errors is None else np.asarray(errors, dtype=np.float64).reshape(-1)
    ceiling = max(100.0, float(np.max(values + errors)))
    span = max(MIN_RECALL_SPAN, SPREAD_SPAN_FACTOR * 2.0 * float(np.max(errors, initial=0.0)))
    floor = max(0.0, min(float(np.min(values - errors)), ceiling - span))
    return floor - 1.0, ceiling + 1.0


def recall_at_k_figure(curves, *, spread=None, title: str = "Recall@K"):
    """The Figure of :func:`plot_recall_at_k`: Recall@K (%) against K (log2 axis), one line per curve.

    ``spread`` (optional) maps a curve's label to ``{K: std}`` (same units as the curve, e.g. the sample
    std over seeds), drawn as error bars of +- std; the points of different curves are shifted apart by
    a few percent of a K step so that their bars do not hide each other (the ticks stay at K).  The y
    range follows :func:`recall_axis_limits`."""
    figure = _figure()
    axes = figure.add_subplot(1, 1, 1)
    named = _named(curves, "Recall@K")
    shifts = np.linspace(-0.06, 0.06, len(named)) if len(named) > 1 else [0.0]
    values, errors = [], []
    for shift, (name, curve) in zip(shifts, named.items()):
        if not isinstance(curve, Mapping) or not curve:
            raise EvaluationInputError(f"recall curve {name!r}: expected a non-empty {{K: recall}} mapping")
        ks = sorted(int(k) for k in curve)
        ys = [100.0 * float(curve[k] if k in curve else curve[str(k)]) for k in ks]
        bars = (spread or {}).get(name)
        err = None if bars is None else [100.0 * float(bars[k] if k in bars else bars[str(k)]) for k in ks]
        axes.errorbar(np.asarray(ks, dtype=np.float64) * 2.0 ** shift, ys, yerr=err, marker="o", markersize=4,
                      capsize=3, linewidth=1.2, label=str(name))
        axes.set_xscale("log", base=2)
        axes.set_xticks(ks, [str(k) for k in ks])
        values += ys
        errors += err or [0.0] * len(ys)
    axes.set_ylim(*recall_axis_limits(values, errors))
    _label(axes, title, "K", "Recall@K (%)")
    return figure


def plot_recall_at_k(curves, path, *, spread=None, title: str = "Recall@K") -> Path:
    """Recall@K (%) against K (log2 axis); a curve is ``{K: recall in [0, 1]}`` as returned by
    :func:`caffe_compat.evaluate.recall_at_k` (str keys from protocol dicts work too); ``spread``: error
    bars, see :func:`recall_at_k_figure`."""
    return save_png(recall_at_k_figure(curves, spread=spread, title=title), path)


def plot_cmc(curves, path, *, max_rank: int = 50, title: str = "CMC on the Small Gallery Set") -> Path:
    """Match rate (%) against rank 1..``max_rank``; a curve is an array with ``curve[k-1]`` = CMC(k), as
    returned by :func:`caffe_compat.evaluate.vehicleid_cmc_curve`."""
    figure = _figure()
    axes = figure.add_subplot(1, 1, 1)
    for name, curve in _named(curves, "CMC").items():
        values = np.asarray(curve, dtype=np.float64).reshape(-1)[:max_rank]
        if values.size == 0:
            raise EvaluationInputError(f"CMC curve {name!r} is empty")
        axes.plot(np.arange(1, values.size + 1), 100.0 * values, label=str(name))
    axes.set_xlim(1, max_rank)
    _label(axes, title, "Rank", "Match rate (%)")
    return save_png(figure, path)


def running_mean(values, window: int) -> np.ndarray:
    """Means of ``window`` consecutive values (``len(values) - window + 1`` of them)."""
    values = np.asarray(values, dtype=np.float64)
    return np.convolve(values, np.ones(window) / window, mode="valid")


def training_loss_figure(panels: Mapping[str, Mapping[str, tuple]], *, window: int = 1, title: str = "training loss"):
    """One panel per loss, each with its own y axis (different losses are on different scales, so they
    share no axis); in a panel one line per seed, so the spread between seeds shows directly.

    ``panels``: ``{loss: {seed label: (iterations, loss values)}}``; each line is the running mean of
    ``window`` iterations (:func:`running_mean`), plotted at the last iteration of its window."""
    if not panels:
        raise EvaluationInputError("training-loss plot: no loss to draw")
    columns = min(2, len(panels))
    rows = -(-len(panels) // columns)
    figure = _figure((4.8 * columns, 3.2 * rows + 0.6))
    for index, (loss, seeds) in enumerate(panels.items()):
        axes = figure.add_subplot(rows, columns, index + 1)
        for seed, (iterations, values) in seeds.items():
            iterations = np.asarray(iterations).reshape(-1)
            if iterations.size < window:
                raise EvaluationInputError(f"training-loss plot: {loss} {seed} has {iterations.size} "
                                           f"iterations, fewer than the window {window}")
            axes.plot(iterations[window - 1:], running_mean(values, window), linewidth=1.0, label=str(seed))
        axes.set_title(str(loss))
        axes.set_xlabel("iteration")
        axes.set_ylabel(f"loss, running mean of {window}" if window > 1 else "loss")
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=8, loc="upper right")
    figure.suptitle(f"{title}\n(one panel per loss: their values are on different scales)", fontsize=10)
    figure.tight_layout()
    return figure


def plot_training_loss(panels, path, *, window: int = 1, title: str = "training loss") -> Path:
    """Write :func:`training_loss_figure` as a PNG at ``path``."""
    return save_png(training_loss_figure(panels, window=window, title=title), path)

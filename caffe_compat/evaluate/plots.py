"""PNG plots of retrieval results: a Recall@K curve and a CMC curve (the FAPPY paper's Fig. 6).

matplotlib is optional: it is imported inside each function and drawn through its object API on an
Agg canvas (no pyplot, no global backend switch); without it a :class:`CaffeCompatError` says so.
Both functions take one curve or a mapping ``{legend label: curve}`` and return the written path.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from caffe_compat.errors import CaffeCompatError
from caffe_compat.evaluate.inputs import EvaluationInputError


def _figure():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise CaffeCompatError("plots need matplotlib, which is not installed (pip install matplotlib)") from exc
    figure = Figure(figsize=(6.0, 4.5), dpi=100)
    FigureCanvasAgg(figure)
    return figure


def _named(curves, default: str) -> dict:
    if isinstance(curves, Mapping) and curves and all(isinstance(v, (Mapping, list, tuple, np.ndarray)) or hasattr(v, "numpy") for v in curves.values()):
        return dict(curves)
    return {default: curves}


def _save(figure, axes, path, title: str, xlabel: str, ylabel: str) -> Path:
    axes.set_title(title)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.grid(True, alpha=0.3)
    axes.legend(loc="lower right")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png")
    return path


def plot_recall_at_k(curves, path, *, title: str = "Recall@K") -> Path:
    """Recall@K (%) against K (log2 axis); a curve is ``{K: recall in [0, 1]}`` as returned by
    :func:`caffe_compat.evaluate.recall_at_k` (str keys from protocol dicts work too)."""
    figure = _figure()
    axes = figure.add_subplot(1, 1, 1)
    for name, curve in _named(curves, "Recall@K").items():
        if not isinstance(curve, Mapping) or not curve:
            raise EvaluationInputError(f"recall curve {name!r}: expected a non-empty {{K: recall}} mapping")
        ks = sorted(int(k) for k in curve)
        values = [100.0 * float(curve[k] if k in curve else curve[str(k)]) for k in ks]
        axes.plot(ks, values, marker="o", label=str(name))
        axes.set_xscale("log", base=2)
        axes.set_xticks(ks, [str(k) for k in ks])
    return _save(figure, axes, path, title, "K", "Recall@K (%)")


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
    return _save(figure, axes, path, title, "Rank", "Match rate (%)")

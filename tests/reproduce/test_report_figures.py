"""The figures `reproduce` writes, checked on the matplotlib objects that were saved: recall_at_k.png has
error bars of the sample std over seeds and a y range that does not blow up sub-spread differences;
training_loss.png has one panel per loss with a line per seed."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
from matplotlib.container import ErrorbarContainer

from caffe_compat.evaluate import plots
from caffe_compat.evaluate.plots import MIN_RECALL_SPAN, SPREAD_SPAN_FACTOR, recall_axis_limits
from caffe_compat.reproduce.report import write_figures
from caffe_compat.reproduce.setups import SETUPS


@pytest.fixture(scope="module")
def saved(digits_run, tmp_path_factory):
    """``{file name: Figure}`` as write_figures saves them for the digits run, and that run's folder."""
    out, _ = digits_run
    runs = {loss: [json.loads((out / loss / f"seed{s}" / "metrics.json").read_text()) for s in (0, 1)]
            for loss in ("fappy", "triplet")}
    dirs = {(loss, s): out / loss / f"seed{s}" for loss in runs for s in (0, 1)}
    figures, original = {}, plots.save_png
    target = tmp_path_factory.mktemp("figures")

    def record(figure, path):
        figures[path.name] = figure
        return original(figure, path)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(plots, "save_png", record)
        written = write_figures(SETUPS["digits"], target, runs, dirs)
    assert sorted(written) == sorted(str(target / name) for name in ("training_loss.png", "recall_at_k.png"))
    assert not [p for p in target.iterdir() if p.name.startswith(".")]  # no temporary file left behind
    return figures, out


def recall(out, loss: str, k: str) -> np.ndarray:
    return 100 * np.array([json.loads((out / loss / f"seed{s}" / "metrics.json").read_text())["metrics"]
                           ["recall_at_k"][k] for s in (0, 1)])


def test_recall_error_bars_are_the_sample_std_over_seeds(saved):
    figures, out = saved
    (axes,) = figures["recall_at_k.png"].axes
    containers = [c for c in axes.containers if isinstance(c, ErrorbarContainer)]
    assert [c.get_label() for c in containers] == ["fappy (n = 2)", "triplet (n = 2)"]
    for container, loss in zip(containers, ("fappy", "triplet")):
        line, _, (bars,) = container.lines
        ks = ["1", "2", "4", "8", "16", "32"]
        np.testing.assert_allclose(np.asarray(line.get_ydata(), dtype=float), [recall(out, loss, k).mean() for k in ks])
        x = np.asarray(line.get_xdata(), dtype=float)
        assert np.all(np.abs(np.log2(x) - np.log2([int(k) for k in ks])) <= 0.06 + 1e-12)  # dodged, not moved
        for segment, k in zip(bars.get_segments(), ks):
            (_, low), (_, high) = segment
            assert (high - low) / 2 == pytest.approx(recall(out, loss, k).std(ddof=1), abs=1e-9)
    assert "sample std" in axes.get_title()


def test_recall_axis_spans_well_beyond_the_error_bars(saved):
    figures, _ = saved
    (axes,) = figures["recall_at_k.png"].axes
    bottom, top = axes.get_ylim()
    ends = np.concatenate([np.asarray(seg)[:, 1] for c in axes.containers for seg in c.lines[2][0].get_segments()])
    bars = np.array([np.ptp(np.asarray(seg)[:, 1]) for c in axes.containers for seg in c.lines[2][0].get_segments()])
    assert bottom <= ends.min() and top >= max(100.0, ends.max())
    assert top - bottom >= max(MIN_RECALL_SPAN, SPREAD_SPAN_FACTOR * bars.max())
    assert bottom >= -1.0


@pytest.mark.parametrize("values, errors, expected", [
    ([95.0, 99.5], [0.5, 0.5], (74.0, 101.0)),      # saturated toy task: 25 points, not 5
    ([95.0, 99.0], [3.0, 2.0], (40.0, 102.0)),      # wide bars: 10 x 6 points below the ceiling, 101
    ([30.0, 60.0], None, (29.0, 101.0)),            # the data reach below the 25-point floor
    ([5.0, 20.0], [20.0, 1.0], (-1.0, 101.0)),      # never below 0
])
def test_recall_axis_rule(values, errors, expected):
    assert recall_axis_limits(values, errors) == pytest.approx(expected)


def logged_loss(path) -> tuple[np.ndarray, np.ndarray]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return np.array([int(r["iter"]) for r in rows]), np.array([float(r["loss"]) for r in rows])


def test_training_loss_has_a_panel_per_loss_and_a_line_per_seed(saved):
    figures, out = saved
    figure = figures["training_loss.png"]
    assert [a.get_title() for a in figure.axes] == ["fappy", "triplet"]
    for axes in figure.axes:
        assert axes.get_shared_y_axes().get_siblings(axes) == [axes]  # no common y axis
        assert [line.get_label() for line in axes.get_lines()] == ["seed 0", "seed 1"]
        for seed, line in enumerate(axes.get_lines()):
            iters, loss = logged_loss(out / axes.get_title() / f"seed{seed}" / "train_log.csv")
            assert list(iters) == list(range(6))
            window = len(iters) - len(line.get_xdata()) + 1
            assert list(line.get_xdata()) == list(iters[window - 1:])
            np.testing.assert_allclose(line.get_ydata(), np.convolve(loss, np.ones(window) / window, "valid"))

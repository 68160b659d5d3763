"""Recall@K and CMC plots are written as PNG; a missing matplotlib gives a clear error."""

import struct
import sys

import numpy as np
import pytest

from caffe_compat.errors import CaffeCompatError
from caffe_compat.evaluate.plots import plot_cmc, plot_recall_at_k


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_recall_curve_png(tmp_path):
    curves = {"FAPPY": {1: 0.504, 2: 0.626, 4: 0.748, 8: 0.84}, "Histogram": {"1": 0.503, "2": 0.619, "4": 0.726, "8": 0.824}}
    out = plot_recall_at_k(curves, tmp_path / "sub" / "recall.png")
    assert out == tmp_path / "sub" / "recall.png" and png_size(out) == (600, 450)
    single = plot_recall_at_k({1: 0.5, 10: 0.8}, tmp_path / "single.png")
    assert png_size(single) == (600, 450)


def test_cmc_curve_png(tmp_path):
    curve = np.linspace(0.5, 1.0, 80)
    out = plot_cmc({"Ours": curve, "Baseline": curve * 0.9}, tmp_path / "cmc.png", max_rank=50)
    assert png_size(out) == (600, 450)
    assert png_size(plot_cmc(curve, tmp_path / "one.png")) == (600, 450)
    with pytest.raises(CaffeCompatError, match="empty"):
        plot_cmc({"none": []}, tmp_path / "bad.png")


def test_missing_matplotlib_raises_caffe_compat_error(tmp_path, monkeypatch):
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(CaffeCompatError, match="matplotlib"):
        plot_cmc(np.ones(3), tmp_path / "x.png")
    with pytest.raises(CaffeCompatError, match="matplotlib"):
        plot_recall_at_k({1: 1.0}, tmp_path / "y.png")
    assert not (tmp_path / "x.png").exists()

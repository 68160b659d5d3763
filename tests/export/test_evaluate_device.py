"""``evaluate_onnx(..., device=)``: the metrics' k-NN runs on the chosen device (CUDA when torch has it by
default) with the same results; the metrics package never imports the nets."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from caffe_compat.data import make_toy_data
from caffe_compat.errors import CaffeCompatError
from caffe_compat.export import evaluate_onnx, export_onnx
from tests.conftest import REPO
from tests.export.helpers import TINY_PREPROCESSING, write_tiny_net


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("evaldevice")
    prototxt, weights = write_tiny_net(root)
    model = export_onnx(prototxt, weights=weights, path=root / "tiny.onnx", preprocessing=TINY_PREPROCESSING)
    cub = make_toy_data("cub", root / "cub", size=32, num_classes=8, images_per_class=6)
    vehicles = make_toy_data("vehicleid", root / "vehicleid", size=32, num_classes=26, images_per_class=3)
    return {"model": model, "cub": cub, "vehicleid": vehicles}


def _strip(result: dict) -> dict:
    """Everything but the device names and MAP@R (a float mean reduced on the device: equal to ~1e-16)."""
    return {k: v for k, v in result.items() if k not in ("knn_device", "provider", "map_at_r")}


def _same(a: dict, b: dict) -> None:
    assert _strip(a) == _strip(b)  # bit-identical: recall, precision@1, NMI, CMC curves, top-k mean/std
    if "map_at_r" in a:
        assert a["map_at_r"] == pytest.approx(b["map_at_r"], rel=1e-12, abs=1e-15)


def test_cpu_and_auto_devices(setup):
    cpu = evaluate_onnx(setup["model"], "cub200", setup["cub"], progress=False, device="cpu")
    from caffe_compat.data import read_cub200

    assert cpu["knn_device"] == "cpu" and cpu["num_images"] == len(read_cub200(setup["cub"], "test"))
    auto = evaluate_onnx(setup["model"], "cub200", setup["cub"], progress=False)
    assert auto["knn_device"] == ("cuda" if torch.cuda.is_available() else "cpu")
    _same(auto, cpu)
    assert 0.0 <= cpu["recall_at_k"]["1"] <= cpu["recall_at_k"]["32"] <= 1.0


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("protocol", ["cub200", "vehicleid"])
def test_every_device_gives_the_cpu_results(setup, protocol, device):
    root = setup["cub" if protocol == "cub200" else "vehicleid"]
    cpu = evaluate_onnx(setup["model"], protocol, root, progress=False, device="cpu")
    other = evaluate_onnx(setup["model"], protocol, root, progress=False, device=device)
    assert other["knn_device"] == device and cpu["knn_device"] == "cpu"
    _same(other, cpu)


@pytest.mark.parametrize("device", DEVICES)
def test_protocols_do_not_depend_on_device_or_tiling(device):
    """The protocols on ``device`` with the default memory budget equal the CPU with a tiny budget
    (many small similarity tiles): neither the device nor the tiling changes a figure."""
    import numpy as np

    from caffe_compat.evaluate import evaluate_cub200, evaluate_sop, evaluate_vehicleid

    tiny = 64 * 1024
    rs = np.random.RandomState(0)
    for n, classes, dim in ((300, 30, 16), (2000, 100, 64)):
        features, labels = rs.randn(n, dim).astype(np.float32), rs.randint(0, classes, n)
        _same(evaluate_cub200(features, labels, device=device),
              evaluate_cub200(features, labels, device="cpu", budget_bytes=tiny))
        _same(evaluate_sop(features, labels, device=device), evaluate_sop(features, labels, device="cpu", budget_bytes=tiny))
        splits = {"small": (features, np.repeat(np.arange(n // 4), 4))}
        _same(evaluate_vehicleid(splits, device=device), evaluate_vehicleid(splits, device="cpu", budget_bytes=tiny))


def test_unusable_device_is_refused(setup, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(CaffeCompatError, match="device cuda: CUDA is not available"):
        evaluate_onnx(setup["model"], "cub200", setup["cub"], progress=False, device="cuda")
    with pytest.raises(CaffeCompatError, match="device must be auto, cpu, cuda or cuda:N"):
        evaluate_onnx(setup["model"], "cub200", setup["cub"], progress=False, device="gpu")


def test_metrics_package_imports_no_net_or_layers():
    code = ("import sys, caffe_compat.evaluate, caffe_compat.evaluate.inputs, caffe_compat.evaluate.protocols; "
            "print(sorted(m for m in sys.modules if m in ('caffe_compat.net', 'caffe_compat.layers')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"

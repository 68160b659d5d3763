"""``--device`` of ``reproduce`` and ``evaluate`` (and the library's ``device=``): checked up front, a clear
one-line error and exit status 2 for a device torch cannot use, nothing written."""

from __future__ import annotations

import pytest
import torch

from caffe_compat.cli import main
from caffe_compat.errors import CaffeCompatError
from caffe_compat.evaluate.inputs import parse_device


def _fake_cuda(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_parse_device_accepts_cpu_cuda_and_cuda_n(monkeypatch):
    assert parse_device("cpu") == torch.device("cpu") and parse_device(" CPU ") == torch.device("cpu")
    _fake_cuda(monkeypatch, 2)
    assert parse_device("auto") == torch.device("cuda") and parse_device(None) == torch.device("cuda")
    assert parse_device("cuda") == torch.device("cuda")
    assert parse_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(CaffeCompatError, match=r"--device cuda:2: no such CUDA device; this machine has 2 "
                                               r"\(cuda:0..cuda:1\)"):
        parse_device("cuda:2")
    _fake_cuda(monkeypatch, 0)
    assert parse_device("auto") == torch.device("cpu")
    with pytest.raises(CaffeCompatError, match=r"--device cuda: CUDA is not available .*use --device cpu"):
        parse_device("cuda")
    with pytest.raises(CaffeCompatError, match="CUDA is not available"):
        parse_device("cuda:0")


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "cuda:", "cpu:0", "", "cuda:-1", "mps"])
def test_parse_device_refuses_other_names(bad):
    with pytest.raises(CaffeCompatError, match=r"--device must be auto, cpu, cuda or cuda:N, got"):
        parse_device(bad)


@pytest.mark.parametrize("device, available, message", [
    ("gpu", 0, "--device must be auto, cpu, cuda or cuda:N, got 'gpu'"),
    ("cuda", 0, "--device cuda: CUDA is not available"),
    ("cuda:3", 2, "--device cuda:3: no such CUDA device; this machine has 2"),
])
def test_reproduce_bad_device_exit_2_nothing_written(tmp_path, capsys, monkeypatch, device, available, message):
    _fake_cuda(monkeypatch, available)
    out = tmp_path / "run"
    assert main(["reproduce", "digits", "--device", device, "--out", str(out), "--max-iter", "1"]) == 2
    err = capsys.readouterr().err
    assert f"caffe-compat reproduce: error: {message}" in err and "Traceback" not in err
    assert not out.exists()


def test_reproduce_library_checks_the_device_too(tmp_path, monkeypatch):
    from caffe_compat.reproduce.pipeline import reproduce

    _fake_cuda(monkeypatch, 0)
    with pytest.raises(CaffeCompatError, match="device cuda: CUDA is not available"):
        reproduce("digits", device="cuda", out_dir=tmp_path / "run", max_iter=1, progress=False)
    assert not (tmp_path / "run").exists()


def test_evaluate_bad_device_exit_2(tmp_path, capsys, monkeypatch):
    _fake_cuda(monkeypatch, 0)
    for device, message in (("gpu", "--device must be auto, cpu, cuda or cuda:N"),
                            ("cuda", "--device cuda: CUDA is not available")):
        status = main(["evaluate", str(tmp_path / "m.onnx"), "--dataset", "cub200", "--data-root", str(tmp_path),
                       "--device", device, "--json", str(tmp_path / "r.json")])
        err = capsys.readouterr().err
        assert status == 2 and message in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("device, message", [
    ("gpu", "--device must be cpu, cuda or cuda:N, got 'gpu'"),
    ("auto", "--device must be cpu, cuda or cuda:N, got 'auto'"),
    ("cuda", "--device cuda: CUDA is not available"),
])
def test_train_bad_device_exit_2_nothing_written(tmp_path, capsys, monkeypatch, device, message):
    from tests.conftest import fixture_path

    _fake_cuda(monkeypatch, 0)
    solver = fixture_path("solvers/sgd_step_momentum/solver.prototxt")
    assert main(["train", str(solver), "--device", device, "--iters", "1"]) == 2
    err = capsys.readouterr().err
    assert f"caffe-compat train: error: {message}" in err and "Traceback" not in err

"""``compile=True`` (``--compile``) in training on a CPU device warns once (CompileSlowerWarning, naming the
measured speed and suggesting to leave it out); on CUDA or without compile it does not.  The compilation
itself is stood in by the net (what it returns does not matter to the warning), so the tests stay fast."""

from __future__ import annotations

import sys
import warnings

import pytest

from caffe_compat import hardware
from caffe_compat.cli import main
from caffe_compat.errors import CaffeCompatWarning
from caffe_compat.hardware import COMPILED_CPU_TRAINING_SPEED, CompileSlowerWarning
from caffe_compat.solver import train as train_module
from caffe_compat.solver.train import train
from tests.solver.caffe_cases import make_solver
from tests.solver.test_train import CASE, loader
from tests.solver.test_train_cli_options import _dummy_solver


REAL_CPU_COMPILER = hardware.cpu_compiler


@pytest.fixture(autouse=True)
def _no_compilation(monkeypatch):
    """No compilation, and a C++ compiler as far as the refusal can tell (these tests hold on machines without)."""
    monkeypatch.setattr(train_module, "compile_net", lambda net, **options: net)
    monkeypatch.setattr(hardware, "cpu_compiler", lambda: "/usr/bin/c++")


def _train_warnings(compile):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(make_solver(CASE), loader(), iters=1, progress=False, compile=compile, device="cpu")
    return [w for w in caught if issubclass(w.category, CompileSlowerWarning)]


def test_compile_on_cpu_warns_once_with_the_measured_speed():
    caught = _train_warnings(True)
    assert len(caught) == 1
    assert issubclass(CompileSlowerWarning, CaffeCompatWarning)
    message = str(caught[0].message)
    low, high = COMPILED_CPU_TRAINING_SPEED
    assert f"{low:.2f}-{high:.2f}x" in message and "eager" in message and "--compile" in message
    assert caught[0].filename == __file__  # points at the caller of train()


def test_no_warning_without_compile_or_off_the_cpu():
    assert _train_warnings(False) == []
    assert hardware.warn_if_compile_slow("cuda", True) is False
    assert hardware.warn_if_compile_slow("cpu", False) is False
    with pytest.warns(CompileSlowerWarning):
        assert hardware.warn_if_compile_slow("cpu", True) is True


def test_cli_prints_the_warning_as_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["train", _dummy_solver(tmp_path, max_iter=1), "--compile", "--device", "cpu"]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(lines) == 1, lines
    assert lines[0].startswith("caffe-compat train: warning: torch.compile makes training on the CPU slower")


def test_cpu_compiler_is_the_one_inductor_would_use(tmp_path, monkeypatch):
    """$CXX names it (inductor's ``cpp.cxx`` default), found on PATH; nothing there: None."""
    monkeypatch.setattr(hardware, "cpu_compiler", REAL_CPU_COMPILER)
    fake = tmp_path / "my-c++"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("CXX", "my-c++")
    monkeypatch.setitem(sys.modules, "torch._inductor.config", None)  # as before inductor is imported
    assert hardware.cpu_compiler() == str(fake)
    monkeypatch.setenv("CXX", "g++")
    assert hardware.cpu_compiler() is None


def test_without_a_cxx_compiler_compile_on_the_cpu_is_refused_before_anything_is_written(tmp_path, monkeypatch,
                                                                                        capsys):
    """A fresh machine without a C++ compiler (a slim container): ``train --compile`` exits 2 naming what to do,
    without a traceback, a log or a snapshot (before, the first compiled step failed deep in inductor)."""
    monkeypatch.setattr(hardware, "cpu_compiler", REAL_CPU_COMPILER)
    monkeypatch.chdir(tmp_path)
    solver = _dummy_solver(tmp_path, max_iter=1, snapshot=1)
    monkeypatch.setenv("PATH", str(tmp_path / "nothing here"))
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setitem(sys.modules, "torch._inductor.config", None)
    before = sorted(tmp_path.iterdir())
    assert main(["train", solver, "--compile", "--device", "cpu", "--log", str(tmp_path / "log.csv")]) == 2
    err = capsys.readouterr().err
    assert "--compile on the CPU needs a C++ compiler" in err and "apt-get install g++" in err
    assert "Traceback" not in err
    assert sorted(tmp_path.iterdir()) == before
    hardware.require_cpu_compiler("cuda", True)  # CUDA kernels need no host compiler; no compile: no check
    hardware.require_cpu_compiler("cpu", False)

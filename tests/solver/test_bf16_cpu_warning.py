"""``amp="bf16"`` on a CPU without bf16 matrix units warns once (Bf16SlowerWarning, naming the measured
ratio and suggesting float32); with AMX-BF16 / AVX512-BF16 flags, with fp16 or without amp it does not.
The CPU's flags and torch's capability string are monkeypatched, so the tests pass on any machine."""

from __future__ import annotations

import warnings

import pytest

from caffe_compat import hardware
from caffe_compat.cli import main
from caffe_compat.errors import CaffeCompatWarning
from caffe_compat.hardware import Bf16SlowerWarning, cpu_class, cpu_has_bf16_matmul
from caffe_compat.solver.train import train
from tests.solver.test_train import CASE, loader
from tests.solver.test_train_cli_options import _dummy_solver
from tests.solver.caffe_cases import make_solver

AVX2_ONLY = frozenset({"fpu", "sse2", "avx", "avx2", "fma"})
SAPPHIRE_RAPIDS = AVX2_ONLY | {"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}


@pytest.mark.parametrize("flags, capability, expected", [
    (SAPPHIRE_RAPIDS, "AVX512", True),
    (AVX2_ONLY | {"avx512_bf16"}, "AVX512", True),
    (frozenset({"fp", "asimd", "bf16"}), "DEFAULT", True),  # AArch64 Features line
    (AVX2_ONLY, "AVX2", False),
    (AVX2_ONLY | {"avx512f", "avx512bw"}, "AVX512", False),  # Skylake/Cascade Lake: AVX-512 without bf16
    (None, "AVX2", False),  # no /proc/cpuinfo: AVX2 at most means no bf16 units
    (None, "AVX512", None),  # AVX-512 may or may not come with bf16: unknown, no warning
])
def test_cpu_has_bf16_matmul_from_flags_then_capability(flags, capability, expected):
    assert cpu_has_bf16_matmul(flags, capability) is expected


def test_cpu_flags_and_name_read_from_cpuinfo(tmp_path, monkeypatch):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz\n"
                    "flags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16\n\nprocessor\t: 1\n")
    monkeypatch.setattr(hardware, "CPUINFO", info)
    assert hardware.cpu_flags() >= {"avx512_bf16", "amx_bf16"}
    assert hardware.cpu_model_name() == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"
    assert cpu_class() == "Intel Xeon" and cpu_class("AMD EPYC 7B13") == "AMD EPYC" and cpu_class("M2") is None
    monkeypatch.setattr(hardware, "CPUINFO", tmp_path / "missing")
    assert hardware.cpu_flags() is None


def _cpu(monkeypatch, flags, capability="AVX2"):
    monkeypatch.setattr(hardware, "cpu_flags", lambda: flags)
    monkeypatch.setattr(hardware, "cpu_capability", lambda: capability)
    monkeypatch.setattr(hardware, "cpu_model_name", lambda: "Test CPU 9000")


def _train_warnings(amp):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(make_solver(CASE), loader(), iters=1, progress=False, amp=amp, device="cpu")
    return [w for w in caught if issubclass(w.category, Bf16SlowerWarning)]


def test_bf16_on_cpu_without_units_warns_once_with_the_ratio(monkeypatch):
    _cpu(monkeypatch, AVX2_ONLY)
    caught = _train_warnings("bf16")
    assert len(caught) == 1
    assert issubclass(Bf16SlowerWarning, CaffeCompatWarning) and issubclass(Bf16SlowerWarning, UserWarning)
    message = str(caught[0].message)
    assert "0.78x" in message and "float32" in message and "Test CPU 9000" in message
    assert caught[0].filename == __file__  # points at the caller of train()


@pytest.mark.parametrize("flags, amp", [(SAPPHIRE_RAPIDS, "bf16"), (AVX2_ONLY, "fp16"), (AVX2_ONLY, None)])
def test_no_warning_with_bf16_units_or_without_bf16(monkeypatch, flags, amp):
    _cpu(monkeypatch, flags)
    assert _train_warnings(amp) == []


def test_no_warning_on_cuda(monkeypatch):
    _cpu(monkeypatch, AVX2_ONLY)
    assert hardware.warn_if_bf16_slow("cuda", "bf16") is False
    with pytest.warns(Bf16SlowerWarning):
        assert hardware.warn_if_bf16_slow("cpu", "bf16") is True


def test_cli_prints_the_warning_as_one_line(tmp_path, monkeypatch, capsys):
    _cpu(monkeypatch, AVX2_ONLY)
    monkeypatch.chdir(tmp_path)
    assert main(["train", _dummy_solver(tmp_path, max_iter=1), "--amp", "bf16", "--device", "cpu"]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(lines) == 1, lines
    assert lines[0].startswith("caffe-compat train: warning: bf16 autocast on this CPU (Test CPU 9000")
    assert "0.78x" in lines[0] and "float32" in lines[0]

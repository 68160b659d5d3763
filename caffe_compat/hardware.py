"""What CPU this process runs on: its model name, its class (AMD EPYC, Intel Xeon) and whether it has
bfloat16 matrix units, without any dependency beyond the standard library and torch.

Sources: ``/proc/cpuinfo`` on Linux (``model name`` and the ``flags`` / ``Features`` lines: ``amx_bf16``,
``avx512_bf16`` on x86, ``bf16`` on AArch64), ``platform.processor()`` elsewhere, and
``torch.backends.cpu.get_cpu_capability()`` (``"DEFAULT"``, ``"AVX2"``, ``"AVX512"``, ...), which tells a CPU
without AVX-512 (hence without bf16 units) even where no flags can be read.

:func:`warn_if_bf16_slow` is what ``train(amp="bf16")`` calls on a CPU device: bf16 autocast on a CPU without
bf16 matrix units converts every operand and computes in float32 anyway, and measured
:data:`BF16_SPEED_OF_FP32` of float32's speed on the authors' net (2-vCPU AMD EPYC, AVX2).
:func:`warn_if_compile_slow` is what ``train(compile=True)`` calls on a CPU device: the compiled training step
ran at :data:`COMPILED_CPU_TRAINING_SPEED` of eager's speed (see there).  Before it, :func:`require_cpu_compiler`:
``torch.compile``'s inductor backend builds its CPU kernels with a C++ compiler, which a fresh machine (a slim
container) may not have; without one the first compiled step failed deep in inductor with a traceback.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
import warnings
from pathlib import Path

from caffe_compat.errors import CaffeCompatError, CaffeCompatWarning

__all__ = ["BF16_SPEED_OF_FP32", "COMPILED_CPU_TRAINING_SPEED", "Bf16SlowerWarning", "CompileSlowerWarning",
           "cpu_compiler", "cpu_model_name", "cpu_flags", "cpu_capability", "cpu_class", "cpu_has_bf16_matmul",
           "require_cpu_compiler", "warn_if_bf16_slow", "warn_if_compile_slow"]

#: Iterations/s of ``bf16`` autocast ÷ float32 measured on a CPU without bf16 units (AMD EPYC, AVX2).
BF16_SPEED_OF_FP32 = 0.78

#: Iterations/s of a ``torch.compile``'d training step ÷ eager on the CPU (inductor, torch 2.13, one run each after
#: compilation, 2-vCPU Intel Xeon): the authors' GoogLeNet + FAPPY at batch 8, one thread (0.962 s eager, 2.72 s
#: compiled, after 140 s of compilation), and the digits FAPPY net at batch 64, two threads (17.2 ms, 38.8 ms,
#: after 6 s).  Under compile the CPU kernels that keep Caffe's MAX pooling, LRN and FAPPY exact (NumPy and
#: OpenCV, opaque to a tracer) give way to their traced PyTorch forms, e.g. a stride-1 3 x 3 pooling of
#: 8 x 192 x 28 x 28 trained in 200 ms instead of 14 ms.
COMPILED_CPU_TRAINING_SPEED = (0.35, 0.44)

#: CPU flags naming bfloat16 matrix / dot-product instructions (x86 AMX and AVX512-BF16, AArch64 BF16).
BF16_FLAGS = frozenset({"amx_bf16", "avx512_bf16", "bf16"})

CPUINFO = Path("/proc/cpuinfo")


class Bf16SlowerWarning(CaffeCompatWarning):
    """bf16 autocast was asked for on a CPU without bf16 matrix units: likely slower than float32."""


class CompileSlowerWarning(CaffeCompatWarning):
    """``torch.compile`` was asked for in training on a CPU: slower than eager there (it is meant for CUDA)."""


def _cpuinfo_fields(name: str) -> list[str]:
    try:
        text = CPUINFO.read_text(errors="replace")
    except OSError:
        return []
    values = []
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() == name:
            values.append(value.strip())
    return values


def cpu_model_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``'s ``model name``, else ``platform.processor()``), or
    ``"unknown CPU"``."""
    names = _cpuinfo_fields("model name")
    name = names[0] if names else (platform.processor() or platform.machine())
    return " ".join(name.split()) or "unknown CPU"


def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags from ``/proc/cpuinfo`` (x86 ``flags``, AArch64 ``Features``), or None where
    they cannot be read (not Linux)."""
    lines = _cpuinfo_fields("flags") or _cpuinfo_fields("features")
    if not lines:
        return None
    return frozenset(lines[0].split())


def cpu_capability() -> str:
    """``torch.backends.cpu.get_cpu_capability()`` (e.g. ``"AVX2"``, ``"AVX512"``), or ``""`` if unavailable."""
    try:
        import torch

        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # noqa: BLE001 - an older or stripped torch: unknown
        return ""


def cpu_class(name: str | None = None) -> str | None:
    """``"AMD EPYC"`` or ``"Intel Xeon"`` when the model name says so, else None."""
    name = (cpu_model_name() if name is None else name).lower()
    if "epyc" in name:
        return "AMD EPYC"
    if "xeon" in name:
        return "Intel Xeon"
    return None


_UNSET = object()


def cpu_has_bf16_matmul(flags=_UNSET, capability: str | None = None) -> bool | None:
    """Whether the CPU has bfloat16 matrix units (AMX-BF16, AVX512-BF16, AArch64 BF16): True / False, or
    None when it cannot tell.  ``flags`` (a set, or None for "unreadable") and ``capability`` default to
    :func:`cpu_flags` and :func:`cpu_capability`."""
    flags = cpu_flags() if flags is _UNSET else flags
    if flags is not None:
        return bool(flags & BF16_FLAGS)
    capability = cpu_capability() if capability is None else capability
    if capability.upper() in ("AVX2", "AVX", "NO AVX", "AVX512") or \
            (capability.upper() == "DEFAULT" and platform.machine().lower() in ("x86_64", "amd64", "i686")):
        # x86 without readable flags: without AVX-512 there is no AVX512-BF16 nor AMX; with AVX-512 it may
        # or may not be there (Skylake/Cascade Lake have none, Sapphire Rapids has both) -> unknown
        return None if capability.upper() == "AVX512" else False
    return None


def warn_if_bf16_slow(device_type: str, amp: str | None, stacklevel: int = 3) -> bool:
    """Warn (:class:`Bf16SlowerWarning`, once per call) when ``amp == "bf16"`` runs on a CPU known to have no
    bf16 matrix units; return whether it warned.  CUDA and other devices never warn."""
    if amp != "bf16" or device_type != "cpu" or cpu_has_bf16_matmul() is not False:
        return False
    warnings.warn(
        f"bf16 autocast on this CPU ({cpu_model_name()}: no AMX-BF16 / AVX512-BF16 bf16 matrix units) will "
        f"likely be slower than float32 (measured {BF16_SPEED_OF_FP32:.2f}x of float32's speed on such a CPU); "
        f"train in float32 instead (leave out --amp / amp=None)",
        Bf16SlowerWarning, stacklevel=stacklevel)
    return True


def warn_if_compile_slow(device_type: str, compile: bool, stacklevel: int = 3) -> bool:
    """Warn (:class:`CompileSlowerWarning`, once per call) when a compiled training step is asked for on a CPU,
    where it ran slower than eager (:data:`COMPILED_CPU_TRAINING_SPEED`); return whether it warned.  CUDA
    and other devices never warn: there compiling is what lets the step run as one graph."""
    if not compile or device_type != "cpu":
        return False
    low, high = COMPILED_CPU_TRAINING_SPEED
    warnings.warn(
        f"torch.compile makes training on the CPU slower, not faster: compiled training steps ran at "
        f"{low:.2f}-{high:.2f}x of eager's speed (the authors' GoogLeNet and the digits net, after 6-140 s of "
        f"compilation), because the CPU kernels that keep Caffe's MAX pooling, LRN and FAPPY exact give way to "
        f"traced forms under compile; compile for CUDA, train without it here (leave out --compile)",
        CompileSlowerWarning, stacklevel=stacklevel)
    return True


def cpu_compiler() -> str | None:
    """The path of the C++ compiler ``torch.compile``'s inductor backend builds CPU kernels with, or None when
    none is on PATH: the names of inductor's ``cpp.cxx`` setting where inductor is loaded, else its default
    ($CXX, else g++; clang++ on macOS), without importing inductor (a second)."""
    config = sys.modules.get("torch._inductor.config")
    names = [name for name in getattr(getattr(config, "cpp", None), "cxx", ()) if name]
    if not names:
        names = [os.environ.get("CXX", "clang++" if sys.platform == "darwin" else "g++")]
    return next((found for found in map(shutil.which, names) if found), None)


def require_cpu_compiler(device_type: str, compile: bool) -> None:
    """Refuse a compiled step on a CPU device where inductor has no C++ compiler (CaffeCompatError naming
    what to do), before anything is trained or written."""
    if compile and device_type == "cpu" and cpu_compiler() is None:
        raise CaffeCompatError(
            "--compile on the CPU needs a C++ compiler: torch.compile's inductor backend builds its CPU kernels "
            "with one (g++ or clang++, or the one $CXX names), and none is on PATH; install one "
            "(apt-get install g++) or leave out --compile (on the CPU it trains slower anyway)")

"""The memory budget's reading of the available memory (``caffe_compat.io.safe_open``): reused for
``AVAILABLE_MEMORY_TTL`` seconds (the readers check every image and record against it), read again after."""

from __future__ import annotations

import pytest

from caffe_compat.io import safe_open


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(safe_open.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(safe_open, "_available", [float("-inf"), 0])
    return now


def test_a_reading_is_reused_within_the_ttl_and_renewed_after(clock, monkeypatch):
    readings = iter([8 << 30, 2 << 30])
    monkeypatch.setattr(safe_open, "_read_available_memory", lambda: next(readings))
    monkeypatch.delenv("CAFFE_COMPAT_MEMORY_BUDGET", raising=False)
    assert safe_open.available_memory() == 8 << 30
    clock[0] += safe_open.AVAILABLE_MEMORY_TTL * 0.99
    assert safe_open.memory_budget() == 4 << 30  # the same reading, halved
    clock[0] += safe_open.AVAILABLE_MEMORY_TTL * 0.02
    assert safe_open.available_memory() == 2 << 30


def test_the_environment_still_wins_at_every_call(clock, monkeypatch):
    monkeypatch.setattr(safe_open, "_read_available_memory", lambda: 8 << 30)
    monkeypatch.setenv("CAFFE_COMPAT_MEMORY_BUDGET", "512M")
    assert safe_open.memory_budget() == 512 << 20
    monkeypatch.setenv("CAFFE_COMPAT_MEMORY_BUDGET", "1G")
    assert safe_open.memory_budget() == 1 << 30


def test_the_reading_is_meminfo_memavailable():
    try:
        with open("/proc/meminfo") as info:
            line = next(row for row in info if row.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        pytest.skip("no /proc/meminfo MemAvailable on this system (the sysconf fallback is used)")
    expected = int(line.split()[1]) * 1024
    got = safe_open._read_available_memory()
    assert abs(got - expected) <= max(expected // 20, 64 << 20)  # read moments apart: the system moves on

"""The fuzz harness in a short, seeded form: every target's special cases, its seeds and a few mutated
cases end as ``ok`` or ``typed`` (no untyped exception, crash, timeout or runaway allocation); and the
runner does tell a crash, a hang, an allocation and a foreign exception from a typed error (the smoke
test could not fail otherwise)."""

from __future__ import annotations

import os
import random
import signal

import pytest

from caffe_compat.errors import FormatError
from tests.fuzz import mutate
from tests.fuzz.__main__ import main
from tests.fuzz.runner import run_case
from tests.fuzz.targets import TARGETS, preload

CASES = 3  # per target; a longer run is python -m tests.fuzz --minutes N


@pytest.fixture(scope="module", autouse=True)
def _warm():
    preload()


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_target_has_no_bugs_on_a_few_seeded_cases(name):
    """Each target in a fresh interpreter (``python -m tests.fuzz``), as a user runs it: the runner forks a
    child per case, and a fork of the long-lived test process (its threads, its address space above the
    child's RLIMIT_AS) would test the test process, not the readers."""
    import subprocess
    import sys

    from tests.conftest import REPO

    done = subprocess.run([sys.executable, "-m", "tests.fuzz", "--cases", str(CASES), "--seed", "19", "--target",
                           name, "--timeout", "60"], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    row = next(line.split() for line in done.stdout.splitlines() if line.startswith(f"{name} ") and "done" not in line)
    cases, ok, typed, bugs = (int(v) for v in row[1:5])
    assert bugs == 0
    assert ok >= len(TARGETS[name].seeds)  # the seeds themselves are read
    assert cases >= CASES + len(TARGETS[name].seeds)


def _typed():
    raise FormatError("bad")


def _untyped():
    return {}["missing"]


def _allocate():
    return bytearray(8 << 30)


def _hang():
    signal.pause()


def _die():
    os.kill(os.getpid(), signal.SIGBUS)


@pytest.mark.parametrize("func, outcome, detail", [
    (lambda: None, "ok", ""),
    (_typed, "typed", "FormatError: bad"),
    (_untyped, "untyped", "KeyError"),
    (_allocate, "memory", "MemoryError"),
    (_hang, "timeout", "still running after 1 s"),
    (_die, "crash", "killed by SIGBUS"),
])
def test_runner_classifies_every_outcome(func, outcome, detail):
    got, text = run_case(func, (), timeout=1, memory_bytes=1 << 30)
    assert got == outcome and detail in text


def test_mutations_are_seeded_and_change_the_input():
    seed = TARGETS["lmdb"].seeds[0]
    first = [mutate.mutate_lmdb(random.Random(5), seed) for _ in range(3)]
    assert first == [mutate.mutate_lmdb(random.Random(5), seed) for _ in range(3)]
    assert all(m != seed for m in first)
    fields = mutate.wire_fields(TARGETS["binaryproto"].seeds[0])
    assert fields and all(kind in (0, 1, 2, 5) for *_, kind in fields)
    huge = mutate.varint(2 ** 64 - 1)
    assert len(huge) == 10 and mutate._read_varint(huge, 0) == (2 ** 64 - 1, 10)


def test_command_line_prints_a_table_and_exits_0(capsys, tmp_path):
    assert main(["--cases", "1", "--target", "binaryproto", "--target", "param_str", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "target" in out and "binaryproto" in out and "param_str" in out
    assert list(tmp_path.iterdir()) == []  # no failing inputs

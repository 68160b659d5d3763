"""A process killed (SIGKILL) while it writes a snapshot leaves the previous snapshot pair valid, and
nothing under the new names except files that were written completely: each snapshot file is written
under a temporary name, flushed to disk and renamed.  The killed write's temporary is removed by the
next run's snapshot."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from caffe_compat.io import read_net, read_solverstate
from caffe_compat.io.atomic import TMP_MARK
from tests.solver.caffe_cases import feed, make_solver

REPO = Path(__file__).resolve().parents[2]
CASE = "sgd_step_momentum"

# The child trains 2 iterations, snapshots, trains one more and snapshots again; during that second
# snapshot the fsync of file number `stall` (1: the caffemodel, 2: the solverstate) announces itself and
# sleeps, and the parent kills the process there.
CHILD = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {repo!r})
    import caffe_compat.io.atomic as atomic
    from tests.solver.caffe_cases import feed, make_solver
    solver = make_solver({case!r}, snapshot_prefix={prefix!r})
    for t in range(2):
        feed(solver, {case!r}, t)
        solver.step(1)
    solver.snapshot()
    feed(solver, {case!r}, 2)
    solver.step(1)
    real_fsync, calls = os.fsync, []
    def stalling_fsync(fd):
        calls.append(fd)
        if len(calls) == {stall}:
            print("STALLED", flush=True)
            time.sleep(120)
        real_fsync(fd)
    atomic.os.fsync = stalling_fsync
    solver.snapshot()
    print("NOT KILLED", flush=True)
""")


@pytest.mark.parametrize("stall, survivors", [
    (1, {"snap_iter_2.caffemodel", "snap_iter_2.solverstate"}),
    (2, {"snap_iter_2.caffemodel", "snap_iter_2.solverstate", "snap_iter_3.caffemodel"}),
])
def test_sigkill_during_snapshot_keeps_the_previous_pair(tmp_path, stall, survivors):
    prefix = str(tmp_path / "snap")
    script = CHILD.format(repo=str(REPO), case=CASE, prefix=prefix, stall=stall)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=REPO)
    try:
        line = child.stdout.readline()
        assert line.strip() == "STALLED", (line, child.stderr.read() if child.poll() is not None else "")
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    finished = {name for name in os.listdir(tmp_path) if not name.startswith(".")}
    assert finished == survivors
    # the interrupted file exists only as a hidden temporary, never under its final name
    leftovers = [name for name in os.listdir(tmp_path) if name.startswith(".snap_iter_3.") and name.endswith(".tmp")]
    assert len(leftovers) == 1 and f".{TMP_MARK}.{child.pid}." in leftovers[0]  # recognisably ours, with its pid
    # the previous pair is complete: resuming from it restores iteration 2 and its weights
    state_path = tmp_path / "snap_iter_2.solverstate"
    resumed = make_solver(CASE, snapshot_prefix=prefix)
    resumed.restore(state_path)
    assert resumed.iter == read_solverstate(state_path).iter == 2
    stored = {layer.name: layer for layer in read_net(str(tmp_path / "snap_iter_2.caffemodel")).layer}
    for name, blobs in resumed.net.params.items():
        for blob, proto in zip(blobs, stored[name].blobs):
            np.testing.assert_array_equal(blob.detach().numpy().ravel(), np.asarray(proto.data))
    if stall == 2:  # the caffemodel of iteration 3 had been renamed into place whole before the kill
        assert len(read_net(str(tmp_path / "snap_iter_3.caffemodel")).layer) == len(stored)
    # the resumed run's snapshots remove the killed run's temporary: nothing but finished files remains
    feed(resumed, CASE, 2)
    resumed.step(1)
    resumed.snapshot()
    names = set(os.listdir(tmp_path))
    assert names == survivors | {"snap_iter_3.caffemodel", "snap_iter_3.solverstate"}, names
    assert read_solverstate(tmp_path / "snap_iter_3.solverstate").iter == 3

"""Atomic writes: the permissions a plain open() gives, typed errors naming the path, no leftovers."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys

import pytest

from caffe_compat.errors import CaffeCompatError, WriteError
from caffe_compat.io.atomic import (TMP_MARK, atomic_path, current_umask, remove_stale_temporaries, temporary_pattern,
                                    write_bytes_atomic, write_text_atomic)


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_current_umask_reads_the_process_umask(umask_027):
    assert current_umask() == 0o027
    assert os.umask(0o027) == 0o027  # unchanged by reading it


def test_new_file_gets_0666_minus_umask_like_open(tmp_path, umask_027):
    write_text_atomic(tmp_path / "a.prototxt", "name: 'x'\n")
    with open(tmp_path / "plain.txt", "w") as fh:  # what a plain open() gives, for comparison
        fh.write("x")
    assert _mode(tmp_path / "a.prototxt") == 0o640 == _mode(tmp_path / "plain.txt")
    os.umask(0o002)
    write_bytes_atomic(tmp_path / "b.caffemodel", b"\x08\x01")
    assert _mode(tmp_path / "b.caffemodel") == 0o664


def test_replacing_a_file_keeps_its_mode_like_open(tmp_path, umask_027):
    target = tmp_path / "w.caffemodel"
    target.write_bytes(b"old")
    os.chmod(target, 0o604)
    write_bytes_atomic(target, b"new")
    assert target.read_bytes() == b"new"
    assert _mode(target) == 0o604


def test_atomic_path_applies_the_mode_too(tmp_path, umask_027):
    with atomic_path(tmp_path / "plot.png") as tmp:
        tmp.write_bytes(b"png")
    assert _mode(tmp_path / "plot.png") == 0o640


@pytest.mark.parametrize("make_target, reason", [
    (lambda d: "/proc/nonexist/y", "cannot create folder /proc/nonexist: No such file or directory"),
    (lambda d: (d / "file").write_text("x") and d / "file" / "y", "is not a folder"),
    (lambda d: (d / "dir" / "sub").mkdir(parents=True) or d / "dir", "Is a directory"),
])
def test_unwritable_targets_raise_write_error_naming_the_path(tmp_path, make_target, reason):
    target = make_target(tmp_path)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(WriteError) as info:
        write_text_atomic(target, "text")
    assert str(info.value).startswith(f"{target}: cannot write (")
    assert reason in str(info.value)
    assert isinstance(info.value, CaffeCompatError) and isinstance(info.value, OSError)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # no temporary file left behind


def test_failed_write_leaves_the_existing_target_untouched(tmp_path):
    target = tmp_path / "keep.prototxt"
    target.write_text("original")
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("writer failed")  # the caller's own error propagates unchanged
    assert target.read_text() == "original"
    assert [p.name for p in tmp_path.iterdir()] == ["keep.prototxt"]


# ----------------------------------------------------------------------------- stale temporaries

def _dead_pid() -> int:
    """The id of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_temporaries_are_named_with_our_mark_and_pid(tmp_path):
    with atomic_path(tmp_path / "w.caffemodel") as tmp:
        assert TMP_MARK in tmp.name
        assert tmp.name.startswith(f".w.caffemodel.{TMP_MARK}.{os.getpid()}.") and tmp.name.endswith(".tmp")
        assert temporary_pattern(re.escape("w.caffemodel")).fullmatch(tmp.name)
        tmp.write_bytes(b"x")
    assert [p.name for p in tmp_path.iterdir()] == ["w.caffemodel"]


def test_a_write_removes_only_its_targets_stale_temporaries(tmp_path):
    dead = _dead_pid()
    ours_dead = tmp_path / f".w.caffemodel.{TMP_MARK}.{dead}.abc_123.tmp"
    live_writer = tmp_path / f".w.caffemodel.{TMP_MARK}.{os.getppid()}.livewr.tmp"  # a live process's
    mine = tmp_path / f".w.caffemodel.{TMP_MARK}.{os.getpid()}.other1.tmp"  # another thread of this process
    reused = tmp_path / f".w.caffemodel.{TMP_MARK}.{os.getppid()}.reused.tmp"  # written before that pid started
    keep = [
        tmp_path / f".w.caffemodel.{dead}.abc.tmp",  # the old naming: not recognisably ours
        tmp_path / f".w.caffemodel.{TMP_MARK}.{dead}.abc.tmp.bak",  # not exactly our pattern
        tmp_path / f".w.caffemodel.{TMP_MARK}.notapid.abc.tmp",
        tmp_path / f".x.caffemodel.{TMP_MARK}.{dead}.abc.tmp",  # another target's
        tmp_path / f".w.caffemodelx.{TMP_MARK}.{dead}.abc.tmp",
        tmp_path / f"w.caffemodel.{TMP_MARK}.{dead}.abc.tmp",  # not hidden
        tmp_path / "unrelated.txt",
        live_writer, mine,
    ]
    for path in [ours_dead, reused, *keep]:
        path.write_bytes(b"leftover")
    os.utime(reused, (1_000_000, 1_000_000))  # 1970: older than any live process
    (tmp_path / f".w.caffemodel.{TMP_MARK}.{dead}.adir1.tmp").mkdir()  # a folder: never removed
    keep.append(tmp_path / f".w.caffemodel.{TMP_MARK}.{dead}.adir1.tmp")
    write_bytes_atomic(tmp_path / "w.caffemodel", b"new")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([p.name for p in keep] + ["w.caffemodel"])


def test_remove_stale_temporaries_takes_a_name_pattern_and_reports(tmp_path):
    dead = _dead_pid()
    stale = [tmp_path / f".snap_iter_{i}.caffemodel.{TMP_MARK}.{dead}.r{i}.tmp" for i in (3, 40)]
    other = tmp_path / f".other_iter_3.caffemodel.{TMP_MARK}.{dead}.r.tmp"
    for path in [*stale, other]:
        path.write_bytes(b"")
    removed = remove_stale_temporaries(tmp_path, r"snap_iter_[0-9]+\.[A-Za-z0-9]+")
    assert sorted(removed) == sorted(stale)
    assert [p.name for p in tmp_path.iterdir()] == [other.name]
    assert remove_stale_temporaries(tmp_path / "missing", ".*") == []  # an unreadable folder: nothing


def test_a_solver_snapshot_removes_stale_temporaries_of_its_prefix(tmp_path):
    from tests.solver.caffe_cases import make_solver
    dead = _dead_pid()
    stale = [tmp_path / f".snap_iter_{i}.{ext}.{TMP_MARK}.{dead}.r.tmp"
             for i, ext in ((7, "caffemodel"), (7, "solverstate"), (9, "trainstate"))]
    keep = [tmp_path / f".other_iter_7.caffemodel.{TMP_MARK}.{dead}.r.tmp", tmp_path / ".snap_iter_7.caffemodel.x.tmp"]
    for path in [*stale, *keep]:
        path.write_bytes(b"")
    solver = make_solver("sgd_step_momentum", snapshot_prefix=str(tmp_path / "snap"))
    solver.snapshot()  # iteration 0: none of the stale temporaries has its name
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [p.name for p in keep] + ["snap_iter_0.caffemodel", "snap_iter_0.solverstate"])


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs os.mkfifo")
def test_a_fifo_or_device_target_is_refused_not_replaced(tmp_path):
    """The temporary file renamed over a FIFO or a device would replace the node (as root, ``--json /dev/null``
    made /dev/null a regular file): a WriteError, and the node stays."""
    from caffe_compat.io.atomic import write_files_atomic

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    targets = [fifo]
    if os.path.exists("/dev/null"):
        link = tmp_path / "null.json"
        link.symlink_to("/dev/null")  # links are followed: a device behind a link is refused too
        targets.append(link)
    for target in targets:
        kind = "a FIFO" if target == fifo else "a character device"
        with pytest.raises(WriteError, match=rf"^{re.escape(str(target))}: cannot write \(it is {kind}"):
            write_text_atomic(target, "{}")
        with pytest.raises(WriteError, match=rf"^{re.escape(str(target))}: cannot write \(it is {kind}"):
            write_files_atomic([(tmp_path / "a.txt", b"a"), (target, b"b")])
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(t.name for t in targets)

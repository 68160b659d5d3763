"""Atomic writes: the permissions a plain open() gives, typed errors naming the path, no leftovers."""

from __future__ import annotations

import os
import stat

import pytest

from caffe_compat.errors import CaffeCompatError, WriteError
from caffe_compat.io.atomic import atomic_path, current_umask, write_bytes_atomic, write_text_atomic


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

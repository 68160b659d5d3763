"""``caffe_compat.allocator``: with the settings in force a freed block is reused without page faults.

Each case runs in a child process (the settings are process-wide; the test process keeps glibc's
defaults).  The count is the child's minor page faults (``ru_minflt``) while a 64 MiB block is taken from
glibc's ``malloc`` and written a second time, after one of the same size was freed: the first writes of
fresh pages fault once per 4 KiB page (16,384 here), reused heap memory does not fault at all.  The block
comes from ``malloc`` itself (ctypes), not from a tensor: what the settings promise is glibc's reuse;
how a torch build carves its tensors out of malloc varies (torch 2.14.1's CUDA build places a freed 64 MiB
tensor's successor elsewhere in the heap, while whole forwards still reuse memory: see the README)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from caffe_compat import allocator

ROOT = Path(__file__).resolve().parents[1]
PAGES = 64 * 2**20 // 4096

CHILD = r"""
import ctypes, ctypes.util, json, resource, sys
from caffe_compat import allocator
steps = sys.argv[1].split(",")
answers = [getattr(allocator, step)() if step else None for step in steps]
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
SIZE = 64 * 2**20
def faults_of_second_block():
    first = libc.malloc(SIZE)
    ctypes.memset(first, 1, SIZE)            # 64 MiB, written, freed
    libc.free(first)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    second = libc.malloc(SIZE)
    ctypes.memset(second, 2, SIZE)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    libc.free(second)
    return faults
print(json.dumps({"answers": answers, "faults": faults_of_second_block(), "retaining": allocator.retaining()}))
"""

glibc_only = pytest.mark.skipif(allocator.glibc() is None, reason="the settings are glibc's; this C library "
                                "is another, where retain_freed_memory() returns False (tested below)")


def _child(steps: str, env=None) -> dict:
    env = dict(os.environ if env is None else env, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", CHILD, steps], capture_output=True, text=True, env=env,
                          timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _transparent_huge_pages_always() -> bool:
    try:
        return "[always]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


@glibc_only
def test_a_freed_block_is_reused_without_page_faults():
    got = _child("retain_freed_memory")
    assert got["answers"] == [True] and got["retaining"]
    assert got["faults"] < PAGES // 100


@glibc_only
@pytest.mark.skipif(_transparent_huge_pages_always(), reason="with transparent huge pages always on, a fresh "
                    "64 MiB mapping faults in 2 MiB pages (~32 faults): the default has no 4 KiB faults to show")
def test_by_default_and_after_release_the_block_faults_page_by_page():
    assert _child("")["faults"] > PAGES // 2
    got = _child("retain_freed_memory,release_freed_memory")
    assert got["answers"] == [True, True] and not got["retaining"]
    assert got["faults"] > PAGES // 2


@glibc_only
def test_the_command_line_retains_unless_switched_off():
    code = ("import json, sys; from caffe_compat import allocator; from caffe_compat.cli import console_main; "
            "sys.argv = ['caffe-compat', '--version']\ntry:\n    console_main()\nexcept SystemExit:\n    pass\n"
            "print(json.dumps(allocator.retaining()))")
    for value, expected in (("1", True), ("0", False), ("off", False), (None, True)):
        env = {k: v for k, v in os.environ.items() if k != allocator.ENV_SWITCH}
        if value is not None:
            env[allocator.ENV_SWITCH] = value
        env["PYTHONPATH"] = str(ROOT)
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                              check=True)
        assert json.loads(done.stdout.strip().splitlines()[-1]) is expected, value


def test_another_c_library_changes_nothing(monkeypatch):
    monkeypatch.setattr(allocator.platform, "libc_ver", lambda: ("", ""))
    assert allocator.glibc() is None
    assert allocator.retain_freed_memory() is False and allocator.release_freed_memory() is False
    assert not allocator.retaining()


# -- prefault_for_writing ------------------------------------------------------------------------------

def _anonymous(nbytes: int):
    import mmap

    import numpy as np

    block = mmap.mmap(-1, nbytes)
    return block, np.frombuffer(block, dtype=np.uint8)


def _kernel_populates() -> bool:
    block, view = _anonymous(allocator.PREFAULT_MIN_BYTES)
    return allocator.prefault_for_writing(view.ctypes.data, view.nbytes)


populating = pytest.mark.skipif(allocator.glibc() is None or not _kernel_populates(), reason="MADV_POPULATE_WRITE "
                                "needs glibc on Linux 5.14 or newer; elsewhere prefault_for_writing returns False")


@populating
def test_prefault_keeps_every_byte_written_or_not():
    """Untouched pages read as zeros before and after, written ones keep their bytes, and the partial pages
    at both ends of an unaligned range are left alone."""
    import numpy as np

    block, view = _anonymous(64 * 4096)
    view[3 * 4096 + 5: 3 * 4096 + 900] = 7          # one page written, the rest never touched
    view[40 * 4096:] = np.arange(24 * 4096) % 251
    before = view.copy()
    assert allocator.prefault_for_writing(view.ctypes.data + 100, view.nbytes - 300)
    assert np.array_equal(view, before)


CHILD_PREFAULT = r"""
import json, mmap, resource, sys
import numpy as np
from caffe_compat import allocator
SIZE = 16 * 2**20
block = mmap.mmap(-1, SIZE)
view = np.frombuffer(block, dtype=np.uint8)
done = allocator.prefault_for_writing(view.ctypes.data, SIZE) if sys.argv[1] == "prefault" else None
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
view[:] = 3
print(json.dumps({"done": done, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


@populating
@pytest.mark.skipif(_transparent_huge_pages_always(), reason="with transparent huge pages always on a fresh "
                    "block faults in 2 MiB pages: no 4 KiB faults to remove")
def test_prefaulted_block_is_written_without_page_faults():
    """Writing a fresh 16 MiB block faults once per 4 KiB page (4,096); prefaulted first, not at all."""
    def run(mode):
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        done = subprocess.run([sys.executable, "-c", CHILD_PREFAULT, mode], capture_output=True, text=True,
                              env=env, timeout=120, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    plain, prefaulted = run("plain"), run("prefault")
    pages = 16 * 2**20 // 4096
    assert plain["faults"] > pages // 2
    assert prefaulted["done"] is True and prefaulted["faults"] < pages // 100


def test_prefault_declines_small_blocks_and_other_c_libraries(monkeypatch):
    block, view = _anonymous(allocator.PREFAULT_MIN_BYTES)
    assert not allocator.prefault_for_writing(view.ctypes.data, allocator.PREFAULT_MIN_BYTES - 1)
    monkeypatch.setattr(allocator, "_madvise", {})
    monkeypatch.setattr(allocator, "glibc", lambda: None)
    assert not allocator.prefault_for_writing(view.ctypes.data, view.nbytes)


@populating
def test_prefault_leaves_a_mapped_block_alone(monkeypatch):
    """A block whose pages are all mapped (malloc reusing freed memory) costs no populate call; one page
    still unmapped, anywhere in it, and the block is populated; residency is told page by page."""
    block, view = _anonymous(32 * 4096)
    assert not allocator.all_resident(view.ctypes.data, view.nbytes)  # fresh: nothing mapped
    view[: 31 * 4096] = 1                                             # every page but the last
    assert not allocator.all_resident(view.ctypes.data, view.nbytes)
    assert allocator.all_resident(view.ctypes.data, 31 * 4096)
    calls = []
    madvise = allocator._libc_madvise()
    monkeypatch.setitem(allocator._madvise, "fn", lambda *args: calls.append(args) or madvise(*args))
    assert allocator.prefault_for_writing(view.ctypes.data, view.nbytes)
    assert len(calls) == 1 and calls[0][2] == allocator.MADV_POPULATE_WRITE
    assert allocator.all_resident(view.ctypes.data, view.nbytes)      # the last page is mapped now
    assert allocator.prefault_for_writing(view.ctypes.data, view.nbytes)
    assert len(calls) == 1                                            # all mapped: no second call

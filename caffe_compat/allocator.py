"""Keep the memory a process frees for its next tensors, as Caffe keeps its blobs (glibc's malloc).

Caffe and OpenCV's dnn allocate each blob once and write into the same memory at every forward.
PyTorch allocates every activation anew, and on Linux glibc's malloc serves a block of 128 KiB or
more (the threshold adapts, up to 32 MiB) with a fresh ``mmap`` that it unmaps again on ``free``:
the next tensor of that size starts on untouched pages, and the first write of each 4 KiB page is a
page fault (microseconds each on a virtual machine).  Measured on the fused full GoogLeNet, one
thread, 2-vCPU Intel Xeon VM: batch 8 290 → 258 ms, batch 32 1,210 → 990 ms, with the peak resident
size 5-6% higher; the unfused training step (forward + backward, batch 8) 1.08 → 1.03 s (torch 2.13.0;
with torch 2.14.1 the fused batch-8 forward 301 → 260 ms, medians).

:func:`retain_freed_memory` sets glibc's ``M_MMAP_MAX`` to 0 (every block comes from the heap) and
``M_TRIM_THRESHOLD`` to its largest value (freed heap memory up to 2 GiB at the top is kept for reuse
instead of being given back).  The process's resident size then stays near its high-water mark, as
a Caffe process's does.  It is process-wide and lasts until :func:`release_freed_memory`; where the C
library is not glibc (macOS, Windows, musl) both change nothing and return False.

The ``caffe-compat`` command applies it when it starts (``CAFFE_COMPAT_RETAIN_FREED_MEMORY=0`` leaves
malloc alone); a program using the library calls it once, e.g. before serving a fused net.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

__all__ = ["ENV_SWITCH", "all_resident", "glibc", "prefault_for_writing", "release_freed_memory", "retain_freed_memory", "retaining"]

#: glibc's ``mallopt`` parameters (``<malloc.h>``).
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_MMAP_THRESHOLD = -3
#: glibc's defaults, restored by :func:`release_freed_memory` (the mmap threshold adapts again only in a
#: new process; 128 KiB is its starting value).
DEFAULT_MMAP_MAX = 65536
DEFAULT_TRIM_THRESHOLD = 128 * 1024
DEFAULT_MMAP_THRESHOLD = 128 * 1024
#: ``mallopt`` takes an ``int``.
LARGEST = 2**31 - 1

#: Environment variable: "0" (or "no", "false", "off") keeps the command line from retaining memory.
ENV_SWITCH = "CAFFE_COMPAT_RETAIN_FREED_MEMORY"

_state = {"retaining": False}


def glibc():
    """The process's glibc as a ``ctypes.CDLL``, or None where the C library is another."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return libc


def _set(settings) -> bool:
    libc = glibc()
    if libc is None:
        return False
    return all(libc.mallopt(param, value) == 1 for param, value in settings)


def retain_freed_memory() -> bool:
    """Serve every block from the heap and keep what is freed there for reuse (module docstring).
    Returns whether glibc took the settings; calling it again changes nothing."""
    done = _set([(M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, LARGEST)])
    _state["retaining"] = _state["retaining"] or done
    return done


def release_freed_memory() -> bool:
    """glibc's defaults again: large blocks mapped and unmapped, freed heap memory trimmed."""
    done = _set([(M_MMAP_MAX, DEFAULT_MMAP_MAX), (M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD),
                 (M_MMAP_THRESHOLD, DEFAULT_MMAP_THRESHOLD)])
    if done:
        _state["retaining"] = False
    return done


def retaining() -> bool:
    """Whether :func:`retain_freed_memory` is in force in this process."""
    return _state["retaining"]


#: ``madvise``'s MADV_POPULATE_WRITE (Linux 5.14 and newer).
MADV_POPULATE_WRITE = 23
PAGE_BYTES = 4096
#: Below this a block's page faults cost less than the call.
PREFAULT_MIN_BYTES = 64 * 1024
_madvise = {}
#: ``bytes.translate`` table keeping only bit 0 of ``mincore``'s per-page byte.
_RESIDENT_BIT = bytes(value & 1 for value in range(256))


def _libc_madvise():
    if "fn" not in _madvise:
        libc = glibc()
        fn = getattr(libc, "madvise", None) if libc is not None else None
        if fn is not None:
            fn.argtypes, fn.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
        mincore = getattr(libc, "mincore", None) if libc is not None else None
        if mincore is not None:
            mincore.argtypes, mincore.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p), ctypes.c_int
        _madvise["fn"], _madvise["mincore"] = fn, mincore
    return _madvise["fn"]


def all_resident(start: int, nbytes: int) -> bool:
    """Whether every page of the page-aligned range ``[start, start + nbytes)`` is mapped in memory
    (``mincore``; False where it cannot tell)."""
    _libc_madvise()
    mincore = _madvise.get("mincore")
    if mincore is None:
        return False
    pages = nbytes // PAGE_BYTES
    flags = (ctypes.c_ubyte * pages)()
    if mincore(start, nbytes, flags) != 0:
        return False
    return b"\0" not in bytes(flags).translate(_RESIDENT_BIT)  # bit 0 of each page's byte; the others are reserved


def prefault_for_writing(address: int, nbytes: int) -> bool:
    """Map the whole pages of ``[address, address + nbytes)`` writable in one system call
    (``madvise(MADV_POPULATE_WRITE)``), for a block the caller is about to overwrite entirely: a fresh
    block's pages are otherwise mapped one page fault at a time while it is written (~2 us each on a
    virtual machine; a 24 MB caffemodel copied into new parameters takes 6,000 of them).  Contents are
    unchanged: an unmapped anonymous page reads as zeros and is mapped as zeros, a mapped one is left
    as it is.  A block whose pages are all mapped already (malloc handing back memory the process freed,
    as when it loads a second model) is left alone: the kernel's walk over mapped pages cost ~0.4 us a
    page, 2.4 ms of a repeated open_nsfw load, for nothing (``mincore`` tells, in one call).  Returns
    False, changing nothing, for blocks under :data:`PREFAULT_MIN_BYTES`, where the C library is not
    glibc, or where the kernel refuses (older than 5.14, or memory it cannot populate); True when the
    pages are mapped."""
    start = (address + PAGE_BYTES - 1) & ~(PAGE_BYTES - 1)
    stop = (address + nbytes) & ~(PAGE_BYTES - 1)
    if nbytes < PREFAULT_MIN_BYTES or stop <= start:
        return False
    madvise = _libc_madvise()
    if madvise is None:
        return False
    return all_resident(start, stop - start) or madvise(start, stop - start, MADV_POPULATE_WRITE) == 0


def retain_unless_switched_off(environ=os.environ) -> bool:
    """:func:`retain_freed_memory` unless :data:`ENV_SWITCH` says no (what the command line does)."""
    if environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "no", "false", "off"):
        return False
    return retain_freed_memory()

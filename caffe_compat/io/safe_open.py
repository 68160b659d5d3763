"""Only regular files: every path a net, solver, solverstate, list or the command line names is checked
here before it is opened.

:func:`check_regular_file` uses ``os.stat`` (never ``open``), so a FIFO named where a file is expected
is refused at once instead of blocking in ``open()`` forever, and a device (``/dev/zero``) is refused
instead of being read until memory runs out.  Directories and sockets are refused too, and a format
with a size limit (protobuf's 2 GB message) is checked against ``st_size``.  A missing path passes: the
caller's own open reports it the way it always has.  :func:`require_regular_file` is the check for a
caller that must name a missing file itself (its own error type and message).  :func:`read_regular_bytes` and
:func:`read_regular_text` check and then read at most the bound, so a file that grows (or is swapped)
between the check and the read still cannot be read without limit.

:func:`memory_budget` is the bound a reader compares a size declared by a file (an HDF5 dataset's shape, a
resize asked for by a model) with before allocating it: half the memory available now.
:func:`read_list_text` reads a list file (an ImageData or convert_imageset list, an HDF5Data source list, a
WindowData file, a data set's table) within :func:`list_file_limit`, a sixteenth of the budget: the text,
its lines and their Python objects take several times the file's bytes.
"""

from __future__ import annotations

import math
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path

from caffe_compat.errors import CaffeCompatError, FormatError, MemoryBudgetError, NotRegularFileError

__all__ = ["LIST_EXPANSION", "PROTOBUF_MAX_BYTES", "available_memory", "check_regular_file", "list_file_limit",
           "memory_budget", "read_list_text", "read_regular_bytes", "read_regular_text", "require_regular_file"]

#: The largest message protobuf parses (2 GB, ``INT_MAX`` bytes): prototxt, caffemodel, solverstate,
#: binaryproto.
PROTOBUF_MAX_BYTES = 2 ** 31 - 1


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _named(path, what: str | None) -> str:
    return f"{path}" + (f" (named by {what})" if what else "")


def check_regular_file(path: str | os.PathLike, what: str | None = None,
                       max_bytes: int | None = None) -> os.stat_result | None:
    """The ``os.stat`` of ``path`` (following links), or None when it does not exist (or cannot be
    stat'ed: the caller's open names that).  NotRegularFileError when it is a directory, a FIFO, a device
    or a socket, or is larger than ``max_bytes``; ``what`` (e.g. ``"layer 'loss' (InfogainLoss)
    infogain_loss_param.source"``) says which field or layer named it."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):  # missing, a dangling link, no permission, a NUL byte in the name
        return None
    if not stat.S_ISREG(st.st_mode):
        raise NotRegularFileError(f"{_named(path, what)}: is {_kind(st.st_mode)}, expected a regular file")
    if max_bytes is not None and st.st_size > max_bytes:
        raise NotRegularFileError(f"{_named(path, what)}: {st.st_size} bytes, more than the {max_bytes} this "
                                  f"format allows")
    return st


def require_regular_file(path: str | os.PathLike, what: str | None = None, *,
                         error: type[Exception] = CaffeCompatError,
                         missing: str | Callable[[], str] | None = None) -> Path:
    """``Path(path)`` when it is a regular file (or a link to one).  Only regular files: a FIFO would block
    its reader forever and a device (``/dev/zero``) never ends, so either one, a socket or a directory is a
    :class:`~caffe_compat.errors.NotRegularFileError` naming it and ``what`` named it (as
    :func:`check_regular_file`, which stats and never opens).  A path that does not exist (or a dangling link)
    is ``error(missing)``, ``missing`` being the caller's whole message, by default ``"<path>: no such file"``;
    a callable ``missing`` is called only then (a message that names the working directory: ``os.getcwd``
    fails once the folder is removed).  A path that exists but cannot be looked at (a folder on the way
    without search permission) is ``error`` saying so, not that it is missing."""
    if check_regular_file(path, what) is None:
        try:
            os.stat(path)
        except PermissionError as exc:
            raise error(f"{_named(path, what)}: cannot be read ({exc.strerror})") from None
        except (OSError, ValueError):
            pass
        message = missing() if callable(missing) else missing
        raise error(f"{path}: no such file" if message is None else message)
    return Path(path)


def read_regular_bytes(path: str | os.PathLike, what: str | None = None, max_bytes: int | None = None) -> bytes:
    """The bytes of ``path`` once :func:`check_regular_file` accepts it; never more than ``max_bytes``
    (NotRegularFileError if the file grew past it).  Missing files raise the usual OSError."""
    st = check_regular_file(path, what, max_bytes)
    if "\0" in os.fsdecode(path):
        raise NotRegularFileError(f"{_named(path, what)!r}: a path with a NUL byte names no file")
    with open(path, "rb") as fh:
        if max_bytes is None:
            return fh.read()
        # fh.read(n) allocates n bytes up front: ask for what the file holds, then (if it grew) read on in
        # chunks, never more than the bound
        expected = st.st_size if st is not None else 0
        data = fh.read(min(max_bytes, expected) + 1)
        while len(data) <= max_bytes:
            chunk = fh.read(min(1 << 20, max_bytes + 1 - len(data)))
            if not chunk:
                break
            data += chunk
    if len(data) > max_bytes:
        raise NotRegularFileError(f"{_named(path, what)}: more than the {max_bytes} bytes this format allows")
    return data


def read_regular_text(path: str | os.PathLike, what: str | None = None, max_bytes: int | None = None,
                      encoding: str | None = None, errors: str | None = None) -> str:
    """:func:`read_regular_bytes` decoded (universal newlines, like ``Path.read_text``)."""
    import io

    data = read_regular_bytes(path, what, max_bytes)
    return io.TextIOWrapper(io.BytesIO(data), encoding=encoding, errors=errors).read()


#: Seconds a reading of the available memory is reused: the readers check every image and record against
#: the budget, and reading ``/proc/meminfo`` (~30 µs) cost as much as a sixth of a JPEG's decode+transform.
AVAILABLE_MEMORY_TTL = 1.0
_available: list = [-math.inf, 0]  # [when read (time.monotonic), bytes]


def available_memory() -> int:
    """Bytes of memory available now: the system's ``MemAvailable`` (Linux), else ``SC_AVPHYS_PAGES``,
    else 8 GiB where the system does not say; a reading is reused for :data:`AVAILABLE_MEMORY_TTL` s."""
    now = time.monotonic()
    when, value = _available
    if now - when < AVAILABLE_MEMORY_TTL:
        return value
    value = _read_available_memory()
    _available[:] = [now, value]
    return value


def _read_available_memory() -> int:
    try:
        with open("/proc/meminfo", "rb") as info:
            text = info.read(1 << 16)
        at = text.index(b"MemAvailable:")
        return int(text[at + 13:text.index(b"\n", at)].split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def memory_budget(fraction: float = 0.5) -> int:
    """The most a reader (or a net) may allocate for what a file declares: ``CAFFE_COMPAT_MEMORY_BUDGET``
    (bytes, or e.g. ``512M``, ``8G``) when set, else ``fraction`` of :func:`available_memory`, at least
    1 MiB."""
    text = os.environ.get("CAFFE_COMPAT_MEMORY_BUDGET", "").strip()
    if text:
        units = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}
        scale = units.get(text[-1].upper(), 1)
        try:
            return int(float(text[:-1] if scale != 1 else text) * scale)
        except ValueError:
            raise FormatError(f"CAFFE_COMPAT_MEMORY_BUDGET={text!r} is not a size (bytes, or e.g. 512M, "
                              f"8G)") from None
    return max(int(available_memory() * fraction), 1 << 20)


#: How many times its size a list file may take once read: the bytes, the decoded text, one ``str`` per line
#: and field (about 50 bytes of object header each), the tuples holding them.
LIST_EXPANSION = 16


def list_file_limit() -> int:
    """The most bytes a list file may hold: :func:`memory_budget` divided by :data:`LIST_EXPANSION`."""
    return memory_budget() // LIST_EXPANSION


def read_list_text(path: str | os.PathLike, what: str | None = None, encoding: str | None = None,
                   errors: str | None = None) -> str:
    """A list file's text (see :func:`read_regular_text`), refused with a MemoryBudgetError naming it when
    it holds more than :func:`list_file_limit` bytes; it is never read past that bound, so a file that
    grows while it is read (or a ``/proc`` file that reports 0 bytes) cannot exhaust memory either."""
    limit = list_file_limit()
    st = check_regular_file(path, what)
    if st is not None and st.st_size > limit:
        raise MemoryBudgetError(f"{_named(path, what)}: a list file of {st.st_size} bytes, more than the "
                                f"{limit} bytes allowed (1/{LIST_EXPANSION} of the memory budget of "
                                f"{limit * LIST_EXPANSION} bytes; set CAFFE_COMPAT_MEMORY_BUDGET to allow more)")
    try:
        return read_regular_text(path, what, limit, encoding, errors)
    except NotRegularFileError as exc:
        if isinstance(exc, MemoryBudgetError) or "bytes this format allows" not in str(exc):
            raise
        raise MemoryBudgetError(f"{_named(path, what)}: a list file of more than the {limit} bytes allowed "
                                f"(1/{LIST_EXPANSION} of the memory budget; set CAFFE_COMPAT_MEMORY_BUDGET to "
                                f"allow more)") from None

"""Atomic file writes: write a temporary file beside the target, then rename it over the target.

A reader (or a crash) never sees a half-written caffemodel, solverstate, binaryproto or ONNX file.

* The written file gets the permissions a plain ``open(path, "w")`` would give it: those of the file it
  replaces when one exists, else ``0o666 & ~umask`` (``mkstemp`` alone would leave ``0o600``).
* Missing parent folders are created (the command line refuses them first: :func:`require_folder`).
* Failures of the write itself (a parent that cannot be created, a read-only folder, a file where a
  folder is expected, a full disk) raise :class:`~caffe_compat.errors.WriteError` naming the target and
  the operating system's reason; the temporary file is removed and an existing target is untouched.
"""

from __future__ import annotations

import os
import stat
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

from caffe_compat.errors import WriteError

_UMASK_LOCK = threading.Lock()


def current_umask() -> int:
    """The process umask, read without changing it where Linux reports it (``/proc/self/status``)."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    with _UMASK_LOCK:  # elsewhere: set and restore it (the only portable way to read it)
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def _new_file_mode(target: Path) -> int:
    try:
        existing = target.stat()
    except OSError:
        existing = None
    if existing is not None and stat.S_ISREG(existing.st_mode):
        return stat.S_IMODE(existing.st_mode)
    return 0o666 & ~current_umask()


def write_error(target: Path, exc: Exception, detail: str | None = None, with_reason: bool = True) -> WriteError:
    """WriteError ``"<target>: cannot write (<detail>: <reason>)"`` from ``exc`` (an OSError, or the
    RuntimeError a library raises for a failed write)."""
    reason = getattr(exc, "strerror", None) or str(exc)
    text = f"{detail}: {reason}" if detail and with_reason else detail or reason
    error = WriteError(f"{target}: cannot write ({text})")
    error.errno, error.strerror, error.filename = getattr(exc, "errno", None), getattr(exc, "strerror", None), str(target)
    return error


def require_folder(path: str | os.PathLike) -> Path:
    """``path`` as a Path when its folder exists; else WriteError naming the missing folder.  The command
    line checks its output paths with this before any work, so a typo never creates folders silently
    (the writers below create them for library callers)."""
    target = Path(path)
    folder = target.parent
    if not folder.is_dir():
        reason = f"{folder} is not a folder" if folder.exists() else f"folder {folder} does not exist; create it first"
        raise WriteError(f"{target}: cannot write ({reason})")
    return target


@contextmanager
def atomic_path(path: str | os.PathLike):
    """Yield a temporary path in the target's directory; on success it is renamed to ``path``.

    Creating the folder or the temporary file, and the final rename, raise WriteError; errors raised by
    the caller's own code inside the ``with`` block propagate unchanged (the temporary file is removed)."""
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError as exc:
        raise write_error(target, exc, f"{exc.filename or target.parent} is not a folder",
                           with_reason=False) from None
    except OSError as exc:
        raise write_error(target, exc, f"cannot create folder {exc.filename or target.parent}") from None
    mode = _new_file_mode(target)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as exc:
        raise write_error(target, exc, f"cannot create a file in {target.parent}") from None
    os.close(fd)
    try:
        yield Path(tmp)
        try:
            os.chmod(tmp, mode)
            os.replace(tmp, target)
        except OSError as exc:
            raise write_error(target, exc) from None
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
        except OSError as exc:
            raise write_error(Path(path), exc) from None


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))

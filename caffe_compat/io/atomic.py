"""Atomic file writes: write a temporary file beside the target, then rename it over the target.

A reader (or a crash) never sees a half-written caffemodel, solverstate, binaryproto or ONNX file.

* The written file gets the permissions a plain ``open(path, "w")`` would give it: those of the file it
  replaces when one exists, else ``0o666 & ~umask`` (``mkstemp`` alone would leave ``0o600``).
* Missing parent folders are created (the command line refuses them first: :func:`require_folder`).
* Failures of the write itself (a parent that cannot be created, a read-only folder, a file where a
  folder is expected, a full disk) raise :class:`~caffe_compat.errors.WriteError` naming the target and
  the operating system's reason; the temporary file is removed and an existing target is untouched.
* :func:`write_files_atomic` writes several files all-or-nothing (a checkpoint converted back to a
  prototxt + caffemodel pair): nothing of a failed call is left behind and the files it would have
  replaced are restored.
* The temporary file is named ``.<target name>.caffe-compat-tmp.<pid>.<random>.tmp`` (:data:`TMP_MARK`,
  the writing process's id).  A process killed mid-write (SIGKILL, power loss) cannot remove it; the
  next write of the same target removes such leftovers (:func:`remove_stale_temporaries`): files of
  exactly that pattern whose process is gone (or whose pid now belongs to a process started after the
  file was last written).  Nothing else in the folder is touched.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import tempfile
import threading
import shutil
from contextlib import contextmanager
from pathlib import Path

from caffe_compat.errors import WriteError

_UMASK_LOCK = threading.Lock()

TMP_MARK = "caffe-compat-tmp"  # in every temporary name: ``.<target name>.caffe-compat-tmp.<pid>.<random>.tmp``
_TMP_TAIL = r"\." + re.escape(TMP_MARK) + r"\.(?P<pid>[0-9]+)\.[A-Za-z0-9_]+\.tmp"
_CLOCK_SLACK_S = 2.0  # process start times are in clock ticks; file times may be coarser


def temporary_prefix(target_name: str) -> str:
    """The start of this process's temporary names for ``target_name``."""
    return f".{target_name}.{TMP_MARK}.{os.getpid()}."


def temporary_pattern(target_name_regex: str) -> re.Pattern:
    """The names of our temporaries for targets whose names match ``target_name_regex`` (whole name)."""
    return re.compile(r"\.(?:" + target_name_regex + r")" + _TMP_TAIL)


def _process_start(pid: int) -> float | None:
    """When ``pid`` started (seconds since the epoch) where Linux's /proc tells; else None."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # field 22 (starttime), counted after the ")" that ends field 2
        with open("/proc/stat", encoding="ascii", errors="replace") as fh:
            boot = next(int(line.split()[1]) for line in fh if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _owner_alive(pid: int, written: float) -> bool:
    """Whether the process that wrote a temporary (last written at ``written``) may still be writing it.
    In doubt (no permission to ask, no start time to compare), alive."""
    if pid == os.getpid():
        return True  # another thread of this process may be writing it
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    except OSError:
        return True
    start = _process_start(pid)
    # the pid was reused: its process started after the temporary was last written
    return start is None or written >= start - _CLOCK_SLACK_S


def remove_stale_temporaries(folder: str | os.PathLike, target_name_regex: str) -> list[Path]:
    """Remove, from ``folder``, leftover temporaries of :func:`atomic_path` for targets whose names match
    ``target_name_regex`` (a regular expression for the whole target name), whose writing process is
    gone.  Only regular files named exactly by our pattern are considered; errors (a folder that cannot
    be listed, a file removed meanwhile) are ignored.  Returns the removed paths."""
    pattern = temporary_pattern(target_name_regex)
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        match = pattern.fullmatch(name)
        if match is None:
            continue
        path = Path(folder) / name
        try:
            info = path.lstat()
            if not stat.S_ISREG(info.st_mode) or _owner_alive(int(match["pid"]), info.st_mtime):
                continue
            path.unlink()
        except (OSError, ValueError):
            continue
        removed.append(path)
    return removed


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


def open_log(path: str | os.PathLike, mode: str = "a", **kwargs):
    """``open(path, mode)`` (``"a"`` or ``"w"``) for a log written as a run goes (not atomic: it grows line by
    line): opened non-blocking, then made blocking, so a FIFO without a reader is a WriteError rather than a
    hang; a folder, a missing or read-only folder are WriteErrors naming the path too."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if mode.startswith("a") else os.O_TRUNC)
    try:
        fd = os.open(path, flags | getattr(os, "O_NONBLOCK", 0), 0o666)
    except OSError as exc:
        fifo = exc.errno == errno.ENXIO and stat.S_ISFIFO(os.stat(path).st_mode)
        raise write_error(Path(path), exc, "a FIFO with no reader" if fifo else None) from None
    try:
        os.set_blocking(fd, True)
        return open(fd, mode, **kwargs)
    except BaseException:
        os.close(fd)
        raise


def refuse_special_target(target: Path) -> None:
    """WriteError when ``target`` exists (links followed) as a device, a FIFO or a socket: the temporary file
    renamed into place would replace the node itself (run as root, ``--json /dev/null`` turned /dev/null
    into a regular file)."""
    from caffe_compat.io.safe_open import _kind

    try:
        st = os.stat(target)
    except (OSError, ValueError):
        return
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        raise WriteError(f"{target}: cannot write (it is {_kind(st.st_mode)}: outputs are written to a temporary "
                         f"file renamed into place, which would replace it; give a regular file's path)")


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
    the caller's own code inside the ``with`` block propagate unchanged (the temporary file is removed).
    Stale temporaries of the same target name, left by killed processes, are removed first."""
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError as exc:
        raise write_error(target, exc, f"{exc.filename or target.parent} is not a folder",
                           with_reason=False) from None
    except OSError as exc:
        raise write_error(target, exc, f"cannot create folder {exc.filename or target.parent}") from None
    refuse_special_target(target)
    remove_stale_temporaries(target.parent, re.escape(target.name))
    mode = _new_file_mode(target)
    try:
        fd, tmp = tempfile.mkstemp(prefix=temporary_prefix(target.name), suffix=".tmp", dir=target.parent)
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


def write_files_atomic(contents: list[tuple[Path, bytes]]) -> None:
    """Write every ``(target, data)`` all-or-nothing: each to a temporary file beside its target first
    (``contents[0]``'s folder and its missing parents are created), then all renamed into place.  If a
    write or a rename fails (full disk, read-only folder, a folder where a target should be), the
    temporary files are removed, a target already renamed is put back as it was (restored, or removed if
    it did not exist), the folders this call created are removed again, and a WriteError names the path
    and the reason."""
    for target, _ in contents:
        refuse_special_target(Path(target))
    first = Path(contents[0][0])
    created = _make_parents(first.parent, first)
    temporaries: list[tuple[Path, Path]] = []
    renamed: list[tuple[Path, Path | None]] = []  # (target, backup of what it replaced, or None)
    current = first
    try:
        for target, data in contents:
            current = target = Path(target)
            remove_stale_temporaries(target.parent, re.escape(target.name))
            fd, name = tempfile.mkstemp(prefix=temporary_prefix(target.name), suffix=".tmp", dir=target.parent)
            temporaries.append((Path(name), target))
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.chmod(name, _new_file_mode(target))
        for tmp, target in temporaries:
            current = target
            backup = target.with_name(f".{target.name}.{os.getpid()}.old") if target.is_file() else None
            try:
                if backup is not None:  # keep the old file until every file is in place
                    try:
                        os.link(target, backup)
                    except OSError:
                        shutil.copy2(target, backup)
                os.replace(tmp, target)
            except BaseException:
                if backup is not None and os.path.lexists(backup):
                    os.unlink(backup)
                raise
            renamed.append((target, backup))
    except BaseException as exc:
        for target, backup in reversed(renamed):
            try:
                if backup is not None:
                    os.replace(backup, target)
                else:
                    os.unlink(target)
            except OSError:
                pass
        for tmp, _ in temporaries:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        _remove_folders(created)
        if isinstance(exc, OSError) and not isinstance(exc, WriteError):
            raise write_error(current, exc) from None
        raise
    for _, backup in renamed:
        if backup is not None:
            try:
                os.unlink(backup)
            except OSError:
                pass


def _make_parents(folder: Path, target: Path) -> list[Path]:
    """Create ``folder`` and its missing parents; return the created ones, deepest first."""
    missing = []
    for path in (folder, *folder.parents):
        if os.path.lexists(path):
            break
        missing.append(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        _remove_folders(missing)
        raise write_error(target, exc) from None
    return missing


def _remove_folders(folders: list[Path]) -> None:
    for folder in folders:  # deepest first; only empty ones (rmdir refuses others)
        try:
            folder.rmdir()
        except OSError:
            pass

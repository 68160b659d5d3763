"""caffe-compat checkpoint -> ``<prefix>.prototxt`` (the net, Caffe's V2 text) + ``<prefix>.caffemodel``
(binary V2, written like Caffe's ``Net::ToProto``: every layer, automatic Split layers included, BatchNorm's
three blobs with the stored scale factor).

The pair is written all-or-nothing: both files are serialised and written to temporary files beside the
targets first; only when both are on disk are they renamed into place.  If a write or a rename fails
(full disk, read-only folder, a folder where a target should be), the temporary files are removed, a
target already renamed is put back as it was (restored, or removed if it did not exist), folders this
call created are removed again, and a :class:`~caffe_compat.errors.WriteError` names the path and the
reason; no half of the pair is left behind."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path

from caffe_compat.checkpoint import load_checkpoint
from caffe_compat.errors import WriteError


def convert_torch_to_caffe(checkpoint: str | os.PathLike, prefix: str | os.PathLike) -> tuple[Path, Path]:
    """Write both files; return their paths (prototxt, caffemodel)."""
    from caffe_compat.checkpoint import checkpoint_prototxt
    from caffe_compat.io.dialects import to_binary_dialect

    net = load_checkpoint(checkpoint)
    prefix = Path(prefix)
    prototxt, caffemodel = prefix.with_name(prefix.name + ".prototxt"), prefix.with_name(prefix.name + ".caffemodel")
    contents = [(prototxt, checkpoint_prototxt(net).encode("utf-8")),
                (caffemodel, to_binary_dialect(net.to_netparameter()).SerializeToString())]
    _write_all(contents)
    return prototxt, caffemodel


def _write_error(target: Path, exc: OSError) -> WriteError:
    error = WriteError(f"{target}: cannot write ({exc.strerror or exc})")
    error.errno, error.strerror, error.filename = exc.errno, exc.strerror, str(target)
    return error


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
        raise _write_error(target, exc) from None
    return missing


def _remove_folders(folders: list[Path]) -> None:
    for folder in folders:  # deepest first; only empty ones (rmdir refuses others)
        try:
            folder.rmdir()
        except OSError:
            pass


def _write_all(contents: list[tuple[Path, bytes]]) -> None:
    """Write every ``(target, data)`` to a temporary file beside it, then rename all of them into place;
    on any failure undo everything (module docstring)."""
    created = _make_parents(contents[0][0].parent, contents[0][0])
    temporaries: list[tuple[Path, Path]] = []
    renamed: list[tuple[Path, Path | None]] = []  # (target, backup of what it replaced, or None)
    current = contents[0][0]
    try:
        for target, data in contents:
            current = target
            fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
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
                if backup is not None:  # keep the old file until the whole pair is in place
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
            raise _write_error(current, exc) from None
        raise
    for _, backup in renamed:
        if backup is not None:
            try:
                os.unlink(backup)
            except OSError:
                pass


def _new_file_mode(target: Path) -> int:
    """The mode a plain ``open(target, "w")`` would give (the replaced file's, else 0o666 & ~umask)."""
    from caffe_compat.io.atomic import current_umask

    try:
        if target.is_file():
            return stat.S_IMODE(target.stat().st_mode)
    except OSError:
        pass
    return 0o666 & ~current_umask()

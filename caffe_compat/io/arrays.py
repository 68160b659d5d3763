"""Reading ``.npy`` / ``.npz`` files a user names (``--input BLOB=FILE``) with typed errors and a size check
before allocation.

``numpy.load`` trusts the header: a ``.npy`` whose header declares ``shape (100000000000,)`` allocates
400 GB before it finds the data missing, a ``.npz`` member can declare any expanded size, and a damaged
file raises whatever the layer below meets (``zipfile.BadZipFile``, ``tokenize.TokenError``,
``EOFError``, ``zlib.error``, ``ValueError``, ...).  :func:`load_array_file` checks a ``.npy`` header
(shape, dtype; no objects: never unpickles) against the bytes the file really holds and the memory budget
(:func:`caffe_compat.io.safe_open.memory_budget`) before reading, does the same for each ``.npz`` member
it is asked for, and turns every failure into a :class:`~caffe_compat.errors.FormatError` naming the file
(and the member).
"""

from __future__ import annotations

import math
import os
import tokenize
import zipfile
import zlib

import numpy as np

from caffe_compat.errors import FormatError, MemoryBudgetError
from caffe_compat.io.safe_open import memory_budget, require_regular_file

__all__ = ["load_array_file"]

# What numpy's readers raise on a damaged file.
_NUMPY_ERRORS = (OSError, ValueError, EOFError, zipfile.BadZipFile, zipfile.LargeZipFile, SyntaxError,
                 tokenize.TokenError, TypeError, OverflowError, KeyError, IndexError, NotImplementedError,
                 zlib.error, RuntimeError, MemoryError, UnicodeDecodeError, AttributeError)


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__


def _check_header(fh, available: int, where: str) -> None:
    """Read and check a ``.npy`` header at ``fh``'s position: the data it declares fits in the
    ``available`` bytes after the header and in the memory budget."""
    start = fh.tell()
    version = np.lib.format.read_magic(fh)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(fh)
    elif version in ((2, 0), (3, 0)):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(fh)
    else:
        raise FormatError(f"{where}: .npy format version {version} is not one numpy writes")
    if dtype.hasobject:
        raise FormatError(f"{where}: holds Python objects ({dtype}); only numeric arrays are read (never unpickled)")
    if any(int(n) < 0 for n in shape):
        raise FormatError(f"{where}: negative dimension in shape {shape}")
    need = math.prod(int(n) for n in shape) * dtype.itemsize
    held = available - (fh.tell() - start)
    if need > held:
        raise FormatError(f"{where}: its header declares shape {shape} of {dtype} ({need} bytes), the file holds "
                          f"{max(held, 0)} bytes of data (truncated or corrupt)")
    if need > memory_budget():
        raise MemoryBudgetError(f"{where}: shape {shape} of {dtype} needs {need} bytes, more than the memory budget of "
                          f"{memory_budget()} bytes")


class _CheckedNpz:
    """A ``.npz`` whose members are checked (:func:`_check_header`) before they are read."""

    def __init__(self, path, npz):
        self.path, self.npz = path, npz
        self.files = list(npz.files)

    def __getitem__(self, name: str) -> np.ndarray:
        where = f"{self.path}: array '{name}'"
        try:
            member = name if name in self.npz.zip.namelist() else f"{name}.npy"
            info = self.npz.zip.getinfo(member)
            if info.file_size > memory_budget():
                raise MemoryBudgetError(f"{where}: {info.file_size} bytes expanded, more than the memory budget of "
                                  f"{memory_budget()} bytes")
            with self.npz.zip.open(member) as fh:
                _check_header(fh, info.file_size, where)
            return np.asarray(self.npz[name])
        except FormatError:
            raise
        except _NUMPY_ERRORS as exc:
            raise FormatError(f"{where}: not a readable array ({_reason(exc)})") from None

    def close(self) -> None:
        self.npz.close()

    def __enter__(self) -> "_CheckedNpz":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load_array_file(path, what: str | None = None):
    """The array of a ``.npy`` file, or a checked ``.npz`` (``.files``, ``[name]``, a context manager), as
    the module docstring says; FormatError naming ``path`` when it is not one."""
    require_regular_file(path, what, error=FormatError)
    try:
        with open(path, "rb") as fh:
            magic = fh.read(6)
            fh.seek(0)
            if magic == b"\x93NUMPY":
                _check_header(fh, os.fstat(fh.fileno()).st_size, str(path))
        loaded = np.load(path, allow_pickle=False)
    except FormatError:
        raise
    except _NUMPY_ERRORS as exc:
        raise FormatError(f"{path}: not a readable .npy/.npz array ({_reason(exc)})") from None
    if isinstance(loaded, np.ndarray):
        return loaded
    if not hasattr(loaded, "files"):
        raise FormatError(f"{path}: not a .npy/.npz array file")
    return _CheckedNpz(path, loaded)

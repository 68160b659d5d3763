"""Reading the datasets of an HDF5 file for Caffe's ``HDF5Data`` layer, with every failure a typed error.

:func:`read_hdf5_tops` opens the file (only a regular file: a FIFO or a device named in the layer's list is
refused by name before anything opens it), and for each top takes the dataset of that name as float32,
as Caffe's ``hdf5_load_nd_dataset`` does.  The name is a link of the file's root group (Caffe's
``H5LTfind_dataset`` compares it with the root's link names): a top named ``group/data`` or ``/data`` is
not found (h5py's path lookup would reach into the group), as Caffe CHECK-fails "Failed to find HDF5
dataset group/data".  What a hostile or damaged file can provoke inside h5py
(``OSError``, ``RuntimeError``, ``KeyError``, ``ValueError``, ``TypeError``, ``IndexError``, ``OverflowError``,
``MemoryError``) is a :class:`~caffe_compat.errors.DataError` naming the file, the dataset and who named the
file.  Before a byte of a dataset is read, its declared size (a compressed dataset declares its
expanded size) is compared with ``max_bytes`` (default: half the memory available now), so a few-KB
gzip bomb is refused instead of being expanded; a group or a dataset whose HDF5 type class is neither
``H5T_FLOAT`` nor ``H5T_INTEGER`` (strings, compound, references, and ``H5T_ENUM``: what h5py writes for a
numpy **bool** array) where a top's dataset should be is a :class:`~caffe_compat.errors.FormatError`, as
Caffe's ``hdf5_load_nd_dataset`` LOG(FATAL)s on every other class ("Unsupported datatype class: H5T_ENUM").
"""

from __future__ import annotations

import math

import numpy as np

from caffe_compat.errors import DataError, FormatError, MemoryBudgetError
from caffe_compat.io.safe_open import check_regular_file, memory_budget

__all__ = ["read_hdf5_tops"]

# What h5py raises on a file it cannot make sense of (its own errors derive from these).
_H5PY_ERRORS = (OSError, RuntimeError, KeyError, ValueError, TypeError, IndexError, OverflowError, AttributeError)


# HDF5 type classes by name (Caffe's hdf5_load_nd_dataset switches on these; only INTEGER and FLOAT are read)
_CLASS_NAMES = ("INTEGER", "FLOAT", "TIME", "STRING", "BITFIELD", "OPAQUE", "COMPOUND", "REFERENCE", "ENUM", "VLEN",
                "ARRAY")


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def read_hdf5_tops(path, names, where: str, named_by: str | None = None,
                   max_bytes: int | None = None) -> list[np.ndarray]:
    """The datasets ``names`` of the HDF5 file ``path`` as float32 arrays (see the module docstring);
    ``where`` (e.g. ``"layer 'h5' (HDF5Data)"``) starts every message, ``named_by`` says which list named
    the file.  ``max_bytes`` bounds the bytes of all datasets together, as stored plus as float32."""
    import h5py

    check_regular_file(path, f"{where} list {named_by}" if named_by else where)
    budget = memory_budget() if max_bytes is None else int(max_bytes)
    arrays: list[np.ndarray] = []
    total = 0
    try:
        with h5py.File(path, "r") as f:
            for name in names:
                if "/" in name or name not in f:  # H5LTfind_dataset: a link of the root group, by exact name
                    raise DataError(f"{where}: {path} has no dataset '{name}'" + (
                        " (Caffe looks the top's name up among the datasets at the file's root, so a name with '/' "
                        "never reaches into a group: 'Failed to find HDF5 dataset')" if "/" in name else ""))
                item = f[name]
                if not isinstance(item, h5py.Dataset):
                    raise FormatError(f"{where}: {path}: '{name}' is a {type(item).__name__}, not a dataset")
                type_class = item.id.get_type().get_class()
                if item.dtype.kind not in "iuf" or type_class not in (h5py.h5t.INTEGER, h5py.h5t.FLOAT):
                    kind = next((f"H5T_{n}" for n in _CLASS_NAMES if getattr(h5py.h5t, n, None) == type_class),
                                "an unknown class")
                    raise FormatError(f"{where}: {path}: dataset '{name}' holds {item.dtype} values ({kind}), Caffe "
                                      f"reads only H5T_FLOAT and H5T_INTEGER datasets")
                shape = tuple(int(n) for n in item.shape)
                need = math.prod(shape) * (item.dtype.itemsize + 4)  # as stored, then as float32
                total += need
                if total > budget:
                    raise MemoryBudgetError(f"{where}: {path}: dataset '{name}' of shape {shape} ({item.dtype}) needs "
                                    f"{need} bytes to read as float32, more than the memory budget of {budget} "
                                    f"bytes")
                arrays.append(np.asarray(item[()], dtype=np.float32))
    except (DataError, FormatError):
        raise
    except MemoryError:
        raise DataError(f"{where}: {path}: not enough memory to read its datasets") from None
    except _H5PY_ERRORS as exc:
        raise DataError(f"{where}: cannot read {path}: {_reason(exc)}") from None
    return arrays

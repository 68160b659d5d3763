"""Random access to an LMDB of Caffe ``Datum`` records, decoded as Caffe's data layers decode them.

:class:`DatumSource` lists the keys once, in LMDB key order (the order of Caffe's cursor), and reads
record ``i`` by key; ``source.image(i)`` is ``(C x H x W array, label)``.

Decoding and the LMDB environment are **not** implemented here: both come from
:mod:`caffe_compat.io.datum_lmdb` (no torch there), so a Data layer, ``iter_lmdb`` and
``compute_image_mean`` on the same database share one environment and one decoder:

* raw Datum: its bytes (uint8) or ``float_data`` (float32) in C-H-W order, as stored;
* encoded Datum (``encoded: true``, JPEG/PNG bytes): :func:`~caffe_compat.io.datum_lmdb.decode_datum`,
  i.e. Caffe's ``DecodeDatumToCVMat``: ``force_color`` -> ``IMREAD_COLOR`` (3 channels BGR),
  ``force_gray`` -> ``IMREAD_GRAYSCALE``, neither -> ``DecodeDatumToCVMatNative`` (flag -1,
  ``IMREAD_UNCHANGED``: the file's own channel count, so a PNG with alpha keeps 4 channels).  The image
  must come out 8-bit (Caffe's DataTransformer CHECKs ``CV_8U``); a 16-bit PNG is a :class:`DataError`.

Caffe's quirk kept: ``force_color``/``force_gray`` only act on encoded records; on a raw record Caffe
merely logs an error and uses the bytes as stored (here: a ``UserWarning`` once per source).

A hostile database is a typed error, never a crash: the environment is opened only after
:func:`caffe_compat.io.lmdb_check.check_lmdb_file` accepted the data file (a truncated or corrupted
``data.mdb`` would otherwise SIGBUS or abort the process inside liblmdb), and every ``lmdb.Error`` or
record that is not a Datum is a :class:`FormatError` naming the database and the record (index and key).

The environment (read-only, ``lock=False``: no lock file is created in the database's folder) is the process-wide one of
:func:`~caffe_compat.io.datum_lmdb.open_lmdb`, opened lazily and again after pickling, so a source can
be handed to ``DataLoader`` workers.  :class:`DatumDataset` wraps it with a
:class:`~caffe_compat.data.transformer.DataTransformer` as a torch ``Dataset``.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from caffe_compat.data.transformer import DataTransformer
from caffe_compat.errors import DataError
from caffe_compat.io.datum_lmdb import (decode_datum, iter_records, lmdb_errors, open_lmdb, parse_datum, record_key,
                                        record_name, warn_force_on_raw)
from caffe_compat.io.safe_open import require_regular_file
from caffe_compat.proto import caffe_pb2


def datum_image(datum: caffe_pb2.Datum, force_color: bool, force_gray: bool, where: str) -> np.ndarray:
    """The Datum's pixels as C x H x W: the shared decoder, :func:`caffe_compat.io.datum_lmdb.decode_datum`."""
    return decode_datum(datum, force_color, force_gray, where)


class DatumSource:
    """Records of an LMDB of Datums by index, in Caffe's cursor (key) order."""

    def __init__(self, path: str | os.PathLike, force_color: bool = False, force_gray: bool = False) -> None:
        self.path = Path(path).absolute()
        require_regular_file(self.path / "data.mdb", f"the LMDB {path}", error=DataError,
                             missing=lambda: f"{path}: not an LMDB database (no data.mdb in {self.path}); Caffe "
                                             f"resolves the source relative to the working directory {Path.cwd()}")
        self.force_color, self.force_gray = bool(force_color), bool(force_gray)
        self._env = None
        self._warned_raw = False
        with self._transaction() as txn:
            self.keys: list[bytes] = [key for _, key, _ in iter_records(self.path, txn)]
        if not self.keys:
            raise DataError(f"{self.path}: the database holds no records")

    def _environment(self):
        if self._env is None:
            self._env = open_lmdb(self.path)
        return self._env

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_env"] = None  # an LMDB environment does not cross processes; reopened on first use
        return state

    def __len__(self) -> int:
        return len(self.keys)

    def _transaction(self):
        with lmdb_errors(f"{self.path} (beginning a read transaction)"):
            return self._environment().begin()

    def _get(self, txn, index: int) -> caffe_pb2.Datum:
        key = self.keys[index]
        with lmdb_errors(record_name(self.path, index, key)):
            value = txn.get(key)
        if value is None:
            raise DataError(f"{record_name(self.path, index, key)}: the key vanished from the database (its keys "
                            f"are not in order: corrupt?)")
        return parse_datum(value, self.path, index, key)

    def datum(self, index: int) -> caffe_pb2.Datum:
        with self._transaction() as txn:
            return self._get(txn, index)

    def labels(self) -> np.ndarray:
        """Every record's label (int64), in key order (reads the whole database once)."""
        out = np.empty(len(self.keys), dtype=np.int64)
        with self._transaction() as txn:
            for i in range(len(self.keys)):
                out[i] = self._get(txn, i).label
        return out

    def image(self, index: int) -> tuple[np.ndarray, int]:
        """``(C x H x W pixels, label)`` of record ``index`` (see the module docstring)."""
        datum = self.datum(index)
        where = record_key(self.path, self.keys[index])
        if not datum.encoded and (self.force_color or self.force_gray) and not self._warned_raw:
            self._warned_raw = True
            warn_force_on_raw(self.path)
        return decode_datum(datum, self.force_color, self.force_gray, where), int(datum.label)


class DatumDataset(Dataset):
    """``(image, label)`` pairs of an LMDB through Caffe's DataTransformer (a torch ``Dataset``).

    ``image`` is the float32 tensor Caffe's Data layer puts in its ``data`` blob for that record,
    ``label`` the Datum's label.  Random crops/mirrors draw from ``numpy.random.RandomState(seed)``,
    re-seeded per DataLoader worker from ``(seed, worker seed)``."""

    def __init__(self, source: DatumSource, transformer: DataTransformer | None = None, seed: int = 0) -> None:
        self.source = source
        self.transformer = transformer or DataTransformer(phase="TEST")
        self.seed = int(seed)
        self._rng = np.random.RandomState(self.seed & 0xFFFFFFFF)
        self._worker = None

    def __len__(self) -> int:
        return len(self.source)

    def _generator(self) -> np.random.RandomState:
        info = get_worker_info()
        if info is not None and self._worker != info.id:
            self._worker = info.id
            self._rng = np.random.RandomState([self.seed & 0xFFFFFFFF, info.seed & 0xFFFFFFFF])
        return self._rng

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        pixels, label = self.source.image(index)
        return torch.from_numpy(self.transformer.transform_chw(pixels, self._generator())), label

    def __getitems__(self, indices) -> list:
        """The batch in one buffer, as :meth:`caffe_compat.data.dataset.ImageRecordDataset.__getitems__`."""
        from caffe_compat.data.dataset import transform_batch

        if type(self).__getitem__ is not DatumDataset.__getitem__:
            return [self[i] for i in indices]
        rng = self._generator()
        return transform_batch(indices, self.source.image,
                               lambda pixels, out: self.transformer.transform_chw(pixels, rng, out=out),
                               lambda pixels: self.transformer.output_shape(*pixels.shape))

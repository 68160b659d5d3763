"""LMDB databases of ``Datum`` records, as Caffe's ``Data`` layer and ``convert_imageset`` use them.

A Datum holds either raw ``uint8`` bytes in C×H×W order (``data``), float values (``float_data``), or
an encoded image file (``encoded: true``; JPEG/PNG bytes).

**One decoder** (:func:`decode_datum`) serves every reader (``iter_lmdb``, ``compute_image_mean``, the
``Data`` layer's :class:`~caffe_compat.data.lmdb_source.DatumSource`), with Caffe's semantics
(``util/io.cpp``, ``data_transformer.cpp``):

* encoded, ``force_color`` -> ``DecodeDatumToCVMat(datum, true)``: ``cv::imdecode(.., IMREAD_COLOR)``,
  3 channels BGR; ``force_gray`` -> ``IMREAD_GRAYSCALE``; neither -> ``DecodeDatumToCVMatNative``:
  ``cv::imdecode(.., -1)``, i.e. ``IMREAD_UNCHANGED``, **not** ``IMREAD_ANYCOLOR``: the file's own
  channel count *including alpha* (an RGBA PNG gives 4 channels), its own bit depth, and the EXIF
  orientation is *not* applied (``IMREAD_ANYCOLOR`` would drop alpha, convert 16-bit to 8-bit and
  rotate by EXIF).  ``compute_image_mean`` decodes with the same native flag (``DecodeDatumNative``).
  The image must then be 8-bit: Caffe CHECKs ``CV_8U`` (DataTransformer, ``CVMatToDatum``), so a
  16-bit PNG is a :class:`DataError` here;
* both flags set: Caffe CHECK-fails "cannot set both force_color and force_gray" -> :class:`FormatError`;
* raw (not encoded): the bytes (uint8) or ``float_data`` (float32) as stored.  ``force_color`` /
  ``force_gray`` do **not** apply: Caffe only logs "force_color and force_gray only for encoded datum"
  and uses the record as it is; the readers here warn once (``UserWarning``) and do the same.

**One environment cache** (:func:`lmdb_environment`, :func:`open_lmdb`): py-lmdb refuses to open the
same database files twice in one process ("already open in this process"), so every reader in this
package goes through this module's cache, keyed by the identity ``(st_dev, st_ino)`` of the data file
(what py-lmdb itself compares, so a database deleted and re-created at the same path is a new entry).
Environments are opened read-only without a lock file (``lock=False``: fixture databases ship without
``lock.mdb`` and readers never write).  :func:`open_lmdb` pins an environment for the rest of the
process (a Data layer reads for its whole life); :func:`lmdb_environment` borrows one for a ``with``
block and closes it afterwards unless it is pinned or still borrowed elsewhere.  A forked child
(``DataLoader`` worker) reuses the environment it inherited: py-lmdb refuses to reopen the files there,
and reading a read-only, lock-free environment through the inherited mapping is safe.
"""

from __future__ import annotations

import os
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from caffe_compat.errors import DataError, FormatError
from caffe_compat.io.protofiles import parse_binary
from caffe_compat.io.safe_open import check_regular_file
from caffe_compat.proto import caffe_pb2


def _lmdb():
    try:
        import lmdb
    except ImportError as exc:  # pragma: no cover - dependency
        raise DataError("reading LMDB needs the 'lmdb' package (pip install lmdb)") from exc
    return lmdb


# identity of the data file -> [environment, borrow count, pinned]
_ENVIRONMENTS: dict[tuple, list] = {}
_ENV_LOCK = threading.RLock()


def _data_file(path: Path) -> tuple[Path, bool]:
    """``(data file, subdir)`` of the database at ``path`` (a folder holding ``data.mdb``, or the
    ``subdir=False`` data file itself); DataError when there is none."""
    if path.is_dir():
        check_regular_file(path / "data.mdb", f"the LMDB {path}")
        if (path / "data.mdb").is_file():
            return path / "data.mdb", True
    else:
        check_regular_file(path, "an LMDB data file")
        if path.is_file():
            return path, False
    raise DataError(f"{path}: not an LMDB database (no data.mdb in {path.absolute()})")


def _acquire(path: str | os.PathLike, pin: bool):
    lmdb = _lmdb()
    path = Path(path)
    data_file, subdir = _data_file(path)
    stat = data_file.stat()
    key = (stat.st_dev, stat.st_ino)
    with _ENV_LOCK:
        entry = _ENVIRONMENTS.get(key)
        if entry is None:
            try:
                env = lmdb.open(str(path), readonly=True, lock=False, readahead=False, max_readers=512,
                                subdir=subdir)
            except lmdb.Error as exc:
                if "already open" in str(exc):
                    raise DataError(f"{path}: this LMDB is already open in this process through another handle "
                                    f"(py-lmdb allows one per process); close it, or open it with "
                                    f"caffe_compat.io.open_lmdb / lmdb_environment") from None
                raise DataError(f"{path}: cannot open the LMDB database ({exc})") from None
            entry = _ENVIRONMENTS[key] = [env, 0, False]
        entry[1] += 1
        entry[2] = entry[2] or pin
        return entry[0], key


def _release(key: tuple) -> None:
    with _ENV_LOCK:
        entry = _ENVIRONMENTS.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] <= 0 and not entry[2]:
            del _ENVIRONMENTS[key]
            entry[0].close()


def open_lmdb(path: str | os.PathLike):
    """The shared read-only environment of the database at ``path``, kept open for the rest of the
    process (see the module docstring)."""
    env, _ = _acquire(path, pin=True)
    return env


@contextmanager
def lmdb_environment(path: str | os.PathLike):
    """Borrow the shared read-only environment of ``path`` for a ``with`` block (see the module docstring)."""
    env, key = _acquire(path, pin=False)
    try:
        yield env
    finally:
        _release(key)


def decode_datum(datum: caffe_pb2.Datum, force_color: bool = False, force_gray: bool = False,
                 source: str = "datum") -> np.ndarray:
    """The Datum's image as C×H×W, decoded as Caffe decodes it (see the module docstring): uint8 for
    byte data and encoded images, float32 for ``float_data``.  ``source`` names the record in errors."""
    if force_color and force_gray:
        raise FormatError(f"{source}: cannot set both force_color and force_gray")
    if datum.encoded:
        import cv2

        flag = cv2.IMREAD_COLOR if force_color else cv2.IMREAD_GRAYSCALE if force_gray else cv2.IMREAD_UNCHANGED
        image = cv2.imdecode(np.frombuffer(datum.data, dtype=np.uint8), flag)
        if image is None:
            raise DataError(f"{source}: OpenCV could not decode the encoded Datum")
        if image.dtype != np.uint8:
            raise DataError(f"{source}: decoded image is {image.dtype}; Caffe needs 8-bit images "
                            f"(DataTransformer/CVMatToDatum CHECK CV_8U)")
        if image.ndim == 2:
            image = image[:, :, None]
        return np.ascontiguousarray(image.transpose(2, 0, 1))
    shape = (datum.channels, datum.height, datum.width)
    count = int(np.prod(shape))
    if count == 0:
        raise DataError(f"{source}: raw Datum with an empty shape {shape}")
    if datum.data:
        if len(datum.data) != count:
            raise DataError(f"{source}: Datum {shape} needs {count} bytes, holds {len(datum.data)}")
        return np.frombuffer(datum.data, dtype=np.uint8).reshape(shape)
    if len(datum.float_data) != count:
        raise DataError(f"{source}: Datum {shape} needs {count} float_data values, holds {len(datum.float_data)}")
    return np.asarray(datum.float_data, dtype=np.float32).reshape(shape)


def warn_force_on_raw(path, stacklevel: int = 3) -> None:
    """Caffe's log line for ``force_color``/``force_gray`` on a raw record, as a UserWarning."""
    warnings.warn(f"{path}: force_color/force_gray only apply to encoded Datums (Caffe logs 'force_color and "
                  f"force_gray only for encoded datum'); raw records are used as stored", stacklevel=stacklevel)


def iter_lmdb(path: str | os.PathLike, force_color: bool = False, force_gray: bool = False,
              decode: bool = True) -> Iterator[tuple[str, np.ndarray | caffe_pb2.Datum, int]]:
    """Yield ``(key, image C×H×W, label)`` in key order (Caffe's cursor order); ``decode=False``
    yields the Datum itself instead of the image.  Decoding and the environment are the shared ones
    (see the module docstring), so this works on a database a Data layer already has open."""
    path = Path(path)
    if force_color and force_gray:
        raise FormatError(f"{path}: cannot set both force_color and force_gray")
    warned = False
    with lmdb_environment(path) as env, env.begin() as txn:
        for key, value in txn.cursor():
            name = key.decode("utf-8", errors="replace")
            where = f"{path}[{name}]"
            datum = parse_binary(bytes(value), caffe_pb2.Datum(), where)
            if not decode:
                yield name, datum, datum.label
                continue
            if not datum.encoded and (force_color or force_gray) and not warned:
                warned = True
                warn_force_on_raw(path)
            yield name, decode_datum(datum, force_color, force_gray, where), datum.label


def lmdb_length(path: str | os.PathLike) -> int:
    """Number of records in the database (through the shared environment cache)."""
    with lmdb_environment(path) as env:
        return env.stat()["entries"]


def make_datum(image: np.ndarray | bytes, label: int, encoded: bool = False) -> caffe_pb2.Datum:
    """A Datum from a C×H×W uint8 array (raw) or from encoded image bytes (``encoded=True``)."""
    datum = caffe_pb2.Datum(label=int(label))
    if encoded:
        datum.data = bytes(image)
        datum.encoded = True
        return datum
    image = np.asarray(image)
    if image.ndim != 3 or image.dtype != np.uint8:
        raise FormatError(f"a raw Datum needs a C×H×W uint8 array, got {image.dtype} {image.shape}")
    datum.channels, datum.height, datum.width = image.shape
    datum.data = np.ascontiguousarray(image).tobytes()
    return datum


class LmdbWriter:
    """A new LMDB of Datum records, built in a temporary folder beside ``path`` and renamed into place by
    :meth:`close` (a reader never sees a half-written database); refuses an existing ``path`` as Caffe's
    ``db::NEW`` does.  Records are committed every 1000, as Caffe's tools commit.  :meth:`abort` (or an
    exception inside ``with``) removes the temporary folder."""

    def __init__(self, path: str | os.PathLike, map_size: int = 1 << 40):
        import tempfile

        lmdb = _lmdb()
        self.target = Path(path)
        if self.target.exists():
            raise DataError(f"{self.target}: already exists (Caffe's convert_imageset refuses too); remove it first")
        self.target.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.", dir=self.target.parent))
        self.count = 0
        try:
            self.env = lmdb.open(str(self.tmp), map_size=map_size)
            self.txn = self.env.begin(write=True)
        except BaseException:
            self.abort()
            raise

    def put(self, key: str, datum: caffe_pb2.Datum) -> None:
        self.txn.put(key.encode("utf-8"), datum.SerializeToString())
        self.count += 1
        if self.count % 1000 == 0:
            self.txn.commit()
            self.txn = self.env.begin(write=True)

    def close(self) -> int:
        """Commit, close and move the database into place; returns the record count."""
        try:
            self.txn.commit()
            self.env.close()
            os.replace(self.tmp, self.target)
        except BaseException:
            self.abort()
            raise
        return self.count

    def abort(self) -> None:
        import shutil

        env = getattr(self, "env", None)
        if env is not None:
            env.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> "LmdbWriter":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()


def write_lmdb(path: str | os.PathLike, records: Iterable[tuple[str, caffe_pb2.Datum]],
               map_size: int = 1 << 40) -> int:
    """Write ``(key, Datum)`` records into a new LMDB (refuses to overwrite); returns the count.

    The database is built in a temporary directory and renamed into place when complete."""
    with LmdbWriter(path, map_size) as writer:
        for key, datum in records:
            writer.put(key, datum)
    return writer.count

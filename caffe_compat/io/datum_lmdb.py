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
* both flags set: Caffe CHECK-fails "cannot set both force_color and force_gray" when it decodes an
  encoded record (``DataTransformer::Transform``/``InferBlobShape``, nowhere else) -> :class:`FormatError`;
* raw (not encoded): the bytes (uint8) or ``float_data`` (float32) as stored.  ``force_color`` /
  ``force_gray`` do **not** apply: Caffe only logs "force_color and force_gray only for encoded datum"
  and uses the record as it is; the readers here warn once (``UserWarning``) and do the same.

**One environment cache** (:func:`lmdb_environment`, :func:`open_lmdb`): py-lmdb refuses to open the
same database files twice in one process ("already open in this process"), so every reader in this
package goes through this module's cache, keyed by the identity ``(st_dev, st_ino)`` of the data file
(what py-lmdb itself compares, so a database deleted and re-created at the same path is a new entry).
Environments are opened read-only without a lock file (``readonly=True, lock=False``: fixture databases ship
without ``lock.mdb``, readers never write, and nothing is created in the database's folder; a ``lock.mdb``
there, whatever it is, is never opened).  :func:`open_lmdb` pins an environment for the rest of the
process (a Data layer reads for its whole life); :func:`lmdb_environment` borrows one for a ``with``
block and closes it afterwards unless it is pinned or still borrowed elsewhere.  A forked child
(``DataLoader`` worker) reuses the environment it inherited: py-lmdb refuses to reopen the files there,
and reading a read-only, lock-free environment through the inherited mapping is safe.

**Hostile databases.** liblmdb memory-maps the data file and trusts it: a truncated ``data.mdb`` would kill
the process with SIGBUS and a corrupted page with an ``abort()``.  So every environment is opened only
after :func:`caffe_compat.io.lmdb_check.check_lmdb_file` has read the meta pages and walked the tree with
``pread`` (its docstring gives the layout and the checks); what it refuses is a :class:`FormatError`
naming the file, the page or record and the field.  Any ``lmdb.Error`` that still comes out of liblmdb
(opening, a transaction, the cursor, a lookup) and a record that is not a valid ``Datum`` protobuf are a
:class:`FormatError` naming the file and the record (its index in key order and its key).
"""

from __future__ import annotations

import math
import os
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from caffe_compat.errors import DataError, FormatError, ParseError, WriteError
from caffe_compat.io.lmdb_check import check_lmdb_file
from caffe_compat.io.protofiles import parse_binary
from caffe_compat.io.safe_open import require_regular_file
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
    subdir = path.is_dir()
    data_file = path / "data.mdb" if subdir else path
    require_regular_file(data_file, f"the LMDB {path}" if subdir else "an LMDB data file", error=DataError,
                         missing=lambda: f"{path}: not an LMDB database (no data.mdb in {path.absolute()})")
    return data_file, subdir


def _acquire(path: str | os.PathLike, pin: bool):
    lmdb = _lmdb()
    path = Path(path)
    data_file, subdir = _data_file(path)
    check_lmdb_file(data_file)  # before liblmdb maps it (remembered per file identity, size and mtime)
    stat = data_file.stat()
    key = (stat.st_dev, stat.st_ino)
    with _ENV_LOCK:
        entry = _ENVIRONMENTS.get(key)
        if entry is None:
            try:
                env = lmdb.open(str(path), readonly=True, lock=False, readahead=False, max_readers=512,
                                subdir=subdir, create=False)
            except lmdb.Error as exc:
                if "already open" in str(exc):
                    raise DataError(f"{path}: this LMDB is already open in this process through another handle "
                                    f"(py-lmdb allows one per process); close it, or open it with "
                                    f"caffe_compat.io.open_lmdb / lmdb_environment") from None
                raise FormatError(f"{data_file}: liblmdb cannot open the database ({type(exc).__name__}: "
                                  f"{exc})") from None
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


@contextmanager
def lmdb_errors(place: str):
    """Turn an ``lmdb.Error`` raised inside the block into a FormatError naming ``place`` (the database,
    and the record when there is one: :func:`record_name`)."""
    lmdb = _lmdb()
    try:
        yield
    except lmdb.Error as exc:
        raise FormatError(f"{place}: corrupt LMDB ({type(exc).__name__}: {exc})") from None


def record_key(path, key: bytes) -> str:
    """``db[00000017]``: how decoding errors name a record (the database and the record's key)."""
    return f"{path}[{key.decode('utf-8', 'replace')}]"


def record_name(path, index: int, key: bytes) -> str:
    """``db[00000017] (record 17)``: the database, the record's key and its index in key order."""
    return f"{record_key(path, key)} (record {index})"


def parse_datum(raw: bytes, path, index: int, key: bytes) -> caffe_pb2.Datum:
    """The ``Datum`` stored under ``key`` (record ``index`` in key order) of the database ``path``; a value
    that is not a valid Datum protobuf is a FormatError naming the file and the record."""
    try:
        return parse_binary(bytes(raw), caffe_pb2.Datum(), record_name(path, index, key))
    except ParseError as exc:
        raise FormatError(str(exc)) from None


def iter_records(path, txn) -> Iterator[tuple[int, bytes, bytes]]:
    """``(index, key, value)`` of every record of the transaction's main database, in key order; an
    ``lmdb.Error`` on the way is a FormatError naming ``path`` and the record it stopped at."""
    cursor = txn.cursor()
    index, where = 0, f"{path} (record 0)"
    with lmdb_errors(where):
        more = cursor.first()
    while more:
        with lmdb_errors(where):
            key, value = bytes(cursor.key()), bytes(cursor.value())
        yield index, key, value
        index, where = index + 1, f"{path} (record {index + 1}, after key {key.decode('utf-8', 'replace')!r})"
        with lmdb_errors(where):
            more = cursor.next()


def decode_datum(datum: caffe_pb2.Datum, force_color: bool = False, force_gray: bool = False,
                 source: str = "datum") -> np.ndarray:
    """The Datum's image as C×H×W, decoded as Caffe decodes it (see the module docstring): uint8 for
    byte data and encoded images, float32 for ``float_data``.  ``source`` names the record in errors.
    An encoded image of 2 to 4 channels comes as OpenCV split it (:func:`caffe_compat.io.planes.chw_planes`):
    each plane contiguous, the planes not one block (``np.ascontiguousarray`` makes one)."""
    if datum.encoded:
        if force_color and force_gray:  # Caffe CHECKs this only where it decodes an encoded Datum
            raise FormatError(f"{source}: cannot set both force_color and force_gray")
        import cv2

        from caffe_compat.io.image_header import check_decode_budget

        flag = cv2.IMREAD_COLOR if force_color else cv2.IMREAD_GRAYSCALE if force_gray else cv2.IMREAD_UNCHANGED
        check_decode_budget(datum.data, f"{source}: the encoded Datum", flag)
        try:
            image = cv2.imdecode(np.frombuffer(datum.data, dtype=np.uint8), flag) if datum.data else None
        except cv2.error as exc:
            raise DataError(f"{source}: OpenCV could not decode the encoded Datum ({cv_reason(exc)})") from None
        if image is None:
            raise DataError(f"{source}: OpenCV could not decode the encoded Datum"
                            + ("" if datum.data else " (its data field is empty)"))
        if image.dtype != np.uint8:
            raise DataError(f"{source}: decoded image is {image.dtype}; Caffe needs 8-bit images "
                            f"(DataTransformer/CVMatToDatum CHECK CV_8U)")
        from caffe_compat.io.planes import chw_planes

        return chw_planes(image)  # C x H x W, the planes split by OpenCV
    shape = (datum.channels, datum.height, datum.width)
    if min(shape) < 0:
        raise DataError(f"{source}: raw Datum with a negative shape {shape} (channels, height, width)")
    count = math.prod(shape)
    if count == 0:
        raise DataError(f"{source}: raw Datum with an empty shape {shape}")
    if datum.data:
        if len(datum.data) != count:
            raise DataError(f"{source}: Datum {shape} needs {count} bytes, holds {len(datum.data)}")
        return np.frombuffer(datum.data, dtype=np.uint8).reshape(shape)
    if len(datum.float_data) != count:
        raise DataError(f"{source}: Datum {shape} needs {count} float_data values, holds {len(datum.float_data)}")
    return np.asarray(datum.float_data, dtype=np.float32).reshape(shape)


def cv_reason(exc) -> str:
    """The last line of an OpenCV error (``cv2.error`` messages span several lines)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


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
    with lmdb_environment(path) as env:
        with lmdb_errors(f"{path} (beginning a read transaction)"):
            txn = env.begin()
        with txn:
            for index, key, value in iter_records(path, txn):
                datum = parse_datum(value, path, index, key)
                if not decode:
                    yield key.decode("utf-8", errors="replace"), datum, datum.label
                    continue
                if not datum.encoded and (force_color or force_gray) and not warned:
                    warned = True
                    warn_force_on_raw(path)
                yield (key.decode("utf-8", errors="replace"),
                       decode_datum(datum, force_color, force_gray, record_key(path, key)), datum.label)


def lmdb_length(path: str | os.PathLike) -> int:
    """Number of records in the database (through the shared environment cache)."""
    with lmdb_environment(path) as env, lmdb_errors(f"{path} (the database statistics)"):
        return env.stat()["entries"]


def fits_datum_label(value: int) -> bool:
    """Whether ``value`` fits a Datum's label, Caffe's ``int`` (int32)."""
    return -2 ** 31 <= value < 2 ** 31


def datum_label(label) -> int:
    """``label`` as a Datum's label; a FormatError outside int32 (protobuf would raise its own ValueError)."""
    value = int(label)
    if not fits_datum_label(value):
        raise FormatError(f"a Datum's label is an int32, got {label}")
    return value


def make_datum(image: np.ndarray | bytes, label: int, encoded: bool = False) -> caffe_pb2.Datum:
    """A Datum from a C×H×W uint8 array (raw) or from encoded image bytes (``encoded=True``), with the fields
    Caffe's convert_imageset sets: a raw one as ``CVMatToDatum`` fills it (``channels``, ``height``,
    ``width``, ``data`` and ``encoded: false`` set explicitly, so serialized), then the label; an encoded one
    as ``ReadFileToDatum`` (``data``, ``label``, ``encoded: true``).  The serialized records are Caffe's bytes."""
    datum = caffe_pb2.Datum(label=datum_label(label))
    if encoded:
        datum.data = bytes(image)
        datum.encoded = True
        return datum
    image = np.asarray(image)
    if image.ndim != 3 or image.dtype != np.uint8:
        raise FormatError(f"a raw Datum needs a C×H×W uint8 array, got {image.dtype} {image.shape}")
    datum.channels, datum.height, datum.width = image.shape
    datum.data = np.ascontiguousarray(image).tobytes()
    datum.encoded = False  # CVMatToDatum's set_encoded(false): present in the record
    return datum


class LmdbWriter:
    """A new LMDB of Datum records, built in a temporary folder beside ``path`` and renamed into place by
    :meth:`close` (a reader never sees a half-written database); refuses an existing ``path`` as Caffe's
    ``db::NEW`` does.  Records are committed every 1000, as Caffe's tools commit.  :meth:`abort` (or an
    exception inside ``with``) removes the temporary folder.

    ``map_size`` (1 TiB by default, as Caffe's 1 TB ``LMDB_MAP_SIZE``) is address space liblmdb maps, not
    memory; where the process may not map that much (``ulimit -v``, a container's limit) the map is halved
    until it opens, and grown (doubled, the uncommitted records written again) whenever it fills."""

    def __init__(self, path: str | os.PathLike, map_size: int = 1 << 40):
        import tempfile

        lmdb = _lmdb()
        self.target = Path(path)
        if self.target.exists():
            raise DataError(f"{self.target}: already exists (Caffe's convert_imageset refuses too); remove it first")
        self.target.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.", dir=self.target.parent))
        self.count = 0
        self.pending: list[tuple[bytes, bytes]] = []  # since the last commit: written again if the map grows
        try:
            while True:
                try:
                    self.env = lmdb.open(str(self.tmp), map_size=map_size)
                    break
                except lmdb.MemoryError:
                    if map_size <= 1 << 20:
                        raise WriteError(f"{self.target}: cannot map even {map_size} bytes for the new LMDB "
                                         f"(address space limit)") from None
                    map_size //= 2
            self.map_size = map_size
            self.txn = self.env.begin(write=True)
        except BaseException:
            self.abort()
            raise

    def put(self, key: str, datum: caffe_pb2.Datum) -> None:
        record = (key.encode("utf-8"), datum.SerializeToString())
        self.pending.append(record)
        self._put(record)
        self.count += 1
        if self.count % 1000 == 0:
            self._commit()
            self.txn = self.env.begin(write=True)

    def _put(self, record) -> None:
        lmdb = _lmdb()
        try:
            self.txn.put(*record)
        except lmdb.MapFullError:
            self._grow()

    def _commit(self) -> None:
        lmdb = _lmdb()
        try:
            self.txn.commit()
        except lmdb.MapFullError:
            self._grow()
            self.txn.commit()
        self.pending = []

    def _grow(self) -> None:
        """The map is full: abort the transaction, double the map and write the uncommitted records again."""
        lmdb = _lmdb()
        self.txn.abort()
        while True:
            self.map_size *= 2
            try:
                self.env.set_mapsize(self.map_size)
            except lmdb.MemoryError:
                raise WriteError(f"{self.target}: the new LMDB needs more than the {self.map_size // 2} bytes of "
                                 f"address space this process may map") from None
            self.txn = self.env.begin(write=True)
            try:
                for record in self.pending:
                    self.txn.put(*record)
                return
            except lmdb.MapFullError:
                self.txn.abort()

    def close(self) -> int:
        """Commit, close and move the database into place; returns the record count."""
        try:
            self._commit()
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

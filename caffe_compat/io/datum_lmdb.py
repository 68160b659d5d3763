"""LMDB databases of ``Datum`` records, as Caffe's ``Data`` layer and ``convert_imageset`` use them.

A Datum holds either raw ``uint8`` bytes in C×H×W order (``data``), float values (``float_data``), or
an encoded image file (``encoded: true``; JPEG/PNG bytes).  Encoded images are decoded with OpenCV
exactly like Caffe: BGR channel order; ``force_color`` → ``IMREAD_COLOR``, ``force_gray`` →
``IMREAD_GRAYSCALE``, otherwise the native channel count (``IMREAD_ANYCOLOR``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from caffe_compat.errors import DataError, FormatError
from caffe_compat.io.protofiles import parse_binary
from caffe_compat.proto import caffe_pb2


def _lmdb():
    try:
        import lmdb
    except ImportError as exc:  # pragma: no cover - dependency
        raise DataError("reading LMDB needs the 'lmdb' package (pip install lmdb)") from exc
    return lmdb


def decode_datum(datum: caffe_pb2.Datum, force_color: bool = False, force_gray: bool = False,
                 source: str = "datum") -> np.ndarray:
    """The Datum's image as a C×H×W array: uint8 for byte data and encoded images, float32 for
    ``float_data``."""
    if datum.encoded:
        import cv2

        flag = cv2.IMREAD_COLOR if force_color else cv2.IMREAD_GRAYSCALE if force_gray else cv2.IMREAD_ANYCOLOR
        image = cv2.imdecode(np.frombuffer(datum.data, dtype=np.uint8), flag)
        if image is None:
            raise FormatError(f"{source}: encoded Datum could not be decoded by OpenCV")
        if image.ndim == 2:
            image = image[:, :, None]
        return np.ascontiguousarray(image.transpose(2, 0, 1))
    shape = (datum.channels, datum.height, datum.width)
    count = int(np.prod(shape))
    if datum.data:
        if len(datum.data) != count:
            raise FormatError(f"{source}: Datum {shape} needs {count} bytes, holds {len(datum.data)}")
        array = np.frombuffer(datum.data, dtype=np.uint8).reshape(shape)
    else:
        if len(datum.float_data) != count:
            raise FormatError(f"{source}: Datum {shape} needs {count} floats, holds {len(datum.float_data)}")
        array = np.asarray(datum.float_data, dtype=np.float32).reshape(shape)
    if datum.channels == 3 and force_gray or datum.channels == 1 and force_color:
        raise FormatError(f"{source}: force_color/force_gray apply to encoded Datums only "
                          f"(this one holds raw {datum.channels}-channel data)")
    return array


def iter_lmdb(path: str | os.PathLike, force_color: bool = False, force_gray: bool = False,
              decode: bool = True) -> Iterator[tuple[str, np.ndarray | caffe_pb2.Datum, int]]:
    """Yield ``(key, image C×H×W, label)`` in key order (Caffe's cursor order); ``decode=False``
    yields the Datum itself instead of the image."""
    lmdb = _lmdb()
    path = Path(path)
    if not (path / "data.mdb").exists() and not path.is_file():
        raise DataError(f"{path}: not an LMDB database (no data.mdb)")
    env = lmdb.open(str(path), readonly=True, lock=False, readahead=False, subdir=path.is_dir())
    try:
        with env.begin() as txn:
            for key, value in txn.cursor():
                name = key.decode("utf-8", errors="replace")
                datum = parse_binary(bytes(value), caffe_pb2.Datum(), f"{path}[{name}]")
                if decode:
                    yield name, decode_datum(datum, force_color, force_gray, f"{path}[{name}]"), datum.label
                else:
                    yield name, datum, datum.label
    finally:
        env.close()


def lmdb_length(path: str | os.PathLike) -> int:
    lmdb = _lmdb()
    env = lmdb.open(str(path), readonly=True, lock=False)
    try:
        return env.stat()["entries"]
    finally:
        env.close()


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


def write_lmdb(path: str | os.PathLike, records: Iterable[tuple[str, caffe_pb2.Datum]],
               map_size: int = 1 << 40) -> int:
    """Write ``(key, Datum)`` records into a new LMDB (refuses to overwrite); returns the count.

    The database is built in a temporary directory and renamed into place when complete."""
    import shutil
    import tempfile

    lmdb = _lmdb()
    target = Path(path)
    if target.exists():
        raise DataError(f"{target}: already exists (Caffe's convert_imageset refuses too); remove it first")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    count = 0
    try:
        env = lmdb.open(str(tmp), map_size=map_size)
        txn = env.begin(write=True)
        for key, datum in records:
            txn.put(key.encode("utf-8"), datum.SerializeToString())
            count += 1
            if count % 1000 == 0:
                txn.commit()
                txn = env.begin(write=True)
        txn.commit()
        env.close()
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return count

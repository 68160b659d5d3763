"""Random access to an LMDB of Caffe ``Datum`` records, decoded as Caffe's data layers decode them.

:class:`DatumSource` lists the keys once, in LMDB key order (the order of Caffe's cursor), and reads
record ``i`` by key; ``source.image(i)`` is ``(C x H x W array, label)``:

* raw Datum: its bytes (uint8) or ``float_data`` (float32) in C-H-W order, as stored;
* encoded Datum (``encoded: true``, JPEG/PNG bytes): decoded with ``cv2.imdecode`` like Caffe's
  ``DecodeDatumToCVMat``: ``force_color`` -> ``IMREAD_COLOR`` (3 channels BGR), ``force_gray`` ->
  ``IMREAD_GRAYSCALE``, neither -> ``DecodeDatumToCVMatNative`` (flag -1, ``IMREAD_UNCHANGED``: the
  file's own channel count, so a PNG with alpha keeps 4 channels).  The image must come out 8-bit
  (Caffe's DataTransformer CHECKs ``CV_8U``); a 16-bit PNG is a :class:`DataError`.

Caffe's quirk kept: ``force_color``/``force_gray`` only act on encoded records; on a raw record Caffe
merely logs an error and uses the bytes as stored (here: a ``UserWarning`` once per source).

The environment is opened read-only without a lock file (``lock=False``: fixture databases ship
without ``lock.mdb`` and Caffe readers never write), lazily, once per process and database (shared by
every source on it; py-lmdb refuses a second handle), and again after pickling, so a source can be
handed to ``DataLoader`` workers.  :class:`DatumDataset` wraps it with a
:class:`~caffe_compat.data.transformer.DataTransformer` as a torch ``Dataset``.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from caffe_compat.data.transformer import DataTransformer
from caffe_compat.errors import DataError, FormatError
from caffe_compat.io.protofiles import parse_binary
from caffe_compat.proto import caffe_pb2


def _lmdb():
    try:
        import lmdb
    except ImportError as exc:  # pragma: no cover - a declared dependency
        raise DataError("reading LMDB needs the 'lmdb' package (pip install lmdb)") from exc
    return lmdb


_ENVIRONMENTS: dict[tuple[int, str], object] = {}


def _open_environment(path: Path):
    """One read-only environment per database and process (py-lmdb refuses to open one twice)."""
    key = (os.getpid(), str(path))
    env = _ENVIRONMENTS.get(key)
    if env is None:
        env = _lmdb().open(str(path), readonly=True, lock=False, readahead=False, max_readers=512)
        _ENVIRONMENTS[key] = env
    return env


def decode_encoded(data: bytes, force_color: bool, force_gray: bool, where: str) -> np.ndarray:
    """Encoded image bytes -> C x H x W uint8, with Caffe's imdecode flags (see the module docstring)."""
    import cv2

    if force_color and force_gray:
        raise FormatError(f"{where}: cannot set both force_color and force_gray")
    flag = cv2.IMREAD_COLOR if force_color else cv2.IMREAD_GRAYSCALE if force_gray else cv2.IMREAD_UNCHANGED
    image = cv2.imdecode(np.frombuffer(data, dtype=np.uint8), flag)
    if image is None:
        raise DataError(f"{where}: OpenCV could not decode the encoded Datum")
    if image.dtype != np.uint8:
        raise DataError(f"{where}: decoded image is {image.dtype}; Caffe's DataTransformer needs 8-bit images")
    if image.ndim == 2:
        image = image[:, :, None]
    return np.ascontiguousarray(image.transpose(2, 0, 1))


def datum_image(datum: caffe_pb2.Datum, force_color: bool, force_gray: bool, where: str) -> np.ndarray:
    """The Datum's pixels as C x H x W (uint8 for bytes and encoded images, float32 for float_data)."""
    if datum.encoded:
        return decode_encoded(datum.data, force_color, force_gray, where)
    shape = (datum.channels, datum.height, datum.width)
    count = int(np.prod(shape))
    if count == 0:
        raise DataError(f"{where}: raw Datum with an empty shape {shape}")
    if datum.data:
        if len(datum.data) != count:
            raise DataError(f"{where}: Datum {shape} needs {count} bytes, holds {len(datum.data)}")
        return np.frombuffer(datum.data, dtype=np.uint8).reshape(shape)
    if len(datum.float_data) != count:
        raise DataError(f"{where}: Datum {shape} needs {count} float_data values, holds {len(datum.float_data)}")
    return np.asarray(datum.float_data, dtype=np.float32).reshape(shape)


class DatumSource:
    """Records of an LMDB of Datums by index, in Caffe's cursor (key) order."""

    def __init__(self, path: str | os.PathLike, force_color: bool = False, force_gray: bool = False) -> None:
        self.path = Path(path).absolute()
        if not (self.path / "data.mdb").is_file():
            raise DataError(f"{path}: not an LMDB database (no data.mdb in {self.path}); Caffe resolves the "
                            f"source relative to the working directory {Path.cwd()}")
        if force_color and force_gray:
            raise FormatError(f"{path}: cannot set both force_color and force_gray")
        self.force_color, self.force_gray = bool(force_color), bool(force_gray)
        self._env = None
        self._warned_raw = False
        with self._environment().begin() as txn:
            self.keys: list[bytes] = [bytes(k) for k in txn.cursor().iternext(keys=True, values=False)]
        if not self.keys:
            raise DataError(f"{self.path}: the database holds no records")

    def _environment(self):
        if self._env is None:
            self._env = _open_environment(self.path)
        return self._env

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_env"] = None  # an LMDB environment does not cross processes; reopened on first use
        return state

    def __len__(self) -> int:
        return len(self.keys)

    def datum(self, index: int) -> caffe_pb2.Datum:
        key = self.keys[index]
        with self._environment().begin() as txn:
            value = txn.get(key)
        if value is None:
            raise DataError(f"{self.path}: key {key!r} vanished from the database")
        return parse_binary(bytes(value), caffe_pb2.Datum(), f"{self.path}[{key.decode('utf-8', 'replace')}]")

    def labels(self) -> np.ndarray:
        """Every record's label (int64), in key order (reads the whole database once)."""
        out = np.empty(len(self.keys), dtype=np.int64)
        with self._environment().begin() as txn:
            for i, key in enumerate(self.keys):
                datum = parse_binary(bytes(txn.get(key)), caffe_pb2.Datum(), f"{self.path}[{i}]")
                out[i] = datum.label
        return out

    def image(self, index: int) -> tuple[np.ndarray, int]:
        """``(C x H x W pixels, label)`` of record ``index`` (see the module docstring)."""
        datum = self.datum(index)
        where = f"{self.path}[{self.keys[index].decode('utf-8', 'replace')}]"
        if not datum.encoded and (self.force_color or self.force_gray) and not self._warned_raw:
            self._warned_raw = True
            warnings.warn(f"{self.path}: force_color/force_gray only apply to encoded Datums (Caffe logs "
                          f"'force_color and force_gray only for encoded datum'); raw records are used as stored",
                          stacklevel=2)
        return datum_image(datum, self.force_color, self.force_gray, where), int(datum.label)


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

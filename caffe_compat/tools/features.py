"""``extract_features``: named blobs of a pretrained net over N mini-batches, written to files.

As Caffe's ``tools/extract_features.cpp``: the net is built in the TEST phase with the weights, forwarded
``num_mini_batches`` times (data layers advance; Input blobs hold zeros or the values fed), and every
sample ``n`` of each named blob goes to that blob's dataset, in order.  Formats:

* ``lmdb`` — Caffe's own: one ``Datum`` per sample with ``float_data`` = the sample's values and
  ``channels``/``height``/``width`` = the blob's legacy ``channels()``/``height()``/``width()`` (axes 1, 2,
  3; 1 where the blob has fewer axes), keys ``caffe::format_int(index, 10)`` — the sample index
  zero-padded to 10 digits (``0000000000``, ``0000000001``, ...) — so Caffe's Data layer and this
  project's :func:`~caffe_compat.io.iter_lmdb` read them back in order.  Like Caffe's ``db::NEW``, an
  existing database is refused; ``leveldb`` is not supported;
* ``npy`` — one float32 array ``(samples, *blob.shape[1:])``;
* ``hdf5`` — one float32 dataset named after the blob, same shape (needs ``h5py``).

Every output is written to a temporary file (or folder) beside its target and renamed when complete.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from caffe_compat.errors import CaffeCompatError, DataError, FormatError, WriteError
from caffe_compat.tools.netsetup import as_tensors

__all__ = ["FORMATS", "ExtractedFeature", "check_request", "datum_key", "extract_features"]

FORMATS = ("lmdb", "npy", "hdf5")


def datum_key(index: int) -> str:
    """Caffe's key of sample ``index`` (``caffe::format_int(index, 10)``)."""
    return f"{int(index):010d}"


@dataclass
class ExtractedFeature:
    blob: str
    path: str
    count: int
    shape: tuple[int, ...]  # of one sample


def _legacy_chw(shape: tuple[int, ...], blob: str) -> tuple[int, int, int]:
    if len(shape) > 4:
        raise FormatError(f"blob '{blob}' has {len(shape)} axes: a Datum holds at most 4 (N, C, H, W)")
    dims = list(shape[1:]) + [1] * (4 - len(shape))
    return dims[0], dims[1], dims[2]


class _LmdbSink:
    def __init__(self, path: Path, blob: str, total: int, shape: tuple[int, ...]):
        from caffe_compat.io.datum_lmdb import LmdbWriter

        self.chw = _legacy_chw((total, *shape), blob)
        self.writer = LmdbWriter(path)

    def add(self, batch: np.ndarray, start: int) -> None:
        from caffe_compat.proto import caffe_pb2

        for n, sample in enumerate(batch.reshape(batch.shape[0], -1)):
            datum = caffe_pb2.Datum(channels=self.chw[0], height=self.chw[1], width=self.chw[2])
            datum.float_data.extend(sample.tolist())
            self.writer.put(datum_key(start + n), datum)

    def close(self) -> None:
        self.writer.close()

    def abort(self) -> None:
        self.writer.abort()


def _h5py():
    try:
        import h5py
    except ImportError:
        raise CaffeCompatError("HDF5 output needs the h5py package (pip install h5py); or write lmdb or npy") from None
    return h5py


# What h5py and numpy's memory-mapped writer raise when the output cannot be made or written.
_SINK_ERRORS = (OSError, ValueError, RuntimeError, TypeError, OverflowError)


class _FileSink:
    """npy (a memory-mapped ``.npy``) or HDF5, written into a temporary file renamed by :meth:`close`."""

    def __init__(self, path: Path, blob: str, total: int, shape: tuple[int, ...], kind: str):
        from caffe_compat.io.atomic import atomic_path

        self.kind = kind
        h5py = _h5py() if kind == "hdf5" else None
        self.context = atomic_path(path)
        tmp = self.context.__enter__()
        self.path, self.blob = path, blob
        try:
            try:
                if kind == "npy":
                    self.file = None
                    self.array = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=(total, *shape))
                else:
                    self.file = h5py.File(tmp, "w")
                    self.array = self.file.create_dataset(blob, shape=(total, *shape), dtype="float32")
            except _SINK_ERRORS as exc:  # h5py/numpy on a full disk, a bad name, a size the file system refuses
                raise WriteError(f"{path}: cannot create the {kind} output of blob '{blob}' "
                                 f"({type(exc).__name__}: {exc})") from None
        except BaseException as exc:
            self.context.__exit__(type(exc), exc, exc.__traceback__)
            raise

    def add(self, batch: np.ndarray, start: int) -> None:
        try:
            self.array[start:start + batch.shape[0]] = batch
        except _SINK_ERRORS as exc:
            raise WriteError(f"{self.path}: cannot write rows {start}.. of blob '{self.blob}' "
                             f"({type(exc).__name__}: {exc})") from None

    def _finish(self) -> None:
        if self.file is not None:
            self.file.close()
        else:
            self.array.flush()
            del self.array

    def close(self) -> None:
        self._finish()
        self.context.__exit__(None, None, None)

    def abort(self) -> None:
        try:
            self._finish()
        finally:
            error = CaffeCompatError("aborted")
            try:
                self.context.__exit__(CaffeCompatError, error, None)
            except CaffeCompatError:
                pass


def check_request(net, blob_names, datasets, num_mini_batches: int, db_type: str):
    """The arguments of :func:`extract_features` checked before anything runs (as Caffe's CHECKs):
    ``(format, blob names, dataset paths, batches)``; a CaffeCompatError names what is wrong."""
    blob_names, datasets = list(blob_names), [Path(d) for d in datasets]
    kind = str(db_type).lower()
    kind = {"h5": "hdf5", "hdf5": "hdf5"}.get(kind, kind)
    if kind == "leveldb":
        raise CaffeCompatError("db_type leveldb is not supported; use lmdb (Caffe's default), npy or hdf5")
    if kind not in FORMATS:
        raise CaffeCompatError(f"db_type must be one of {', '.join(FORMATS)}, got {db_type!r}")
    if len(blob_names) != len(datasets) or not blob_names:
        raise CaffeCompatError(f"the number of blob names and dataset names must be equal and non-zero: "
                               f"{len(blob_names)} blob(s), {len(datasets)} dataset(s)")
    if len(set(map(str, datasets))) != len(datasets):
        raise CaffeCompatError("two blobs are written to the same dataset")
    for name in blob_names:
        if name not in net.blob_shapes:
            raise FormatError(f"Unknown feature blob name {name} in the network '{net.name}'")
    num_mini_batches = int(num_mini_batches)
    if num_mini_batches < 1:
        raise CaffeCompatError(f"num_mini_batches must be >= 1, got {num_mini_batches}")
    if kind == "hdf5":
        _h5py()
    if kind != "lmdb":  # each file's target checked before any is written: a later one refused left the first
        from caffe_compat.errors import WriteError
        from caffe_compat.io.atomic import refuse_special_target

        for path in datasets:
            if path.is_dir():
                raise WriteError(f"{path}: cannot write (Is a directory)")
            refuse_special_target(path)
    if kind == "lmdb":
        for path in datasets:
            if path.exists():
                raise DataError(f"{path}: already exists (Caffe's extract_features opens a NEW database); "
                                f"remove it first")
    return kind, blob_names, datasets, num_mini_batches


@torch.no_grad()
def extract_features(net, blob_names, datasets, num_mini_batches: int, db_type: str = "lmdb",
                     inputs: dict | None = None, on_batch: Callable[[int], None] | None = None
                     ) -> list[ExtractedFeature]:
    """Write ``blob_names[i]`` of ``num_mini_batches`` forward passes to ``datasets[i]`` in ``db_type``
    (``lmdb``, ``npy`` or ``hdf5``; module docstring).  ``inputs``: ``{blob: array}`` fed to Input blobs at
    every pass.  ``on_batch(i)`` is called after batch ``i`` (1-based).  Returns one record per blob."""
    kind, blob_names, datasets, num_mini_batches = check_request(net, blob_names, datasets, num_mini_batches,
                                                                 db_type)
    fed = as_tensors(inputs or {}, net._device())
    sinks: list = []
    shapes: list[tuple[int, ...]] = []
    written = [0] * len(blob_names)
    try:
        for b in range(num_mini_batches):
            blobs = net(**fed)
            for i, name in enumerate(blob_names):
                value = blobs[name].detach().float().cpu().numpy()
                if value.ndim == 0:
                    value = value.reshape(1)
                if b == 0:
                    shapes.append(tuple(value.shape[1:]))
                    total = value.shape[0] * num_mini_batches
                    if kind == "lmdb":
                        sinks.append(_LmdbSink(datasets[i], name, total, shapes[i]))
                    else:
                        sinks.append(_FileSink(datasets[i], name, total, shapes[i], kind))
                elif tuple(value.shape) != (written[i] // b, *shapes[i]):
                    raise FormatError(f"blob '{name}' changed shape between batches: {value.shape} at batch {b}")
                sinks[i].add(value, written[i])
                written[i] += value.shape[0]
            if on_batch is not None:
                on_batch(b + 1)
        while sinks:
            sinks[0].close()
            sinks.pop(0)
    except BaseException:
        for sink in sinks:
            try:
                sink.abort()
            except Exception:  # the first error is the one to report
                pass
        raise
    return [ExtractedFeature(name, os.fspath(path), count, shape)
            for name, path, count, shape in zip(blob_names, datasets, written, shapes)]

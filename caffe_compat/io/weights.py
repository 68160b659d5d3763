"""The weights of a caffemodel without a NetParameter: layer names and blob arrays, read in place.

``read_weights(path)`` returns, in file order, ``(layer name, [StoredBlob, ...])`` for every layer of
a binary caffemodel, which is all that Caffe's ``Net::CopyTrainedLayersFrom`` looks at.  A caffemodel
is mostly one packed float array per blob; protobuf's parser copies each of them into its arena and
numpy copies them again, so for a model of tens of MB most of the load time is spent faulting in
fresh memory.  Here the file is memory-mapped and only the message *framing* is decoded (protobuf's
wire format: a varint key ``field << 3 | wire type``, then a varint, 4 or 8 bytes, or a varint length
and that many bytes); each packed ``data``/``double_data`` run becomes a read-only numpy view of the
mapped file, and the one copy is the caller's copy into its own tensors.

Fields used (names and numbers of caffe.proto): NetParameter ``layer`` = 100 (LayerParameter:
``name`` = 1, ``blobs`` = 7); BlobProto ``num, channels, height, width`` = 1-4, ``data`` = 5 (packed
float), ``double_data`` = 8 (packed double), ``shape`` = 7 (BlobShape ``dim`` = 1, packed int64).
Protobuf's merge rules are kept: a repeated field may come in several runs (concatenated), the last
``name`` wins, ``shape`` messages merge.  Anything else — legacy ``layers`` (V1/V0, which need
Caffe's upgrade), a text file, unpacked floats, groups, a truncated or corrupt file — goes through
:func:`caffe_compat.io.read_net` instead, which upgrades the net and raises the precise error.
``double_data`` wins over ``data`` when present, as in ``Blob::FromProto``.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from caffe_compat.io.blobs import blob_shape, is_legacy
from caffe_compat.io.path_or_text import is_existing_file
from caffe_compat.io.protofiles import looks_binary
from caffe_compat.io.safe_open import PROTOBUF_MAX_BYTES, check_regular_file
from caffe_compat.proto import caffe_pb2

_VARINT, _FIXED64, _BYTES, _FIXED32 = 0, 1, 2, 5
_NET_LAYER, _NET_LEGACY_LAYERS = 100, 2
_LAYER_NAME, _LAYER_BLOBS = 1, 7
_BLOB_LEGACY_DIMS = (1, 2, 3, 4)
_BLOB_DATA, _BLOB_SHAPE, _BLOB_DOUBLE_DATA = 5, 7, 8
_SHAPE_DIM = 1


@dataclass(frozen=True)
class StoredBlob:
    """One BlobProto of a caffemodel: its shape as stored and its values (flat, float32 or float64).

    ``legacy``: the shape is the 4-D ``num, channels, height, width`` (compared with a net's shape
    after padding that with leading 1s, as ``Blob::ShapeEquals`` does)."""

    shape: tuple[int, ...]
    legacy: bool
    values: np.ndarray

    def fits(self, target: tuple[int, ...]) -> bool:
        """Caffe's ``Blob::ShapeEquals`` against a net blob of shape ``target``."""
        target = tuple(int(d) for d in target)
        if not self.legacy:
            return self.shape == target
        return len(target) <= 4 and (1,) * (4 - len(target)) + target == self.shape


class _Fallback(Exception):
    """The file needs protobuf's full parser (and possibly Caffe's upgrade)."""


def read_weights(model) -> list[tuple[str, list[StoredBlob]]]:
    """``[(layer name, blobs)]`` of a caffemodel path, in file order; also accepts what
    :func:`~caffe_compat.io.read_net` accepts (a NetParameter, bytes, prototxt text).

    The arrays of a binary V2 caffemodel file are read-only views of the memory-mapped file: copy
    them (``np.array``) to keep them past a rewrite of that file in place (an atomic rename, as every
    writer of this project does, leaves the mapped old file intact)."""
    from caffe_compat.io.netfiles import read_net

    if isinstance(model, caffe_pb2.NetParameter):
        return from_netparameter(model)
    if is_existing_file(model):
        try:
            return _read_mapped(Path(model))
        except _Fallback:
            pass
    return from_netparameter(read_net(model))


def from_netparameter(net: caffe_pb2.NetParameter) -> list[tuple[str, list[StoredBlob]]]:
    """The same list from a parsed (V2) NetParameter; the arrays are copies."""
    return [(layer.name, [_stored(blob) for blob in layer.blobs]) for layer in net.layer]


def _stored(blob: caffe_pb2.BlobProto) -> StoredBlob:
    values = (np.asarray(blob.double_data, dtype=np.float64) if len(blob.double_data)
              else np.asarray(blob.data, dtype=np.float32))
    return StoredBlob(blob_shape(blob), is_legacy(blob), values)


def _read_mapped(path: Path) -> list[tuple[str, list[StoredBlob]]]:
    check_regular_file(path, None, PROTOBUF_MAX_BYTES)  # Caffe's reader stops at protobuf's 2 GB too
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size == 0:
                raise _Fallback
            if os.name == "posix":  # MAP_POPULATE: map the cached pages at once, not one fault at a time
                flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                view = mmap.mmap(handle.fileno(), 0, flags=flags, prot=mmap.PROT_READ)
            else:
                view = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError:
        raise _Fallback from None  # read_net reads it, or names the file and the reason
    if not looks_binary(view[:65536]):
        raise _Fallback
    try:
        return _net_layers(view, 0, size)
    except (IndexError, ValueError, UnicodeDecodeError):
        raise _Fallback from None  # truncated or corrupt: read_net names the problem


def _varint(buf, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")


def _fields(buf, pos: int, end: int):
    """``(field number, wire type, value)`` of the message in ``buf[pos:end]``; the value of a
    length-delimited field is its ``(start, stop)``, of a varint its integer, of fixed fields None."""
    while pos < end:
        key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == _VARINT:
            value, pos = _varint(buf, pos)
        elif wire == _BYTES:
            length, pos = _varint(buf, pos)
            value, pos = (pos, pos + length), pos + length
        elif wire == _FIXED32:
            value, pos = None, pos + 4
        elif wire == _FIXED64:
            value, pos = None, pos + 8
        else:
            raise _Fallback  # groups: not in caffe.proto
        if pos > end or field == 0:
            raise ValueError("field runs past its message")
        yield field, wire, value


def _net_layers(buf, pos: int, end: int) -> list[tuple[str, list[StoredBlob]]]:
    layers = []
    for field, wire, value in _fields(buf, pos, end):
        if field == _NET_LEGACY_LAYERS:
            raise _Fallback  # V1/V0 layers: Caffe upgrades them first
        if field == _NET_LAYER and wire == _BYTES:
            layers.append(_layer(buf, *value))
    return layers


def _layer(buf, pos: int, end: int) -> tuple[str, list[StoredBlob]]:
    name, blobs = "", []
    for field, wire, value in _fields(buf, pos, end):
        if wire != _BYTES:
            continue
        if field == _LAYER_NAME:
            name = bytes(buf[value[0]:value[1]]).decode("utf-8")
        elif field == _LAYER_BLOBS:
            blobs.append(_blob(buf, *value))
    return name, blobs


def _blob(buf, pos: int, end: int) -> StoredBlob:
    legacy, dims, floats, doubles = {}, [], [], []
    for field, wire, value in _fields(buf, pos, end):
        if field in _BLOB_LEGACY_DIMS and wire == _VARINT:
            legacy[field] = value - (1 << 64) if value >= 1 << 63 else value  # int32 as a sign-extended varint
        elif field == _BLOB_SHAPE and wire == _BYTES:
            dims.extend(_shape_dims(buf, *value))
        elif field == _BLOB_DATA:
            floats.append(_packed(buf, wire, value, "<f4"))
        elif field == _BLOB_DOUBLE_DATA:
            doubles.append(_packed(buf, wire, value, "<f8"))
    if legacy:
        shape = tuple(legacy.get(f, 0) for f in _BLOB_LEGACY_DIMS)  # proto2 defaults 0
    else:
        shape = tuple(dims)
    runs = doubles or floats
    values = (runs[0] if len(runs) == 1 else np.concatenate(runs) if runs
              else np.zeros(0, np.float64 if doubles else np.float32))
    return StoredBlob(shape, bool(legacy), values)


def _packed(buf, wire: int, value, dtype: str) -> np.ndarray:
    if wire != _BYTES:
        raise _Fallback  # one unpacked value per field: valid, rare, left to protobuf
    start, stop = value
    itemsize = np.dtype(dtype).itemsize
    if (stop - start) % itemsize:
        raise ValueError("packed run is not a whole number of values")
    return np.frombuffer(buf, dtype=dtype, count=(stop - start) // itemsize, offset=start)


def _shape_dims(buf, pos: int, end: int) -> list[int]:
    dims = []
    for field, wire, value in _fields(buf, pos, end):
        if field != _SHAPE_DIM:
            continue
        if wire == _VARINT:
            dims.append(value - (1 << 64) if value >= 1 << 63 else value)
        elif wire == _BYTES:
            p, stop = value
            while p < stop:
                dim, p = _varint(buf, p)
                dims.append(dim - (1 << 64) if dim >= 1 << 63 else dim)
            if p != stop:
                raise ValueError("packed dims overrun")
    return dims


def mismatch_message(files: str, net_name: str, ignored: list[str], left: list[str]) -> str:
    """The text of a WeightsMismatchWarning / strict FormatError: ``files`` (the caffemodel(s)), the
    ``ignored`` source layers the net lacks and the net layers ``left`` at their fillers (both already
    formatted, e.g. ``'conv2'``)."""
    parts = []
    if ignored:
        parts.append(f"ignoring source layers the net lacks: {', '.join(ignored)}")
    if left:
        parts.append(f"net layers left at their fillers (not in the weights): {', '.join(left)}")
    return f"{files}: weights do not match net '{net_name}': {'; '.join(parts)}"

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
``name`` wins, ``shape`` messages merge, an ``int32`` keeps the low 32 bits of its varint and any varint
its low 64.  The fields it does not use are checked as protobuf's parser checks them (the framing of
every known sub-message per caffe.proto's descriptors, packed runs whole), so it accepts only bytes
that protobuf accepts, with the same values — ``tests/io/test_weights_differential.py`` compares both on
thousands of mutated caffemodels.  Anything else — legacy ``layers`` (V1/V0, which need Caffe's
upgrade), a text file, unpacked floats, a known field with another wire type, groups, invalid UTF-8 in a
name, a truncated or corrupt file — is :class:`Deferred` to :func:`caffe_compat.io.read_net`, which
upgrades the net and raises the precise error.
``double_data`` wins over ``data`` when present, as in ``Blob::FromProto``; so does ``double_diff`` over
``diff`` (fields 6 and 9: the diffs a ``snapshot_diff: true`` snapshot carries, which ``FromProto`` copies
into the blob's diff too).
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
_BLOB_DIFF, _BLOB_DOUBLE_DIFF = 6, 9
_SHAPE_DIM = 1


@dataclass(frozen=True)
class StoredBlob:
    """One BlobProto of a caffemodel: its shape as stored and its values (flat, float32 or float64).

    ``legacy``: the shape is the 4-D ``num, channels, height, width`` (compared with a net's shape
    after padding that with leading 1s, as ``Blob::ShapeEquals`` does).  ``diff``: the stored diff
    (``double_diff`` when present, else ``diff``), None when the blob holds none."""

    shape: tuple[int, ...]
    legacy: bool
    values: np.ndarray
    diff: np.ndarray | None = None

    def fits(self, target: tuple[int, ...]) -> bool:
        """Caffe's ``Blob::ShapeEquals`` against a net blob of shape ``target``."""
        target = tuple(int(d) for d in target)
        if not self.legacy:
            return self.shape == target
        return len(target) <= 4 and (1,) * (4 - len(target)) + target == self.shape


class Deferred(Exception):
    """The bytes need protobuf's full parser (and possibly Caffe's upgrade): unusual, corrupt or legacy."""



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
        except Deferred:
            pass
    return from_netparameter(read_net(model))


def from_netparameter(net: caffe_pb2.NetParameter) -> list[tuple[str, list[StoredBlob]]]:
    """The same list from a parsed (V2) NetParameter; the arrays are copies."""
    return [(layer.name, [_stored(blob) for blob in layer.blobs]) for layer in net.layer]


def _stored(blob: caffe_pb2.BlobProto) -> StoredBlob:
    values = (np.asarray(blob.double_data, dtype=np.float64) if len(blob.double_data)
              else np.asarray(blob.data, dtype=np.float32))
    diff = (np.asarray(blob.double_diff, dtype=np.float64) if len(blob.double_diff)
            else np.asarray(blob.diff, dtype=np.float32) if len(blob.diff) else None)
    return StoredBlob(blob_shape(blob), is_legacy(blob), values, diff)


def _read_mapped(path: Path) -> list[tuple[str, list[StoredBlob]]]:
    check_regular_file(path, None, PROTOBUF_MAX_BYTES)  # Caffe's reader stops at protobuf's 2 GB too
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size == 0:
                raise Deferred
            if os.name == "posix":  # MAP_POPULATE: map the cached pages at once, not one fault at a time
                flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
                view = mmap.mmap(handle.fileno(), 0, flags=flags, prot=mmap.PROT_READ)
            else:
                view = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError:
        raise Deferred from None  # read_net reads it, or names the file and the reason
    return parse_in_place(view)


def parse_in_place(buf) -> list[tuple[str, list[StoredBlob]]]:
    """``[(layer name, blobs)]`` of the binary NetParameter in ``buf`` (bytes, or a memory map: the arrays
    are views of it), or :class:`Deferred` when protobuf's parser must decide (see the module docstring)."""
    if not looks_binary(buf[:65536]):
        raise Deferred
    try:
        return _net_layers(buf, 0, len(buf))
    except (IndexError, ValueError, UnicodeDecodeError):
        raise Deferred from None  # truncated or corrupt: read_net names the problem


_MASK64, _MASK32 = (1 << 64) - 1, (1 << 32) - 1
_MAX_DEPTH = 100  # protobuf's default recursion limit


def _varint(buf, pos: int) -> tuple[int, int]:
    """A varint as protobuf decodes it: at most 10 bytes, the value kept to its low 64 bits."""
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value & _MASK64, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")


def _int32(value: int) -> int:
    """An ``int32`` field's value from its varint: protobuf keeps the low 32 bits, then the sign."""
    value &= _MASK32
    return value - (1 << 32) if value >= 1 << 31 else value


def _int64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _fields(buf, pos: int, end: int):
    """``(field number, wire type, value)`` of the message in ``buf[pos:end]``; the value of a
    length-delimited field is its ``(start, stop)``, of a varint its integer, of fixed fields None.
    (One-byte tags and values, nearly all of a caffemodel's, are decoded inline: the same numbers.)"""
    while pos < end:
        key = buf[pos]
        if key < 0x80:
            pos += 1
        else:
            key, pos = _varint(buf, pos)
            if key > _MASK32:
                raise Deferred  # protobuf reads a tag as 32 bits
        field, wire = key >> 3, key & 7
        if wire == _VARINT or wire == _BYTES:
            value = buf[pos]
            if value < 0x80:
                pos += 1
            else:
                value, pos = _varint(buf, pos)
            if wire == _BYTES:
                value, pos = (pos, pos + value), pos + value
        elif wire == _FIXED32:
            value, pos = None, pos + 4
        elif wire == _FIXED64:
            value, pos = None, pos + 8
        else:
            raise Deferred  # groups (not in caffe.proto), a stray end-group, wire types 6 and 7
        if pos > end or field == 0:
            raise ValueError("field runs past its message")
        yield field, wire, value


# -- protobuf's checks of the fields the fast reader does not use ------------------------------------
# protobuf parses every known field of every message (a LayerParameter's convolution_param, a blob's
# diff, the net's state), so corruption there is corruption of the file: the fast reader checks those
# fields' framing against caffe.proto's descriptors, and defers to protobuf on anything it does not
# model exactly (a known field with another wire type, groups).

_F = caffe_pb2.NetParameter.DESCRIPTOR.fields_by_name["layer"].__class__  # FieldDescriptor
_VARINT_TYPES = {_F.TYPE_INT32, _F.TYPE_INT64, _F.TYPE_UINT32, _F.TYPE_UINT64, _F.TYPE_SINT32, _F.TYPE_SINT64,
                 _F.TYPE_BOOL, _F.TYPE_ENUM}
_FIXED32_TYPES = {_F.TYPE_FIXED32, _F.TYPE_SFIXED32, _F.TYPE_FLOAT}
_FIXED64_TYPES = {_F.TYPE_FIXED64, _F.TYPE_SFIXED64, _F.TYPE_DOUBLE}


def _is_repeated(field) -> bool:
    flag = getattr(field, "is_repeated", None)  # protobuf >= 5.28; protobuf 7 dropped `label`
    return bool(flag) if flag is not None else field.label == _F.LABEL_REPEATED


def _check_field(buf, descriptor, number: int, wire: int, value, depth: int) -> None:
    """Check one field of a message of type ``descriptor`` as protobuf's parser would (ValueError when it
    is corrupt, :class:`Deferred` when protobuf must decide)."""
    field = descriptor.fields_by_number.get(number)
    if field is None:
        return  # an unknown field: protobuf keeps it as is, its framing is all that is checked
    kind = field.type
    if kind == _F.TYPE_MESSAGE:
        if wire != _BYTES:
            raise Deferred
        _check_message(buf, *value, field.message_type, depth + 1)
    elif kind in (_F.TYPE_STRING, _F.TYPE_BYTES):
        if wire != _BYTES:
            raise Deferred
    elif wire == _BYTES:
        if not _is_repeated(field):
            raise Deferred
        start, stop = value
        if kind in _VARINT_TYPES:
            pos = start
            while pos < stop:
                _, pos = _varint(buf, pos)
            if pos != stop:
                raise ValueError("packed varints overrun their field")
        elif (stop - start) % (4 if kind in _FIXED32_TYPES else 8):
            raise ValueError("packed run is not a whole number of values")
    elif wire != (_VARINT if kind in _VARINT_TYPES else _FIXED32 if kind in _FIXED32_TYPES
                  else _FIXED64 if kind in _FIXED64_TYPES else -1):
        raise Deferred


def _check_message(buf, pos: int, end: int, descriptor, depth: int) -> None:
    if depth > _MAX_DEPTH:
        raise Deferred
    for number, wire, value in _fields(buf, pos, end):
        _check_field(buf, descriptor, number, wire, value, depth)


_NET, _LAYER, _BLOB, _SHAPE = (caffe_pb2.NetParameter.DESCRIPTOR, caffe_pb2.LayerParameter.DESCRIPTOR,
                               caffe_pb2.BlobProto.DESCRIPTOR, caffe_pb2.BlobShape.DESCRIPTOR)


def _net_layers(buf, pos: int, end: int) -> list[tuple[str, list[StoredBlob]]]:
    layers = []
    for field, wire, value in _fields(buf, pos, end):
        if field == _NET_LEGACY_LAYERS:
            raise Deferred  # V1/V0 layers: Caffe upgrades them first
        if field == _NET_LAYER and wire == _BYTES:
            layers.append(_layer(buf, *value))
        else:
            _check_field(buf, _NET, field, wire, value, 1)
    return layers


def _layer(buf, pos: int, end: int) -> tuple[str, list[StoredBlob]]:
    name, blobs = "", []
    for field, wire, value in _fields(buf, pos, end):
        if field == _LAYER_NAME and wire == _BYTES:
            name = bytes(buf[value[0]:value[1]]).decode("utf-8")  # invalid UTF-8: protobuf decides
        elif field == _LAYER_BLOBS and wire == _BYTES:
            blobs.append(_blob(buf, *value))
        else:
            _check_field(buf, _LAYER, field, wire, value, 2)
    return name, blobs


def _blob(buf, pos: int, end: int) -> StoredBlob:
    legacy, dims = {}, []
    runs = {_BLOB_DATA: [], _BLOB_DOUBLE_DATA: [], _BLOB_DIFF: [], _BLOB_DOUBLE_DIFF: []}
    for field, wire, value in _fields(buf, pos, end):
        if field in _BLOB_LEGACY_DIMS and wire == _VARINT:
            legacy[field] = _int32(value)
        elif field == _BLOB_SHAPE and wire == _BYTES:
            dims.extend(_shape_dims(buf, *value))
        elif field in runs:
            if wire != _BYTES:
                raise Deferred  # one unpacked value per field: valid, rare, left to protobuf
            runs[field].append(_packed(buf, value, "<f8" if field in (_BLOB_DOUBLE_DATA, _BLOB_DOUBLE_DIFF) else "<f4"))
        else:
            _check_field(buf, _BLOB, field, wire, value, 3)
    if legacy:
        shape = tuple(legacy.get(f, 0) for f in _BLOB_LEGACY_DIMS)  # proto2 defaults 0
    else:
        shape = tuple(dims)
    values = _first_present(_joined(runs[_BLOB_DOUBLE_DATA]), _joined(runs[_BLOB_DATA]))
    diff = _first_present(_joined(runs[_BLOB_DOUBLE_DIFF]), _joined(runs[_BLOB_DIFF]))
    return StoredBlob(shape, bool(legacy), np.zeros(0, np.float32) if values is None else values, diff)


def _joined(runs: list) -> np.ndarray | None:
    """The values of a packed field given in ``runs`` (protobuf concatenates them), None when it has none."""
    values = runs[0] if len(runs) == 1 else np.concatenate(runs) if runs else None
    return values if values is not None and values.size else None


def _first_present(doubles: np.ndarray | None, floats: np.ndarray | None) -> np.ndarray | None:
    """``Blob::FromProto``'s choice: the double field when it holds any value, else the float one."""
    return doubles if doubles is not None else floats


def _packed(buf, value, dtype: str) -> np.ndarray:
    start, stop = value
    itemsize = np.dtype(dtype).itemsize
    if (stop - start) % itemsize:
        raise ValueError("packed run is not a whole number of values")
    return np.frombuffer(buf, dtype=dtype, count=(stop - start) // itemsize, offset=start)


def _shape_dims(buf, pos: int, end: int) -> list[int]:
    dims = []
    for field, wire, value in _fields(buf, pos, end):
        if field == _SHAPE_DIM and wire == _VARINT:
            dims.append(_int64(value))
        elif field == _SHAPE_DIM and wire == _BYTES:
            p, stop = value
            while p < stop:
                dim, p = _varint(buf, p)
                dims.append(_int64(dim))
            if p != stop:
                raise ValueError("packed dims overrun")
        else:
            _check_field(buf, _SHAPE, field, wire, value, 4)
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

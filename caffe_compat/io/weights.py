"""The weights of a caffemodel without a NetParameter: layer names and blob arrays, read in place.

``read_weights(path)`` returns, in file order, ``(layer name, [StoredBlob, ...])`` for every layer of
a binary caffemodel, which is all that Caffe's ``Net::CopyTrainedLayersFrom`` looks at.  A caffemodel
is mostly one packed float array per blob; protobuf's parser copies each of them into its arena and
numpy copies them again, so for a model of tens of MB most of the load time is spent faulting in
fresh memory.  Here the file is memory-mapped and only the message *framing* is decoded (protobuf's
wire format: a varint key ``field << 3 | wire type``, then a varint, 4 or 8 bytes, or a varint length
and that many bytes); each packed ``data``/``double_data`` run becomes a read-only numpy view of the
mapped file, and the one copy is the caller's copy into its own tensors.

Fields used (names and numbers of caffe.proto): NetParameter ``layer`` = 100, LayerParameter ``blobs`` = 7,
BlobProto ``data`` = 5, ``diff`` = 6 (packed float), ``double_data`` = 8, ``double_diff`` = 9 (packed double):
the walk in Python goes no deeper than a blob and only locates those packed runs.  Every other byte (the
net's fields, each layer's name, type and parameters, each blob's dims and shape) is copied, framed as it
was, into one small NetParameter that protobuf's own parser reads: protobuf decides on that part exactly as
on the whole file (wire types, UTF-8, nesting depth, merging, the last ``name`` winning, an int32 keeping
the low 32 bits of its varint), and the blob shapes and layer names come from its parse.  So the reader
accepts only bytes that protobuf accepts, with the same values — ``tests/io/test_weights_differential.py``
compares both on thousands of mutated caffemodels.  Anything else — legacy ``layers`` (V1/V0, which need
Caffe's upgrade), a text file, unpacked floats, a group directly in the net, a layer or a blob, a
truncated or corrupt file — is :class:`Deferred` to :func:`caffe_compat.io.read_net`,
which upgrades the net and raises the precise error.
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
from google.protobuf.message import DecodeError

from caffe_compat.io.blobs import blob_shape, is_legacy
from caffe_compat.io.path_or_text import is_existing_file
from caffe_compat.io.protofiles import looks_binary
from caffe_compat.io.safe_open import PROTOBUF_MAX_BYTES, check_regular_file
from caffe_compat.proto import caffe_pb2

_VARINT, _FIXED64, _BYTES, _FIXED32 = 0, 1, 2, 5
_NET_LAYER, _NET_LEGACY_LAYERS = 100, 2
_LAYER_BLOBS = 7
_BLOB_DATA, _BLOB_DOUBLE_DATA = 5, 8
_BLOB_DIFF, _BLOB_DOUBLE_DIFF = 6, 9


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


def _fields(buf, pos: int, end: int):
    """``(field number, wire type, value, start, stop)`` of the message in ``buf[pos:end]``: ``buf[start:stop]``
    is the whole field, key included; the value of a length-delimited field is its ``(start, stop)``, of a
    varint its integer, of fixed fields None.  (One-byte tags and values, nearly all of a caffemodel's, are
    decoded inline: the same numbers.)"""
    while pos < end:
        start = pos
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
        yield field, wire, value, start, pos


# -- everything but the blobs' values, parsed by protobuf ---------------------------------------------
# The walk locates the blobs' packed value runs and nothing else.  Every other byte of the file (the net's
# own fields; each layer's name, type, convolution_param, ...; each blob's dims and shape) is copied, framed
# as it was, into one small NetParameter that protobuf's parser reads: protobuf decides on that part exactly
# as on the whole file (wire types, UTF-8 of the strings, the nesting depth, merged sub-messages, the last
# ``name`` winning, an int32 keeping the low 32 bits of its varint), and the walk never goes below a blob.


def _varint_bytes(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_LAYER_KEY = _varint_bytes(_NET_LAYER << 3 | _BYTES)
_BLOBS_KEY = _varint_bytes(_LAYER_BLOBS << 3 | _BYTES)


def _without(buf, pos: int, end: int, cuts: list) -> bytes:
    """``buf[pos:end]`` with each field ``(start, stop, replacement)`` of ``cuts`` (in order) replaced."""
    parts = []
    for start, stop, replacement in cuts:
        parts += (buf[pos:start], replacement)
        pos = stop
    parts.append(buf[pos:end])
    return b"".join(parts)


def _framed(key: bytes, body: bytes) -> bytes:
    return key + _varint_bytes(len(body)) + body


def _net_layers(buf, pos: int, end: int) -> list[tuple[str, list[StoredBlob]]]:
    body, runs_of = _without_values(buf, pos, end, _NET_LAYER, _LAYER_KEY, _layer, deferring=_NET_LEGACY_LAYERS)
    try:
        net = caffe_pb2.NetParameter.FromString(body)
    except (DecodeError, RecursionError):
        raise Deferred from None  # read_net names the problem
    return [(layer.name, [_stored_in_place(blob, blob_runs) for blob, blob_runs in zip(layer.blobs, runs, strict=True)])
            for layer, runs in zip(net.layer, runs_of, strict=True)]


def _layer(buf, pos: int, end: int) -> tuple[bytes, list]:
    """The layer's bytes without its blobs' values, and each blob's ``(value runs, legacy fields seen)``."""
    return _without_values(buf, pos, end, _LAYER_BLOBS, _BLOBS_KEY, _blob)


def _without_values(buf, pos: int, end: int, number: int, key: bytes, read_child,
                    deferring: int | None = None) -> tuple[bytes, list]:
    """The message ``buf[pos:end]`` with each sub-message field ``number`` replaced by ``read_child``'s copy of
    it (framed with ``key``), and what ``read_child`` found in each, in order; :class:`Deferred` at a field
    ``deferring`` (the net's legacy V1/V0 ``layers``: Caffe upgrades them first)."""
    cuts, found = [], []
    for field, wire, value, start, stop in _fields(buf, pos, end):
        if field == number and wire == _BYTES:
            body, inner = read_child(buf, *value)
            cuts.append((start, stop, _framed(key, body)))
            found.append(inner)
        elif field == deferring:
            raise Deferred
    return (_without(buf, pos, end, cuts) if cuts else buf[pos:end]), found


def _blob(buf, pos: int, end: int) -> tuple[bytes, tuple[dict, bool]]:
    """The blob's bytes without its ``data``/``diff`` runs; those runs by field number, and whether a field
    numbered as a legacy dimension (``num`` .. ``width``) is there."""
    cuts, runs, legacy = [], {}, False
    for field, wire, value, start, stop in _fields(buf, pos, end):
        if field in _VALUE_DTYPES:
            if wire != _BYTES:
                raise Deferred  # one unpacked value per field: valid, rare, left to protobuf
            runs.setdefault(field, []).append(_packed(buf, value, _VALUE_DTYPES[field]))
            cuts.append((start, stop, b""))
        elif field <= 4:
            legacy = True
    return _without(buf, pos, end, cuts), (runs, legacy)


_VALUE_DTYPES = {_BLOB_DATA: "<f4", _BLOB_DIFF: "<f4", _BLOB_DOUBLE_DATA: "<f8", _BLOB_DOUBLE_DIFF: "<f8"}
_NO_VALUES = np.zeros(0, np.float32)
_NO_VALUES.flags.writeable = False


def _stored_in_place(blob: caffe_pb2.BlobProto, found: tuple[dict, bool]) -> StoredBlob:
    """A StoredBlob from protobuf's parse of the blob's dims and shape and the walk's value runs (protobuf is
    asked about the legacy dims only where a field of their numbers was there)."""
    runs, maybe_legacy = found
    legacy = maybe_legacy and is_legacy(blob)
    shape = blob_shape(blob) if legacy else tuple(blob.shape.dim)
    if len(runs) == 1 and _BLOB_DATA in runs:  # the usual blob: float data, no diff
        values = _joined(runs[_BLOB_DATA])
        return StoredBlob(shape, legacy, _NO_VALUES if values is None else values)
    values = _first_present(_joined(runs.get(_BLOB_DOUBLE_DATA)), _joined(runs.get(_BLOB_DATA)))
    diff = _first_present(_joined(runs.get(_BLOB_DOUBLE_DIFF)), _joined(runs.get(_BLOB_DIFF)))
    return StoredBlob(shape, legacy, _NO_VALUES if values is None else values, diff)


def _joined(runs: list | None) -> np.ndarray | None:
    """The values of a packed field given in ``runs`` (protobuf concatenates them), None when it has none."""
    values = runs[0] if runs and len(runs) == 1 else np.concatenate(runs) if runs else None
    return values if values is not None and values.size else None


def _first_present(doubles: np.ndarray | None, floats: np.ndarray | None) -> np.ndarray | None:
    """``Blob::FromProto``'s choice: the double field when it holds any value, else the float one."""
    return doubles if doubles is not None else floats


def _packed(buf, value, dtype: str) -> np.ndarray:
    start, stop = value
    itemsize = 8 if dtype == "<f8" else 4
    if (stop - start) % itemsize:
        raise ValueError("packed run is not a whole number of values")
    return np.frombuffer(buf, dtype=dtype, count=(stop - start) // itemsize, offset=start)


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

"""BlobProto <-> numpy, and mean ``.binaryproto`` files.

A BlobProto's shape is its ``shape.dim`` when present, else the legacy 4-D ``num, channels, height,
width`` (what old caffemodels and ``compute_image_mean`` write).  Data are ``data`` (float32) or
``double_data`` (float64).  Caffe compares a legacy 4-D blob with a target shape after padding the
target with leading 1s (``Blob::ShapeEquals``): :func:`legacy_shape_equals` does the same, so an old
InnerProduct weight 1×1×M×K loads into an M×K blob.
"""

from __future__ import annotations

import os

import numpy as np

from caffe_compat.errors import FormatError, ShapeMismatchError
from caffe_compat.io.protofiles import read_message, write_message
from caffe_compat.proto import caffe_pb2


_LEGACY_FIELDS = ("num", "channels", "height", "width")


def is_legacy(blob: caffe_pb2.BlobProto) -> bool:
    """Caffe's rule: any of num/channels/height/width set makes the blob legacy 4-D."""
    return any(blob.HasField(f) for f in _LEGACY_FIELDS)


def blob_shape(blob: caffe_pb2.BlobProto) -> tuple[int, ...]:
    """Legacy 4-D dims when any is set, else ``shape.dim`` (absent or empty: a 0-axis blob, shape ())."""
    if is_legacy(blob):
        return (blob.num, blob.channels, blob.height, blob.width)
    return tuple(int(d) for d in blob.shape.dim)


def blob_to_array(blob: caffe_pb2.BlobProto, diff: bool = False, source: str = "blob") -> np.ndarray:
    """The blob's data (or diff) as an array of its shape: float64 from ``double_data`` whenever the blob
    has any (then its count must fit, whatever ``data`` holds), else float32 from ``data``, as
    ``Blob::FromProto`` reads a mean file, a solverstate's history or a net's weights."""
    shape = blob_shape(blob)
    single = blob.diff if diff else blob.data
    double = blob.double_diff if diff else blob.double_data
    values = np.asarray(double, dtype=np.float64) if len(double) else np.asarray(single, dtype=np.float32)
    count = int(np.prod(shape)) if shape else 1
    if values.size != count:
        raise FormatError(f"{source}: blob has shape {shape} ({count} values) but holds {values.size} values")
    return values.reshape(shape)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        if not n:
            out.append(low)
            return bytes(out)
        out.append(low | 0x80)


def set_packed_floats(blob: caffe_pb2.BlobProto, values, field: str = "data") -> None:
    """Append ``values`` (as little-endian float32; float64 for ``double_data``/``double_diff``) to
    ``blob.<field>`` (``data``, ``diff``, ``double_data`` or ``double_diff``).

    The same message as ``blob.data.extend(values)``, built by merging the packed field's wire bytes
    (tag, length, raw floats): protobuf copies them at once instead of converting float by float, ~25×
    faster (a 268 MB InnerProduct blob: 0.6 s instead of 15 s)."""
    dtype = "<f8" if field.startswith("double_") else "<f4"
    raw = np.ascontiguousarray(np.asarray(values, dtype=dtype).ravel()).tobytes()
    if not raw:
        return
    number = caffe_pb2.BlobProto.DESCRIPTOR.fields_by_name[field].number
    blob.MergeFromString(_varint(number << 3 | 2) + _varint(len(raw)) + raw)


def array_to_blob(array, legacy: bool = False, diff=None) -> caffe_pb2.BlobProto:
    """A BlobProto with ``shape`` (or legacy num/channels/height/width for ≤4-D when ``legacy``)."""
    array = np.asarray(array)
    blob = caffe_pb2.BlobProto()
    if legacy:
        if array.ndim > 4:
            raise FormatError(f"legacy blobs hold at most 4 axes, got shape {array.shape}")
        n, c, h, w = (1,) * (4 - array.ndim) + tuple(array.shape)
        blob.num, blob.channels, blob.height, blob.width = n, c, h, w
    else:
        blob.shape.dim.extend(int(d) for d in array.shape)
    if array.dtype == np.float64:
        blob.double_data.extend(array.ravel().tolist())
    else:
        set_packed_floats(blob, array)
    if diff is not None:
        set_packed_floats(blob, diff, "diff")
    return blob


def legacy_shape_equals(blob: caffe_pb2.BlobProto, target: tuple[int, ...]) -> bool:
    """Caffe's ``Blob::ShapeEquals``: exact for ``shape`` blobs; legacy blobs compare 4-D, target
    padded with leading 1s (a target of more than 4 axes never matches a legacy blob)."""
    target = tuple(int(d) for d in target)
    if not is_legacy(blob):
        return blob_shape(blob) == target
    if len(target) > 4:
        return False
    return blob_shape(blob) == (1,) * (4 - len(target)) + target


def blob_to_array_as(blob: caffe_pb2.BlobProto, target: tuple[int, ...], where: str) -> np.ndarray:
    """The blob's data shaped as ``target`` when Caffe would accept it, else ShapeMismatchError."""
    if not legacy_shape_equals(blob, target):
        raise ShapeMismatchError(f"{where}: the weights have shape {blob_shape(blob)}, the net expects {tuple(target)}")
    return blob_to_array(blob, source=where).reshape(target)


def read_blob(path: str | os.PathLike) -> np.ndarray:
    """A ``.binaryproto`` BlobProto (e.g. a mean file) as a numpy array of its stored shape."""
    blob = read_message(path, caffe_pb2.BlobProto(), binary=True)
    return blob_to_array(blob, source=str(path))


def write_blob(array, path: str | os.PathLike, legacy: bool = True) -> None:
    """Write ``array`` as a binary BlobProto (legacy 4-D dims by default, like compute_image_mean)."""
    write_message(array_to_blob(array, legacy=legacy), path, binary=True)

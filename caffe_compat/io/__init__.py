"""Caffe's file formats (no torch here): prototxt/caffemodel, solver, solverstate, binaryproto, LMDB
Datum, glog-format logs; legacy upgrades; the pycaffe-style ``caffe.io`` helpers (Transformer,
load_image, resize_image, oversample, the BlobProto and Datum converters) when present."""

from caffe_compat.io.blobs import (array_to_blob, blob_shape, blob_to_array, blob_to_array_as,
                                   legacy_shape_equals, read_blob, write_blob)
from caffe_compat.io.datum_lmdb import decode_datum, iter_lmdb, lmdb_length, make_datum, write_lmdb
from caffe_compat.io.netfiles import read_net, read_solver, read_solverstate, write_net, write_solverstate
from caffe_compat.io.upgrade import upgrade_net, upgrade_solver
from caffe_compat.io.weights import StoredBlob, read_weights

try:  # pycaffe's caffe.io helpers (numpy + OpenCV), if that module is present
    from caffe_compat.io.transformer import (Transformer, array_to_blobproto, array_to_datum,  # noqa: F401
                                             arraylist_to_blobprotovector_str, blobproto_to_array,
                                             blobprotovector_str_to_arraylist, datum_to_array, load_image,
                                             oversample, resize_image)
except ModuleNotFoundError as _exc:  # pragma: no cover
    if _exc.name != "caffe_compat.io.transformer":
        raise

__all__ = [
    "StoredBlob", "array_to_blob", "blob_shape", "blob_to_array", "blob_to_array_as", "decode_datum",
    "iter_lmdb", "legacy_shape_equals", "lmdb_length", "make_datum",
    "read_blob", "read_net", "read_solver", "read_solverstate", "read_weights", "upgrade_net", "upgrade_solver",
    "write_blob", "write_lmdb", "write_net", "write_solverstate",
]

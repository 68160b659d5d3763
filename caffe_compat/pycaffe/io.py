"""pycaffe's ``caffe.io`` module, what ``import caffe.io`` gives under the alias
(:mod:`caffe_compat.pycaffe.alias`): ``Transformer``, ``load_image``, ``resize_image``, ``oversample``,
the BlobProto converters (``blobproto_to_array`` with legacy 4-D and shape-less blobs,
``array_to_blobproto``, ``arraylist_to_blobprotovector_str``, ``blobprotovector_str_to_arraylist``) and
the Datum converters (``array_to_datum``, ``datum_to_array``).  pycaffe spells the list writer
``arraylist_to_blobprotovecor_str`` (its only name, typo included); that name is here too, the same function
as the correctly spelled ``arraylist_to_blobprotovector_str``.  They live in
:mod:`caffe_compat.io.transformer` (numpy and OpenCV, no torch); this module only gathers pycaffe's names,
and ``caffe_pb2`` as pycaffe's io module exposes it.
"""

from __future__ import annotations

from caffe_compat.io.transformer import (Transformer, array_to_blobproto, array_to_datum,  # noqa: F401
                                         arraylist_to_blobprotovector_str, blobproto_to_array,
                                         blobprotovector_str_to_arraylist, datum_to_array, load_image,
                                         oversample, resize_image)
from caffe_compat.proto import caffe_pb2  # noqa: F401

arraylist_to_blobprotovecor_str = arraylist_to_blobprotovector_str  # pycaffe's own spelling

__all__ = ["Transformer", "array_to_blobproto", "array_to_datum", "arraylist_to_blobprotovector_str",
           "arraylist_to_blobprotovecor_str",
           "blobproto_to_array", "blobprotovector_str_to_arraylist", "datum_to_array", "load_image",
           "oversample", "resize_image", "caffe_pb2"]

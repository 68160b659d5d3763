"""Thin converters between Caffe's files and caffe-compat checkpoints (each calls the library,
:mod:`caffe_compat.convert`, which never imports this package).

* :func:`caffe_to_torch.convert_caffe_to_torch`: prototxt + caffemodel -> checkpoint (``load_checkpoint``).
* :func:`torch_to_caffe.convert_torch_to_caffe`: checkpoint -> ``<prefix>.prototxt`` + ``<prefix>.caffemodel``.
"""

from converters.caffe_to_torch import convert_caffe_to_torch
from converters.torch_to_caffe import convert_torch_to_caffe

__all__ = ["convert_caffe_to_torch", "convert_torch_to_caffe"]

"""caffe-compat checkpoint -> ``<prefix>.prototxt`` + ``<prefix>.caffemodel``, written all-or-nothing: a
thin entry point over :func:`caffe_compat.convert.convert_torch_to_caffe` (see there for the behaviour)."""

from caffe_compat.convert import convert_torch_to_caffe

__all__ = ["convert_torch_to_caffe"]

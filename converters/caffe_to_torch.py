"""Caffe prototxt + caffemodel -> caffe-compat checkpoint: a thin entry point over
:func:`caffe_compat.convert.convert_caffe_to_torch` (see there for the behaviour)."""

from caffe_compat.convert import convert_caffe_to_torch

__all__ = ["convert_caffe_to_torch"]

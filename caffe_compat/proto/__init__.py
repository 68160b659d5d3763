"""Our caffe.proto and the protobuf module generated from it (no torch here)."""

from caffe_compat.proto import caffe_pb2

__all__ = ["caffe_pb2"]

"""pycaffe's layers: :class:`Layer`, the base class of Python layers (``caffe.Layer``), and
:class:`LayerView`, what ``net.layers[i]`` shows (``type``, ``name``, ``blobs``).

``Layer`` has pycaffe's interface (``setup``, ``reshape``, ``forward``, ``backward`` over lists of
blobs, ``param_str``, ``phase``, ``blobs``) so that old layer code imports.  Not reproduced: caffe-compat
never instantiates a Python layer named by a model file (``type: "Python"``); a Python layer runs once a
native port is registered for it (:func:`caffe_compat.layers.register_layer`, see
:mod:`caffe_compat.layers.registry`).
"""

from __future__ import annotations

from caffe_compat.pycaffe._mode import TEST

__all__ = ["Layer", "LayerView"]


class LayerView:
    """pycaffe's ``net.layers[i]``: ``type``, ``name``, ``blobs`` (its parameter blobs)."""

    def __init__(self, name: str, type_: str, blobs: list):
        self.name, self.type, self.blobs = name, type_, blobs

    def __repr__(self) -> str:
        return f"Layer({self.name!r}, type={self.type!r})"


class Layer:
    """pycaffe's ``caffe.Layer`` base class of Python layers (``setup``, ``reshape``, ``forward``,
    ``backward`` over lists of :class:`Blob`, ``param_str``, ``phase``, ``blobs``).  Provided so that old
    layer code imports; caffe-compat never instantiates Python layers named by a model file: register a
    native port instead (:func:`caffe_compat.layers.register_layer`)."""

    def __init__(self, param_str: str = "", phase: int = TEST):
        self.param_str, self.phase, self.blobs = param_str, phase, []

    def setup(self, bottom, top):
        pass

    def reshape(self, bottom, top):
        pass

    def forward(self, bottom, top):
        raise NotImplementedError(f"{type(self).__name__}.forward is not implemented")

    def backward(self, top, propagate_down, bottom):
        raise NotImplementedError(f"{type(self).__name__}.backward is not implemented")


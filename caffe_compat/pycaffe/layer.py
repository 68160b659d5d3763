"""pycaffe's layers: :class:`Layer`, the base class of Python layers (``caffe.Layer``), and
:class:`LayerView`, what ``net.layers[i]`` shows (``type``, ``name``, ``blobs``).

``Layer`` has pycaffe's interface (``setup``, ``reshape``, ``forward``, ``backward`` over lists of
blobs with numpy ``data``/``diff``, ``param_str``, ``phase``, ``blobs.add_blob``); it lives in the core
(:mod:`caffe_compat.layers.python_user`, which runs such layers inside a CaffeNet with pycaffe's
semantics) and is re-exported here.  A model file never makes caffe-compat import a module: a ``Python``
layer runs when the program registered its class (``caffe_compat.register_python_layer``), already
imported the module defining it, or opted in to imports (``caffe_compat.allow_python_imports``,
``caffe-compat train --python-path DIR``); see :mod:`caffe_compat.layers.python_user`.
"""

from __future__ import annotations

from caffe_compat.layers.python_user import BlobVec, HostBlob, Layer

__all__ = ["Layer", "LayerView", "BlobVec", "HostBlob"]


class LayerView:
    """pycaffe's ``net.layers[i]``: ``type``, ``name``, ``blobs`` (its parameter blobs)."""

    def __init__(self, name: str, type_: str, blobs: list):
        self.name, self.type, self.blobs = name, type_, blobs

    def __repr__(self) -> str:
        return f"Layer({self.name!r}, type={self.type!r})"

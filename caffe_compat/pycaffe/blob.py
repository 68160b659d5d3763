"""pycaffe's blobs: :class:`Blob` (``net.blobs[name]``) and :class:`ParamBlob` (``net.params[layer][i]``),
numpy ``data``/``diff`` arrays over torch tensors.

Reproduced from pycaffe / Caffe:

* ``data`` and ``diff`` are numpy arrays with a **stable memory**: a net's ``forward()`` copies its results
  into them (what it returns are these very arrays, as in pycaffe).  ``reshape(*shape)`` is Caffe's
  ``Blob::Reshape``: memory is reallocated (zeros) only when the new count exceeds the blob's capacity
  (the largest count it had); otherwise the blob keeps its memory and values, seen in the new shape (the
  same shape changes nothing: what the script wrote stays).  On a net input the net re-infers every other
  shape at ``net.reshape()`` or the next ``forward()``, as Caffe (see :mod:`caffe_compat.pycaffe.net`).
  ``shape``, ``count`` and the legacy 4-D accessors ``num``/``channels``/``height``/``width`` (Caffe's
  ``LegacyShape``: an axis the blob lacks counts 1, so a (N, C) blob has num N and channels C; on
  parameter blobs too).
* A parameter blob's ``data``/``diff`` are, on CPU, numpy views of the torch parameter and of its ``.grad``
  (writing ``data[...] = w`` changes the net; ``.grad`` is created as zeros on first use, as Caffe's diff
  exists from the start).
* On CUDA both are **host copies** kept by Caffe's SyncedMemory scheme (:class:`_Synced`): reading fetches
  the device value and hands the host copy to the caller, who may write into it; the owning net uploads
  every host copy handed out before its next forward/backward/save.  Device-side changes made behind the
  facade are seen by the next ``.data`` read, not by arrays fetched before.
"""

from __future__ import annotations

import warnings
import weakref
from typing import TYPE_CHECKING

import numpy as np
import torch

from caffe_compat.layers.blob_memory import shape_argument, within_capacity
from caffe_compat.layers.facts import legacy_shape as caffe_legacy_shape

if TYPE_CHECKING:
    from caffe_compat.pycaffe.net import Net

__all__ = ["Blob", "ParamBlob", "legacy_shape", "grad_of"]


def legacy_shape(name: str, shape: tuple, axis: int) -> int:
    """Caffe's ``Blob::LegacyShape(axis)`` (``num``/``channels``/``height``/``width``): the axis's size, 1 for
    an axis the blob lacks (a (N, C) blob has num N, channels C, height and width 1); > 4 axes refused."""
    return caffe_legacy_shape(shape, f"blob '{name}'")[axis]


class _Synced:
    """One array on host and device (Caffe's SyncedMemory): ``head`` says where the newest value is.

    On CPU host and device are the same tensor.  On CUDA: ``host()`` returns the host copy the caller may
    write to (fetched when the device is newer) and moves the head to the host; ``device()`` uploads a
    host head first; ``assign()`` stores a new device value."""

    def __init__(self, value: torch.Tensor):
        self._dev = value
        self._host = value if value.device.type == "cpu" else None
        self.head = "synced"
        self.source = None  # the tensor a parameter mirror follows

    @property
    def on_cpu(self) -> bool:
        return self._dev.device.type == "cpu"

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._dev.shape)

    def host(self) -> torch.Tensor:
        if self.on_cpu:
            return self._dev
        if self._host is None or tuple(self._host.shape) != self.shape:
            self._host = torch.empty(self.shape, dtype=self._dev.dtype).pin_memory()
            self.head = "device"
        if self.head == "device":
            self._host.copy_(self._dev)
        self.head = "host"
        return self._host

    def device(self) -> torch.Tensor:
        if self.head == "host" and not self.on_cpu:
            self._dev.copy_(self._host)
        self.head = "synced" if self.head == "host" else self.head
        return self._dev

    def assign(self, value: torch.Tensor) -> None:
        value = value.detach()
        if tuple(value.shape) != self.shape or value.dtype != self._dev.dtype:
            self._dev = value.clone() if self.on_cpu else value
            self._host = self._dev if self.on_cpu else None
        elif self.on_cpu:
            if value.data_ptr() != self._dev.data_ptr():
                self._dev.copy_(value)
        else:
            self._dev = value
        self.head = "device" if not self.on_cpu else "synced"

    def reshaped(self, shape: tuple[int, ...]) -> "_Synced":
        """Caffe's ``Blob::Reshape`` of this memory: a view of the same storage (values kept) when the new
        count fits in its capacity, else new zeros."""
        dev = self.device()  # a host copy the script wrote is uploaded first
        root = dev if dev._base is None else dev._base
        count = int(np.prod(shape, dtype=np.int64))
        if root.is_contiguous() and root.dtype == dev.dtype and count <= root.numel():
            return _Synced(root.reshape(-1)[:count].view(shape))
        return _Synced(torch.zeros(shape, dtype=dev.dtype, device=dev.device))

    def fill(self, value: float) -> None:
        self.device().fill_(value)
        if not self.on_cpu:
            self.head = "device"


class Blob:
    """pycaffe's Blob: ``data`` and ``diff`` numpy arrays (see the module docstring for CPU/GPU), ``shape``,
    ``count``, ``num/channels/height/width`` (legacy 4-D accessors) and ``reshape``."""

    def __init__(self, name: str, shape, device: torch.device, owner: "Net"):
        self.name = name
        self._owner = weakref.ref(owner)
        self._data = _Synced(torch.zeros(tuple(shape), dtype=torch.float32, device=device))
        self._diff = _Synced(torch.zeros(tuple(shape), dtype=torch.float32, device=device))

    @property
    def data(self) -> np.ndarray:
        return self._data.host().numpy()

    @property
    def diff(self) -> np.ndarray:
        return self._diff.host().numpy()

    @property
    def shape(self) -> tuple[int, ...]:
        return self._data.shape

    @property
    def count(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    num = property(lambda self: legacy_shape(self.name, self.shape, 0))
    channels = property(lambda self: legacy_shape(self.name, self.shape, 1))
    height = property(lambda self: legacy_shape(self.name, self.shape, 2))
    width = property(lambda self: legacy_shape(self.name, self.shape, 3))

    def reshape(self, *shape, **kwargs) -> None:
        """New shape, Caffe's ``Blob::Reshape`` (values kept within the capacity, see the module docstring).
        On a net input, the net's other shapes follow at ``net.reshape()`` / ``forward()``.  A keyword argument
        is pycaffe's RuntimeError."""
        shape = shape_argument(self.name, shape, kwargs)
        if shape == self.shape:
            return  # Caffe: nothing changes, the data stays
        self._reshape_memory(shape)
        owner = self._owner()
        if owner is not None:
            owner._blob_reshaped(self.name)

    def _reshape_memory(self, shape) -> None:
        self._data, self._diff = self._data.reshaped(shape), self._diff.reshaped(shape)

    def _realloc(self, shape) -> None:
        device = self._data._dev.device
        self._data = _Synced(torch.zeros(shape, dtype=torch.float32, device=device))
        self._diff = _Synced(torch.zeros(shape, dtype=torch.float32, device=device))

    def __repr__(self) -> str:
        return f"Blob({self.name!r}, shape={self.shape})"


class ParamBlob:
    """One learnable (or statistics) blob of a layer, pycaffe's ``net.params[layer][i]``: ``data`` and
    ``diff`` share memory with the torch tensor and its ``.grad`` on CPU (host copies on CUDA).  It keeps
    its net alive (as pycaffe's blobs are shared pointers): it stays valid after the net is deleted."""

    def __init__(self, owner: "Net", module_key: str, index: int):
        self._owner = lambda: owner
        self._key, self._index = module_key, index

    @property
    def tensor(self) -> torch.Tensor:
        """The torch tensor (``nn.Parameter`` or buffer) inside the CaffeNet."""
        return self._owner()._cnet.layers[self._key].caffe_blobs()[self._index]

    def _mirror(self, kind: str) -> _Synced:
        owner = self._owner()
        tensor = self.tensor
        key = (self._key, self._index, kind)
        source = tensor if kind == "data" else grad_of(tensor)
        mirror = owner._param_mirrors.get(key)
        if mirror is None or mirror.source is not source:  # first use, or the tensor was replaced
            mirror = _Synced(source.detach())
            mirror.source = source
            mirror.head = "device"
            owner._param_mirrors[key] = mirror
        return mirror

    @property
    def data(self) -> np.ndarray:
        return self._mirror("data").host().numpy()

    @property
    def diff(self) -> np.ndarray:
        return self._mirror("diff").host().numpy()

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    @property
    def count(self) -> int:
        return int(self.tensor.numel())

    num = property(lambda self: legacy_shape(repr(self), self.shape, 0))
    channels = property(lambda self: legacy_shape(repr(self), self.shape, 1))
    height = property(lambda self: legacy_shape(repr(self), self.shape, 2))
    width = property(lambda self: legacy_shape(repr(self), self.shape, 3))

    def reshape(self, *shape, **kwargs) -> None:
        """pycaffe's ``net.params[layer][i].reshape(*shape)``, Caffe's ``Blob::Reshape`` of the parameter
        blob (net surgery: reshape, write ``data``, ``net.save``): ``data`` and ``diff`` keep their memory,
        seen in the new shape, while the new count fits in what the tensor's storage holds, else become
        zeros; ``shape`` and a saved caffemodel then have the new shape.  The layer keeps its own
        sizes: Caffe's layer goes on reading them over the blob's memory, which this does not reproduce, so
        a forward after a reshape that changes the count is not Caffe's (and may fail)."""
        shape = shape_argument(repr(self), shape, kwargs)
        owner = self._owner()
        owner._upload_params()  # host copies the script wrote (CUDA) first
        tensor = self.tensor
        if shape == tuple(tensor.shape):
            return  # Caffe: nothing changes
        with torch.no_grad():
            grad = grad_of(tensor)
            bases = owner.__dict__.setdefault("_param_bases", {})  # (key, index, kind) -> its full memory
            for kind, current in (("data", tensor.data), ("diff", grad)):
                view, bases[(self._key, self._index, kind)] = within_capacity(
                    current, shape, bases.get((self._key, self._index, kind)))
                if kind == "data":
                    tensor.data = view
                else:
                    tensor.grad = view
        for kind in ("data", "diff"):  # the next .data / .diff read sees the new tensors
            owner._param_mirrors.pop((self._key, self._index, kind), None)

    def __repr__(self) -> str:
        return f"ParamBlob({self._key!r}[{self._index}], shape={self.shape})"


def grad_of(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's ``.grad``, created as zeros when absent (Caffe's diff exists from the start)."""
    if tensor.grad is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # .grad of a buffer / frozen parameter: allowed, just unusual
            tensor.grad = torch.zeros_like(tensor.detach())
    return tensor.grad


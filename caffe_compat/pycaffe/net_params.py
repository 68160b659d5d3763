"""The weight side of pycaffe's ``caffe.Net``: ``copy_from``, ``save``, ``save_hdf5``/``load_hdf5``,
``share_with``, ``clear_param_diffs``, ``set_input_arrays`` (:class:`NetParamsMixin`), and the helpers the
solver views share (:func:`share_trained_layers`, :func:`transplant_state`, :func:`set_input_arrays_of`).

Reproduced from Caffe:

* ``copy_from(path)`` and ``Net(prototxt, weights, phase)``: ``CopyTrainedLayersFrom``, by layer name; an
  HDF5 file (its signature, as Caffe's ``H5Fis_hdf5`` tests, or a name ending in ``.h5``) is read as HDF5.
  ``save(path)``: ``ToProto`` written as a binary caffemodel.
* ``save_hdf5(path)``: ``Net::ToHDF5`` without diffs: a group ``data`` holding one group per layer (Split
  layers included, empty when the layer has no blobs) and in it one float32 dataset per blob the layer
  owns, named ``"0"``, ``"1"``, ... (a blob shared through ``ParamSpec.name`` is written once, by its
  owner), written to a temporary file renamed when complete.  ``load_hdf5(path)``:
  ``CopyTrainedLayersFromHDF5``: source layers the net lacks are ignored; a layer whose blob count or a blob
  whose shape differs raises ShapeMismatchError naming the layer and blob.  Needs ``h5py``.
* ``share_with(other)``: ``ShareTrainedLayersWith``: every layer of this net named like a layer of
  ``other`` with blobs takes ``other``'s very tensors (the same memory from then on, as Caffe's shared
  data); blob counts and shapes must agree.
* ``clear_param_diffs()``: ``ClearParamDiffs``, every parameter diff set to zero in place (numpy views of
  ``.diff`` taken before see the zeros).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from caffe_compat.errors import CaffeCompatError, InputArraysError, ShapeMismatchError
from caffe_compat.io.atomic import atomic_path
from caffe_compat.net import CaffeNet
from caffe_compat.net_weights import copy_hdf5_weights, is_hdf5_weights, trained_layer_pairs
from caffe_compat.pycaffe.blob import grad_of

__all__ = ["NetParamsMixin", "copy_hdf5_weights", "is_hdf5_weights", "set_input_arrays_of", "share_trained_layers",
           "transplant_state"]


def share_trained_layers(source: CaffeNet, target: CaffeNet) -> bool:
    """Caffe's ``target->ShareTrainedLayersWith(source)``: each layer of ``source`` gives its blob tensors to
    the first layer of ``target`` of its name (:func:`~caffe_compat.net_weights.trained_layer_pairs`: blob
    counts and shapes must agree).  Returns whether anything changed."""
    changed = False
    for step, theirs, mine in trained_layer_pairs(source, target, "share_with"):
        module = target.layers[step.module_key] if step.module_key is not None else None
        for i, (a, b) in enumerate(zip(mine, theirs)):
            if a is not b:
                module.share_caffe_blob(i, b)
                changed = True
    if changed:
        target._state_storage = None  # CaffeNet's cache of weight storages
    return changed


def transplant_state(old: CaffeNet, new: CaffeNet) -> None:
    """Give ``new`` (same layers, other input shapes) the very tensors of ``old``'s blobs and the state of
    its data layers, so that views on parameters and their gradients stay valid."""
    for key, module in new.layers.items():
        previous = old.layers[key]
        old_blobs, new_blobs = previous.caffe_blobs(), module.caffe_blobs()
        for i, (a, b) in enumerate(zip(old_blobs, new_blobs)):
            if tuple(a.shape) != tuple(b.shape):
                raise ShapeMismatchError(f"layer '{module.layer_name}': blob {i} would change shape from "
                                         f"{tuple(a.shape)} to {tuple(b.shape)} with the new input shape")
        for i, blob in enumerate(old_blobs):
            module.share_caffe_blob(i, blob)
        for attr in ("_data", "_labels", "position", "_generator", "generator", "order", "_stream"):
            if attr in previous.__dict__:
                setattr(module, attr, previous.__dict__[attr])


def set_input_arrays_of(cnet: CaffeNet, data, labels) -> None:
    """pycaffe's ``Net::set_input_arrays`` on ``cnet``: its first layer must be MemoryData; float32,
    C-contiguous arrays, 4-D data, labels one per row.  Every refusal is an :class:`InputArraysError`, a
    RuntimeError as pycaffe's (its C++ checks throw ``std::runtime_error``)."""
    try:
        _set_input_arrays_of(cnet, data, labels)
    except InputArraysError:
        raise
    except CaffeCompatError as exc:
        raise InputArraysError(str(exc)) from None


def _set_input_arrays_of(cnet: CaffeNet, data, labels) -> None:
    first = cnet.steps[0] if cnet.steps else None
    if first is None or first.type != "MemoryData":
        raise CaffeCompatError("set_input_arrays may only be called if the first layer is a MemoryData layer")
    data, labels = np.asarray(data), np.asarray(labels)
    for what, arr in (("data", data), ("labels", labels)):
        if arr.dtype != np.float32:
            raise CaffeCompatError(f"set_input_arrays: {what} must be float32, got {arr.dtype}")
        if not arr.flags["C_CONTIGUOUS"]:
            raise CaffeCompatError(f"set_input_arrays: {what} must be C contiguous")
    if data.ndim != 4:
        raise ShapeMismatchError(f"set_input_arrays: data must be 4-d, got shape {data.shape}")
    if labels.ndim == 1:
        labels = labels[:, None, None, None]
    cnet.layers[first.module_key].set_input_arrays(data, labels)


def _h5py():
    try:
        import h5py
    except ModuleNotFoundError:
        raise CaffeCompatError("save_hdf5/load_hdf5 need h5py: pip install h5py") from None
    return h5py


class NetParamsMixin:
    """The weight methods of :class:`~caffe_compat.pycaffe.net.Net` (see the module docstring)."""

    def _upload_params(self) -> None:
        for mirror in self._param_mirrors.values():
            mirror.device()

    def _forget_param_mirrors(self) -> None:
        for mirror in self._param_mirrors.values():
            mirror.head = "device"

    def copy_from(self, path) -> None:
        """Load weights by layer name (``CopyTrainedLayersFrom``): a caffemodel, or Caffe's HDF5 weights."""
        if is_hdf5_weights(path):
            self.load_hdf5(path)
            return
        self._upload_params()
        self._cnet.load_caffemodel(str(path))
        self._forget_param_mirrors()

    def save(self, path) -> None:
        """Write the weights as a binary caffemodel (``Net::ToProto``, Split layers included, as Caffe)."""
        self._upload_params()
        self._cnet.save_caffemodel(str(path))

    def save_hdf5(self, path) -> None:
        """Write the weights as Caffe's HDF5 weights file (``Net::ToHDF5``, no diffs): only the blobs a layer owns
        (a blob it shares through ``ParamSpec.name`` is its owner's dataset), into a temporary file renamed to
        ``path`` when complete."""
        h5py = _h5py()
        self._upload_params()
        cnet = self._cnet
        shared = cnet.shared_blobs()
        with atomic_path(os.fspath(path)) as tmp:
            try:
                with h5py.File(tmp, "w") as f:
                    data = f.create_group("data")
                    for step in cnet.steps:
                        group = data.require_group(step.name)
                        for i, blob in enumerate(cnet.step_blobs(step)):
                            if (step.module_key, i) not in shared:  # ToHDF5: "Only save params that own themselves"
                                group.create_dataset(str(i), data=blob.detach().to("cpu", torch.float32).numpy())
            except OSError as exc:
                raise CaffeCompatError(f"save_hdf5: cannot write {path}: {exc}") from None

    def load_hdf5(self, path) -> None:
        """Copy weights by layer name from Caffe's HDF5 weights file (``CopyTrainedLayersFromHDF5``)."""
        _h5py()
        self._upload_params()
        copy_hdf5_weights(self._cnet, path)
        self._forget_param_mirrors()

    def share_with(self, other) -> None:
        """Take ``other``'s parameter tensors for the same-named layers (``ShareTrainedLayersWith``)."""
        source = getattr(other, "_cnet", other)
        if not isinstance(source, CaffeNet):
            raise CaffeCompatError(f"share_with: expected a caffe.Net, got {type(other).__name__}")
        self._upload_params()
        share_trained_layers(source, self._cnet)

    def clear_param_diffs(self) -> None:
        """Zero every parameter diff in place (``Net::ClearParamDiffs``)."""
        with torch.no_grad():
            for module in self._cnet.layers.values():
                for blob in module.caffe_blobs():
                    grad_of(blob).zero_()
            for (_, _, kind), mirror in self._param_mirrors.items():
                if kind == "diff" and mirror._host is not None and not mirror.on_cpu:
                    mirror._host.zero_()  # host copies handed out before (CUDA) read zeros too
        self._forget_param_mirrors()

    def set_input_arrays(self, data, labels) -> None:
        """Feed the first layer, a MemoryData layer (pycaffe's checks: float32, C-contiguous, 4-D data)."""
        set_input_arrays_of(self._cnet, data, labels)

    def _set_input_arrays(self, data, labels) -> None:
        """The binding under ``set_input_arrays`` (``_caffe.cpp``'s ``Net_SetInputArrays``): the same, but
        the labels must already be 4-D, n × 1 × 1 × 1 (pycaffe's wrapper reshapes 1-D labels first)."""
        shape = np.shape(labels)
        if len(shape) != 4 or tuple(shape[1:]) != (1, 1, 1):
            raise InputArraysError(f"_set_input_arrays: labels array must be 4-d, n x 1 x 1 x 1, got shape "
                                     f"{tuple(shape)}")
        set_input_arrays_of(self._cnet, data, labels)

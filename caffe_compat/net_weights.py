"""CaffeNet's weights: Caffe's fillers, ``CopyTrainedLayersFrom`` (by layer name) and ``Net::ToProto``.

:class:`CaffemodelWeights` is the part of :class:`~caffe_compat.net.CaffeNet` that moves blobs between
the net and caffemodels (it uses the net's ``steps``, ``layers`` and shared-blob table).  A stored blob
goes to the first net layer of its layer's name, and is copied when Caffe's ``Blob::ShapeEquals``
accepts it (legacy 4-D dims padded with leading 1s); ``double_data`` wins over ``data``; name mismatches
are reported once, as a :class:`~caffe_compat.errors.WeightsMismatchWarning` or, with ``strict``, a
FormatError.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections import Counter

import numpy as np
import torch

from caffe_compat.allocator import prefault_for_writing
from caffe_compat.errors import (CaffeCompatError, FormatError, ShapeMismatchError, WeightsMismatchWarning,
                                 naming_file, outside_stacklevel)
from caffe_compat.io import write_net
from caffe_compat.io.blobs import set_packed_floats
from caffe_compat.io.weights import StoredBlob, mismatch_message, read_weights
from caffe_compat.proto import caffe_pb2

log = logging.getLogger("caffe_compat.net")


def _copy_blob(blob: StoredBlob, target: torch.Tensor, layer: str, index: int) -> None:
    """Copy a stored blob into ``target`` (blob ``index`` of layer ``layer``) if Caffe's ``Blob::ShapeEquals``
    accepts it: legacy num/channels/height/width compare with the target's shape padded with leading 1s
    (at most 4 axes); otherwise ``shape.dim`` must equal it (an absent ``shape`` is a 0-axis blob, as Caffe
    writes a scalar such as a channel-shared PReLU slope).  Called once per blob of a load: the common case
    (a float32 CPU target of the stored shape) costs a shape comparison and the copy.  A stored diff (a
    ``snapshot_diff: true`` snapshot's) becomes the target's ``.grad``, Caffe's diff, as ``FromProto`` copies it,
    its count checked like the data's."""
    values = blob.values
    if blob.legacy or blob.shape != target.shape:  # torch.Size compares equal to a tuple of the same ints
        shape = tuple(int(d) for d in target.shape)
        if not blob.fits(shape):
            raise ShapeMismatchError(f"layer '{layer}' blob {index}: the weights have shape {blob.shape}, the net "
                                     f"expects {shape}")
    if values.size != target.numel():
        raise FormatError(f"layer '{layer}' blob {index}: the blob holds {values.size} values, its shape "
                          f"{tuple(int(d) for d in target.shape)} needs {target.numel()}")
    if target.device.type == "cpu" and target.dtype in _NUMPY_DTYPES and target.is_contiguous():
        # every byte is overwritten: map a fresh parameter's pages in one call, not one fault per page
        prefault_for_writing(target.data_ptr(), target.numel() * target.element_size())
        np.copyto(target.detach().numpy().reshape(-1), values, casting="same_kind")
    else:  # the values may be a read-only view of the mapped file: copy before handing them to torch
        target.copy_(torch.from_numpy(np.array(values)).reshape(target.shape))
    if blob.diff is not None:  # Blob::FromProto copies a stored diff too (a snapshot_diff: true snapshot's)
        if blob.diff.size != target.numel():
            raise FormatError(f"layer '{layer}' blob {index}: the blob holds {blob.diff.size} diff values, its "
                              f"shape {tuple(int(d) for d in target.shape)} needs {target.numel()}")
        diff = torch.from_numpy(np.array(blob.diff)).reshape(target.shape)
        if target.grad is None:
            target.grad = diff.to(device=target.device, dtype=target.dtype)
        else:
            target.grad.copy_(diff)


_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16)


def overwritten_layers(layers, stored) -> frozenset[str]:
    """Names of the net layers (``layers``: the user layers, in net order) whose every blob the caffemodel
    ``stored`` overwrites, so that building them need not initialise their blobs: layers the file holds
    blobs for, named once in the net (``CopyTrainedLayersFrom`` copies by name into the first layer of
    that name: :attr:`CaffemodelWeights.copy_targets`).  Such a layer's blobs are all overwritten, or
    building the net raises: a blob count or shape that does not fit is an error
    (:meth:`CaffemodelWeights._copy_stored`); a blob it shares through ``ParamSpec.name`` is the owner's
    (filled or copied, as before)."""
    if not stored:
        return frozenset()
    in_net = Counter(layer.name for layer in layers)
    return frozenset(name for name, blobs in stored if blobs and in_net[name] == 1)


class _BlobsByKey(dict):
    """Each port's ``caffe_blobs()`` by module key, asked once (a port builds the list at every call)."""

    def __init__(self, layers):
        super().__init__()
        self._layers = layers

    def __missing__(self, key):
        blobs = self[key] = self._layers[key].caffe_blobs()
        return blobs


_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def is_hdf5_weights(path) -> bool:
    """Whether ``CopyTrainedLayersFrom`` reads ``path`` as HDF5: Caffe asks ``H5Fis_hdf5`` (the file's HDF5
    signature, at its start here), whatever the name, so a binary caffemodel called ``x.h5`` is read as one; only
    a file that cannot be opened is taken for what a ``.h5`` name says (its reader then names the problem)."""
    if not isinstance(path, (str, os.PathLike)):
        return False
    try:
        with open(path, "rb") as handle:
            return handle.read(len(_HDF5_SIGNATURE)) == _HDF5_SIGNATURE
    except OSError:
        return os.fspath(path).endswith(".h5")


def copy_hdf5_weights(cnet, path) -> None:
    """Caffe's ``CopyTrainedLayersFromHDF5`` into ``cnet``'s blobs (what ``copy_from``, ``caffe test -weights``
    and ``extract_features`` use for an HDF5 weights file, as Caffe's ``CopyTrainedLayersFrom``): each group of
    ``data`` goes to the *last* net layer of its name (``layer_names_index_``); source layers the net lacks are
    ignored; a group with more datasets than the layer has blobs is refused ("Incompatible number of blobs"),
    and so is a missing dataset ``"i"`` unless blob i is shared from another layer (``ParamSpec.name``):
    ``Net::ToHDF5`` writes only the blobs a layer owns, so a siamese net's sharing layers have none; a shape
    that differs is a ShapeMismatchError."""
    try:
        import h5py
    except ModuleNotFoundError:
        raise CaffeCompatError(f"{os.fspath(path)}: reading HDF5 weights needs h5py: pip install h5py") from None
    path = os.fspath(path)
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise FormatError(f"load_hdf5: cannot read {path} as HDF5: {exc}") from None
    with f:
        if "data" not in f:
            raise FormatError(f"{path}: no 'data' group (not a Caffe HDF5 weights file)")
        source = f["data"]
        targets = {step.name: step.module_key for step in cnet.steps if step.module_key is not None}
        sharers = cnet.shared_blobs()
        with torch.no_grad():
            for name in source:
                key = targets.get(name)
                if key is None:
                    continue  # Caffe: "Ignoring source layer"
                blobs = list(cnet.layers[key].caffe_blobs())
                group = source[name]
                if len(group) > len(blobs):
                    raise ShapeMismatchError(f"{path}: layer '{name}' has {len(group)} blobs, the net's has "
                                             f"{len(blobs)} (Incompatible number of blobs)")
                for i, blob in enumerate(blobs):
                    if str(i) not in group:
                        if (key, i) in sharers:
                            continue  # shared: its owner's dataset holds it
                        raise ShapeMismatchError(f"{path}: layer '{name}' has no dataset '{i}' for its blob {i}, "
                                                 f"which it does not share (Incompatible number of blobs)")
                    value = np.asarray(group[str(i)], dtype=np.float32)
                    if tuple(value.shape) != tuple(blob.shape):
                        raise ShapeMismatchError(f"{path}: layer '{name}' blob {i} has shape {value.shape}, "
                                                 f"the net's {tuple(blob.shape)}")
                    blob.copy_(torch.from_numpy(value))


def trained_layer_pairs(source, target, where: str) -> list:
    """Caffe's ``target->ShareTrainedLayersWith(source)`` matching (net.cpp), as ``[(target step, source blobs,
    target blobs)]``: every layer of ``source`` in order, blob-less ones included, goes to the *first* layer of
    ``target`` of its name (none: ignored); their blob counts must agree ("Incompatible number of blobs", a
    ShapeMismatchError naming ``where`` and the layer) and so must each blob's shape, exactly."""
    first = {}
    for step in target.steps:
        first.setdefault(step.name, step)

    pairs = []
    for step in source.steps:
        mine = first.get(step.name)
        if mine is None:
            continue  # Caffe: "Ignoring source layer"
        theirs, ours = source.step_blobs(step), target.step_blobs(mine)
        if len(theirs) != len(ours):
            raise ShapeMismatchError(f"{where}: layer '{step.name}' has {len(ours)} blobs, the source net's has "
                                     f"{len(theirs)} (Incompatible number of blobs)")
        for i, (a, b) in enumerate(zip(ours, theirs)):
            if tuple(a.shape) != tuple(b.shape):
                raise ShapeMismatchError(f"{where}: layer '{step.name}' blob {i} has shape {tuple(a.shape)}, the "
                                         f"source net's {tuple(b.shape)}")
        pairs.append((mine, theirs, ours))
    return pairs


def copy_weights_files(cnet, paths, strict: bool = False) -> None:
    """Caffe's ``CopyLayers``: each weights file in order into ``cnet``: one that ``CopyTrainedLayersFrom``
    reads as HDF5 (:func:`is_hdf5_weights`: a ``.caffemodel.h5`` snapshot) through
    :func:`copy_hdf5_weights`, each run of caffemodels through ``load_caffemodels`` (one name-mismatch report
    per run)."""
    from itertools import groupby

    for hdf5, run in groupby(paths, key=is_hdf5_weights):
        if hdf5:
            for path in run:
                copy_hdf5_weights(cnet, path)
        else:
            cnet.load_caffemodels(list(run), strict=strict)


class CaffemodelWeights:
    """Fillers and caffemodel I/O of a :class:`~caffe_compat.net.CaffeNet` (a mixin of it)."""

    def step_blobs(self, step) -> list[torch.Tensor]:
        """The blobs of the layer of ``step`` in Caffe order (none for an automatic Split layer)."""
        return [] if step.module_key is None else list(self.layers[step.module_key].caffe_blobs())

    def shared_blobs(self) -> dict[tuple[str, int], tuple[str, int]]:
        """Blobs shared through ``ParamSpec.name``: (sharer module key, blob index) -> (owner key, owner index)
        (Caffe's ``param_owners_`` != -1; every other blob is owned by its layer)."""
        return {(key, i): (owner, owner_i) for key, i, owner, owner_i in self._shared}

    @torch.no_grad()
    def reinitialize(self, seed: int = 0, skip: frozenset[str] = frozenset()) -> None:
        """Fill every blob with its layer's Caffe fillers, drawing from ``torch.Generator().manual_seed(seed)``
        (layers in net order).  A shared blob keeps its owner's values.  Layers whose module key is in
        ``skip`` (those a caffemodel is about to overwrite) are left as they are and draw nothing."""
        generator = torch.Generator().manual_seed(int(seed))
        shared_by = {}
        for key, i, _, _ in self._shared:
            shared_by.setdefault(key, []).append(i)
        for step in self.steps:
            if step.module_key is None or step.module_key in skip:
                continue
            module = self.layers[step.module_key]
            keep = [(i, module.caffe_blobs()[i].detach().clone()) for i in shared_by.get(step.module_key, [])]
            module.fill(generator)
            for i, value in keep:
                module.caffe_blobs()[i].copy_(value)

    @property
    def copy_targets(self) -> dict[str, str]:
        """Caffe layer name -> module key of the layer ``CopyTrainedLayersFrom`` copies a caffemodel layer of that
        name into: the *first* net layer so named (its linear search over ``layer_names_``), where pycaffe's
        name dicts (``module_names``, ``params``) keep the last.  Two layers may share a name in Caffe (a ReLU
        named like its convolution): only the first one gets the stored blobs."""
        targets: dict[str, str] = {}
        for step in self.steps:
            if step.module_key is not None:
                targets.setdefault(step.name, step.module_key)
        return targets

    def _supplied_by(self, stored: list[tuple[str, list[StoredBlob]]] | None, blobs_of=None) -> frozenset[str]:
        """Module keys of the layers whose every blob a caffemodel's layer of the same name supplies
        (``blobs_of``: the ports' blobs by module key, when the caller has them)."""
        if not stored:
            return frozenset()
        by_name, blobs_of = self.copy_targets, self._blobs_by_key(blobs_of)
        return frozenset(by_name[name] for name, blobs in stored
                         if name in by_name and len(blobs) == len(blobs_of[by_name[name]]))

    def _blobs_by_key(self, blobs_of=None):
        """``blobs_of`` when given, else a mapping that asks each port for its ``caffe_blobs()`` once."""
        return _BlobsByKey(self.layers) if blobs_of is None else blobs_of

    def load_caffemodel(self, model, strict: bool = False) -> None:
        """Copy weights by layer name from a caffemodel path (or a NetParameter, or what
        :func:`~caffe_compat.io.weights.read_weights` returned), like Caffe's ``CopyTrainedLayersFrom``:
        layers absent from the model keep their values, model layers absent from the net are ignored; a
        blob count or shape mismatch raises ShapeMismatchError (legacy 4-D blob dims are accepted when they
        equal the net's shape padded with leading 1s).  ``double_data`` wins over ``data``, as in
        ``Blob::FromProto``; values are rounded to the net's dtype.

        Name mismatches are reported (:meth:`load_caffemodels`): one
        :class:`~caffe_compat.errors.WeightsMismatchWarning` naming the ignored source layers with blobs
        and the net layers with blobs left at their fillers; with ``strict=True`` a FormatError instead
        (nothing is copied then)."""
        self._load_stored([(model, model if isinstance(model, list) else read_weights(model))], strict)

    def load_caffemodels(self, models, strict: bool = False) -> None:
        """:meth:`load_caffemodel` of each model in turn (Caffe's ``weights: "a,b"``), reported once: a net
        layer is left at its fillers only when no model covers it.  Source layers without blobs that the
        net lacks (a train net's data or loss layers) are only logged, as Caffe logs them."""
        self._load_stored([(model, model if isinstance(model, list) else read_weights(model)) for model in models],
                          strict)

    def _load_stored(self, loaded, strict: bool, blobs_of=None) -> None:
        """The one place weights are copied: ``loaded`` is ``[(model as given, read_weights(model))]``
        (``blobs_of``: the ports' blobs by module key, when the caller has them)."""
        if not loaded:
            return
        by_name, blobs_of = self.copy_targets, self._blobs_by_key(blobs_of)
        ignored, covered = [], set()
        for model, stored in loaded:
            for name, blobs in stored:
                if name in by_name:
                    covered.add(by_name[name])
                elif blobs:
                    ignored.append((model, name))
                else:
                    log.info("Ignoring source layer %s", name)
        left = self._left_at_fillers(covered, blobs_of)
        if ignored or left:
            self._report_mismatch([model for model, _ in loaded], ignored, left, strict)
        with torch.no_grad():
            for model, stored in loaded:
                try:
                    self._copy_stored(stored, by_name, blobs_of)
                except CaffeCompatError as exc:  # names the layer and blob: the caffemodel too, when a file
                    raise naming_file(exc, model if isinstance(model, (str, os.PathLike)) else None) from exc

    def _left_at_fillers(self, covered, blobs_of=None) -> list[str]:
        """Names of the net layers with a blob that no layer of ``covered`` (the module keys of the layers a
        caffemodel supplies) writes.  A blob shared through ``ParamSpec.name`` is one tensor, as in Caffe
        (one memory): the caffemodel's values for any layer sharing it, owner or not, are its values."""
        blobs_of = self._blobs_by_key(blobs_of)
        root = self.shared_blobs()
        supplied = {root.get((key, i), (key, i)) for key in covered for i in range(len(blobs_of[key]))}
        return [step.name for step in self.steps
                if step.module_key is not None and step.module_key not in covered
                and any(root.get((step.module_key, i), (step.module_key, i)) not in supplied
                        for i in range(len(blobs_of[step.module_key])))]

    def unsupplied_layers(self, names) -> list[str]:
        """Names of the net layers left at their fillers by a caffemodel holding blobs for the layers called
        ``names`` (shared blobs count as supplied through any layer sharing them: :meth:`_left_at_fillers`)."""
        by_name = self.copy_targets
        return self._left_at_fillers({by_name[name] for name in names if name in by_name})

    def _report_mismatch(self, models, ignored, left, strict: bool) -> None:
        def label(model):
            return os.fspath(model) if isinstance(model, (str, os.PathLike)) else "<weights>"
        files = ", ".join(label(m) for m in models)
        names = [f"'{n}'" + (f" ({label(m)})" if len(models) > 1 else "") for m, n in ignored]
        text = mismatch_message(files, self.name, names, [f"'{n}'" for n in left])
        if strict:
            raise FormatError(text)
        warnings.warn(text + " (strict=True / --strict makes this an error)", WeightsMismatchWarning,
                      stacklevel=outside_stacklevel())

    def _copy_stored(self, stored, by_name, blobs_of) -> None:
        for name, blobs in stored:
            key = by_name.get(name)
            if key is None:
                continue
            targets = blobs_of[key]
            if len(blobs) != len(targets):
                raise ShapeMismatchError(f"layer '{name}': the weights have {len(blobs)} blobs, the net "
                                         f"expects {len(targets)} (incompatible number of blobs)")
            for j, (blob, target) in enumerate(zip(blobs, targets)):
                _copy_blob(blob, target, name, j)

    def to_netparameter(self) -> caffe_pb2.NetParameter:
        """The net with its current weights as a V2 NetParameter, as Caffe's ``Net::ToProto`` writes it
        (every layer, Split layers included, with its phase and blobs with ``shape``; a float64 blob, of a
        net made ``.double()``, as ``double_data`` like ``Blob<double>::ToProto``, any other as ``data``)."""
        out = caffe_pb2.NetParameter()
        out.name = self.name
        for step, saved in zip(self.steps, self._saved_params):
            layer = out.layer.add()
            layer.CopyFrom(saved)
            del layer.blobs[:]
            if step.module_key is None:
                continue
            for tensor in self.layers[step.module_key].caffe_blobs():
                blob = layer.blobs.add()
                if tensor.dim():  # Caffe writes no shape at all for a 0-axis blob
                    blob.shape.dim.extend(int(d) for d in tensor.shape)
                if tensor.dtype == torch.float64:  # Blob<double>::ToProto: double_data, no rounding
                    set_packed_floats(blob, tensor.detach().to("cpu").reshape(-1).numpy(), "double_data")
                else:
                    set_packed_floats(blob, tensor.detach().to("cpu", torch.float32).reshape(-1).numpy())
        return out

    def save_caffemodel(self, path: str | os.PathLike) -> None:
        """Write the current weights as a binary V2 caffemodel (atomically: temp file, then rename)."""
        write_net(self.to_netparameter(), path, binary=True)

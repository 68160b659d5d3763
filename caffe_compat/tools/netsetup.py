"""What Caffe's tools share: the ``-gpu``/``-phase``/``-level``/``-stage`` flags, the net with its weights,
and values for its Input layers.

Caffe's tools forward the net without feeding anything: data layers (Data, ImageData, HDF5Data, ...) read
their sources (relative paths from the working directory, as in Caffe) and Input layers hold zeros.  Here
an Input blob may also be fed from a file (:func:`load_inputs`, ``--input BLOB=FILE``), the same values at
every iteration, so a deploy net can be scored or its features extracted.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import torch

from caffe_compat.errors import CaffeCompatError, DataError, FormatError, naming_file
from caffe_compat.io.safe_open import require_regular_file

__all__ = ["as_tensors", "build_net", "device_lines", "gpu_ids", "load_inputs", "resolve_device", "split_list",
           "synchronize"]

log = logging.getLogger("caffe_compat.tools")


def split_list(text) -> list[str]:
    """Caffe's comma-separated flag values (``-weights a,b``, ``-stage s1,s2``), empty items dropped."""
    if text is None:
        return []
    if isinstance(text, (list, tuple)):
        return [str(t) for t in text if str(t)]
    return [part.strip() for part in str(text).split(",") if part.strip()]


def gpu_ids(gpu) -> list[int] | None:
    """The device IDs of Caffe's ``-gpu`` (``0``, ``1,2``), as its ``get_gpus`` reads them; None for ``all``.
    Each comma-separated item must be a non-negative integer (Caffe's ``lexical_cast`` fails on an empty one)."""
    text = str(gpu).strip()
    if text.lower() == "all":
        return None
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        ids = []
    if not ids or any(i < 0 for i in ids):
        raise CaffeCompatError(f"-gpu must be a device id, a comma-separated list of ids or 'all', got {gpu!r}")
    return ids


def resolve_device(gpu=None, device=None) -> torch.device:
    """The device from Caffe's ``-gpu`` (``0``, ``1,2`` — the first is used, as ``caffe test``/``time``
    do —, or ``all``) or from ``--device`` (cpu, cuda, cuda:N, auto); neither: the CPU, as Caffe."""
    from caffe_compat.evaluate.inputs import cuda_missing, parse_device

    if gpu not in (None, "") and device not in (None, ""):
        raise CaffeCompatError("give either -gpu (Caffe's flag) or --device, not both")
    if device not in (None, ""):
        return parse_device(device, option="--device")
    if gpu in (None, ""):
        return torch.device("cpu")
    ids = gpu_ids(gpu)
    if ids is None:
        ids = list(range(torch.cuda.device_count())) or [0]
    for extra in reversed(ids[1:]):
        log.info("Not using GPU #%d for single-GPU function", extra)
    if not torch.cuda.is_available():  # Caffe's CPU mode is the absence of -gpu
        raise cuda_missing(f"-gpu {gpu}", "leave out -gpu to run on the CPU")
    return parse_device(f"cuda:{ids[0]}", option="-gpu")


def device_lines(device: torch.device, *, with_name: bool = False) -> list[str]:
    """The lines ``caffe test`` and ``caffe time`` log about their device: ``Use CPU.``, or ``Use GPU with
    device ID N`` (the CUDA index), which ``caffe test`` follows with ``GPU device name: <name>``
    (``with_name``)."""
    if device.type != "cuda":
        return ["Use CPU."]
    index = device.index if device.index is not None else torch.cuda.current_device()
    lines = [f"Use GPU with device ID {index}"]
    if with_name:
        lines.append(f"GPU device name: {torch.cuda.get_device_name(index)}")
    return lines


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued kernels (CUDA); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_net(model, weights=None, *, phase: str = "test", level: int | None = None, stages=(),
              device=None, require_weights: bool = False):
    """The :class:`~caffe_compat.net.CaffeNet` of ``model`` in ``phase`` (with ``level``/``stages``), the
    caffemodel(s) in ``weights`` (a path, a list, or Caffe's comma-separated string) copied in by layer
    name (an HDF5 weights file, ``.caffemodel.h5``, read as HDF5, as Caffe's ``CopyTrainedLayersFrom``),
    on ``device``.  ``require_weights``: refuse a net with learnable blobs and no weights (``caffe
    test``'s "Need model weights to score"); a net without learnable blobs needs none."""
    from caffe_compat.io import read_net
    from caffe_compat.net import CaffeNet, copy_weights_files

    for path in [model, *split_list(weights)]:
        if isinstance(path, (str, os.PathLike)):
            require_regular_file(path, error=DataError)  # a FIFO, a device or a folder is named as such
    try:  # a setup error names the layer; the file too (as load_net)
        net = CaffeNet(read_net(model), phase=phase, level=level, stages=tuple(split_list(stages)))
    except CaffeCompatError as exc:
        raise naming_file(exc, model if isinstance(model, (str, os.PathLike)) else None) from exc
    paths = split_list(weights)
    if require_weights and not paths and net.params:
        raise CaffeCompatError(f"{model}: need model weights to score (-weights W.caffemodel): the net has "
                               f"learnable blobs ({', '.join(list(net.params)[:3])}"
                               f"{', ...' if len(net.params) > 3 else ''})")
    for path in paths:  # one at a time, each reported (Caffe's CopyTrainedLayersFrom; an HDF5 file read as HDF5)
        copy_weights_files(net, [path])
    return net.to(torch.device("cpu") if device is None else device)


def _read_array(path: Path, key: str | None, blob: str) -> np.ndarray:
    from caffe_compat.io.arrays import load_array_file

    data = load_array_file(path, f"the array for blob '{blob}'")  # typed errors, size checked before reading
    if isinstance(data, np.ndarray):
        if key is not None:
            raise FormatError(f"{path}: a .npy file holds one array; drop ':{key}'")
        return data
    with data:
        name = key or (blob if blob in data.files else (data.files[0] if len(data.files) == 1 else None))
        if name is None or name not in data.files:
            raise FormatError(f"{path}: no array named {key or blob!r} (arrays: {', '.join(data.files[:8])}"
                              f"{', ...' if len(data.files) > 8 else ''}); name one as BLOB={path}:KEY")
        return data[name]


def load_inputs(specs, net=None) -> dict[str, np.ndarray]:
    """``{blob: float32 array}`` from ``["BLOB=FILE.npy", "BLOB=FILE.npz", "BLOB=FILE.npz:KEY"]`` (an
    ``.npz`` without ``:KEY`` gives its array named BLOB, or its only array).  With ``net``: each BLOB must
    be one the net can be fed (a top of a bottomless layer) and the array must have the blob's shape."""
    inputs: dict[str, np.ndarray] = {}
    for spec in specs or []:
        blob, sep, rest = str(spec).partition("=")
        if not sep or not blob or not rest:
            raise CaffeCompatError(f"--input {spec!r}: expected BLOB=FILE.npy or BLOB=FILE.npz[:KEY]")
        file, key = rest, None
        if not Path(rest).is_file() and ":" in rest:
            file, _, key = rest.rpartition(":")
        path = require_regular_file(Path(file), f"--input {spec!r}", error=DataError,  # a FIFO is named as such
                                    missing=f"--input {spec!r}: {Path(file)}: no such file")
        array = np.asarray(_read_array(path, key, blob))
        if not np.issubdtype(array.dtype, np.number) and array.dtype != np.bool_:
            raise FormatError(f"--input {spec!r}: {array.dtype} values are not numbers")
        if blob in inputs:
            raise CaffeCompatError(f"--input: blob '{blob}' given twice")
        inputs[blob] = np.ascontiguousarray(array, dtype=np.float32)
    if net is not None:
        feedable = net.feedable_names
        for blob, array in inputs.items():
            if blob not in feedable:
                raise FormatError(f"--input {blob}=...: '{blob}' is not a blob the net can be fed; feedable blobs "
                                  f"(tops of Input and data layers): {', '.join(feedable) or 'none'}")
            shape = tuple(net.blob_shapes.get(blob) or ())
            if shape and tuple(array.shape) != shape:
                raise FormatError(f"--input {blob}=...: the array has shape {tuple(array.shape)}, the net's blob "
                                  f"'{blob}' has {shape}")
    return inputs


def as_tensors(inputs: dict, device: torch.device) -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(array).to(device) for name, array in inputs.items()}

"""Caffe's files <-> caffe-compat checkpoints (``caffe_compat.checkpoint`` format).

* :func:`convert_caffe_to_torch`: prototxt + caffemodel -> checkpoint.  The net is built like Caffe's
  ``Net(prototxt, phase)`` and the weights copied by layer name (``CopyTrainedLayersFrom``: a shape
  mismatch raises, layers absent from the caffemodel keep their fillers' values, so ``strict=True``
  refuses a caffemodel that leaves learnable layers without weights).  ``strict_weights=True`` also
  refuses caffemodel layers with blobs that the net lacks (a FormatError naming both lists, see
  :meth:`~caffe_compat.net.CaffeNet.load_caffemodel`); otherwise those give a
  :class:`~caffe_compat.errors.WeightsMismatchWarning`.
* :func:`convert_torch_to_caffe`: checkpoint -> ``<prefix>.prototxt`` (the net, Caffe's V2 text) +
  ``<prefix>.caffemodel`` (binary V2, written like Caffe's ``Net::ToProto``: every layer, automatic
  Split layers included, BatchNorm's three blobs with the stored scale factor).  The pair is written
  all-or-nothing (:func:`caffe_compat.io.atomic.write_files_atomic`): on a failed write or rename no half
  of the pair is left behind, a replaced pair is restored, and a :class:`~caffe_compat.errors.WriteError`
  names the path and the reason.

The ``convert`` command and the top-level ``converters`` package call these.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from caffe_compat.checkpoint import checkpoint_prototxt, load_checkpoint, save_checkpoint
from caffe_compat.errors import ShapeMismatchError, WeightsMismatchWarning
from caffe_compat.io import read_net
from caffe_compat.io.atomic import write_files_atomic
from caffe_compat.io.dialects import to_binary_dialect
from caffe_compat.io.netfiles import check_net_and_weights
from caffe_compat.net import load_net

__all__ = ["convert_caffe_to_torch", "convert_torch_to_caffe"]


def convert_caffe_to_torch(prototxt: str | os.PathLike, caffemodel: str | os.PathLike, output: str | os.PathLike,
                           phase: str = "test", strict: bool = True, strict_weights: bool = False):
    """Write the checkpoint and return the CaffeNet it holds (the two files given the wrong way round are
    named as such)."""
    check_net_and_weights(prototxt, caffemodel)
    with warnings.catch_warnings(record=True) as mismatch:  # given after the check below, which may refuse
        warnings.simplefilter("always", WeightsMismatchWarning)
        net = load_net(str(prototxt), weights=str(caffemodel), phase=phase, strict=strict_weights)
    if strict:
        stored = {layer.name for layer in read_net(str(caffemodel)).layer if len(layer.blobs)}
        missing = net.unsupplied_layers(stored)
        if missing:
            raise ShapeMismatchError(f"{caffemodel}: no weights for layer(s) {missing[:8]}"
                                     f"{' ...' if len(missing) > 8 else ''} of {prototxt} (names must match)")
    for record in mismatch:
        warnings.warn_explicit(record.message, record.category, record.filename, record.lineno)
    save_checkpoint(net, output)
    return net


def convert_torch_to_caffe(checkpoint: str | os.PathLike, prefix: str | os.PathLike) -> tuple[Path, Path]:
    """Write both files; return their paths (prototxt, caffemodel)."""
    net = load_checkpoint(checkpoint)
    prefix = Path(prefix)
    prototxt, caffemodel = prefix.with_name(prefix.name + ".prototxt"), prefix.with_name(prefix.name + ".caffemodel")
    write_files_atomic([(prototxt, checkpoint_prototxt(net).encode("utf-8")),
                        (caffemodel, to_binary_dialect(net.to_netparameter()).SerializeToString())])
    return prototxt, caffemodel

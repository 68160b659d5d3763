"""Caffe prototxt + caffemodel -> caffe-compat checkpoint (``caffe_compat.checkpoint`` format).

The net is built like Caffe's ``Net(prototxt, phase)`` and the weights copied by layer name
(``CopyTrainedLayersFrom``: a shape mismatch raises, layers absent from the caffemodel keep their fillers'
values, so ``strict=True`` refuses a caffemodel that leaves learnable layers without weights).
``strict_weights=True`` also refuses caffemodel layers with blobs that the net lacks (a FormatError naming
both lists, see :meth:`~caffe_compat.net.CaffeNet.load_caffemodel`); otherwise those give a
:class:`~caffe_compat.errors.WeightsMismatchWarning`.
"""

from __future__ import annotations

import os
import warnings

from caffe_compat.checkpoint import save_checkpoint
from caffe_compat.errors import ShapeMismatchError, WeightsMismatchWarning
from caffe_compat.io import read_net
from caffe_compat.io.netfiles import check_net_and_weights
from caffe_compat.net import load_net


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
        missing = [name for name, blobs in net.params.items() if blobs and name not in stored]
        if missing:
            raise ShapeMismatchError(f"{caffemodel}: no weights for layer(s) {missing[:8]}"
                                     f"{' ...' if len(missing) > 8 else ''} of {prototxt} (names must match)")
    for record in mismatch:
        warnings.warn_explicit(record.message, record.category, record.filename, record.lineno)
    save_checkpoint(net, output)
    return net

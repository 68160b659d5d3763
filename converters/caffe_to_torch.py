"""Caffe prototxt + caffemodel -> caffe-compat checkpoint (``caffe_compat.checkpoint`` format).

The net is built like Caffe's ``Net(prototxt, phase)`` and the weights copied by layer name
(``CopyTrainedLayersFrom``: a shape mismatch raises, layers absent from the caffemodel keep their fillers'
values, so ``strict=True`` refuses a caffemodel that leaves learnable layers without weights).
"""

from __future__ import annotations

import os

from caffe_compat.checkpoint import save_checkpoint
from caffe_compat.errors import ShapeMismatchError
from caffe_compat.io import read_net
from caffe_compat.io.netfiles import check_net_and_weights
from caffe_compat.net import load_net


def convert_caffe_to_torch(prototxt: str | os.PathLike, caffemodel: str | os.PathLike, output: str | os.PathLike,
                           phase: str = "test", strict: bool = True):
    """Write the checkpoint and return the CaffeNet it holds (the two files given the wrong way round are
    named as such)."""
    check_net_and_weights(prototxt, caffemodel)
    weights = read_net(str(caffemodel))
    net = load_net(str(prototxt), weights=weights, phase=phase)
    if strict:
        stored = {layer.name for layer in weights.layer if len(layer.blobs)}
        missing = [name for name, blobs in net.params.items() if blobs and name not in stored]
        if missing:
            raise ShapeMismatchError(f"{caffemodel}: no weights for layer(s) {missing[:8]}"
                                     f"{' ...' if len(missing) > 8 else ''} of {prototxt} (names must match)")
    save_checkpoint(net, output)
    return net

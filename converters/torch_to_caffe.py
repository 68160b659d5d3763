"""caffe-compat checkpoint -> ``<prefix>.prototxt`` (the net, Caffe's V2 text) + ``<prefix>.caffemodel``
(binary V2, written like Caffe's ``Net::ToProto``: every layer, automatic Split layers included, BatchNorm's
three blobs with the stored scale factor)."""

from __future__ import annotations

import os
from pathlib import Path

from caffe_compat.checkpoint import load_checkpoint


def convert_torch_to_caffe(checkpoint: str | os.PathLike, prefix: str | os.PathLike) -> tuple[Path, Path]:
    """Write both files; return their paths (prototxt, caffemodel)."""
    from caffe_compat.checkpoint import checkpoint_prototxt

    net = load_checkpoint(checkpoint)
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prototxt, caffemodel = prefix.with_name(prefix.name + ".prototxt"), prefix.with_name(prefix.name + ".caffemodel")
    tmp = prototxt.with_name(f".{prototxt.name}.tmp{os.getpid()}")
    tmp.write_text(checkpoint_prototxt(net))
    os.replace(tmp, prototxt)
    net.save_caffemodel(caffemodel)
    return prototxt, caffemodel

"""A CaffeNet as one PyTorch checkpoint file that ``torch.load(path, weights_only=True)`` accepts.

Layout (format ``"caffe-compat/1"``), strings and tensors only::

    {"format": "caffe-compat/1",
     "net_prototxt": <the net as prototxt text: phase-filtered, Caffe's automatic Split layers removed,
                      the NetState (phase, level, stages) it was built with in ``state``>,
     "phase": "train" | "test",
     "state_dict": CaffeNet.state_dict()}   # keys "layers.<module key>.<blob>", BatchNorm's three blobs
                                            # (mean, variance, scale factor) included as buffers

``load_checkpoint`` rebuilds the CaffeNet from the prototxt (same layers, same blob names, Split tops
included) and loads the state dict strictly, so a checkpoint reloads to bit-identical outputs.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from google.protobuf import text_format

from caffe_compat.errors import CaffeCompatError, FormatError
from caffe_compat.proto import caffe_pb2

FORMAT = "caffe-compat/1"

__all__ = ["FORMAT", "save_checkpoint", "load_checkpoint", "checkpoint_prototxt"]


def _caffe_net(net):
    """A CaffeNet from a CaffeNet or a pycaffe-style :class:`caffe_compat.pycaffe.Net`."""
    from caffe_compat.net import CaffeNet

    inner = getattr(net, "torch_net", net)
    if not isinstance(inner, CaffeNet):
        raise CaffeCompatError(f"save_checkpoint: expected a CaffeNet or caffe_compat.Net, got {type(net).__name__}")
    return inner


def checkpoint_prototxt(net) -> str:
    """The prototxt a checkpoint stores: the built net without Caffe's automatic Split layers (rebuilding
    inserts them again under the same names), with the NetState it was built with."""
    net = _caffe_net(net)
    automatic = {step.name for step in net.steps if step.module_key is None}
    source_of: dict[str, str] = {}
    out = caffe_pb2.NetParameter()
    out.CopyFrom(net.net_param)
    del out.layer[:]
    for layer in net.net_param.layer:
        if layer.name in automatic and layer.type == "Split":
            for top in layer.top:
                source_of[top] = source_of.get(layer.bottom[0], layer.bottom[0])
            if layer.loss_weight and layer.loss_weight[0]:
                _restore_loss_weight(out, layer.bottom[0], float(layer.loss_weight[0]))
            continue
        kept = out.layer.add()
        kept.CopyFrom(layer)
        for j, blob in enumerate(kept.bottom):
            kept.bottom[j] = source_of.get(blob, blob)
        del kept.blobs[:]
    out.state.CopyFrom(net.state)
    return text_format.MessageToString(out)


def _restore_loss_weight(net: caffe_pb2.NetParameter, blob: str, weight: float) -> None:
    """Give back to the producer of ``blob`` the loss weight InsertSplits moved onto the Split layer."""
    for layer in reversed(net.layer):
        if blob in layer.top:
            if not layer.loss_weight:
                layer.loss_weight.extend([0.0] * len(layer.top))
            layer.loss_weight[list(layer.top).index(blob)] = weight
            return


def save_checkpoint(net, path: str | os.PathLike) -> None:
    """Write ``net`` (CaffeNet or pycaffe Net) to ``path`` (written to a temp file, then renamed)."""
    cnet = _caffe_net(net)
    payload = {
        "format": FORMAT,
        "net_prototxt": checkpoint_prototxt(cnet),
        "phase": cnet.phase,
        "state_dict": {k: v.detach().to("cpu") for k, v in cnet.state_dict().items()},
    }
    from caffe_compat.io.atomic import atomic_path, write_error

    with atomic_path(path) as tmp:
        try:
            torch.save(payload, tmp)
        except (OSError, RuntimeError) as exc:  # torch.save reports a full disk as RuntimeError
            raise write_error(Path(path), exc) from None


def load_checkpoint(path: str | os.PathLike, device=None):
    """The CaffeNet stored by :func:`save_checkpoint` (loaded with ``weights_only=True``), on ``device``."""
    from caffe_compat.net import CaffeNet

    from caffe_compat.io.safe_open import check_regular_file

    path = Path(path)
    check_regular_file(path, "the checkpoint")
    if not path.is_file():
        raise CaffeCompatError(f"{path}: no such checkpoint file")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises pickle/zip errors of several kinds on a foreign file
        raise FormatError(f"{path}: not a readable PyTorch checkpoint ({type(exc).__name__}: {exc})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise FormatError(f"{path}: not a caffe-compat checkpoint (format {found!r}, expected {FORMAT!r})")
    for key in ("net_prototxt", "phase", "state_dict"):
        if key not in payload:
            raise FormatError(f"{path}: checkpoint lacks '{key}'")
    net = CaffeNet(payload["net_prototxt"], phase=payload["phase"])
    missing, unexpected = net.load_state_dict(payload["state_dict"], strict=False)
    if missing or unexpected:
        raise FormatError(f"{path}: the state_dict does not fit the stored net (missing {list(missing)[:5]}, "
                          f"unexpected {list(unexpected)[:5]})")
    return net.to(device) if device is not None else net

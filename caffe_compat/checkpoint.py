"""A CaffeNet as one PyTorch checkpoint file that ``torch.load(path, weights_only=True)`` accepts.

Layout (format ``"caffe-compat/1"``), strings and tensors only::

    {"format": "caffe-compat/1",
     "net_prototxt": <the net as prototxt text: phase-filtered, Caffe's automatic Split layers removed,
                      the NetState (phase, level, stages) it was built with in ``state``>,
     "phase": "train" | "test",
     "state_dict": CaffeNet.state_dict()}   # keys "layers.<module key>.<blob>", BatchNorm's three blobs
                                            # (mean, variance, scale factor) included as buffers

``load_checkpoint`` rebuilds the CaffeNet from the prototxt (same layers, same blob names, Split tops
included), in the stored blobs' dtype when they all share one (a net saved after ``.double()`` reloads in
float64), and loads the state dict strictly, so a checkpoint reloads to bit-identical outputs.

Integrity: ``save_checkpoint`` adds ``"sha256"``, the SHA-256 of the content (:func:`content_digest`: the
format, the prototxt, the phase, and every tensor's name, dtype, shape and bytes in order).  PyTorch's zip
reader does not check its records' CRCs, so without it a flipped byte in a tensor loads as a different
weight without a word; ``load_checkpoint`` recomputes the digest after loading and refuses a mismatch
(FormatError "digest mismatch: the file was truncated or modified").  It reads only a regular file no
larger than the memory budget (:func:`~caffe_compat.io.safe_open.memory_budget`: the tensors are loaded
whole) and checks every key and type of the payload (unknown and missing keys named) before using it.
A checkpoint **without** ``sha256`` (written by an older caffe-compat) loads with a
:class:`~caffe_compat.errors.CaffeCompatWarning` that its integrity cannot be checked.  The file stays
what ``torch.load(path, weights_only=True)`` reads (the digest is one more string in the dict).
"""

from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path

import torch
from google.protobuf import text_format

from caffe_compat.errors import (CaffeCompatError, CaffeCompatWarning, FormatError, MemoryBudgetError,
                                 ShapeMismatchError)
from caffe_compat.proto import caffe_pb2

FORMAT = "caffe-compat/1"

__all__ = ["FORMAT", "save_checkpoint", "load_checkpoint", "checkpoint_prototxt", "content_digest"]

_KEYS = ("format", "net_prototxt", "phase", "state_dict")
_DIGEST = "sha256"


def content_digest(payload: dict) -> str:
    """The hex SHA-256 of a checkpoint's content: format, prototxt, phase, then each state_dict entry's
    name, dtype, shape and raw bytes, in order (each part length-prefixed, so no two contents collide by
    concatenation)."""
    digest = hashlib.sha256()

    def part(data) -> None:
        view = memoryview(data).cast("B")
        digest.update(len(view).to_bytes(8, "little"))
        digest.update(view)

    for key in ("format", "net_prototxt", "phase"):
        part(str(payload[key]).encode("utf-8"))
    for name, tensor in payload["state_dict"].items():
        tensor = tensor.detach().to("cpu").contiguous()
        part(str(name).encode("utf-8"))
        part(f"{tensor.dtype}:{list(tensor.shape)}".encode("ascii"))
        part(tensor.reshape(-1).view(torch.uint8).numpy() if tensor.numel() else b"")
    return digest.hexdigest()


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
    payload[_DIGEST] = content_digest(payload)
    from caffe_compat.io.atomic import atomic_path, write_error

    with atomic_path(path) as tmp:
        try:
            torch.save(payload, tmp)
        except (OSError, RuntimeError) as exc:  # torch.save reports a full disk as RuntimeError
            raise write_error(Path(path), exc) from None


def load_checkpoint(path: str | os.PathLike, device=None):
    """The CaffeNet stored by :func:`save_checkpoint` (loaded with ``weights_only=True``), on ``device``;
    its digest verified (see the module docstring)."""
    from caffe_compat.net import CaffeNet

    from caffe_compat.io.safe_open import check_regular_file, memory_budget

    path = Path(path)
    st, budget = check_regular_file(path, "the checkpoint"), memory_budget()
    if st is not None and st.st_size > budget:
        raise MemoryBudgetError(f"{path}: {st.st_size} bytes, more than the memory budget of {budget} "
                          f"(CAFFE_COMPAT_MEMORY_BUDGET): a checkpoint is loaded whole")
    if not path.is_file():
        raise CaffeCompatError(f"{path}: no such checkpoint file")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises pickle/zip errors of several kinds on a foreign file
        raise FormatError(f"{path}: not a readable PyTorch checkpoint (truncated, modified or another format: "
                          f"{type(exc).__name__}: {exc})"[:600]) from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise FormatError(f"{path}: not a caffe-compat checkpoint (format {str(found)[:80]!r}, expected {FORMAT!r})")
    _check_payload(path, payload)
    recorded = payload.get(_DIGEST)
    if recorded is None:
        warnings.warn(CaffeCompatWarning(f"{path}: checkpoint without a digest (written by an older caffe-compat): "
                                         f"its integrity cannot be checked"), stacklevel=2)
    elif recorded != content_digest(payload):
        raise FormatError(f"{path}: digest mismatch: the file was truncated or modified (the content's sha256 is "
                          f"not the {recorded[:16]}... it records)")
    # no fillers: the state_dict must supply every blob (checked below), so a large stored net whose
    # state_dict does not fit is refused without first drawing all its initial values
    net = CaffeNet(payload["net_prototxt"], phase=payload["phase"], fill=False)
    stored_dtypes = {tensor.dtype for tensor in payload["state_dict"].values() if tensor.is_floating_point()}
    if len(stored_dtypes) == 1 and torch.float32 not in stored_dtypes:  # a net saved after .double()/.half()
        net = net.to(stored_dtypes.pop())
    expected = net.state_dict()
    for name, tensor in payload["state_dict"].items():
        if name in expected and tuple(tensor.shape) != tuple(expected[name].shape):
            raise ShapeMismatchError(f"{path}: state_dict '{name}' has shape {list(tensor.shape)}, the stored net's "
                                     f"blob {list(expected[name].shape)}")
    try:
        missing, unexpected = net.load_state_dict(payload["state_dict"], strict=False)
    except RuntimeError as exc:  # a tensor torch cannot copy into the blob
        raise FormatError(f"{path}: the state_dict does not fit the stored net ({str(exc)[:300]})") from None
    if missing or unexpected:
        raise FormatError(f"{path}: the state_dict does not fit the stored net (missing {list(missing)[:5]}, "
                          f"unexpected {list(unexpected)[:5]})")
    return net.to(device) if device is not None else net


def _check_payload(path: Path, payload: dict) -> None:
    """Every key and type of a checkpoint's dict, before any is used."""
    for key in _KEYS:
        if key not in payload:
            raise FormatError(f"{path}: checkpoint lacks '{key}'")
    unknown = [k for k in payload if k not in _KEYS and k != _DIGEST]
    if unknown:
        raise FormatError(f"{path}: checkpoint has unknown key{'s' if len(unknown) > 1 else ''} "
                          f"{', '.join(repr(k)[:60] for k in unknown[:5])}")
    if not isinstance(payload["net_prototxt"], str):
        raise FormatError(f"{path}: checkpoint 'net_prototxt': expected the net as prototxt text, got "
                          f"{type(payload['net_prototxt']).__name__}")
    if payload["phase"] not in ("train", "test"):
        raise FormatError(f"{path}: checkpoint 'phase': expected 'train' or 'test', got {str(payload['phase'])[:40]!r}")
    state = payload["state_dict"]
    if not isinstance(state, dict):
        raise FormatError(f"{path}: checkpoint 'state_dict': expected a dict of tensors, got {type(state).__name__}")
    for name, value in state.items():
        if not isinstance(name, str) or not torch.is_tensor(value):
            raise FormatError(f"{path}: checkpoint 'state_dict' entry {str(name)[:80]!r}: expected a tensor named by a "
                              f"string, got {type(value).__name__}")
    recorded = payload.get(_DIGEST)
    if recorded is not None and not (isinstance(recorded, str) and len(recorded) == 64
                                     and all(c in "0123456789abcdef" for c in recorded)):
        raise FormatError(f"{path}: digest mismatch: the file was truncated or modified (its '{_DIGEST}' is not a "
                          f"SHA-256 digest)")

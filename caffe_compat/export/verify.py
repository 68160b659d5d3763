"""``verify_onnx``: ``onnx.checker``, then ONNX Runtime against the PyTorch layer ports on the same inputs.

For every input batch ``x`` (``inputs`` maps a case name to an ``(N, C, H, W)`` array; default one case
``"random"`` = ``RandomState(0).randn(2, C, H, W) * 50``, pixel-scale values) the reference is the float32
:class:`~caffe_compat.export.embedder.Embedder` of the same net and weights, ``o`` the ONNX Runtime output:

    max_abs = max |o − ref|            max_rel = max_abs / max |ref|   (error relative to the output's scale)

``passed`` is ``max_rel <= tolerance`` for every case.  Default tolerance: ``1e-4`` for a float32 model
(the Caffe reference README's whole-net rtol; measured errors are ~1e-6) and ``1e-2`` for a ``fp16``
model (float16 has an 11-bit significand: ~5e-4 per rounding, accumulated over the layers).  The fp16
model is compared with the float32 reference, i.e. the tolerance bounds the precision loss.

Net and weights default to the ``source`` paths recorded in the model's metadata.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from caffe_compat.errors import CaffeCompatError, FormatError
from caffe_compat.export.metadata import read_metadata
from caffe_compat.export.onnx_export import build_embedder, example_input
from caffe_compat.export.runtime import EmbedderSession

__all__ = ["verify_onnx", "FP32_TOLERANCE", "FP16_TOLERANCE"]

FP32_TOLERANCE = 1e-4
FP16_TOLERANCE = 1e-2


def _check(onnx_path: Path) -> None:
    import onnx

    try:
        onnx.checker.check_model(str(onnx_path), full_check=True)
    except Exception as exc:  # onnx.checker.ValidationError, shape inference errors
        raise FormatError(f"{onnx_path}: onnx.checker rejects the model: {str(exc).strip().splitlines()[0]}") from None


def _cases(inputs, shape, fixed_batch) -> dict:
    if inputs is None:
        return {"random": example_input((1, *shape), fixed_batch or 2).numpy()}
    if not isinstance(inputs, dict) or not inputs:
        raise CaffeCompatError("inputs must be a non-empty dict {case name: (N, C, H, W) array}")
    cases = {}
    for name, value in inputs.items():
        array = np.asarray(value.detach().cpu() if torch.is_tensor(value) else value, dtype=np.float32)
        if array.ndim != 4 or tuple(array.shape[1:]) != tuple(shape):
            raise CaffeCompatError(f"input case '{name}': shape {array.shape}, the model takes "
                                   f"(N, {', '.join(map(str, shape))})")
        if fixed_batch is not None and array.shape[0] != fixed_batch:
            raise CaffeCompatError(f"input case '{name}': batch {array.shape[0]}, the model is fixed to {fixed_batch}")
        cases[str(name)] = array
    return cases


def verify_onnx(onnx_path, prototxt=None, weights=None, checkpoint=None, inputs: dict | None = None,
                tolerance: float | None = None, provider: str | None = "cpu") -> dict:
    """Check ``onnx_path`` and compare ONNX Runtime with PyTorch (see the module docstring)."""
    onnx_path = Path(onnx_path)
    if not onnx_path.is_file():
        raise CaffeCompatError(f"{onnx_path}: no such ONNX file")
    _check(onnx_path)
    meta = read_metadata(onnx_path)
    source = meta.get("source") or {}
    if prototxt is None and weights is None and checkpoint is None:
        prototxt, weights, checkpoint = source.get("prototxt"), source.get("weights"), source.get("checkpoint")
    if prototxt is None and checkpoint is None:
        raise CaffeCompatError(f"{onnx_path}: give the net prototxt (the model records none)")
    fp16 = bool(meta.get("fp16"))
    tolerance = float(tolerance if tolerance is not None else (FP16_TOLERANCE if fp16 else FP32_TOLERANCE))
    reference = build_embedder(prototxt, weights, checkpoint, meta["output_blob"], bool(meta.get("normalize")),
                               image_size=meta.get("input_shape"))
    session = EmbedderSession(onnx_path, provider)
    fixed = None if meta.get("batch") == "dynamic" else int(meta["batch"])
    result = {"onnx": str(onnx_path), "checker": "passed", "provider": session.provider, "fp16": fp16,
              "tolerance": tolerance, "cases": {}}
    worst_abs = worst_rel = 0.0
    for name, x in _cases(inputs, meta["input_shape"], fixed).items():
        with torch.no_grad():
            ref = reference(torch.from_numpy(x)).numpy()
        out = session(x)
        if out.shape != ref.shape:
            raise FormatError(f"{onnx_path}: ONNX Runtime output shape {out.shape}, PyTorch {ref.shape} "
                              f"(case '{name}')")
        max_abs = float(np.abs(out.astype(np.float64) - ref).max())
        scale = float(np.abs(ref).max())
        max_rel = max_abs / scale if scale > 0 else max_abs
        result["cases"][name] = {"batch": int(x.shape[0]), "max_abs": max_abs, "max_rel": max_rel, "max_ref": scale}
        worst_abs, worst_rel = max(worst_abs, max_abs), max(worst_rel, max_rel)
    result.update(max_abs=worst_abs, max_rel=worst_rel, passed=bool(worst_rel <= tolerance))
    return result

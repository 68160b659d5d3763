"""``verify_onnx``: ``onnx.checker``, then ONNX Runtime against the PyTorch layer ports on the same inputs.

For every input batch ``x`` the reference is the float32 :class:`~caffe_compat.export.embedder.Embedder`
of the same net and weights, ``o`` the ONNX Runtime output.  The batches: ``inputs`` maps a case name to
an ``(N, C, H, W)`` array or to a file read by :func:`load_verify_input` (a ``.npy`` / ``.npz`` array in
the net's input layout, or an image preprocessed from the model's metadata); the case ``"random"`` =
``RandomState(0).randn(2, C, H, W) * 50`` (pixel-scale values) is compared too when ``random`` is true
(default: only when no ``inputs`` are given).  For each case:

    max_abs = max |o − ref|            max_rel = max_abs / max |ref|   (error relative to the output's scale)

``passed`` is ``max_rel <= tolerance`` for every case.  Default tolerance: ``1e-4`` for a float32 model
(the Caffe reference README's whole-net rtol; measured errors are ~1e-6) and ``1e-2`` for a ``fp16``
model (float16 has an 11-bit significand: ~5e-4 per rounding, accumulated over the layers).  The fp16
model is compared with the float32 reference, i.e. the tolerance bounds the precision loss.  A model exported
with ``fuse`` (:mod:`caffe_compat.fuse`) is compared with the **unfused** net; its default tolerance is the
larger of ``1e-4`` and the ``fuse_tolerance`` recorded at export (``2·γ_(K+8)``, K the longest dot product
of a fused step, u = 2⁻²⁴: the float32 rounding of the folded weights and of the reordered sums).

Net and weights default to the ``source`` paths recorded in the model's metadata.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from caffe_compat.errors import CaffeCompatError, DataError, FormatError
from caffe_compat.export.metadata import read_metadata
from caffe_compat.export.onnx_export import build_embedder, example_input
from caffe_compat.export.runtime import EmbedderSession
from caffe_compat.io.safe_open import check_regular_file

__all__ = ["verify_onnx", "load_verify_input", "check_verify_input_path", "FP32_TOLERANCE", "FP16_TOLERANCE",
           "ARRAY_SUFFIXES"]

FP32_TOLERANCE = 1e-4
FP16_TOLERANCE = 1e-2
ARRAY_SUFFIXES = (".npy", ".npz")


def _layout(meta: dict) -> str:
    shape = ", ".join(str(int(d)) for d in meta["input_shape"])
    batch = "N" if meta.get("batch", "dynamic") == "dynamic" else str(int(meta["batch"]))
    return f"({batch}, {shape})"


def check_verify_input_path(path) -> Path:
    """``path`` as a Path if it names a readable file, else :class:`CaffeCompatError` (cheap; no decoding)."""
    path = Path(path)
    if not path.exists():
        raise CaffeCompatError(f"{path}: verification input not found (expected a .npy/.npz array or an image file)")
    if not path.is_file():
        raise CaffeCompatError(f"{path}: verification input is not a file (expected a .npy/.npz array or an image)")
    check_regular_file(path, "the verification input")
    try:
        with path.open("rb"):
            pass
    except OSError as exc:
        raise CaffeCompatError(f"{path}: cannot read the verification input ({exc.strerror or exc})") from None
    return path


def _read_array(path: Path, meta: dict) -> np.ndarray:
    from caffe_compat.io.arrays import load_array_file

    expected = f"an (N, C, H, W) = {_layout(meta)} float array"
    try:  # header checked against the file's size and the memory budget before numpy allocates
        loaded = load_array_file(path, "the verification input")
    except FormatError as exc:
        text = str(exc).replace(f"{path}: not a readable .npy/.npz array", f"{path}: not a readable {path.suffix} file", 1)
        raise FormatError(f"{text}; expected {expected}") from None
    if not isinstance(loaded, np.ndarray):
        with loaded:
            names = list(loaded.files)
            blob = meta.get("input_blob", "data")
            if blob in names:
                name = blob
            elif len(names) == 1:
                name = names[0]
            else:
                raise FormatError(f"{path}: holds {len(names)} arrays {names} and none is named '{blob}' (the model's "
                                  f"input blob); expected one array or one named '{blob}', {expected}")
            try:
                array = loaded[name]
            except FormatError as exc:
                raise FormatError(f"{exc}; expected {expected}") from None
            where = f"{path}['{name}']"
    else:
        array, where = loaded, str(path)
    if array.dtype.kind not in "biuf":
        raise FormatError(f"{where}: dtype {array.dtype}; expected {expected}")
    if array.ndim != 4 or tuple(array.shape[1:]) != tuple(int(d) for d in meta["input_shape"]):
        raise FormatError(f"{where}: shape {tuple(array.shape)}; expected {expected} (the model's input layout)")
    if array.shape[0] < 1:
        raise FormatError(f"{where}: empty batch; expected {expected}")
    fixed = meta.get("batch", "dynamic")
    if fixed != "dynamic" and array.shape[0] != int(fixed):
        raise FormatError(f"{where}: batch {array.shape[0]}; expected {expected} (the model's batch is fixed)")
    array = array.astype(np.float32)
    if not np.isfinite(array).all():
        raise FormatError(f"{where}: contains NaN or infinite values; expected finite {expected}")
    return array


def load_verify_input(path, meta: dict) -> np.ndarray:
    """A verification batch from a file, as float32 ``(N, C, H, W)``; ``meta`` = :func:`read_metadata`'s dict.

    * ``.npy``: the array itself; ``.npz``: the array named after the model's input blob (``"data"`` in a
      fixture's ``blobs.npz``) or the archive's only array.  Either must already be in the net's input
      layout ``(N, C, H, W)`` (the input blob's values, i.e. preprocessed), with the model's batch size
      when that is fixed;
    * anything else is decoded as an image (OpenCV: jpg, png, bmp, ...) and preprocessed with the
      preprocessing stored in the model (:class:`~caffe_compat.export.preprocess.ImagePreprocessor`, the
      one ``caffe-compat evaluate`` uses): batch 1, zero-padded to a fixed batch size like ``evaluate``.

    Every problem (missing or unreadable file, wrong shape, dtype or batch) raises a
    :class:`CaffeCompatError` naming the file and what was expected.
    """
    from caffe_compat.export.preprocess import ImagePreprocessor

    path = check_verify_input_path(path)
    if path.suffix.lower() in ARRAY_SUFFIXES:
        return _read_array(path, meta)
    preprocessor = ImagePreprocessor(meta)
    try:
        blob = preprocessor(path)
    except DataError as exc:  # OpenCV cannot decode it
        raise FormatError(f"{exc} (expected a .npy/.npz array in the layout {_layout(meta)} or an image file "
                          f"OpenCV can decode)") from None
    batch = blob[None].astype(np.float32)
    fixed = meta.get("batch", "dynamic")
    if fixed != "dynamic" and int(fixed) > 1:
        batch = np.concatenate([batch, np.zeros((int(fixed) - 1, *blob.shape), np.float32)])
    return batch


def _check(onnx_path: Path) -> None:
    import onnx

    try:
        onnx.checker.check_model(str(onnx_path), full_check=True)
    except Exception as exc:  # onnx.checker.ValidationError, shape inference errors
        raise FormatError(f"{onnx_path}: onnx.checker rejects the model: {str(exc).strip().splitlines()[0]}") from None


def _cases(inputs, meta, random) -> dict:
    shape = meta["input_shape"]
    fixed_batch = None if meta.get("batch") == "dynamic" else int(meta["batch"])
    if inputs is not None and (not isinstance(inputs, dict) or not inputs):
        raise CaffeCompatError("inputs must be a non-empty dict {case name: (N, C, H, W) array or file path}")
    cases = {}
    if random or (random is None and inputs is None):
        cases["random"] = example_input((1, *shape), fixed_batch or 2).numpy()
    for name, value in (inputs or {}).items():
        if str(name) in cases:
            raise CaffeCompatError(f"input case '{name}' given twice")
        if isinstance(value, (str, os.PathLike)):
            cases[str(name)] = load_verify_input(value, meta)
            continue
        array = np.asarray(value.detach().cpu() if torch.is_tensor(value) else value, dtype=np.float32)
        if array.ndim != 4 or tuple(array.shape[1:]) != tuple(shape):
            raise CaffeCompatError(f"input case '{name}': shape {array.shape}, the model takes "
                                   f"(N, {', '.join(map(str, shape))})")
        if fixed_batch is not None and array.shape[0] != fixed_batch:
            raise CaffeCompatError(f"input case '{name}': batch {array.shape[0]}, the model is fixed to {fixed_batch}")
        cases[str(name)] = array
    return cases


def verify_onnx(onnx_path, prototxt=None, weights=None, checkpoint=None, inputs: dict | None = None,
                tolerance: float | None = None, provider: str | None = "cpu", random: bool | None = None) -> dict:
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
    default = FP16_TOLERANCE if fp16 else max(FP32_TOLERANCE, float(meta.get("fuse_tolerance") or 0.0))
    tolerance = float(tolerance if tolerance is not None else default)
    cases = _cases(inputs, meta, random)  # bad inputs fail before the reference net is built
    reference = build_embedder(prototxt, weights, checkpoint, meta["output_blob"], bool(meta.get("normalize")),
                               image_size=meta.get("input_shape"))
    session = EmbedderSession(onnx_path, provider)
    result = {"onnx": str(onnx_path), "checker": "passed", "provider": session.provider, "fp16": fp16,
              "tolerance": tolerance, "cases": {}}
    for name, x in cases.items():
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
    # np.max propagates a NaN error (a NaN output), which then fails; Python's max() would skip it
    worst_abs = float(np.max([c["max_abs"] for c in result["cases"].values()]))
    worst_rel = float(np.max([c["max_rel"] for c in result["cases"].values()]))
    passed = all(c["max_rel"] <= tolerance for c in result["cases"].values())
    result.update(max_abs=worst_abs, max_rel=worst_rel, passed=bool(passed))
    return result

"""Turning user arrays into the tensors every metric works on.

Features may be a numpy array or a torch tensor of shape ``(N, D)`` (any float dtype; from PyTorch, from
Caffe blobs, from ONNX Runtime alike); they are cast to float32 and L2-normalised row-wise with the
``F.normalize`` convention (a zero row stays zero, so its cosine with everything is 0). Labels may be
any 1-D integer array or tensor (numpy string arrays work too); they are replaced by dense codes
``0..C-1`` in sorted label order, so only label *equality* matters. ``device=None`` means the features'
own device for a tensor and the CPU for a numpy array.  :func:`parse_device` turns a user's device option
(``auto``, ``cpu``, ``cuda``, ``cuda:N``) into a checked ``torch.device``.

Bad input (wrong rank, length mismatch, NaN/Inf, fewer than two items) raises
:class:`EvaluationInputError`, a :class:`~caffe_compat.errors.CaffeCompatError`.
"""

from __future__ import annotations

import numpy as np
import torch

from caffe_compat.errors import CaffeCompatError


class EvaluationInputError(CaffeCompatError):
    """Features or labels handed to a metric are malformed (shape, length, dtype, non-finite values)."""


def resolve_device(features, device=None) -> torch.device:
    """The device metrics run on: ``device`` if given, else the tensor's device, else the CPU."""
    if device is not None:
        return torch.device(device)
    if isinstance(features, torch.Tensor):
        return features.device
    return torch.device("cpu")


DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"


def cuda_missing(asked: str, remedy: str) -> CaffeCompatError:
    """The error for ``asked`` (the option and value that asked for CUDA) where this torch sees no CUDA
    device: which torch, whether it was built with CUDA, and ``remedy`` (how to run on the CPU)."""
    build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", built without CUDA")
    return CaffeCompatError(f"{asked}: CUDA is not available ({build}; torch.cuda.is_available() is False); {remedy}")


def parse_device(spec=None, *, option: str = "--device", allow_auto: bool = True) -> torch.device:
    """A checked ``torch.device`` from a user's option value.

    ``None``/``"auto"``: CUDA when ``torch.cuda.is_available()``, else the CPU; ``"cpu"``; ``"cuda"`` or
    ``"cuda:N"``: only when this torch build sees a CUDA device (N in ``0..device_count-1``).  Anything else
    raises :class:`~caffe_compat.errors.CaffeCompatError` naming ``option`` (the CLI's exit status 2).
    """
    if isinstance(spec, torch.device):
        spec = str(spec)
    if spec is None or (allow_auto and str(spec).strip().lower() == "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    text = str(spec).strip().lower()
    choices = DEVICE_CHOICES if allow_auto else "cpu, cuda or cuda:N"
    kind, _, index = text.partition(":")
    if kind == "cpu" and not index:
        return torch.device("cpu")
    if kind != "cuda" or (_ and not index.isdigit()):
        raise CaffeCompatError(f"{option} must be {choices}, got {spec!r}")
    if not torch.cuda.is_available():
        raise cuda_missing(f"{option} {spec}", f"use {option} cpu")
    count = torch.cuda.device_count()
    if index and int(index) >= count:
        raise CaffeCompatError(f"{option} {spec}: no such CUDA device; this machine has {count} "
                               f"(cuda:0..cuda:{count - 1})")
    return torch.device("cuda", int(index)) if index else torch.device("cuda")


def as_features(features, device=None, *, name: str = "features", normalize: bool = True) -> torch.Tensor:
    """``(N, D)`` float32 tensor on ``device``, rows L2-normalised when ``normalize``."""
    if isinstance(features, torch.Tensor):
        x = features.detach()
    elif isinstance(features, np.ndarray):
        if not np.issubdtype(features.dtype, np.number) or np.issubdtype(features.dtype, np.complexfloating):
            raise EvaluationInputError(f"{name}: expected a real numeric array, got dtype {features.dtype}")
        x = torch.from_numpy(np.ascontiguousarray(features))
    else:
        raise EvaluationInputError(f"{name}: expected a numpy array or a torch tensor, got {type(features).__name__}")
    if x.dim() != 2:
        raise EvaluationInputError(f"{name}: expected shape (N, D), got {tuple(x.shape)}")
    if x.shape[0] < 2 or x.shape[1] < 1:
        raise EvaluationInputError(f"{name}: need at least 2 items of dimension >= 1, got {tuple(x.shape)}")
    if x.is_complex() or x.dtype == torch.bool:
        raise EvaluationInputError(f"{name}: expected real numbers, got {x.dtype}")
    x = x.to(device=resolve_device(features, device), dtype=torch.float32)
    # A NaN or ±inf entry makes its row's 2-norm NaN or inf (squares cannot cancel), so finite norms
    # clear the whole matrix at the cost of one reduction; only an overflowing norm (|x| ~ 1e19 and up)
    # or a bad entry needs the element-wise check (CPU ``isfinite``: ~5x a norm).
    norms = x.norm(2, 1, keepdim=True)
    if not bool(torch.isfinite(norms).all()) and not bool(torch.isfinite(x).all()):
        raise EvaluationInputError(f"{name}: contains NaN or Inf")
    if normalize:  # ``F.normalize(x, dim=1, eps=1e-12)``'s own two operations, on the norms just taken
        x = x / norms.clamp_min(1e-12).expand_as(x)
    return x


def as_labels(labels, n: int, device, *, name: str = "labels") -> torch.Tensor:
    """Dense int64 codes ``0..C-1`` (sorted label order) of a length-``n`` label vector, on ``device``."""
    if isinstance(labels, torch.Tensor):
        lab = labels.detach().reshape(-1) if labels.dim() == 2 and labels.shape[1] == 1 else labels.detach()
        if lab.dim() != 1:
            raise EvaluationInputError(f"{name}: expected a 1-D vector, got shape {tuple(labels.shape)}")
        if lab.is_floating_point():
            if not bool((lab == lab.round()).all()):
                raise EvaluationInputError(f"{name}: float labels must hold whole numbers")
            lab = lab.to(torch.int64)
        elif lab.is_complex():
            raise EvaluationInputError(f"{name}: complex labels are not supported")
        codes = torch.unique(lab, return_inverse=True)[1]
    else:
        arr = np.asarray(labels)
        if arr.ndim == 2 and arr.shape[1] == 1:
            arr = arr.reshape(-1)
        if arr.ndim != 1:
            raise EvaluationInputError(f"{name}: expected a 1-D vector, got shape {arr.shape}")
        if arr.dtype.kind == "f" and not np.all(arr == np.round(arr)):
            raise EvaluationInputError(f"{name}: float labels must hold whole numbers")
        if arr.dtype.kind not in "biufUS":
            raise EvaluationInputError(f"{name}: unsupported label dtype {arr.dtype}")
        codes = torch.from_numpy(np.unique(arr, return_inverse=True)[1].reshape(-1).astype(np.int64))
    if codes.shape[0] != n:
        raise EvaluationInputError(f"{name}: {codes.shape[0]} labels for {n} feature rows")
    return codes.to(device=device, dtype=torch.int64)


def as_ks(ks, name: str = "ks") -> tuple[int, ...]:
    """Validated, de-duplicated, sorted tuple of positive integer cut-offs."""
    try:
        values = tuple(sorted({int(k) for k in ks}))
    except (TypeError, ValueError) as exc:
        raise EvaluationInputError(f"{name}: expected integers, got {ks!r}") from exc
    if not values or values[0] < 1 or any(int(k) != k for k in ks):
        raise EvaluationInputError(f"{name}: expected positive integers, got {ks!r}")
    return values

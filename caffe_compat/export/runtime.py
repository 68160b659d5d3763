"""ONNX Runtime sessions for exported embedders, and the choice of execution provider.

``provider``: ``"cuda"`` asks for ``CUDAExecutionProvider`` (falling back to the CPU when the installed
onnxruntime has no CUDA provider or it cannot start, e.g. no GPU or no CUDA libraries), ``"cpu"`` uses
``CPUExecutionProvider`` only, ``None`` means "CUDA if it works, else CPU".  What the session really
uses is read back from ``session.get_providers()`` and reported (:attr:`EmbedderSession.provider`),
never assumed: when ``"cuda"`` was asked and the session runs on another provider, a
:class:`~caffe_compat.export.notices.ProviderFallbackWarning` names the provider used and why (the CLI
prints it on stderr).  ``threads`` sets ``intra_op_num_threads`` (0 = ONNX Runtime's default: one per core).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

from caffe_compat.errors import CaffeCompatError, FormatError
from caffe_compat.export.notices import ProviderFallbackWarning

__all__ = ["PROVIDERS", "EmbedderSession", "make_session"]

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


def make_session(model, provider: str | None = "cpu", threads: int = 0):
    """An ``onnxruntime.InferenceSession`` for ``model`` (path or bytes); see the module docstring."""
    import onnxruntime as ort

    if provider not in (None, "cpu", "cuda"):
        raise CaffeCompatError(f"provider must be 'cpu', 'cuda' or None (auto), got {provider!r}")
    if isinstance(model, (str, Path)) and not Path(model).is_file():
        raise CaffeCompatError(f"{model}: no such ONNX file")
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if threads:
        options.intra_op_num_threads = int(threads)
    source = str(model) if isinstance(model, (str, Path)) else model
    if isinstance(source, str):
        from caffe_compat.io.safe_open import check_regular_file

        check_regular_file(source, "the ONNX model")
    want_cuda = provider != "cpu" and PROVIDERS["cuda"] in ort.get_available_providers()
    providers = [PROVIDERS["cuda"], PROVIDERS["cpu"]] if want_cuda else [PROVIDERS["cpu"]]
    if want_cuda:
        ort.set_default_logger_severity(4)  # a CUDA provider that cannot load logs an error, then falls back
    try:
        session = ort.InferenceSession(source, options, providers=providers)
    except Exception as exc:  # onnxruntime raises its own pybind types (InvalidGraph, Fail, ...)
        raise FormatError(f"{model if isinstance(model, (str, Path)) else 'model'}: ONNX Runtime cannot load it "
                          f"({type(exc).__name__}: {str(exc).strip().splitlines()[0]})") from None
    finally:
        if want_cuda:
            ort.set_default_logger_severity(2)
    used = session.get_providers()[0]
    if provider == "cuda" and used != PROVIDERS["cuda"]:
        why = ("the installed onnxruntime has no CUDAExecutionProvider" if not want_cuda else
               "CUDAExecutionProvider could not start (no GPU, or CUDA/cuDNN libraries missing)")
        warnings.warn(f"ONNX Runtime was asked for CUDAExecutionProvider but runs on {used}: {why}",
                      ProviderFallbackWarning, stacklevel=2)
    return session


class EmbedderSession:
    """An exported embedder ready to run: ``session(batch) -> (N, D) float32`` features."""

    def __init__(self, model, provider: str | None = "cpu", threads: int = 0):
        self.session = make_session(model, provider, threads)
        self.input_name = self.session.get_inputs()[0].name
        self.output_name = self.session.get_outputs()[0].name
        self.provider = self.session.get_providers()[0]
        self.requested = provider

    def __call__(self, batch) -> np.ndarray:
        batch = np.ascontiguousarray(batch, dtype=np.float32)
        return self.session.run([self.output_name], {self.input_name: batch})[0]

"""Deployment: Caffe embedders as ONNX files and their evaluation with ONNX Runtime.

* :func:`export_onnx` cuts a TEST-phase net at its embedding blob (optionally L2-normalised, float16,
  dynamic or fixed batch; traced, or with ``compile`` captured by ``torch.export``) and stores the
  preprocessing in the model's metadata;
* :func:`verify_onnx` runs ``onnx.checker`` and compares ONNX Runtime with the PyTorch layer ports;
* :func:`evaluate_onnx` embeds a data set's test split(s) with ONNX Runtime and applies the paper's
  protocol (:data:`caffe_compat.evaluate.PROTOCOLS`).

Direction of dependence: export -> {net, data, evaluate}; nothing in the library imports this package.
"""

from caffe_compat.export.embedder import Embedder, cut_steps
from caffe_compat.export.evaluate import evaluate_onnx
from caffe_compat.export.metadata import read_metadata
from caffe_compat.export.onnx_export import export_onnx
from caffe_compat.export.runtime import EmbedderSession, make_session
from caffe_compat.export.verify import verify_onnx

__all__ = ["Embedder", "EmbedderSession", "cut_steps", "evaluate_onnx", "export_onnx", "make_session",
           "read_metadata", "verify_onnx"]

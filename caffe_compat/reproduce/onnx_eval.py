"""The reproduce pipeline's deployment step: export the trained embedder to ONNX, then compute the
test-set features with ONNX Runtime and evaluate them with the data set's protocol (its k-NN on the
training device; ONNX Runtime on CUDA for a CUDA device, with a warning when it falls back to the CPU)."""

from __future__ import annotations

from pathlib import Path


def export_embedder(deploy, caffemodel, output_blob: str, path: Path, preprocessing: dict) -> Path:
    from caffe_compat.export import export_onnx

    export_onnx(str(deploy), weights=str(caffemodel), output_blob=output_blob, path=str(path), normalize=True,
                preprocessing=preprocessing)
    return Path(path)


def evaluate_onnx_embedder(setup, onnx_path: Path, root: Path, device: str = "cpu", batch_size: int = 64,
                           progress: bool = True) -> dict:
    from caffe_compat.export import evaluate_onnx

    return evaluate_onnx(onnx_path, setup.protocol, root, provider="cuda" if device.startswith("cuda") else "cpu",
                         batch_size=batch_size, progress=progress, device=device)

"""``evaluate_onnx``: test-set features from an exported embedder with ONNX Runtime, then the protocol.

1. the test split(s) are read with the data set's reader (``read_cub200(root, "test")``,
   ``read_sop(root, "test")``, ``read_vehicleid(root, s)`` for s in small/medium/large);
2. every distinct image (VehicleID's lists are nested, so each image is embedded once) is preprocessed
   from the model's metadata (:class:`~caffe_compat.export.preprocess.ImagePreprocessor`) and embedded by
   ONNX Runtime in batches of ``batch_size`` (a model with a fixed batch runs with that size, the last
   batch zero-padded and trimmed);
3. the features go to ``caffe_compat.evaluate.PROTOCOLS[protocol]`` (cosine on L2-normalised rows):
   ``evaluate_cub200(features, labels)``, ``evaluate_sop(features, labels)`` or
   ``evaluate_vehicleid({split: (features, vehicle_ids)})``, with the k-NN searches on ``device``:
   ``"auto"`` (default; CUDA when torch has it, else the CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``
   (:func:`caffe_compat.evaluate.inputs.parse_device`; an unusable device raises CaffeCompatError).  The
   metrics are the same on either device (the k-NN engine's fixed-shape tiles and exact tie order).

The returned dict is the protocol's, plus ``"provider"`` (the execution provider ONNX Runtime really used),
``"knn_device"`` (where the metrics ran), ``"onnx"`` and ``"split"``.  ``split=None`` means the test split(s); a name (or, for VehicleID, a list of
names) overrides it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from caffe_compat.errors import CaffeCompatError
from caffe_compat.export.metadata import read_metadata
from caffe_compat.export.preprocess import ImagePreprocessor
from caffe_compat.export.runtime import EmbedderSession

__all__ = ["embed_images", "evaluate_onnx", "read_protocol_records"]

VEHICLEID_SPLITS = ("small", "medium", "large")


def read_protocol_records(protocol: str, root, split=None) -> dict:
    """``{split name: records}`` the protocol evaluates."""
    from caffe_compat.data import read_cub200, read_sop, read_vehicleid

    root = Path(root)
    if not root.exists():
        raise CaffeCompatError(f"data root {root} does not exist")
    if protocol == "vehicleid":
        names = VEHICLEID_SPLITS if split is None else ((split,) if isinstance(split, str) else tuple(split))
        bad = [s for s in names if s not in VEHICLEID_SPLITS]
        if bad or not names:
            raise CaffeCompatError(f"VehicleID splits must be among {VEHICLEID_SPLITS}, got {list(names)}")
        return {name: read_vehicleid(root, name) for name in names}
    reader = {"cub200": read_cub200, "sop": read_sop}[protocol]
    name = split or "test"
    return {name: reader(root, name)}


def embed_images(session: EmbedderSession, paths, preprocessor: ImagePreprocessor, batch_size: int = 64,
                 fixed_batch: int | None = None, progress: bool = True, desc: str = "embedding") -> np.ndarray:
    """``(len(paths), D)`` float32 features, ``batch_size`` images per ONNX Runtime call."""
    from tqdm import tqdm

    size = fixed_batch or int(batch_size)
    if size < 1:
        raise CaffeCompatError(f"batch size must be >= 1, got {batch_size}")
    chunks = []
    with tqdm(total=len(paths), desc=desc, unit="img", disable=not progress, file=sys.stderr) as bar:
        for start in range(0, len(paths), size):
            batch = np.stack([preprocessor(p) for p in paths[start:start + size]])
            count = len(batch)
            if fixed_batch and count < fixed_batch:
                batch = np.concatenate([batch, np.zeros((fixed_batch - count, *batch.shape[1:]), batch.dtype)])
            chunks.append(session(batch)[:count])
            bar.update(count)
    if not chunks:
        raise CaffeCompatError("no images to embed")
    return np.concatenate(chunks).astype(np.float32, copy=False)


def evaluate_onnx(onnx_path, protocol: str, root, provider: str | None = "cpu", batch_size: int = 64,
                  progress: bool = True, split=None, device="auto") -> dict:
    """Evaluate the embedder ``onnx_path`` on data set ``root`` (see the module docstring)."""
    from caffe_compat.evaluate import PROTOCOLS
    from caffe_compat.evaluate.inputs import parse_device

    knn_device = parse_device(device, option="device")
    if protocol not in PROTOCOLS:
        raise CaffeCompatError(f"protocol must be one of {sorted(PROTOCOLS)}, got {protocol!r}")
    onnx_path = Path(onnx_path)
    if not onnx_path.is_file():
        raise CaffeCompatError(f"{onnx_path}: no such ONNX file")
    meta = read_metadata(onnx_path)
    preprocessor = ImagePreprocessor(meta, str(onnx_path))  # its metadata checked before anything is read
    per_split = read_protocol_records(protocol, root, split)
    session = EmbedderSession(onnx_path, provider)
    paths = list(dict.fromkeys(str(r.path) for records in per_split.values() for r in records))
    fixed = None if meta.get("batch") == "dynamic" else int(meta["batch"])
    features = embed_images(session, paths, preprocessor, batch_size, fixed, progress, desc=f"{protocol} features")
    row = {p: i for i, p in enumerate(paths)}
    arrays = {}
    for name, records in per_split.items():
        index = np.fromiter((row[str(r.path)] for r in records), dtype=np.int64, count=len(records))
        arrays[name] = (features[index], np.asarray([r.label for r in records], dtype=np.int64))
    if protocol == "vehicleid":
        result = PROTOCOLS[protocol](arrays, device=knn_device)
    else:
        (name, (feats, labels)), = arrays.items()
        result = PROTOCOLS[protocol](feats, labels, device=knn_device)
    result["provider"] = session.provider
    result["knn_device"] = str(knn_device)
    result["onnx"] = str(onnx_path)
    result["split"] = list(per_split) if protocol == "vehicleid" else next(iter(per_split))
    return result

"""What an exported embedder needs at inference, stored in the ONNX model's ``metadata_props``.

Every entry is a key with a **JSON** value, so ``onnxruntime``'s ``get_modelmeta().custom_metadata_map``
or Netron show it and :func:`read_metadata` gives the Python values back:

==================  ===============================================================================
key                 value
==================  ===============================================================================
format              ``"caffe-compat-onnx/1"``
input_blob          graph input name = the Caffe input blob (``"data"``)
input_shape         ``[C, H, W]`` the net takes (the batch axis is ``"batch"`` or the fixed size)
channel_order       ``"BGR"`` (Caffe/OpenCV) or ``"RGB"``: order of the channels fed to the net
resize              ``[new_height, new_width]`` for OpenCV's ``cv2.resize`` (INTER_LINEAR) or ``null``
crop_size           centre crop side (Caffe TEST phase), 0 = none
mean_value          per-channel means in ``channel_order`` (one value = all channels), ``[]`` = none
scale               multiplier applied after the mean subtraction (Caffe's ``scale``)
output_blob         the Caffe blob cut at; graph output name
embedding_dim       D of the ``(N, D)`` output
normalize           whether the graph L2-normalises the rows
fp16                whether weights/arithmetic are float16 (input and output stay float32)
batch               ``"dynamic"`` or the fixed batch size
opset               the ONNX opset
source              ``{"net": name, "prototxt": path, "weights": path, "checkpoint": path}``
preprocessing_derived  ``true`` when no preprocessing was given and it was derived from the net
==================  ===============================================================================

Preprocessing follows Caffe's ImageData + DataTransformer in the TEST phase: decode BGR with OpenCV,
resize (if set), reorder channels (if RGB), centre crop, subtract the mean, multiply by ``scale``.
With no preprocessing given the derived default is "resize to the input size, no crop, no mean, scale 1,
BGR"; a given dict must produce exactly the net's input size or :class:`FormatError` is raised.
"""

from __future__ import annotations

import json
import math

from caffe_compat.errors import FormatError

FORMAT = "caffe-compat-onnx/1"
PREPROCESSING_KEYS = ("channel_order", "resize", "crop_size", "mean_value", "scale", "input_blob")

__all__ = ["FORMAT", "PREPROCESSING_KEYS", "normalize_preprocessing", "read_metadata", "write_metadata"]


def _resize_pair(value, where: str):
    if value is None or value == 0:
        return None
    if isinstance(value, bool):
        raise FormatError(f"{where}: resize must be an int or [height, width], got {value!r}")
    if isinstance(value, (int, float)):
        value = [value, value]
    try:
        pair = [int(v) for v in value]
    except (TypeError, ValueError):
        raise FormatError(f"{where}: resize must be an int or [height, width], got {value!r}") from None
    if len(pair) != 2 or min(pair) < 1:
        raise FormatError(f"{where}: resize must be a positive int or [height, width], got {value!r}")
    return pair


def normalize_preprocessing(preprocessing: dict | None, input_blob: str, input_shape, where: str = "export") -> dict:
    """A complete, validated preprocessing dict for an input of shape ``(N, C, H, W)``."""
    if len(input_shape) != 4:
        raise FormatError(f"{where}: input blob '{input_blob}' has shape {tuple(input_shape)}; image preprocessing "
                          f"needs (N, C, H, W)")
    channels, height, width = (int(d) for d in input_shape[1:])
    if preprocessing is None:
        return {"channel_order": "BGR", "resize": [height, width], "crop_size": 0, "mean_value": [], "scale": 1.0,
                "input_blob": input_blob, "preprocessing_derived": True}
    unknown = sorted(set(preprocessing) - set(PREPROCESSING_KEYS))
    if unknown:
        raise FormatError(f"{where}: unknown preprocessing keys {unknown}; known: {list(PREPROCESSING_KEYS)}")
    order = str(preprocessing.get("channel_order", "BGR")).upper()
    if order not in ("BGR", "RGB"):
        raise FormatError(f"{where}: channel_order must be 'BGR' or 'RGB', got {preprocessing['channel_order']!r}")
    if order == "RGB" and channels != 3:
        raise FormatError(f"{where}: channel_order RGB needs 3 channels, input blob '{input_blob}' has {channels}")
    blob = preprocessing.get("input_blob", input_blob)
    if blob != input_blob:
        raise FormatError(f"{where}: preprocessing names input blob '{blob}', the exported cut reads '{input_blob}'")
    resize = _resize_pair(preprocessing.get("resize"), where)
    crop = int(preprocessing.get("crop_size", 0) or 0)
    if crop < 0:
        raise FormatError(f"{where}: crop_size must be >= 0, got {crop}")
    means = preprocessing.get("mean_value", [])
    means = [float(means)] if isinstance(means, (int, float)) else [float(m) for m in (means or [])]
    if len(means) not in (0, 1, channels):
        raise FormatError(f"{where}: mean_value needs 1 or {channels} values, got {len(means)}")
    scale = float(preprocessing.get("scale", 1.0))
    if not math.isfinite(scale):
        raise FormatError(f"{where}: scale must be finite, got {scale}")
    produced = (crop, crop) if crop else (tuple(resize) if resize else None)
    if produced is not None and produced != (height, width):
        raise FormatError(f"{where}: preprocessing yields {produced[0]}x{produced[1]} images, input blob "
                          f"'{input_blob}' is {height}x{width}")
    if crop and resize and (resize[0] < crop or resize[1] < crop):
        raise FormatError(f"{where}: resize {resize} is smaller than crop_size {crop}")
    return {"channel_order": order, "resize": resize, "crop_size": crop, "mean_value": means, "scale": scale,
            "input_blob": input_blob, "preprocessing_derived": False}


def write_metadata(model, values: dict) -> None:
    """Set ``values`` (JSON-able) as the model's metadata_props, replacing entries with the same keys."""
    keep = [p for p in model.metadata_props if p.key not in values]
    del model.metadata_props[:]
    for prop in keep:
        model.metadata_props.add(key=prop.key, value=prop.value)
    for key, value in values.items():
        model.metadata_props.add(key=key, value=json.dumps(value))


def read_metadata(model_or_path) -> dict:
    """The metadata of an exported embedder as Python values (an ONNX path, bytes or ModelProto)."""
    import onnx

    where = "model"
    if isinstance(model_or_path, onnx.ModelProto):
        model = model_or_path
    else:
        where = str(model_or_path) if not isinstance(model_or_path, bytes) else "model bytes"
        try:
            model = onnx.load_model_from_string(model_or_path) if isinstance(model_or_path, bytes) else onnx.load(
                str(model_or_path), load_external_data=False)
        except FileNotFoundError:
            raise FormatError(f"{where}: no such ONNX file") from None
        except Exception as exc:  # onnx raises DecodeError and friends on a foreign file
            raise FormatError(f"{where}: not a readable ONNX model ({type(exc).__name__}: {exc})") from None
    values = {}
    for prop in model.metadata_props:
        try:
            values[prop.key] = json.loads(prop.value)
        except json.JSONDecodeError:
            values[prop.key] = prop.value
    if values.get("format") != FORMAT:
        raise FormatError(f"{where}: not a caffe-compat embedder (metadata 'format' is {values.get('format')!r}, "
                          f"expected {FORMAT!r}); export it with caffe-compat export")
    return values

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
mean_file           the ``.binaryproto`` a mean image was read from (informative), or ``null``
mean_image          that mean image itself, ``{"shape": [C, H, W], "dtype": "float32", "base64": ...}``
                    (little-endian float32 bytes, C order), or ``null``; subtracted before the crop at
                    the crop offset, like Caffe's ``mean_file`` (so it has the pre-crop image size)
scale               multiplier applied after the mean subtraction (Caffe's ``scale``)
output_blob         the Caffe blob cut at; graph output name
embedding_dim       D of the ``(N, D)`` output
normalize           whether the graph L2-normalises the rows
fp16                whether weights/arithmetic are float16 (input and output stay float32)
batch               ``"dynamic"`` or the fixed batch size
opset               the ONNX opset
source              ``{"net": name, "prototxt": path, "weights": path, "checkpoint": path}``
preprocessing_derived  ``true`` when no preprocessing was given (read from the net or assumed)
preprocessing_source   ``"given"``, ``"data layer '<name>' (<type>)"`` (its ``transform_param`` / the
                    authors' ``param_str``) or ``"assumed"``
preprocessing_assumed  list of what was assumed rather than known (empty when nothing was)
==================  ===============================================================================

Preprocessing follows Caffe's ImageData + DataTransformer in the TEST phase: decode BGR with OpenCV,
resize (if set), reorder channels (if RGB), centre crop, subtract the mean, multiply by ``scale``.
A given dict may name a ``mean_file`` (a ``.binaryproto``, read with :func:`caffe_compat.io.read_blob`
relative to the working directory, like Caffe; stored whole in ``mean_image``, so inference needs no side
file).  Without a given dict, :func:`caffe_compat.export.onnx_export.export_onnx` reads the preprocessing
from the net's TEST-phase data layer (:func:`preprocessing_from_data_layer`); with no such layer the
default is "resize to the input size, no crop, no mean, scale 1, BGR", recorded as ``"assumed"`` and
announced by a :class:`~caffe_compat.export.notices.PreprocessingAssumedWarning`.  A dict must produce
exactly the net's input size or :class:`FormatError` is raised.
"""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path

import numpy as np

from caffe_compat.errors import CaffeCompatError, FormatError
from caffe_compat.io.safe_open import PROTOBUF_MAX_BYTES, check_regular_file, require_regular_file

FORMAT = "caffe-compat-onnx/1"
PREPROCESSING_KEYS = ("channel_order", "resize", "crop_size", "mean_value", "mean_file", "scale", "input_blob")

__all__ = ["FORMAT", "PREPROCESSING_KEYS", "assumed_preprocessing", "check_preprocessing_metadata",
           "decode_mean_image", "encode_mean_image",
           "normalize_preprocessing", "preprocessing_from_data_layer", "read_mean_file", "read_metadata",
           "write_metadata"]


def read_mean_file(path, where: str) -> np.ndarray:
    """A mean ``.binaryproto`` as a float32 ``(C, H, W)`` array; FormatError naming ``where`` and the file."""
    from caffe_compat.io import read_blob

    path = Path(path)
    require_regular_file(path, f"{where}: mean_file", error=FormatError,
                         missing=lambda: f"{where}: mean_file '{path}' not found (read relative to the working "
                                         f"directory {Path.cwd()}, as Caffe does)")
    try:
        mean = np.asarray(read_blob(path), dtype=np.float32)
    except CaffeCompatError as exc:
        raise FormatError(f"{where}: mean_file '{path}' is not a readable BlobProto ({exc})") from None
    if mean.ndim == 4 and mean.shape[0] == 1:
        mean = mean[0]
    if mean.ndim != 3:
        raise FormatError(f"{where}: mean_file '{path}' has shape {mean.shape}; a mean image is (C, H, W) "
                          f"or (1, C, H, W)")
    return mean


def encode_mean_image(mean: np.ndarray) -> dict:
    data = np.ascontiguousarray(mean, dtype="<f4")
    return {"shape": [int(d) for d in data.shape], "dtype": "float32",
            "base64": base64.b64encode(data.tobytes()).decode("ascii")}


def decode_mean_image(value) -> np.ndarray | None:
    """The ``mean_image`` metadata entry back as a float32 ``(C, H, W)`` array (None when absent)."""
    if value is None:
        return None
    try:
        shape = tuple(int(d) for d in value["shape"])
        data = np.frombuffer(base64.b64decode(value["base64"]), dtype="<f4")
        return data.reshape(shape).astype(np.float32)
    except (KeyError, TypeError, ValueError) as exc:
        raise FormatError(f"metadata 'mean_image' is malformed ({exc})") from None


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
                "mean_file": None, "mean_image": None, "input_blob": input_blob, "preprocessing_derived": True}
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
    mean_file, mean_image = preprocessing.get("mean_file"), None
    if mean_file is not None:
        if not isinstance(mean_file, (str, Path)) or not str(mean_file).strip():
            raise FormatError(f"{where}: mean_file must be the path of a .binaryproto, got {mean_file!r}")
        if means:
            raise FormatError(f"{where}: give mean_file or mean_value, not both (Caffe refuses both)")
        mean = read_mean_file(mean_file, f"{where}: preprocessing")
        _check_mean_shape(mean, str(mean_file), channels, (height, width), resize, crop, where)
        mean_file, mean_image = str(mean_file), encode_mean_image(mean)
    return {"channel_order": order, "resize": resize, "crop_size": crop, "mean_value": means, "scale": scale,
            "mean_file": mean_file, "mean_image": mean_image, "input_blob": input_blob,
            "preprocessing_derived": False}


def _check_mean_shape(mean, name, channels, input_hw, resize, crop, where) -> None:
    """Caffe subtracts a mean image from the uncropped image: it must have the image's size."""
    if mean.shape[0] != channels:
        raise FormatError(f"{where}: mean_file '{name}' has {mean.shape[0]} channels, the net takes {channels}")
    size = tuple(mean.shape[1:])
    if resize and size != tuple(resize):
        raise FormatError(f"{where}: mean_file '{name}' is {size[0]}x{size[1]}, the resized images "
                          f"{resize[0]}x{resize[1]}; the mean is subtracted before the crop, so they must agree")
    if not resize and not crop and size != tuple(input_hw):
        raise FormatError(f"{where}: mean_file '{name}' is {size[0]}x{size[1]}, the net's input "
                          f"{input_hw[0]}x{input_hw[1]}")
    if crop and (size[0] < crop or size[1] < crop):
        raise FormatError(f"{where}: mean_file '{name}' is {size[0]}x{size[1]}, smaller than crop_size {crop}")


def assumed_preprocessing(input_shape) -> list[str]:
    """What the default preprocessing assumes for an input of shape ``(N, C, H, W)`` (warning text)."""
    height, width = (int(d) for d in input_shape[2:4])
    return [f"resize to {height}x{width} (the net's input size)", "no crop", "no mean subtraction", "scale 1",
            "BGR channel order"]


def _layer_mean(path, where: str) -> np.ndarray:
    try:
        return read_mean_file(path, where)
    except FormatError as exc:
        raise FormatError(f"{exc}; the exported model needs the data layer's mean: run export from the directory "
                          f"Caffe ran in, or give the preprocessing explicitly (--preprocessing)") from None


def preprocessing_from_data_layer(layer) -> tuple[dict | None, list[str]]:
    """The preprocessing a TEST-phase data layer applies, as a dict for :func:`normalize_preprocessing`, and
    the list of what had to be assumed; ``(None, [])`` when the layer says nothing about it.

    The facts are the port's (``input_facts``, see :func:`~caffe_compat.export.source.data_layer_facts`):

    * ``transform_param`` (Data, ImageData, ...): ``crop_size``, ``mean_value``, ``mean_file``, ``scale``
      (``mirror`` is a training augmentation: off).  The resize is the layer's (ImageData's
      ``new_height``/``new_width``), else the mean file's size (Caffe needs the stored images to have
      it), else unknown: images are used at their stored size (noted as assumed);
    * the FAPPY authors' ``LabelShufflingLayer`` (Python): ``mean_file`` from its ``param_str`` (subtracted
      whole, no crop) and ``scales[0]``.
    """
    from caffe_compat.export.source import data_layer_facts

    where = f"data layer '{layer.name}' ({layer.type})"
    facts = data_layer_facts(layer)
    if not facts.preprocessing:
        return None, []
    spec = {"channel_order": "BGR", "crop_size": int(facts.crop)}
    if facts.mean_value is not None:
        spec["mean_value"] = [float(v) for v in facts.mean_value]
    if facts.scale is not None:
        spec["scale"] = float(facts.scale)
    resize = list(facts.resize) if facts.resize else None
    if facts.mean_file:
        mean = _layer_mean(facts.mean_file, f"{where} {'param_str' if layer.type == 'Python' else 'transform_param'}")
        spec["mean_file"] = str(facts.mean_file)
        resize = resize or [int(d) for d in mean.shape[1:]]
    notes = []
    if resize is not None:
        spec["resize"] = resize
    else:
        notes.append(f"resize: none (images used at their stored size, which {facts.stored_size_by} decides "
                     f"and export does not open)")
    return spec, notes


def _number(value, key: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise FormatError(f"{where}: metadata '{key}' must be a finite number, got {value!r}")
    return float(value)


def check_preprocessing_metadata(meta: dict, where: str = "model") -> dict:
    """The preprocessing entries of a model's metadata (``input_shape``, ``channel_order``, ``resize``,
    ``crop_size``, ``mean_value``, ``mean_image``, ``scale``), checked before any image is read: a typed
    error naming ``where`` (the ONNX file) and the entry for anything :func:`normalize_preprocessing` would
    not have written -- a NaN or infinite scale or mean, a channel order other than BGR/RGB, a resize that
    is not two positive sizes, a crop larger than the resized image -- and a MemoryBudgetError for a
    resize whose image exceeds the memory budget (``resize: [100000, 100000]``).  Returns the entries as
    ``{"input_shape": (C, H, W), "resize": (h, w) or None, "rgb": bool, "crop_size": int,
    "mean_value": [...], "mean_image": array or None, "scale": float}``."""
    from caffe_compat.errors import MemoryBudgetError
    from caffe_compat.io.safe_open import memory_budget

    shape = meta.get("input_shape")
    if (not isinstance(shape, list) or len(shape) != 3
            or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in shape)):
        raise FormatError(f"{where}: metadata 'input_shape' must be [C, H, W] of positive ints, got {shape!r}")
    channels = shape[0]
    order = meta.get("channel_order", "BGR")
    if not isinstance(order, str) or order.upper() not in ("BGR", "RGB"):
        raise FormatError(f"{where}: metadata 'channel_order' must be 'BGR' or 'RGB', got {order!r}")
    if order.upper() == "RGB" and channels != 3:
        raise FormatError(f"{where}: metadata 'channel_order' RGB needs 3 channels, 'input_shape' has {channels}")
    raw_resize = meta.get("resize")
    if raw_resize is not None and not (isinstance(raw_resize, list) and len(raw_resize) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) for v in raw_resize)):
        raise FormatError(f"{where}: metadata 'resize' must be [height, width] or null, got {raw_resize!r}")
    resize = _resize_pair(raw_resize, f"{where}: metadata")
    if resize is not None:
        need, budget = resize[0] * resize[1] * channels, memory_budget()
        if need > budget:
            raise MemoryBudgetError(f"{where}: metadata 'resize' {resize} needs {need} bytes per image, more than "
                                    f"the memory budget of {budget} bytes")
    crop = meta.get("crop_size", 0) or 0
    if isinstance(crop, bool) or not isinstance(crop, int) or crop < 0:
        raise FormatError(f"{where}: metadata 'crop_size' must be an int >= 0, got {crop!r}")
    if crop and resize is not None and (resize[0] < crop or resize[1] < crop):
        raise FormatError(f"{where}: metadata 'resize' {resize} is smaller than 'crop_size' {crop}")
    means = meta.get("mean_value") or []
    means = [means] if isinstance(means, (int, float)) and not isinstance(means, bool) else means
    if not isinstance(means, list) or len(means) not in (0, 1, channels):
        raise FormatError(f"{where}: metadata 'mean_value' needs 0, 1 or {channels} numbers, got {means!r}")
    means = [_number(m, "mean_value", where) for m in means]
    try:
        mean_image = decode_mean_image(meta.get("mean_image"))
    except FormatError as exc:
        raise FormatError(f"{where}: {exc}") from None
    if mean_image is not None:
        if mean_image.ndim != 3 or mean_image.shape[0] != channels:
            raise FormatError(f"{where}: metadata 'mean_image' has shape {mean_image.shape}, expected ({channels}, "
                              f"H, W)")
        if not np.isfinite(mean_image).all():
            raise FormatError(f"{where}: metadata 'mean_image' holds NaN or infinite values")
        if means:
            raise FormatError(f"{where}: metadata has both 'mean_image' and 'mean_value'")
    scale = _number(meta.get("scale", 1.0), "scale", where)
    return {"input_shape": tuple(shape), "resize": tuple(resize) if resize else None, "rgb": order.upper() == "RGB",
            "crop_size": crop, "mean_value": means, "mean_image": mean_image, "scale": scale}


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
        if not isinstance(model_or_path, bytes):
            check_regular_file(model_or_path, "the ONNX model", PROTOBUF_MAX_BYTES)
        try:
            model = onnx.load_model_from_string(model_or_path) if isinstance(model_or_path, bytes) else onnx.load(
                str(model_or_path), load_external_data=False)
        except FileNotFoundError:
            raise FormatError(f"{where}: no such ONNX file") from None
        except Exception as exc:  # onnx raises DecodeError and friends on a foreign file
            raise FormatError(f"{where}: not a readable ONNX model ({type(exc).__name__}: {exc})") from None
    values = {}
    for prop in model.metadata_props:
        key, value = prop.key, prop.value
        if isinstance(key, bytes) or isinstance(value, bytes):  # protobuf hands invalid UTF-8 over as bytes
            raise FormatError(f"{where}: metadata entry {key!r} is not valid UTF-8 text")
        try:
            values[key] = json.loads(value)
        except json.JSONDecodeError:
            values[key] = value
    if values.get("format") != FORMAT:
        raise FormatError(f"{where}: not a caffe-compat embedder (metadata 'format' is {values.get('format')!r}, "
                          f"expected {FORMAT!r}); export it with caffe-compat export")
    return values

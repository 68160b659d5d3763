"""Image -> input blob for an exported embedder, from the preprocessing in its ONNX metadata.

Caffe's ImageData layer + DataTransformer in the TEST phase (:mod:`caffe_compat.data`): decode with
OpenCV (BGR, or grey for a 1-channel input), ``cv2.resize`` to ``resize`` (INTER_LINEAR) when set, reverse
the channels when ``channel_order`` is RGB, then ``(pixel − mean) · scale`` on the centre ``crop_size``
window, the mean being ``mean_value[c]`` or the stored ``mean_image`` (a mean file, indexed at the crop
offset) (no mirroring; deterministic and bit-identical to Caffe's TEST transform).
"""

from __future__ import annotations

import numpy as np

from caffe_compat.data import DataTransformer, load_image_bgr
from caffe_compat.errors import FormatError
from caffe_compat.export.metadata import decode_mean_image

__all__ = ["ImagePreprocessor"]


class ImagePreprocessor:
    """``preprocessor(path) -> float32 (C, H, W)``; built from :func:`read_metadata`'s dict."""

    def __init__(self, meta: dict):
        try:
            self.channels, self.height, self.width = (int(d) for d in meta["input_shape"])
            resize = meta.get("resize")
            self.resize = (int(resize[0]), int(resize[1])) if resize else (0, 0)
            self.rgb = str(meta.get("channel_order", "BGR")).upper() == "RGB"
            mean_image = decode_mean_image(meta.get("mean_image"))
            self.transformer = DataTransformer(crop_size=int(meta.get("crop_size") or 0), mean_file=mean_image,
                                               mean_value=() if mean_image is not None else meta.get("mean_value") or (),
                                               scale=float(meta.get("scale", 1.0)), phase="TEST")
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"the model's preprocessing metadata is incomplete or malformed ({exc})") from None

    def __call__(self, path) -> np.ndarray:
        image = load_image_bgr(path, self.channels == 3, self.resize[0], self.resize[1])
        if self.rgb:
            image = np.ascontiguousarray(image[:, :, ::-1])
        blob = self.transformer.transform(image)
        if blob.shape != (self.channels, self.height, self.width):
            raise FormatError(f"{path}: preprocessing gives shape {blob.shape}, the model takes "
                              f"{(self.channels, self.height, self.width)} (set resize / crop_size at export)")
        return blob

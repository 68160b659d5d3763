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
from caffe_compat.export.metadata import check_preprocessing_metadata

__all__ = ["ImagePreprocessor"]


class ImagePreprocessor:
    """``preprocessor(path) -> float32 (C, H, W)``; built from :func:`read_metadata`'s dict, checked first by
    :func:`~caffe_compat.export.metadata.check_preprocessing_metadata` (``where`` names the model in its
    errors: a NaN scale, a bad channel order or a huge resize is refused before any image is read)."""

    def __init__(self, meta: dict, where: str = "the model"):
        checked = check_preprocessing_metadata(meta, where)
        self.channels, self.height, self.width = checked["input_shape"]
        self.resize = checked["resize"] or (0, 0)
        self.rgb = checked["rgb"]
        mean_image = checked["mean_image"]
        try:
            self.transformer = DataTransformer(crop_size=checked["crop_size"], mean_file=mean_image,
                                               mean_value=() if mean_image is not None else checked["mean_value"],
                                               scale=checked["scale"], phase="TEST")
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"{where}: the preprocessing metadata is malformed ({exc})") from None

    def __call__(self, path) -> np.ndarray:
        image = load_image_bgr(path, self.channels == 3, self.resize[0], self.resize[1])
        if self.rgb:
            image = np.ascontiguousarray(image[:, :, ::-1])
        blob = self.transformer.transform(image)
        if blob.shape != (self.channels, self.height, self.width):
            raise FormatError(f"{path}: preprocessing gives shape {blob.shape}, the model takes "
                              f"{(self.channels, self.height, self.width)} (set resize / crop_size at export)")
        return blob

"""pycaffe's ``caffe.io`` helpers: :class:`Transformer` and :func:`load_image` (numpy + OpenCV).

Nearly every old inference script does::

    t = caffe.io.Transformer({"data": net.blobs["data"].data.shape})
    t.set_transpose("data", (2, 0, 1)); t.set_mean("data", mean); t.set_raw_scale("data", 255)
    t.set_channel_swap("data", (2, 1, 0))
    net.blobs["data"].data[...] = t.preprocess("data", caffe.io.load_image(path))

``preprocess`` applies, in pycaffe's order: resize to the blob's H×W (when different), transpose,
channel swap, raw scale, mean subtraction, input scale.  ``load_image`` returns an H×W×3 float32
**RGB** image in [0, 1] (8-bit images divided by 255, 16-bit by 65535), grey images repeated to three
channels when ``color``; with ``color=False`` a single channel of luminance
``0.2125 R + 0.7154 G + 0.0721 B`` (scikit-image's weights, which pycaffe used).

Difference from pycaffe, documented: resizing uses OpenCV's bilinear ``cv2.resize`` on the min-max
normalised image instead of scikit-image's ``resize`` (pycaffe's ``resize_image``); results agree to
interpolation round-off, not bit for bit.  Feed images already at the blob size for exact parity.
"""

from __future__ import annotations

import numpy as np

from caffe_compat.errors import CaffeCompatError, DataError


def load_image(filename: str, color: bool = True) -> np.ndarray:
    import cv2

    image = cv2.imread(str(filename), cv2.IMREAD_UNCHANGED)
    if image is None:
        raise DataError(f"{filename}: cannot read image (missing file or unsupported format)")
    scale = 65535.0 if image.dtype == np.uint16 else 255.0 if image.dtype == np.uint8 else 1.0
    image = image.astype(np.float32) / np.float32(scale)
    if image.ndim == 3:
        image = image[:, :, :3][:, :, ::-1]  # BGR(A) -> RGB
    if not color:
        if image.ndim == 3:
            image = image @ np.asarray([0.2125, 0.7154, 0.0721], dtype=np.float32)
        return np.ascontiguousarray(image[:, :, None], dtype=np.float32)
    if image.ndim == 2:
        image = np.repeat(image[:, :, None], 3, axis=2)
    return np.ascontiguousarray(image, dtype=np.float32)


def resize_image(image: np.ndarray, new_dims) -> np.ndarray:
    """Bilinear resize of an H×W×K image to ``new_dims`` (H', W') (see the module note)."""
    import cv2

    h, w = int(new_dims[0]), int(new_dims[1])
    lo, hi = float(image.min()), float(image.max())
    if hi <= lo:
        return np.full((h, w, image.shape[-1]), lo, dtype=np.float32)
    normed = ((image - lo) / (hi - lo)).astype(np.float32)
    channels = [cv2.resize(normed[:, :, k], (w, h), interpolation=cv2.INTER_LINEAR) for k in range(normed.shape[-1])]
    return (np.stack(channels, axis=-1) * (hi - lo) + lo).astype(np.float32)


class Transformer:
    """pycaffe's ``caffe.io.Transformer`` (see the module docstring for the order of operations)."""

    def __init__(self, inputs: dict):
        self.inputs = {name: tuple(int(d) for d in shape) for name, shape in inputs.items()}
        self.transpose, self.channel_swap, self.raw_scale, self.mean, self.input_scale = {}, {}, {}, {}, {}

    def _check(self, in_):
        if in_ not in self.inputs:
            raise CaffeCompatError(f"{in_} is not one of the net inputs: {sorted(self.inputs)}")

    def set_transpose(self, in_, order):
        self._check(in_)
        if len(order) != len(self.inputs[in_]) - 1:
            raise CaffeCompatError("Transpose order needs to have the same number of dimensions as the input.")
        self.transpose[in_] = tuple(order)

    def set_channel_swap(self, in_, order):
        self._check(in_)
        if len(order) != self.inputs[in_][1]:
            raise CaffeCompatError("Channel swap needs to have the same number of dimensions as the input channels.")
        self.channel_swap[in_] = tuple(order)

    def set_raw_scale(self, in_, scale):
        self._check(in_)
        self.raw_scale[in_] = scale

    def set_input_scale(self, in_, scale):
        self._check(in_)
        self.input_scale[in_] = scale

    def set_mean(self, in_, mean):
        self._check(in_)
        mean = np.asarray(mean, dtype=np.float32)
        shape = self.inputs[in_]
        if mean.ndim == 1:
            if mean.shape[0] != shape[1]:
                raise CaffeCompatError("Mean channels incompatible with input.")
            mean = mean[:, None, None]
        else:
            ms = mean.shape if mean.ndim == 3 else (1,) + mean.shape
            if len(ms) != 3:
                raise CaffeCompatError("Mean shape invalid")
            if ms != shape[1:]:
                raise CaffeCompatError(f"Mean shape incompatible with input shape: mean {ms}, input {shape[1:]}")
            mean = mean.reshape(ms)
        self.mean[in_] = mean

    def preprocess(self, in_, data) -> np.ndarray:
        self._check(in_)
        caffe_in = np.array(data, dtype=np.float32, copy=True)
        in_dims = self.inputs[in_][2:]
        if caffe_in.shape[:2] != tuple(in_dims):
            caffe_in = resize_image(caffe_in, in_dims)
        if in_ in self.transpose:
            caffe_in = caffe_in.transpose(self.transpose[in_])
        if in_ in self.channel_swap:
            caffe_in = caffe_in[list(self.channel_swap[in_]), :, :]
        if in_ in self.raw_scale:
            caffe_in *= self.raw_scale[in_]
        if in_ in self.mean:
            caffe_in -= self.mean[in_]
        if in_ in self.input_scale:
            caffe_in *= self.input_scale[in_]
        return np.ascontiguousarray(caffe_in, dtype=np.float32)

    def deprocess(self, in_, data) -> np.ndarray:
        self._check(in_)
        decaf_in = np.array(data, dtype=np.float32, copy=True).squeeze()
        if in_ in self.input_scale:
            decaf_in /= self.input_scale[in_]
        if in_ in self.mean:
            decaf_in += self.mean[in_]
        if in_ in self.raw_scale:
            decaf_in /= self.raw_scale[in_]
        if in_ in self.channel_swap:
            decaf_in = decaf_in[np.argsort(self.channel_swap[in_]), :, :]
        if in_ in self.transpose:
            decaf_in = decaf_in.transpose(np.argsort(self.transpose[in_]))
        return decaf_in

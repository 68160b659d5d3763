"""pycaffe's ``caffe.Classifier``: a :class:`~caffe_compat.pycaffe.net.Net` (TEST phase) that classifies
H×W×K images by resizing, centre-cropping or oversampling, preprocessing and averaging.

As pycaffe's ``classifier.py``:

* construction: ``Classifier(model_file, pretrained_file, image_dims=None, mean=None, input_scale=None,
  raw_scale=None, channel_swap=None)``; a :class:`~caffe_compat.io.transformer.Transformer` on the first
  input with transpose ``(2, 0, 1)`` and the given mean / scales / channel swap; ``crop_dims`` is the
  input's H×W and ``image_dims`` defaults to it;
* ``predict(inputs, oversample=True)``: every image is resized to ``image_dims`` (``resize_image``); with
  ``oversample`` the 10 crops of ``caffe.io.oversample`` (4 corners, centre, and their mirrors) are
  classified and each image's predictions are the mean over its 10, else the centre crop (``image_dims/2
  ± crop_dims/2``, truncated to integers) alone; the crops are preprocessed and run through
  :func:`forward_all` (batches of the net's input batch size, the last one zero-padded and its padding
  dropped); the predictions are the first output blob.
"""

from __future__ import annotations

import numpy as np

from caffe_compat.errors import CaffeCompatError
from caffe_compat.io.transformer import Transformer, oversample as oversample_crops, resize_image
from caffe_compat.pycaffe._mode import TEST
from caffe_compat.pycaffe.net import Net

__all__ = ["Classifier", "forward_all"]


def forward_all(net, blobs=None, **kwargs) -> dict:
    """pycaffe's ``Net.forward_all``: the inputs split in batches of the input blobs' batch size (the last
    one zero-padded), ``{output: array over all inputs}`` with the padding dropped.  Uses the net's own
    ``forward_all`` when it has one."""
    own = getattr(type(net), "forward_all", None)
    if own is not None:
        return own(net, blobs=blobs, **kwargs)
    if not kwargs:
        raise CaffeCompatError("forward_all(): give the input arrays by blob name")
    arrays = {name: np.asarray(value, dtype=np.float32) for name, value in kwargs.items()}
    total = len(next(iter(arrays.values())))
    if any(len(a) != total for a in arrays.values()):
        raise CaffeCompatError("forward_all(): the inputs have different numbers of items")
    batch = net.blobs[next(iter(arrays))].shape[0]
    if not batch:  # pycaffe's _batch: remainder = num % batch_size (we raised range()'s ValueError: step 0)
        raise ZeroDivisionError(f"forward_all(): the input blob '{next(iter(arrays))}' has batch size 0, so {total} "
                                f"rows cannot be cut into batches (pycaffe's num % batch_size is an integer modulo "
                                f"by zero)")
    outs: dict[str, list] = {}
    for start in range(0, total, batch):
        feed = {}
        for name, array in arrays.items():
            chunk = array[start:start + batch]
            if len(chunk) < batch:
                chunk = np.concatenate([chunk, np.zeros((batch - len(chunk),) + chunk.shape[1:], np.float32)])
            feed[name] = chunk
        for name, value in net.forward(blobs=blobs, **feed).items():
            outs.setdefault(name, []).extend(np.array(value, copy=True))
    return {name: np.asarray(values[:total]) for name, values in outs.items()}


def image_transformer(net, blob: str, mean, input_scale, raw_scale, channel_swap) -> Transformer:
    """pycaffe's set-up of a :class:`Transformer` for an image input (HxWxC → CxHxW, then the optional mean,
    input/raw scales and channel swap), shared by :class:`Classifier` and the Detector."""
    transformer = Transformer({blob: net.blobs[blob].data.shape})
    transformer.set_transpose(blob, (2, 0, 1))
    if mean is not None:
        transformer.set_mean(blob, mean)
    if input_scale is not None:
        transformer.set_input_scale(blob, input_scale)
    if raw_scale is not None:
        transformer.set_raw_scale(blob, raw_scale)
    if channel_swap is not None:
        transformer.set_channel_swap(blob, channel_swap)
    return transformer


class Classifier(Net):
    """pycaffe's ``caffe.Classifier`` (see the module docstring)."""

    def __init__(self, model_file, pretrained_file, image_dims=None, mean=None, input_scale=None, raw_scale=None,
                 channel_swap=None):
        Net.__init__(self, model_file, pretrained_file, TEST)
        in_ = self.inputs[0] if self.inputs else None
        if in_ is None:
            raise CaffeCompatError(f"Classifier: net {model_file} has no Input layer to feed images to")
        self.transformer = image_transformer(self, in_, mean, input_scale, raw_scale, channel_swap)
        self.crop_dims = np.array(self.blobs[in_].data.shape[2:])
        self.image_dims = self.crop_dims if image_dims is None or len(image_dims) == 0 else image_dims

    def predict(self, inputs, oversample: bool = True) -> np.ndarray:
        """(N × classes) predictions of N H×W×K images (see the module docstring)."""
        inputs = [np.asarray(im) for im in inputs]
        if not inputs:
            raise CaffeCompatError("Classifier.predict: no images given")
        height, width = (int(d) for d in self.image_dims)
        images = np.zeros((len(inputs), height, width, inputs[0].shape[2]), dtype=np.float32)
        for ix, image in enumerate(inputs):
            images[ix] = resize_image(image, (height, width))
        if oversample:
            crops = oversample_crops(images, self.crop_dims)
        else:
            center = np.array((height, width)) / 2.0
            box = (np.tile(center, (1, 2))[0] + np.concatenate([-self.crop_dims / 2.0, self.crop_dims / 2.0]))
            box = box.astype(int)
            crops = images[:, box[0]:box[2], box[1]:box[3], :]
        in_ = self.inputs[0]
        caffe_in = np.zeros(np.array(crops.shape)[[0, 3, 1, 2]], dtype=np.float32)
        for ix, crop in enumerate(crops):
            caffe_in[ix] = self.transformer.preprocess(in_, crop)
        predictions = forward_all(self, **{in_: caffe_in})[self.outputs[0]]
        if oversample:
            predictions = predictions.reshape((len(predictions) // 10, 10, -1)).mean(1)
        return predictions

"""pycaffe's ``caffe.Detector``: windowed detection (R-CNN style) with a
:class:`~caffe_compat.pycaffe.net.Net` (TEST phase): crop windows, optionally with context, warp them
to the net's input and classify them.

As pycaffe's ``detector.py``:

* ``Detector(model_file, pretrained_file, mean=None, input_scale=None, raw_scale=None, channel_swap=None,
  context_pad=None)``: a Transformer on the first input (transpose ``(2, 0, 1)``, mean, scales, swap), then
  :meth:`Detector.configure_crop`;
* ``detect_windows([(image_file, [window, ...]), ...])``: each image read with ``caffe.io.load_image``
  (RGB in [0, 1]), each window ``(ymin, xmin, ymax, xmax)`` cropped by :meth:`Detector.crop`, preprocessed
  (warped to the input size), run through ``forward_all``; returns one ``{"window", "prediction",
  "filename"}`` dict per window, in order;
* ``crop(im, window)``: the window itself, or with ``context_pad`` p the window grown by ``s = size /
  (size - 2p)`` around its centre (``size``: the input's width, the input assumed square), clipped to the
  image, resized and placed into a ``crop_dims`` canvas filled with ``crop_mean`` so that the part outside
  the image preprocesses to the mean (zero after mean subtraction);
* ``configure_crop(context_pad)``: ``crop_dims`` (the input's H×W×K) and ``crop_mean`` (the Transformer's
  mean taken back to raw image space: transposed, channel swap undone, divided by ``raw_scale``, in the
  mean's dtype, e.g. float64, so a context crop is float64 until preprocessing; zeros without a mean).

Not reproduced: ``detect_selective_search`` needs the external selective-search MATLAB tool; it raises
:class:`SelectiveSearchUnavailable` (a CaffeCompatError and NotImplementedError) saying to compute the
windows elsewhere and call ``detect_windows``.  Rounding follows Python 3's ``round`` (half to even) where
pycaffe calls ``round`` (under Python 2 it rounded halves away from zero).
"""

from __future__ import annotations

import numpy as np

from caffe_compat.errors import CaffeCompatError
from caffe_compat.io.transformer import load_image, resize_image
from caffe_compat.pycaffe._mode import TEST
from caffe_compat.pycaffe.classifier import forward_all, image_transformer
from caffe_compat.pycaffe.net import Net

__all__ = ["Detector", "SelectiveSearchUnavailable"]


class SelectiveSearchUnavailable(CaffeCompatError, NotImplementedError):
    """Selective search proposals need an external tool that caffe-compat does not ship."""


class Detector(Net):
    """pycaffe's ``caffe.Detector`` (see the module docstring)."""

    def __init__(self, model_file, pretrained_file, mean=None, input_scale=None, raw_scale=None, channel_swap=None,
                 context_pad=None):
        Net.__init__(self, model_file, pretrained_file, TEST)
        if not self.inputs:
            raise CaffeCompatError(f"Detector: net {model_file} has no Input layer to feed windows to")
        in_ = self.inputs[0]
        self.transformer = image_transformer(self, in_, mean, input_scale, raw_scale, channel_swap)
        self.configure_crop(context_pad)

    def detect_windows(self, images_windows) -> list[dict]:
        """Classify every window of every image (see the module docstring)."""
        images_windows = [(name, list(windows)) for name, windows in images_windows]
        window_inputs = []
        for image_fname, windows in images_windows:
            image = load_image(image_fname).astype(np.float32)
            for window in windows:
                window_inputs.append(self.crop(image, window))
        if not window_inputs:
            return []
        in_ = self.inputs[0]
        caffe_in = np.zeros((len(window_inputs), window_inputs[0].shape[2]) + self.blobs[in_].data.shape[2:],
                            dtype=np.float32)
        for ix, window_in in enumerate(window_inputs):
            caffe_in[ix] = self.transformer.preprocess(in_, window_in)
        predictions = forward_all(self, **{in_: caffe_in})[self.outputs[0]]
        detections, ix = [], 0
        for image_fname, windows in images_windows:
            for window in windows:
                detections.append({"window": window, "prediction": predictions[ix], "filename": image_fname})
                ix += 1
        return detections

    def detect_selective_search(self, image_fnames):
        raise SelectiveSearchUnavailable(
            "detect_selective_search needs the external selective_search_ijcv_with_python (MATLAB) tool, which "
            "caffe-compat does not run: compute the windows (ymin, xmin, ymax, xmax) with it or another proposal "
            "method and call detect_windows([(image_file, windows), ...])")

    def crop(self, im, window) -> np.ndarray:
        """The window of ``im`` (H×W×K), with context padding when configured (see the module docstring)."""
        window = np.asarray(window)
        y0, x0, y1, x1 = (int(v) for v in window[:4])
        if not self.context_pad:
            crop = im[y0:y1, x0:x1]
            if crop.size == 0:
                raise CaffeCompatError(f"Detector.crop: window {tuple(window)} is empty in a {im.shape[:2]} image")
            return crop
        box = window.astype(np.float64)
        crop_size = self.blobs[self.inputs[0]].data.shape[3]  # the input's width; assumed square, as pycaffe
        scale = crop_size / (1. * crop_size - self.context_pad * 2)
        half_h, half_w = (box[2] - box[0] + 1) / 2., (box[3] - box[1] + 1) / 2.
        center = (box[0] + half_h, box[1] + half_w)
        box = np.round(np.tile(center, 2) + scale * np.array((-half_h, -half_w, half_h, half_w)))
        full_h, full_w = box[2] - box[0] + 1, box[3] - box[1] + 1
        scale_h, scale_w = crop_size / full_h, crop_size / full_w
        pad_y, pad_x = round(max(0, -box[0]) * scale_h), round(max(0, -box[1]) * scale_w)  # out of the image
        im_h, im_w = im.shape[:2]
        box = np.clip(box, 0., [im_h, im_w, im_h, im_w])
        clip_h, clip_w = box[2] - box[0] + 1, box[3] - box[1] + 1
        if clip_h <= 0 or clip_w <= 0:
            raise CaffeCompatError(f"Detector.crop: window {tuple(window)} lies outside the {im_h}x{im_w} image")
        crop_h, crop_w = min(round(clip_h * scale_h), crop_size - pad_y), min(round(clip_w * scale_w),
                                                                               crop_size - pad_x)
        context = im[int(box[0]):int(box[2]), int(box[1]):int(box[3])]
        context = resize_image(context, (crop_h, crop_w))
        crop = np.ones(self.crop_dims, dtype=np.float32) * self.crop_mean
        crop[pad_y:pad_y + crop_h, pad_x:pad_x + crop_w] = context
        return crop

    def configure_crop(self, context_pad) -> None:
        """``crop_dims`` and, with context padding, ``crop_mean`` (see the module docstring)."""
        in_ = self.inputs[0]
        transpose = self.transformer.transpose[in_]
        inverse = [transpose[t] for t in transpose]
        self.crop_dims = np.array(self.blobs[in_].data.shape[1:])[inverse]
        self.context_pad = context_pad
        if not self.context_pad:
            return
        mean = self.transformer.mean.get(in_)
        if mean is None:
            self.crop_mean = np.zeros(self.crop_dims, dtype=np.float32)
            return
        crop_mean = np.array(mean, copy=True).transpose(inverse)  # the mean's own dtype, as pycaffe's copy
        order = self.transformer.channel_swap.get(in_)
        if order is not None:
            crop_mean = crop_mean[:, :, [list(order).index(i) for i in range(crop_mean.shape[2])]]
        raw_scale = self.transformer.raw_scale.get(in_)
        if raw_scale is not None:
            crop_mean = crop_mean / raw_scale
        self.crop_mean = crop_mean

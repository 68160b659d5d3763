"""Caffe's ``DataTransformer`` (``data_transformer.cpp``) on numpy arrays.

For an input of ``C x H x W`` values (a Datum's bytes, or an OpenCV ``H x W x C`` BGR uint8 image
read in C-H-W order) and a ``crop_size`` (0 = no crop) the output is the float32 ``C x h x w`` blob

    out[c, h, w'] = (pixel[c, h_off + h, w_off + w] - mean[c, h_off + h, w_off + w]) * scale

with ``w' = w`` or, when mirrored, ``w' = w_out - 1 - w``.  ``mean`` is either the mean file (an
array of the *uncropped* input size, indexed at the crop offset) or one value per channel
(``mean_value``: one value is replicated over every channel).  The arithmetic is float32, in this
order, like Caffe's ``Dtype`` code (the pixel is converted to float first).

Defaults as ``TransformationParameter``: ``scale`` 1, ``mirror`` false, ``crop_size`` 0, no mean.

Offsets and mirroring:
* crop in ``TRAIN``: ``h_off = Rand(H - crop + 1)``, ``w_off = Rand(W - crop + 1)``;
  crop in ``TEST``: ``h_off = (H - crop) // 2``, ``w_off = (W - crop) // 2``;
* **Caffe quirk kept:** ``do_mirror = mirror && Rand(2)`` is drawn in *every* phase, so
  ``mirror: true`` mirrors about half of the ``TEST`` images too (BVLC Caffe does exactly this).
* The random draws happen in Caffe's order (mirror first, then ``h_off``, then ``w_off``) but come
  from a seeded ``numpy.random.RandomState``, not Caffe's Boost RNG: random crops are reproducible
  here, not equal to a particular Caffe run.  ``TEST`` without mirroring is deterministic and
  bit-identical to Caffe.

``out=`` (a float32 ``C x h x w`` array, e.g. a row of a batch) receives the result in place of a new
array: a batch is built without a copy per image (:mod:`caffe_compat.data.dataset`).

``phase`` is the transformer's default; ``transform``/``transform_chw`` take ``phase=`` to use the
other phase for one call (the data layers pass their mode: ``.eval()`` on a net gives Caffe's TEST
transform, ``.train()`` Caffe's TRAIN transform, see :mod:`caffe_compat.layers.datasets`).

Errors Caffe raises as ``CHECK`` failures are :class:`~caffe_compat.errors.FormatError` (bad
parameters: mean file together with mean values, a mean_value count that is neither 1 nor C) or
:class:`~caffe_compat.errors.DataError` (an image smaller than the crop, a mean of another size).
``mean_file`` takes the mean as an array (``C x H x W`` or ``1 x C x H x W``); reading a
``.binaryproto`` belongs to ``caffe_compat.io``.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from caffe_compat.data.hwc_crop import crop_planes, stream_crop
from caffe_compat.errors import DataError, FormatError

TRAIN = "TRAIN"
TEST = "TEST"


def _phase_name(phase: str | int) -> str:
    if isinstance(phase, str) and phase.upper() in (TRAIN, TEST):
        return phase.upper()
    if not isinstance(phase, str) and phase in (0, 1):  # caffe.proto: TRAIN = 0, TEST = 1
        return (TRAIN, TEST)[int(phase)]
    raise FormatError(f"phase must be 'TRAIN' or 'TEST' (or 0 / 1), got {phase!r}")


class DataTransformer:
    """Caffe's ``TransformationParameter`` applied to single images (see the module docstring)."""

    def __init__(
        self,
        crop_size: int = 0,
        mirror: bool = False,
        mean_file: np.ndarray | None = None,
        mean_value: float | Sequence[float] = (),
        scale: float = 1.0,
        phase: str | int = TRAIN,
        seed: int = 0,
    ) -> None:
        if crop_size < 0:
            raise FormatError(f"crop_size must be >= 0, got {crop_size}")
        mean_values = np.atleast_1d(np.asarray(mean_value, dtype=np.float32))
        if mean_file is not None and mean_values.size:
            raise FormatError("Cannot specify mean_file and mean_value at the same time")
        if mean_file is not None:
            if isinstance(mean_file, (str, bytes)) or not hasattr(mean_file, "shape"):
                raise FormatError("mean_file must be an array (C, H, W); read .binaryproto files with caffe_compat.io")
            mean = np.asarray(mean_file, dtype=np.float32)
            if mean.ndim == 4 and mean.shape[0] == 1:
                mean = mean[0]
            if mean.ndim != 3:
                raise FormatError(f"mean_file must have shape (C, H, W) or (1, C, H, W), got {mean.shape}")
            self.mean_file: np.ndarray | None = mean
        else:
            self.mean_file = None
        self.mean_values = mean_values
        self.crop_size = int(crop_size)
        self.mirror = bool(mirror)
        self.scale = np.float32(scale)
        self.phase = _phase_name(phase)
        self.rng = np.random.RandomState(seed)

    @property
    def needs_rand(self) -> bool:
        """Caffe's ``InitRand`` condition: ``mirror || (phase == TRAIN && crop_size)``."""
        return self.mirror or (self.phase == TRAIN and self.crop_size > 0)

    def output_shape(self, channels: int, height: int, width: int) -> tuple[int, int, int]:
        """``(C, crop, crop)`` with a crop, else ``(C, H, W)`` (Caffe's ``InferBlobShape``)."""
        if self.crop_size:
            return channels, self.crop_size, self.crop_size
        return channels, height, width

    def transform(self, image_hwc: np.ndarray, rng: np.random.RandomState | None = None,
                  phase: str | int | None = None, out: np.ndarray | None = None,
                  streaming: bool = False) -> np.ndarray:
        """The cv::Mat path: ``H x W x C`` (or ``H x W``) uint8 BGR image -> float32 ``C x h x w``.
        ``phase``: TRAIN/TEST for this call (default: ``self.phase``); ``out``: where to write it;
        ``streaming``: ``out`` is not read soon (a batch row), write it past the cache where that is done
        (:func:`~caffe_compat.data.hwc_crop.stream_crop`; the same values)."""
        image = np.asarray(image_hwc)
        if image.dtype != np.uint8:
            raise DataError(f"Image data type must be unsigned byte (uint8), got {image.dtype}")
        if image.ndim == 2:
            image = image[:, :, None]
        if image.ndim != 3:
            raise DataError(f"expected an H x W x C image, got shape {image.shape}")
        return self._apply(image.transpose(2, 0, 1), rng, phase, out, hwc=image, streaming=streaming)

    def transform_chw(self, datum_chw: np.ndarray, rng: np.random.RandomState | None = None,
                      phase: str | int | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """The Datum path: ``C x H x W`` uint8 bytes or float values -> float32 ``C x h x w``.
        ``phase``: TRAIN/TEST for this call (default: ``self.phase``); ``out``: where to write it."""
        datum = np.asarray(datum_chw)
        if datum.ndim != 3:
            raise DataError(f"expected a C x H x W array, got shape {datum.shape}")
        return self._apply(datum, rng, phase, out)

    def _apply(self, chw: np.ndarray, rng: np.random.RandomState | None, phase: str | int | None = None,
               out: np.ndarray | None = None, hwc: np.ndarray | None = None, streaming: bool = False) -> np.ndarray:
        """``chw`` (C x H x W, any strides) transformed into ``out``; ``hwc``: the same pixels as the H x W x C
        uint8 image ``chw`` is a transposed view of (the cv::Mat path), cut into planes by OpenCV, or with
        ``streaming`` (and no mean file) written past the cache."""
        rng = self.rng if rng is None else rng
        phase = self.phase if phase is None else _phase_name(phase)
        channels, height, width = chw.shape
        do_mirror = self.mirror and bool(rng.randint(2))
        if channels < 1:
            raise DataError("image has no channels")
        crop = self.crop_size
        if height < crop or width < crop:
            raise DataError(f"image of size {height}x{width} is smaller than crop_size {crop}")
        h_off = w_off = 0
        out_h, out_w = height, width
        if crop:
            out_h = out_w = crop
            if phase == TRAIN:
                h_off = int(rng.randint(height - crop + 1))
                w_off = int(rng.randint(width - crop + 1))
            else:
                h_off = (height - crop) // 2
                w_off = (width - crop) // 2
        window = (slice(None), slice(h_off, h_off + out_h), slice(w_off, w_off + out_w))
        # element-wise arithmetic: mirroring the input (and the mean) first gives the same values as
        # mirroring the result, without a second copy
        flip = (slice(None), slice(None), slice(None, None, -1)) if do_mirror else (slice(None),) * 3
        if self.mean_file is not None and self.mean_file.shape != (channels, height, width):
            raise DataError(f"mean_file has shape {self.mean_file.shape}, the image {(channels, height, width)} (a "
                            f"mean blob is read through Caffe's legacy channels/height/width: store it as "
                            f"1 x C x H x W)")
        if self.mean_file is None and self.mean_values.size not in (0, 1, channels):
            raise FormatError(f"Specify either 1 mean_value or as many as channels: {channels}")
        if out is None:
            out = np.empty((channels, out_h, out_w), dtype=np.float32)
        elif out.shape != (channels, out_h, out_w) or out.dtype != np.float32:
            raise DataError(f"out= must be a float32 array of shape {(channels, out_h, out_w)}, got {out.dtype} "
                            f"{out.shape}")
        if (streaming and hwc is not None and self.mean_file is None
                and stream_crop(hwc, h_off, w_off, out_h, out_w, do_mirror, self.mean_values, self.scale, out)):
            return out
        planes = None if hwc is None else crop_planes(hwc, h_off, w_off, out_h, out_w, do_mirror)
        if planes is None:
            return self._cast_into(out, chw[window][flip], slice(None), window, flip)
        # from the crop's contiguous uint8 planes (already mirrored, :func:`~caffe_compat.data.hwc_crop.crop_planes`),
        # one output channel at a time: its float32 plane (200 KB at 224 x 224) stays in the core's cache
        for c, plane in enumerate(planes):
            self._cast_into(out[c], plane, c, window, flip)
        return out

    def _cast_into(self, dest: np.ndarray, source: np.ndarray, channel, window: tuple, flip: tuple) -> np.ndarray:
        """``dest = (float32(source) - mean) * scale`` for the output channels ``channel`` (an index, or
        ``slice(None)`` for all): ``source`` is the crop (mirrored) of those channels, ``window``/``flip`` the
        crop and mirror that cut it, which pick the matching part of the mean file."""
        np.copyto(dest, source, casting="unsafe")  # what astype(np.float32) computes
        if self.mean_file is not None:
            mean = self.mean_file[(channel, *window[1:])]
            dest -= mean[flip[-mean.ndim:]]
        elif self.mean_values.size:
            mean = self.mean_values[0] if self.mean_values.size == 1 else self.mean_values[channel]
            dest -= mean if np.ndim(mean) == 0 else mean[:, None, None]
        if self.scale != 1:
            dest *= self.scale
        return dest

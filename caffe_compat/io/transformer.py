"""pycaffe's ``caffe.io`` helpers (numpy + OpenCV, scipy for one resize, no torch): :class:`Transformer`,
:func:`load_image`, :func:`resize_image`, :func:`oversample` and the BlobProto converters :func:`blobproto_to_array`,
:func:`array_to_blobproto`, :func:`arraylist_to_blobprotovector_str`,
:func:`blobprotovector_str_to_arraylist`, and the Datum converters :func:`array_to_datum`,
:func:`datum_to_array`.

Nearly every old inference script does::

    t = caffe.io.Transformer({"data": net.blobs["data"].data.shape})
    t.set_transpose("data", (2, 0, 1)); t.set_mean("data", mean); t.set_raw_scale("data", 255)
    t.set_channel_swap("data", (2, 1, 0))
    net.blobs["data"].data[...] = t.preprocess("data", caffe.io.load_image(path))

``preprocess`` applies, in pycaffe's order: resize to the blob's H×W (when different), transpose,
channel swap, raw scale, mean subtraction, input scale.  ``load_image`` returns an H×W×3 float32
**RGB** image in [0, 1] (8-bit images divided by 255, 16-bit by 65535), grey images repeated to three
channels when ``color``; with ``color=False`` a single channel of luminance
``0.2125 R + 0.7154 G + 0.0721 B`` (scikit-image's ``rgb2gray``, which pycaffe's ``imread(as_grey=True)``
calls: computed in float64 and rounded once to float32, as there).

Difference from pycaffe, documented: :func:`resize_image` (also used by ``preprocess``) resizes with
OpenCV (``cv2.resize``, per channel, on the min-max normalised image) instead of scikit-image's
``resize(..., mode='constant')``.  Both sample at half-pixel centres, so **inside** the image bilinear
results agree to float round-off (checked against scikit-image's algorithm re-implemented with
scipy.ndimage: ≤ 1e-7 on [0, 1] data), but they are *not* equal in two cases:

* enlarging: pycaffe's ``mode='constant'`` blends the outermost output rows/columns with the
  constant 0 of the normalised image, i.e. pulls them toward the image minimum; OpenCV replicates the
  edge pixel (differences up to ~0.4 of the value range on random data);
* shrinking with scikit-image ≥ 0.15: its ``resize`` anti-aliases by default (a Gaussian pre-filter,
  sigma = (factor - 1) / 2), which pycaffe does not turn off; OpenCV's bilinear does not filter, so
  results differ by far more than round-off (~0.1-0.4 of the range on random data).  With the
  scikit-image of pycaffe's era (< 0.15, no anti-aliasing) shrinking agrees to round-off.

Feed images already at the blob size for exact parity.  ``interp_order`` 0 (nearest, OpenCV's
half-pixel ``INTER_NEAREST_EXACT``: scikit-image's order 0 except at exact half-way ties) and 1
(bilinear) are supported; scikit-image's spline orders 2-5 are refused rather than approximated.
Images with other than 1 or 3 channels go, as in pycaffe, through ``scipy.ndimage.zoom`` (corner-aligned
sampling, no normalising, any order 0-5): the same numbers as pycaffe.
"""

from __future__ import annotations

import os

import numpy as np

from caffe_compat.errors import (ArrayShapeError, CaffeCompatError, FormatError, ImageNotFoundError,
                                 ImageReadError, MemoryBudgetError)
from caffe_compat.io.blobs import blob_shape, set_packed_floats
from caffe_compat.io.safe_open import memory_budget
from caffe_compat.proto import caffe_pb2

__all__ = ["Transformer", "array_to_blobproto", "array_to_datum", "arraylist_to_blobprotovector_str",
           "blobproto_to_array", "blobprotovector_str_to_arraylist", "datum_to_array", "load_image", "oversample",
           "resize_image"]


def load_image(filename: str, color: bool = True) -> np.ndarray:
    """pycaffe's ``caffe.io.load_image`` (the module docstring gives the values).  A file that cannot be read
    as an image is an :class:`~caffe_compat.errors.ImageReadError`, a missing one an
    :class:`~caffe_compat.errors.ImageNotFoundError`: both OSErrors (``IOError``; the latter a
    FileNotFoundError), as pycaffe's scikit-image reader raised, and DataErrors."""
    import cv2

    from caffe_compat.io.safe_open import check_regular_file

    from caffe_compat.io.image_header import IMREAD_UNCHANGED, check_decode_budget, imread

    if check_regular_file(filename, "load_image") is None:  # could not stat it: missing (or unreadable)
        try:
            os.stat(filename)
        except FileNotFoundError:
            raise ImageNotFoundError(f"{filename}: no such file") from None
        except (OSError, ValueError):
            pass  # no permission, a NUL byte: OpenCV's read below fails and says so
    check_decode_budget(filename, str(filename), IMREAD_UNCHANGED)
    try:
        image = imread(filename, cv2.IMREAD_UNCHANGED)
    except cv2.error as exc:
        from caffe_compat.io.datum_lmdb import cv_reason

        raise ImageReadError(f"{filename}: OpenCV could not decode the image ({cv_reason(exc)})") from None
    if image is None:
        raise ImageReadError(f"{filename}: cannot read image (unreadable file or unsupported format)")
    scale = 65535.0 if image.dtype == np.uint16 else 255.0 if image.dtype == np.uint8 else 1.0
    if not color and image.ndim == 3:
        # scikit-image's rgb2gray: img_as_float (x * (1 / 255.) in float64), the weighted sum in float64,
        # rounded once to float32 by pycaffe's astype
        def channel(k):
            return np.multiply(image[:, :, k], 1.0 / scale, dtype=np.float64)

        grey = 0.2125 * channel(2)  # BGR(A): red is channel 2
        grey += 0.7154 * channel(1)
        grey += 0.0721 * channel(0)
        return np.ascontiguousarray(grey[:, :, None], dtype=np.float32)
    image = image.astype(np.float32) / np.float32(scale)
    if image.ndim == 3:
        image = image[:, :, :3][:, :, ::-1]  # BGR(A) -> RGB
    if not color:
        return np.ascontiguousarray(image[:, :, None], dtype=np.float32)
    if image.ndim == 2:
        image = np.repeat(image[:, :, None], 3, axis=2)
    return np.ascontiguousarray(image, dtype=np.float32)


_INTERPOLATION = {0: "INTER_NEAREST_EXACT", 1: "INTER_LINEAR"}


def resize_image(im: np.ndarray, new_dims, interp_order: int = 1) -> np.ndarray:
    """pycaffe's ``caffe.io.resize_image``: an H×W×K image resized to ``new_dims`` (H', W'), float32.

    As pycaffe, for 1 or 3 channels: the image is min-max normalised, resized and mapped back; a constant
    image gives the constant (no division by 0).  ``interp_order`` 0 = nearest, 1 = bilinear (the module
    docstring says where the numbers differ from pycaffe's scikit-image resize).  Any other channel count
    goes, as in pycaffe, through ``scipy.ndimage.zoom`` by ``(H'/H, W'/W, 1)`` with ``interp_order`` (0-5):
    corner-aligned sampling of the image as it is (no normalising), pycaffe's very numbers."""
    import cv2

    image = np.asarray(im)
    if image.ndim != 3 or 0 in image.shape:
        raise CaffeCompatError(f"resize_image: expected a non-empty H x W x K image, got shape {image.shape}")
    try:
        h, w = (int(d) for d in new_dims)
    except (TypeError, ValueError):
        raise CaffeCompatError(f"resize_image: new_dims must be (height, width), got {new_dims!r}") from None
    if h < 1 or w < 1:
        raise CaffeCompatError(f"resize_image: new_dims must be positive, got {(h, w)}")
    need = 3 * h * w * image.shape[-1] * 4  # float32: the resized planes, their stack and the result
    if need > memory_budget():  # (10^6, 10^6) raised OpenCV's cv2.error (Insufficient memory, 4 TB)
        raise MemoryBudgetError(f"resize_image: new_dims {(h, w)} of a {image.shape[-1]}-channel image need {need} "
                                f"bytes, more than the memory budget of {memory_budget()} bytes; set "
                                f"CAFFE_COMPAT_MEMORY_BUDGET to allow more")
    if image.shape[-1] not in (1, 3):  # pycaffe: "ndimage interpolates anything but more slowly"
        from scipy.ndimage import zoom

        if interp_order not in range(6):
            raise CaffeCompatError(f"resize_image: interp_order must be 0-5 (scipy.ndimage.zoom's spline orders), "
                                   f"got {interp_order!r}")
        scale = tuple(np.array((h, w), dtype=float) / np.array(image.shape[:2]))
        return zoom(image, scale + (1,), order=interp_order).astype(np.float32)
    if interp_order not in _INTERPOLATION:
        raise CaffeCompatError(f"resize_image: interp_order must be 0 (nearest) or 1 (bilinear), got {interp_order!r} "
                               f"(scikit-image's spline orders 2-5 are not reproduced)")
    lo, hi = float(image.min()), float(image.max())
    if hi <= lo:
        return np.full((h, w, image.shape[-1]), lo, dtype=np.float32)
    normed = ((image - lo) / (hi - lo)).astype(np.float32)
    flag = getattr(cv2, _INTERPOLATION[interp_order])
    channels = [cv2.resize(normed[:, :, k], (w, h), interpolation=flag) for k in range(normed.shape[-1])]
    return (np.stack(channels, axis=-1) * (hi - lo) + lo).astype(np.float32)


def oversample(images, crop_dims) -> np.ndarray:
    """pycaffe's ``caffe.io.oversample``: 10 crops of ``crop_dims`` (h, w) per H×W×K image, float32
    ``(10·N, h, w, K)``.  Per image, in pycaffe's order: the corners top-left, top-right, bottom-left,
    bottom-right, the centre (offset ``((H-h)//2, (W-w)//2)``, what pycaffe's rounding gives), then the
    same five mirrored left-right.  All images must have the first one's shape (pycaffe takes the crop
    positions from the first image)."""
    images = [np.asarray(im) for im in images]
    if not images:
        raise CaffeCompatError("oversample: no images given")
    shape = images[0].shape
    if len(shape) != 3:
        raise CaffeCompatError(f"oversample: images must be H x W x K arrays, got shape {shape}")
    for k, im in enumerate(images):
        if im.shape != shape:
            raise CaffeCompatError(f"oversample: image {k} has shape {im.shape}, image 0 has {shape}")
    try:
        ch, cw = (int(d) for d in crop_dims)
    except (TypeError, ValueError):
        raise CaffeCompatError(f"oversample: crop_dims must be (height, width), got {crop_dims!r}") from None
    height, width = shape[:2]
    if not (0 < ch <= height and 0 < cw <= width):
        raise CaffeCompatError(f"oversample: crop {(ch, cw)} does not fit the {height}x{width} images")
    offsets = [(0, 0), (0, width - cw), (height - ch, 0), (height - ch, width - cw),
               ((height - ch) // 2, (width - cw) // 2)]
    crops = np.empty((10 * len(images), ch, cw, shape[2]), dtype=np.float32)
    for n, im in enumerate(images):
        for k, (y, x) in enumerate(offsets):
            crops[10 * n + k] = im[y:y + ch, x:x + cw, :]
            crops[10 * n + 5 + k] = im[y:y + ch, x:x + cw, :][:, ::-1, :]
    return crops


# ---------------------------------------------------------------------------------------------- BlobProto

def blobproto_to_array(blob, return_diff: bool = False) -> np.ndarray:
    """pycaffe's ``caffe.io.blobproto_to_array``: the blob's ``data`` (``diff`` with ``return_diff``) as a
    float64 array (pycaffe's ``np.array(blob.data)``) of shape ``(num, channels, height, width)`` for a
    legacy blob (any of those fields set), else ``shape.dim``.  Beyond pycaffe: a blob storing only
    ``double_data``/``double_diff`` is read too; a value count that does not fit the shape is a
    :class:`~caffe_compat.errors.ArrayShapeError` naming both (a FormatError and, as numpy's reshape error
    in pycaffe, a ValueError; e.g. a shape-less blob of more than one value)."""
    if not isinstance(blob, caffe_pb2.BlobProto):
        raise CaffeCompatError(f"blobproto_to_array: expected a caffe_pb2.BlobProto, got {type(blob).__name__}")
    single, double = (blob.diff, blob.double_diff) if return_diff else (blob.data, blob.double_data)
    data = np.array(double if len(double) and not len(single) else single, dtype=np.float64)
    shape = blob_shape(blob)
    count = int(np.prod(shape)) if shape else 1
    if data.size != count:
        what = "diff" if return_diff else "data"
        raise ArrayShapeError(f"blobproto_to_array: blob of shape {shape} ({count} values) holds {data.size} {what} "
                              f"values")
    return data.reshape(shape)


def array_to_blobproto(arr, diff=None):
    """pycaffe's ``caffe.io.array_to_blobproto``: a BlobProto with ``shape.dim`` = ``arr.shape`` and the
    values as float32 ``data`` (and ``diff`` when given; unlike pycaffe, a diff of another shape is
    refused)."""
    array = np.asarray(arr)
    blob = caffe_pb2.BlobProto()
    blob.shape.dim.extend(int(d) for d in array.shape)
    set_packed_floats(blob, array)
    if diff is not None:
        diff = np.asarray(diff)
        if diff.shape != array.shape:
            raise CaffeCompatError(f"array_to_blobproto: diff has shape {diff.shape}, the array {array.shape}")
        set_packed_floats(blob, diff, "diff")
    return blob


def arraylist_to_blobprotovector_str(arraylist) -> bytes:
    """pycaffe's ``caffe.io.arraylist_to_blobprotovector_str``: a serialised BlobProtoVector of the arrays."""
    vec = caffe_pb2.BlobProtoVector()
    vec.blobs.extend([array_to_blobproto(arr) for arr in arraylist])
    return vec.SerializeToString()


def blobprotovector_str_to_arraylist(str_) -> list[np.ndarray]:
    """pycaffe's ``caffe.io.blobprotovector_str_to_arraylist``: the arrays of a serialised BlobProtoVector."""
    from google.protobuf.message import DecodeError

    vec = caffe_pb2.BlobProtoVector()
    try:
        vec.ParseFromString(bytes(str_))
    except (DecodeError, TypeError) as exc:
        raise FormatError(f"blobprotovector_str_to_arraylist: not a serialised BlobProtoVector ({exc})") from None
    return [blobproto_to_array(blob) for blob in vec.blobs]


# ---------------------------------------------------------------------------------------------- Datum

def array_to_datum(arr, label=None) -> caffe_pb2.Datum:
    """pycaffe's ``caffe.io.array_to_datum``: a Datum of a C×H×W array, its bytes in ``data`` when the
    array is uint8, else its values (as float) in ``float_data``; ``label`` is set only when given (an
    unset label is not serialised).  Any other number of axes raises
    :class:`~caffe_compat.errors.ArrayShapeError` (a ValueError, as pycaffe's)."""
    arr = np.asarray(arr)
    if arr.ndim != 3:
        raise ArrayShapeError(f"array_to_datum: the array must be 3-D (channels, height, width), got shape "
                              f"{arr.shape}")
    datum = caffe_pb2.Datum()
    datum.channels, datum.height, datum.width = (int(d) for d in arr.shape)
    if arr.dtype == np.uint8:
        datum.data = np.ascontiguousarray(arr).tobytes()
    else:
        datum.float_data.extend(arr.astype(np.float64).ravel().tolist())
    if label is not None:
        from caffe_compat.io.datum_lmdb import datum_label

        datum.label = datum_label(label)
    return datum


def datum_to_array(datum) -> np.ndarray:
    """pycaffe's ``caffe.io.datum_to_array``: the Datum's C×H×W values, uint8 from ``data`` (bytes), else
    float64 from ``float_data`` (the label is ``datum.label``).  An encoded Datum (JPEG/PNG bytes) is
    refused with an :class:`~caffe_compat.errors.ArrayShapeError` (a ValueError), as pycaffe's reshape of the
    compressed bytes to the unset 0×0×0 shape fails with numpy's ValueError; so is a value count that does
    not fit channels×height×width."""
    if not isinstance(datum, caffe_pb2.Datum):
        raise CaffeCompatError(f"datum_to_array: expected a caffe_pb2.Datum, got {type(datum).__name__}")
    shape = (int(datum.channels), int(datum.height), int(datum.width))
    if datum.encoded:
        raise ArrayShapeError("datum_to_array: the Datum is encoded (compressed image bytes); decode it with "
                              "caffe_compat.io.decode_datum")
    if len(datum.data):
        values = np.frombuffer(datum.data, dtype=np.uint8)
    else:
        values = np.array(datum.float_data, dtype=np.float64)
    if values.size != int(np.prod(shape)):
        raise ArrayShapeError(f"datum_to_array: Datum of shape {shape} holds {values.size} values")
    return values.reshape(shape).copy() if values.dtype == np.uint8 else values.reshape(shape)


class Transformer:
    """pycaffe's ``caffe.io.Transformer`` (see the module docstring for the order of operations)."""

    def __init__(self, inputs: dict):
        self.inputs = {name: tuple(int(d) for d in shape) for name, shape in inputs.items()}
        self.transpose, self.channel_swap, self.raw_scale, self.mean, self.input_scale = {}, {}, {}, {}, {}

    def _check(self, in_):
        if in_ not in self.inputs:
            raise CaffeCompatError(f"{in_} is not one of the net inputs: {sorted(self.inputs)}")

    # pycaffe's own name for the check, ``__check_input`` (so ``_Transformer__check_input``), which
    # subclasses adding their own settings call: ``caffe.io.Transformer._Transformer__check_input(self, in_)``
    __check_input = _check

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
        """Mean to subtract (per channel, or per pixel of the input's C x H x W); a shape that does not fit
        raises :class:`~caffe_compat.errors.ArrayShapeError`, a ValueError, as pycaffe's ``set_mean``.

        The mean keeps its dtype, as pycaffe stores the array it is given: a float64 mean (``np.load`` of
        ``ilsvrc_2012_mean.npy``) is subtracted from the float32 input in float64 and the difference rounded
        once to float32 (``caffe_in -= mean``), not rounded to float32 first."""
        self._check(in_)
        mean = np.asarray(mean)
        shape = self.inputs[in_]
        if mean.ndim == 1:
            if mean.shape[0] != shape[1]:
                raise ArrayShapeError("Mean channels incompatible with input.")
            mean = mean[:, None, None]
        else:
            ms = mean.shape if mean.ndim == 3 else (1,) + mean.shape
            if len(ms) != 3:
                raise ArrayShapeError("Mean shape invalid")
            if ms != shape[1:]:
                raise ArrayShapeError(f"Mean shape incompatible with input shape: mean {ms}, input {shape[1:]}")
            mean = mean.reshape(ms)
        self.mean[in_] = mean

    def preprocess(self, in_, data) -> np.ndarray:
        """pycaffe's ``preprocess`` (order in the module docstring).  Quirk kept: pycaffe starts from
        ``data.astype(np.float32, copy=False)`` and scales / subtracts in place, so a float32 image already
        at the blob's H×W whose channels are not swapped (a fancy-index copy) is itself changed: after the
        call it holds the raw-scaled, mean-subtracted values (transposed back to its own layout)."""
        self._check(in_)
        caffe_in = np.asarray(data).astype(np.float32, copy=False)
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
        """The inverse of :meth:`preprocess` on a squeezed copy of ``data``, which keeps its dtype (pycaffe's
        ``data.copy().squeeze()``; the blob's float32 stays float32, a float64 array stays float64)."""
        self._check(in_)
        decaf_in = np.array(data, copy=True).squeeze()
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

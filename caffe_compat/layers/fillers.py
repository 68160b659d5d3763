"""Caffe's weight fillers (``include/caffe/filler.hpp``) on torch tensors, driven by a ``torch.Generator``.

``fill_blob(tensor, filler_param, generator)`` fills ``tensor`` in place and returns it.  The random
streams are torch's, not Caffe's boost RNG, so the *distributions* match Caffe, not the bits.
``filler_param`` is a ``caffe_pb2.FillerParameter`` (``None`` = the proto default: constant 0, which is
what Caffe uses for an unset ``weight_filler``/``bias_filler``).

Legacy axes: Caffe calls ``num = shape[0]`` and ``channels = shape[1]`` (1 when the blob has a single
axis, and also 1 for both when it has none).

==================  =====================================================================================
type                values
==================  =====================================================================================
constant            ``value`` (default 0)
uniform             U[min, max) (defaults 0, 1); ``min > max`` is a FormatError (Caffe CHECKs ``min <= max``)
gaussian            N(mean, std²) (defaults 0, 1); ``std <= 0`` is a FormatError (Caffe's Gaussian draw
                    CHECKs ``sigma > 0``: ``std: 0`` aborts); ``sparse >= 0``: each value is then kept with
                    probability ``sparse / num`` (zeroed otherwise), i.e. on average ``sparse``
                    non-zeros per column of an InnerProduct weight (``num`` = number of outputs);
                    ``sparse > num`` is a FormatError (Caffe's Bernoulli draw CHECKs ``p <= 1``)
positive_unitball   U[0, 1), then each of the ``num`` rows (``count/num`` values) divided by its sum
xavier              U[-a, a), a = sqrt(3 / n)
msra                N(0, 2 / n)
bilinear            4-D square kernels (K×K), per position: (1 - |x/f - c|)(1 - |y/f - c|) with
                    f = ceil(K/2), c = (K - 1) / (2f) (BVLC master's centre, also used by Caffe 1.0),
                    each operation rounded in the blob's type (see :func:`bilinear_kernel`)
==================  =====================================================================================

For xavier/msra: ``fan_in = count / num``, ``fan_out = count / channels``; ``variance_norm`` FAN_IN
(default) uses n = fan_in, FAN_OUT n = fan_out, AVERAGE n = (fan_in + fan_out) / 2.  Only ``gaussian``
accepts ``sparse``; Caffe aborts on ``sparse`` for the others and so do we (``FormatError``).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from caffe_compat.errors import FormatError
from caffe_compat.proto import caffe_pb2

_VarianceNorm = caffe_pb2.FillerParameter

FILLER_TYPES = ("constant", "uniform", "gaussian", "positive_unitball", "xavier", "msra", "bilinear")


def constant_filler(value: float = 0.0, **fields) -> caffe_pb2.FillerParameter:
    """A ``FillerParameter`` of type constant (used for layer defaults such as PReLU's 0.25)."""
    return filler_parameter("constant", value=value, **fields)


def filler_parameter(type_: str, **fields) -> caffe_pb2.FillerParameter:
    """Build a ``FillerParameter``: ``filler_parameter("xavier", variance_norm=2)``."""
    param = caffe_pb2.FillerParameter(type=type_)
    for name, value in fields.items():
        setattr(param, name, value)
    return param


def layer_filler(container, field: str, default: caffe_pb2.FillerParameter | None = None):
    """``container.<field>`` if the prototxt sets it, else ``default`` (else the proto default,
    constant 0): Caffe's ``has_filler() ? filler() : <layer default>``."""
    if container.HasField(field):
        return getattr(container, field)
    return default if default is not None else caffe_pb2.FillerParameter()


def _legacy_num_channels(shape: tuple[int, ...]) -> tuple[int, int]:
    num = shape[0] if len(shape) >= 1 else 1
    channels = shape[1] if len(shape) >= 2 else 1
    return num, channels


def fan_in_out(shape: tuple[int, ...]) -> tuple[int, int]:
    """Caffe's ``(count / num, count / channels)`` for xavier/msra."""
    count = int(math.prod(shape))
    num, channels = _legacy_num_channels(shape)
    return count // num, count // channels


def _variance_n(param: caffe_pb2.FillerParameter, shape: tuple[int, ...]) -> float:
    fan_in, fan_out = fan_in_out(shape)
    if param.variance_norm == _VarianceNorm.AVERAGE:
        return (fan_in + fan_out) / 2.0
    if param.variance_norm == _VarianceNorm.FAN_OUT:
        return float(fan_out)
    return float(fan_in)


def bilinear_kernel(size: int, dtype=torch.float32) -> torch.Tensor:
    """The K×K bilinear-interpolation kernel of Caffe's ``BilinearFiller``, bit for bit: Caffe computes in
    the blob's type (Dtype): ``c`` is the double ``(K − 1) / (2f)`` rounded to Dtype, then ``x / f − c``,
    ``fabs`` (its float overload: math.h is included), ``1 − ·`` and the product are Dtype operations, each
    rounded (in float32 that differs from a double computation rounded once, e.g. for K = 5, 6, 9, 12)."""
    f = math.ceil(size / 2.0)
    c = torch.tensor((size - 1) / (2.0 * f), dtype=dtype)
    pos = torch.arange(size, dtype=dtype)
    weights = 1 - torch.abs(pos / f - c)
    return weights[:, None] * weights[None, :]


def _random(shape, generator, dtype, kind: str) -> torch.Tensor:
    # Draw on the generator's device (CPU by default); the caller copies to the blob's device.
    device = generator.device if generator is not None else torch.device("cpu")
    if kind == "uniform":
        return torch.rand(shape, generator=generator, dtype=dtype, device=device)
    return torch.randn(shape, generator=generator, dtype=dtype, device=device)


def fill_blob(tensor: torch.Tensor, filler_param: caffe_pb2.FillerParameter | None = None,
              generator: torch.Generator | None = None) -> torch.Tensor:
    """Fill ``tensor`` in place with Caffe's filler ``filler_param``; returns ``tensor``."""
    param = filler_param if filler_param is not None else caffe_pb2.FillerParameter()
    kind = param.type
    shape = tuple(tensor.shape)
    count = int(math.prod(shape))
    if kind not in FILLER_TYPES:
        raise FormatError(f"unknown filler type '{kind}' (expected one of {', '.join(FILLER_TYPES)})")
    if param.sparse != -1 and kind != "gaussian":
        raise FormatError(f"filler '{kind}': sparse={param.sparse} is only supported by the gaussian filler")
    if count == 0:
        raise FormatError(f"filler '{kind}': cannot fill an empty blob of shape {shape}")
    draw_dtype = tensor.dtype if tensor.dtype.is_floating_point else torch.float32
    if kind == "constant":
        values = torch.full(shape, float(param.value), dtype=torch.float64)
    elif kind == "uniform":
        if np.float32(param.min) > np.float32(param.max):  # caffe_rng_uniform CHECK_LE(a, b)
            raise FormatError(f"uniform filler: min {param.min} is above max {param.max} (Caffe's caffe_rng_uniform "
                              f"CHECKs min <= max)")
        values = _random(shape, generator, draw_dtype, "uniform") * (param.max - param.min) + param.min
    elif kind == "gaussian":
        if not np.float32(param.std) > 0:  # caffe_rng_gaussian CHECK_GT(sigma, 0)
            raise FormatError(f"gaussian filler: std must be > 0, got {param.std} (Caffe's caffe_rng_gaussian CHECKs "
                              f"sigma > 0: std 0 aborts; use a constant filler for a fixed value)")
        values = _random(shape, generator, draw_dtype, "normal") * param.std + param.mean
        if param.sparse < -1:
            raise FormatError(f"gaussian filler: sparse must be >= -1, got {param.sparse}")
        if param.sparse >= 0:
            if len(shape) < 1:
                raise FormatError("gaussian filler: sparse needs a blob with at least one axis")
            # Caffe: Dtype(sparse) / Dtype(num_outputs), then caffe_rng_bernoulli CHECKs 0 <= p <= 1
            if np.float32(param.sparse) / np.float32(shape[0]) > 1:
                raise FormatError(f"gaussian filler: sparse={param.sparse} is more than the {shape[0]} outputs "
                                  f"(shape[0] of {shape}): the keep probability sparse / outputs exceeds 1 (Caffe's "
                                  f"caffe_rng_bernoulli CHECKs p <= 1)")
            keep_probability = param.sparse / shape[0]
            keep = _random(shape, generator, torch.float64, "uniform") < keep_probability
            values = values * keep.to(values.device)
    elif kind == "positive_unitball":
        num, _ = _legacy_num_channels(shape)
        values = _random(shape, generator, draw_dtype, "uniform").reshape(num, -1)
        values = (values / values.sum(dim=1, keepdim=True)).reshape(shape)
    elif kind == "xavier":
        scale = math.sqrt(3.0 / _variance_n(param, shape))
        values = (_random(shape, generator, draw_dtype, "uniform") * 2.0 - 1.0) * scale
    elif kind == "msra":
        std = math.sqrt(2.0 / _variance_n(param, shape))
        values = _random(shape, generator, draw_dtype, "normal") * std
    else:  # bilinear
        if len(shape) != 4:
            raise FormatError(f"bilinear filler: the blob must have 4 axes, got shape {shape}")
        if shape[2] != shape[3]:
            raise FormatError(f"bilinear filler: the kernel must be square, got {shape[2]}x{shape[3]}")
        values = bilinear_kernel(shape[3], draw_dtype).expand(shape)
    with torch.no_grad():
        tensor.copy_(values.to(device=tensor.device, dtype=tensor.dtype))
    return tensor

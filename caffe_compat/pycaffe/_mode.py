"""pycaffe's global state: the phase constants and the mode functions (``caffe.TRAIN``/``caffe.TEST``,
``set_mode_cpu``, ``set_mode_gpu``, ``set_device``, ``set_random_seed``).

As in pycaffe (Caffe's ``Caffe::Get()`` singleton), the mode is process-wide and read when a net is
built: ``set_mode_gpu()`` makes nets built afterwards run on ``cuda:<set_device>`` when CUDA is available
(else a warning and CPU); nets already built keep their device.  ``set_random_seed(seed)`` seeds the
fillers of nets built afterwards and torch's global RNG (Dropout masks); without it fillers use seed 0
(deterministic), where Caffe would seed from the clock.
"""

from __future__ import annotations

import warnings

import torch

from caffe_compat.errors import CaffeCompatError
from caffe_compat.proto import caffe_pb2

__all__ = ["TRAIN", "TEST", "set_mode_cpu", "set_mode_gpu", "set_device", "set_random_seed", "current_device",
           "filler_seed"]

TRAIN = caffe_pb2.TRAIN  # 0, as pycaffe's caffe.TRAIN
TEST = caffe_pb2.TEST    # 1, as pycaffe's caffe.TEST

# the process-wide mode (Caffe's singleton): GPU on/off, the CUDA device, the filler seed (None: unset)
_MODE = {"gpu": False, "device": 0, "seed": None}


def set_mode_cpu() -> None:
    """Nets built from now on run on the CPU."""
    _MODE["gpu"] = False


def set_mode_gpu() -> None:
    """Nets built from now on run on CUDA device ``set_device`` (CPU with a warning when CUDA is missing)."""
    _MODE["gpu"] = True


def set_device(device_id: int) -> None:
    """The CUDA device used in GPU mode (Caffe's ``caffe.set_device``)."""
    device_id = int(device_id)
    if device_id < 0:
        raise CaffeCompatError(f"set_device: device id must be >= 0, got {device_id}")
    if torch.cuda.is_available() and device_id >= torch.cuda.device_count():
        raise CaffeCompatError(f"set_device: device {device_id} does not exist ({torch.cuda.device_count()} "
                               f"CUDA device(s))")
    _MODE["device"] = device_id


def set_random_seed(seed: int) -> None:
    """Seed the fillers of nets built afterwards and torch's RNG (Dropout masks)."""
    _MODE["seed"] = int(seed)
    torch.manual_seed(int(seed))


def filler_seed() -> int:
    """The seed of the fillers of a net built now: ``set_random_seed``'s, else 0."""
    return _MODE["seed"] if _MODE["seed"] is not None else 0


def current_device() -> torch.device:
    """The device the mode selects now (CPU when GPU mode is on but CUDA is unavailable, with a warning)."""
    if not _MODE["gpu"]:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        warnings.warn("caffe_compat: set_mode_gpu() was called but CUDA is not available; running on the CPU",
                      RuntimeWarning, stacklevel=3)
        return torch.device("cpu")
    return torch.device("cuda", _MODE["device"])

"""pycaffe's module functions that are not about one net (BVLC's ``_caffe`` binding): ``layer_type_list``,
the multi-GPU globals (``solver_count``, ``solver_rank``, ``set_solver_count``, ``set_solver_rank``,
``set_multiprocess``, ``has_nccl``, ``NCCL``), ``Timer``, ``init_log``/``log`` and ``__version__``.

What they answer here (each tells the truth about this process, as Caffe's did about its build):

* ``layer_type_list()``: the layer types a net may use, sorted (Caffe's ``LayerRegistry::LayerTypeList``):
  every registered port's type, and ``"Python"`` when a ``Python`` layer can be built (a native port of
  one is registered, or the user-layer support :mod:`caffe_compat.layers.python_user` is present).
* ``solver_count()``/``solver_rank()``: what ``set_solver_count``/``set_solver_rank`` set; unset, the
  world size and rank of an initialised ``torch.distributed`` process group, else 1 and 0 (Caffe's
  defaults).  ``set_multiprocess(bool)`` records Caffe's flag (``multiprocess()`` reads it).
* ``has_nccl()``: true when ``torch.distributed`` has its NCCL backend and CUDA is available.  ``NCCL``
  maps Caffe's NCCL object onto ``torch.distributed``: ``NCCL.new_uid()`` (bytes, as pycaffe 3), and
  ``NCCL(solver, uid)`` needs an initialised NCCL process group (``torch.distributed.init_process_group``);
  ``bcast()`` broadcasts rank 0's weights, and as a solver callback it averages the gradients over the
  group before each update (Caffe's ``on_gradients_ready`` all-reduce).  Without NCCL it raises a
  CaffeCompatError saying what is missing.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import time

import torch

from caffe_compat import __version__  # pycaffe's caffe.__version__
from caffe_compat.errors import CaffeCompatError

__all__ = ["layer_type_list", "solver_count", "solver_rank", "set_solver_count", "set_solver_rank",
           "set_multiprocess", "multiprocess", "has_nccl", "NCCL", "Timer", "init_log", "log", "__version__"]

_GLOBALS: dict = {"solver_count": None, "solver_rank": None, "multiprocess": False}


def layer_type_list() -> list[str]:
    """The layer types a net may use, sorted (see the module docstring)."""
    from caffe_compat.layers import registered_types

    types = {t for t in registered_types() if not t.startswith("Python:")}
    if (any(t.startswith("Python:") for t in registered_types())
            or importlib.util.find_spec("caffe_compat.layers.python_user") is not None):
        types.add("Python")
    return sorted(types)


def _group():
    dist = torch.distributed
    return dist if dist.is_available() and dist.is_initialized() else None


def solver_count() -> int:
    """The number of solvers training together (see the module docstring)."""
    if _GLOBALS["solver_count"] is not None:
        return _GLOBALS["solver_count"]
    group = _group()
    return group.get_world_size() if group is not None else 1


def solver_rank() -> int:
    """This solver's rank among them (see the module docstring)."""
    if _GLOBALS["solver_rank"] is not None:
        return _GLOBALS["solver_rank"]
    group = _group()
    return group.get_rank() if group is not None else 0


def set_solver_count(count: int) -> None:
    count = int(count)
    if count < 1:
        raise CaffeCompatError(f"set_solver_count: the count must be >= 1, got {count}")
    _GLOBALS["solver_count"] = count


def set_solver_rank(rank: int) -> None:
    rank = int(rank)
    if rank < 0:
        raise CaffeCompatError(f"set_solver_rank: the rank must be >= 0, got {rank}")
    _GLOBALS["solver_rank"] = rank


def set_multiprocess(value: bool) -> None:
    _GLOBALS["multiprocess"] = bool(value)


def multiprocess() -> bool:
    return bool(_GLOBALS["multiprocess"])


def has_nccl() -> bool:
    """Whether NCCL can be used: torch.distributed with its NCCL backend, and CUDA."""
    dist = torch.distributed
    return bool(dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available())


class NCCL:
    """Caffe's NCCL object on ``torch.distributed`` (see the module docstring)."""

    def __init__(self, solver, uid: bytes):
        if not has_nccl():
            raise CaffeCompatError("caffe.NCCL: NCCL is not available here (it needs CUDA and torch.distributed "
                                   "with the NCCL backend); check caffe.has_nccl() first")
        group = _group()
        if group is None or group.get_backend() != "nccl":
            raise CaffeCompatError("caffe.NCCL: initialise the NCCL process group first "
                                   "(torch.distributed.init_process_group('nccl', ...), one process per GPU)")
        self.solver, self.uid = solver, bytes(uid)

    @staticmethod
    def new_uid() -> bytes:
        """A new unique id (NCCL's 128-byte ``ncclUniqueId``), as bytes."""
        return os.urandom(128)

    def _tensors(self) -> list:
        return [p for p in self.solver.net.torch_net.parameters()]

    def bcast(self) -> None:
        """Broadcast rank 0's weights to every rank (Caffe's ``NCCL::Broadcast``)."""
        for tensor in self._tensors():
            torch.distributed.broadcast(tensor.data, src=0)

    def on_start(self) -> None:
        pass

    #: ``net.after_backward(nccl)`` registers no layer callback (see :meth:`__call__`)
    reduces_at_gradients_ready = True

    def __call__(self, layer: int) -> None:
        """Caffe's ``NCCL::run(layer)``, the layer-wise reduce (``layer_wise_reduce``, registered by
        ``solver.net.after_backward(nccl)``): here the whole reduction is :meth:`on_gradients_ready`'s, after
        the backward, so this does nothing and the net keeps its one whole-net backward."""

    def on_gradients_ready(self) -> None:
        """Average the gradients over the group (Caffe sums, then scales by 1/solver_count)."""
        size = torch.distributed.get_world_size()
        for tensor in self._tensors():
            if tensor.grad is not None:
                torch.distributed.all_reduce(tensor.grad)
                tensor.grad.div_(size)


class Timer:
    """Caffe's ``Timer``: ``start()``, ``stop()``, ``ms`` (milliseconds between them; while running, up to
    now)."""

    def __init__(self):
        self._start = self._stop = None

    def start(self) -> None:
        self._start, self._stop = time.perf_counter(), None

    def stop(self) -> None:
        if self._start is not None:
            self._stop = time.perf_counter()

    @property
    def ms(self) -> float:
        if self._start is None:
            return 0.0
        end = self._stop if self._stop is not None else time.perf_counter()
        return (end - self._start) * 1000.0


def init_log(level: int = 0, stderr: bool = False) -> None:
    """pycaffe's ``init_log``: glog-style INFO lines of caffe_compat on stderr (level 0 INFO ... 2 ERROR)."""
    levels = {0: logging.INFO, 1: logging.WARNING, 2: logging.ERROR}
    logger = logging.getLogger("caffe_compat")
    if not any(getattr(h, "_pycaffe_init_log", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler._pycaffe_init_log = True
        logger.addHandler(handler)
    logger.setLevel(levels.get(int(level), logging.INFO))


def log(message: str) -> None:
    """pycaffe's ``caffe.log``: one INFO line."""
    logging.getLogger("caffe_compat").info("%s", message)

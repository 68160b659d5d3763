"""Shared plumbing of the batch samplers: seeded epochs and the DDP split of each global batch.

Every sampler here builds *global* batches of ``batch_size`` indices from ``(seed, epoch)`` alone,
so all ranks build the same ones; rank ``r`` of ``num_replicas`` yields its share
(``batch_size / num_replicas`` indices; by default the contiguous slice ``[r*b, (r+1)*b)``, which
keeps label runs together; a sampler may override :meth:`local_part`).  Concatenating the ranks'
shares in rank order gives the global batch back.  ``num_replicas`` / ``rank`` default to the
initialised ``torch.distributed`` group, else 1 / 0.

Epochs follow ``DistributedSampler``: ``set_epoch(e)`` selects epoch ``e``; additionally each
``iter()`` advances the epoch by one (at the call), so a plain loop over epochs never repeats
itself; ``len()`` counts the batches of the epoch the next ``iter()`` yields.
Random numbers come from ``numpy.random.RandomState`` (a stream numpy keeps stable across versions).
Use a sampler as ``DataLoader(dataset, batch_sampler=sampler)``.

Resuming (``caffe_compat.solver.train.train(..., resume=...)`` saves it beside each snapshot):
``state_dict()`` is ``{"epoch": e, "batch": b, "seed": s}``, meaning *the next* ``iter()`` *yields epoch*
``e`` *from its global batch* ``b`` *on*; ``load_state_dict(state)`` sets it (``batch`` applies to that one
``iter()``, the following epochs start at their first batch).  The batches of an epoch depend on
``(seed, epoch)`` alone, so this is the whole state; the consumer adds the batches it has taken from
the current ``iter()`` to ``batch`` (a DataLoader's workers fetch ahead of what was consumed).
"""

from __future__ import annotations

import itertools
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import Sampler

from caffe_compat.errors import DataError


def epoch_rng(seed: int, epoch: int, stream: int = 0) -> np.random.RandomState:
    """A ``RandomState`` that depends on ``(seed, epoch, stream)`` only."""
    return np.random.RandomState([seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, epoch & 0xFFFFFFFF, stream])


def as_label_array(labels, what: str = "labels") -> np.ndarray:
    """``labels`` as a 1-D int64 array (float labels must be integral, like Caffe's float blobs)."""
    array = np.asarray(labels)
    if array.ndim != 1 or array.size == 0:
        raise DataError(f"{what} must be a non-empty 1-D sequence, got shape {array.shape}")
    if array.dtype.kind == "f":
        if not np.all(np.isfinite(array)) or np.any(array != np.round(array)):
            raise DataError(f"{what} must hold integers")
    elif array.dtype.kind not in "iub":
        raise DataError(f"{what} must hold integers, got dtype {array.dtype}")
    return array.astype(np.int64)


def group_by_label(labels: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """Sorted distinct labels and, for each, its sample indices in ascending order."""
    order = np.argsort(labels, kind="stable")
    values, starts = np.unique(labels[order], return_index=True)
    return values, np.split(order, starts[1:])


def resolve_replicas(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """``(num_replicas, rank)``: given values, else the ``torch.distributed`` group's, else ``(1, 0)``."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if num_replicas is None:
        num_replicas = torch.distributed.get_world_size() if distributed else 1
    if rank is None:
        rank = torch.distributed.get_rank() if distributed else 0
    if num_replicas < 1 or not 0 <= rank < num_replicas:
        raise DataError(f"need num_replicas >= 1 and 0 <= rank < num_replicas, got {num_replicas}, {rank}")
    return int(num_replicas), int(rank)


class GlobalBatchSampler(Sampler[list[int]]):
    """Base class: subclasses implement :meth:`global_batches` and :meth:`num_batches`."""

    def __init__(self, batch_size: int, seed: int, num_replicas: int | None, rank: int | None) -> None:
        if batch_size < 1:
            raise DataError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.num_replicas, self.rank = resolve_replicas(num_replicas, rank)
        if self.batch_size % self.num_replicas:
            raise DataError(f"batch_size {batch_size} is not divisible by num_replicas {self.num_replicas}")
        self.local_batch_size = self.batch_size // self.num_replicas
        self.epoch = 0
        self._start_batch = 0  # the first global batch the next iter() yields (load_state_dict)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next ``iter()`` yields (``DistributedSampler`` convention)."""
        self.epoch = int(epoch)

    def global_batches(self, epoch: int) -> Iterator[np.ndarray]:
        """The global batches of ``epoch`` (index arrays of length ``batch_size``)."""
        raise NotImplementedError

    def num_batches(self, epoch: int) -> int:
        """How many batches ``epoch`` has."""
        raise NotImplementedError

    def local_part(self, batch: np.ndarray) -> np.ndarray:
        """This rank's share of a global batch: the contiguous slice ``[rank*b, (rank+1)*b)``."""
        start = self.rank * self.local_batch_size
        return batch[start : start + self.local_batch_size]

    def global_batches_from(self, epoch: int, start: int) -> Iterator[np.ndarray]:
        """The global batches of ``epoch`` from batch number ``start`` on (resuming mid-epoch)."""
        if start <= 0:
            return self.global_batches(epoch)
        return itertools.islice(self.global_batches(epoch), start, None)

    def state_dict(self) -> dict:
        """What the next ``iter()`` yields: epoch ``epoch`` from its global batch ``batch`` (module docstring)."""
        return {"epoch": int(self.epoch), "batch": int(getattr(self, "_start_batch", 0)), "seed": int(self.seed)}

    def load_state_dict(self, state: dict) -> None:
        """Make the next ``iter()`` yield epoch ``state["epoch"]`` from its global batch ``state["batch"]``."""
        epoch, batch = int(state["epoch"]), int(state.get("batch", 0))
        if epoch < 0 or batch < 0:
            raise DataError(f"sampler state: epoch and batch must be >= 0, got {epoch}, {batch}")
        self.epoch, self._start_batch = epoch, batch

    def __iter__(self) -> Iterator[list[int]]:
        epoch, start = self.epoch, getattr(self, "_start_batch", 0)
        self.epoch, self._start_batch = epoch + 1, 0
        return (self.local_part(batch).tolist() for batch in self.global_batches_from(epoch, start))

    def __len__(self) -> int:
        """Batches of the epoch the next ``iter()`` yields (from its start batch on)."""
        return max(self.num_batches(self.epoch) - getattr(self, "_start_batch", 0), 0)

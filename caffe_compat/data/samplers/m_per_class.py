"""M-per-class batches: ``batch_size / m`` distinct classes per batch, ``m`` images of each.

The classic P x K sampler of metric learning (pytorch-metric-learning's ``MPerClassSampler``
draws the same shape), made epoch-exact here: **every image is in at least one batch per epoch**.

One epoch, from ``RandomState(seed, epoch)``:

1. each class's images are permuted and cut into chunks of ``m``; a short last chunk is filled up
   with other images of the same class (the first ones of the permutation); a class with fewer
   than ``m`` images repeats its images (drawn with replacement) to make one chunk;
2. while chunks remain: if at least ``P = batch_size / m`` classes still have chunks, draw ``P`` of
   them without replacement with probability proportional to their remaining chunk counts (so
   large classes are spread over the epoch); otherwise take all remaining classes and fill up
   with other classes, chosen uniformly, each contributing ``m`` random images of its own;
3. the batch is the next chunk of each chosen class, in the drawn order (runs of ``m``).

The number of batches is ``ceil``-like, ``sum_c ceil(n_c/m) / P`` plus a few fill-up batches, and
varies slightly between epochs.  Requires ``batch_size % m == 0`` and at least ``P`` classes.
DDP: contiguous slices; with ``(batch_size / num_replicas) % m == 0`` no run is split.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from caffe_compat.data.samplers.base import GlobalBatchSampler, as_label_array, epoch_rng, group_by_label
from caffe_compat.errors import DataError


def _chunks(images: np.ndarray, m: int, rng: np.random.RandomState) -> list[np.ndarray]:
    if len(images) < m:
        return [np.concatenate([rng.permutation(images), rng.choice(images, m - len(images))])]
    perm = rng.permutation(images)
    short = (-len(perm)) % m
    return np.split(np.concatenate([perm, perm[:short]]), (len(perm) + short) // m)


class MPerClassSampler(GlobalBatchSampler):
    """``P = batch_size / m`` classes x ``m`` images per batch, every image once per epoch."""

    def __init__(
        self,
        labels: Sequence[int] | np.ndarray,
        m: int,
        batch_size: int,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        super().__init__(batch_size, seed, num_replicas, rank)
        if m < 1 or batch_size % m:
            raise DataError(f"batch_size {batch_size} must be a positive multiple of m = {m}")
        self.labels = as_label_array(labels)
        self.m = int(m)
        self.classes_per_batch = batch_size // m
        _, self.groups = group_by_label(self.labels)
        if len(self.groups) < self.classes_per_batch:
            raise DataError(
                f"batch_size / m = {self.classes_per_batch} classes per batch, but the labels hold "
                f"only {len(self.groups)} classes"
            )
        self._plans: dict[int, list[np.ndarray]] = {}

    def plan(self, epoch: int) -> list[np.ndarray]:
        """All global batches of ``epoch`` (cached for the last epoch asked)."""
        if epoch not in self._plans:
            self._plans = {epoch: self._make_plan(epoch)}
        return self._plans[epoch]

    def _make_plan(self, epoch: int) -> list[np.ndarray]:
        rng = epoch_rng(self.seed, epoch)
        chunks = [_chunks(group, self.m, rng) for group in self.groups]
        remaining = np.array([len(c) for c in chunks], dtype=np.int64)
        p = self.classes_per_batch
        batches = []
        while remaining.any():
            available = np.flatnonzero(remaining)
            if len(available) >= p:
                chosen = rng.choice(available, p, replace=False, p=remaining[available] / remaining[available].sum())
                fillers = np.empty(0, np.int64)
            else:
                chosen = rng.permutation(available)
                others = np.setdiff1d(np.arange(len(chunks)), available)
                fillers = rng.choice(others, p - len(available), replace=False)
            parts = []
            for c in chosen:
                parts.append(chunks[c][len(chunks[c]) - remaining[c]])
                remaining[c] -= 1
            for c in fillers:
                group = self.groups[c]
                parts.append(rng.choice(group, self.m, replace=len(group) < self.m))
            batches.append(np.concatenate(parts))
        return batches

    def num_batches(self, epoch: int) -> int:
        return len(self.plan(epoch))

    def global_batches(self, epoch: int) -> Iterator[np.ndarray]:
        return iter(self.plan(epoch))

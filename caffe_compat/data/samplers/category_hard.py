"""FastAP's category-hard mini-batch sampling (He et al., "Deep Metric Learning to Rank",
supplementary section A), with its VehicleID variant.

A batch of ``M = batch_size`` indices is two halves of ``M/2``:

* ``variant="two_categories"`` (Stanford Online Products: 12 super-classes; In-Shop: 23): the
  halves come from two different categories; an epoch visits every unordered pair of categories
  ``batches_per_pair`` times (5 for SOP: ``C(12,2) * 5 = 330`` batches, 2 for In-Shop), in a
  shuffled order, the two categories of a pair in random order.  Every class needs a category.
* ``variant="vehicleid"`` (VehicleID: 250 labelled vehicle models covering about half of the
  training set): the first half comes from one labelled category, the second from the classes
  *without* a category (``category < 0``); category ``c`` with ``N_c`` images gets
  ``ceil(2 N_c / M)`` batches per epoch (the paper's ``sum_c 2 N_c / M``, rounded up), shuffled.

Within a half, whole classes are drawn at random "until M/2 images are obtained": each category
(and the unlabelled pool) keeps a stream that walks its classes in a shuffled order, each class's
images shuffled and consecutive (a batch takes a sampled class completely, the paper's few-shot
rule); the class cut by the end of a half continues in that category's next half, and an
exhausted stream starts a new shuffled pass.  Hence, per epoch, in the ``vehicleid`` variant every
image of a labelled category is visited (unlabelled images are a continuing stream, all visited
once the epoch takes at least as many of them); in ``two_categories`` each category is visited
``(K-1) * batches_per_pair * M/2`` times, as the pairs dictate.

Random numbers: ``RandomState(seed, epoch)``.  DDP: rank ``r`` takes the ``r``-th slice of *each*
half (``M / (2 num_replicas)`` images of each), so every rank keeps the hard/easy structure;
needs ``batch_size % (2 * num_replicas) == 0``.
"""

from __future__ import annotations

import itertools
from typing import Iterator, Sequence

import numpy as np

from caffe_compat.data.samplers.base import GlobalBatchSampler, as_label_array, epoch_rng, group_by_label
from caffe_compat.errors import DataError

VARIANTS = ("two_categories", "vehicleid")


class ClassStream:
    """Shuffled passes over whole classes: ``take(n)`` returns the next ``n`` indices."""

    def __init__(self, groups: list[np.ndarray], rng: np.random.RandomState) -> None:
        self.groups = groups
        self.rng = rng
        self.buffer = np.empty(0, np.int64)

    def _new_pass(self) -> np.ndarray:
        order = self.rng.permutation(len(self.groups))
        return np.concatenate([self.rng.permutation(self.groups[c]) for c in order])

    def take(self, n: int) -> np.ndarray:
        while len(self.buffer) < n:
            self.buffer = np.concatenate([self.buffer, self._new_pass()])
        out, self.buffer = self.buffer[:n], self.buffer[n:]
        return out


class CategoryHardSampler(GlobalBatchSampler):
    """FastAP's category-hard batches (see the module docstring)."""

    def __init__(
        self,
        labels: Sequence[int] | np.ndarray,
        categories: Sequence[int] | np.ndarray,
        batch_size: int,
        seed: int = 0,
        variant: str = "two_categories",
        batches_per_pair: int = 5,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        super().__init__(batch_size, seed, num_replicas, rank)
        if variant not in VARIANTS:
            raise DataError(f"variant must be one of {VARIANTS}, got {variant!r}")
        if batch_size % (2 * self.num_replicas):
            raise DataError(
                f"batch_size {batch_size} must be divisible by 2 * num_replicas = {2 * self.num_replicas}"
            )
        if batches_per_pair < 1:
            raise DataError(f"batches_per_pair must be >= 1, got {batches_per_pair}")
        self.labels = as_label_array(labels)
        cats = as_label_array(categories, "categories")
        if cats.shape != self.labels.shape:
            raise DataError(f"{len(cats)} categories for {len(self.labels)} labels")
        self.variant = variant
        self.batches_per_pair = int(batches_per_pair)
        self.half = batch_size // 2
        values, groups = group_by_label(self.labels)
        class_category = np.array([cats[g[0]] for g in groups], dtype=np.int64)
        for value, group, category in zip(values, groups, class_category):
            if np.any(cats[group] != category):
                raise DataError(f"class {value} has images in more than one category: {np.unique(cats[group])}")
        labelled = np.unique(class_category[class_category >= 0])
        self.category_ids = labelled
        self.category_groups = [[groups[i] for i in np.flatnonzero(class_category == c)] for c in labelled]
        self.unlabelled_groups = [groups[i] for i in np.flatnonzero(class_category < 0)]
        if variant == "two_categories":
            if self.unlabelled_groups:
                raise DataError(
                    f"{len(self.unlabelled_groups)} classes have no category (< 0); "
                    "use variant='vehicleid' for partly labelled data"
                )
            if len(labelled) < 2:
                raise DataError(f"two_categories needs at least 2 categories, got {len(labelled)}")
        else:
            if not self.unlabelled_groups or not len(labelled):
                raise DataError("the vehicleid variant needs both labelled (>= 0) and unlabelled (< 0) classes")
        sizes = np.array([sum(len(g) for g in groups_c) for groups_c in self.category_groups], dtype=np.int64)
        self.batches_per_category = -(-2 * sizes // batch_size)

    def num_batches(self, epoch: int) -> int:
        if self.variant == "two_categories":
            k = len(self.category_ids)
            return k * (k - 1) // 2 * self.batches_per_pair
        return int(self.batches_per_category.sum())

    def global_batches(self, epoch: int) -> Iterator[np.ndarray]:
        rng = epoch_rng(self.seed, epoch)
        streams = [ClassStream(groups, rng) for groups in self.category_groups]
        if self.variant == "two_categories":
            pairs = np.array(list(itertools.combinations(range(len(streams)), 2)) * self.batches_per_pair)
            pairs = pairs[rng.permutation(len(pairs))]
            flips = rng.randint(2, size=len(pairs)).astype(bool)
            pairs[flips] = pairs[flips][:, ::-1]
            for a, b in pairs:
                yield np.concatenate([streams[a].take(self.half), streams[b].take(self.half)])
        else:
            unlabelled = ClassStream(self.unlabelled_groups, rng)
            order = rng.permutation(np.repeat(np.arange(len(streams)), self.batches_per_category))
            for c in order:
                yield np.concatenate([streams[c].take(self.half), unlabelled.take(self.half)])

    def local_part(self, batch: np.ndarray) -> np.ndarray:
        """The rank's slice of each half, concatenated (keeps both categories on every rank)."""
        part = self.half // self.num_replicas
        start = self.rank * part
        return np.concatenate([batch[start : start + part], batch[self.half + start : self.half + start + part]])

"""The FAPPY authors' ``LabelShufflingLayer`` (their Python data layer) as a batch sampler.

State: the list of labels in a shuffled order, a current label and a position in its image list.
For every batch slot, in order:

1. if the position has reached the end of the current label's image list, or ``max_per_label``
   (``max_number_object_per_label``: 10 for CUB, 16 for VehicleID in the authors' prototxt),
   that label's image list is reshuffled in place, the position goes back to 0 and the next label
   becomes current; past the last label, the label list is reshuffled and starts over;
2. the slot gets the current label's image at the position; the position advances.

So a batch holds consecutive runs of up to ``max_per_label`` images of one label (fewer for a label
with fewer images), its first run may continue a label of the previous batch and its last run is
cut by the batch end.  Quirks kept: a label's images come in data set order on its *first* visit
(the layer listed them in LMDB key order and shuffles a list only when leaving it); a label at
the end of one label pass can be current again right after the reshuffle.

Stream and epochs: the batches form one infinite stream determined by ``seed``; epoch ``e`` is
stream batches ``[e*L, (e+1)*L)`` with ``L = batches_per_epoch``, by default
``ceil(sum_l min(n_l, max_per_label) / batch_size)``: about one pass over the label list.  An epoch
visits each label about once and at most ``max_per_label`` of its images, so (unlike a plain
shuffling sampler) it does **not** promise to visit every image; over successive passes each
label's reshuffled list rotates different images to the front.  The random numbers come from
``numpy.random.RandomState(seed)`` in the layer's order (initial label shuffle, then every
reshuffle as it happens), so the stream equals the authors' layer run with ``np.random.seed(seed)``
when both list the labels in ascending order (Python 2 did, for small integer labels).
"""

from __future__ import annotations

import copy
import math
from typing import Iterator, Sequence

import numpy as np

from caffe_compat.data.samplers.base import GlobalBatchSampler, as_label_array, group_by_label
from caffe_compat.errors import DataError


class LabelShufflingStream:
    """The layer's state machine; :meth:`take` returns the next ``n`` sample indices."""

    def __init__(self, labels: np.ndarray, max_per_label: float, seed: int) -> None:
        _, groups = group_by_label(labels)
        self.rng = np.random.RandomState(seed & 0xFFFFFFFF)
        self.image_lists = [group.copy() for group in groups]
        self.label_order = np.arange(len(groups))
        self.rng.shuffle(self.label_order)
        self.max_per_label = max_per_label
        self.label_index = 0
        self.image_index = 0

    def take(self, n: int) -> np.ndarray:
        runs = []
        while n > 0:
            images = self.image_lists[self.label_order[self.label_index]]
            end = min(len(images), self.max_per_label)
            if self.image_index >= end:
                self.rng.shuffle(images)
                self.image_index = 0
                self.label_index += 1
                if self.label_index >= len(self.label_order):
                    self.rng.shuffle(self.label_order)
                    self.label_index = 0
                continue
            count = min(int(end) - self.image_index, n)
            runs.append(images[self.image_index : self.image_index + count].copy())  # shuffled in place later
            self.image_index += count
            n -= count
        return np.concatenate(runs) if runs else np.empty(0, np.int64)

    def state_dict(self) -> dict:
        """The whole state (arrays and numbers only): RandomState, every label's (reshuffled) image list
        concatenated in label order, the label order and both cursors."""
        return {"rng": self.rng.get_state(legacy=False),
                "image_lists": np.concatenate(self.image_lists) if self.image_lists else np.empty(0, np.int64),
                "label_order": self.label_order.copy(), "label_index": int(self.label_index),
                "image_index": int(self.image_index)}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` of a stream over the same labels."""
        images = np.asarray(state["image_lists"], dtype=np.int64)
        sizes = [len(group) for group in self.image_lists]
        order = np.asarray(state["label_order"], dtype=self.label_order.dtype)
        if images.shape != (sum(sizes),) or order.shape != self.label_order.shape:
            raise DataError(f"label-shuffling state of {images.size} images / {order.size} labels does not fit a "
                            f"stream of {sum(sizes)} images / {self.label_order.size} labels")
        self.image_lists = [part.copy() for part in np.split(images, np.cumsum(sizes)[:-1])] if sizes else []
        self.label_order = order.copy()
        self.label_index, self.image_index = int(state["label_index"]), int(state["image_index"])
        self.rng.set_state(state["rng"])


class LabelShufflingSampler(GlobalBatchSampler):
    """Batches of the authors' ``LabelShufflingLayer`` (see the module docstring)."""

    def __init__(
        self,
        labels: Sequence[int] | np.ndarray,
        batch_size: int,
        max_per_label: int | None = None,
        seed: int = 0,
        batches_per_epoch: int | None = None,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        super().__init__(batch_size, seed, num_replicas, rank)
        self.labels = as_label_array(labels)
        if max_per_label is not None and max_per_label < 1:
            raise DataError(f"max_per_label must be >= 1 (or None for no cap), got {max_per_label}")
        self.max_per_label = math.inf if max_per_label is None else int(max_per_label)
        _, groups = group_by_label(self.labels)
        per_pass = sum(min(len(group), self.max_per_label) for group in groups)
        self.batches_per_epoch = (
            -(-int(per_pass) // self.batch_size) if batches_per_epoch is None else int(batches_per_epoch)
        )
        if self.batches_per_epoch < 1:
            raise DataError(f"batches_per_epoch must be >= 1, got {batches_per_epoch}")
        self._resume: tuple[int, LabelShufflingStream] | None = None

    def num_batches(self, epoch: int) -> int:
        return self.batches_per_epoch

    def stream_at(self, batch_position: int) -> LabelShufflingStream:
        """The stream state just before global batch number ``batch_position``."""
        if self._resume is not None and self._resume[0] == batch_position:
            return copy.deepcopy(self._resume[1])
        stream = LabelShufflingStream(self.labels, self.max_per_label, self.seed)
        stream.take(batch_position * self.batch_size)
        return stream

    def global_batches(self, epoch: int) -> Iterator[np.ndarray]:
        return self.global_batches_from(epoch, 0)

    def global_batches_from(self, epoch: int, start: int) -> Iterator[np.ndarray]:
        begin = epoch * self.batches_per_epoch
        stream = self.stream_at(begin + max(int(start), 0))
        for _ in range(max(int(start), 0), self.batches_per_epoch):
            yield stream.take(self.batch_size)
        self._resume = (begin + self.batches_per_epoch, copy.deepcopy(stream))

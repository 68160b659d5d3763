"""A torch ``Dataset`` over image records: Caffe's decode (``ReadImageToCVMat``) + ``DataTransformer``.

``dataset[i]`` is ``(image, label)``: ``image`` the float32 ``C x h x w`` tensor that Caffe's
ImageData layer would put in its ``data`` blob for ``records[i]`` (decode with OpenCV, optional
resize to ``new_height x new_width``, then the transformer), ``label`` the record's class label as
an int.  Without a transformer the identity transform is used (float32 CHW, BGR, 0..255).

Randomness (crop offsets, mirroring) comes from a ``numpy.random.RandomState`` owned by the data
set: seeded with ``seed`` in the main process; in a ``DataLoader`` worker it is re-seeded from
``(seed, worker_info.seed)``, so workers draw different, reproducible streams (the worker seeds are
derived by PyTorch from the loader's generator: fix ``torch.manual_seed`` or pass ``generator=``).
The streams with 0 workers and with N workers therefore differ, as every PyTorch loader's do, unless the
batch sampler yields :class:`KeyedBatch` lists: each such batch draws from its own ``RandomState`` seeded
with ``(seed, key)``, so a batch is the same whichever worker makes it, however many workers there are,
and when a run resumed at batch k asks for batch k first (what ``caffe-compat reproduce`` does).

Batches (``DataLoader(..., batch_size=...)`` or ``batch_sampler=``): ``__getitems__`` transforms every
image of the batch straight into one ``(N, C, h, w)`` buffer and returns its rows as :class:`BatchRow`
samples (plain ``(image, label)`` tuples to any other collate function), and the default collate,
through the entry this module adds to ``torch.utils.data``'s ``default_collate_fn_map``, returns that
buffer instead of stacking copies: ``torch.stack`` in the main process runs on torch's intra-op thread pool,
which on a small busy machine cost more than the decoding (0.12-0.8x a plain decode+transform loop,
``benchmarks/bench_input_pipeline.py``).  Same values and random draws, in the same order, as
``[dataset[i] for i in indices]``; images of different sizes (no crop) fall back to the plain samples.
In DataLoader workers the buffer is a new one in shared memory, which is what the default collate makes
there and what the worker hands to the main process without a copy: the per-image arrays and the
``torch.stack`` copy of the plain path (each a fresh 19 MB of pages to fault in per batch) are saved.
The rows are written with ``streaming=True`` (:meth:`DataTransformer.transform`): past the core's cache,
which a batch does not fit in, so the decoder's working set stays there (~4% per image, same values).
"""

from __future__ import annotations

import sys
import threading
from typing import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info
from torch.utils.data._utils.collate import collate, default_collate_fn_map

from caffe_compat.allocator import prefault_for_writing
from caffe_compat.data.image import load_image_bgr
from caffe_compat.data.records import ImageRecord, categories_of, labels_of
from caffe_compat.data.transformer import DataTransformer


class BatchRow(tuple):
    """An ``(image, label)`` sample whose image is row ``row`` of ``whole``, the batch that
    ``__getitems__`` built; the default collate hands back ``whole`` (see the module docstring)."""

    whole: torch.Tensor
    row: int


class KeyedBatch(list):
    """The indices of one batch and its ``key`` (e.g. the batch's position in the training stream): the
    data set draws this batch's crop offsets and mirror flips from ``RandomState((seed, key))`` instead of
    its running generator (a list subclass, so a DataLoader hands it to ``__getitems__`` as it is, through a
    worker's index queue too)."""

    def __init__(self, indices, key: int):
        super().__init__(indices)
        self.key = int(key)


def keyed_generator(seed: int, key: int) -> np.random.RandomState:
    """The ``RandomState`` of the batch ``key`` of a data set seeded with ``seed`` (both taken as 64-bit)."""
    seed, key = int(seed) & (2 ** 64 - 1), int(key) & (2 ** 64 - 1)
    return np.random.RandomState([seed & 0xFFFFFFFF, seed >> 32, key & 0xFFFFFFFF, key >> 32, 0x6B6579])


def _collate_rows(batch, *, collate_fn_map=None):
    whole = batch[0].whole
    if len(batch) == whole.shape[0] and all(type(s) is BatchRow and s.whole is whole and s.row == k
                                            for k, s in enumerate(batch)):
        return [whole, collate([s[1] for s in batch], collate_fn_map=collate_fn_map)]
    return collate([tuple(s) for s in batch], collate_fn_map=collate_fn_map)  # rows of several batches


default_collate_fn_map[BatchRow] = _collate_rows


_SPARE_LOCK = threading.Lock()
_SPARES: list = []  # batch buffers made here; one nothing else references any more is written again


def _batch_buffer(shape: tuple) -> tuple[np.ndarray, torch.Tensor]:
    """A float32 buffer of ``shape`` and its tensor: a former batch's when no tensor, view or sample of it is
    left (its reference count says so), else a new one.  A fresh 19 MB batch costs ~0.15 ms per image in page
    faults (first writes), what the per-image loop never pays."""
    with _SPARE_LOCK:
        for spare in _SPARES:
            if spare.shape == shape and sys.getrefcount(spare) == 3:  # _SPARES, ``spare``, the call's argument
                return spare, torch.from_numpy(spare)
        buffer = np.empty(shape, dtype=np.float32)
        prefault_for_writing(buffer.ctypes.data, buffer.nbytes)  # fresh pages, all about to be written
        _SPARES.append(buffer)
        del _SPARES[:-2]
        return buffer, torch.from_numpy(buffer)


def _shared_batch_buffer(shape: tuple) -> tuple[np.ndarray, torch.Tensor]:
    """In a DataLoader worker: a new float32 buffer of ``shape`` in shared memory and its tensor (the main
    process may hold a former batch for as long as it likes, so none is written again).  Its pages are
    mapped in one system call (:func:`~caffe_compat.allocator.prefault_for_writing`) before the rows are
    written: a batch of 32 crops of 224 x 224 is 4,704 fresh pages, which page faults one at a time took
    10.0 ms to map on the team's VM, the one call 5.4 ms (the same 19 MB written)."""
    count = int(np.prod(shape))
    whole = torch.empty(0, dtype=torch.float32).set_(torch.UntypedStorage._new_shared(4 * count), 0, shape)
    prefault_for_writing(whole.data_ptr(), 4 * count)
    return whole.numpy(), whole


def transform_batch(indices, load, transform, output_shape) -> list:
    """``[(image tensor, label)]`` for ``indices``: ``load(i) -> (pixels, label)``, ``output_shape(pixels)``
    the transformed shape, ``transform(pixels, out)`` writes it; in one buffer when the shapes agree."""
    samples, whole, buffer = [], None, None
    for k, index in enumerate(indices):
        pixels, label = load(index)
        shape = output_shape(pixels)
        if k == 0:
            new_buffer = _batch_buffer if get_worker_info() is None else _shared_batch_buffer
            buffer, whole = new_buffer((len(indices), *shape))
        if buffer is not None and tuple(shape) == buffer.shape[1:]:
            samples.append((torch.from_numpy(transform(pixels, buffer[k])), label))
        else:
            buffer = None
            samples.append((torch.from_numpy(transform(pixels, None)), label))
    if buffer is None:
        return samples
    rows = []
    for k, sample in enumerate(samples):
        row = BatchRow(sample)
        row.whole, row.row = whole, k
        rows.append(row)
    return rows


def _hwc_output_shape(transformer: DataTransformer, image: np.ndarray) -> tuple[int, int, int]:
    height, width = image.shape[:2]
    return transformer.output_shape(image.shape[2] if image.ndim == 3 else 1, height, width)


class ImageRecordDataset(Dataset):
    """Images of ``records`` decoded like Caffe and transformed by ``transformer``."""

    def __init__(
        self,
        records: Sequence[ImageRecord],
        transformer: DataTransformer | None = None,
        color: bool = True,
        new_height: int = 0,
        new_width: int = 0,
        seed: int = 0,
    ) -> None:
        self.records = list(records)
        self.transformer = transformer if transformer is not None else DataTransformer(phase="TEST")
        self.color = color
        self.new_height = new_height
        self.new_width = new_width
        self.seed = int(seed)
        self._rng: np.random.RandomState | None = None
        self._rng_key: object = "unset"

    @property
    def labels(self) -> np.ndarray:
        """Class labels of every record (int64), for the samplers."""
        return labels_of(self.records)

    @property
    def categories(self) -> np.ndarray:
        """Categories of every record (int64, -1 = none), for the category-hard sampler."""
        return categories_of(self.records)

    def __len__(self) -> int:
        return len(self.records)

    def _generator(self) -> np.random.RandomState:
        info = get_worker_info()
        key = None if info is None else info.seed
        if self._rng is None or key != self._rng_key:
            if info is None:
                seed: int | list[int] = self.seed & 0xFFFFFFFF
            else:
                seed = [self.seed & 0xFFFFFFFF, info.seed & 0xFFFFFFFF, (info.seed >> 32) & 0xFFFFFFFF]
            self._rng = np.random.RandomState(seed)
            self._rng_key = key
        return self._rng

    def _load(self, index: int) -> tuple[np.ndarray, int]:
        record = self.records[index]
        return load_image_bgr(record.path, self.color, self.new_height, self.new_width), record.label

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image, label = self._load(index)
        return torch.from_numpy(self.transformer.transform(image, rng=self._generator())), label

    def __getitems__(self, indices: Sequence[int]) -> list:
        """The batch ``indices`` in one buffer (module docstring); a :class:`KeyedBatch` draws from its own
        generator."""
        if type(self).__getitem__ is not ImageRecordDataset.__getitem__:
            return [self[i] for i in indices]  # a subclass with its own items
        rng = keyed_generator(self.seed, indices.key) if isinstance(indices, KeyedBatch) else self._generator()
        transformer = self.transformer

        def transform(image: np.ndarray, out: np.ndarray | None) -> np.ndarray:
            return transformer.transform(image, rng, out=out, streaming=out is not None)  # a row: past the cache

        return transform_batch(indices, self._load, transform, lambda image: _hwc_output_shape(transformer, image))


class NativeLayoutDataset(ImageRecordDataset):
    """An :class:`ImageRecordDataset` over a data set in its native layout: subclasses name the
    ``reader`` (``reader(root, split, **reader_options) -> records``); items are ``(image, label)``."""

    reader = None

    def __init__(
        self,
        root,
        split: str = "train",
        transformer: DataTransformer | None = None,
        new_height: int = 0,
        new_width: int = 0,
        seed: int = 0,
        **reader_options,
    ) -> None:
        records = type(self).reader(root, split, **reader_options)
        super().__init__(records, transformer, True, new_height, new_width, seed)

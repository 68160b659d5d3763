"""A torch ``Dataset`` over image records: Caffe's decode (``ReadImageToCVMat``) + ``DataTransformer``.

``dataset[i]`` is ``(image, label)``: ``image`` the float32 ``C x h x w`` tensor that Caffe's
ImageData layer would put in its ``data`` blob for ``records[i]`` (decode with OpenCV, optional
resize to ``new_height x new_width``, then the transformer), ``label`` the record's class label as
an int.  Without a transformer the identity transform is used (float32 CHW, BGR, 0..255).

Randomness (crop offsets, mirroring) comes from a ``numpy.random.RandomState`` owned by the data
set: seeded with ``seed`` in the main process; in a ``DataLoader`` worker it is re-seeded from
``(seed, worker_info.seed)``, so workers draw different, reproducible streams (the worker seeds are
derived by PyTorch from the loader's generator: fix ``torch.manual_seed`` or pass ``generator=``).
The streams with 0 workers and with N workers therefore differ, as every PyTorch loader's do.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from caffe_compat.data.image import load_image_bgr
from caffe_compat.data.records import ImageRecord, categories_of, labels_of
from caffe_compat.data.transformer import DataTransformer


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

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        record = self.records[index]
        image = load_image_bgr(record.path, self.color, self.new_height, self.new_width)
        blob = self.transformer.transform(image, rng=self._generator())
        return torch.from_numpy(blob), record.label


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

"""Image records and the whitespace-separated list files every data set here is described by.

A reader turns a data set's native list files into a plain ``list[ImageRecord]``: one image path,
its class label exactly as the files write it (no re-indexing), the data set's own image id, and an
optional category (Stanford Online Products' super-class, VehicleID's vehicle model; ``-1`` when the
data set gives none).  Samplers take ``labels_of(records)`` / ``categories_of(records)``.
The list files themselves are parsed by :mod:`caffe_compat.data.listfile`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

NO_CATEGORY = -1


@dataclass(frozen=True)
class ImageRecord:
    """One image of a data set: ``path`` (absolute), ``label`` (class id as in the files),
    ``image_id`` (the data set's id or name, as a string), ``category`` (super-class / model id, or
    ``NO_CATEGORY``)."""

    path: Path
    label: int
    image_id: str
    category: int = NO_CATEGORY


def labels_of(records: Sequence[ImageRecord]) -> np.ndarray:
    """The class labels of ``records`` as an int64 array (sampler input)."""
    return np.fromiter((r.label for r in records), dtype=np.int64, count=len(records))


def categories_of(records: Sequence[ImageRecord]) -> np.ndarray:
    """The categories of ``records`` as an int64 array, ``NO_CATEGORY`` (-1) where there is none."""
    return np.fromiter((r.category for r in records), dtype=np.int64, count=len(records))

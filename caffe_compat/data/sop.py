"""Stanford Online Products in its native layout.

Files under the root (``Stanford_Online_Products/``): ``Ebay_train.txt`` and ``Ebay_test.txt``,
each starting with the header line ``image_id class_id super_class_id path`` followed by one line
per image, ``path`` relative to the root (``bicycle_final/111085122871_0.JPG``).  The split is the
published one (train: 59,551 images of 11,318 classes, test: 60,502 images of 11,316 classes; the
two share no class but share the 12 super-classes).

Records: ``label`` = class_id, ``category`` = super_class_id (FastAP's category-hard sampler draws
two of them per batch), ``image_id`` = image_id as written; file order.  A root that holds
``Stanford_Online_Products/`` is accepted too.
"""

from __future__ import annotations

from pathlib import Path

from caffe_compat.data.dataset import NativeLayoutDataset
from caffe_compat.data.listfile import checked_image, parse_int, read_table
from caffe_compat.data.records import ImageRecord
from caffe_compat.errors import DataError

SPLIT_FILES = {"train": "Ebay_train.txt", "test": "Ebay_test.txt"}
HEADER = ("image_id", "class_id", "super_class_id", "path")


def sop_root(root: str | Path) -> Path:
    """The directory holding ``Ebay_train.txt``: ``root`` itself or ``root/Stanford_Online_Products``."""
    root = Path(root)
    nested = root / "Stanford_Online_Products"
    if not (root / "Ebay_train.txt").is_file() and (nested / "Ebay_train.txt").is_file():
        return nested
    return root


def read_sop(root: str | Path, split: str = "train", check_files: bool = True) -> list[ImageRecord]:
    """The records of ``split`` ("train" or "test"); see the module docstring."""
    if split not in SPLIT_FILES:
        raise DataError(f"Stanford Online Products split must be one of {tuple(SPLIT_FILES)}, got {split!r}")
    root = sop_root(root)
    list_file = root / SPLIT_FILES[split]
    records: list[ImageRecord] = []
    seen: set[str] = set()
    category_of: dict[int, int] = {}
    for number, (image_id, cid, sid, relative) in read_table(list_file, HEADER, header=True):
        parse_int(image_id, list_file, number, "image_id")
        label = parse_int(cid, list_file, number, "class_id")
        category = parse_int(sid, list_file, number, "super_class_id")
        if image_id in seen:
            raise DataError(f"{list_file}:{number}: image id {image_id} appears twice")
        seen.add(image_id)
        if category_of.setdefault(label, category) != category:
            raise DataError(
                f"{list_file}:{number}: class {label} has super-class {category} here "
                f"but {category_of[label]} earlier"
            )
        path = checked_image(root / relative.strip(), list_file, number, check_files)
        records.append(ImageRecord(path=path, label=label, image_id=image_id, category=category))
    return records


class StanfordOnlineProducts(NativeLayoutDataset):
    """Torch data set over :func:`read_sop` records (``(image, label)`` items)."""

    reader = staticmethod(read_sop)

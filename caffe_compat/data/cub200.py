"""CUB-200-2011 in its native layout, with the metric-learning (class-disjoint) split.

Files under the root (``CUB_200_2011/``): ``images.txt`` ("image_id relative/path", paths relative
to ``images/``), ``image_class_labels.txt`` ("image_id class_id"), ``classes.txt`` ("class_id
name").  ``train_test_split.txt`` (the *classification* split) is not used.

Split (Song et al.'s protocol, followed by FAPPY): the first 100 classes (ids 1-100, 5,864 images)
train, the other 100 (ids 101-200, 5,924 images) test.  Generalised to any number ``n`` of classes
(a toy tree): the ``n // 2`` smallest class ids train, the rest test.

Records: ``label`` = class id (1-based, as in the files), ``image_id`` = the numeric id as written,
``category`` = -1.  Records come in ``images.txt`` order.  A root that holds ``CUB_200_2011/``
instead of the files themselves is accepted too.
"""

from __future__ import annotations

from pathlib import Path

from caffe_compat.data.dataset import NativeLayoutDataset
from caffe_compat.data.listfile import checked_image, parse_int, read_table
from caffe_compat.data.records import ImageRecord
from caffe_compat.errors import DataError

SPLITS = ("train", "test", "all")


def cub200_root(root: str | Path) -> Path:
    """The directory holding ``images.txt``: ``root`` itself or ``root/CUB_200_2011``."""
    root = Path(root)
    if not (root / "images.txt").is_file() and (root / "CUB_200_2011" / "images.txt").is_file():
        return root / "CUB_200_2011"
    return root


def read_cub200(root: str | Path, split: str = "train", check_files: bool = True) -> list[ImageRecord]:
    """The records of ``split`` ("train", "test" or "all"); see the module docstring."""
    if split not in SPLITS:
        raise DataError(f"CUB-200-2011 split must be one of {SPLITS}, got {split!r}")
    root = cub200_root(root)
    classes_file = root / "classes.txt"
    class_ids: set[int] = set()
    for number, (cid, _name) in read_table(classes_file, ("class_id", "class_name")):
        value = parse_int(cid, classes_file, number, "class_id")
        if value in class_ids:
            raise DataError(f"{classes_file}:{number}: class id {value} appears twice")
        class_ids.add(value)
    if not class_ids:
        raise DataError(f"{classes_file}: no classes")

    labels_file = root / "image_class_labels.txt"
    label_of: dict[str, int] = {}
    for number, (image_id, cid) in read_table(labels_file, ("image_id", "class_id")):
        value = parse_int(cid, labels_file, number, "class_id")
        if value not in class_ids:
            raise DataError(f"{labels_file}:{number}: class id {value} is not in {classes_file.name}")
        if image_id in label_of:
            raise DataError(f"{labels_file}:{number}: image id {image_id} appears twice")
        label_of[image_id] = value

    ordered = sorted(class_ids)
    train_classes = set(ordered[: len(ordered) // 2])
    images_file = root / "images.txt"
    records: list[ImageRecord] = []
    seen: set[str] = set()
    for number, (image_id, relative) in read_table(images_file, ("image_id", "path")):
        parse_int(image_id, images_file, number, "image_id")
        if image_id in seen:
            raise DataError(f"{images_file}:{number}: image id {image_id} appears twice")
        seen.add(image_id)
        if image_id not in label_of:
            raise DataError(f"{images_file}:{number}: image id {image_id} has no line in {labels_file.name}")
        label = label_of[image_id]
        if split == "all" or (label in train_classes) == (split == "train"):
            path = checked_image(root / "images" / relative.strip(), images_file, number, check_files)
            records.append(ImageRecord(path=path, label=label, image_id=image_id))
    missing = set(label_of) - seen
    if missing:
        raise DataError(f"{labels_file}: image ids not in {images_file.name}: {sorted(missing)[:5]}")
    return records


class Cub200(NativeLayoutDataset):
    """Torch data set over :func:`read_cub200` records (``(image, label)`` items)."""

    reader = staticmethod(read_cub200)

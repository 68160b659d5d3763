"""PKU VehicleID in its native layout.

Files under the root (``VehicleID_V1.0/``):

* ``image/<image_name>.jpg``: the images;
* ``train_test_split/train_list.txt`` and ``test_list_800.txt``, ``test_list_1600.txt``,
  ``test_list_2400.txt``: lines ``image_name vehicle_id`` (the name without ``.jpg``; a name that
  already ends in ``.jpg`` is taken as is);
* ``attribute/model_attr.txt``: lines ``vehicle_id model_id`` for the vehicles whose model is
  labelled (about half of the training vehicles); FastAP's VehicleID category sampler uses it.

Splits: ``"train"`` (13,134 vehicles), and the three test sets ``"small"`` / ``"medium"`` /
``"large"`` = 800 / 1,600 / 2,400 vehicles (``test_list_<n>.txt``).  The toy tree from
:mod:`caffe_compat.data.toy` keeps these file names with scaled-down contents.

Records: ``label`` = vehicle id, ``category`` = model id from ``model_attr.txt`` or -1 when the
vehicle has none (or ``with_models=False``), ``image_id`` = image name; file order.  A root that
holds ``VehicleID_V1.0/`` is accepted too.
"""

from __future__ import annotations

from pathlib import Path

from caffe_compat.data.dataset import NativeLayoutDataset
from caffe_compat.data.listfile import checked_image, parse_int, read_table
from caffe_compat.data.records import NO_CATEGORY, ImageRecord
from caffe_compat.errors import DataError

TEST_SIZES = {"small": 800, "medium": 1600, "large": 2400}
SPLITS = ("train",) + tuple(TEST_SIZES)


def split_list_name(split: str) -> str:
    """``train_list.txt`` or ``test_list_<800|1600|2400>.txt`` for a split name."""
    if split == "train":
        return "train_list.txt"
    if split in TEST_SIZES:
        return f"test_list_{TEST_SIZES[split]}.txt"
    raise DataError(f"VehicleID split must be one of {SPLITS}, got {split!r}")


def vehicleid_root(root: str | Path) -> Path:
    """The directory holding ``train_test_split/``: ``root`` itself or ``root/VehicleID_V1.0``."""
    root = Path(root)
    nested = root / "VehicleID_V1.0"
    if not (root / "train_test_split").is_dir() and (nested / "train_test_split").is_dir():
        return nested
    return root


def read_vehicle_models(root: str | Path) -> dict[int, int]:
    """``{vehicle_id: model_id}`` from ``attribute/model_attr.txt``."""
    attr_file = vehicleid_root(root) / "attribute" / "model_attr.txt"
    models: dict[int, int] = {}
    for number, (vid, mid) in read_table(attr_file, ("vehicle_id", "model_id")):
        vehicle = parse_int(vid, attr_file, number, "vehicle_id")
        model = parse_int(mid, attr_file, number, "model_id")
        if model < 0:
            raise DataError(f"{attr_file}:{number}: model id must be >= 0, got {model}")
        if models.setdefault(vehicle, model) != model:
            raise DataError(f"{attr_file}:{number}: vehicle {vehicle} has model {model} here but {models[vehicle]} earlier")
    return models


def read_vehicleid(
    root: str | Path, split: str = "train", with_models: bool = True, check_files: bool = True
) -> list[ImageRecord]:
    """The records of ``split`` ("train", "small", "medium" or "large"); see the module docstring."""
    root = vehicleid_root(root)
    list_file = root / "train_test_split" / split_list_name(split)
    models = read_vehicle_models(root) if with_models else {}
    records: list[ImageRecord] = []
    seen: set[str] = set()
    for number, (name, vid) in read_table(list_file, ("image_name", "vehicle_id")):
        vehicle = parse_int(vid, list_file, number, "vehicle_id")
        if name in seen:
            raise DataError(f"{list_file}:{number}: image {name} appears twice")
        seen.add(name)
        file_name = name if name.lower().endswith(".jpg") else f"{name}.jpg"
        path = checked_image(root / "image" / file_name, list_file, number, check_files)
        records.append(ImageRecord(path=path, label=vehicle, image_id=name, category=models.get(vehicle, NO_CATEGORY)))
    return records


class VehicleID(NativeLayoutDataset):
    """Torch data set over :func:`read_vehicleid` records (``(image, label)`` items)."""

    reader = staticmethod(read_vehicleid)

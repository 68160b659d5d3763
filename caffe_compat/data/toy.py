"""Small real data sets in the exact native layouts of CUB-200-2011, Stanford Online Products and
VehicleID, built offline in a second from scikit-learn's bundled handwritten digits.

Source: ``sklearn.datasets.load_digits()``: 1,797 real 8x8 greyscale scans (values 0..16) of the
digits 0-9 (scikit-learn is needed only here; it is imported lazily).

Classes.  Ten digits are too few for class-disjoint metric learning, so a class is a pair
``(digit, style)``: class index ``q`` (0-based) has ``digit = q % 10`` and ``style = q // 10``.  A
style is a fixed colour tint (8 BGR multipliers: white, red, green, blue, yellow, magenta, cyan,
orange) optionally rotated by 90 degrees (styles 8-15), so at most 160 classes.  Every image is a
real digit scan: ``gray * 255 / 16``, upscaled to ``size x size`` with ``cv2.resize(INTER_CUBIC)``,
rounded and clipped to uint8, rotated for styles >= 8, then channel ``c`` is ``round(gray * tint[c])``
(three BGR channels).
A digit's scans are permuted with ``RandomState(seed)`` and dealt round-robin to its styles, so no
scan appears in two classes; a class takes the first ``images_per_class`` scans of its share.

Splits are class-disjoint, as in the real protocols, and the class-index order is style-major, so
train and test classes are different styles of the same ten digits (a network can transfer).

=========  ==========================================================================================
kind       layout written under ``out_dir`` (which plays the data set's root directory)
=========  ==========================================================================================
cub        ``images/<NNN>.Digit<d>_<style>/Digit<d>_<style>_<scan>.jpg``, ``images.txt``,
           ``image_class_labels.txt``, ``classes.txt``, ``train_test_split.txt`` (classification
           split: every other image of a class; unused by the metric-learning split).  Default 20
           classes x 12 images; class ids 1..n, the first n//2 train (the reader's rule).
sop        ``digit<d>_final/<class_id:012d>_<k>.JPG``, ``Ebay_train.txt``, ``Ebay_test.txt``,
           ``Ebay_info.txt`` (header ``image_id class_id super_class_id path``).  Default 60 classes
           with 2-6 images each (drawn from the seed; SOP averages 5.3); super-class = digit + 1
           (10 super-classes, each in both splits); class ids 1..n, the first n//2 train.
vehicleid  ``image/<7-digit name>.jpg``, ``train_test_split/train_list.txt``,
           ``test_list_800.txt`` / ``test_list_1600.txt`` / ``test_list_2400.txt`` holding **8 / 16 /
           24 vehicles** (the real names, sizes scaled by 1/100; nested: small within medium within
           large), ``attribute/model_attr.txt``.  Default 64 vehicles x 8 images: vehicle ids
           0..n-1, the last 24 are the test vehicles, the others train.  Model id = digit,
           labelled only for vehicles of even style (about half of the training vehicles, as in
           the real data set); FastAP's VehicleID sampler needs both kinds.
=========  ==========================================================================================

The output is a pure function of ``(kind, seed, size, num_classes, images_per_class)``: byte-equal
files on every run (OpenCV's encoders are deterministic).

``out_dir`` must not exist or be an empty folder: a non-empty one is refused (DataError; the CLI exits
2), so trees of two kinds or seeds are never mixed.  The tree is written into a temporary sibling folder
(``.<name>.*.tmp``) that is renamed to ``out_dir`` once complete; on any error it is removed, so
``out_dir`` never holds a partial tree.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import cv2
import numpy as np

from caffe_compat.data.vehicleid import TEST_SIZES
from caffe_compat.errors import DataError, MemoryBudgetError
from caffe_compat.io.safe_open import memory_budget

KINDS = ("cub", "sop", "vehicleid")
TOY_TEST_SIZES = {"small": 8, "medium": 16, "large": 24}

_TINTS_BGR = (
    ("white", (1.0, 1.0, 1.0)),
    ("red", (0.25, 0.3, 1.0)),
    ("green", (0.3, 1.0, 0.3)),
    ("blue", (1.0, 0.45, 0.2)),
    ("yellow", (0.2, 1.0, 1.0)),
    ("magenta", (1.0, 0.3, 1.0)),
    ("cyan", (1.0, 1.0, 0.25)),
    ("orange", (0.1, 0.6, 1.0)),
)
MAX_CLASSES = 10 * 2 * len(_TINTS_BGR)
_DEFAULTS = {"cub": (20, 12), "sop": (60, None), "vehicleid": (64, 8)}


def style_name(style: int) -> str:
    """``"red"``, ``"red_rot90"``, ...: the tint, plus the rotation for styles >= 8."""
    name = _TINTS_BGR[style % len(_TINTS_BGR)][0]
    return name if style < len(_TINTS_BGR) else f"{name}_rot90"


def _load_digits() -> tuple[np.ndarray, np.ndarray]:
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise DataError(
            "make_toy_data needs scikit-learn for its bundled handwritten digits: pip install scikit-learn"
        ) from exc
    digits = load_digits()
    return np.asarray(digits.images, dtype=np.float64), np.asarray(digits.target, dtype=np.int64)


def _render(scan: np.ndarray, size: int, style: int) -> np.ndarray:
    gray = cv2.resize((scan * (255.0 / 16.0)).astype(np.float32), (size, size), interpolation=cv2.INTER_CUBIC)
    gray8 = np.clip(np.rint(gray), 0, 255).astype(np.uint8)
    if style >= len(_TINTS_BGR):
        gray8 = np.ascontiguousarray(np.rot90(gray8))
    tint = np.asarray(_TINTS_BGR[style % len(_TINTS_BGR)][1], dtype=np.float64)
    tables = np.rint(np.arange(256)[:, None] * tint).astype(np.uint8)  # 256 x 3 lookup
    return cv2.merge([cv2.LUT(gray8, np.ascontiguousarray(tables[:, c])) for c in range(3)])


def _class_members(num_classes: int, counts: np.ndarray, targets: np.ndarray, seed: int) -> list[np.ndarray]:
    """Scan indices of each class: each digit's scans permuted, dealt round-robin to its styles."""
    rng = np.random.RandomState(seed & 0xFFFFFFFF)
    styles = -(-num_classes // 10)
    members: list[np.ndarray] = [np.empty(0, np.int64)] * num_classes
    for digit in range(10):
        pool = rng.permutation(np.flatnonzero(targets == digit))
        for style in range(styles):
            q = style * 10 + digit
            if q >= num_classes:
                continue
            share = pool[style::styles]
            if counts[q] > share.size:
                raise DataError(
                    f"toy data: class {q} (digit {digit}) asks for {counts[q]} images, only {share.size} "
                    f"scans are left for it with {num_classes} classes"
                )
            members[q] = share[: counts[q]]
    return members


def _write(path: Path, image: np.ndarray) -> None:
    """Encode in memory and write the bytes ourselves: ``cv2.imwrite`` (the same encoder and defaults) kills the
    process with a segmentation fault on a path that is not UTF-8, as ``cv2.imread`` does
    (:func:`~caffe_compat.io.image_header.imread`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    ok, encoded = cv2.imencode(path.suffix, image)
    if not ok:
        raise DataError(f"{path}: OpenCV could not encode the image")
    path.write_bytes(encoded.tobytes())


def _write_lines(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


#: The largest image side: libjpeg's limit (JPEG_MAX_DIMENSION), as the toy sets are JPEG files.
MAX_SIDE = 65500
#: What rendering one image holds at its peak, per pixel: the float32 resize and its two rounding temporaries
#: (12 bytes), the uint8 plane, then three tinted planes, the merged BGR image and the JPEG being encoded.
RENDER_BYTES_PER_PIXEL = 16


def make_toy_data(
    kind: str,
    out_dir: str | Path,
    seed: int = 0,
    size: int = 64,
    num_classes: int | None = None,
    images_per_class: int | None = None,
) -> Path:
    """Write a toy ``kind`` ("cub", "sop", "vehicleid") data set under ``out_dir``; return its root.

    ``size`` is the side of the square images in pixels; ``num_classes`` / ``images_per_class``
    override the per-kind defaults of the module docstring.
    """
    if kind not in KINDS:
        raise DataError(f"toy data kind must be one of {KINDS}, got {kind!r}")
    if not 8 <= size <= MAX_SIDE:
        raise DataError(f"toy data image size must be 8..{MAX_SIDE} pixels (JPEG's largest side), got {size}")
    need, budget = RENDER_BYTES_PER_PIXEL * size * size, memory_budget()
    if need > budget:  # one image at a time, before OpenCV is asked to resize to it
        raise MemoryBudgetError(f"toy data: an image of {size} x {size} pixels needs {need} bytes, more than the "
                                f"memory budget of {budget} bytes (CAFFE_COMPAT_MEMORY_BUDGET)")
    default_classes, default_count = _DEFAULTS[kind]
    num_classes = default_classes if num_classes is None else int(num_classes)
    minimum = TOY_TEST_SIZES["large"] + 2 if kind == "vehicleid" else 2
    if not minimum <= num_classes <= MAX_CLASSES:
        raise DataError(f"toy {kind} data needs {minimum}..{MAX_CLASSES} classes, got {num_classes}")
    rng = np.random.RandomState([seed & 0xFFFFFFFF, 1])
    if images_per_class is not None:
        counts = np.full(num_classes, int(images_per_class), np.int64)
    elif default_count is not None:
        counts = np.full(num_classes, default_count, np.int64)
    else:
        counts = rng.randint(2, 7, size=num_classes).astype(np.int64)
    if counts.min() < 1:
        raise DataError(f"images_per_class must be >= 1, got {images_per_class}")
    root = Path(out_dir)
    _check_target(root)
    scans, targets = _load_digits()
    members = _class_members(num_classes, counts, targets, seed)
    writer = {"cub": _write_cub, "sop": _write_sop, "vehicleid": _write_vehicleid}[kind]
    with _fresh_directory(root) as tmp:
        writer(tmp, members, scans, size)
    return root


def _check_target(root: Path) -> None:
    """The target must not exist, or be an empty folder (a tree is never mixed into existing files)."""
    if root.is_symlink() or (root.exists() and not root.is_dir()):
        raise DataError(f"{root}: exists and is not a directory")
    if root.is_dir() and any(root.iterdir()):
        raise DataError(f"{root}: the folder exists and is not empty; make-toy-data writes a fresh tree only "
                        f"(remove it or choose another folder)")


@contextmanager
def _fresh_directory(root: Path):
    """Yield a temporary sibling folder of ``root``; on success it is renamed to ``root`` (which must still
    be absent or empty), else removed: ``root`` never holds a partial tree."""
    from caffe_compat.errors import WriteError
    from caffe_compat.io.atomic import current_umask

    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.", suffix=".tmp", dir=root.parent))
    except OSError as exc:
        raise WriteError(f"{root}: cannot write ({exc.strerror or exc})") from None
    try:
        yield tmp
        _check_target(root)  # nobody filled it meanwhile
        os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp's 0o700 -> what a plain mkdir gives
        try:
            os.replace(tmp, root)  # POSIX rename(2) replaces an empty folder
        except OSError as exc:
            raise WriteError(f"{root}: cannot write (renaming {tmp.name} into place: {exc.strerror or exc})") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_cub(root: Path, members: list[np.ndarray], scans: np.ndarray, size: int) -> None:
    classes, images, labels, split = [], [], [], []
    image_id = 0
    for q, scan_ids in enumerate(members):
        digit, style = q % 10, q // 10
        name = f"Digit{digit}_{style_name(style)}"
        folder = f"{q + 1:03d}.{name}"
        classes.append(f"{q + 1} {folder}")
        for k, scan in enumerate(scan_ids):
            image_id += 1
            relative = f"{folder}/{name}_{scan:04d}.jpg"
            _write(root / "images" / relative, _render(scans[scan], size, style))
            images.append(f"{image_id} {relative}")
            labels.append(f"{image_id} {q + 1}")
            split.append(f"{image_id} {1 - k % 2}")
    _write_lines(root / "classes.txt", classes)
    _write_lines(root / "images.txt", images)
    _write_lines(root / "image_class_labels.txt", labels)
    _write_lines(root / "train_test_split.txt", split)


def _write_sop(root: Path, members: list[np.ndarray], scans: np.ndarray, size: int) -> None:
    header = "image_id class_id super_class_id path"
    train, test = [header], [header]
    image_id = 0
    n_train = len(members) // 2
    for q, scan_ids in enumerate(members):
        digit, style = q % 10, q // 10
        for k, scan in enumerate(scan_ids):
            image_id += 1
            relative = f"digit{digit}_final/{q + 1:012d}_{k}.JPG"
            _write(root / relative, _render(scans[scan], size, style))
            (train if q < n_train else test).append(f"{image_id} {q + 1} {digit + 1} {relative}")
    _write_lines(root / "Ebay_train.txt", train)
    _write_lines(root / "Ebay_test.txt", test)
    _write_lines(root / "Ebay_info.txt", train + test[1:])


def _write_vehicleid(root: Path, members: list[np.ndarray], scans: np.ndarray, size: int) -> None:
    n_test = TOY_TEST_SIZES["large"]
    first_test = len(members) - n_test
    train, test, models = [], [], []
    number = 0
    for q, scan_ids in enumerate(members):
        digit, style = q % 10, q // 10
        if style % 2 == 0:
            models.append(f"{q} {digit}")
        for scan in scan_ids:
            number += 1
            name = f"{number:07d}"
            _write(root / "image" / f"{name}.jpg", _render(scans[scan], size, style))
            (train if q < first_test else test).append((q, f"{name} {q}"))
    _write_lines(root / "train_test_split" / "train_list.txt", [line for _, line in train])
    for split, vehicles in TOY_TEST_SIZES.items():
        real = TEST_SIZES[split]
        chosen = [line for q, line in test if q < first_test + vehicles]
        _write_lines(root / "train_test_split" / f"test_list_{real}.txt", chosen)
    _write_lines(root / "attribute" / "model_attr.txt", models)

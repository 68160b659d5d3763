"""Caffe's ``convert_imageset`` and ``compute_image_mean`` tools.

``convert_imageset(list_file, root, out)`` reads lines ``relative/path label``, and writes one Datum per
line into a new LMDB under the key ``%08d_<path>`` (Caffe's key), in list order (``shuffle`` permutes the
lines with a seeded RNG first):

* raw (default): the image decoded by OpenCV (BGR, optionally resized with ``cv2.resize`` bilinear, or
  grey), stored as C×H×W bytes;
* ``encoded``: the file's own bytes when no resize/re-encoding is asked for (Caffe's ReadFileToDatum),
  else the decoded, resized image re-encoded with OpenCV in ``encode_type`` (default: the file's own
  extension).

``compute_image_mean(db)`` sums every Datum's pixels in float32, record by record, then divides by the
count in float32, exactly as Caffe's tool, and returns a 1×C×H×W array (written with legacy 4-D dims).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from caffe_compat.errors import DataError


def read_list_file(list_file: str | os.PathLike) -> list[tuple[str, int]]:
    """Caffe's list format: ``path label`` per line; the label is the last space-separated field."""
    entries = []
    path = Path(list_file)
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise DataError(f"{path}: no such list file") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        name, _, label = line.rstrip().rpartition(" ")
        if not name:
            raise DataError(f"{path}:{number}: expected 'relative/path label', got {line!r}")
        try:
            entries.append((name, int(label)))
        except ValueError:
            raise DataError(f"{path}:{number}: label {label!r} is not an integer") from None
    return entries


def _datum_for(image_path: Path, label: int, resize, gray: bool, encoded: bool, encode_type: str):
    import cv2

    from caffe_compat.data.image import load_image_bgr
    from caffe_compat.io import make_datum

    suffix = image_path.suffix.lower().lstrip(".")
    if encoded and not resize and (not encode_type or encode_type.lower() == suffix) and not gray:
        try:
            return make_datum(image_path.read_bytes(), label, encoded=True)
        except FileNotFoundError:
            raise DataError(f"{image_path}: could not open or find the image (file not found)") from None
    h, w = resize or (0, 0)
    image = load_image_bgr(image_path, color=not gray, new_height=h, new_width=w)
    if encoded:
        ok, buf = cv2.imencode("." + (encode_type or suffix or "png"), image)
        if not ok:
            raise DataError(f"{image_path}: OpenCV could not encode it as {encode_type or suffix}")
        return make_datum(buf.tobytes(), label, encoded=True)
    return make_datum(np.ascontiguousarray(image.transpose(2, 0, 1)), label)


def convert_imageset(list_file, root, out, resize=None, gray: bool = False, encoded: bool = False,
                     encode_type: str = "", shuffle: bool = False, seed: int = 0, progress: bool = True) -> int:
    """Write an LMDB of Datums from a list file (see the module docstring); returns the record count."""
    from caffe_compat.io import write_lmdb

    entries = read_list_file(list_file)
    if shuffle:
        order = np.random.RandomState(seed).permutation(len(entries))
        entries = [entries[i] for i in order]
    root = Path(root)

    def records():
        iterator = enumerate(entries)
        if progress:
            from tqdm import tqdm

            iterator = tqdm(iterator, total=len(entries), desc="convert_imageset", unit="img")
        for line_id, (name, label) in iterator:
            yield f"{line_id:08d}_{name}", _datum_for(root / name, label, resize, gray, encoded, encode_type)

    return write_lmdb(out, records())


def compute_image_mean(db) -> np.ndarray:
    """Per-pixel mean of an LMDB of Datums, as Caffe's compute_image_mean computes it (1×C×H×W)."""
    from caffe_compat.io import iter_lmdb

    total, count, shape = None, 0, None
    for key, image, _ in iter_lmdb(db):
        if total is None:
            shape = image.shape
            total = np.zeros(shape, dtype=np.float32)
        elif image.shape != shape:
            raise DataError(f"{db}[{key}]: image shape {image.shape} differs from the first record's {shape}; "
                            f"compute_image_mean needs equal sizes (use convert_imageset --resize)")
        total += image.astype(np.float32)
        count += 1
    if not count:
        raise DataError(f"{db}: the database is empty")
    return (total / np.float32(count))[None].astype(np.float32)

"""Caffe's ``convert_imageset`` and ``compute_image_mean`` tools.

``convert_imageset(list_file, root, out)`` reads lines ``relative/path label`` and writes one Datum per
readable image into a new LMDB (built in a temporary folder, renamed into place when complete), in list
order (``shuffle`` permutes the lines with a seeded RNG first), as Caffe's ``tools/convert_imageset.cpp``
with ``ReadImageToDatum`` does:

* every image is decoded first (``ReadImageToCVMat``: OpenCV, BGR or grey, ``cv::resize`` bilinear when
  both resize sides are set), in every mode, ``encoded`` included;
* **an image that is missing or cannot be decoded is skipped** (Caffe logs "Could not open or find file"
  and goes on): here a warning ``list:line: skipped <path>: <reason>`` goes to ``on_skip`` (default:
  :func:`warnings.warn`); the key numbers keep their gaps, like Caffe's.  ``strict=True`` makes it a
  :class:`DataError` naming ``list:line`` instead.  If no image at all is readable, nothing is written
  (DataError; Caffe would leave an empty database);
* the arguments are ``list_file, root`` (Caffe's order is root first): a folder given as the list and a
  file as the root are reported as swapped (DataError), before anything is read;
* key ``%08d_<path>``: the number is the line's 0-based index in the list file (Caffe's ``line_id``;
  a blank line, which Caffe reads as an empty path and skips, keeps its number), or the position in the
  shuffled order with ``shuffle``;
* raw (default): the decoded image stored as C×H×W bytes;
* encoded: the file's own bytes when no resize is asked and ``encode_type`` matches the file's extension
  -- Caffe's ``ReadFileToDatum``; otherwise the decoded (resized) image re-encoded with
  ``cv::imencode("." + encode_type)``.  Caffe's ``matchExt`` compares the extension *with its dot*
  (case-insensitive): with no ``encode_type`` convert_imageset guesses the dotted extension (``.jpg``),
  which matches, so the file's bytes are kept; an ``encode_type`` spelt as usual, ``jpg``, never matches,
  so every image is decoded and re-encoded (a JPEG at OpenCV's default quality 95, whatever its own
  extension); ``.jpg`` matches ``.jpg`` files only (not ``.jpeg``).  Caffe quirks kept: ``encode_type`` alone
  implies ``encoded`` (Caffe passes it to ``ReadImageToDatum`` whatever ``--encoded`` says), and
  ``gray`` does not change stored file bytes (the condition ``(channels == 3) == is_color`` always holds
  after a grey decode), so a colour JPEG stored with ``gray`` + ``encoded`` and no resize stays colour:
  decode it with ``force_gray``.  An encoder OpenCV lacks (``encode_type: xyz``) is a DataError before
  anything is read (Caffe crashes with a cv::Exception).

OpenCV's own log lines ("imread_(...): can't open/read file", PNG chunk errors) are silenced while the
images are read, and what the JPEG/PNG libraries print on stderr themselves (e.g. "Premature end of JPEG
file") is captured and reported through ``on_skip`` with the ``list:line`` it belongs to (an image that
still decodes is kept, as Caffe keeps it).

``compute_image_mean(db)`` sums every Datum's pixels in float32, record by record, then divides by the
count in float32, exactly as Caffe's tool, and returns a 1×C×H×W array (written with legacy 4-D dims).
Encoded records are decoded natively (``DecodeDatumNative``, ``IMREAD_UNCHANGED``) by the shared
decoder of :mod:`caffe_compat.io.datum_lmdb`.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import numpy as np

from caffe_compat.errors import DataError, NotRegularFileError
from caffe_compat.io.planes import chw_planes
from caffe_compat.io.safe_open import memory_budget, read_list_text, read_regular_bytes


def caffe_atoi(text: str) -> int:
    """C's ``atoi``: leading white space (``isspace``) skipped, an optional sign, then the decimal digits up
    to the first other character; no digit gives 0 (``"1.5"`` is 1, ``"3abc"`` 3, ``"x"`` and ``""`` 0)."""
    match = re.match(r"[ \t\n\v\f\r]*([+-]?[0-9]+)", text)
    return int(match.group(1)) if match else 0


def read_list_entries(list_file: str | os.PathLike, what: str | None = None) -> list[tuple[int, str, int]]:
    """``(line number, path, label)`` of every line of a Caffe list file (numbers from 1), parsed as Caffe's
    ImageDataLayer and convert_imageset parse them (``std::getline``, ``find_last_of(' ')``, ``atoi``):
    the path is the text before the **last space** and the label ``atoi`` of the text after it, so
    ``a.jpg 1.5`` has label 1 and ``a.jpg 3abc`` label 3; a line without a space is all path, with label
    ``atoi`` of the whole line (``a.jpg``: label 0); a trailing space leaves the label text empty (label 0)
    and the path ``a.jpg 3``; a blank line is an entry with the empty path (Caffe cannot load it).  Line ends
    are ``\n`` (``\r\n`` too: the CR is dropped).  A list that is not a regular file raises
    NotRegularFileError naming ``what`` named it."""
    from caffe_compat.io.datum_lmdb import fits_datum_label

    entries = []
    path = Path(list_file)
    try:
        text = read_list_text(path, what)
    except FileNotFoundError:
        raise DataError(f"{path}: no such list file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: cannot read the list file ({exc})") from None
    lines = text.split("\n")
    if lines and lines[-1] == "":  # std::getline gives no line after the final newline
        lines.pop()
    for number, line in enumerate(lines, start=1):
        space = line.rfind(" ")
        name, label = (line[:space], line[space + 1:]) if space >= 0 else (line, line)
        if "\0" in name:
            raise DataError(f"{path}:{number}: the path {name!r} holds a NUL byte")
        value = caffe_atoi(label)
        if not fits_datum_label(value):  # atoi past int's range is undefined in C (Datum.label is an int32)
            raise DataError(f"{path}:{number}: label {label.strip()} is outside Caffe's 32-bit int range")
        entries.append((number, name, value))
    return entries


def read_list_file(list_file: str | os.PathLike, what: str | None = None) -> list[tuple[str, int]]:
    """Caffe's list format: ``path label`` per line; the label is the last space-separated field."""
    return [(name, label) for _, name, label in read_list_entries(list_file, what)]


def match_ext(filename: str, encoding: str) -> bool:
    """Caffe's ``matchExt``: the file's extension *with its dot* (``.jpg``) equals ``encoding``
    (case-insensitive); a name without a dot is its own extension.  So the extension convert_imageset
    guesses (``.jpg``, dot included) matches, and an ``--encode_type`` spelt without the dot (``jpg``)
    never does; Caffe's clause ``jpg`` matching ``jpeg`` compares the dotted extension and is dead too."""
    dot = filename.rfind(".")
    ext = (filename[dot:] if dot >= 0 else filename).lower()
    encoding = encoding.lower()
    return ext == encoding or (encoding == "jpg" and ext == "jpeg")


_STDERR_LOCK = threading.Lock()


@contextmanager
def _quiet_opencv():
    """Silence OpenCV's logger and capture what the codec libraries write to stderr (fd 2) themselves.

    Yields a function returning (and clearing) the captured text."""
    import cv2

    # cv2.utils.logging where the bindings have it; OpenCV 4.11's wheels export only cv2.getLogLevel/setLogLevel
    log = getattr(getattr(cv2, "utils", None), "logging", None)
    get_level = getattr(log, "getLogLevel", None) or getattr(cv2, "getLogLevel", None)
    set_level = getattr(log, "setLogLevel", None) or getattr(cv2, "setLogLevel", None)
    old_level = get_level() if get_level is not None and set_level is not None else None
    if old_level is not None:
        set_level(getattr(log, "LOG_LEVEL_SILENT", 0))  # 0: cv::utils::logging::LOG_LEVEL_SILENT
    with _STDERR_LOCK, tempfile.TemporaryFile() as sink:
        try:
            saved = os.dup(2)
        except OSError:  # no fd 2 (detached process): nothing to capture
            saved = None

        def captured() -> str:
            if saved is None:
                return ""
            sink.flush()
            sink.seek(0)
            text = sink.read().decode("utf-8", "replace").strip()
            sink.seek(0)
            sink.truncate()
            return text

        @contextmanager
        def capturing():
            if saved is None:
                yield
                return
            sys.stderr.flush()
            os.dup2(sink.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(saved, 2)

        try:
            yield capturing, captured
        finally:
            if saved is not None:
                os.close(saved)
            if old_level is not None:
                set_level(old_level)


class _Skip(Exception):
    """An image Caffe's convert_imageset would skip (missing or undecodable)."""


def _datum_for(image_path: Path, name: str, label: int, resize, gray: bool, encode_type: str | None, capturing,
               captured, where: str, report: Callable[[str], None]):
    """The Datum of one list line, as ``ReadImageToDatum`` builds it (see the module docstring).

    ``encode_type`` None: raw; "" : encoded with the file's extension."""
    import cv2

    from caffe_compat.io import make_datum

    try:
        raw = read_regular_bytes(image_path, where, memory_budget())
    except FileNotFoundError:
        raise _Skip("file not found") from None
    except OSError as exc:
        raise _Skip(exc.strerror or str(exc)) from None
    except NotRegularFileError:
        # a directory (the root itself for a blank list line: Caffe reads it as the empty path): cv::imread fails
        # on it and convert_imageset skips the line.  A FIFO or a device (which cv::imread would block on or read
        # without end) and a file larger than the format allows stay refused, never opened
        if image_path.is_dir():
            raise _Skip("a directory, not an image file") from None
        raise
    flag = cv2.IMREAD_GRAYSCALE if gray else cv2.IMREAD_COLOR
    from caffe_compat.io.image_header import check_decode_budget

    check_decode_budget(raw, f"{where}: {image_path}", flag)  # refused, not skipped: the user asked for it
    with capturing():
        try:
            image = cv2.imdecode(np.frombuffer(raw, dtype=np.uint8), flag) if raw else None
        except cv2.error:
            image = None
    noise = captured()
    if image is None:
        raise _Skip("OpenCV could not decode it" + (f" ({noise})" if noise else ""))
    if noise:
        report(f"{where}: {image_path}: {noise} (decoded anyway; kept, as Caffe keeps it)")
    h, w = resize or (0, 0)
    if h > 0 and w > 0:
        from caffe_compat.data.image import resize_within_budget

        image = resize_within_budget(image, h, w, f"{where}: {image_path}")
    if image.ndim == 2:
        image = image[:, :, None]
    if encode_type is None:
        return make_datum(chw_planes(image), label)
    # convert_imageset's guess keeps the dot (fn.substr(p)): '.jpg'; cv::imencode("." + '.jpg') reads '.jpg'
    encoding = encode_type or (name[name.rfind("."):] if "." in name else name).lower()
    if not (h or w) and match_ext(name, encoding):
        return make_datum(raw, label, encoded=True)  # ReadFileToDatum: the file's own bytes
    try:
        ok, buf = cv2.imencode("." + encoding, image)
    except cv2.error:
        ok = False
    if not ok:
        raise DataError(f"{where}: OpenCV cannot encode {image_path} as '.{encoding.lstrip('.')}' (no such encoder); "
                        f"set --encode-type to jpg or png")
    return make_datum(buf.tobytes(), label, encoded=True)


def convert_imageset(list_file, root, out, resize=None, gray: bool = False, encoded: bool = False,
                     encode_type: str = "", shuffle: bool = False, seed: int = 0, progress: bool = True,
                     strict: bool = False, on_skip: Callable[[str], None] | None = None,
                     skipped: list | None = None, check_size: bool = False) -> int:
    """Write an LMDB of Datums from a list file (see the module docstring); returns the record count.

    ``check_size`` (Caffe's ``--check_size``): every raw record must hold as many bytes as the first
    (C×H×W); one that does not is a DataError naming ``list:line`` and nothing is written (Caffe aborts on a
    CHECK).  With encoded records it is refused before anything is read: Caffe compares each file's bytes
    with the first record's C×H×W, which an encoded Datum leaves at 0, so it aborts at the second image.

    ``on_skip(message)`` receives each skip (and codec) warning, default :func:`warnings.warn`;
    ``skipped``, when given, is extended with the ``list:line`` of every skipped image."""
    import cv2

    from caffe_compat.io import write_lmdb

    report = on_skip or (lambda message: warnings.warn(message, UserWarning, stacklevel=4))
    encode_type = (encode_type or "").strip().lower()  # a leading dot kept: it decides Caffe's matchExt
    if encode_type and not cv2.haveImageWriter("." + encode_type):
        raise DataError(f"encode type '{encode_type}': OpenCV has no encoder for '.{encode_type.lstrip('.')}' "
                        f"(use jpg, png, bmp, ...)")
    if resize is not None and (len(resize) != 2 or min(resize) < 0):
        raise DataError(f"resize must be two sizes H W >= 0, got {resize}")
    target = Path(out)
    if target.exists():
        raise DataError(f"{target}: already exists (Caffe's convert_imageset refuses too); remove it first")
    root = Path(root)
    if Path(list_file).is_dir() and root.is_file():  # Caffe's order: convert_imageset ROOTFOLDER/ LISTFILE DB
        raise DataError(f"{list_file} and {root} look swapped: {list_file} is a folder and {root} a file; give the "
                        f"list file first, then the image root folder (Caffe's convert_imageset takes the root "
                        f"first)")
    if not root.is_dir():
        raise DataError(f"{root}: the image root folder does not exist")
    entries = read_list_entries(list_file)
    keyed = [(number - 1, number, name, label) for number, name, label in entries]
    if shuffle:
        order = np.random.RandomState(seed).permutation(len(keyed))
        keyed = [(k, keyed[i][1], keyed[i][2], keyed[i][3]) for k, i in enumerate(order)]
    mode = encode_type if (encoded or encode_type) else None
    if check_size and (encoded or encode_type):
        raise DataError("check_size applies to raw records: with encoded ones Caffe's convert_imageset compares "
                        "the first image's C x H x W (0 for an encoded Datum) with every file's size and aborts at "
                        "the second image; leave out one of the two")
    skips: list[str] = []
    sizes: list[int] = []  # the first raw record's byte count (check_size)

    def records():
        with _quiet_opencv() as (capturing, captured):
            iterator = keyed
            if progress:
                from tqdm import tqdm

                iterator = tqdm(keyed, total=len(keyed), desc="convert_imageset", unit="img")
            count = 0
            for key_id, number, name, label in iterator:
                where = f"{list_file}:{number}"
                try:
                    datum = _datum_for(root / name, name, label, resize, gray, mode, capturing, captured, where,
                                       report)
                except _Skip as exc:
                    if strict:
                        raise DataError(f"{where}: could not read image {root / name} ({exc})") from None
                    skips.append(where)
                    report(f"{where}: skipped {root / name}: {exc} (Caffe's convert_imageset skips it too)")
                    continue
                if check_size and not sizes:
                    sizes.append(len(datum.data))
                elif check_size:
                    _check_size(datum, sizes[0], where, root / name)
                count += 1
                yield f"{key_id:08d}_{name}", datum
            if not count:
                raise DataError(f"{list_file}: none of its {len(keyed)} images could be read; nothing written")

    try:
        return write_lmdb(target, records())
    finally:
        if skipped is not None:
            skipped.extend(skips)


def _check_size(datum, size: int, where: str, path: Path) -> None:
    if len(datum.data) != size:
        raise DataError(f"{where}: {path} is {datum.channels} x {datum.height} x {datum.width} = {len(datum.data)} "
                        f"bytes, the first image {size} (check_size; Caffe stops with 'Incorrect data field size'); "
                        f"nothing written")


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

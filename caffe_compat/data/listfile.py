"""The whitespace-separated list files every data set here is described by.

:func:`read_table` is the one place that reads them.  Lines are split on whitespace into a fixed
number of fields (the last field keeps any remaining text, so a path may hold spaces); blank lines
are skipped, and so is a UTF-8 byte-order mark at the start (a list saved by Windows Notepad).  Every
problem raises :class:`~caffe_compat.errors.DataError` naming ``file:line`` and the offending text,
e.g. ``.../images.txt:7: expected 2 fields (image_id path), got 1: '7'``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from caffe_compat.errors import DataError
from caffe_compat.io.safe_open import read_list_text, require_regular_file


def read_table(path: Path, fields: Sequence[str], header: bool = False) -> list[tuple[int, list[str]]]:
    """Rows of a whitespace-separated list file as ``(line_number, [field, ...])``.

    ``fields`` names the columns (used in messages).  With ``header=True`` the first non-blank line
    must spell exactly those names (Stanford Online Products' ``image_id class_id super_class_id
    path``) and is not returned.
    """
    path, what = Path(path), " ".join(fields)
    require_regular_file(path, what, error=DataError, missing=f"{path}: file not found ({what})")
    try:
        text = read_list_text(path, encoding="utf-8-sig")  # a leading BOM is no part of the first field
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc})") from None
    rows: list[tuple[int, list[str]]] = []
    need_header = header
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.split(None, len(fields) - 1)
        if need_header:
            if line.split() != list(fields):  # not ``parts``: its last field keeps trailing blanks
                raise DataError(
                    f"{path}:{number}: expected the header line {' '.join(fields)!r}, got {line.strip()!r}"
                )
            need_header = False
            continue
        if len(parts) != len(fields):
            raise DataError(
                f"{path}:{number}: expected {len(fields)} fields ({' '.join(fields)}), "
                f"got {len(parts)}: {line.strip()!r}"
            )
        rows.append((number, parts))
    if need_header:
        raise DataError(f"{path}: empty file, expected the header line {' '.join(fields)!r}")
    return rows


def parse_int(value: str, path: Path, number: int, field: str) -> int:
    """``int(value)``, or a :class:`DataError` naming ``path:number`` and the field."""
    try:
        return int(value)
    except ValueError:
        raise DataError(f"{path}:{number}: field {field} must be an integer, got {value!r}") from None


def checked_image(image: Path, list_file: Path, number: int, check: bool) -> Path:
    """``image``; with ``check`` a :class:`DataError` naming ``list_file:number`` if it does not exist."""
    if check:
        require_regular_file(image, f"{list_file}:{number}", error=DataError,
                             missing=f"{list_file}:{number}: image file not found: {image}")
    return image

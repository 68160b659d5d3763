"""Is an argument a file name or prototxt text?  One answer for every reader of Caffe's files.

Readers (``read_net``, ``read_solver``, ``Solver``, the export) accept a path (``str`` or
``os.PathLike``), prototxt text passed directly, bytes or a parsed message.  :func:`is_path` decides:

* an ``os.PathLike`` is a path; anything other than a ``str`` (bytes, a message) is not;
* a string with a newline is text (no file name of this project's has one);
* a string naming an existing file (or folder) is a path;
* else a string with ``{`` is text (``layer { ... }`` on one line);
* a string ending in a Caffe file suffix (``.prototxt``, ``.caffemodel``, ...) is a path, missing or
  not, so that its reader says "no such file" rather than failing to parse the name;
* else a string shorter than 4096 characters that does not start like a net (``name:``, ``layer``,
  ``input``) is a path (a missing file named so), anything else text.

:func:`is_existing_file` is :func:`is_path` for a file that exists (a regular file or a link to one).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["BINARY_SUFFIXES", "FILE_SUFFIXES", "is_existing_file", "is_path"]

#: Suffixes of Caffe's binary files (caffemodel, binaryproto, solverstate, ...).
BINARY_SUFFIXES = frozenset({".caffemodel", ".binaryproto", ".solverstate", ".pb", ".bin"})
#: A string ending so names a file (missing or not), never prototxt text such as ``layer {...}``.
FILE_SUFFIXES = BINARY_SUFFIXES | {".prototxt", ".pbtxt", ".txt"}

_NET_TEXT_STARTS = ("name:", "layer", "input")
_MAX_NAME_LENGTH = 4096


def is_path(value) -> bool:
    """Whether ``value`` names a file rather than holding prototxt text (see the module docstring)."""
    if isinstance(value, os.PathLike):
        return True
    if not isinstance(value, str) or "\n" in value:
        return False
    if os.path.exists(value):  # False (no error) for names too long or with a NUL
        return True
    if "{" in value:
        return False
    stripped = value.strip()
    if Path(stripped).suffix.lower() in FILE_SUFFIXES:
        return True
    return len(value) < _MAX_NAME_LENGTH and not stripped.startswith(_NET_TEXT_STARTS)


def is_existing_file(value) -> bool:
    """Whether ``value`` is a path (:func:`is_path`) of an existing file."""
    return is_path(value) and os.path.isfile(value)

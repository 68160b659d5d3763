"""Shared output helpers for commands: JSON + human tables, progress bars."""

from __future__ import annotations

import json
import sys


def tolerate_narrow_encodings(*streams) -> None:
    """Let the console streams print what their encoding cannot hold as ``\\uXXXX`` escapes.

    The reports print ``±``, ``≤``, ``Δ`` and ``→``.  Where ``sys.stdout`` is a pipe or a file on Windows its
    encoding is the ANSI code page (cp1252 has no ``≤``), and ``PYTHONIOENCODING=ascii`` has none of them;
    with Python's default ``errors="strict"`` the first such character raised ``UnicodeEncodeError`` after
    the work was done.  A stream already given an error handler, or not a text wrapper, is left as it is.
    """
    for stream in streams or (sys.stdout, sys.stderr):
        if getattr(stream, "errors", None) == "strict" and hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")


def print_table(rows: list[list], headers: list[str], file=None) -> None:
    """A plain aligned text table."""
    file = sys.stdout if file is None else file
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    print(line, file=file)
    print("  ".join("-" * w for w in widths), file=file)
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)), file=file)


def markdown_table(rows: list[list], headers: list[str]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def require_output_folders(*paths) -> None:
    """Refuse (WriteError, exit 2) an output path whose folder does not exist, before the command does any
    work, so that a typo never creates folders; ``None`` (not asked) and ``-`` (a standard stream) pass."""
    from caffe_compat.io.atomic import require_folder

    for path in paths:
        if path is not None and str(path) != "-":
            require_folder(path)


def dump_json(obj, path=None) -> None:
    text = json.dumps(obj, indent=2, sort_keys=False)
    if path in (None, "-"):
        print(text)
    else:
        from caffe_compat.io.atomic import write_text_atomic

        write_text_atomic(path, text + "\n")

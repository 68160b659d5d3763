"""A Caffe ``Python`` layer's ``param_str`` as a dict, read as the layers read it (``yaml.load``).

The layers this project knows (madkn/HistogramLoss's ``LabelShufflingLayer`` and
``DistributionLossLayer``, which the FAPPY authors' prototxts use) take flat mappings: one
``key: value`` per line (the prototxt's ``\\n``); blank lines and ``#`` comment lines are skipped.  A
value is a number (``1.`` and ``1e-3`` included), a ``[a, b]`` list, a quoted string, one of YAML's
words (``true``/``false``, ``yes``/``no``, ``on``/``off``, ``null``/``~``, ``.inf``), else the bare
string.  A line without ``:`` (or with nothing before it) is a FormatError.

One parser for the layer ports (:mod:`caffe_compat.layers.python_ports`), the export (which reads a
data layer's ``mean_file`` without building it) and the model builders (:mod:`caffe_compat.zoo`).
"""

from __future__ import annotations

import ast
import math

from caffe_compat.errors import FormatError

__all__ = ["parse_param_str"]

_YAML_WORDS = {"true": True, "false": False, "yes": True, "no": False, "on": True, "off": False,
               "null": None, "~": None, ".inf": math.inf}


def _scalar(text: str):
    word = text.strip()
    if word.lower() in _YAML_WORDS:
        return _YAML_WORDS[word.lower()]
    try:
        return ast.literal_eval(word)  # numbers ("1.", "1e-3"), lists, quoted strings
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):  # e.g. a bare word, {[1]: 2}
        return word


def parse_param_str(text: str, layer: str | None = None) -> dict:
    """The flat YAML mapping of a Python layer's ``param_str`` (see the module docstring); errors name
    ``layer`` when given."""
    out = {}
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, colon, value = line.partition(":")
        if not colon or not key.strip():
            where = f"layer '{layer}': " if layer is not None else ""
            raise FormatError(f"{where}param_str line {line.strip()!r} is not 'key: value'")
        out[key.strip()] = _scalar(value)
    return out

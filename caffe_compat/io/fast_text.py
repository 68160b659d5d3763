"""A fast path for parsing prototxt, falling back to protobuf's own text parser.

protobuf's Python text parser is pure Python and tokenises character class by character class; a
ResNet-50 deploy file (60 KB) takes ~50 ms, longer than OpenCV needs to load the whole model.  Caffe
files use a small subset of the text format (identifiers, numbers, quoted strings without escapes,
``{}`` nesting, ``#`` comments), which one regular expression tokenises.  :func:`merge_fast` handles
exactly that subset and returns ``False`` on anything else (escapes, ``[a, b]`` lists, ``<>``
delimiters, bytes fields, unknown names, any malformed input), in which case the caller runs
``google.protobuf.text_format`` on a fresh message, so error messages and rare syntax are protobuf's.
Tests check that both parsers build equal messages on every reference file.
"""

from __future__ import annotations

import re

from google.protobuf.descriptor import FieldDescriptor as _F

# One token per match: whitespace or a comment (skipped), punctuation, a quoted string, a word, or
# (last group) any other character, which sends the file to the full parser.  The alternatives are
# tried at every position in turn, so ``findall`` covers the whole text without backtracking.
_TOKEN = re.compile(r"""
    (\s+|\#[^\n]*)
  | ([{}:])
  | ("[^"\\\n]*"|'[^'\\\n]*')
  | ([-+]?[A-Za-z0-9_.][\w.+-]*)
  | (.)
""", re.X)

_INTS = {_F.CPPTYPE_INT32, _F.CPPTYPE_INT64, _F.CPPTYPE_UINT32, _F.CPPTYPE_UINT64}
_FLOATS = {_F.CPPTYPE_FLOAT, _F.CPPTYPE_DOUBLE}
_BOOLS = {"true": True, "t": True, "True": True, "1": True, "false": False, "f": False, "False": False, "0": False}
_SPECIAL_FLOATS = {"inf": float("inf"), "-inf": float("-inf"), "+inf": float("inf"), "infinity": float("inf"),
                   "-infinity": float("-inf"), "nan": float("nan"), "-nan": float("nan")}


class _Fallback(Exception):
    pass


def _is_repeated(field) -> bool:
    # protobuf >= 5.28 has `is_repeated`; protobuf 7 dropped `label`.
    flag = getattr(field, "is_repeated", None)
    return bool(flag) if flag is not None else field.label == _F.LABEL_REPEATED


def _tokens(text: str) -> list[tuple[str, str]]:
    out = []
    append = out.append
    for skip, punct, string, word, other in _TOKEN.findall(text):
        if skip:
            continue
        if punct:
            append(("punct", punct))
        elif word:
            append(("word", word))
        elif string:
            append(("string", string))
        else:
            raise _Fallback
    return out


def _scalar(field, kind: str, token: str):
    cpp = field.cpp_type
    if cpp == _F.CPPTYPE_STRING:
        if kind != "string" or field.type == _F.TYPE_BYTES:
            raise _Fallback
        return token[1:-1]
    if kind != "word":
        raise _Fallback
    if cpp in _INTS:
        if not re.fullmatch(r"[-+]?\d+", token):
            raise _Fallback
        return int(token)
    if cpp in _FLOATS:
        low = token.lower()
        if low in _SPECIAL_FLOATS:
            return _SPECIAL_FLOATS[low]
        if low.endswith("f") and not low.startswith(("in", "-in", "+in")):
            low = low[:-1]
        try:
            return float(low)
        except ValueError:
            raise _Fallback from None
    if cpp == _F.CPPTYPE_BOOL:
        if token not in _BOOLS:
            raise _Fallback
        return _BOOLS[token]
    if cpp == _F.CPPTYPE_ENUM:
        value = field.enum_type.values_by_name.get(token)
        if value is None:
            raise _Fallback
        return value.number
    raise _Fallback


_FIELD_INFO: dict = {}


def _fields(descriptor) -> dict:
    """name -> (field, is a message, is repeated) for one message type (cached)."""
    info = _FIELD_INFO.get(descriptor)
    if info is None:
        info = {name: (f, f.cpp_type == _F.CPPTYPE_MESSAGE, _is_repeated(f))
                for name, f in descriptor.fields_by_name.items()}
        _FIELD_INFO[descriptor] = info
    return info


def _merge(message, tokens, i: int, depth: int) -> int:
    fields = _fields(message.DESCRIPTOR)
    n = len(tokens)
    while i < n:
        kind, token = tokens[i]
        if kind == "punct":
            if token == "}" and depth > 0:
                return i + 1
            raise _Fallback
        info = fields.get(token)
        if info is None or kind != "word":
            raise _Fallback
        field, is_message, repeated = info
        i += 1
        colon = i < n and tokens[i] == ("punct", ":")
        if colon:
            i += 1
        if i >= n:
            raise _Fallback
        if not is_message and not colon:
            raise _Fallback  # scalars need the colon (messages may omit it)
        if is_message:
            if tokens[i] != ("punct", "{"):
                raise _Fallback
            sub = getattr(message, token).add() if repeated else getattr(message, token)
            if not repeated:
                sub.SetInParent()
            i = _merge(sub, tokens, i + 1, depth + 1)
            continue
        value = _scalar(field, *tokens[i])
        i += 1
        if repeated:
            getattr(message, token).append(value)
        else:
            setattr(message, token, value)
    if depth:
        raise _Fallback
    return i


def merge_fast(text: str, message) -> bool:
    """Merge prototxt ``text`` into ``message`` if it uses only the plain subset; False otherwise
    (``message`` is then left cleared, ready for the full parser)."""
    try:
        _merge(message, _tokens(text), 0, 0)
        return True
    except (_Fallback, ValueError, TypeError, AttributeError):
        message.Clear()
        return False

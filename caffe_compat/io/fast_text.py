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

# One token per match: a comment (dropped), a quoted string without escapes, punctuation, a run of
# other non-blank characters (a name or a number, checked where it is used), or a lone quote, which
# sends the file to the full parser.  Every non-blank character is in some token, so ``findall``
# skips only whitespace.
_TOKEN = re.compile(r"""\#[^\n]*|"[^"\\\n]*"|'[^'\\\n]*'|[{}:]|[^\s{}:"'\#]+|["']""")

_INTS = {_F.CPPTYPE_INT32, _F.CPPTYPE_INT64, _F.CPPTYPE_UINT32, _F.CPPTYPE_UINT64}
_FLOATS = {_F.CPPTYPE_FLOAT, _F.CPPTYPE_DOUBLE}
_BOOLS = {"true": True, "t": True, "True": True, "1": True, "false": False, "f": False, "False": False, "0": False}
_SPECIAL_FLOATS = {"inf": float("inf"), "-inf": float("-inf"), "+inf": float("inf"), "infinity": float("inf"),
                   "-infinity": float("-inf"), "nan": float("nan"), "-nan": float("nan")}
_PUNCT = frozenset("{}:")


class _Fallback(Exception):
    pass


def _is_repeated(field) -> bool:
    # protobuf >= 5.28 has `is_repeated`; protobuf 7 dropped `label`.
    flag = getattr(field, "is_repeated", None)
    return bool(flag) if flag is not None else field.label == _F.LABEL_REPEATED


def _tokens(text: str) -> list[str]:
    tokens = _TOKEN.findall(text)
    if "#" in text:
        tokens = [t for t in tokens if t[0] != "#"]
    return tokens


def _string(token: str) -> str:
    if len(token) < 2 or token[0] not in "\"'":
        raise _Fallback
    return token[1:-1]


def _leading_zero(token: str) -> bool:
    """``07``, ``-010``, ``01.5``: a number written with a leading zero, which the text format reads as
    octal (``num_output: 010`` is 8 in Caffe's C++ TextFormat and in protobuf's parser, not 10) and refuses
    for a float (C++: "Expect a decimal number"); protobuf's parser decides."""
    digits = token[1:] if token[:1] in ("-", "+") else token
    return len(digits) > 1 and digits[0] == "0" and digits[1].isdigit()


def _int(token: str) -> int:
    digits = token[1:] if token[:1] in ("-", "+") else token
    if not (digits.isascii() and digits.isdigit()) or _leading_zero(token):
        raise _Fallback  # hex, octal, underscores...: protobuf's parser decides
    return int(token)


def _float(token: str) -> float:
    low = token.lower()
    if low in _SPECIAL_FLOATS:
        return _SPECIAL_FLOATS[low]
    if _leading_zero(low):
        raise _Fallback
    if low.endswith("f") and not low.startswith(("in", "-in", "+in")):
        low = low[:-1]
    if not low.isascii() or "_" in low:
        raise _Fallback
    return float(low)  # ValueError -> fallback


def _bool(token: str) -> bool:
    if token not in _BOOLS:
        raise _Fallback
    return _BOOLS[token]


def _converter(field):
    """The function turning one token into the value of a scalar ``field`` (None: not handled)."""
    cpp = field.cpp_type
    if cpp == _F.CPPTYPE_STRING:
        return None if field.type == _F.TYPE_BYTES else _string
    if cpp in _INTS:
        return _int
    if cpp in _FLOATS:
        return _float
    if cpp == _F.CPPTYPE_BOOL:
        return _bool
    if cpp == _F.CPPTYPE_ENUM:
        numbers = {name: value.number for name, value in field.enum_type.values_by_name.items()}

        def enum(token: str) -> int:
            if token not in numbers:
                raise _Fallback
            return numbers[token]
        return enum
    return None


_FIELD_INFO: dict = {}


def _fields(descriptor) -> dict:
    """name -> (is a message, is repeated, token converter) for one message type (cached)."""
    info = _FIELD_INFO.get(descriptor)
    if info is None:
        info = {name: (f.cpp_type == _F.CPPTYPE_MESSAGE, _is_repeated(f), _converter(f))
                for name, f in descriptor.fields_by_name.items()}
        _FIELD_INFO[descriptor] = info
    return info


def _merge(message, tokens: list[str], i: int, depth: int) -> int:
    fields = _fields(message.DESCRIPTOR)
    n = len(tokens)
    seen = set()  # singular fields given twice: Caffe's TextFormat::Parse rejects them (protobuf says where)
    while i < n:
        token = tokens[i]
        if token == "}" and depth > 0:
            return i + 1
        info = fields.get(token)
        if info is None:
            raise _Fallback  # punctuation out of place, a quoted name, an unknown field
        is_message, repeated, convert = info
        if not repeated:
            if token in seen:
                raise _Fallback
            seen.add(token)
        i += 1
        colon = i < n and tokens[i] == ":"
        if colon:
            i += 1
        if i >= n:
            raise _Fallback
        if is_message:
            if tokens[i] != "{":
                raise _Fallback
            sub = getattr(message, token).add() if repeated else getattr(message, token)
            if not repeated:
                sub.SetInParent()
            i = _merge(sub, tokens, i + 1, depth + 1)
            continue
        value = tokens[i]
        if not colon or convert is None or value in _PUNCT:
            raise _Fallback  # scalars need the colon (messages may omit it)
        i += 1
        if repeated:
            getattr(message, token).append(convert(value))
        else:
            setattr(message, token, convert(value))
    if depth:
        raise _Fallback
    return i


# A quoted string (escapes included), a comment, or a run of other non-blank characters.
_PLUS_SCAN = re.compile(r"""\"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|\#[^\n]*|[^\s"'\#]+|["']""")


def plus_sign(text: str) -> tuple[int, int] | None:
    """``(line, column)``, 1-based, of the first ``+`` outside strings and comments that is not an exponent's
    sign (``1e+5``), or None.  protobuf's C++ tokenizer, which Caffe's parser uses, makes such a ``+`` a symbol
    of its own that no value may start with (``num_output: +3`` is "Expected integer, got: +"), where
    protobuf's Python parser reads ``+3`` as 3."""
    for match in _PLUS_SCAN.finditer(text):
        token = match.group()
        if token[0] in "\"'#" or "+" not in token:
            continue
        for i, char in enumerate(token):
            if char == "+" and not (i and token[i - 1] in "eE" and (token[0].isdigit() or token[0] in ".-")):
                offset = match.start() + i
                line = text.count("\n", 0, offset) + 1
                return line, offset - (text.rfind("\n", 0, offset) + 1) + 1
    return None


def merge_fast(text: str, message) -> bool:
    """Merge prototxt ``text`` into ``message`` if it uses only the plain subset; False otherwise
    (``message`` is then left cleared, ready for the full parser)."""
    try:
        _merge(message, _tokens(text), 0, 0)
        return True
    except (_Fallback, ValueError, TypeError, AttributeError):
        message.Clear()
        return False

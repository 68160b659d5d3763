"""A fast path for parsing prototxt, falling back to protobuf's own text parser.

protobuf's Python text parser is pure Python and tokenises character class by character class; a
ResNet-50 deploy file (60 KB) takes ~50 ms, longer than OpenCV needs to load the whole model.  Caffe
files use a small subset of the text format (identifiers, numbers, quoted strings without escapes,
``{}`` nesting, ``#`` comments), which one regular expression tokenises.  :func:`merge_fast` handles
exactly that subset and returns ``False`` on anything else (escapes, ``[a, b]`` lists, ``<>``
delimiters, bytes fields, unknown names, any malformed input), in which case the caller runs
``google.protobuf.text_format`` on a fresh message, so error messages and rare syntax are protobuf's.
Tests check that both parsers build equal messages on every reference file.

Caffe itself reads prototxt with protobuf's C++ TextFormat, whose tokenizer is stricter in some places and
looser in others than the Python parser; :func:`cpp_text` applies its rules before the Python parser runs
(and the fast path's converters take only what C++ takes), so both paths accept exactly what Caffe does.
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
                   "-infinity": float("-inf"), "nan": float("nan"), "-nan": float("-nan")}
_PUNCT = frozenset("{}:")
# A float value as protobuf's C++ tokenizer writes one (io/tokenizer.cc ConsumeNumber: digits, an optional
# '.', an exponent with digits, one optional f/F), with TextFormat's optional '-' (a separate symbol there;
# the fast path joins them).  Anything else ("1.5ff", "1_0", "0x10") goes to the full parser and its checks.
_FLOAT_TOKEN = re.compile(r"-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?[fF]?\Z")
# Characters Python's regex calls whitespace that the C++ tokenizer does not skip (it skips only
# " \t\n\r\v\f"), and NUL, which ends a C++ string ("Unexpected end of string"): the full path decides.
_NOT_CPP_SPACE = re.compile("[\x00\x1c-\x1f\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]")


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


_FLOAT_VALUES: dict = {}  # token -> value: a net repeats the same few (1, 2, 0, 0.01)


def _uint(token: str) -> int:
    """An unsigned field takes no sign at all in C++ (ConsumeUnsignedInteger: "Expected integer, got: -",
    even for -0, which protobuf's Python parser takes)."""
    if token[:1] == "-":
        raise _Fallback
    return _int(token)


def _float(token: str) -> float:
    """C++ TextFormat's ConsumeDouble: a decimal integer or float token (``1.5f`` included), or the
    identifiers inf/infinity/nan in any case (not ``inff``/``nanf``, which protobuf's Python parser takes)."""
    value = _FLOAT_VALUES.get(token)
    if value is None:
        low = token.lower()
        if low in _SPECIAL_FLOATS:
            return _SPECIAL_FLOATS[low]
        if _leading_zero(low) or not _FLOAT_TOKEN.match(low):
            raise _Fallback
        value = float(low.rstrip("f"))
        if len(_FLOAT_VALUES) < 4096:
            _FLOAT_VALUES[token] = value
    return value


def _bool(token: str) -> bool:
    if token not in _BOOLS:
        raise _Fallback
    return _BOOLS[token]


def _converter(field):
    """The function turning one token into the value of a scalar ``field`` (None: not handled)."""
    cpp = field.cpp_type
    if cpp == _F.CPPTYPE_STRING:
        return None if field.type == _F.TYPE_BYTES else _string
    if cpp in (_F.CPPTYPE_UINT32, _F.CPPTYPE_UINT64):
        return _uint
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
        if value == "-" and i < n:  # "- 1": the C++ tokenizer's '-' is a symbol of its own, blanks may follow
            value += tokens[i]
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
    if (("\x00" in text or "\x1c" in text or "\x1d" in text or "\x1e" in text or "\x1f" in text)
            if text.isascii() else _NOT_CPP_SPACE.search(text)):
        return False
    try:
        _merge(message, _tokens(text), 0, 0)
        return True
    except (_Fallback, ValueError, TypeError, AttributeError):
        message.Clear()
        return False


# --- What protobuf's C++ tokenizer refuses -------------------------------------------------------------------
# Caffe reads prototxt with TextFormat::Parse over io::Tokenizer (src/google/protobuf/io/tokenizer.cc); any
# error the tokenizer reports fails the parse (ParserImpl::Parse returns !had_errors_).  protobuf's Python
# parser has its own, looser tokenizer (``1_000``, ``0b1``, ``1.5ff``, ``"\q"``, ``"\N{...}"``, U+00A0 as a
# blank...), so the full path first runs the C++ token rules below.

_CPP_TOKEN = re.compile(r"""
    (?P<space>[ \t\n\r\v\f]+)
  | (?P<comment>\#[^\n\x00]*)
  | (?P<ident>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<number>0[xX][0-9a-fA-F]*|0[0-9]+|(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]*)?[fF]?)
  | (?P<string>"(?:[^"\\\n\x00]|\\[^\n\x00])*"?|'(?:[^'\\\n\x00]|\\[^\n\x00])*'?)
  | (?P<symbol>[\s\S])
""", re.VERBOSE)
_ESCAPE_PAIR = re.compile(r"\\.", re.DOTALL)
_VALID_ESCAPE = re.compile(r"""\\(?:[abfnrtv\\?'"]|[0-7]|[xX][0-9a-fA-F]|u[0-9a-fA-F]{4}|U00[01][0-9a-fA-F]{5})""")
_BAD_EXPONENT = re.compile(r"[eE](?![-+]?[0-9])")
_SUFFIXED_SPECIAL = frozenset({"inff", "infinityf", "nanf"})


class CppTokenError(Exception):
    """What protobuf's C++ tokenizer or TextFormat parser reports, with a 1-based line and column."""

    def __init__(self, offset: int, text: str, message: str):
        self.line = text.count("\n", 0, offset) + 1
        self.column = offset - (text.rfind("\n", 0, offset) + 1) + 1
        super().__init__(message)


def _number_error(token: str, following: str) -> str | None:
    """The C++ tokenizer's complaint about a number token (ConsumeNumber), None when it takes it."""
    if token[:2] in ("0x", "0X"):
        if len(token) == 2:
            return '"0x" must be followed by hex digits.'
        is_float = False
    elif len(token) > 1 and token[0] == "0" and token[1].isdigit():
        if "8" in token or "9" in token:
            return "Numbers starting with leading zero must be in octal."
        is_float = False
    else:
        if _BAD_EXPONENT.search(token):
            return '"e" must be followed by exponent.'
        is_float = not token.isdigit()
    if following.isascii() and (following.isalpha() or following == "_"):
        return "Need space between number and identifier."
    if following == ".":
        return ("Already saw decimal point or exponent; can't have another one." if is_float
                else "Hex and octal numbers must be integers.")
    return None


def _string_error(token: str, following: str) -> str | None:
    """The C++ tokenizer's complaint about a quoted string (ConsumeString), None when it takes it."""
    if len(token) < 2 or token[-1] != token[0] or token.endswith("\\" + token[0]) and _open_at_end(token):
        if following == "\n":
            return "String literals cannot cross line boundaries."
        if following == "\\":
            return "Invalid escape sequence in string literal."
        return "Unexpected end of string."
    if "\\" in token:
        for pair in _ESCAPE_PAIR.finditer(token):
            if not _VALID_ESCAPE.match(token, pair.start()):
                return "Invalid escape sequence in string literal."
    return None


def _open_at_end(token: str) -> bool:
    """True when the closing quote of ``token`` is escaped (an odd run of backslashes before it)."""
    run = len(token) - 1 - len(token[:-1].rstrip("\\"))
    return run % 2 == 1


_UNSIGNED = {_F.CPPTYPE_UINT32, _F.CPPTYPE_UINT64}
_VALUE_START = frozenset(":[,")


def _cpp_integer(token: str) -> int | None:
    """The value of a C++ integer token (Tokenizer::ParseInteger: hex, octal, decimal), None for a float."""
    try:
        return int(token, 16) if token[:2] in ("0x", "0X") else int(token, 8) if token[0] == "0" else int(token)
    except ValueError:
        return None


def cpp_text(text: str, descriptor=None) -> str:
    """Check ``text`` against protobuf's C++ tokenizer and the value rules of TextFormat that protobuf's
    Python parser does not share; return the text to hand to the Python parser.

    Raises :class:`CppTokenError` (first problem in the text) where C++ refuses what Python would take.
    Where C++ takes what Python refuses, the returned text is rewritten to Python's spelling: a '-' separated
    from its number by blanks or comments (``- 1``, a symbol of its own in C++, read by ConsumeSignedInteger
    and ConsumeDouble with TryConsume("-")) is joined to it.  With the message's ``descriptor``, values are
    also checked against their fields: a '-' before an unsigned field's value (``num_output: -0``, which
    ConsumeUnsignedInteger refuses: "Expected integer, got: -") is refused, and a bool written as a hex or
    octal integer token (``0x1``, ``01``: ConsumeUnsignedInteger(value, 1)) is rewritten to 1 or 0."""
    edits = []  # (start, stop, replacement), in order
    previous = None  # (kind, token, end) of the last significant token
    pending_minus = None  # end offset of a '-' whose number has not come yet
    stack = [(descriptor, None)]  # each open '{' or '<': its message type (None: not followed), outer field
    field = None  # the field whose value comes after ':' (or in its '[...]' list)
    for match in _CPP_TOKEN.finditer(text):  # every character is in some token: the matches tile the text
        kind = match.lastgroup
        if kind == "space" or kind == "comment":
            continue
        token, pos, end = match.group(), match.start(), match.end()
        following = text[end:end + 1]
        after = previous[1] if previous is not None else None
        error = None
        if kind == "number":
            error = _number_error(token, following)
            if token[0] == "." and previous is not None and previous[0] == "ident" and previous[2] == pos:
                error = "Need space between identifier and decimal point."
            elif (error is None and after in _VALUE_START and field is not None
                  and field.cpp_type == _F.CPPTYPE_BOOL and token not in ("0", "1")
                  and _cpp_integer(token) in (0, 1)):
                edits.append((pos, end, str(_cpp_integer(token))))
        elif kind == "string":
            error = _string_error(token, following)
        elif kind == "symbol":
            if token == "\x00" or (token < " " and token not in " \t\n\r\v\f"):
                error = "Invalid control characters encountered in text."
            elif not token.isascii():
                error = f"Interpreting non ascii codepoint {token.encode('utf-8', 'surrogatepass')[0]}."
            elif (token == "-" and after in _VALUE_START and field is not None and field.cpp_type in _UNSIGNED
                  and _next_token(text, end) is not None and _cpp_integer(_next_token(text, end)) == 0):
                # Python reads -0 as 0 (a nonzero value it refuses itself: "Value out of range")
                error = f"field '{field.name}': Expected integer, got: -"
            elif token in ":[" and previous is not None and previous[0] == "ident":
                field = _field(stack[-1][0], previous[1])
            elif token in "{<":
                holder = _field(stack[-1][0], previous[1]) if previous is not None and previous[0] == "ident" \
                    else field if after in _VALUE_START else None
                stack.append((holder.message_type if holder is not None else None, field))
                field = None
            elif token in "}>" and len(stack) > 1:
                field = stack.pop()[1]
        elif kind == "ident" and token.lower() in _SUFFIXED_SPECIAL and after in (":", "-", "[", ","):
            error = f"Expected double, got: {token.lower()}"  # ConsumeDouble: inf, infinity, nan only
        if error is not None:
            raise CppTokenError(pos, text, error)
        if pending_minus is not None and pending_minus != pos and kind in ("number", "ident"):
            # "-\n  # c\n  1" -> "-1" and the gap's newlines after it (the lines after stay put)
            edits.append((pending_minus, end, text[pos:end] + "\n" * text.count("\n", pending_minus, pos)))
        pending_minus = end if kind == "symbol" and token == "-" else None
        previous = (kind, token, end)
    if not edits:
        return text
    pieces, last = [], 0
    for start, stop, replacement in edits:
        pieces.append(text[last:start])
        pieces.append(replacement)
        last = stop
    pieces.append(text[last:])
    return "".join(pieces)


def _next_token(text: str, pos: int) -> str | None:
    """The next number token after ``pos`` (blanks and comments skipped), None if another kind comes."""
    while pos < len(text):
        match = _CPP_TOKEN.match(text, pos)
        if match.lastgroup not in ("space", "comment"):
            return match.group() if match.lastgroup == "number" else None
        pos = match.end()
    return None


def _field(descriptor, name: str):
    return descriptor.fields_by_name.get(name) if descriptor is not None else None

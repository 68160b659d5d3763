"""Reading and writing protobuf messages as Caffe does: text format (prototxt) or binary.

Errors name the file and, for text, ``line:col`` and the offending field in Caffe's terms, e.g.
``train.prototxt:12:5: unknown field 'kernal_size' in ConvolutionParameter``.  Truncated or corrupt
binary input raises :class:`~caffe_compat.errors.ParseError` naming the file; protobuf cannot hold a
single message larger than 2 GB, which bounds a caffemodel (Caffe has the same limit).
"""

from __future__ import annotations

import os
import re
import warnings

from google.protobuf import message as _pb_message
from google.protobuf import text_format

from caffe_compat.errors import ParseError
from caffe_compat.io.atomic import write_bytes_atomic, write_text_atomic
from caffe_compat.io.fast_text import CppTokenError, cpp_text, merge_fast, plus_sign
from caffe_compat.io.path_or_text import is_path
from caffe_compat.io.safe_open import PROTOBUF_MAX_BYTES, read_regular_bytes

PROTOBUF_LIMIT = 2**31 - 1

_UNKNOWN_FIELD = re.compile(r'Message type "(?:caffe\.)?([\w.]+)" has no field named "(\w+)"')
_UNKNOWN_ENUM = re.compile(r'Enum type "(?:caffe\.)?([\w.]+)" has no value named (\w+)')
_SET_TWICE = re.compile(r'Message type "(?:caffe\.)?([\w.]+)" should not have multiple "(\w+)" fields')
_CONTROL_BYTES = re.compile(rb"[\x00-\x08\x0e-\x1f]")
_POSITION = re.compile(r"^(\d+):(\d+) : ?")


_LINE_EXCERPT = re.compile(r"^'.*?': ")
_LAST_FIELD = re.compile(r"(\w+)\s*:\s*$")


def describe_text_error(exc: text_format.ParseError, source: str, document: str | None = None) -> str:
    """Turn protobuf's text ParseError into ``source:line:col: message`` in Caffe's terms.  With the
    parsed ``document``, a bad value (``num_output: four``) also names its field."""
    text = str(exc)
    line, col = exc.GetLine(), exc.GetColumn()
    match = _POSITION.match(text)
    if match:
        line, col = int(match.group(1)), int(match.group(2))
        text = text[match.end():]
    excerpt = _LINE_EXCERPT.match(text)
    if excerpt:  # newer protobuf quotes the whole line first: the position already says where
        text = text[excerpt.end():]
    if document is not None and line and col and (excerpt or text.startswith(("Couldn't parse", "Value out of range",
                                                                               "Expected", "Invalid"))):
        lines = document.split("\n")
        if line <= len(lines):
            field = _LAST_FIELD.search(lines[line - 1][:col - 1])
            if field:
                text = f"field '{field.group(1)}': {text}"
    unknown = _UNKNOWN_FIELD.search(text)
    enum = _UNKNOWN_ENUM.search(text)
    twice = _SET_TWICE.search(text)
    if twice:
        text = (f"'{twice.group(2)}' is given more than once in {twice.group(1).split('.')[-1]} (it is not a "
                "repeated field; Caffe's parser rejects this)")
    elif unknown:
        text = f"unknown field '{unknown.group(2)}' in {unknown.group(1).split('.')[-1]}"
    elif enum:
        text = f"'{enum.group(2)}' is not a value of {enum.group(1).split('.')[-1]}"
    where = f"{source}:{line}:{col}" if line else source
    return f"{where}: {text.strip().rstrip('.')}"


def parse_text(text: str, message, source: str = "<text>"):
    """Parse prototxt ``text`` into ``message`` (repeated fields may appear in any order; a singular
    field given twice is an error, as in Caffe's ``TextFormat::Parse``).

    Plain Caffe files take the fast path of :mod:`caffe_compat.io.fast_text`; anything else, and every
    error, goes through protobuf's own text parser.  A value signed with ``+``, which protobuf's Python
    parser takes and Caffe's C++ one refuses, is refused (:func:`~caffe_compat.io.fast_text.plus_sign`), and so is
    what the C++ tokenizer refuses (:func:`~caffe_compat.io.fast_text.cpp_text`: ``1_000``, ``1.5ff``, ``"\\q"``,
    ``inff``...); ``- 1``, which it takes, is read as -1."""
    fast = not message.ByteSize() and merge_fast(text, message)
    if not fast:
        try:
            checked = cpp_text(text, message.DESCRIPTOR)
        except CppTokenError as exc:
            raise ParseError(_first_error(text, message, source, exc)) from None
        try:
            text_format.Parse(checked, message)  # like Caffe's TextFormat::Parse: a singular field only once
        except text_format.ParseError as exc:
            raise ParseError(describe_text_error(exc, source, checked)) from None
    where = plus_sign(text) if "+" in text else None
    if where is not None:
        raise ParseError(f"{source}:{where[0]}:{where[1]}: '+' before a value: Caffe's parser (protobuf's C++ "
                         f"TextFormat) takes only '-' as a sign (\"Expected ..., got: +\")")
    return message


def _first_error(text: str, message, source: str, exc: CppTokenError) -> str:
    """The error Caffe's parser reports first: protobuf's C++ tokenizer reads lazily, so a syntax error
    before the token it refuses (``exc``) stops the parse there."""
    try:
        with warnings.catch_warnings():  # its unescaping warns on the escapes C++ refuses ("\\q")
            warnings.simplefilter("ignore", DeprecationWarning)
            text_format.Parse(text, type(message)())
    except text_format.ParseError as earlier:
        if (earlier.GetLine() or 0, earlier.GetColumn() or 0) < (exc.line, exc.column) and earlier.GetLine():
            return describe_text_error(earlier, source, text)
    return (f"{source}:{exc.line}:{exc.column}: {exc} (Caffe's parser, protobuf's C++ TextFormat, refuses "
            "this)")


def parse_binary(data: bytes, message, source: str = "<bytes>"):
    """Parse a binary protobuf into ``message``; truncated or corrupt data raises ParseError, which also
    says what the data looks like when that is another Caffe file (a .solverstate given as weights)."""
    if len(data) > PROTOBUF_LIMIT:
        raise ParseError(f"{source}: {len(data)} bytes exceed protobuf's 2 GB message limit")
    try:
        message.ParseFromString(data)
    except (_pb_message.DecodeError, RuntimeError, ValueError) as exc:
        from caffe_compat.io.sniff import describe_binary

        what = describe_binary(data)
        seen = "" if what.startswith("a binary protobuf") else f"; it looks like {what}"
        raise ParseError(f"{source}: not a valid binary {message.DESCRIPTOR.name} "
                         f"(truncated or corrupt: {exc}){seen}") from None
    return message


def looks_binary(data: bytes) -> bool:
    """True unless ``data`` is plausible prototxt: no control bytes other than whitespace in its first
    64 KiB.  Bytes that are not UTF-8 (a Latin-1 comment in an old prototxt) do not make it binary; the
    text reader decides what they mean (:func:`caffe_compat.io.netfiles.decode_prototxt`)."""
    if not data:
        return False
    head = data[:65536]
    return bool(_CONTROL_BYTES.search(head))  # every binary Caffe message has a tag or length byte < 0x20


def read_bytes(path: str | os.PathLike, what: str | None = None) -> bytes:
    """The bytes of a protobuf file (prototxt, caffemodel, solverstate, binaryproto): a regular file of at
    most protobuf's 2 GB (NotRegularFileError otherwise, naming ``what`` named it), else ParseError."""
    try:
        return read_regular_bytes(path, what, PROTOBUF_MAX_BYTES)
    except FileNotFoundError:
        raise ParseError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ParseError(f"{path}: is a directory, expected a file") from None
    except OSError as exc:
        raise ParseError(f"{path}: cannot read ({exc.strerror})") from None


def read_message(path_or_text, message, binary: bool | None = None):
    """Read a message from a path (text or binary, auto-detected unless ``binary`` is given) or from
    prototxt text passed directly (a string that :func:`~caffe_compat.io.path_or_text.is_path` says is
    text: one with a newline, ``{`` ...)."""
    if isinstance(path_or_text, bytes):
        data, source = path_or_text, "<bytes>"
    elif isinstance(path_or_text, str) and not is_path(path_or_text):
        return parse_text(path_or_text, message, "<text>")
    else:
        source = str(path_or_text)
        data = read_bytes(path_or_text)
    if binary is None:
        binary = looks_binary(data)
    if binary:
        return parse_binary(data, message, source)
    return parse_text(decode_prototxt(data, source), message, source)


def decode_prototxt(data: bytes, source: str) -> str:
    """``data`` as UTF-8 text.  Bytes that are not UTF-8 are accepted in comments only (old prototxts
    carry Latin-1 comments, which Caffe's C++ parser skips unread): each such comment is dropped.  Anywhere
    else ParseError names ``source``, the byte offset and line of the first invalid byte."""
    if _first_bad(data) is None:
        return data.decode("utf-8")
    lines = data.split(b"\n")
    offset = 0
    for k, line in enumerate(lines):
        bad = _first_bad(line)
        if bad is not None:
            code, commented = _code_part(line)
            if not commented or _first_bad(code) is not None:
                raise ParseError(f"{source}: invalid UTF-8 byte 0x{line[bad]:02x} at byte offset {offset + bad} "
                                 f"(line {k + 1}); a prototxt must be UTF-8 text (other bytes are allowed in "
                                 "# comments only)")
            lines[k] = code
        offset += len(line) + 1
    return b"\n".join(lines).decode("utf-8")


def _first_bad(data: bytes) -> int | None:
    """Offset of the first byte that is not valid UTF-8, None when ``data`` decodes."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.start
    return None


def _code_part(line: bytes) -> tuple[bytes, bool]:
    """``(code, has a comment)`` of one prototxt line: the first ``#`` outside a quoted string starts the
    comment (``"`` or ``'`` quotes, backslash escapes)."""
    quote = None
    escaped = False
    for i, byte in enumerate(line):
        ch = chr(byte)
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch == "#":
            return line[:i], True
    return line, False


def message_to_text(message) -> str:
    return text_format.MessageToString(message)


def write_message(message, path: str | os.PathLike, binary: bool) -> None:
    """Write ``message`` atomically, as binary protobuf or as prototxt."""
    if binary:
        write_bytes_atomic(path, message.SerializeToString())
    else:
        write_text_atomic(path, message_to_text(message))

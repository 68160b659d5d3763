"""Reading and writing protobuf messages as Caffe does: text format (prototxt) or binary.

Errors name the file and, for text, ``line:col`` and the offending field in Caffe's terms, e.g.
``train.prototxt:12:5: unknown field 'kernal_size' in ConvolutionParameter``.  Truncated or corrupt
binary input raises :class:`~caffe_compat.errors.ParseError` naming the file; protobuf cannot hold a
single message larger than 2 GB, which bounds a caffemodel (Caffe has the same limit).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from google.protobuf import message as _pb_message
from google.protobuf import text_format

from caffe_compat.errors import ParseError
from caffe_compat.io.atomic import write_bytes_atomic, write_text_atomic
from caffe_compat.io.fast_text import merge_fast

PROTOBUF_LIMIT = 2**31 - 1

_UNKNOWN_FIELD = re.compile(r'Message type "(?:caffe\.)?([\w.]+)" has no field named "(\w+)"')
_UNKNOWN_ENUM = re.compile(r'Enum type "(?:caffe\.)?([\w.]+)" has no value named (\w+)')
_SET_TWICE = re.compile(r'Message type "(?:caffe\.)?([\w.]+)" should not have multiple "(\w+)" fields')
_CONTROL_BYTES = re.compile(rb"[\x00-\x08\x0e-\x1f]")
_POSITION = re.compile(r"^(\d+):(\d+) : ?")


def describe_text_error(exc: text_format.ParseError, source: str) -> str:
    """Turn protobuf's text ParseError into ``source:line:col: message`` in Caffe's terms."""
    text = str(exc)
    line, col = exc.GetLine(), exc.GetColumn()
    match = _POSITION.match(text)
    if match:
        line, col = int(match.group(1)), int(match.group(2))
        text = text[match.end():]
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
    error, goes through protobuf's own text parser."""
    if not message.ByteSize() and merge_fast(text, message):
        return message
    try:
        text_format.Parse(text, message)  # like Caffe's TextFormat::Parse: a singular field only once
    except text_format.ParseError as exc:
        raise ParseError(describe_text_error(exc, source)) from None
    return message


def parse_binary(data: bytes, message, source: str = "<bytes>"):
    """Parse a binary protobuf into ``message``; truncated or corrupt data raises ParseError."""
    if len(data) > PROTOBUF_LIMIT:
        raise ParseError(f"{source}: {len(data)} bytes exceed protobuf's 2 GB message limit")
    try:
        message.ParseFromString(data)
    except (_pb_message.DecodeError, RuntimeError, ValueError) as exc:
        raise ParseError(f"{source}: not a valid binary {message.DESCRIPTOR.name} "
                         f"(truncated or corrupt: {exc})") from None
    return message


def looks_binary(data: bytes) -> bool:
    """True unless ``data`` is plausible prototxt (UTF-8 without control bytes other than whitespace)."""
    if not data:
        return False
    head = data[:65536]
    if _CONTROL_BYTES.search(head):
        return True
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.start < len(head) - 3 or len(data) == len(head)
    return False


def read_bytes(path: str | os.PathLike) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise ParseError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ParseError(f"{path}: is a directory, expected a file") from None
    except OSError as exc:
        raise ParseError(f"{path}: cannot read ({exc.strerror})") from None


def read_message(path_or_text, message, binary: bool | None = None):
    """Read a message from a path (text or binary, auto-detected unless ``binary`` is given) or from
    prototxt text passed directly (a string containing a newline or ``{``)."""
    if isinstance(path_or_text, bytes):
        data, source = path_or_text, "<bytes>"
    elif isinstance(path_or_text, str) and ("\n" in path_or_text or "{" in path_or_text or ":" in path_or_text
                                            and not os.path.exists(path_or_text)):
        return parse_text(path_or_text, message, "<text>")
    else:
        source = str(path_or_text)
        data = read_bytes(path_or_text)
    if binary is None:
        binary = looks_binary(data)
    if binary:
        return parse_binary(data, message, source)
    return parse_text(data.decode("utf-8"), message, source)


def message_to_text(message) -> str:
    return text_format.MessageToString(message)


def write_message(message, path: str | os.PathLike, binary: bool) -> None:
    """Write ``message`` atomically, as binary protobuf or as prototxt."""
    if binary:
        write_bytes_atomic(path, message.SerializeToString())
    else:
        write_text_atomic(path, message_to_text(message))

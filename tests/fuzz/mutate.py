"""Mutations of seed files: byte-level ones for any file, and structure-aware ones for protobuf wire
format, prototxt text, LMDB data files and ``.npy`` headers.  Every function takes a ``random.Random``
and the bytes to mutate and returns new bytes; the same seed gives the same mutations."""

from __future__ import annotations

import random
import re
import struct

INTERESTING_INTS = [0, 1, -1, 2 ** 7 - 1, 2 ** 8 - 1, 2 ** 15 - 1, 2 ** 16 - 1, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1,
                    2 ** 32, 2 ** 63 - 1, 2 ** 64 - 1, -2 ** 31, -2 ** 63]
INTERESTING_NUMBERS = ["0", "-1", "1", "2147483647", "2147483648", "4294967296", "-2147483649", "99999999999999999999",
                       "1e308", "-1e308", "1e-320", "nan", "inf", "-inf", "-0", "3000000", "0x7fffffff", "1.5"]


# -- bytes -------------------------------------------------------------------------------------------

def truncate(rng: random.Random, data: bytes) -> bytes:
    return data[:rng.randrange(len(data))] if data else data


def bit_flips(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        if out:
            i = rng.randrange(len(out))
            out[i] ^= 1 << rng.randrange(8)
    return bytes(out)


def interesting_bytes(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        if out:
            out[rng.randrange(len(out))] = rng.choice([0x00, 0xFF, 0x7F, 0x80, 0x01, 0x0A, 0x22, 0x7B, 0x7D])
    return bytes(out)


def interesting_word(rng: random.Random, data: bytes) -> bytes:
    size = rng.choice([2, 4, 8])
    if len(data) < size:
        return data
    value = rng.choice(INTERESTING_INTS) % (1 << (8 * size))
    i = rng.randrange(len(data) - size + 1)
    return data[:i] + value.to_bytes(size, "little") + data[i + size:]


def insert_random(rng: random.Random, data: bytes) -> bytes:
    i = rng.randrange(len(data) + 1)
    return data[:i] + rng.randbytes(rng.randint(1, 64)) + data[i:]


def delete_range(rng: random.Random, data: bytes) -> bytes:
    if not data:
        return data
    i = rng.randrange(len(data))
    return data[:i] + data[i + rng.randint(1, 256):]


def repeat_range(rng: random.Random, data: bytes) -> bytes:
    if not data:
        return data
    i = rng.randrange(len(data))
    chunk = data[i:i + rng.randint(1, 128)]
    return data[:i] + chunk * rng.randint(2, 64) + data[i:]


def splice(rng: random.Random, data: bytes, other: bytes) -> bytes:
    if not data or not other:
        return data
    return data[:rng.randrange(len(data))] + other[rng.randrange(len(other)):]


BYTE_MUTATIONS = [truncate, bit_flips, interesting_bytes, interesting_word, insert_random, delete_range, repeat_range]


def mutate_bytes(rng: random.Random, data: bytes, others: list[bytes] = ()) -> bytes:
    for _ in range(rng.randint(1, 3)):
        if others and rng.random() < 0.1:
            data = splice(rng, data, rng.choice(others))
        else:
            data = rng.choice(BYTE_MUTATIONS)(rng, data)
    return data


# -- protobuf wire format ----------------------------------------------------------------------------

def varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(data) or shift > 63:
            raise ValueError("bad varint")
        byte = data[i]
        value |= (byte & 0x7F) << shift
        i += 1
        shift += 7
        if not byte & 0x80:
            return value, i


def wire_fields(data: bytes) -> list[tuple[int, int, int, int, int]] | None:
    """``(start, tag end, payload start, end, wire type)`` of each top-level field, or None when ``data``
    is not a well-formed message."""
    fields, i = [], 0
    try:
        while i < len(data):
            start = i
            key, i = _read_varint(data, i)
            kind, tag_end = key & 7, i
            if kind == 0:
                _, i = _read_varint(data, i)
                fields.append((start, tag_end, tag_end, i, 0))
            elif kind == 1:
                i += 8
                fields.append((start, tag_end, tag_end, i, 1))
            elif kind == 2:
                length, payload = _read_varint(data, i)
                i = payload + length
                fields.append((start, tag_end, payload, i, 2))
            elif kind == 5:
                i += 4
                fields.append((start, tag_end, tag_end, i, 5))
            else:
                return None
            if i > len(data) or key >> 3 == 0:
                return None
    except ValueError:
        return None
    return fields


def mutate_protobuf(rng: random.Random, data: bytes, depth: int = 0) -> bytes:
    """One structure-aware mutation of a binary protobuf message (recursing into nested messages)."""
    fields = wire_fields(data)
    if not fields:
        return mutate_bytes(rng, data)
    start, tag_end, payload, end, kind = rng.choice(fields)
    tag = data[start:tag_end]
    op = rng.choice(["huge_length", "repeat", "drop", "nest", "huge_varint", "recurse", "recurse", "wrong_type"])
    if op == "huge_length" and kind == 2:
        length = rng.choice([2 ** 31 - 1, 2 ** 31, 2 ** 32 + 7, 2 ** 63, 2 ** 64 - 1, end - payload + 1])
        return data[:tag_end] + varint(length) + data[payload:]
    if op == "repeat":
        return data[:end] + data[start:end] * rng.randint(1, 200) + data[end:]
    if op == "drop":
        return data[:start] + data[end:]
    if op == "nest" and kind == 2:
        body = data[payload:end]
        for _ in range(rng.choice([10, 100, 1000, 5000])):
            body = tag + varint(len(body)) + body
        return data[:start] + body + data[end:]
    if op == "huge_varint" and kind == 0:
        return data[:tag_end] + varint(rng.choice(INTERESTING_INTS)) + data[end:]
    if op == "wrong_type":
        key, _ = _read_varint(data, start)
        return data[:start] + varint((key & ~7) | rng.choice([0, 1, 2, 5])) + data[tag_end:]
    if op == "recurse" and kind == 2 and depth < 6:
        inner = mutate_protobuf(rng, data[payload:end], depth + 1)
        return data[:tag_end] + varint(len(inner)) + inner + data[end:]
    return mutate_bytes(rng, data)


# -- prototxt text -----------------------------------------------------------------------------------

_NUMBER = re.compile(rb"(?<=: )-?[0-9][0-9.e+-]*")
_CHUNKS = [b"{", b"}", b":", b'"', b"layer", b"dim: -3", b"dim: 0", b"axis: 9", b"group: 0", b"\x00", "\u00e9".encode(),
           b"num_output: 2000000000", b"kernel_size: 0", b"pad: 4294967295", b"top: \"data\"", b"#", b"\\", b"'"]


def mutate_text(rng: random.Random, data: bytes) -> bytes:
    """One structure-aware mutation of prototxt (net, solver, param_str) text."""
    op = rng.choice(["number", "number", "chunk", "line", "nest", "long_string", "bytes"])
    if op == "number":
        numbers = list(_NUMBER.finditer(data))
        if numbers:
            m = rng.choice(numbers)
            return data[:m.start()] + rng.choice(INTERESTING_NUMBERS).encode() + data[m.end():]
    if op == "chunk":
        i = rng.randrange(len(data) + 1)
        return data[:i] + rng.choice(_CHUNKS) + data[i:]
    if op == "line":
        lines = data.split(b"\n")
        i = rng.randrange(len(lines))
        lines[i:i + 1] = [lines[i]] * rng.choice([0, 2, 50])
        return b"\n".join(lines)
    if op == "nest":
        depth = rng.choice([100, 1000, 20000])
        i = rng.randrange(len(data) + 1)
        return data[:i] + b"layer { " * depth + b"}" * rng.choice([depth, depth - 1, 0]) + data[i:]
    if op == "long_string":
        i = rng.randrange(len(data) + 1)
        return data[:i] + b' name: "' + b"x" * rng.choice([1000, 1 << 20]) + b'" ' + data[i:]
    return mutate_bytes(rng, data)


# -- LMDB data files ---------------------------------------------------------------------------------

def mutate_lmdb(rng: random.Random, data: bytes, psize: int = 4096) -> bytes:
    """One page-aware mutation of an LMDB ``data.mdb``: a page zeroed, swapped or cut, a header or node
    field set to an interesting value, the other meta page made the current one."""
    pages = len(data) // psize
    if pages < 3:
        return mutate_bytes(rng, data)
    out = bytearray(data)
    page = rng.randrange(pages)
    base = page * psize
    op = rng.choice(["zero", "truncate_page", "truncate_mid", "swap", "header", "node", "meta", "meta_txnid"])
    if op == "zero":
        out[base:base + psize] = bytes(psize)
    elif op == "truncate_page":
        return bytes(out[:base])
    elif op == "truncate_mid":
        return bytes(out[:base + rng.randrange(1, psize)])
    elif op == "swap":
        other = rng.randrange(pages) * psize
        out[base:base + psize], out[other:other + psize] = out[other:other + psize], out[base:base + psize]
    elif op == "header":  # mp_pgno, mp_flags, mp_lower, mp_upper (or mp_pages)
        offset, size = rng.choice([(0, 8), (10, 2), (12, 2), (14, 2), (12, 4)])
        value = rng.choice(INTERESTING_INTS + [1, 2, 4, 0x12, 0x22, 0x41]) % (1 << (8 * size))
        out[base + offset:base + offset + size] = value.to_bytes(size, "little")
    elif op == "node":
        lower = struct.unpack_from("<H", out, base + 12)[0]
        count = max(0, min((lower - 16) // 2, (psize - 16) // 2))
        if count:
            k = rng.randrange(count)
            ptr = struct.unpack_from("<H", out, base + 16 + 2 * k)[0]
            target = rng.choice([base + 16 + 2 * k, base + ptr, base + ptr + 2, base + ptr + 4, base + ptr + 6,
                                 base + ptr + 8])
            if target + 2 <= len(out):
                out[target:target + 2] = (rng.choice(INTERESTING_INTS) % 65536).to_bytes(2, "little")
    elif op == "meta":  # a field of meta page 0 or 1: psize, flags, depth, counts, root, last_pg, txnid
        base = rng.randrange(2) * psize
        offset, size = rng.choice([(40, 4), (44, 2), (92, 2), (94, 2), (120, 8), (128, 8), (136, 8), (144, 8),
                                   (16, 4), (20, 4), (32, 8)])
        value = rng.choice(INTERESTING_INTS + [pages, pages - 1, pages + 1, 512, 65536]) % (1 << (8 * size))
        out[base + offset:base + offset + size] = value.to_bytes(size, "little")
    else:  # make the older meta page the one liblmdb uses
        for b in (0, psize):
            struct.pack_into("<Q", out, b + 144, rng.choice([0, 1, 5, 2 ** 64 - 1]))
    return bytes(out)


# -- .npy headers ------------------------------------------------------------------------------------

def mutate_npy(rng: random.Random, data: bytes) -> bytes:
    """One mutation of an ``.npy`` header's dict (shape, dtype, order) or its length field."""
    end = data.find(b"}")
    start = data.find(b"{")
    if not data.startswith(b"\x93NUMPY") or start < 0 or end < 0:
        return mutate_bytes(rng, data)
    header = data[start:end + 1]
    op = rng.choice(["shape", "dtype", "order", "length", "bytes"])
    if op == "shape":
        shape = rng.choice([b"(100000000000,)", b"(-1, 3)", b"(2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12)", b"()", b"(0,)",
                            b"(4294967296, 4294967296)", b"(3,) * 1000", b"[1, 2]"])
        header = re.sub(rb"\([^)]*\)", shape, header, count=1)
    elif op == "dtype":
        dtype = rng.choice([b"'|O'", b"'<U100000000'", b"'V8'", b"'<f16'", b"[('a', '<f4')]", b"'|S0'", b"'>i8'"])
        header = re.sub(rb"'<f4'|'<f8'|'<i8'", dtype, header, count=1)
    elif op == "order":
        header = header.replace(b"False", b"True") if b"False" in header else header.replace(b"True", b"1")
    elif op == "length":
        return data[:8] + rng.choice([b"\xff\xff", b"\x00\x00", b"\x01\x00"]) + data[10:]
    else:
        return mutate_bytes(rng, data)
    return data[:start] + header + data[end + 1:]

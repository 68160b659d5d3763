"""An image's decoded size read from its header, before OpenCV decodes it (issue #19).

A few hundred bytes of PNG can declare a 60000 × 60000 image; ``cv2.imread`` / ``cv2.imdecode`` would
then ask the allocator for gigabytes before the first row is read.  :func:`check_decode_budget` reads
the header (never the pixel data), computes what the decode would allocate and refuses it with a
:class:`~caffe_compat.errors.MemoryBudgetError` naming the file (or LMDB key) and the bytes, when that
is more than :func:`~caffe_compat.io.safe_open.memory_budget`.

Formats are recognised by their signature, as OpenCV does (never by the file name):

======  ====================================================================================
JPEG    ``FF D8``; the markers are walked to the first SOFn (C0-CF but C4, C8, CC): height, width,
        components (1 grey; otherwise 3: OpenCV converts YCbCr, RGB and CMYK to BGR); precision > 8
        is counted as 16-bit
PNG     the IHDR chunk (width, height, bit depth, colour type); the chunks before IDAT are walked for
        ``tRNS`` (OpenCV gives BGRA for a palette or RGB image with transparency, and for grey+alpha)
BMP     ``BM``; the OS/2 core header (12 bytes) or a Windows header (width, height: negative is
        top-down); 32 bits per pixel may give BGRA, anything else at most BGR
GIF     ``GIF87a``/``GIF89a``: the logical screen (OpenCV decodes onto it), at most BGRA
WebP    ``RIFF....WEBP`` with a ``VP8 `` (lossy), ``VP8L`` (lossless) or ``VP8X`` (extended) chunk
PNM     ``P1``-``P6`` (PBM, PGM, PPM; ASCII or binary): width, height and maxval (> 255 is 16-bit)
TIFF    ``II*\\0`` / ``MM\\0*``: the first IFD's ImageWidth, ImageLength, SamplesPerPixel and
        BitsPerSample
======  ====================================================================================

Anything else (JPEG 2000, PAM, PFM, Sun raster, HDR, EXR, BigTIFF, a header too damaged to read) is
left to OpenCV: the readers keep their typed error for a failed decode, and OpenCV's own limit on the
pixel count still applies.  The byte count is an upper bound of what the decode allocates: the larger
of the image as the file stores it (the decoder's own buffer) and as the flag asks for it
(``IMREAD_COLOR`` 3 channels, 8-bit; ``IMREAD_GRAYSCALE`` 1; ``IMREAD_UNCHANGED`` the file's channels
and depth).  ``tests/io/test_image_header.py`` compares every format's header with the shape OpenCV
decodes.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Callable

from caffe_compat.errors import MemoryBudgetError
from caffe_compat.io.safe_open import memory_budget

__all__ = ["ImageHeader", "IMREAD_COLOR", "IMREAD_GRAYSCALE", "IMREAD_UNCHANGED", "check_decode_budget",
           "decoded_bytes", "read_image_header"]

#: OpenCV's flag values (``cv2.IMREAD_*``), repeated here so that reading a header needs no OpenCV.
IMREAD_UNCHANGED, IMREAD_GRAYSCALE, IMREAD_COLOR = -1, 0, 1

_MAX_CHUNKS = 4096  # PNG chunks / JPEG markers walked before giving up (left to OpenCV)
_HEAD_BYTES = 1 << 16  # read from a file at once (a JPEG's EXIF/ICC segments before SOFn fit in it)


@dataclass(frozen=True)
class ImageHeader:
    """What an image's header declares: ``channels`` and ``depth`` (bytes per sample) are what
    ``IMREAD_UNCHANGED`` gives at most."""

    format: str
    width: int
    height: int
    channels: int
    depth: int = 1

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.height, self.width, self.channels


Reader = Callable[[int, int], bytes]


def _be16(b: bytes, i: int) -> int:
    return struct.unpack_from(">H", b, i)[0]


def _jpeg(at: Reader) -> ImageHeader | None:
    offset = 2
    for _ in range(_MAX_CHUNKS):
        head = at(offset, 2)
        if len(head) < 2 or head[0] != 0xFF:
            return None
        marker = head[1]
        if marker == 0xFF:  # fill byte
            offset += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # TEM, RSTn, SOI: no length
            offset += 2
            continue
        if marker in (0xD9, 0xDA):  # EOI or SOS before any frame header
            return None
        length = at(offset + 2, 2)
        if len(length) < 2 or _be16(length, 0) < 2:
            return None
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            sof = at(offset + 4, 6)
            if len(sof) < 6:
                return None
            precision, height, width, components = sof[0], _be16(sof, 1), _be16(sof, 3), sof[5]
            if height == 0 or width == 0 or components == 0:  # a DNL-defined height: left to OpenCV
                return None
            return ImageHeader("JPEG", width, height, 1 if components == 1 else 3, 2 if precision > 8 else 1)
        offset += 2 + _be16(length, 0)
    return None


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png(at: Reader) -> ImageHeader | None:
    ihdr = at(8, 8 + 13)
    if len(ihdr) < 21 or ihdr[4:8] != b"IHDR":
        return None
    width, height = struct.unpack_from(">II", ihdr, 8)
    bits, colour = ihdr[16], ihdr[17]
    transparent = False
    offset = 8 + 12 + 13
    for _ in range(_MAX_CHUNKS):  # tRNS comes before IDAT
        chunk = at(offset, 8)
        if len(chunk) < 8 or chunk[4:8] in (b"IDAT", b"IEND"):
            break
        if chunk[4:8] == b"tRNS":
            transparent = True
            break
        offset += 12 + struct.unpack_from(">I", chunk, 0)[0]
    if colour in (4, 6) or (colour in (2, 3) and transparent):
        channels = 4
    elif colour in (2, 3):
        channels = 3
    else:
        channels = 1
    return ImageHeader("PNG", width, height, channels, 2 if bits == 16 and colour != 3 else 1)


def _bmp(at: Reader) -> ImageHeader | None:
    head = at(14, 26)
    if len(head) < 16:
        return None
    size = struct.unpack_from("<I", head, 0)[0]
    if size == 12:
        width, height, _, bpp = struct.unpack_from("<HHHH", head, 4)
    elif size >= 40 and len(head) >= 16:
        width, height, _, bpp = struct.unpack_from("<iiHH", head, 4)
    else:
        return None
    return ImageHeader("BMP", abs(width), abs(height), 4 if bpp == 32 else 3)


def _gif(at: Reader) -> ImageHeader | None:
    head = at(6, 4)
    if len(head) < 4:
        return None
    width, height = struct.unpack_from("<HH", head, 0)
    return ImageHeader("GIF", width, height, 4)


def _webp(at: Reader) -> ImageHeader | None:
    chunk = at(12, 8 + 10)
    if len(chunk) < 18:
        return None
    kind, body = chunk[:4], chunk[8:]
    if kind == b"VP8X":
        alpha = bool(body[0] & 0x10)
        width = 1 + int.from_bytes(body[4:7], "little")
        height = 1 + int.from_bytes(body[7:10], "little")
        return ImageHeader("WebP", width, height, 4 if alpha else 3)
    if kind == b"VP8L":
        if body[0] != 0x2F:
            return None
        bits = int.from_bytes(body[1:5], "little")
        return ImageHeader("WebP", 1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF), 4 if bits >> 28 & 1 else 3)
    if kind == b"VP8 ":
        if body[3:6] != b"\x9d\x01\x2a":
            return None
        width, height = struct.unpack_from("<HH", body, 6)
        return ImageHeader("WebP", width & 0x3FFF, height & 0x3FFF, 3)
    return None


def _pnm(at: Reader) -> ImageHeader | None:
    head = at(0, 1024)
    kind = head[1:2]
    wanted = 2 if kind in (b"1", b"4") else 3
    numbers, i = [], 2
    while len(numbers) < wanted:
        while i < len(head) and (head[i:i + 1].isspace() or head[i:i + 1] == b"#"):
            if head[i:i + 1] == b"#":
                end = head.find(b"\n", i)
                if end < 0:
                    return None
                i = end
            i += 1
        start = i
        while i < len(head) and head[i:i + 1].isdigit():
            i += 1
        if i == start or i - start > 12:
            return None
        numbers.append(int(head[start:i]))
    width, height = numbers[0], numbers[1]
    depth = 2 if wanted == 3 and numbers[2] > 255 else 1
    return ImageHeader("PNM", width, height, 3 if kind in (b"3", b"6") else 1, depth)


def _tiff(at: Reader) -> ImageHeader | None:
    order = "<" if at(0, 2) == b"II" else ">"
    head = at(4, 4)
    if len(head) < 4:
        return None
    ifd = struct.unpack(order + "I", head)[0]
    count_bytes = at(ifd, 2)
    if len(count_bytes) < 2:
        return None
    count = min(struct.unpack(order + "H", count_bytes)[0], 1024)
    entries = at(ifd + 2, 12 * count)
    values = {}
    for k in range(len(entries) // 12):
        tag, kind, n = struct.unpack_from(order + "HHI", entries, 12 * k)
        if tag not in (256, 257, 258, 277):
            continue
        if kind == 3:  # SHORT: the first value is in the entry when it fits, else at the offset
            raw = entries[12 * k + 8: 12 * k + 10] if n <= 2 else at(struct.unpack_from(order + "I", entries,
                                                                                       12 * k + 8)[0], 2)
            if len(raw) < 2:
                return None
            values[tag] = struct.unpack(order + "H", raw)[0]
        elif kind == 4:  # LONG
            raw = entries[12 * k + 8: 12 * k + 12] if n <= 1 else at(struct.unpack_from(order + "I", entries,
                                                                                       12 * k + 8)[0], 4)
            if len(raw) < 4:
                return None
            values[tag] = struct.unpack(order + "I", raw)[0]
    if 256 not in values or 257 not in values:
        return None
    samples, bits = max(values.get(277, 1), 1), values.get(258, 1)
    channels = samples if samples in (1, 3) else max(samples, 4)
    depth = 1 if bits <= 8 else 2 if bits <= 16 else 4 if bits <= 32 else 8
    return ImageHeader("TIFF", values[256], values[257], channels, depth)


def _parse(at: Reader) -> ImageHeader | None:
    magic = at(0, 12)
    if magic[:2] == b"\xff\xd8":
        return _jpeg(at)
    if magic[:8] == _PNG_SIGNATURE:
        return _png(at)
    if magic[:2] == b"BM":
        return _bmp(at)
    if magic[:6] in (b"GIF87a", b"GIF89a"):
        return _gif(at)
    if magic[:4] == b"RIFF" and magic[8:12] == b"WEBP":
        return _webp(at)
    if magic[:1] == b"P" and magic[1:2] in b"123456" and len(magic) > 2 and magic[2:3].isspace():
        return _pnm(at)
    if magic[:4] in (b"II*\x00", b"MM\x00*"):
        return _tiff(at)
    return None


def read_image_header(source: bytes | bytearray | memoryview | str | os.PathLike) -> ImageHeader | None:
    """The header of an encoded image (its bytes, or a path: its first 64 KiB, and a marker past them where
    it lies; never the pixel data), or None when the format is not one of the module docstring's or the
    header cannot be read (left to OpenCV)."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source) if not isinstance(source, bytes) else source

        def at(offset: int, n: int) -> bytes:
            return data[offset:offset + n] if offset >= 0 else b""

        try:
            return _parse(at)
        except (struct.error, ValueError, IndexError):
            return None
    try:
        fd = os.open(source, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO named here cannot block
    except (OSError, ValueError, TypeError):
        return None
    try:  # one read serves almost every header; a marker past it is read where it lies
        head = os.read(fd, _HEAD_BYTES)

        def at(offset: int, n: int) -> bytes:
            if offset < 0:
                return b""
            if offset + n <= len(head) or len(head) < _HEAD_BYTES:
                return head[offset:offset + n]
            return os.pread(fd, n, offset)

        return _parse(at)
    except (OSError, struct.error, ValueError, IndexError, OverflowError):
        return None
    finally:
        os.close(fd)


def decoded_bytes(header: ImageHeader, flag: int = IMREAD_COLOR) -> int:
    """Bytes a decode with ``flag`` (``cv2.IMREAD_*``) allocates at most (see the module docstring)."""
    stored = header.width * header.height * header.channels * header.depth
    if flag == IMREAD_UNCHANGED:
        return stored
    asked = header.width * header.height * (1 if flag == IMREAD_GRAYSCALE else 3)
    return max(stored, asked)


def check_decode_budget(source, where: str, flag: int = IMREAD_COLOR,
                        budget: int | None = None) -> ImageHeader | None:
    """MemoryBudgetError naming ``where`` when decoding ``source`` (an encoded image's bytes or path) with
    ``flag`` would allocate more than ``budget`` (default :func:`memory_budget`); the header otherwise
    (None when the format is left to OpenCV)."""
    header = read_image_header(source)
    if header is None:
        return None
    need = decoded_bytes(header, flag)
    budget = memory_budget() if budget is None else int(budget)
    if need > budget:
        raise MemoryBudgetError(
            f"{where}: its {header.format} header declares {header.width} x {header.height} x {header.channels} "
            f"({header.depth * 8}-bit); decoding it needs {need} bytes, more than the memory budget of {budget} "
            f"bytes (CAFFE_COMPAT_MEMORY_BUDGET)")
    return header


def imread(path, flag: int):
    """``cv2.imread(path, flag)``, except for a path that is not UTF-8 (a file name's Latin-1 byte, which
    Python holds as a lone surrogate): OpenCV's binding cannot convert it and the process died of a
    segmentation fault, so its bytes are read here and decoded with ``cv2.imdecode`` (the same decoders and
    EXIF orientation).  None where the file cannot be read or decoded, as ``cv2.imread`` gives."""
    import cv2

    text = os.fsdecode(path)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        import numpy as np

        try:
            with open(os.fsencode(text), "rb") as handle:
                data = np.frombuffer(handle.read(), dtype=np.uint8)
        except OSError:
            return None
        return cv2.imdecode(data, flag) if data.size else None
    return cv2.imread(text, flag)

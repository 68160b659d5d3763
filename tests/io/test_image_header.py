"""An image's decoded size is read from its header before OpenCV decodes it (issue #19): the header
parser agrees with OpenCV on every format it reads (the decoded height and width exactly, the bytes as an
upper bound, the channels exactly where OpenCV's choice follows from the header), and a small file
declaring 60000 x 60000 pixels is a MemoryBudgetError naming the file (or the LMDB key), through every
reader that decodes images, before anything is allocated."""

from __future__ import annotations

import struct
import zlib

import cv2
import numpy as np
import pytest
from google.protobuf import text_format

from caffe_compat.errors import DataError, FormatError, MemoryBudgetError
from caffe_compat.io.image_header import (IMREAD_COLOR, IMREAD_GRAYSCALE, IMREAD_UNCHANGED, check_decode_budget,
                                          decoded_bytes, read_image_header)
from caffe_compat.proto import caffe_pb2

HUGE = 60000

# (extension, channels, dtype) that OpenCV writes; its decoded channel count under IMREAD_UNCHANGED is the
# header's exactly, except a grey BMP (an 8-bit palette OpenCV reads as grey: the header says at most 3)
# and GIF (the header says at most BGRA).
ENCODINGS = [(ext, c, dt) for ext in (".png", ".tif") for c in (1, 3, 4) for dt in (np.uint8, np.uint16)] + [
    (".jpg", 1, np.uint8), (".jpg", 3, np.uint8), (".bmp", 1, np.uint8), (".bmp", 3, np.uint8), (".bmp", 4, np.uint8),
    (".gif", 3, np.uint8), (".webp", 3, np.uint8), (".webp", 4, np.uint8), (".ppm", 3, np.uint8),
    (".ppm", 3, np.uint16), (".pgm", 1, np.uint8), (".pgm", 1, np.uint16), (".pbm", 1, np.uint8)]
UPPER_BOUND_ONLY = {(".bmp", 1), (".gif", 3)}


def _encode(ext, channels, dtype, height=13, width=21):
    rng = np.random.default_rng(channels)
    top = 255 if dtype == np.uint8 else 65535
    image = rng.integers(0, top, size=(height, width, channels) if channels > 1 else (height, width)).astype(dtype)
    if not cv2.haveImageWriter(ext):  # e.g. GIF before OpenCV 4.12's encoder (the wheels numpy 1.x gets)
        pytest.skip(f"OpenCV {cv2.__version__} has no {ext} encoder to make the test image with")
    ok, buf = cv2.imencode(ext, image)
    assert ok
    return buf.tobytes()


@pytest.mark.parametrize("ext, channels, dtype", ENCODINGS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_header_agrees_with_what_opencv_decodes(ext, channels, dtype):
    data = _encode(ext, channels, dtype)
    header = read_image_header(data)
    assert header is not None
    for flag in (IMREAD_UNCHANGED, IMREAD_GRAYSCALE, IMREAD_COLOR):
        decoded = cv2.imdecode(np.frombuffer(data, np.uint8), flag)
        assert decoded.shape[:2] == (header.height, header.width) == (13, 21)
        assert decoded.nbytes <= decoded_bytes(header, flag)
        # a 32-bit BMP: OpenCV 4.14 keeps its alpha (exact below), 4.11 drops it (the header is then a bound)
        dropped_alpha = (ext, channels) == (".bmp", 4) and (decoded.shape + (1,))[2] == 3
        if flag == IMREAD_UNCHANGED and (ext, channels) not in UPPER_BOUND_ONLY and not dropped_alpha:
            assert (decoded.shape + (1,))[2] == header.channels
            assert decoded.itemsize == header.depth
            assert decoded.nbytes == decoded_bytes(header, flag)


def test_header_from_a_file_reads_only_the_header(tmp_path):
    path = tmp_path / "a.jpg"
    path.write_bytes(_encode(".jpg", 3, np.uint8, height=40, width=30))
    assert read_image_header(path).shape == (40, 30, 3)
    assert read_image_header(tmp_path / "missing.png") is None


def _with_app_segments(jpeg: bytes, total: int) -> bytes:
    """``jpeg`` with APP15 segments of ``total`` bytes in all inserted after SOI (before the SOFn)."""
    segments = b""
    while len(segments) < total:
        body = b"\x00" * 60000
        segments += b"\xff\xef" + struct.pack(">H", len(body) + 2) + body
    return jpeg[:2] + segments + jpeg[2:]


@pytest.mark.parametrize("padding", [0, 65000, 200000])
def test_header_from_a_file_past_the_first_read(tmp_path, padding):
    """A file's first 64 KiB are read at once; a SOFn behind large APP segments (EXIF, ICC) is read where
    it lies, and the file agrees with its bytes and with OpenCV."""
    data = _with_app_segments(_encode(".jpg", 3, np.uint8, height=40, width=30), padding)
    path = tmp_path / "a.jpg"
    path.write_bytes(data)
    assert cv2.imread(str(path)).shape == (40, 30, 3)
    assert read_image_header(path) == read_image_header(data)
    assert read_image_header(path).shape == (40, 30, 3)
    truncated = tmp_path / "b.jpg"
    truncated.write_bytes(data[:len(data) - len(_encode(".jpg", 3, np.uint8, height=40, width=30)) + 4])
    assert read_image_header(truncated) is None  # the SOFn is missing: left to OpenCV


@pytest.mark.parametrize("data", [b"", b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"\xff\xd8\xff\xda\x00\x02", b"BM",
                                  b"GIF89a", b"RIFF\0\0\0\0WEBPVP8 ", b"P6 12", b"II*\x00\xff\xff\xff\xff",
                                  b"not an image", b"P7\nWIDTH 4\n"])
def test_unreadable_or_unknown_headers_are_left_to_opencv(data):
    assert read_image_header(data) is None
    assert check_decode_budget(data, "x", budget=1) is None


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def huge_png(width=HUGE, height=HUGE) -> bytes:
    """A valid PNG signature and IHDR (8-bit RGB) declaring ``width x height``, a few bytes of IDAT."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + _chunk(b"IEND", b""))


def huge_jpeg(width=HUGE, height=HUGE) -> bytes:
    """SOI, an APP0 segment, a baseline SOF0 declaring ``width x height`` with 3 components, EOI."""
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\0\x01\x01\0\0\x01\0\x01\0\0"
    sof = b"\xff\xc0" + struct.pack(">HBHHB", 17, 8, height, width, 3) + b"\x01\x22\x00\x02\x11\x01\x03\x11\x01"
    return b"\xff\xd8" + app0 + sof + b"\xff\xd9"


@pytest.fixture
def small_budget(monkeypatch):
    monkeypatch.setenv("CAFFE_COMPAT_MEMORY_BUDGET", "1G")


@pytest.mark.parametrize("make, kind", [(huge_png, "PNG"), (huge_jpeg, "JPEG")])
def test_crafted_headers_declare_what_they_say(make, kind):
    header = read_image_header(make())
    assert (header.format, header.width, header.height, header.channels) == (kind, HUGE, HUGE, 3)
    assert decoded_bytes(header, IMREAD_COLOR) == HUGE * HUGE * 3


NEED = f"needs {HUGE * HUGE * 3} bytes, more than the memory budget of {1 << 30} bytes"


@pytest.mark.parametrize("make", [huge_png, huge_jpeg])
def test_huge_image_file_is_refused_by_every_file_reader(tmp_path, small_budget, make):
    from caffe_compat.data.image import load_image_bgr
    from caffe_compat.io.transformer import load_image

    path = tmp_path / "huge.img"
    path.write_bytes(make())
    with pytest.raises(MemoryBudgetError, match=f"huge.img \\(named by list.txt:3\\): .*{NEED}") as info:
        load_image_bgr(path, what="list.txt:3")
    assert isinstance(info.value, DataError) and isinstance(info.value, FormatError)
    with pytest.raises(MemoryBudgetError, match=f"huge.img: .*{NEED}"):
        load_image(str(path))


def test_huge_image_through_image_data_names_the_list_entry(tmp_path, small_budget, monkeypatch):
    from caffe_compat.layers import layer_class

    monkeypatch.chdir(tmp_path)
    (tmp_path / "huge.png").write_bytes(huge_png())
    (tmp_path / "list.txt").write_text("huge.png 1\n")
    param = text_format.Parse('name: "img" type: "ImageData" top: "data" top: "label" '
                              'image_data_param { source: "list.txt" batch_size: 1 }', caffe_pb2.LayerParameter())
    with pytest.raises(MemoryBudgetError, match=f"huge.png .*ImageData.* list.txt entry 1.*PNG header declares "
                                                f"60000 x 60000 x 3.*{NEED}"):
        layer_class(param)(param, [], "test")


def test_huge_encoded_datum_in_lmdb_names_the_key(tmp_path, small_budget):
    pytest.importorskip("lmdb")
    from caffe_compat.data.imageset import compute_image_mean
    from caffe_compat.data.lmdb_source import DatumSource
    from caffe_compat.io import iter_lmdb, make_datum, write_lmdb

    good = _encode(".png", 3, np.uint8)
    db = tmp_path / "db"
    write_lmdb(db, [("00000000_ok.png", make_datum(good, 0, encoded=True)),
                    ("00000001_huge.jpg", make_datum(huge_jpeg(), 1, encoded=True))])
    pattern = f"db\\[00000001_huge.jpg\\].*JPEG header declares 60000 x 60000.*{NEED}"
    with pytest.raises(MemoryBudgetError, match=pattern):
        list(iter_lmdb(db))
    with pytest.raises(MemoryBudgetError, match=pattern):
        compute_image_mean(db)
    source = DatumSource(db)
    assert source.image(0)[0].shape == (3, 13, 21)
    with pytest.raises(MemoryBudgetError, match=pattern):
        source.image(1)


def test_huge_image_in_a_convert_imageset_list_is_refused_naming_the_line(tmp_path, small_budget):
    pytest.importorskip("lmdb")
    from caffe_compat.data.imageset import convert_imageset

    (tmp_path / "ok.png").write_bytes(_encode(".png", 3, np.uint8))
    (tmp_path / "huge.png").write_bytes(huge_png())
    (tmp_path / "list.txt").write_text("ok.png 0\nhuge.png 1\n")
    with pytest.raises(MemoryBudgetError, match=f"list.txt:2: .*huge.png: .*{NEED}"):
        convert_imageset(tmp_path / "list.txt", tmp_path, tmp_path / "db", progress=False)
    assert not (tmp_path / "db").exists()


def test_an_image_within_the_budget_still_decodes(tmp_path, monkeypatch):
    from caffe_compat.data.image import load_image_bgr

    path = tmp_path / "ok.png"
    path.write_bytes(_encode(".png", 3, np.uint8))
    monkeypatch.setenv("CAFFE_COMPAT_MEMORY_BUDGET", str(13 * 21 * 3))
    assert load_image_bgr(path).shape == (13, 21, 3)
    monkeypatch.setenv("CAFFE_COMPAT_MEMORY_BUDGET", str(13 * 21 * 3 - 1))
    with pytest.raises(MemoryBudgetError, match="ok.png: its PNG header declares 21 x 13 x 3"):
        load_image_bgr(path)


def test_header_of_a_fifo_does_not_block(tmp_path):
    """A path that is not a regular file (callers refuse those first) gives None at once, never a hang."""
    import os

    fifo = tmp_path / "pipe.jpg"
    os.mkfifo(fifo)
    assert read_image_header(fifo) is None
    assert read_image_header(tmp_path) is None  # a directory

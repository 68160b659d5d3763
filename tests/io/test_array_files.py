"""``.npy``/``.npz`` files named by ``--input`` (io.arrays.load_array_file): a header declaring more data
than the file holds, a damaged zip, a pickled object array, are FormatErrors naming the file; nothing is
allocated from a header's word alone."""

from __future__ import annotations

import io

import numpy as np
import pytest

from caffe_compat.errors import FormatError, NotRegularFileError
from caffe_compat.io.arrays import load_array_file
from caffe_compat.tools.netsetup import load_inputs


def _npy(array) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def test_valid_files_load(tmp_path):
    (tmp_path / "a.npy").write_bytes(_npy(np.arange(6, dtype=np.float32).reshape(2, 3)))
    np.savez(tmp_path / "b.npz", data=np.ones((1, 2)), other=np.zeros(3))
    np.testing.assert_array_equal(load_array_file(tmp_path / "a.npy"), np.arange(6).reshape(2, 3))
    with load_array_file(tmp_path / "b.npz") as npz:
        assert sorted(npz.files) == ["data", "other"]
        np.testing.assert_array_equal(npz["data"], np.ones((1, 2)))
    assert load_inputs([f"data={tmp_path / 'b.npz'}"])["data"].shape == (1, 2)


def test_header_declaring_a_huge_shape_is_refused_before_allocation(tmp_path):
    raw = _npy(np.zeros(4, np.float32)).replace(b"(4,)", b"(100000000000,)".ljust(4))
    header_end = raw.index(b"\n") + 1
    raw = raw[:8] + (header_end - 10).to_bytes(2, "little") + raw[10:]  # the longer header's length
    (tmp_path / "huge.npy").write_bytes(raw)
    with pytest.raises(FormatError, match=r"huge.npy: its header declares shape \(100000000000,\) of float32 "
                                          r"\(400000000000 bytes\), the file holds 16 bytes"):
        load_array_file(tmp_path / "huge.npy")


@pytest.mark.parametrize("content, reason", [
    (b"PK\x03\x04" + bytes(40), "BadZipFile"),
    (b"\x93NUMPY\x01\x00\x10\x00{'descr': '<f4', ", "not a readable"),
    (_npy(np.array([{"a": 1}], dtype=object)), "Python objects"),
    (_npy(np.arange(10, dtype=np.float64))[:-8], "the file holds 72 bytes"),
])
def test_damaged_files_are_format_errors_naming_the_file(tmp_path, content, reason):
    path = tmp_path / "x.npz"
    path.write_bytes(content)
    with pytest.raises(FormatError, match=f"x.npz.*{reason}"):
        load_array_file(path)
    with pytest.raises(FormatError, match=f"x.npz.*{reason}"):
        load_inputs([f"data={path}"])


def test_npz_member_with_a_truncated_array_names_the_member(tmp_path):
    import zipfile

    with zipfile.ZipFile(tmp_path / "m.npz", "w") as z:
        z.writestr("data.npy", _npy(np.arange(10, dtype=np.float64))[:-16])
    with load_array_file(tmp_path / "m.npz") as npz:
        with pytest.raises(FormatError, match="m.npz: array 'data': .*declares shape \\(10,\\)"):
            npz["data"]


def test_bounded_read_allocates_what_the_file_holds_not_the_bound(tmp_path):
    """read_regular_bytes(max_bytes=2 GB) on a small file, under an address-space limit far below 2 GB
    (found by the fuzzer: fh.read(n) allocates n bytes up front)."""
    from caffe_compat.io.safe_open import PROTOBUF_MAX_BYTES, read_regular_bytes
    from tests.fuzz.runner import run_case

    path = tmp_path / "small.bin"
    path.write_bytes(b"x" * 1000)

    def read():
        assert read_regular_bytes(path, max_bytes=PROTOBUF_MAX_BYTES) == b"x" * 1000
        assert read_regular_bytes(path, max_bytes=1000) == b"x" * 1000

    assert run_case(read, (), timeout=20, memory_bytes=256 << 20) == ("ok", "")
    with pytest.raises(NotRegularFileError, match="small.bin: 1000 bytes, more than the 999"):
        read_regular_bytes(path, max_bytes=999)

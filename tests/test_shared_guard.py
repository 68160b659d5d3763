"""The conftest guard: a test reads the optional shared references only through ``shared_reference()``."""

from __future__ import annotations

import pytest

from tests import conftest


@pytest.fixture
def fake_shared(tmp_path, monkeypatch):
    root = tmp_path / "shared"
    (root / "caffe_reference" / "large").mkdir(parents=True)
    (root / "caffe_reference" / "large" / "w.caffemodel").write_bytes(b"\x08\x01")
    monkeypatch.setattr(conftest, "_SHARED", root.resolve())
    monkeypatch.setattr(conftest, "_SHARED_REFERENCE", root.resolve() / "caffe_reference")
    return root


def test_reading_the_shared_folder_by_accident_fails(fake_shared):
    with pytest.raises(conftest.SharedAccessError, match="without tests.conftest.shared_reference"):
        open(fake_shared / "caffe_reference" / "large" / "w.caffemodel", "rb")
    with pytest.raises(conftest.SharedAccessError):
        list((fake_shared / "caffe_reference").iterdir())


def test_shared_reference_opens_the_folder_for_this_test(fake_shared):
    path = conftest.shared_reference("large/w.caffemodel")
    assert path.read_bytes() == b"\x08\x01"


def test_missing_shared_reference_skips_naming_the_file_and_the_variable(fake_shared):
    with pytest.raises(pytest.skip.Exception, match=r"caffe_reference/large/absent.*CAFFE_COMPAT_SHARED"):
        conftest.shared_reference("large/absent")


def test_fixture_path_never_falls_back_to_the_shared_folder(fake_shared):
    with pytest.raises(FileNotFoundError, match="is not in"):
        conftest.fixture_path("large/w.caffemodel")

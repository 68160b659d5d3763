"""Hostile LMDB databases (issue #19): a truncated, zeroed, flipped or random ``data.mdb``, a FIFO or
``/dev/zero`` where the data file should be, a ``lock.mdb`` FIFO, a corrupt record: every reader
(``iter_lmdb``, ``lmdb_length``, ``compute_image_mean``, the Data layer's ``DatumSource``, the CLI's
``compute-mean``) gives a typed error naming the file and where in it, never a signal, a hang or a
foreign exception, opens the database read-only and leaves the folder as it was.

Cases that would kill a process run in a child (``subprocess``), so a regression fails the test with
the signal instead of taking pytest down; the premise test shows that plain liblmdb really dies on the
same files.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys

import numpy as np
import pytest

from caffe_compat.cli import main
from caffe_compat.data.imageset import compute_image_mean
from caffe_compat.data.lmdb_source import DatumSource
from caffe_compat.errors import DataError, FormatError, NotRegularFileError
from caffe_compat.io import iter_lmdb, lmdb_length, make_datum, write_lmdb
from caffe_compat.io.lmdb_check import check_lmdb_file
from tests.conftest import REPO, fixture_path

FIXTURE = fixture_path("data/lmdb_raw/data.mdb")
PAGE = 4096
# The fixture (written by Caffe's convert_imageset): meta pages 0 and 1, leaf pages 2 and 3, branch root 4.
LEAVES, ROOT = (2, 3), 4


def _db(tmp_path, data: bytes, name: str = "db"):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "data.mdb").write_bytes(data)
    return folder


def _set_u16(data: bytes, offset: int, value: int) -> bytes:
    out = bytearray(data)
    struct.pack_into("<H", out, offset, value)
    return bytes(out)


def _corruptions() -> dict[str, bytes]:
    """name -> data.mdb bytes, each a corruption liblmdb alone would not survive or would misread."""
    good = FIXTURE.read_bytes()
    cases = {f"truncated_to_{n}": good[:n] for n in (0, 1, 100, 151, PAGE, PAGE + 100, 2 * PAGE, 3 * PAGE,
                                                        4 * PAGE, 4 * PAGE + 7, len(good) - 1)}
    for page in range(len(good) // PAGE):
        cases[f"page_{page}_zeroed"] = good[:page * PAGE] + bytes(PAGE) + good[(page + 1) * PAGE:]
    cases["leaf_3_flagged_branch"] = _set_u16(good, 3 * PAGE + 10, 0x01)  # liblmdb: abort in mdb_cursor_next
    cases["root_flagged_leaf"] = _set_u16(good, ROOT * PAGE + 10, 0x02)
    cases["leaf_2_node_offset_past_page"] = _set_u16(good, 2 * PAGE + 16, 0xFFF0)
    cases["leaf_2_data_size_huge"] = _set_u16(good, 2 * PAGE + struct.unpack_from("<H", good, 2 * PAGE + 16)[0] + 2,
                                              0x7FFF)
    meta1 = bytearray(good)
    struct.pack_into("<Q", meta1, PAGE + 136, 2 ** 40)  # mm_last_pg of the meta page in use
    cases["last_page_huge"] = bytes(meta1)
    cases["random_bytes"] = np.random.RandomState(19).bytes(len(good))
    return cases


_CHILD = r"""
import json, sys
from caffe_compat.errors import CaffeCompatError
from caffe_compat.io import iter_lmdb
from caffe_compat.data.lmdb_source import DatumSource
for name, folder in json.loads(sys.argv[1]).items():
    outcomes = []
    for reader in (lambda: list(iter_lmdb(folder)), lambda: DatumSource(folder).labels()):
        try:
            reader()
            outcomes.append("ok")
        except CaffeCompatError as exc:
            outcomes.append(type(exc).__name__ + ": " + str(exc))
    print(json.dumps([name, outcomes]), flush=True)
"""


def _run_child(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env=env)


def test_corrupt_data_files_are_typed_errors_in_a_child_that_no_signal_kills(tmp_path):
    folders = {name: str(_db(tmp_path, data, name)) for name, data in _corruptions().items()}
    result = _run_child(_CHILD, json.dumps(folders))
    assert result.returncode == 0, (f"the child died (status {result.returncode}, "
                                    f"{signal.Signals(-result.returncode).name if result.returncode < 0 else ''}) "
                                    f"after {result.stdout.splitlines()[-1:]}: {result.stderr[-2000:]}")
    outcomes = dict(json.loads(line) for line in result.stdout.splitlines())
    assert set(outcomes) == set(folders)
    for name, (first, second) in outcomes.items():
        assert first.startswith(("FormatError", "NotRegularFileError")), (name, first)
        assert second.startswith(("FormatError", "NotRegularFileError", "DataError")), (name, second)
        assert folders[name] in first, (name, first)  # names the database
    assert "past the end of the file" in outcomes["truncated_to_12288"][0]
    assert "page 3" in outcomes["leaf_3_flagged_branch"][0] and "mp_flags" in outcomes["leaf_3_flagged_branch"][0]
    assert "mm_last_pg" in outcomes["last_page_huge"][0]
    assert "meta page 0" in outcomes["random_bytes"][0]


_RAW = r"""
import sys, lmdb
env = lmdb.open(sys.argv[1], readonly=True, lock=False)
print(sum(1 for _ in env.begin().cursor()))
"""


@pytest.mark.parametrize("case, dies_with", [("truncated_to_12288", signal.SIGBUS),
                                             ("leaf_3_flagged_branch", signal.SIGABRT)])
def test_premise_plain_liblmdb_dies_on_the_same_files(tmp_path, case, dies_with):
    """Without the check, liblmdb kills the process: the corruptions above are the real danger."""
    folder = _db(tmp_path, _corruptions()[case])
    result = _run_child(_RAW, str(folder))
    assert result.returncode == -dies_with, (result.returncode, result.stderr[-500:])


def test_the_check_accepts_real_databases_and_names_what_it_saw(tmp_path):
    summary = check_lmdb_file(FIXTURE)
    assert (summary.page_size, summary.entries, summary.depth, summary.tree_pages) == (PAGE, 6, 2, 3)
    # a database with overflow records (values > half a page), deletions and a deeper tree
    db = tmp_path / "big"
    records = [(f"{i:06d}", make_datum(np.full((3, 40, 40), i % 251, np.uint8), i)) for i in range(400)]
    write_lmdb(db, records)
    summary = check_lmdb_file(db / "data.mdb")
    assert summary.entries == 400 and summary.overflow_pages == 400 * 2  # 4800 bytes + header: 2 pages each
    assert [int(label) for _, _, label in iter_lmdb(db)] == list(range(400))


def test_lock_file_that_is_a_fifo_is_never_opened_and_the_folder_is_left_as_it_was(tmp_path):
    db = _db(tmp_path, FIXTURE.read_bytes())
    os.mkfifo(db / "lock.mdb")  # opening it would block forever
    before = sorted(os.listdir(db)), (db / "data.mdb").stat().st_mtime_ns
    code = ("import sys\nfrom caffe_compat.io import iter_lmdb, lmdb_length\n"
            "from caffe_compat.data.lmdb_source import DatumSource\n"
            "print(len(list(iter_lmdb(sys.argv[1]))), lmdb_length(sys.argv[1]), len(DatumSource(sys.argv[1])))")
    result = _run_child(code, str(db), timeout=60)
    assert result.returncode == 0, result.stderr[-1000:]
    assert result.stdout.split() == ["6", "6", "6"]
    assert (sorted(os.listdir(db)), (db / "data.mdb").stat().st_mtime_ns) == before


def test_reading_creates_no_lock_file(tmp_path):
    db = _db(tmp_path, FIXTURE.read_bytes())
    before = sorted(os.listdir(db))
    assert len(list(iter_lmdb(db))) == 6
    assert lmdb_length(db) == 6
    source = DatumSource(db)
    assert source.labels().shape == (6,)
    assert compute_image_mean(db).shape == (1, 3, 16, 20)
    assert sorted(os.listdir(db)) == before == ["data.mdb"]


def test_fifo_device_and_missing_data_files_are_refused_by_name(tmp_path):
    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "data.mdb")
    zero = tmp_path / "zero"
    zero.mkdir()
    os.symlink("/dev/zero", zero / "data.mdb")
    empty = tmp_path / "empty"
    empty.mkdir()
    for folder, kind in ((fifo, "FIFO"), (zero, "character device")):
        for reader in (lambda: list(iter_lmdb(folder)), lambda: DatumSource(folder), lambda: lmdb_length(folder)):
            with pytest.raises(NotRegularFileError, match=f"{folder}/data.mdb.*{kind}"):
                reader()
    with pytest.raises(DataError, match="no data.mdb"):
        list(iter_lmdb(empty))
    with pytest.raises(DataError, match="no data.mdb"):
        DatumSource(empty)
    assert os.listdir(empty) == []


def test_record_that_is_not_a_datum_names_the_file_the_record_and_its_key(tmp_path):
    import lmdb

    db = tmp_path / "db"
    write_lmdb(db, [("a", make_datum(np.zeros((1, 2, 2), np.uint8), 0))])
    env = lmdb.open(str(db))
    with env.begin(write=True) as txn:
        txn.put(b"b", b"\x0a\xff\xff\xff\xff\x0f")  # field 1 with a length past the end
    env.close()
    (db / "lock.mdb").unlink()  # the writer's; readers never create one
    with pytest.raises(FormatError, match=r"db\[b\] \(record 1\): not a valid binary Datum"):
        list(iter_lmdb(db))
    source = DatumSource(db)
    assert source.image(0)[1] == 0
    with pytest.raises(FormatError, match=r"db\[b\] \(record 1\): not a valid binary Datum"):
        source.image(1)
    with pytest.raises(FormatError, match=r"\(record 1\)"):
        source.labels()
    # through the CLI: exit 2, one line, nothing written
    assert main(["compute-mean", str(db), str(tmp_path / "mean.binaryproto")]) == 2
    assert not (tmp_path / "mean.binaryproto").exists()


@pytest.mark.parametrize("datum, message", [
    (dict(channels=-1, height=-2, width=3, data=b"\0" * 6), "negative shape"),
    (dict(channels=3, height=2 ** 30, width=2 ** 30, data=b"\0" * 6), "needs 3458764513820540928 bytes"),
    (dict(encoded=True, data=b""), "data field is empty"),
    (dict(encoded=True, data=b"\x89PNG\r\n\x1a\n" + b"\0" * 40), "could not decode"),
])
def test_bad_datums_are_data_errors_naming_the_record(tmp_path, datum, message):
    from caffe_compat.proto import caffe_pb2

    db = tmp_path / "db"
    write_lmdb(db, [("k0", caffe_pb2.Datum(label=1, **datum))])
    with pytest.raises(DataError, match=rf"db\[k0\]: .*{message}"):
        list(iter_lmdb(db))
    with pytest.raises(DataError, match=rf"db\[k0\]: .*{message}"):
        DatumSource(db).image(0)


def test_compute_mean_cli_on_a_truncated_database_exits_2_without_writing(tmp_path, capsys):
    db = _db(tmp_path, FIXTURE.read_bytes()[:3 * PAGE])
    out = tmp_path / "mean.binaryproto"
    assert main(["compute-mean", str(db), str(out)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "data.mdb" in err and "past the end of the file" in err
    assert not out.exists()

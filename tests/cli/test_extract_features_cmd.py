"""``extract-features`` checks every output before it writes any: one it cannot write (a folder) was refused
only after the outputs before it had been written."""

from __future__ import annotations

import pytest

from tests.cli.test_cli_errors import run_cli
from tests.cli.test_wrong_files import TRAINABLE
from tests.conftest import fixture_path

WEIGHTS = fixture_path("nets/googlenet_small/weights.caffemodel")  # no layer of the net (a warning): filler values


@pytest.mark.parametrize("db_type", ["npy", "hdf5"])
def test_a_folder_among_the_outputs_writes_none_of_them(tmp_path, db_type):
    if db_type == "hdf5":
        pytest.importorskip("h5py")
    (tmp_path / "net.prototxt").write_text(TRAINABLE)
    (tmp_path / "adir").mkdir()
    done = run_cli("extract_features", WEIGHTS, "net.prototxt", "ip,data", "f.out,adir", 1, db_type,
                   "--no-progress", cwd=tmp_path)
    assert "Traceback" not in done.stderr and done.returncode == 2, done.stderr
    assert done.stderr.splitlines()[-1] == "caffe-compat extract_features: error: adir: cannot write (Is a directory)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "net.prototxt"]
    assert list((tmp_path / "adir").iterdir()) == []

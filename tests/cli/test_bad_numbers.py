"""Numbers on the command line outside what the work can take (a year datetime cannot hold, a seed numpy's
RandomState refuses, a batch numpy cannot allocate, a negative or NaN tolerance, an iteration count beyond the
solver's int32 field): exit status 2, one line naming the option, no traceback, nothing written."""

from __future__ import annotations

import pytest

from tests.cli.test_cli_errors import assert_usage_error, run_cli
from tests.conftest import REPO, fixture_path

LOG = REPO / "tests" / "tools" / "data" / "lenet_caffe.log"
NET = fixture_path("nets/googlenet_small/deploy.prototxt")
WEIGHTS = fixture_path("nets/googlenet_small/weights.caffemodel")


@pytest.mark.parametrize("year", [-1, 0, 10000, 2 ** 63])
def test_parse_log_year_out_of_range(tmp_path, year):
    done = run_cli("parse-log", LOG, tmp_path, "--year", year)
    assert_usage_error(done, "parse-log", f"--year must be 1 to 9999, got {year}")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("seed", [-1, 2 ** 32, 2 ** 63])
def test_make_lmdb_shuffle_seed_out_of_range(tmp_path, seed):
    (tmp_path / "list.txt").write_text("a.png 0\n")
    done = run_cli("make-lmdb", "list.txt", ".", "db", "--shuffle", "--seed", seed, cwd=tmp_path)
    assert_usage_error(done, "make-lmdb", f"--seed must be 0 to 2**32 - 1, got {seed}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["list.txt"]


def test_export_batch_too_big_to_allocate(tmp_path):
    done = run_cli("export", NET, "--weights", WEIGHTS, "-o", tmp_path / "e.onnx", "--batch", 2 ** 63)
    assert "Traceback" not in done.stderr and done.returncode == 2, done.stderr
    assert f"caffe-compat export: error: --batch {2 ** 63}: cannot make an example batch of that size" in done.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("tolerance", ["-1", "nan"])
def test_export_tolerance_must_be_a_number_at_least_0(tmp_path, tolerance):
    done = run_cli("export", NET, "--weights", WEIGHTS, "-o", tmp_path / "e.onnx", "--verify",
                   "--tolerance", tolerance)
    assert_usage_error(done, "export", f"--tolerance must be a number >= 0, got {float(tolerance)}")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("option", ["--max-iter", "--snapshot-every"])
def test_reproduce_iterations_beyond_int32(tmp_path, option):
    done = run_cli("reproduce", "digits", option, 2 ** 63, "--out", tmp_path / "r")
    assert_usage_error(done, "reproduce", f"reproduce digits: {option} must be <= {2 ** 31 - 1}, got {2 ** 63}")
    assert list(tmp_path.iterdir()) == []

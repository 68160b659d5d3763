"""``.ci/oldest.py``: the pins of CI's oldest leg are pyproject.toml's lower bounds."""

from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / ".ci" / "oldest.py"


def test_every_lower_bound_is_pinned_except_protobuf_which_says_why():
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, check=True).stdout
    pins = dict(line.split("==") for line in out.splitlines() if line and not line.startswith("#"))
    assert pins["torch"] == "2.13" and pins["numpy"] == "1.23.0"
    assert pins["opencv-python-headless"] == "4.5.4.58" and pins["onnxruntime-gpu"] == pins["onnxruntime"]
    assert pins["pytest"] == "7.0.0" and pins["onnxscript"] == "0.7.0"  # the dev and compile extras too
    assert "protobuf" not in pins
    assert any(line.startswith("# protobuf>=4.21.0 not pinned: grpcio-tools") for line in out.splitlines())
    assert "grpcio-tools" not in pins  # an exact pin has no lower bound to move


def test_two_different_lower_bounds_are_refused(tmp_path):
    module = runpy.run_path(str(SCRIPT))
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\ndependencies = ["numpy>=1.23.0"]\n'
                         '[project.optional-dependencies]\ndev = ["numpy>=1.26.0", "h5py[x] >= 3.6.0 ; python_version>\'3\'"]\n')
    with pytest.raises(SystemExit, match="numpy has two lower bounds, 1.23.0 and 1.26.0"):
        module["lower_bounds"](pyproject)
    pyproject.write_text('[project]\ndependencies = ["numpy>=1.23.0,<3", "h5py[x] >= 3.6.0 ; python_version>\'3\'"]\n')
    assert module["lower_bounds"](pyproject) == {"numpy": "1.23.0", "h5py": "3.6.0"}
    pyproject.write_text('[project]\ndependencies = ["numpy>>1.23"]\n')
    with pytest.raises(SystemExit, match=r"pyproject.toml: cannot read the requirement 'numpy>>1.23'"):
        module["lower_bounds"](pyproject)


def test_one_bound_for_the_protobuf_runtime_checks():
    run = [sys.executable, str(SCRIPT), "--bound"]
    assert subprocess.run(run + ["protobuf"], capture_output=True, text=True, check=True).stdout == "4.21.0\n"
    missing = subprocess.run(run + ["grpcio-tools"], capture_output=True, text=True)
    assert missing.returncode == 1 and "gives grpcio-tools no lower bound" in missing.stderr

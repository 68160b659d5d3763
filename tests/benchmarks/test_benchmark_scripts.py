"""The benchmark scripts still run: each with its smallest settings, in a subprocess, exit 0 and its table
printed.  Timings are not asserted (benchmarks measure; tests check numbers elsewhere)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

CASES = {
    "bench_fappy.py": (["--device", "cpu", "--repeats", "1", "--no-memory"], "C++/caffe"),
    "bench_metric_losses.py": (["--quick", "--only", "contrastive", "histogram", "--batch", "128", "--threads", "1",
                                "--device", "cpu", "--no-memory"], "speed-up"),
    "bench_input_pipeline.py": (["--batches", "2", "--batch-size", "8"], "DataLoader num_workers=2"),
    "bench_onnx.py": (["--batch", "2", "--repeats", "1"], "ONNX Runtime CPU"),
}


@pytest.mark.parametrize("script", sorted(CASES))
def test_benchmark_script_runs_and_prints_its_table(script):
    args, marker = CASES[script]
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args], capture_output=True,
                          text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert marker in done.stdout, done.stdout[-2000:]
    assert "Traceback" not in done.stderr


def test_load_benchmark_runs_on_the_nsfw_model(nsfw_dir):
    assert (nsfw_dir / "deploy.prototxt").is_file()  # fetched into REPO/.cache, where the script looks
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_load.py"), "--repeats", "1",
                           "--nsfw-cache", str(REPO / ".cache")], capture_output=True, text=True, cwd=REPO,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "open_nsfw" in done.stdout

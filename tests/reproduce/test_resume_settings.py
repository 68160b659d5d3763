"""`reproduce` resumes only the run it was: settings.json in every run directory, refusal (exit 2) on any
difference, ``--fresh`` to retrain, a lower --max-iter never evaluating later weights, and run.json's
training time, resume / reuse flags and git state."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from caffe_compat.cli import main
from caffe_compat.reproduce.pipeline import reproduce
from caffe_compat.reproduce.training import RunSettingsMismatch
from tests.conftest import REPO

RUN = dict(losses=["fappy"], seeds=[0], progress=False)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    out = tmp_path_factory.mktemp("resume") / "digits"
    summary = reproduce("digits", max_iter=3, out_dir=out, **RUN)
    return out, summary


def _copy(base, tmp_path):
    out = tmp_path / "digits"
    shutil.copytree(base[0], out)
    return out


def _mtimes(out):
    return {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}


def _checkout_revision() -> str | None:
    """HEAD of the checkout under test, read with git itself; None where git or the work tree is missing."""
    git = shutil.which("git")
    if git is None or not (REPO / ".git").exists():
        return None
    revision = subprocess.run([git, "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert re.fullmatch(r"[0-9a-f]{40}", revision)
    return revision


def test_run_dir_records_its_settings_and_run_json_the_run(base):
    out, summary = base
    run_dir = out / "fappy" / "seed0"
    settings = json.loads((run_dir / "settings.json").read_text())
    s = settings["settings"]
    assert s["max_iter"] == 3 and s["seed"] == 0 and s["loss"] == "fappy" and s["batch_size"] == 64
    assert s["per_label"] == 8 and s["weights_sha256"] is None and s["delta_min"] is None
    assert s["data_root"].startswith("generated: make_toy_data('cub'")
    assert re.fullmatch(r"[0-9a-f]{64}", s["train_records_sha256"]) and re.fullmatch(r"[0-9a-f]{64}", settings["sha256"])
    assert "device" not in s and "workers" not in s
    run = json.loads((out / "run.json").read_text())
    assert run["git_revision"] == _checkout_revision()  # None from a tree without git (an archive, no git program)
    assert isinstance(run["git_dirty"], bool) if run["git_revision"] else run["git_dirty"] is None
    (entry,) = run["runs"]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert entry == {"loss": "fappy", "seed": 0, "iterations": 3, "training_seconds": metrics["train"]["seconds"],
                     "resumed_from": None, "reused": False, "devices": ["cpu"]}
    assert metrics["train"]["seconds"] > 0 and metrics["train"]["caffemodel"].endswith("snapshot_iter_3.caffemodel")


def test_same_settings_reuse_the_run_and_keep_its_training_time(base, tmp_path):
    out = _copy(base, tmp_path)
    original = json.loads((out / "fappy" / "seed0" / "metrics.json").read_text())
    before = _mtimes(out / "fappy")
    again = reproduce("digits", max_iter=3, out_dir=out, **RUN)
    assert _mtimes(out / "fappy") == before  # nothing retrained, re-exported or rewritten
    (entry,) = again["runs"]
    assert entry["reused"] is True and entry["training_seconds"] == original["train"]["seconds"]
    assert again["figures"] == base[1]["figures"]


def test_lower_max_iter_is_refused_then_fresh_retrains_to_it(base, tmp_path, capsys):
    out = _copy(base, tmp_path)
    before = _mtimes(out)
    with pytest.raises(RunSettingsMismatch, match=r"other settings \(max_iter 3 -> 2\).*--out.*--fresh"):
        reproduce("digits", max_iter=2, out_dir=out, **RUN)
    status = main(["reproduce", "digits", "--loss", "fappy", "--seeds", "0", "--max-iter", "2", "--out", str(out),
                   "--device", "cpu"])
    err = capsys.readouterr().err
    assert status == 2 and "caffe-compat reproduce: error:" in err and "max_iter 3 -> 2" in err
    assert "Traceback" not in err
    assert _mtimes(out) == before  # refused before anything was written
    summary = reproduce("digits", max_iter=2, out_dir=out, fresh=True, **RUN)
    run_dir = out / "fappy" / "seed0"
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["train"]["iterations"] == 2 and metrics["settings"]["max_iter"] == 2
    assert metrics["train"]["caffemodel"].endswith("snapshot_iter_2.caffemodel")
    assert not list(run_dir.glob("snapshot_iter_3.*"))  # the later weights are gone, never evaluated
    assert summary["fresh"] is True and summary["runs"][0]["reused"] is False


@pytest.mark.parametrize("change, message", [
    (dict(delta_min=1e-3), r"delta_min null -> 0.001"),
    (dict(batch_size=32, per_label=8), r"batch_size 64 -> 32"),
    (dict(seeds=[0], losses=["fappy"], max_iter=3, data_root="DATA"), r"data_root"),
])
def test_other_result_settings_are_refused(base, tmp_path, change, message):
    out = _copy(base, tmp_path)
    kwargs = {**RUN, "max_iter": 3, **change}
    if kwargs.get("data_root") == "DATA":
        kwargs["data_root"] = out / "data" / "CUB_200_2011"  # same images, named explicitly: another data root
    before = _mtimes(out)
    with pytest.raises(RunSettingsMismatch, match=message):
        reproduce("digits", out_dir=out, **kwargs)
    assert _mtimes(out) == before


def test_other_initial_weights_are_refused(base, tmp_path):
    out = _copy(base, tmp_path)
    weights = out / "fappy" / "seed0" / "snapshot_iter_3.caffemodel"
    with pytest.raises(RunSettingsMismatch, match=r"weights_sha256 null -> "):
        reproduce("digits", max_iter=3, out_dir=out, weights=str(weights), **RUN)


def test_run_without_a_settings_record_is_refused(base, tmp_path):
    out = _copy(base, tmp_path)
    (out / "fappy" / "seed0" / "settings.json").unlink()
    with pytest.raises(RunSettingsMismatch, match="no record of its settings"):
        reproduce("digits", max_iter=3, out_dir=out, **RUN)


def test_run_stopped_before_its_evaluation_resumes_and_says_so(base, tmp_path):
    """metrics.json missing (stopped after training): the final snapshot is restored, not retrained."""
    out = _copy(base, tmp_path)
    run_dir = out / "fappy" / "seed0"
    original = json.loads((run_dir / "metrics.json").read_text())
    (run_dir / "metrics.json").unlink()
    summary = reproduce("digits", max_iter=3, out_dir=out, **RUN)
    (entry,) = summary["runs"]
    assert entry["resumed_from"] == 3 and entry["reused"] is False and entry["iterations"] == 3
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert [s["from_iter"] for s in metrics["train"]["segments"]] == [0, 3]
    assert entry["training_seconds"] >= original["train"]["seconds"]
    assert metrics["metrics"]["recall_at_k"] == original["metrics"]["recall_at_k"]

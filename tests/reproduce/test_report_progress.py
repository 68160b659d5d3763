"""The terminal of `reproduce`: what is on disk before starting, ``run k of n: <loss> seed <s>`` with
what each run reuses from disk, resumes or trains, and a closing summary."""

from __future__ import annotations

import shutil

from caffe_compat.cli import main
from tests.reproduce.conftest import DIGITS_RUN


def test_rerun_says_what_it_reused_resumed_and_trained(digits_run, tmp_path, capsys):
    """A copy of the digits run with one run's metrics.json gone (stopped before its evaluation) and
    one run gone entirely: 2 reused, 1 resumed from its final snapshot, 1 trained."""
    out = tmp_path / "digits"
    shutil.copytree(digits_run[0], out)
    (out / "triplet" / "seed0" / "metrics.json").unlink()
    shutil.rmtree(out / "triplet" / "seed1")
    args = ["reproduce", "digits", "--max-iter", str(DIGITS_RUN["max_iter"]), "--device", "cpu", "--out", str(out),
            "--seeds", *map(str, DIGITS_RUN["seeds"])]
    for loss in DIGITS_RUN["losses"]:
        args += ["--loss", loss]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (f"reproduce digits: 4 runs (2 loss(es) x 2 seed(s), 6 iterations each) in {out}; on disk: "
                        f"2 finished (reused), 1 with a snapshot to resume from")
    progress = [line for line in lines if line.startswith("run ")]
    assert progress[0].startswith("run 1 of 4: fappy seed 0: reused from disk (snapshot_iter_6.caffemodel, "
                                  "embedder.onnx and metrics.json: Recall@1 ")
    assert progress[1].startswith("run 2 of 4: fappy seed 1: reused from disk (")
    assert progress[2] == "run 3 of 4: triplet seed 0: resuming from snapshot_iter_6.solverstate on disk"
    assert progress[3].startswith("run 3 of 4: triplet seed 0: Recall@1 ") and "resumed from iteration 6" in progress[3]
    assert progress[4] == "run 4 of 4: triplet seed 1: training"
    assert progress[5].startswith("run 4 of 4: triplet seed 1: Recall@1 ") and "resumed" not in progress[5]
    assert len(progress) == 6
    assert lines[-1].startswith("4 runs: 2 reused from disk (weights, ONNX and metrics of an earlier invocation); "
                                "1 resumed from a snapshot (triplet seed 0 at iteration 6); 1 trained from scratch; ")
    assert lines[-1].endswith(" s wall on cpu")

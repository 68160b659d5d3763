"""parse-log (Caffe's tools/extra/parse_log.py) on Caffe's logs and on ours.

* ``tests/tools/data/lenet_caffe.log``: a LeNet run written line for line in Caffe 1.0's formats
  (``solver.cpp`` / ``sgd_solver.cpp`` messages, test at 0/100/200, the final ``Iteration 200, loss`` line
  without outputs, a prototxt dump without prefixes, a run over New Year) with glog's ``MMDD`` prefix;
  the same log with newer glog's ``YYYYMMDD`` prefix must give the same tables.  The expected CSV rows
  are worked out by hand from the lines (Seconds from ``Solving LeNet`` at 23:59:50.650330; the first
  row's NaN LearningRate copied from the second, as Caffe's script does).
* ``tests/fixtures/solvers/sgd_step_momentum/caffe_log.txt``: a real Caffe log (glog ``YYYYMMDD``, no
  ``Solving`` line); our own ``train`` on the same solver, net, weights and batches writes a log through
  ``caffe_log`` whose tables have the same columns and the same NumIters, LearningRate and loss.
"""

from __future__ import annotations

import csv
import math
import re
import shutil
from pathlib import Path

import cv2
import numpy as np
import pytest

from caffe_compat.cli import main
from caffe_compat.io.glog import parse_line
from caffe_compat.tools.parse_log import parse_log
from tests.conftest import UNWRITABLE_REASONS, fixture_path, unwritable_log

DATA = Path(__file__).parent / "data"
LENET = DATA / "lenet_caffe.log"
START = 59 * 60 + 50.650330  # Solving LeNet, seconds after 23:00

TRAIN = [  # NumIters, Seconds, LearningRate, loss
    (0.0, 50.990040 - 50.650330, 0.01, 2.31418),
    (100.0, 9.349670 + 4.490050, 0.01, 0.214502),
]
TEST = [  # NumIters, Seconds, LearningRate, accuracy, loss
    (0.0, 50.980000 - 50.650330, 0.01, 0.0784, 2.35519),
    (100.0, 9.349670 + 0.300000, 0.01, 0.9621, 0.121137),
    (200.0, 9.349670 + 9.300000, 0.00992565, 0.9623, 0.120871),
]


def _long_dates(text: str) -> str:
    """The same log as newer glog writes it: I<YYYYMMDD> (2025-12-31 then 2026-01-01)."""
    return re.sub(r"^I(\d{2})(\d{2}) ", lambda m: f"I{2025 if m.group(1) == '12' else 2026}{m.group(1)}{m.group(2)} ",
                  text, flags=re.MULTILINE)


def _read_csv(path: Path) -> list[list[str]]:
    with open(path, newline="") as fh:
        return list(csv.reader(fh))


def _check_rows(rows: list[list[str]], header: list[str], expected) -> None:
    assert rows[0] == header
    assert len(rows) == 1 + len(expected)
    for got, want in zip(rows[1:], expected):
        assert [float(v) for v in got] == pytest.approx(want, rel=1e-9, abs=1e-6)


@pytest.mark.parametrize("style", ["MMDD", "YYYYMMDD"])
def test_caffe_log_both_prefixes_give_the_hand_computed_tables(tmp_path, style, capsys):
    log = tmp_path / "lenet.log"
    text = LENET.read_text()
    log.write_text(text if style == "MMDD" else _long_dates(text))
    assert text.count("\nI1231") > 10 and "I2025" not in text  # the fixture really is the MMDD form
    (tmp_path / "out").mkdir()  # as Caffe's script, parse-log writes into an existing folder
    args = ["parse-log", str(log), str(tmp_path / "out"), "--plot", str(tmp_path / "curves.png")]
    assert main(args + (["--year", "2025"] if style == "MMDD" else [])) == 0
    _check_rows(_read_csv(tmp_path / "out" / "lenet.log.train"), ["NumIters", "Seconds", "LearningRate", "loss"],
                TRAIN)
    _check_rows(_read_csv(tmp_path / "out" / "lenet.log.test"),
                ["NumIters", "Seconds", "LearningRate", "accuracy", "loss"], TEST)
    assert "2 train rows (loss), 3 test rows (accuracy, loss)" in capsys.readouterr().out
    image = cv2.imread(str(tmp_path / "curves.png"))
    assert image is not None and image.shape[0] >= 300 and image.shape[1] >= 300
    assert image.std() > 10  # something is drawn


def test_delimiter_and_caffe_file_names(tmp_path):
    assert main(["parse-log", str(LENET), str(tmp_path), "--delimiter", "\t"]) == 0
    lines = (tmp_path / "lenet_caffe.log.test").read_text().splitlines()
    assert lines[0] == "NumIters\tSeconds\tLearningRate\taccuracy\tloss" and lines[3].startswith("200.0\t")


def test_glog_prefixes_are_parsed():
    short = parse_line("I1124 21:48:49.577123 1234 solver.cpp:218] Iteration 100, lr = 0.01")
    long = parse_line("I20261124 21:48:49.577 1234 solver.cpp:218] Iteration 100, lr = 0.01")
    assert (short.year, short.month, short.day, short.message) == (None, 11, 24, "Iteration 100, lr = 0.01")
    assert (long.year, long.month, long.day, long.message) == (2026, 11, 24, "Iteration 100, lr = 0.01")
    assert short.time == pytest.approx(21 * 3600 + 48 * 60 + 49.577123) and long.time == pytest.approx(78529.577)
    assert parse_line("name: \"LeNet\"") is None and parse_line("I1399 00:00:00.0 x] bad month") is None


def _solver_dir(tmp_path: Path, test: bool) -> Path:
    case = fixture_path("solvers/sgd_step_momentum")
    for name in ("net.prototxt", "init.caffemodel"):
        shutil.copy(case / name, tmp_path / name)
    text = (case / "solver.prototxt").read_text()
    if test:
        (tmp_path / "net.prototxt").write_text((case / "net.prototxt").read_text() + (
            'layer { name: "accuracy" type: "Accuracy" bottom: "ip1" bottom: "label" top: "accuracy" '
            'include { phase: TEST } }\n'))
        text += "test_iter: 2\ntest_interval: 2\n"
    (tmp_path / "solver.prototxt").write_text(text)
    return tmp_path


def _our_log(tmp_path: Path, test: bool):
    from caffe_compat.solver import Solver
    from caffe_compat.solver.train import train
    from caffe_compat.io.glog import caffe_log

    folder = _solver_dir(tmp_path, test)
    inputs = np.load(fixture_path("solvers/sgd_step_momentum/inputs.npz"))
    batches = [{"data": inputs["data"][t], "label": inputs["label"][t]} for t in range(5)]
    solver = Solver(folder / "solver.prototxt", weights=folder / "init.caffemodel")
    log = tmp_path / "ours.log"
    with caffe_log(log):
        train(solver, data=batches, iters=5, progress=False, test_data=[batches[3:]] if test else None)
    return log, solver


@pytest.mark.parametrize("target", ["folder", "fifo", "full"])
def test_an_unwritable_caffe_log_is_one_write_error(tmp_path, target, capsys):
    """train --caffe-log that is a folder, a FIFO nobody reads (it blocked for ever) or on a full disk: one
    WriteError naming it (a full disk printed logging's traceback at every record, then an OSError traceback
    at close: exit 1)."""
    import logging

    from caffe_compat.errors import WriteError
    from caffe_compat.io.glog import caffe_log

    path = unwritable_log(tmp_path, target)
    reason = {**UNWRITABLE_REASONS, "full": "the log is incomplete: "}[target]
    with pytest.raises(WriteError, match=rf"^{re.escape(str(path))}: cannot write \({reason}"):
        with caffe_log(path):
            for i in range(3):
                logging.getLogger("caffe_compat.solver").info("Iteration %d, lr = 0.01", i)
    assert "Traceback" not in capsys.readouterr().err


def test_our_train_log_parses_like_the_real_caffe_log_of_the_same_run(tmp_path):
    log, _ = _our_log(tmp_path, test=False)
    ours = parse_log(log)
    caffe = parse_log(fixture_path("solvers/sgd_step_momentum/caffe_log.txt"))
    assert ours.train_columns == caffe.train_columns == ["NumIters", "Seconds", "LearningRate", "loss"]
    assert len(caffe.train) == 5 and not caffe.test and not ours.test
    for a, b in zip(ours.train, caffe.train, strict=True):
        assert (a["NumIters"], a["LearningRate"]) == (b["NumIters"], b["LearningRate"])
        # both logs print the float32 loss to 6 significant digits: ours is Caffe's to 2e-6 relative (this
        # case's trajectory, tests/solver), and each print rounds by up to half a unit of the 6th digit
        unit = 10.0 ** (math.floor(math.log10(abs(b["loss"]))) - 5)
        assert abs(a["loss"] - b["loss"]) <= 2e-6 * abs(b["loss"]) + unit, (a["loss"], b["loss"])
    seconds = [row["Seconds"] for row in ours.train]
    assert seconds == sorted(seconds) and seconds[0] >= 0
    # what Caffe's own parse_log.py/extract_seconds.py need: a 'Solving' line, I<MMDD> <H:M:S.micro> prefixes
    lines = log.read_text().splitlines()
    assert any("] Solving solver_tiny" in line for line in lines)
    for line in lines:
        if "Iteration" in line:
            head, clock = line.split()[:2]
            assert re.fullmatch(r"I\d{4}", head) and re.fullmatch(r"\d\d:\d\d:\d\d\.\d{6}", clock), line
    assert any(re.search(r"\] Iteration 4 \([\d.e+-]+ iter/s, [\d.e+-]+s/1 iters\), loss = 3\.51232$", line)
               for line in lines)


def test_our_train_log_with_a_test_net(tmp_path):
    log, solver = _our_log(tmp_path, test=True)
    (tmp_path / "csv").mkdir()
    assert main(["parse-log", str(log), str(tmp_path / "csv"), "--plot", str(tmp_path / "c.png"), "--x",
                 "seconds"]) == 0
    rows = _read_csv(tmp_path / "csv" / "ours.log.test")
    assert rows[0] == ["NumIters", "Seconds", "LearningRate", "accuracy", "loss"]
    assert [float(r[0]) for r in rows[1:]] == [0.0, 2.0, 4.0]  # test_interval 2 over iterations 0..4
    last = solver.test_scores[0]
    assert float(rows[-1][3]) == pytest.approx(float(last["accuracy"]), rel=1e-5)
    assert float(rows[-1][4]) == pytest.approx(float(last["loss"]), rel=1e-5)
    assert not math.isnan(float(rows[1][2]))
    assert cv2.imread(str(tmp_path / "c.png")) is not None


def test_bad_logs_exit_2_with_one_line(tmp_path, capsys):
    empty = tmp_path / "empty.log"
    empty.write_text("not a log\n")
    assert main(["parse-log", str(empty), str(tmp_path)]) == 2
    assert main(["parse-log", str(tmp_path / "missing.log"), str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "not a Caffe training log" in err[0] and "cannot read" in err[1]


def test_a_log_the_plot_refuses_leaves_no_tables(tmp_path, capsys):
    """--plot on a log with nothing to draw (only multi-element outputs, no finite lr) exits 2 before the
    CSVs are written (they were written, then the command failed)."""
    log = tmp_path / "odd.log"
    log.write_text("I1130 12:00:00.000000  1234 solver.cpp:330] Iteration 7, Testing net (#0)\n"
                   "I1130 12:00:00.000000  1234 solver.cpp:397]     Test net output #0: acc = 0.5\n"
                   "I1130 12:00:00.000000  1234 solver.cpp:397]     Test net output #1: acc = 0.25\n")
    (tmp_path / "csv").mkdir()  # the output folder must exist, as for Caffe's parse_log.py
    assert main(["parse-log", str(log), str(tmp_path / "csv"), "--plot", str(tmp_path / "c.png")]) == 2
    assert "no scalar outputs or learning rates to plot" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["csv", "odd.log"] and not any((tmp_path / "csv").iterdir())

"""test_interval / test_iter / test_initialization through the Solver, as Caffe's ``Solver::Step``/``Solve``.

The TEST nets run at the start of iterations 0, k, 2k, ... (iteration 0 only with ``test_initialization``,
Caffe's default true), each time ``test_iter`` forwards of the TEST-phase net with the weights after
``iter`` updates shared from the TRAIN net; ``Solve`` (and ``train()`` up to ``max_iter``) tests once more
at the end when ``max_iter`` is a multiple of ``test_interval``.  The reported outputs (the returned
scores and the logged ``Test net output`` lines) must equal a hand-made TEST-phase CaffeNet forward with
the same weights, averaged over the ``test_iter`` batches.

The net is the sgd_step_momentum fixture's plus a Dropout (identity only in the TEST phase) and a
TEST-only Accuracy layer, so a TRAIN-phase forward could not give the same outputs.
"""

from __future__ import annotations

import itertools
import logging
import re
import shutil

import numpy as np
import pytest
import torch

from caffe_compat.errors import FormatError
from caffe_compat.net import CaffeNet
from caffe_compat.solver import Solver
from caffe_compat.solver.train import train
from tests.solver.caffe_cases import case_dir, load_case, param_arrays

CASE = "sgd_step_momentum"
TEST_BATCHES = (3, 4)  # the fixture batches the TEST net reads, in this order, test_iter = 2


def _solver_file(tmp_path, interval=2, initialization=None, max_iter=5, test_iter=2) -> str:
    net = (case_dir(CASE) / "net.prototxt").read_text()
    net = net.replace('layer { name: "ip1"',
                      'layer { name: "drop1" type: "Dropout" bottom: "pool1" top: "pool1" '
                      'dropout_param { dropout_ratio: 0.5 } }\nlayer { name: "ip1"', 1)
    net += ('layer { name: "accuracy" type: "Accuracy" bottom: "ip1" bottom: "label" top: "accuracy" '
            'include { phase: TEST } }\n')
    (tmp_path / "net.prototxt").write_text(net)
    shutil.copy(case_dir(CASE) / "init.caffemodel", tmp_path / "init.caffemodel")
    text = (f'net: "net.prototxt"\ntest_iter: {test_iter}\ntest_interval: {interval}\nbase_lr: 0.05\n'
            f'lr_policy: "fixed"\nmomentum: 0.9\nmax_iter: {max_iter}\nrandom_seed: 5\nsolver_mode: CPU\n'
            f'snapshot_after_train: false\n')
    if initialization is not None:
        text += f"test_initialization: {'true' if initialization else 'false'}\n"
    (tmp_path / "solver.prototxt").write_text(text)
    return str(tmp_path / "solver.prototxt")


def _batch(t: int) -> dict:
    inputs, _ = load_case(CASE)
    return {"data": inputs["data"][t % 5], "label": inputs["label"][t % 5]}


class _Counting:
    """An endless iterator over the TEST batches that counts how many were taken."""

    def __init__(self):
        self.taken = 0
        self._cycle = itertools.cycle([_batch(t) for t in TEST_BATCHES])

    def __iter__(self):
        return self

    def __next__(self):
        self.taken += 1
        return next(self._cycle)


def _spy(solver: Solver) -> list[dict]:
    """Record every Solver.test call: the iteration, the weights it ran with, the scores, the batches taken."""
    calls = []
    original = solver.test

    def test(index=0):
        source = solver.test_data_sources[index]
        before = source.taken if isinstance(source, _Counting) else None
        record = {"iter": solver.iter, "weights": param_arrays(solver)}
        record["scores"] = original(index)
        if before is not None:
            record["taken"] = source.taken - before
        calls.append(record)
        return record["scores"]

    solver.test = test
    return calls


def _make(path) -> tuple[Solver, list[dict]]:
    solver = Solver(path, weights=str(case_dir(CASE) / "init.caffemodel"), device="cpu")
    solver.test_data_sources[0] = _Counting()
    return solver, _spy(solver)


def _train_batches():
    return iter([_batch(t) for t in range(100)])


def _manual_test(net_path, weights: dict, test_iter: int = 2) -> dict[str, np.ndarray]:
    """TEST-phase CaffeNet with the given TRAIN-net weights, averaged over the test batches, by hand."""
    net = CaffeNet(str(net_path), phase="test")
    with torch.no_grad():
        for key, value in weights.items():
            _, layer, i = key.split(":")
            net.params[layer][int(i)].copy_(torch.from_numpy(value))
        sums = {}
        for t in itertools.islice(itertools.cycle(TEST_BATCHES), test_iter):
            blobs = net(**{k: torch.from_numpy(np.asarray(v, np.float32)) for k, v in _batch(t).items()})
            for name in ("accuracy", "loss"):
                sums[name] = sums.get(name, 0.0) + blobs[name].numpy().astype(np.float64)
    return {name: (total / test_iter).astype(np.float32) for name, total in sums.items()}


@pytest.mark.parametrize("initialization, expected", [(None, [0, 2, 4]), (True, [0, 2, 4]), (False, [2, 4])],
                         ids=["default", "true", "false"])
def test_step_tests_at_multiples_of_test_interval(tmp_path, initialization, expected):
    solver, calls = _make(_solver_file(tmp_path, initialization=initialization))
    solver.data_source = _train_batches()
    solver.step(5)
    assert [c["iter"] for c in calls] == expected
    assert [c["taken"] for c in calls] == [2] * len(expected)  # test_iter forwards per test
    assert solver.test_data_sources[0].taken == 2 * len(expected)


def test_test_interval_3_and_step_calls_split_anywhere(tmp_path):
    """The schedule follows the iteration counter, not the step() calls."""
    solver, calls = _make(_solver_file(tmp_path, interval=3, max_iter=10))
    solver.data_source = _train_batches()
    for n in (1, 2, 4, 3):
        solver.step(n)
    assert solver.iter == 10 and [c["iter"] for c in calls] == [0, 3, 6, 9]


@pytest.mark.parametrize("interval", [0, -3, None], ids=["zero", "negative", "unset"])
def test_test_nets_without_a_positive_test_interval_are_refused(tmp_path, interval):
    """Caffe's ``InitTestNets``: ``CHECK_GT(test_interval, 0)`` as soon as there is one test net (the field
    defaults to 0), so such a solver never trains; without test nets (no ``test_iter``) 0 is fine."""
    path = _solver_file(tmp_path, interval=0 if interval is None else interval)
    if interval is None:
        text = (tmp_path / "solver.prototxt").read_text().replace("test_interval: 0\n", "")
        (tmp_path / "solver.prototxt").write_text(text)
    with pytest.raises(FormatError, match=r"solver\.prototxt: test_interval must be > 0 with 1 test net"):
        Solver(path)
    text = (tmp_path / "solver.prototxt").read_text().replace("test_iter: 2\n", "")
    (tmp_path / "solver.prototxt").write_text(text)
    solver = Solver(path)
    assert solver.test_nets == []
    solver.data_source = _train_batches()
    solver.step(2)
    assert solver.iter == 2


def test_reported_outputs_equal_a_manual_test_net_forward(tmp_path, caplog):
    path = _solver_file(tmp_path)
    solver, calls = _make(path)
    solver.data_source = _train_batches()
    with caplog.at_level(logging.INFO, logger="caffe_compat.solver"):
        solver.step(5)
    assert [c["iter"] for c in calls] == [0, 2, 4]
    # the weights each test used are the TRAIN net's after `iter` updates: they change between the tests
    assert not np.array_equal(calls[0]["weights"]["param:ip1:0"], calls[1]["weights"]["param:ip1:0"])
    logged = [float(m.group(2)) for m in re.finditer(r"Test net output #\d+: (\w+) = (\S+)", caplog.text)]
    values = []
    for call in calls:
        expected = _manual_test(tmp_path / "net.prototxt", call["weights"])
        assert sorted(call["scores"]) == ["accuracy", "loss"]
        for name, value in expected.items():
            np.testing.assert_array_equal(call["scores"][name], value, err_msg=f"{name} @ {call['iter']}")
            values.append(float(value))
    assert solver.test_scores[0] is calls[-1]["scores"]
    # the log shows the same numbers (6 significant digits, accuracy then loss, in output order)
    assert logged == pytest.approx(values, rel=1e-5)
    assert re.findall(r"Iteration (\d+), Testing net \(#0\)", caplog.text) == ["0", "2", "4"]
    # the TEST net is not the TRAIN net: the TRAIN net has no accuracy output and drops units
    assert "accuracy" not in solver.net.output_names


def test_solve_tests_once_more_at_max_iter(tmp_path):
    solver, calls = _make(_solver_file(tmp_path, max_iter=4))
    solver.data_source = _train_batches()
    solver.solve()
    assert [c["iter"] for c in calls] == [0, 2, 4]
    expected = _manual_test(tmp_path / "net.prototxt", calls[-1]["weights"])
    np.testing.assert_allclose(calls[-1]["scores"]["loss"], expected["loss"], rtol=1e-6)
    assert calls[-1]["weights"]["param:ip1:0"].tolist() == param_arrays(solver)["param:ip1:0"].tolist()


@pytest.mark.parametrize("max_iter, expected", [(4, [0, 2, 4]), (5, [0, 2, 4])])
def test_train_to_max_iter_tests_like_solve(tmp_path, max_iter, expected):
    """``train()`` (``caffe-compat train``) runs to max_iter the way ``Solve`` does, final test included."""
    solver, calls = _make(_solver_file(tmp_path, max_iter=max_iter))
    train(solver, [_batch(t) for t in range(5)], progress=False)
    assert solver.iter == max_iter
    assert [c["iter"] for c in calls] == expected and [c["taken"] for c in calls] == [2] * len(expected)


def test_train_with_test_data_iterables(tmp_path):
    solver = Solver(_solver_file(tmp_path, initialization=False, max_iter=4),
                    weights=str(case_dir(CASE) / "init.caffemodel"), device="cpu")
    calls = _spy(solver)
    train(solver, [_batch(t) for t in range(5)], test_data=[[_batch(t) for t in TEST_BATCHES]], progress=False)
    assert [c["iter"] for c in calls] == [2, 4]
    for call in calls:
        expected = _manual_test(tmp_path / "net.prototxt", call["weights"])
        for name, value in expected.items():
            np.testing.assert_allclose(call["scores"][name], value, rtol=1e-6, err_msg=name)


def _requests(*answers):
    """An ``action_request`` giving ``answers`` in turn, then None; the answers given are counted."""
    queue = list(answers)

    def request():
        return queue.pop(0) if queue else None

    return request


def test_a_stop_asked_for_while_testing_interrupts_the_test_and_the_step(tmp_path, caplog):
    """Caffe's ``Test``: ``GetRequestedAction`` before every test forward, until NONE; a STOP sets
    ``requested_early_exit_``, breaks out (``Test interrupted.``, no scores) and ``Step`` breaks before
    that iteration's training.  Requests: None after updates 1 and 2, then "stop" at the first test
    forward of iteration 2 (test_interval 2, no test at 0): iteration 2 trains no more, no test batch taken."""
    solver, calls = _make(_solver_file(tmp_path, initialization=False))
    solver.data_source = _train_batches()
    solver.action_request = _requests(None, None, "stop")
    with caplog.at_level(logging.INFO, logger="caffe_compat.solver"):
        solver.step(5)
    assert solver.iter == 2 and solver.requested_early_exit
    assert [c["iter"] for c in calls] == [2] and calls[0]["scores"] == {} and calls[0]["taken"] == 0
    assert solver.test_scores == []
    lines = [r.getMessage() for r in caplog.records]
    assert lines.index("Iteration 2, Testing net (#0)") + 1 == lines.index("Test interrupted.")
    assert not any(line.startswith("    Test net output") for line in lines)


def test_a_snapshot_asked_for_while_testing_is_written_at_once(tmp_path):
    """A SNAPSHOT request before a test forward: ``Snapshot()`` there (iteration 2), then the test goes on."""
    path = _solver_file(tmp_path, initialization=False)
    text = (tmp_path / "solver.prototxt").read_text() + f'snapshot_prefix: "{tmp_path / "snap"}"\n'
    (tmp_path / "solver.prototxt").write_text(text)
    solver, calls = _make(path)
    solver.data_source = _train_batches()
    solver.action_request = _requests(None, None, "snapshot")
    solver.step(3)
    assert solver.iter == 3 and (tmp_path / "snap_iter_2.solverstate").is_file()
    assert [c["iter"] for c in calls] == [2] and calls[0]["taken"] == 2

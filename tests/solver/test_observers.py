"""The Solver's observers: the events in Caffe's order, pycaffe's ``add_callback``, ``around_snapshot``
taking over ``snapshot()``, and ``train`` leaving the observer list as it found it."""

from __future__ import annotations

import pytest

from caffe_compat.solver import SolverObserver
from caffe_compat.solver.train import train
from tests.solver.caffe_cases import feed, make_solver

CASE = "sgd_step_momentum"


def test_events_arrive_in_caffes_order(tmp_path):
    solver = make_solver(CASE, snapshot_prefix=str(tmp_path / "snap"))
    solver.param.snapshot = 2
    events = []

    class Watcher:
        def on_start(self, s):
            events.append(("start", s.iter))

        def on_gradients_ready(self, s):
            assert all(p.grad is not None for p in s.optimizer.params)
            events.append(("gradients", s.iter))

        def on_iteration(self, s):
            events.append(("iteration", s.iter))

        def on_snapshot(self, s, model, state):
            events.append(("snapshot", s.iter, model.endswith("_iter_2.caffemodel"),
                           state.endswith("_iter_2.solverstate")))

    solver.observers.append(Watcher())
    for t in range(2):
        feed(solver, CASE, t)
        solver.step(1)
    assert events == [("start", 0), ("gradients", 0), ("iteration", 1),
                      ("start", 1), ("gradients", 1), ("snapshot", 2, True, True), ("iteration", 2)]


def test_add_callback_takes_pycaffes_argumentless_functions():
    solver = make_solver(CASE)
    calls = []
    observer = solver.add_callback(lambda: calls.append("start"), lambda: calls.append("gradients"))
    assert solver.observers == [observer]
    feed(solver, CASE, 0)
    solver.step(2)
    assert calls == ["start", "gradients"] * 2


def test_around_snapshot_takes_over_and_nests_first_outermost(tmp_path):
    solver = make_solver(CASE, snapshot_prefix=str(tmp_path / "snap"))
    order = []

    def outer(s, write):
        order.append("outer")
        return write()

    def skip(s, write):
        order.append("inner")
        return ("not", "written")

    solver.observers += [SolverObserver(around_snapshot=outer), SolverObserver(around_snapshot=skip)]
    assert solver.snapshot() == ("not", "written") and order == ["outer", "inner"]
    assert not list(tmp_path.iterdir())
    solver.observers.pop()
    model, state = solver.snapshot()
    assert (tmp_path / "snap_iter_0.caffemodel").exists() and state.endswith("snap_iter_0.solverstate")


def test_solver_observer_refuses_unknown_events():
    with pytest.raises(TypeError, match="unknown event"):
        SolverObserver(on_finish=print)


def test_train_removes_its_observers(tmp_path):
    solver = make_solver(CASE, snapshot_prefix=str(tmp_path / "snap"))
    mine = SolverObserver(on_iteration=lambda s: None)
    solver.observers.append(mine)
    feed(solver, CASE, 0)
    summary = train(solver, iters=2, progress=False)
    assert solver.observers == [mine] and summary.iterations == 2

"""Observers of a :class:`~caffe_compat.solver.Solver`: the one way to act at defined points of its iterations.

``solver.observers`` is a list of objects; the solver calls each observer's method of an event, in list
order, when the observer has one (every method is optional):

* ``on_start(solver)``: at the start of every iteration, after the TEST nets ran (when due), before the
  forward/backward passes (Caffe's ``Solver::Callback::on_start``);
* ``before_forward(solver, net)`` / ``after_forward(solver, net, blobs)``: around every forward of the TRAIN
  net in ``forward_backward`` (compiled or not; pycaffe's view keeps the last blobs this way);
* ``on_gradients_ready(solver)``: after the backward passes (the diffs of all ``iter_size`` sub-batches
  accumulated) and the display, before Caffe's update (Caffe's ``on_gradients_ready``; e.g.
  :func:`caffe_compat.solver.distributed.average_gradients_hook`);
* ``on_iteration(solver)``: at the end of every iteration, after ``iter`` moved on and the periodic
  snapshot (progress bars, logs);
* ``on_snapshot(solver, caffemodel_path, solverstate_path)``: after a snapshot's two files are written
  (``train`` writes its ``.trainstate`` there); an error propagates like a failed write;
* ``around_snapshot(solver, write)``: takes over :meth:`Solver.snapshot`: ``write()`` writes the two files
  (and notifies ``on_snapshot``) and returns their paths; the method returns what ``snapshot()`` returns
  (``train``'s data-parallel run writes on rank 0 only, and holds a failed write's error until all ranks
  agree).  Several observers with one nest, the first in the list outermost.

:class:`SolverObserver` makes an observer of plain functions; pycaffe's
``solver.add_callback(on_start, on_gradients_ready)`` (functions without arguments) adds one.
"""

from __future__ import annotations

import functools

__all__ = ["EVENTS", "SolverObserver", "around_snapshot", "notify"]

#: The events an observer may have a method for (``around_snapshot`` aside).
EVENTS = ("on_start", "before_forward", "after_forward", "on_gradients_ready", "on_iteration", "on_snapshot")


class SolverObserver:
    """An observer made of functions: ``SolverObserver(on_iteration=lambda solver: ...)``; each keyword is
    one of :data:`EVENTS` or ``around_snapshot``, called with the arguments that event's method gets."""

    def __init__(self, **methods):
        unknown = sorted(set(methods) - set(EVENTS) - {"around_snapshot"})
        if unknown:
            raise TypeError(f"SolverObserver: unknown event(s) {unknown}; events: {', '.join(EVENTS)}, "
                            f"around_snapshot")
        for name, method in methods.items():
            if method is not None:
                setattr(self, name, method)

    def __repr__(self) -> str:
        names = [name for name in (*EVENTS, "around_snapshot") if name in self.__dict__]
        return f"SolverObserver({', '.join(names)})"


def notify(solver, event: str, *args) -> None:
    """Call ``observer.<event>(solver, *args)`` for every observer of ``solver`` that has the method."""
    for observer in solver.observers:
        method = getattr(observer, event, None)
        if method is not None:
            method(solver, *args)


def around_snapshot(solver, write):
    """``write`` wrapped in the ``around_snapshot`` methods of ``solver``'s observers (the first listed
    outermost); call the result to take the snapshot."""
    for observer in reversed(solver.observers):
        method = getattr(observer, "around_snapshot", None)
        if method is not None:
            write = functools.partial(method, solver, write)
    return write

"""Solver builders with the FAPPY authors' settings (``SolverParameter`` messages, no torch here).

Common to the authors' three solver files: SGD, ``momentum 0.9``, ``weight_decay 2e-4``,
``lr_policy "step"`` with ``gamma 0.7``, ``display 1``, ``average_loss 1``, ``debug_info true``, no
testing (``test_iter 0``, ``test_interval`` and ``max_iter`` 987654321, ``test_initialization false``)
and ``solver_mode GPU``.  Per data set:

=============  =========  ========  ========
data set       base_lr    stepsize  snapshot
=============  =========  ========  ========
cub200         1e-5       32000     200
sop            1e-4       160000    250
vehicleid      5e-4       32000     200
=============  =========  ========  ========

The Stanford Online Products and VehicleID files spell the type ``solver_type: SGD`` (deprecated);
ours write ``type: "SGD"``, which is what Caffe (and :func:`caffe_compat.io.read_solver`) upgrades it to.
"""

from __future__ import annotations

from caffe_compat.errors import FormatError
from caffe_compat.proto import caffe_pb2

AUTHORS_COMMON = {
    "test_initialization": False, "display": 1, "average_loss": 1, "test_interval": 987654321,
    "max_iter": 987654321, "type": "SGD", "lr_policy": "step", "gamma": 0.7, "weight_decay": 2e-4,
    "momentum": 0.9, "solver_mode": caffe_pb2.SolverParameter.GPU, "debug_info": True,
}

AUTHORS_PER_DATASET = {
    "cub200": {"base_lr": 1e-5, "stepsize": 32000, "snapshot": 200},
    "sop": {"base_lr": 1e-4, "stepsize": 160000, "snapshot": 250},
    "vehicleid": {"base_lr": 5e-4, "stepsize": 32000, "snapshot": 200},
}

#: The toy digits run: the authors' update rule and step policy, scaled to a CPU run of minutes.
DIGITS_SOLVER = {
    "type": "SGD", "base_lr": 0.01, "lr_policy": "step", "gamma": 0.7, "stepsize": 200, "momentum": 0.9,
    "weight_decay": 2e-4, "max_iter": 1000, "display": 20, "average_loss": 20, "snapshot": 0,
    "test_initialization": False, "solver_mode": caffe_pb2.SolverParameter.CPU, "random_seed": 1,
}


def solver_parameter(net: str, snapshot_prefix: str | None = None, test_iter: list[int] | None = None,
                     **fields) -> caffe_pb2.SolverParameter:
    """A SolverParameter with ``net``, optional ``snapshot_prefix`` / ``test_iter``, and scalar fields."""
    solver = caffe_pb2.SolverParameter(net=net)
    if test_iter is not None:
        solver.test_iter.extend(test_iter)
    for key, value in fields.items():
        if key not in solver.DESCRIPTOR.fields_by_name:
            raise FormatError(f"SolverParameter has no field '{key}'")
        setattr(solver, key, value)
    if snapshot_prefix is not None:
        solver.snapshot_prefix = snapshot_prefix
    return solver


def paper_solver(dataset: str, net: str, snapshot_prefix: str, **overrides) -> caffe_pb2.SolverParameter:
    """The authors' solver for ``dataset`` (cub200, sop, vehicleid), training ``net``."""
    if dataset not in AUTHORS_PER_DATASET:
        raise FormatError(f"no authors' solver for data set '{dataset}' (known: {', '.join(AUTHORS_PER_DATASET)})")
    fields = {**AUTHORS_COMMON, **AUTHORS_PER_DATASET[dataset], **overrides}
    return solver_parameter(net, snapshot_prefix, test_iter=[0], **fields)


def digits_solver(net: str, snapshot_prefix: str, **overrides) -> caffe_pb2.SolverParameter:
    """The toy digits solver (:data:`DIGITS_SOLVER`), training ``net``."""
    return solver_parameter(net, snapshot_prefix, **{**DIGITS_SOLVER, **overrides})

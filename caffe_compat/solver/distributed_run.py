"""The data-parallel side of :func:`~caffe_compat.solver.train.train` (its module docstring says what a
data-parallel run does): whether a call runs distributed and on which device, and :class:`DistributedRun`,
the solver observer that feeds each rank its share of the batches, averages the parameter diffs before
the update, lets rank 0 alone write snapshots and logs, and makes the ranks agree on errors after every
iteration.  The collectives themselves are :mod:`caffe_compat.solver.distributed`'s.
"""

from __future__ import annotations

import logging
import os
import warnings

import torch

from caffe_compat.errors import CaffeCompatError
from caffe_compat.proto import caffe_pb2
from caffe_compat.solver import distributed as ddp
from caffe_compat.solver.observers import SolverObserver
from caffe_compat.solver.recorder import Recorder
from caffe_compat.solver.solver import Solver

__all__ = ["ALONE", "DistributedRun", "RankZeroOnly", "prepare_nets", "rank_device", "wants_distributed"]

log = logging.getLogger("caffe_compat.solver.train")  # train()'s messages, one logger for the whole loop

ALONE = object()  # shard_data of a single-process run (even inside a process group)


class RankZeroOnly(logging.Filter):
    """Drops the INFO/DEBUG records of ranks other than 0 (Caffe's log once, not N times)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING


class DistributedRun:
    """Solver observer of a data-parallel run: shares of the batches, rank-0-only snapshots and logs (the
    ``recorder``'s), and the per-iteration agreement on errors (``on_iteration``, run by every rank at the
    same point).  Besides adding it to ``solver.observers``, :meth:`attach` it before training (the solver's
    data and gradients) and :meth:`detach` it afterwards."""

    def __init__(self, solver: Solver, recorder: Recorder, shard_data: bool | None):
        self.solver = solver
        self.recorder = recorder
        self.shard_data = shard_data
        self.main = ddp.is_main_process()
        self.world = ddp.world_size()
        self.pending: BaseException | None = None
        self.declared = {name: (tuple(shape)[0] if len(shape) else None)
                         for name, shape in solver.net.blob_shapes.items()}
        self.saved_source = None
        self.averaging = None  # the gradient-averaging observer attach() added (None: the solver had one)

    # ---------------------------------------------------------------------------- the solver
    def attach(self) -> None:
        """The solver reads this rank's shares and averages the diffs across ranks before each update
        (unless one of its observers already does, with
        :func:`~caffe_compat.solver.distributed.average_gradients_hook`)."""
        solver = self.solver
        self.saved_source = solver.data_source
        if solver.data_source is not None:
            solver.data_source = self.source(solver.data_source)
        elif solver.inputs:  # Input blobs, or data-layer tops fed by solver.feed(...)
            solver.data_source = self.fed_inputs()
        if not any(getattr(o, "on_gradients_ready", None) is ddp.average_gradients_hook for o in solver.observers):
            # first: every other observer sees the averaged diffs
            self.averaging = SolverObserver(on_gradients_ready=ddp.average_gradients_hook)
            solver.observers.insert(0, self.averaging)

    def detach(self) -> None:
        """Undo :meth:`attach`."""
        solver = self.solver
        if self.averaging is not None:
            solver.observers.remove(self.averaging)
            self.averaging = None
        solver.data_source = self.saved_source

    # ---------------------------------------------------------------------------- data
    def local(self, batch: dict) -> dict:
        if self.shard_data is False:
            return batch
        if self.shard_data is None:
            rows = {name: int(v.shape[0]) for name, v in batch.items() if getattr(v, "shape", None) is not None
                    and len(v.shape)}
            local = [name for name, n in rows.items() if self.declared.get(name) is not None
                     and self.declared[name] != n and self.declared[name] == n * self.world]
            if local and len(local) == len(rows):
                return batch  # already this rank's share (a sampler that splits itself)
        return ddp.shard_batch(batch, "train")

    def source(self, batches):
        for batch in batches:
            yield self.local(batch)

    def fed_inputs(self):
        """``solver.inputs`` (read afresh at every forward, as the solver does), as shares."""
        while True:
            yield self.local(dict(self.solver.inputs))

    # ---------------------------------------------------------------------------- snapshots
    def around_snapshot(self, solver: Solver, write):
        if not self.main:
            return solver.snapshot_filename(".caffemodel"), solver.snapshot_filename(".solverstate")
        try:
            return write()
        except Exception as exc:  # raised on every rank by on_iteration, right after
            self.pending = exc
            return ()

    def on_snapshot(self, solver: Solver, model_path, state_path) -> None:
        self.recorder.on_snapshot(solver, model_path, state_path)

    def agree(self, what: str) -> None:
        """Every rank at the same point: raise everywhere when some rank failed."""
        error, self.pending = self.pending, None
        failed = ddp.any_rank(error is not None, self.solver.device)
        if error is not None:
            raise error
        if failed:
            raise CaffeCompatError(f"rank {ddp.rank()}: stopping {what}: another rank failed (see rank 0's log)")

    def on_iteration(self, solver: Solver) -> None:
        if self.pending is None:
            try:
                self.recorder.on_iteration(solver)
            except Exception as exc:
                self.pending = exc
        self.agree(f"after iteration {solver.iter - 1}")


def prepare_nets(solver: Solver) -> None:
    """The solver's nets for a data-parallel run: rank 0's weights on every rank, the pair layers reading
    gathered bottoms, the data layers keeping this rank's share of the global batch."""
    if solver.device.type == "cuda" and solver.device.index != torch.cuda.current_device():
        # stacklevel: prepare_nets <- the training loop <- train() <- its caller
        warnings.warn(f"rank {ddp.rank()} trains on {solver.device} but its current CUDA device is "
                      f"cuda:{torch.cuda.current_device()}: build the Solver with device='cuda:<LOCAL_RANK>'",
                      stacklevel=4)
    ddp.broadcast_parameters(solver.net)
    ddp.gather_loss_bottoms(solver.net)
    ddp.shard_data_layers(solver.net)
    if any(step.type == "BatchNorm" for step in solver.net.steps):
        log.warning("BatchNorm layers normalise each rank's share with its own statistics (no SyncBatchNorm)")


def wants_distributed(distributed: bool | None) -> bool:
    """Whether :func:`~caffe_compat.solver.train.train` runs data-parallel: ``distributed`` as given, or
    (None) when a process group of several ranks is initialised or torchrun's ``WORLD_SIZE`` > 1."""
    if distributed is False:
        return False
    active = ddp.is_distributed() and ddp.world_size() > 1
    if distributed is None:
        return active or ddp.env_world_size() > 1
    if not active and ddp.env_world_size() <= 1:
        raise CaffeCompatError("train: distributed=True needs torchrun's environment (WORLD_SIZE > 1, RANK, "
                               "MASTER_ADDR, MASTER_PORT) or an initialised torch.distributed process group")
    return True


def rank_device(solver, device):
    """The device of this rank: ``cuda`` (or the solver's GPU mode) means ``cuda:<LOCAL_RANK>``."""
    if device is not None and torch.device(device).type != "cuda":
        return torch.device(device)
    if device is None:
        if isinstance(solver, Solver):
            return solver.device
        param = Solver._read_param(solver)
        if param.solver_mode != caffe_pb2.SolverParameter.GPU or not torch.cuda.is_available():
            return torch.device("cpu")
    device = torch.device(device or "cuda")
    if device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return device


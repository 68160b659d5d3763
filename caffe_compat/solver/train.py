"""The training loop around a :class:`Solver`: devices, mixed precision, logging, data sets.

``train(solver, data=loader, iters=..., device="cuda", amp="bf16", channels_last=True, compile=False,
progress=True, csv_log="train.csv", tensorboard="runs/x", deterministic=True, seed=0)`` runs Caffe's
iterations unchanged (same update rules, lr policy, iter_size, clipping, snapshots) and adds:

* ``data``: an iterable of batches (a DataLoader): dicts ``{blob: tensor}`` or tuples in the order of
  the net's Input tops; restarted when exhausted (epochs).  Without it the solver's own inputs/data
  layers are used.
* ``amp``: ``"bf16"`` or ``"fp16"`` autocast for forward/backward; fp16 adds dynamic loss scaling
  (``torch.amp.GradScaler``; a step whose gradients overflow is skipped, the iteration still counts).
  Parameters, diffs and Caffe's update stay float32.
* ``channels_last``: 4-D parameters and inputs in NHWC memory order (values unchanged).
* ``compile``: the net's forward through ``torch.compile``.
* ``deterministic``: seeds (torch, numpy, random), ``torch.use_deterministic_algorithms``, no cuDNN
  autotuning: two runs with the same seed give the same weights.
* a tqdm bar with loss and lr, a CSV log (``iter, loss, smoothed_loss, lr, clip_scale, seconds``),
  TensorBoard scalars when ``torch.utils.tensorboard`` is importable (else a warning), and a
  :class:`TrainSummary` at the end (also logged).

Iterations run to ``max_iter`` by default; then, as ``Solver::Solve`` does, a snapshot is written when
``snapshot_after_train`` (unless the last iteration just wrote one).

A solver *path* whose train net reads its batches only from ``Input`` layers is refused when no
``data`` is given (nothing could feed them: it would train on zero-filled blobs); a :class:`Solver`
object is trained on whatever its ``inputs`` hold (the pycaffe way).

Data parallel (``torchrun --nproc_per_node N ...``, or ``distributed=True``; default: when
``WORLD_SIZE`` > 1 or a process group is already initialised).  Each rank joins the process group
(gloo on CPU, NCCL with ``cuda:<LOCAL_RANK>`` on CUDA; ``device="cuda"`` or the solver's GPU mode
means the rank's own GPU) and, with the helpers of :mod:`caffe_compat.solver.distributed`:

* every rank starts from rank 0's weights (broadcast) and sees *its share of each global batch*:
  rows ``[r·B/N, (r+1)·B/N)``, so the shares in rank order are the single-process batch, rows in
  order (the split the samplers of :mod:`caffe_compat.data.samplers` make).  ``shard_data``: ``True``
  — the batches of ``data`` (and ``solver.inputs`` when there is no ``data``) are global batches, split
  here; ``False`` — they are already this rank's share (e.g. a sampler built after the process group,
  which splits itself); ``None`` (default) — a batch with the net's declared batch size (its Input
  shape) is global, one with that size / N is a share, any other size is taken as global.  The net's
  own data layers (Data, ImageData, MemoryData, HDF5Data, the LabelShufflingLayer port, ...) produce
  the global batch on every rank (seeded alike) and each rank keeps its share;
* the pair layers (``distributed.PAIR_LAYER_TYPES``: CosineSimilarityBatch, FAPPY, ...) read the
  bottoms gathered from all ranks (differentiable all-gather), so they compute the global batch's loss;
  the parameter diffs are averaged across ranks before Caffe's update, which makes the gradient of the
  global-batch loss (see :mod:`caffe_compat.solver.distributed` for why, and for loss layers that are
  not gathered) and keeps the ranks' weights equal.  BatchNorm statistics stay per rank;
* only rank 0 writes snapshots, the CSV/TensorBoard logs, the progress bar and the solver's INFO log;
  every rank returns the same :class:`TrainSummary`;
* errors stop every rank: the ranks agree on a flag after every iteration (a failed snapshot or log
  write on rank 0 makes all ranks raise at that iteration), and a rank that fails anywhere else
  destroys the process group on its way out, so ranks waiting in a collective fail at once instead
  of waiting for the collective's timeout (under torchrun, the launcher then stops the job).

A process group that ``train`` initialised stays initialised after a successful run (evaluate, train
again); ``torch.distributed.destroy_process_group()`` ends it (``caffe-compat train`` does).
"""

from __future__ import annotations

import csv
import logging
import os
import random
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from caffe_compat.errors import CaffeCompatError, FormatError, TrainingDiverged
from caffe_compat.proto import caffe_pb2
from caffe_compat.solver import distributed as ddp
from caffe_compat.solver.solver import Solver

__all__ = ["TrainSummary", "set_deterministic", "train"]

log = logging.getLogger("caffe_compat.solver.train")

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class TrainSummary:
    iterations: int
    seconds: float
    iters_per_s: float
    first_loss: float
    last_loss: float
    last_smoothed_loss: float
    last_lr: float
    device: str
    amp: str | None
    snapshots: list[str] = field(default_factory=list)
    diverged_at: int | None = None

    def __str__(self) -> str:
        text = (f"{self.iterations} iterations in {self.seconds:.1f} s ({self.iters_per_s:.2f} it/s) on {self.device}"
                f"{' with ' + self.amp if self.amp else ''}; loss {self.first_loss:.6g} -> {self.last_loss:.6g} "
                f"(smoothed {self.last_smoothed_loss:.6g}), lr {self.last_lr:.6g}")
        if self.snapshots:
            text += f"; snapshots: {', '.join(self.snapshots)}"
        if self.diverged_at is not None:
            text += f"; DIVERGED at iteration {self.diverged_at}"
        return text


def set_deterministic(seed: int) -> None:
    """Seed torch/numpy/random and ask PyTorch for deterministic kernels (cuBLAS workspace set too)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


def _batches(data, names: list[str]):
    """Endless dict batches from an iterable (restarted when exhausted)."""
    while True:
        empty = True
        for batch in data:
            empty = False
            if isinstance(batch, dict):
                yield batch
            else:
                batch = list(batch)
                if len(batch) != len(names):
                    raise CaffeCompatError(f"train: a batch of {len(batch)} items for the net inputs {names}; "
                                           f"yield dicts or one item per input")
                yield dict(zip(names, batch))
        if empty:
            raise CaffeCompatError("train: the data source yielded no batch")


class _Recorder:
    """Iteration hook: progress bar, CSV rows, TensorBoard scalars."""

    def __init__(self, total: int, progress: bool, csv_log, tensorboard):
        self.start = time.perf_counter()
        self.first_loss = None
        self.bar = None
        if progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, unit="it", dynamic_ncols=True)
        self.csv_file = self.writer = None
        if csv_log:
            new = not os.path.exists(csv_log) or os.path.getsize(csv_log) == 0
            self.csv_file = open(csv_log, "a", newline="")
            self.csv = csv.writer(self.csv_file)
            if new:
                self.csv.writerow(["iter", "loss", "smoothed_loss", "lr", "clip_scale", "seconds"])
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional
                warnings.warn("tensorboard is not installed: no TensorBoard log is written", stacklevel=3)
            else:
                self.writer = SummaryWriter(tensorboard)

    def __call__(self, solver: Solver) -> None:
        if self.first_loss is None:
            self.first_loss = solver.last_loss
        clip = solver.optimizer.last_clip
        it = solver.iter - 1  # the iteration just finished (Caffe's numbering in its log)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{solver.smoothed_loss:.4g}", lr=f"{solver.last_lr:.3g}")
        if self.csv_file is not None:
            self.csv.writerow([it, f"{solver.last_loss:.9g}", f"{solver.smoothed_loss:.9g}", f"{solver.last_lr:.9g}",
                               "" if clip is None else f"{clip[1]:.9g}", f"{time.perf_counter() - self.start:.3f}"])
            self.csv_file.flush()
        if self.writer is not None:
            self.writer.add_scalar("train/loss", solver.last_loss, it)
            self.writer.add_scalar("train/smoothed_loss", solver.smoothed_loss, it)
            self.writer.add_scalar("train/lr", solver.last_lr, it)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.csv_file is not None:
            self.csv_file.close()
        if self.writer is not None:
            self.writer.close()


class _RankZeroOnly(logging.Filter):
    """Drops the INFO/DEBUG records of ranks other than 0 (Caffe's log once, not N times)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING


class _DistributedRun:
    """The distributed side of :func:`train`: shares of the batches, rank-0-only snapshots and logs, and
    the per-iteration agreement on errors (an iteration hook run by every rank at the same point)."""

    def __init__(self, solver: Solver, recorder: "_Recorder", shard_data: bool | None):
        self.solver = solver
        self.recorder = recorder
        self.shard_data = shard_data
        self.main = ddp.is_main_process()
        self.world = ddp.world_size()
        self.pending: BaseException | None = None
        self.declared = {name: (tuple(shape)[0] if len(shape) else None)
                         for name, shape in solver.net.blob_shapes.items()}

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
    def snapshot_hook(self, original):
        def snapshot():
            if not self.main:
                return self.solver.snapshot_filename(".caffemodel"), self.solver.snapshot_filename(".solverstate")
            try:
                return original()
            except Exception as exc:  # raised on every rank by the iteration hook, right after
                self.pending = exc
                return ()
        return snapshot

    def agree(self, what: str) -> None:
        """Every rank at the same point: raise everywhere when some rank failed."""
        error, self.pending = self.pending, None
        failed = ddp.any_rank(error is not None, self.solver.device)
        if error is not None:
            raise error
        if failed:
            raise CaffeCompatError(f"rank {ddp.rank()}: stopping {what}: another rank failed (see rank 0's log)")

    def __call__(self, solver: Solver) -> None:  # iteration hook
        if self.pending is None:
            try:
                self.recorder(solver)
            except Exception as exc:
                self.pending = exc
        self.agree(f"after iteration {solver.iter - 1}")


_ALONE = object()  # shard_data of a single-process run (even inside a process group)


def _train_net_reads_only_inputs(solver: Solver) -> bool:
    net = solver.net
    return bool(net.input_names) and set(net.feedable_names) == set(net.input_names)


def _wants_distributed(distributed: bool | None) -> bool:
    if distributed is False:
        return False
    active = ddp.is_distributed() and ddp.world_size() > 1
    if distributed is None:
        return active or ddp.env_world_size() > 1
    if not active and ddp.env_world_size() <= 1:
        raise CaffeCompatError("train: distributed=True needs torchrun's environment (WORLD_SIZE > 1, RANK, "
                               "MASTER_ADDR, MASTER_PORT) or an initialised torch.distributed process group")
    return True


def _rank_device(solver, device):
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


def train(solver, data=None, *, iters: int | None = None, weights=None, resume=None, device=None,
          amp: str | None = None, channels_last: bool = False, compile: bool = False, progress: bool = True,
          csv_log=None, tensorboard=None, deterministic: bool = False, seed: int | None = None,
          test_data=None, distributed: bool | None = None, shard_data: bool | None = None) -> TrainSummary:
    """Train ``solver`` (a :class:`Solver` or a solver prototxt path) — see the module docstring.

    ``iters``: iterations to run (default: up to ``max_iter``).  ``weights``/``resume``: a caffemodel to
    start from / a ``.solverstate`` to continue.  ``test_data``: one iterable per TEST net.
    ``distributed``/``shard_data``: data-parallel training (module docstring); ``distributed=False``
    trains alone even under torchrun.
    """
    if amp is not None and amp not in AMP_DTYPES:
        raise FormatError(f"amp must be one of {sorted(AMP_DTYPES)} or None, got {amp!r}")
    if not _wants_distributed(distributed):
        return _train(solver, data, _ALONE, iters=iters, weights=weights, resume=resume, device=device, amp=amp,
                      channels_last=channels_last, compile=compile, progress=progress, csv_log=csv_log,
                      tensorboard=tensorboard, deterministic=deterministic, seed=seed, test_data=test_data)
    device = _rank_device(solver, device)
    ddp.init_distributed(device=device)
    filt = _RankZeroOnly()
    loggers = [logging.getLogger("caffe_compat.solver"), log]
    if not ddp.is_main_process():
        for logger in loggers:
            logger.addFilter(filt)
    try:
        return _train(solver, data, shard_data, iters=iters, weights=weights, resume=resume, device=device,
                      amp=amp, channels_last=channels_last, compile=compile, progress=progress, csv_log=csv_log,
                      tensorboard=tensorboard, deterministic=deterministic, seed=seed, test_data=test_data)
    except BaseException as exc:
        if ddp.is_distributed():
            log.error("rank %d: training stopped: %s: %s", ddp.rank(), type(exc).__name__, exc)
            # Ranks still inside a collective fail at once when this rank's connections close
            # (rather than after the collective's timeout); the group is unusable anyway.
            import torch.distributed as dist

            dist.destroy_process_group()
        raise
    finally:
        for logger in loggers:
            logger.removeFilter(filt)


def _train(solver, data, shard_data, *, iters, weights, resume, device, amp, channels_last, compile, progress,
           csv_log, tensorboard, deterministic, seed, test_data) -> TrainSummary:
    distributed = shard_data is not _ALONE and ddp.is_distributed() and ddp.world_size() > 1
    main = not distributed or ddp.is_main_process()
    if deterministic:
        set_deterministic(0 if seed is None else int(seed))
    elif seed is not None:
        torch.manual_seed(int(seed))
    built_here = not isinstance(solver, Solver)
    if built_here:
        source_name = solver if isinstance(solver, (str, os.PathLike)) else "the solver"
        solver = Solver(solver, weights=weights, device=device)
        if data is None and _train_net_reads_only_inputs(solver):
            names = ", ".join(solver.net.input_names)
            raise CaffeCompatError(
                f"train: the train net of {source_name} ('{solver.net.name}') reads its batches only from Input "
                f"layers ({names}) and no data were given: it would train on zero-filled blobs.  An Input-only "
                f"net needs its data fed through the Python API (caffe_compat.solver.train.train(solver, "
                f"data=loader), or solver.feed(...) / solver.net.blobs[...].data[...] = ... before "
                f"solver.step()); or give the net a data layer (Data, ImageData, HDF5Data, MemoryData, the "
                f"LabelShufflingLayer port)")
    elif weights is not None:
        for path in Solver._weight_list(weights):
            solver.net.load_caffemodel(path)
    if resume is not None:
        solver.restore(resume)
    run = None
    if distributed:
        if solver.device.type == "cuda" and solver.device.index != torch.cuda.current_device():
            warnings.warn(f"rank {ddp.rank()} trains on {solver.device} but its current CUDA device is "
                          f"cuda:{torch.cuda.current_device()}: build the Solver with device='cuda:<LOCAL_RANK>'",
                          stacklevel=3)
        ddp.broadcast_parameters(solver.net)
        ddp.gather_loss_bottoms(solver.net)
        ddp.shard_data_layers(solver.net)
        if any(step.type == "BatchNorm" for step in solver.net.steps):
            log.warning("BatchNorm layers normalise each rank's share with its own statistics (no SyncBatchNorm)")
    if data is not None:
        solver.data_source = _batches(data, solver.net.input_names)
    for i, source in enumerate(test_data or []):
        solver.test_data_sources[i] = _batches(source, solver.test_nets[i].input_names)
    if amp is not None:
        solver.autocast_dtype = AMP_DTYPES[amp]
        if amp == "fp16":
            solver.grad_scaler = torch.amp.GradScaler(solver.device.type)
    if channels_last:
        solver.memory_format = torch.channels_last
        for net in [solver.net] + solver.test_nets:
            net.to(memory_format=torch.channels_last)
    if compile:
        solver.forward_fn = torch.compile(solver.net)
    total = int(solver.param.max_iter) - solver.iter if iters is None else int(iters)
    recorder = _Recorder(max(total, 0), progress and main, csv_log if main else None, tensorboard if main else None)
    hook = recorder
    saved_source, saved_gradient_hook = solver.data_source, solver.gradient_hook
    if distributed:
        run = hook = _DistributedRun(solver, recorder, shard_data)
        if solver.data_source is not None:
            solver.data_source = run.source(solver.data_source)
        elif solver.inputs:  # Input blobs, or data-layer tops fed by solver.feed(...)
            solver.data_source = run.fed_inputs()
        user_hook = None if solver.gradient_hook is ddp.average_gradients_hook else solver.gradient_hook

        def gradient_hook(s):
            ddp.average_gradients_hook(s)
            if user_hook is not None:
                user_hook(s)

        solver.gradient_hook = gradient_hook
        solver.snapshot = run.snapshot_hook(Solver.snapshot.__get__(solver))
    solver.iteration_hooks.append(hook)
    snapshots: list[str] = []
    start_iter, start = solver.iter, time.perf_counter()
    diverged = None
    try:
        solver.step(total)
        p = solver.param
        if iters is None and p.snapshot_after_train and (not p.snapshot or solver.iter % p.snapshot != 0):
            snapshots.extend(solver.snapshot())
        if run is not None:
            run.agree(f"at the end of training (iteration {solver.iter})")
    except TrainingDiverged as exc:
        diverged = solver.iter
        log.error("%s", exc)
        raise
    finally:
        recorder.close()
        solver.iteration_hooks.remove(hook)
        if run is not None:
            del solver.snapshot  # the class's method again
            solver.gradient_hook = saved_gradient_hook
            solver.data_source = saved_source
        seconds = time.perf_counter() - start
        done = solver.iter - start_iter
        summary = TrainSummary(iterations=done, seconds=seconds, iters_per_s=done / seconds if seconds > 0 else 0.0,
                               first_loss=recorder.first_loss if recorder.first_loss is not None else float("nan"),
                               last_loss=solver.last_loss, last_smoothed_loss=solver.smoothed_loss,
                               last_lr=solver.last_lr, device=str(solver.device), amp=amp, snapshots=snapshots,
                               diverged_at=diverged)
        log.info("Training summary: %s", summary)
    return summary

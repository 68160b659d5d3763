"""The training loop around a :class:`Solver`: devices, mixed precision, logging, data sets.

``train(solver, data=loader, iters=..., device="cuda", amp="bf16", channels_last=True, compile=False,
progress=True, csv_log="train.csv", tensorboard="runs/x", deterministic=True, seed=0)`` runs Caffe's
iterations unchanged (same update rules, lr policy, iter_size, clipping, snapshots) and adds:

* ``data``: an iterable of batches (a DataLoader): dicts ``{blob: tensor}`` or tuples in the order of
  the net's Input tops; restarted when exhausted (epochs).  Without it the solver's own inputs/data
  layers are used.
* ``amp``: ``"bf16"`` or ``"fp16"`` autocast for forward/backward; ``"bf16"`` on a CPU without bf16
  matrix units warns once (:class:`~caffe_compat.hardware.Bf16SlowerWarning`: likely slower than float32).
  fp16 adds dynamic loss scaling (``torch.amp.GradScaler``; a step whose gradients overflow is skipped,
  the iteration still counts).
  Parameters, diffs and Caffe's update stay float32.
* ``channels_last``: 4-D parameters and inputs in NHWC memory order; every layer keeps it (pooling, LRN and
  ReLU give NHWC tops and diffs with the bits of the NCHW computation), while the convolutions' NHWC
  kernels sum in another order (the authors' GoogLeNet embeddings: 3.7e-7 relative).
* ``compile``: the net's forward through ``torch.compile``, as one graph (``fullgraph=True``): the data
  layers reading their own files run eagerly ahead of it and feed it their tops
  (:func:`caffe_compat.net.compile_net`; user Python layers, and under torchrun the pair layers'
  cross-rank gathers, run eagerly between graphs, one per run of layers between them: the FAPPY
  fixture net fed by the authors' label-shuffling layer, 2 iterations on the CPU: 28.4 s with the data
  layer inside the graph, 5.5 s ahead of it, compilation included).  Meant for CUDA: on a CPU device it
  warns once (:class:`~caffe_compat.hardware.CompileSlowerWarning`: the compiled step was 2-3x slower).
* ``cuda_graphs``: each iteration's forward and backward, and Caffe's update, recorded as CUDA graphs
  and replayed (:mod:`caffe_compat.solver.step_graphs`: the iteration's thousands of kernel launches at
  once; the eager numbers); where a graph cannot hold the iteration (not CUDA, ``iter_size`` > 1,
  ``clip_gradients``, fp16, Adam, user Python layers, torchrun) it warns and trains eagerly.
* ``deterministic``: seeds (torch, numpy, random), ``torch.use_deterministic_algorithms``, no cuDNN
  autotuning: two runs with the same seed give the same weights.
* a tqdm bar with loss and lr, a CSV log (``iter, loss, smoothed_loss, lr, clip_scale, seconds``),
  TensorBoard scalars when ``torch.utils.tensorboard`` is importable (else a warning), and a
  :class:`TrainSummary` at the end (also logged).

Iterations run to ``max_iter`` by default; then, as ``Solver::Solve`` does, a snapshot is written when
``snapshot_after_train`` (unless the last iteration just wrote one) and the TEST nets run once more when
``max_iter`` is a multiple of ``test_interval``.

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
again); ``distributed.shutdown_distributed()`` ends it (``caffe-compat train`` does: a barrier, then the
group destroyed, so that no rank exits while another still uses the connections).

Resuming (``resume=<prefix>_iter_N.solverstate``, ``caffe-compat train --resume``): Caffe's Restore, then
the ``<prefix>_iter_N.trainstate`` that ``train`` writes beside every snapshot (data streams, RNGs, loss
window, GradScaler), so that in deterministic mode the resumed run gives the **same losses and weights as
the uninterrupted run**; without that file (a Caffe snapshot) the data and RNGs restart with a warning, as
in Caffe.  What is saved, how each kind of ``data`` continues, and the file format:
:mod:`caffe_compat.solver.trainstate`.

The pieces: :mod:`~caffe_compat.solver.feed` (the data iterables), :mod:`~caffe_compat.solver.trainstate`,
:mod:`~caffe_compat.solver.recorder` (bar, CSV, TensorBoard) and :mod:`~caffe_compat.solver.distributed_run`;
the last three act through solver observers (:mod:`caffe_compat.solver.observers`) for the length of the
call, and the solver's observer list is as before once ``train`` returns.
"""

from __future__ import annotations

import logging
import os
import random
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from caffe_compat.errors import CaffeCompatError, CaffeCompatWarning, FormatError, TrainingDiverged
from caffe_compat.hardware import require_cpu_compiler, warn_if_bf16_slow, warn_if_compile_slow
from caffe_compat.net import compile_net
from caffe_compat.solver import distributed as ddp
from caffe_compat.solver.distributed_run import (ALONE, DistributedRun, RankZeroOnly, prepare_nets, rank_device,
                                                 wants_distributed)
from caffe_compat.solver.feed import Feed
from caffe_compat.solver.recorder import Recorder
from caffe_compat.solver.solver import Solver
from caffe_compat.solver.step_graphs import StepGraphs
from caffe_compat.solver.trainstate import TrainStateWriter, load_train_state, train_state_path

__all__ = ["TrainSummary", "load_train_state", "set_deterministic", "train", "train_state_path"]

log = logging.getLogger("caffe_compat.solver.train")

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class TrainSummary:
    """What :func:`train` returns (and logs as ``Training summary: ...``)."""

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
    stopped_early: bool = False  # an action_request stopped it before its last iteration (caffe train's SIGINT)

    def __str__(self) -> str:
        text = (f"{self.iterations} iterations in {self.seconds:.1f} s ({self.iters_per_s:.2f} it/s) on {self.device}"
                f"{' with ' + self.amp if self.amp else ''}; loss {self.first_loss:.6g} -> {self.last_loss:.6g} "
                f"(smoothed {self.last_smoothed_loss:.6g}), lr {self.last_lr:.6g}")
        if self.snapshots:
            text += f"; snapshots: {', '.join(self.snapshots)}"
        if self.diverged_at is not None:
            text += f"; DIVERGED at iteration {self.diverged_at}"
        if self.stopped_early:
            text += "; stopped early"
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


def _train_net_reads_only_inputs(solver: Solver) -> bool:
    net = solver.net
    return bool(net.input_names) and set(net.feedable_names) == set(net.input_names)


def train(solver, data=None, *, iters: int | None = None, weights=None, resume=None, device=None,
          amp: str | None = None, channels_last: bool = False, compile: bool = False, progress: bool = True,
          csv_log=None, tensorboard=None, deterministic: bool = False, seed: int | None = None,
          test_data=None, distributed: bool | None = None, shard_data: bool | None = None,
          strict_weights: bool = False, cuda_graphs: bool = False, action_request=None,
          train_state=None) -> TrainSummary:
    """Train ``solver`` (a :class:`Solver` or a solver prototxt path) — see the module docstring.

    ``iters``: iterations to run (default: up to ``max_iter``).  ``weights``/``resume``: a caffemodel to
    start from / a ``.solverstate`` to continue; with the ``.trainstate`` that ``train`` writes beside each
    snapshot, the continuation repeats the uninterrupted run (data streams, RNGs, loss window); without
    it (a Caffe snapshot) the data streams and RNGs restart with a warning, as Caffe's own resume does
    (module docstring, "Resuming").  ``test_data``: one iterable per TEST net.
    ``distributed``/``shard_data``: data-parallel training (module docstring); ``distributed=False``
    trains alone even under torchrun.  ``strict_weights``: ``weights`` whose layer names do not match the
    TRAIN net raise a FormatError instead of a :class:`~caffe_compat.errors.WeightsMismatchWarning`.
    ``action_request``: Caffe's action function (:attr:`Solver.action_request`, e.g. ``caffe train``'s signal
    effects): ``"snapshot"`` after an iteration writes a snapshot, ``"stop"`` ends the run there with
    ``Solver::Solve``'s snapshot after training (``TrainSummary.stopped_early``).  ``train_state``: a
    ``NetState`` merged into the solver's ``train_state`` before its nets are built (``caffe train``'s
    ``-level``/``-stage``; only when ``solver`` is a file or a SolverParameter).

    As ``caffe train`` does (``solver_param.clear_weights()``), ``weights`` or ``resume`` replace the
    caffemodels of the solver file's own ``weights`` field: those are loaded only when neither is given.
    """
    if amp is not None and amp not in AMP_DTYPES:
        raise FormatError(f"amp must be one of {sorted(AMP_DTYPES)} or None, got {amp!r}")
    if not wants_distributed(distributed):
        return _train(solver, data, ALONE, iters=iters, weights=weights, resume=resume, device=device, amp=amp,
                      channels_last=channels_last, compile=compile, progress=progress, csv_log=csv_log,
                      tensorboard=tensorboard, deterministic=deterministic, seed=seed, test_data=test_data,
                      strict_weights=strict_weights, cuda_graphs=cuda_graphs, action_request=action_request,
                      train_state=train_state)
    device = rank_device(solver, device)
    ddp.init_distributed(device=device)
    filt = RankZeroOnly()
    loggers = [logging.getLogger("caffe_compat.solver"), log]
    if not ddp.is_main_process():
        for logger in loggers:
            logger.addFilter(filt)
    try:
        return _train(solver, data, shard_data, iters=iters, weights=weights, resume=resume, device=device,
                      amp=amp, channels_last=channels_last, compile=compile, progress=progress, csv_log=csv_log,
                      tensorboard=tensorboard, deterministic=deterministic, seed=seed, test_data=test_data,
                      strict_weights=strict_weights, cuda_graphs=cuda_graphs, action_request=action_request,
                      train_state=train_state)
    except BaseException as exc:
        if ddp.is_distributed():
            log.error("rank %d: training stopped: %s: %s", ddp.rank(), type(exc).__name__, exc)
            # Ranks still inside a collective fail at once when this rank's connections close
            # (rather than after the collective's timeout); the group is unusable anyway.
            ddp.shutdown_distributed(barrier=False)
        raise
    finally:
        for logger in loggers:
            logger.removeFilter(filt)


def _train(solver, data, shard_data, *, iters, weights, resume, device, amp, channels_last, compile, progress,
           csv_log, tensorboard, deterministic, seed, test_data, strict_weights=False,
           cuda_graphs=False, action_request=None, train_state=None) -> TrainSummary:
    distributed = shard_data is not ALONE and ddp.is_distributed() and ddp.world_size() > 1
    main = not distributed or ddp.is_main_process()
    if deterministic:
        set_deterministic(0 if seed is None else int(seed))
    elif seed is not None:
        torch.manual_seed(int(seed))
    solver = _solver_with_weights(solver, data, weights, device, strict_weights, train_state,
                                  solver_weights=weights is None and resume is None)
    if resume is not None:
        log.info("Resuming from %s", resume)  # caffe train's line, before its Restore
        solver.restore(resume)
    if distributed:
        prepare_nets(solver)
    feeds = _attach_feeds(solver, data, test_data)
    if amp is not None:
        warn_if_bf16_slow(solver.device.type, amp, stacklevel=4)  # warn_if_bf16_slow <- _train <- train <- caller
    require_cpu_compiler(solver.device.type, compile)
    warn_if_compile_slow(solver.device.type, compile, stacklevel=4)
    _configure(solver, amp, channels_last, compile)
    if resume is not None:
        load_train_state(solver, resume, feeds)
    total = int(solver.param.max_iter) - solver.iter if iters is None else int(iters)
    recorder = Recorder(max(total, 0), progress and main, csv_log if main else None, tensorboard if main else None)
    run = None
    if distributed:
        run = DistributedRun(solver, recorder, shard_data)
        run.attach()
    # the .trainstate after each snapshot's solverstate, then the record (the run records on rank 0 only)
    observers = [TrainStateWriter(feeds), recorder if run is None else run]
    solver.observers.extend(observers)
    if cuda_graphs:
        _record_iterations(solver)
    previous_request = solver.action_request
    if action_request is not None:
        solver.action_request = action_request
    start_iter, start = solver.iter, time.perf_counter()
    diverged = None
    log.info("Starting Optimization")  # caffe train's line, before Solve's "Solving <net>"
    try:
        _solve(solver, total, iters is None, run)
    except TrainingDiverged as exc:
        diverged = solver.iter
        log.error("%s", exc)
        raise
    finally:
        recorder.close()
        solver.action_request = previous_request
        for observer in observers:
            solver.observers.remove(observer)
        if run is not None:
            run.detach()
        seconds = time.perf_counter() - start
        done = solver.iter - start_iter
        summary = TrainSummary(iterations=done, seconds=seconds, iters_per_s=done / seconds if seconds > 0 else 0.0,
                               first_loss=recorder.first_loss if recorder.first_loss is not None else float("nan"),
                               last_loss=solver.last_loss, last_smoothed_loss=solver.smoothed_loss,
                               last_lr=solver.last_lr, device=str(solver.device), amp=amp,
                               snapshots=recorder.snapshots, diverged_at=diverged,
                               stopped_early=solver.requested_early_exit)
        log.info("Training summary: %s", summary)
    return summary


def _solver_with_weights(solver, data, weights, device, strict_weights, train_state=None,
                         solver_weights: bool = True) -> Solver:
    """``solver`` when it is a :class:`Solver` (``weights`` loaded into its TRAIN net), else the Solver it
    names, built with ``weights``, ``train_state`` and ``solver_weights`` (refused when nothing could feed its
    Input-only train net)."""
    if isinstance(solver, Solver):
        if train_state is not None:
            raise CaffeCompatError("train_state applies while the nets are built: give the solver file or "
                                   "SolverParameter, or build the Solver with train_state=")
        if weights is not None:
            paths = Solver._weight_list(weights)
            Solver._copy_weights(solver.net, paths, strict=strict_weights)
            for test_net in solver.test_nets:  # as the Solver's own weights: the TEST nets take them too
                Solver._copy_weights(test_net, paths, quiet=True)
        return solver
    source_name = solver if isinstance(solver, (str, os.PathLike)) else "the solver"
    solver = Solver(solver, weights=weights, device=device, strict_weights=strict_weights, train_state=train_state,
                    solver_weights=solver_weights)
    if data is None and _train_net_reads_only_inputs(solver):
        names = ", ".join(solver.net.input_names)
        raise CaffeCompatError(
            f"train: the train net of {source_name} ('{solver.net.name}') reads its batches only from Input "
            f"layers ({names}) and no data were given: it would train on zero-filled blobs.  An Input-only "
            f"net needs its data fed through the Python API (caffe_compat.solver.train.train(solver, "
            f"data=loader), or solver.feed(...) / solver.inputs[name][...] = ... before "
            f"solver.step()); or give the net a data layer (Data, ImageData, HDF5Data, MemoryData, the "
            f"LabelShufflingLayer port)")
    return solver


def _attach_feeds(solver: Solver, data, test_data) -> dict[str, Feed]:
    """The solver's data sources: ``data`` for the TRAIN net, ``test_data[i]`` for TEST net i, as
    resumable :class:`~caffe_compat.solver.feed.Feed`s (``{"train": ..., "test0": ...}``)."""
    feeds: dict[str, Feed] = {}
    if data is not None:
        solver.data_source = feeds["train"] = Feed(data, solver.net.input_names)
    for i, source in enumerate(test_data or []):
        solver.test_data_sources[i] = feeds[f"test{i}"] = Feed(source, solver.test_nets[i].input_names)
    return feeds


def _configure(solver: Solver, amp, channels_last: bool, compile: bool) -> None:
    """Mixed precision (fp16 with a GradScaler), NHWC memory order, a compiled forward."""
    if amp is not None:
        solver.autocast_dtype = AMP_DTYPES[amp]
        if amp == "fp16":
            solver.grad_scaler = torch.amp.GradScaler(solver.device.type)
    if channels_last:
        solver.memory_format = torch.channels_last
        for net in [solver.net] + solver.test_nets:
            net.to(memory_format=torch.channels_last)
    if compile:
        solver.forward_fn = compile_net(solver.net)  # fullgraph graphs, the data layers ahead of them


def _record_iterations(solver: Solver) -> None:
    """The iterations as CUDA graphs (:mod:`caffe_compat.solver.step_graphs`), or a warning saying why not."""
    graphs = StepGraphs(solver)
    if graphs.active:
        solver.step_graphs = graphs
    else:
        warnings.warn(f"cuda_graphs: {graphs.reason}; the iterations run eagerly", CaffeCompatWarning, stacklevel=4)


def _solve(solver: Solver, total: int, to_max_iter: bool, run: DistributedRun | None) -> None:
    """``total`` iterations; when training ``to_max_iter`` or stopped by ``action_request``, the rest of
    ``Solver::Solve`` (:meth:`Solver.finish_solve`: its snapshot after training, its final display forward
    and test); a data-parallel run's ranks agree at the end."""
    solver.log_solving()
    start_iter = solver.iter
    solver.requested_early_exit = False
    solver.step(total)
    if to_max_iter or solver.requested_early_exit:
        solver.finish_solve(start_iter)
    if run is not None:
        run.agree(f"at the end of training (iteration {solver.iter})")

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
* ``channels_last``: 4-D parameters and inputs in NHWC memory order (values unchanged).
* ``compile``: the net's forward through ``torch.compile``.
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

Resuming (``resume=<prefix>_iter_N.solverstate``, ``caffe-compat train --resume``)
-------------------------------------------------------------------------------
Caffe's ``.solverstate`` holds the iteration, ``current_step`` and the update history; the weights come
from its ``.caffemodel``.  That is all Caffe itself restores: its data layers start their databases from
the first record again and its RNG is reseeded, so a resumed Caffe run does not repeat the uninterrupted
one.  ``train`` writes, beside every snapshot it takes (after the ``.caffemodel`` and the ``.solverstate``,
atomically: temporary file + rename), ``<prefix>_iter_N.trainstate`` with the rest of the continuation,
and ``train(resume=...)`` restores it after Caffe's Restore, so that in deterministic mode (same seed,
same data, same devices) the resumed run gives the **same losses and weights as the uninterrupted run**:

* the global RNGs: torch CPU (and CUDA, when initialised), ``numpy.random`` and ``random`` — Dropout
  masks, miners, user transforms draw from them;
* every layer of the TRAIN and TEST nets that has ``stream_state()``/``load_stream_state()`` (Data,
  ImageData, HDF5Data, MemoryData's cursor, DummyData, the LabelShufflingLayer port: cursor, RandomState,
  shuffled order) and the state of each layer's own ``generator`` (a ``torch.Generator``, e.g. Dropout's);
* for ``data`` (and each ``test_data``) iterable: how many batches of the current pass were taken, the
  global RNG states just before the pass's ``iter()`` (a DataLoader draws its seeds there), and — when
  the iterable, or its ``batch_sampler``/``sampler``, has ``state_dict()``/``load_state_dict()`` (the
  samplers of :mod:`caffe_compat.data.samplers`, torchdata's StatefulDataLoader) — that state.  On
  resume a sampler whose state has an ``epoch``/``batch`` position continues at the next batch directly;
  another stateful iterable gets its ``load_state_dict``; a plain iterable (a list, a DataLoader over a
  fixed sampler) is replayed from the start of the pass, the taken batches dropped.  Pass the same
  (deterministic) ``data`` as the interrupted run; with DataLoader workers, per-worker random transforms
  are exact only with ``num_workers=0`` (the batches go to other workers after a resume);
* the average_loss window (the CSV's ``smoothed_loss`` continues as in the uninterrupted run, where
  Caffe's own resume starts a new window) and the fp16 GradScaler's state.

File format: UTF-8 JSON, ``{"format": "caffe-compat trainstate", "version": 1, "iter": N, "rng": ...,
"nets": {"train": {layer: state}, "test0": ...}, "data": {"train": ..., "test0": ...}, "loss_window": ...,
"grad_scaler": ...}``; arrays (RNG states, orders) are ``{"__ndarray__": base64, "dtype", "shape"}``
(``__tensor__`` for torch tensors), tuples ``{"__tuple__": [...]}`` — no pickle, nothing executed on
load.  Resuming from a ``.solverstate`` without its ``.trainstate`` (a real Caffe snapshot, or one taken
by ``Solver.snapshot()`` outside ``train``) restores what Caffe restores and logs a warning that the data
stream and the RNGs restart; a ``.trainstate`` of another iteration is ignored with a warning.  Under
torchrun rank 0 writes the file and every rank reads it (the ranks' data layers are seeded alike; their
RNG streams are rank 0's after the resume).
"""

from __future__ import annotations

import base64
import csv
import json
import logging
import os
import random
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from caffe_compat.errors import CaffeCompatError, FormatError, TrainingDiverged
from caffe_compat.hardware import warn_if_bf16_slow
from caffe_compat.io.atomic import write_text_atomic
from caffe_compat.proto import caffe_pb2
from caffe_compat.solver import distributed as ddp
from caffe_compat.solver.solver import Solver

__all__ = ["TrainSummary", "load_train_state", "set_deterministic", "train", "train_state_path"]

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


# -------------------------------------------------------------------------------------------- resumable state
#
# The .trainstate file (module docstring): JSON with tagged arrays, tensors, tuples and bytes.

TRAINSTATE_FORMAT = "caffe-compat trainstate"
TRAINSTATE_VERSION = 1


def _encode(obj):
    """``obj`` as JSON values: dicts, lists, numbers, strings; arrays/tensors/tuples/bytes tagged."""
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _encode(v) for k, v in obj.items()}
        return {"__items__": [[_encode(k), _encode(v)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v) for v in obj]}
    if isinstance(obj, list):
        return [_encode(v) for v in obj]
    if torch.is_tensor(obj):
        array = obj.detach().cpu().numpy()
        return {"__tensor__": base64.b64encode(np.ascontiguousarray(array).tobytes()).decode("ascii"),
                "dtype": array.dtype.str, "shape": list(array.shape)}
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise CaffeCompatError("train state: object arrays cannot be saved")
        return {"__ndarray__": base64.b64encode(np.ascontiguousarray(obj).tobytes()).decode("ascii"),
                "dtype": obj.dtype.str, "shape": list(obj.shape)}
    if isinstance(obj, (bytes, bytearray)):
        return {"__bytes__": base64.b64encode(bytes(obj)).decode("ascii")}
    if isinstance(obj, np.generic):
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise CaffeCompatError(f"train state: cannot save a {type(obj).__name__} (state_dict() values must be "
                           f"numbers, strings, lists, dicts, tuples, arrays or tensors)")


def _decode(obj):
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__items__" in obj:
        return {_decode(k): _decode(v) for k, v in obj["__items__"]}
    if "__tuple__" in obj:
        return tuple(_decode(v) for v in obj["__tuple__"])
    if "__bytes__" in obj:
        return base64.b64decode(obj["__bytes__"])
    for tag in ("__ndarray__", "__tensor__"):
        if tag in obj:
            dtype = np.dtype(obj["dtype"])
            if dtype.hasobject:
                raise FormatError("train state: object arrays are not read")
            array = np.frombuffer(base64.b64decode(obj[tag]), dtype=dtype).reshape(obj["shape"]).copy()
            return torch.from_numpy(array) if tag == "__tensor__" else array
    return {k: _decode(v) for k, v in obj.items()}


def train_state_path(solverstate) -> str:
    """``<prefix>_iter_N.trainstate`` beside ``<prefix>_iter_N.solverstate``."""
    stem, ext = os.path.splitext(str(solverstate))
    return (stem if ext == ".solverstate" else str(solverstate)) + ".trainstate"


def _rng_states() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(legacy=False),
             "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_states(state: dict) -> None:
    torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8))
    np.random.set_state(state["numpy"])
    python = state["python"]
    random.setstate((python[0], tuple(int(v) for v in python[1]), python[2]))
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([torch.as_tensor(c, dtype=torch.uint8) for c in cuda])
        else:
            log.warning("the train state holds %d CUDA RNG states, this machine has %d devices: CUDA RNGs not "
                        "restored", len(cuda), torch.cuda.device_count())


def _stateful(obj):
    return obj is not None and not isinstance(obj, torch.nn.Module) and callable(getattr(obj, "state_dict", None)) \
        and callable(getattr(obj, "load_state_dict", None))


class _Feed:
    """Endless dict batches from an iterable (restarted when exhausted), resumable (module docstring)."""

    def __init__(self, data, names: list[str]):
        self.data, self.names = data, list(names)
        if _stateful(data):
            self.kind, self.stateful = "data", data
        else:
            self.kind, self.stateful = None, None
            for attr in ("batch_sampler", "sampler"):
                candidate = getattr(data, attr, None)
                if _stateful(candidate):
                    self.kind, self.stateful = "sampler", candidate
                    break
        self.iterator = None
        self.consumed = 0  # batches taken from the current pass
        self.from_iterator = 0  # batches the current iterator gave (an empty fresh pass is an error)
        self.pass_state = None  # the sampler's state_dict() just before the pass's iter()
        self.pass_rng = None  # the global RNG states just before the pass's iter()

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        while True:
            if self.iterator is None:
                self.pass_state = self.stateful.state_dict() if self.kind == "sampler" else None
                self.pass_rng = _rng_states()
                self.consumed = self.from_iterator = 0
                self.iterator = iter(self.data)
            try:
                batch = next(self.iterator)
            except StopIteration:
                if self.from_iterator == 0 and self.consumed == 0:
                    raise CaffeCompatError("train: the data source yielded no batch") from None
                self.iterator = None
                continue
            self.consumed += 1
            self.from_iterator += 1
            return self._as_dict(batch)

    def _as_dict(self, batch) -> dict:
        if isinstance(batch, dict):
            return batch
        batch = list(batch)
        if len(batch) != len(self.names):
            raise CaffeCompatError(f"train: a batch of {len(batch)} items for the net inputs {self.names}; "
                                   f"yield dicts or one item per input")
        return dict(zip(self.names, batch))

    def state_dict(self) -> dict:
        state = {"kind": self.kind, "consumed": self.consumed, "pass_state": _savable(self.pass_state),
                 "pass_rng": self.pass_rng, "started": self.iterator is not None}
        if self.kind == "data":
            state["data_state"] = _savable(self.data.state_dict())
        return state

    def load_state_dict(self, state: dict, what: str) -> None:
        """Continue where the saved feed was; moves the global RNGs (the caller restores them afterwards)."""
        if not state.get("started"):
            return  # nothing was drawn yet: the first next() starts a pass, as in the uninterrupted run
        consumed, skip = int(state["consumed"]), 0
        pass_state = state.get("pass_state")
        if self.kind == "data" and state.get("data_state") is not None:
            self.data.load_state_dict(state["data_state"])
        elif self.kind == "sampler" and isinstance(pass_state, dict):
            position = dict(pass_state)
            if "batch" in position:  # a GlobalBatchSampler: go straight to the next batch
                position["batch"] = int(position["batch"]) + consumed
            else:
                skip = consumed
            self.stateful.load_state_dict(position)
        else:
            if state.get("kind") not in (None, self.kind):
                log.warning("resume: %s data was a %s source, now it has no state_dict(): replaying %d batches "
                            "of its current pass", what, state.get("kind"), consumed)
            skip = consumed
        if skip:
            log.info("resume: replaying %d batches of the %s data's current pass", skip, what)
        if state.get("pass_rng") is not None:
            _set_rng_states(state["pass_rng"])
        self.iterator = iter(self.data)
        self.from_iterator = 0
        for i in range(skip):
            try:
                next(self.iterator)
            except StopIteration:
                log.warning("resume: the %s data's pass ended after %d of the %d batches taken before the "
                            "snapshot: it is not the data of the interrupted run; starting a new pass", what, i,
                            skip)
                self.iterator = None
                return
        self.consumed, self.pass_state, self.pass_rng = consumed, pass_state, state.get("pass_rng")


def _savable(state):
    """``state`` when the .trainstate can hold it, else None with a warning (a resume then replays the pass)."""
    try:
        _encode(state)
    except CaffeCompatError as exc:
        log.warning("the data's state_dict() cannot be saved (%s): a resume will replay the current pass", exc)
        return None
    return state


def _batches(data, names: list[str]) -> _Feed:
    """Endless dict batches from an iterable (restarted when exhausted)."""
    return _Feed(data, names)


def _unwrap(module):
    while "inner" in getattr(module, "_modules", {}):  # distributed.ShardTops
        module = module._modules["inner"]
    return module


def _net_states(net) -> dict:
    states = {}
    for key, module in net.layers.items():
        module, entry = _unwrap(module), {}
        if callable(getattr(module, "stream_state", None)):
            entry["stream"] = module.stream_state()
        generator = getattr(module, "generator", None)
        if isinstance(generator, torch.Generator):
            entry["generator"] = generator.get_state()
        if entry:
            states[key] = entry
    return states


def _load_net_states(net, states: dict, what: str) -> None:
    for key, entry in states.items():
        if key not in net.layers:
            log.warning("resume: the train state has layer '%s' of the %s net, which this net lacks", key, what)
            continue
        module = _unwrap(net.layers[key])
        if "stream" in entry:
            if not callable(getattr(module, "load_stream_state", None)):
                log.warning("resume: layer '%s' of the %s net cannot take its saved data state", key, what)
            else:
                module.load_stream_state(entry["stream"])
        generator = getattr(module, "generator", None)
        if "generator" in entry and isinstance(generator, torch.Generator):
            generator.set_state(torch.as_tensor(entry["generator"], dtype=torch.uint8))


def _train_state(solver: Solver, feeds: dict) -> dict:
    losses, smoothed, start = solver.loss_window()
    return {"format": TRAINSTATE_FORMAT, "version": TRAINSTATE_VERSION, "iter": int(solver.iter),
            "rng": _rng_states(),
            "nets": {"train": _net_states(solver.net),
                     **{f"test{i}": _net_states(net) for i, net in enumerate(solver.test_nets)}},
            "data": {name: feed.state_dict() for name, feed in feeds.items()},
            "loss_window": {"losses": losses, "smoothed_loss": smoothed, "start": start},
            "grad_scaler": solver.grad_scaler.state_dict() if solver.grad_scaler is not None else None}


def _write_train_state(solver: Solver, feeds: dict, state_path) -> str:
    path = train_state_path(state_path)
    log.info("Snapshotting the data streams and RNG states to %s", path)
    write_text_atomic(path, json.dumps(_encode(_train_state(solver, feeds)), separators=(",", ":")))
    return path


def load_train_state(solver: Solver, resume, feeds: dict | None = None) -> bool:
    """Restore the ``.trainstate`` beside the solverstate ``resume`` into ``solver`` (after
    ``solver.restore(resume)``) and the ``feeds`` (``{"train": _Feed, "test0": ...}``).  Returns False (with
    a warning) when there is none or it belongs to another iteration: the data and RNGs then restart."""
    feeds = feeds or {}
    path = train_state_path(resume)
    if not os.path.exists(path):
        log.warning("resume: %s has no %s beside it (a Caffe snapshot?): only Caffe's state is restored — the "
                    "data stream starts again from its beginning and the RNGs are not restored (as in Caffe), so "
                    "the run will not repeat an uninterrupted one", resume, os.path.basename(path))
        return False
    try:
        with open(path, encoding="utf-8") as fh:
            state = _decode(json.load(fh))
    except (OSError, ValueError) as exc:
        raise FormatError(f"{path}: not a readable train state ({exc})") from None
    if not isinstance(state, dict) or state.get("format") != TRAINSTATE_FORMAT:
        raise FormatError(f"{path}: not a caffe-compat train state")
    if int(state.get("version", 0)) > TRAINSTATE_VERSION:
        raise FormatError(f"{path}: train state version {state.get('version')} is newer than this caffe-compat's "
                          f"({TRAINSTATE_VERSION})")
    if int(state["iter"]) != solver.iter:
        log.warning("resume: %s is of iteration %s, the solverstate of iteration %d: ignored (the data stream and "
                    "RNGs restart)", path, state["iter"], solver.iter)
        return False
    nets = state.get("nets", {})
    _load_net_states(solver.net, nets.get("train", {}), "train")
    for i, net in enumerate(solver.test_nets):
        _load_net_states(net, nets.get(f"test{i}", {}), f"test #{i}")
    window = state.get("loss_window")
    if window is not None:
        solver.resumed_loss_window = ([float(v) for v in window["losses"]], float(window["smoothed_loss"]),
                                      int(window["start"]))
    if state.get("grad_scaler") is not None and solver.grad_scaler is not None:
        solver.grad_scaler.load_state_dict(state["grad_scaler"])
    saved = state.get("data", {})
    for name, feed in feeds.items():
        if name in saved:
            feed.load_state_dict(saved[name], name)
        else:
            log.warning("resume: the snapshotted run had no %s data iterable: this one starts from its beginning",
                        name)
    for name in saved:
        if name not in feeds and saved[name].get("started"):
            log.warning("resume: the snapshotted run read %s data from an iterable that is not given now", name)
    _set_rng_states(state["rng"])  # last: restarting the iterables above drew from them
    log.info("resume: data streams and RNG states restored from %s", path)
    return True


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
          test_data=None, distributed: bool | None = None, shard_data: bool | None = None,
          strict_weights: bool = False) -> TrainSummary:
    """Train ``solver`` (a :class:`Solver` or a solver prototxt path) — see the module docstring.

    ``iters``: iterations to run (default: up to ``max_iter``).  ``weights``/``resume``: a caffemodel to
    start from / a ``.solverstate`` to continue; with the ``.trainstate`` that ``train`` writes beside each
    snapshot, the continuation repeats the uninterrupted run (data streams, RNGs, loss window); without
    it (a Caffe snapshot) the data streams and RNGs restart with a warning, as Caffe's own resume does
    (module docstring, "Resuming").  ``test_data``: one iterable per TEST net.
    ``distributed``/``shard_data``: data-parallel training (module docstring); ``distributed=False``
    trains alone even under torchrun.  ``strict_weights``: ``weights`` whose layer names do not match the
    TRAIN net raise a FormatError instead of a :class:`~caffe_compat.errors.WeightsMismatchWarning`.
    """
    if amp is not None and amp not in AMP_DTYPES:
        raise FormatError(f"amp must be one of {sorted(AMP_DTYPES)} or None, got {amp!r}")
    if not _wants_distributed(distributed):
        return _train(solver, data, _ALONE, iters=iters, weights=weights, resume=resume, device=device, amp=amp,
                      channels_last=channels_last, compile=compile, progress=progress, csv_log=csv_log,
                      tensorboard=tensorboard, deterministic=deterministic, seed=seed, test_data=test_data,
                      strict_weights=strict_weights)
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
                      tensorboard=tensorboard, deterministic=deterministic, seed=seed, test_data=test_data,
                      strict_weights=strict_weights)
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
           csv_log, tensorboard, deterministic, seed, test_data, strict_weights=False) -> TrainSummary:
    distributed = shard_data is not _ALONE and ddp.is_distributed() and ddp.world_size() > 1
    main = not distributed or ddp.is_main_process()
    if deterministic:
        set_deterministic(0 if seed is None else int(seed))
    elif seed is not None:
        torch.manual_seed(int(seed))
    built_here = not isinstance(solver, Solver)
    if built_here:
        source_name = solver if isinstance(solver, (str, os.PathLike)) else "the solver"
        solver = Solver(solver, weights=weights, device=device, strict_weights=strict_weights)
        if data is None and _train_net_reads_only_inputs(solver):
            names = ", ".join(solver.net.input_names)
            raise CaffeCompatError(
                f"train: the train net of {source_name} ('{solver.net.name}') reads its batches only from Input "
                f"layers ({names}) and no data were given: it would train on zero-filled blobs.  An Input-only "
                f"net needs its data fed through the Python API (caffe_compat.solver.train.train(solver, "
                f"data=loader), or solver.feed(...) / solver.inputs[name][...] = ... before "
                f"solver.step()); or give the net a data layer (Data, ImageData, HDF5Data, MemoryData, the "
                f"LabelShufflingLayer port)")
    elif weights is not None:
        solver.net.load_caffemodels(Solver._weight_list(weights), strict=strict_weights)
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
    feeds: dict[str, _Feed] = {}
    if data is not None:
        solver.data_source = feeds["train"] = _batches(data, solver.net.input_names)
    for i, source in enumerate(test_data or []):
        solver.test_data_sources[i] = feeds[f"test{i}"] = _batches(source, solver.test_nets[i].input_names)
    if amp is not None:
        warn_if_bf16_slow(solver.device.type, amp, stacklevel=4)  # warn_if_bf16_slow <- _train <- train <- caller
        solver.autocast_dtype = AMP_DTYPES[amp]
        if amp == "fp16":
            solver.grad_scaler = torch.amp.GradScaler(solver.device.type)
    if channels_last:
        solver.memory_format = torch.channels_last
        for net in [solver.net] + solver.test_nets:
            net.to(memory_format=torch.channels_last)
    if compile:
        solver.forward_fn = torch.compile(solver.net)
    if resume is not None:
        load_train_state(solver, resume, feeds)

    def write_train_state(s, model_path, state_path):  # a snapshot hook: the .trainstate after the solverstate
        _write_train_state(s, feeds, state_path)

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
    snapshots: list[str] = []  # every snapshot this call writes, periodic ones included

    def record_snapshot(_solver, model_path, state_path):
        snapshots.extend(str(p) for p in (model_path, state_path) if p)

    solver.snapshot_hooks.extend([write_train_state, record_snapshot])
    start_iter, start = solver.iter, time.perf_counter()
    diverged = None
    try:
        solver.log_solving()
        solver.step(total)
        p = solver.param
        if iters is None and p.snapshot_after_train and (not p.snapshot or solver.iter % p.snapshot != 0):
            solver.snapshot()
        if iters is None and p.test_interval and solver.iter % p.test_interval == 0:
            solver.test_all()  # Solver::Solve's final TestAll at max_iter (step() tests only at iteration starts)
        if run is not None:
            run.agree(f"at the end of training (iteration {solver.iter})")
    except TrainingDiverged as exc:
        diverged = solver.iter
        log.error("%s", exc)
        raise
    finally:
        recorder.close()
        solver.iteration_hooks.remove(hook)
        solver.snapshot_hooks.remove(write_train_state)
        solver.snapshot_hooks.remove(record_snapshot)
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

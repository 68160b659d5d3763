"""Training one (data set, loss, seed) run from our prototxt with Caffe's solver, fed by the native
data set readers, Caffe's DataTransformer and the authors' label-shuffling sampler.

The train net's data layer (the authors' Python LabelShufflingLayer or an LMDB Data layer) is replaced
by two ``Input`` layers, ``data`` (B×3×crop×crop) and ``label`` (B), fed batch by batch: the sampler
and transformer reproduce what those layers did, from the images in their native layout.

Where the nets are: :func:`prototxt_root` -- the package's own copy (``caffe_compat/reproduce/prototxt``,
package data of the wheel; in a checkout a link to the top-level ``prototxt/``), else the checkout's
``prototxt/``.

A run is resumable, and only into the run it was: every run directory holds ``settings.json``, the
settings that decide its result (:func:`run_settings`: data set, loss, seed, max_iter, the sha256 of the
initial weights, delta_min, batch size, per-label count, preprocessing, the sha256 of the nets and of
the training list, and what the caller adds, e.g. the data root; never the device, the worker count or
the snapshot interval).  :func:`check_run_dir` refuses (:class:`RunSettingsMismatch`, a CaffeCompatError)
a directory trained with other settings, or holding a run with no settings record; the remedy is a new
run directory or discarding it (:func:`clear_run_dir`, ``reproduce --fresh``).  With matching settings a
restarted run restores its latest snapshot (never one past ``max_iter``) with its ``.trainstate`` (the RNGs
and the batch position, :class:`TrainingBatches`: nothing is decoded again), drops the log rows after it
and ends on the weights of the uninterrupted run.  ``progress.json`` keeps the wall time of every training
segment (also of an interrupted one, unless the process was killed outright), so the reported training
time is the total, and whether the run was resumed.
"""

from __future__ import annotations

import csv
import hashlib
import json
import time
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from caffe_compat.errors import CaffeCompatError
from caffe_compat.io import read_net, read_solver
from caffe_compat.io.atomic import write_text_atomic
from caffe_compat.io.safe_open import check_regular_file, memory_budget, read_regular_text, require_regular_file
from caffe_compat.proto import caffe_pb2

_RECORD_MAX_BYTES = 16 << 20  # the settings and progress records are a few KB of JSON

#: The top-level prototxt/ of a source checkout (absent from an installed package).
CHECKOUT_PROTOTXT = Path(__file__).resolve().parents[2] / "prototxt"
SETTINGS_FILE, PROGRESS_FILE, SETTINGS_FORMAT = "settings.json", "progress.json", 1
#: What a run directory may hold (all written by the pipeline; snapshots: .caffemodel, .solverstate and the
#: training loop's side files); clear_run_dir removes exactly these.
RUN_FILES = ("snapshot_iter_*", "train_log.csv", "embedder.onnx", "metrics.json", SETTINGS_FILE, PROGRESS_FILE)


class RunSettingsMismatch(CaffeCompatError):
    """A run directory holds a run made with other settings (or with no record of them)."""


def packaged_prototxt_root() -> Path | None:
    """``caffe_compat/reproduce/prototxt`` as installed (package data), or None when it is missing."""
    from importlib import resources

    try:
        root = resources.files("caffe_compat").joinpath("reproduce", "prototxt")
    except (ModuleNotFoundError, TypeError):
        return None
    root = Path(str(root))
    return root if (root / "digits" / "deploy.prototxt").is_file() else None


def prototxt_root(strict: bool = True) -> Path:
    """The folder holding our ``<data set>/{train_<loss>,solver,deploy}.prototxt`` (module docstring)."""
    packaged = packaged_prototxt_root()
    if packaged is not None:
        return packaged
    if (CHECKOUT_PROTOTXT / "digits" / "deploy.prototxt").is_file() or not strict:
        return CHECKOUT_PROTOTXT
    raise CaffeCompatError(f"the paper's nets are missing: neither the package data caffe_compat/reproduce/prototxt "
                           f"nor {CHECKOUT_PROTOTXT} holds them; reinstall caffe-compat")


#: Backward-compatible name: where the nets are found (see :func:`prototxt_root`).
REPO_PROTOTXT = prototxt_root(strict=False)


@lru_cache(maxsize=32)
def _sha256_cached(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    check_regular_file(path, "a reproduced run's file")  # a FIFO would block, /dev/zero never end
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_sha256(path) -> str:
    path = require_regular_file(Path(path), "a reproduced run's file")  # a FIFO is named as such, not as missing
    stat = path.stat()
    return _sha256_cached(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


def records_sha256(records) -> str:
    """Identity of a training list independent of where the data set lies: folder/file name and label."""
    digest = hashlib.sha256()
    for r in records:
        path = Path(r.path)
        digest.update(f"{path.parent.name}/{path.name}\t{int(r.label)}\n".encode())
    return digest.hexdigest()


def run_settings(setup, loss: str, seed: int, max_iter: int, weights=None, delta_min=None, records=None,
                 extra: dict | None = None) -> dict:
    """Every setting that decides a run's result (see the module docstring), as a JSON-able dict."""
    root = prototxt_root() / setup.prototxt_dir
    settings = {
        "format": SETTINGS_FORMAT, "dataset": setup.name, "loss": loss, "seed": int(seed), "max_iter": int(max_iter),
        "weights_sha256": None if weights is None else file_sha256(weights),
        "delta_min": None if delta_min is None else float(delta_min),
        "batch_size": int(setup.batch_size), "per_label": int(setup.per_label), "resize": int(setup.resize),
        "crop": int(setup.crop), "mean_value": [float(v) for v in setup.mean_value], "scale": float(setup.scale),
        "mirror": bool(setup.mirror), "embedding_blob": setup.embedding_blob,
        "nets_sha256": {name: file_sha256(root / name) if (root / name).is_file() else None
                        for name in (f"train_{loss}.prototxt", "solver.prototxt", "deploy.prototxt")},
        "train_records_sha256": None if records is None else records_sha256(records),
    }
    settings.update(extra or {})
    return settings


def _has_run(run_dir: Path) -> bool:
    return any(next(iter(run_dir.glob(pattern)), None) is not None for pattern in RUN_FILES)


def read_settings(run_dir: Path) -> dict | None:
    path = Path(run_dir) / SETTINGS_FILE
    if not path.exists():
        return None
    try:
        return json.loads(read_regular_text(path, "the run's settings record", _RECORD_MAX_BYTES))["settings"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RunSettingsMismatch(f"{path}: unreadable settings record ({exc}); pass a new --out, or --fresh to "
                                  f"discard this run and retrain it") from None


def _short(value) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 24 else text[:20] + "..."


def check_run_dir(run_dir, settings: dict) -> bool:
    """True when ``run_dir`` holds a run with exactly ``settings`` (reusable / resumable), False when it
    holds none; :class:`RunSettingsMismatch` when it holds another one."""
    run_dir = Path(run_dir)
    stored = read_settings(run_dir)
    remedy = "pass a new --out for these settings, or --fresh to discard the old run and retrain it"
    if stored is None:
        if run_dir.is_dir() and _has_run(run_dir):
            raise RunSettingsMismatch(f"{run_dir} holds a run with no record of its settings ({SETTINGS_FILE}; "
                                      f"written by an older caffe-compat?), so it can be neither reused nor "
                                      f"resumed safely; {remedy}")
        return False
    if stored != settings:
        keys = sorted(set(stored) | set(settings))
        changed = [f"{k} {_short(stored.get(k))} -> {_short(settings.get(k))}" for k in keys
                   if stored.get(k) != settings.get(k)]
        raise RunSettingsMismatch(f"{run_dir} was trained with other settings ({'; '.join(changed)}); refusing to "
                                  f"reuse or resume it: {remedy}")
    return True


def clear_run_dir(run_dir) -> None:
    """Remove what the pipeline wrote in ``run_dir`` (:data:`RUN_FILES`; anything else stays)."""
    run_dir = Path(run_dir)
    for pattern in RUN_FILES:
        for path in run_dir.glob(pattern):
            path.unlink()


def write_settings(run_dir, settings: dict) -> None:
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
    write_text_atomic(Path(run_dir) / SETTINGS_FILE,
                      json.dumps({"sha256": digest, "settings": settings}, indent=2, sort_keys=True) + "\n")


def input_layers(batch: int, crop: int) -> list[caffe_pb2.LayerParameter]:
    data = caffe_pb2.LayerParameter(name="data", type="Input", top=["data"])
    data.input_param.shape.add().dim.extend([batch, 3, crop, crop])
    label = caffe_pb2.LayerParameter(name="label", type="Input", top=["label"])
    label.input_param.shape.add().dim.extend([batch])
    return [data, label]


def train_net_param(setup, loss: str, delta_min: float | None = None) -> caffe_pb2.NetParameter:
    """Our ``train_<loss>.prototxt`` with its data layer replaced by fed Input layers."""
    path = prototxt_root() / setup.prototxt_dir / f"train_{loss}.prototxt"
    if not path.exists():
        known = sorted(p.stem[len("train_"):] for p in path.parent.glob("train_*.prototxt"))
        raise CaffeCompatError(f"no {loss!r} net for {setup.name} (known: {', '.join(known)})")
    net = read_net(path)
    data_tops = {"data", "label"}
    layers = [layer for layer in net.layer if not set(layer.top) & data_tops or layer.bottom]
    del net.layer[:]
    net.layer.extend(input_layers(setup.batch_size, setup.crop) + layers)
    if delta_min is not None:
        for layer in net.layer:
            if layer.type == "FAPPYLoss":
                layer.fappy_loss_param.delta = float(delta_min)
    return net


def solver_param(setup, net: caffe_pb2.NetParameter, seed: int, max_iter: int, run_dir: Path,
                 device: str) -> caffe_pb2.SolverParameter:
    param = read_solver(prototxt_root() / setup.prototxt_dir / "solver.prototxt")
    for name in ("net", "train_net", "net_param", "train_net_param"):
        param.ClearField(name)
    param.net_param.CopyFrom(net)
    param.max_iter = int(max_iter)
    param.random_seed = int(seed)
    param.snapshot = 0
    param.snapshot_prefix = str(run_dir / "snapshot")
    param.display = 0
    del param.test_iter[:]
    param.test_interval = 0
    param.solver_mode = caffe_pb2.SolverParameter.GPU if device.startswith("cuda") else caffe_pb2.SolverParameter.CPU
    return param


class TrainingBatches:
    """Endless ``{"data", "label"}`` batches from the label-shuffling sampler, from batch ``position`` on;
    resumable: ``state_dict()`` is the position of the next batch, which :func:`caffe_compat.solver.train.train`
    saves in each snapshot's ``.trainstate`` and hands back on ``resume`` (no batch is decoded again).

    Batch k's crops and mirrors come from its own generator, seeded with ``(seed, k)``
    (:class:`~caffe_compat.data.dataset.KeyedBatch`), and the DataLoader's base seed from a generator of its
    own: the same batches for any number of ``workers``, the global RNGs (dropout's) left alone, so a run
    resumed at batch k continues exactly as the uninterrupted run (before, 0 workers restarted the crop
    stream at the resume, N workers drew per worker, and starting the loader drew from the global RNG)."""

    def __init__(self, setup, records, seed: int, start: int, workers: int):
        self.setup, self.records, self.seed, self.workers = setup, records, int(seed), int(workers)
        self.position = int(start)

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])

    def __iter__(self):
        from torch.utils.data import DataLoader

        from caffe_compat.data import DataTransformer, ImageRecordDataset, LabelShufflingSampler
        from caffe_compat.data.dataset import KeyedBatch

        setup, seed, start = self.setup, self.seed, self.position
        transformer = DataTransformer(crop_size=setup.crop if setup.resize else 0, mirror=setup.mirror,
                                      mean_value=setup.mean_value, scale=setup.scale, phase="TRAIN", seed=seed)
        dataset = ImageRecordDataset(self.records, transformer, new_height=setup.resize, new_width=setup.resize,
                                     seed=seed)
        sampler = LabelShufflingSampler(dataset.labels, setup.batch_size, setup.per_label, seed=seed)

        def index_batches():
            epoch, position = 0, 0
            while True:
                sampler.set_epoch(epoch)
                for batch in sampler:
                    if position >= start:
                        yield KeyedBatch(batch, position)
                    position += 1
                epoch += 1

        loader = DataLoader(dataset, batch_sampler=index_batches(), num_workers=self.workers,
                            persistent_workers=self.workers > 0, pin_memory=torch.cuda.is_available(),
                            generator=torch.Generator().manual_seed(seed))
        for images, labels in loader:
            self.position += 1
            yield {"data": images, "label": labels.to(torch.float32)}


#: ``batches(setup, records, seed, start, workers)``: a run's training batches from batch ``start`` on.
batches = TrainingBatches


def snapshot_iteration(path: Path) -> int:
    """N of ``<prefix>_iter_N.solverstate``."""
    return int(Path(path).stem.rsplit("_", 1)[1])


def latest_snapshot(run_dir: Path, max_iter: int | None = None) -> Path | None:
    """The solverstate of the latest snapshot in ``run_dir`` at or before ``max_iter``."""
    numbered = (p for p in run_dir.glob("snapshot_iter_*.solverstate") if p.stem.rsplit("_", 1)[1].isdigit())
    states = sorted((p for p in numbered if max_iter is None or snapshot_iteration(p) <= max_iter),
                    key=snapshot_iteration)
    return states[-1] if states else None


def _truncate_log(log_path: Path, before_iter: int) -> None:
    """Keep the header and the rows of iterations ``< before_iter`` (a resumed run redoes the others)."""
    if not log_path.exists():
        return
    text = read_regular_text(log_path, "the run's training log", memory_budget(0.1))
    rows = list(csv.reader(text.splitlines(keepends=True)))
    kept = rows[:1] + [r for r in rows[1:] if r and r[0].lstrip("-").isdigit() and int(r[0]) < before_iter]
    text = "".join(",".join(r) + "\n" for r in kept)
    write_text_atomic(log_path, text)


def _segments(run_dir: Path) -> list[dict]:
    path = run_dir / PROGRESS_FILE
    if not path.exists():
        return []
    try:
        return list(json.loads(read_regular_text(path, "the run's progress record", _RECORD_MAX_BYTES))["segments"])
    except (OSError, ValueError, KeyError, TypeError):
        return []


def train_run(setup, loss: str, seed: int, records, run_dir: Path, *, device: str = "cpu", max_iter: int,
              weights: str | None = None, delta_min: float | None = None, workers: int = 0,
              snapshot_every: int = 0, progress: bool = True, settings: dict | None = None,
              compile: bool = False, cuda_graphs: bool = False) -> dict:
    """Train one run with :func:`caffe_compat.solver.train.train`; returns ``{"caffemodel", "iterations",
    "final_loss", "seconds" (all segments), "segments", "resumed_from" (iteration or None), "log"}``.

    ``settings`` (default :func:`run_settings` of the arguments) is checked against the run directory
    (:func:`check_run_dir`: RunSettingsMismatch when it holds another run) and recorded there."""
    from caffe_compat.solver import Solver
    from caffe_compat.solver.train import train

    run_dir = Path(run_dir)
    if settings is None:
        settings = run_settings(setup, loss, seed, max_iter, weights, delta_min, records)
    same = check_run_dir(run_dir, settings)
    run_dir.mkdir(parents=True, exist_ok=True)
    if not same:
        clear_run_dir(run_dir)  # nothing of ours is there (check_run_dir), but a stale log may be
        write_settings(run_dir, settings)
    np.random.seed(seed)
    param = solver_param(setup, train_net_param(setup, loss, delta_min), seed, max_iter, run_dir, device)
    param.snapshot = int(snapshot_every)
    solver = Solver(param, weights=weights, device=device)
    resume = latest_snapshot(run_dir, max_iter)
    start_iter = 0 if resume is None else snapshot_iteration(resume)
    log_path = run_dir / "train_log.csv"
    if resume is None:
        if log_path.exists():
            log_path.unlink()
        segments = []
    else:
        _truncate_log(log_path, start_iter)
        segments = _segments(run_dir)
    started, finished = time.perf_counter(), False
    try:
        # resume: Caffe's Restore, then the snapshot's .trainstate (the RNGs, the batch position)
        summary = train(solver, data=batches(setup, records, seed, start_iter, workers), progress=progress,
                        csv_log=str(log_path), seed=seed, compile=compile, cuda_graphs=cuda_graphs,
                        resume=None if resume is None else str(resume))
        finished = True
    finally:
        segments.append({"from_iter": int(start_iter), "to_iter": int(solver.iter), "finished": finished,
                         "seconds": round(time.perf_counter() - started, 3), "device": str(device)})
        write_text_atomic(run_dir / PROGRESS_FILE, json.dumps({"segments": segments}, indent=2) + "\n")
    caffemodel = Path(f"{param.snapshot_prefix}_iter_{solver.iter}.caffemodel")
    if not caffemodel.exists():
        caffemodel, _ = solver.snapshot()
    return {"caffemodel": str(caffemodel), "iterations": solver.iter, "final_loss": summary.last_loss,
            "seconds": float(sum(seg["seconds"] for seg in segments)), "segments": segments,
            "resumed_from": None if resume is None else int(start_iter), "log": str(log_path)}

"""What ``caffe-compat reproduce`` runs: :class:`ReproduceConfig`, one object for every option of
:func:`caffe_compat.reproduce.pipeline.reproduce`, and :func:`resolve`, which checks it and fills in the
data set's defaults (before anything is read or written).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

from caffe_compat.errors import CaffeCompatError
from caffe_compat.io.safe_open import require_regular_file
from caffe_compat.reproduce.setups import SETUPS, ReproduceSetup
from caffe_compat.reproduce.training import prototxt_root

__all__ = ["ReproduceConfig", "resolve"]


@dataclass(frozen=True)
class ReproduceConfig:
    """The options of a ``reproduce`` invocation; ``None`` means the data set's default.

    ``dataset``: a key of :data:`~caffe_compat.reproduce.setups.SETUPS`.  ``data_root``: the data set in its
    native layout (``digits``: generated under ``out_dir`` when None).  ``losses`` (default: the paper's
    table), ``seeds`` (0 1 2 for the toy set, 0 otherwise), ``weights`` (initial caffemodel), ``delta_min``
    (FAPPY's finest bin width), ``device`` (``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``; checked),
    ``max_iter`` (iterations per run), ``out_dir`` (default ``runs/<dataset>``), ``workers`` (data-loading
    processes: 0 for the toy set, else :func:`loader_workers`), ``snapshot_every`` (also snapshot every N
    iterations), ``batch_size`` / ``per_label`` (override the paper's batch, e.g. a small one for a CPU smoke
    run), ``progress`` (say what happens on the terminal), ``fresh`` (discard the requested runs' directories
    and retrain them), ``compile`` (``torch.compile`` the training net, fullgraph:
    :func:`caffe_compat.net.compile_net`; the same numbers to float32 round-off, not part of the run's
    settings), ``cuda_graphs`` (each iteration recorded as CUDA graphs and replayed:
    :mod:`caffe_compat.solver.step_graphs`; the eager numbers, not part of the run's settings).
    """

    dataset: str
    data_root: str | Path | None = None
    losses: list[str] | None = None
    seeds: list[int] | None = None
    weights: str | None = None
    delta_min: float | None = None
    device: str = "cpu"
    max_iter: int | None = None
    out_dir: str | Path | None = None
    workers: int | None = None
    snapshot_every: int = 0
    batch_size: int | None = None
    per_label: int | None = None
    progress: bool = True
    fresh: bool = False
    compile: bool = False
    cuda_graphs: bool = False


def resolve(config: ReproduceConfig) -> tuple[ReproduceConfig, ReproduceSetup]:
    """``config`` checked, with every default filled in (``losses``/``seeds`` lists, ``max_iter``,
    ``out_dir`` a Path, ``workers``, ``device`` as torch names it), and the data set's setup (with the
    batch overrides).  Raises CaffeCompatError for an unknown data set, an unusable device, a batch that is
    no run of labels, a loss without a prototxt, a loss or seed named twice, a seed outside 0..2**32-1,
    negative ``workers`` or ``snapshot_every``, ``max_iter`` < 1 or missing ``weights``."""
    from caffe_compat.evaluate.inputs import parse_device

    dataset = config.dataset
    if dataset not in SETUPS:
        raise CaffeCompatError(f"unknown data set {dataset!r}; choose one of {sorted(SETUPS)}")
    device = str(parse_device(config.device, option="device"))
    setup = _with_batch(SETUPS[dataset], config.batch_size, config.per_label)
    losses = list(config.losses or setup.losses)
    nets = prototxt_root() / setup.prototxt_dir
    unknown = [l for l in losses if not (nets / f"train_{l}.prototxt").exists()]
    if unknown:
        raise CaffeCompatError(f"reproduce {dataset}: no prototxt for loss(es) {unknown}; "
                               f"available: {', '.join(setup.losses)}")
    seeds = list(config.seeds if config.seeds is not None else ((0, 1, 2) if setup.toy_kind else (0,)))
    for option, values in (("--loss", losses), ("--seeds", seeds)):
        twice = sorted({v for v in values if values.count(v) > 1})
        if twice:  # one run directory per (loss, seed): a repeat would train it twice and count it twice
            raise CaffeCompatError(f"reproduce {dataset}: {option} names {', '.join(map(str, twice))} more than once")
    bad_seeds = [s for s in seeds if not 0 <= int(s) < 2 ** 32]
    if bad_seeds:  # numpy's global RandomState (Caffe's random_seed) takes 0..2**32-1
        raise CaffeCompatError(f"reproduce {dataset}: --seeds must be in 0..{2 ** 32 - 1}, got {bad_seeds}")
    for option, value in (("--workers", config.workers), ("--snapshot-every", config.snapshot_every)):
        if value is not None and int(value) < 0:
            raise CaffeCompatError(f"reproduce {dataset}: {option} must be >= 0, got {value}")
    max_iter = int(setup.max_iter if config.max_iter is None else config.max_iter)  # 0 is refused, not the default
    if max_iter < 1:
        raise CaffeCompatError(f"reproduce {dataset}: --max-iter must be >= 1, got {max_iter}")
    for option, value in (("--max-iter", max_iter), ("--snapshot-every", config.snapshot_every)):
        if value is not None and int(value) > 2 ** 31 - 1:  # int32 fields of the solver (max_iter, snapshot)
            raise CaffeCompatError(f"reproduce {dataset}: {option} must be <= {2 ** 31 - 1}, got {value}")
    if config.weights is not None:
        require_regular_file(config.weights, "--weights",  # a FIFO, a device or a folder is named as such
                             missing=f"reproduce {dataset}: --weights {config.weights}: no such file")
    if config.delta_min is not None and not (math.isfinite(config.delta_min) and config.delta_min > 0):
        raise CaffeCompatError(f"reproduce {dataset}: --delta-min must be a finite number > 0 (FAPPY's finest bin "
                               f"width; Caffe's layer loops for ever otherwise), got {config.delta_min}")
    out_dir = Path(config.out_dir or Path("runs") / dataset)
    workers = (0 if setup.toy_kind else loader_workers(device)) if config.workers is None else int(config.workers)
    resolved = replace(config, losses=losses, seeds=seeds, max_iter=max_iter, out_dir=out_dir, workers=workers,
                       device=device)
    return resolved, setup


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, which a container or ``taskset`` narrows; else
    ``os.cpu_count()``)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity call (macOS, Windows)
        return max(1, os.cpu_count() or 1)


def loader_workers(device: str) -> int:
    """Default DataLoader processes for a real data set.  On CUDA every usable CPU but the main process's,
    2 to 8: the paper's batches of 256² JPEGs cropped to 224² take a worker ~0.8-0.9 ms an image on the
    team's Xeon (1,145-1,305 images/s, ``bench_input_pipeline.py``), and a full-size CUB or SOP photo
    three times as long (decoding a 500 x 375 JPEG and resizing it to 256² took 1.8 ms there, a 256² JPEG
    0.6 ms), while an H100 trains ~1,450-2,470 images/s; fewer workers leave the GPU waiting.  On the CPU
    2 (the net's compute takes the cores).  The count changes no number: every batch draws from its own
    generator (:class:`~caffe_compat.reproduce.training.TrainingBatches`)."""
    if not device.startswith("cuda"):
        return 2
    return max(2, min(8, usable_cpus() - 1))


def _with_batch(setup: ReproduceSetup, batch_size: int | None, per_label: int | None) -> ReproduceSetup:
    if batch_size is None and per_label is None:
        return setup
    batch_size = int(setup.batch_size if batch_size is None else batch_size)  # None only means the default
    per_label = int(min(setup.per_label, batch_size) if per_label is None else per_label)
    if not 2 <= per_label <= batch_size:
        raise CaffeCompatError(f"reproduce {setup.name}: need 2 <= --per-label <= --batch-size, got "
                               f"{per_label} and {batch_size} (a batch is made of label runs)")
    return replace(setup, batch_size=batch_size, per_label=per_label)

"""``caffe-compat reproduce``: train from our prototxt → snapshot → export ONNX → evaluate with ONNX
Runtime → the paper-style table, curves and ``run.json``.  The options are one
:class:`~caffe_compat.reproduce.config.ReproduceConfig`; :func:`reproduce` resolves it, reads the data,
checks every run directory, runs each (loss, seed) and writes the summary, one step each.

One run per (loss, seed) under ``OUT/<loss>/seed<k>/`` (settings.json, progress.json, train_log.csv,
snapshots, embedder.onnx, metrics.json).  Re-running the same command continues where it stopped: a
finished run (metrics.json) is reused, an interrupted one resumes from its last snapshot -- but only when
the run directory's settings.json records exactly the settings asked for now
(:func:`caffe_compat.reproduce.training.run_settings`: loss, seed, max_iter, initial weights (sha256),
delta_min, batch size, per-label count, preprocessing, nets, training list, data root; not the device,
workers or snapshot interval).  Any difference is refused before anything is trained or written
(:class:`~caffe_compat.reproduce.training.RunSettingsMismatch`, exit status 2 in the CLI): use a new
``--out``, or ``fresh=True`` (``--fresh``), which discards what the requested runs' directories hold and
retrains them.  So a lower ``--max-iter`` never evaluates weights of a later iteration.  A data set
given with ``data_root`` is read (every split's list) before anything is written, so a wrong one leaves
no ``OUT/`` behind.

The summary files sit in ``OUT/``: ``results.md`` (the data set's name -- the toy set is called
"digits, CUB layout", not after the data set whose layout it copies --, the Table 1/2 layout of the
means over seeds, then Recall@1 / MAP@R / precision@1 / NMI (top-1 / top-5 for VehicleID) as mean ±
sample standard deviation over the seeds, see :mod:`caffe_compat.reproduce.report`), ``results.json``
(every run's metrics and the same summary), ``run.json`` (configuration, git revision and whether the
working tree was dirty, library versions, figures, each run's original training time (all its
segments), whether it was resumed from a snapshot or reused from an earlier invocation, this
invocation's wall time, and the ``preprocessing`` of the training batches (resize, crop, mirror, mean
values, scale) with a note on how the authors' data layer differs, see
:func:`~caffe_compat.reproduce.setups.training_preprocessing`), ``training_loss.png`` (a panel per
loss, a line per seed) and ``recall_at_k.png`` (mean over seeds, error bars of the sample std; or
``cmc.png`` for VehicleID).

With ``progress`` the terminal says what is on disk before starting, then ``run k of n: <loss> seed
<s>`` for each run: reused from disk (snapshot, ONNX and metrics of an earlier invocation), resuming
from a snapshot, or training; the caller prints ``"closing"`` (how many were reused, resumed, trained).
"""

from __future__ import annotations

import json
import platform
import subprocess
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from caffe_compat.errors import CaffeCompatError
from caffe_compat.hardware import require_cpu_compiler
from caffe_compat.io.atomic import write_error, write_text_atomic
from caffe_compat.reproduce.report import (SPREAD, closing_summary, headline, metric_columns, results_json,
                                           results_markdown, seed_spread, write_figures)
from caffe_compat.reproduce.config import ReproduceConfig, resolve
from caffe_compat.reproduce.setups import training_preprocessing
from caffe_compat.reproduce.training import (check_run_dir, clear_run_dir, latest_snapshot, prototxt_root,
                                             read_settings, run_settings, train_run)

#: Toy data used by the embedded default (`reproduce digits`).
DIGITS_CLASSES, DIGITS_IMAGES_PER_CLASS = 40, 40


def _git(args: list[str], cwd: Path) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_state() -> dict:
    """``{"revision", "dirty"}`` of the checkout caffe_compat is imported from (both None when it is not
    a git work tree, e.g. an installed wheel); ``dirty``: ``git status --porcelain`` lists anything."""
    import caffe_compat

    source = Path(caffe_compat.__file__).resolve().parents[1]
    top = _git(["rev-parse", "--show-toplevel"], source)
    if top is None or Path(top).resolve() != source:
        return {"revision": None, "dirty": None}
    revision = _git(["rev-parse", "HEAD"], source)
    status = _git(["status", "--porcelain"], source)
    return {"revision": revision or None, "dirty": None if status is None else bool(status)}


def _git_revision() -> str | None:
    return git_state()["revision"]


def _versions() -> dict:
    import google.protobuf
    import onnx
    import onnxruntime
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
            "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__,
            "protobuf": google.protobuf.__version__, "platform": platform.platform()}


def data_root_for(setup, data_root, out_dir: Path) -> Path:
    if setup.toy_kind is not None and data_root is None:
        from caffe_compat.data import make_toy_data

        root = out_dir / "data" / "CUB_200_2011"
        if not (root / "images.txt").exists():
            make_toy_data(setup.toy_kind, root, seed=0, size=setup.crop, num_classes=DIGITS_CLASSES,
                          images_per_class=DIGITS_IMAGES_PER_CLASS)
        return root
    if data_root is None:
        raise CaffeCompatError(f"reproduce {setup.name}: --data-root is required (the data set in its native layout)")
    root = Path(data_root)
    if not root.exists():
        raise CaffeCompatError(f"reproduce {setup.name}: data root {root} does not exist")
    return root


def read_records(setup, root: Path) -> list:
    """The training split's records; the test splits are read too (and dropped), so that a data set
    missing one fails now, not after training."""
    records = setup.read(root, setup.train_split)
    for split in setup.test_splits:
        setup.read(root, split)
    return records


def preprocessing(setup) -> dict:
    """What the exported embedder expects (stored in the ONNX metadata)."""
    return {"channel_order": "BGR", "resize": setup.resize, "crop_size": setup.crop,
            "mean_value": list(setup.mean_value), "scale": setup.scale, "input_blob": "data"}


def evaluate_run(setup, caffemodel: str, run_dir: Path, root: Path, device: str, batch_size: int = 64,
                 progress: bool = True) -> dict:
    """Export the deploy net with the trained weights to ONNX and evaluate it with ONNX Runtime."""
    from caffe_compat.reproduce.onnx_eval import evaluate_onnx_embedder, export_embedder

    onnx_path = export_embedder(prototxt_root() / setup.prototxt_dir / "deploy.prototxt", caffemodel,
                                setup.embedding_blob, run_dir / "embedder.onnx", preprocessing(setup))
    metrics = evaluate_onnx_embedder(setup, onnx_path, root, device=device, batch_size=batch_size, progress=progress)
    metrics["onnx"] = str(onnx_path)
    return metrics


def _headline_text(setup, metrics: dict) -> str:
    return f"{metric_columns(setup)[0][1]} {100 * headline(setup, metrics):.1f}%"


def _data_note(setup, generated: bool) -> str:
    """results.md's line on the data actually used (the toy set is not the data set whose layout it has)."""
    if setup.toy_kind is None:
        return ""
    source = (f"scikit-learn's handwritten digits, generated as a CUB-200-2011-style tree ({DIGITS_CLASSES} "
              f"classes = digit x colour/rotation style, {DIGITS_IMAGES_PER_CLASS} images each; the first half "
              f"of the classes train, the others test)" if generated else "the given CUB-style tree")
    return (f"Data: {source}, evaluated with the CUB-200-2011 protocol (Recall@K, NMI, MAP@R). It is not "
            f"CUB-200-2011: these figures are not comparable with the paper's.")


def _say(progress: bool, text: str) -> None:
    if progress:
        print(text, flush=True)


def _on_disk(run_dir: Path, settings: dict, max_iter: int, fresh: bool) -> tuple[str, Path | None]:
    """What a run directory offers: ``("finished", None)`` (metrics.json with these settings),
    ``("snapshot", path)`` (the latest snapshot at or before ``max_iter``, to resume from) or
    ``("nothing", None)`` (also always under --fresh)."""
    if fresh:
        return "nothing", None
    if (run_dir / "metrics.json").exists() and read_settings(run_dir) == settings:
        return "finished", None
    snapshot = latest_snapshot(run_dir, max_iter)
    return ("nothing", None) if snapshot is None else ("snapshot", snapshot)


def reproduce(config: ReproduceConfig | str, **options) -> dict:
    """Run every (loss, seed) of the data set and write the summary files; return run.json's content plus
    ``"table"`` (results.md) and ``"closing"`` (:func:`~caffe_compat.reproduce.report.closing_summary`).

    ``config``: a :class:`~caffe_compat.reproduce.config.ReproduceConfig` (every option, see there), or the
    data set's name with the config's fields as keywords (``reproduce("digits", max_iter=6)``); keywords
    given with a config replace its fields.  Resuming and ``fresh``: see the module docstring."""
    if not isinstance(config, ReproduceConfig):
        config = ReproduceConfig(config, **options)
    elif options:
        config = replace(config, **options)
    config, setup = resolve(config)
    require_cpu_compiler(config.device.split(":")[0], config.compile)  # before anything is written
    started = time.perf_counter()
    generated = setup.toy_kind is not None and config.data_root is None
    data = None
    if not generated:
        # A data set given by the user is read (every split's list, so also validated) before anything is
        # written: a wrong --data-root leaves no run folder behind.
        data = _read_data(setup, config, generated)
    planned = [(loss, seed, config.out_dir / loss / f"seed{seed}") for loss in config.losses for seed in config.seeds]
    try:
        config.out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # --out (or a folder above it) is a file, or cannot be created
        reason = "not a folder" if isinstance(exc, (FileExistsError, NotADirectoryError)) else "cannot create it"
        raise write_error(config.out_dir, exc, f"--out: {reason}", with_reason=reason != "not a folder") from None
    if config.weights is None and setup.toy_kind is None and config.progress:
        print(f"reproduce {config.dataset}: no --weights, so training starts from the prototxt's fillers (Caffe's "
              f"default filler is constant 0); the paper starts from the ImageNet caffemodel named in models/",
              flush=True)
    if generated:  # the toy data set is made inside the run folder
        data = _read_data(setup, config, generated)
    # Every run's settings, checked against its directory before anything is trained or written.
    settings = _checked_settings(setup, config, planned, data)
    state = {run_dir: _on_disk(run_dir, settings[run_dir], config.max_iter, config.fresh) for _, _, run_dir in planned}
    found = [sum(1 for kind, _ in state.values() if kind == wanted) for wanted in ("finished", "snapshot")]
    _say(config.progress, f"reproduce {config.dataset}: {len(planned)} runs ({len(config.losses)} loss(es) x "
                          f"{len(config.seeds)} seed(s), {config.max_iter} iterations each) in {config.out_dir}; "
                          f"on disk: {found[0]} finished (reused), {found[1]} with a snapshot to resume from"
                          + (" (--fresh: all retrained)" if config.fresh else ""))
    per_loss: dict[str, list[dict]] = {}
    for number, (loss, seed, run_dir) in enumerate(planned, 1):
        name = f"run {number} of {len(planned)}: {loss} seed {seed}"
        run = _one_run(setup, config, loss, seed, run_dir, name, state[run_dir], settings[run_dir], data)
        per_loss.setdefault(loss, []).append(run)
    return _write_summary(setup, config, planned, per_loss, data, started)


@dataclass
class _Data:
    root: Path  # the data set's folder
    records: list  # the training split's records
    data_id: str  # what settings.json records of the data


def _read_data(setup, config: ReproduceConfig, generated: bool) -> _Data:
    """The data set (generated under ``out_dir`` for the toy set without ``data_root``): its root, the
    training records (every split read, so checked) and how the run settings name it."""
    root = data_root_for(setup, config.data_root, config.out_dir)
    records = read_records(setup, root)
    if generated:
        data_id = (f"generated: make_toy_data({setup.toy_kind!r}, seed=0, size={setup.crop}, "
                   f"num_classes={DIGITS_CLASSES}, images_per_class={DIGITS_IMAGES_PER_CLASS})")
    else:
        data_id = str(root.resolve())
    return _Data(root, records, data_id)


def _checked_settings(setup, config: ReproduceConfig, planned: list, data: _Data) -> dict:
    """Each run directory's settings (:func:`~caffe_compat.reproduce.training.run_settings`), checked
    against what the directory holds unless ``fresh`` (RunSettingsMismatch)."""
    settings = {}
    for loss, seed, run_dir in planned:
        settings[run_dir] = run_settings(setup, loss, seed, config.max_iter, config.weights, config.delta_min,
                                         data.records, extra={"data_root": data.data_id})
        if not config.fresh:
            check_run_dir(run_dir, settings[run_dir])
    return settings


def _one_run(setup, config: ReproduceConfig, loss: str, seed: int, run_dir: Path, name: str, on_disk: tuple,
             settings: dict, data: _Data) -> dict:
    """One (loss, seed): reused from disk, or trained (resuming from a snapshot), exported and evaluated;
    its metrics.json content with ``"reused"``."""
    done = run_dir / "metrics.json"
    if config.fresh:
        clear_run_dir(run_dir)
    elif on_disk[0] == "finished":
        run = json.loads(done.read_text())
        run["reused"] = True
        _say(config.progress, f"{name}: reused from disk ({Path(run['train']['caffemodel']).name}, embedder.onnx "
                              f"and metrics.json: {_headline_text(setup, run['metrics'])})")
        return run
    snapshot = on_disk[1]
    _say(config.progress, f"{name}: " + ("training" if snapshot is None else
                                         f"resuming from {snapshot.name} on disk"))
    max_iter = config.max_iter
    train = train_run(setup, loss, seed, data.records, run_dir, device=config.device, max_iter=max_iter,
                      weights=config.weights, delta_min=config.delta_min, workers=config.workers,
                      snapshot_every=config.snapshot_every, progress=config.progress, settings=settings,
                      compile=config.compile, cuda_graphs=config.cuda_graphs)
    if train["iterations"] != max_iter:
        raise CaffeCompatError(f"{run_dir}: training ended at iteration {train['iterations']}, not {max_iter}")
    metrics = evaluate_run(setup, train["caffemodel"], run_dir, data.root, config.device, progress=config.progress)
    run = {"loss": loss, "seed": seed, "max_iter": max_iter, "settings": settings, "train": train,
           "metrics": metrics}
    write_text_atomic(done, json.dumps(run, indent=2) + "\n")
    run["reused"] = False
    resumed = "" if train["resumed_from"] is None else f", resumed from iteration {train['resumed_from']}"
    _say(config.progress, f"{name}: {_headline_text(setup, metrics)} ({train['seconds']:.0f} s training{resumed})")
    return run


def _write_summary(setup, config: ReproduceConfig, planned: list, per_loss: dict, data: _Data,
                   started: float) -> dict:
    """results.md, results.json, the figures and run.json in ``out_dir``; run.json's content plus
    ``"table"`` and ``"closing"``."""
    out_dir, generated = config.out_dir, setup.toy_kind is not None and config.data_root is None
    markdown = results_markdown(setup, per_loss, max_iter=config.max_iter, seeds=config.seeds,
                                data_note=_data_note(setup, generated))
    write_text_atomic(out_dir / "results.md", markdown)
    write_text_atomic(out_dir / "results.json", json.dumps(results_json(setup, per_loss), indent=2) + "\n")
    plots = write_figures(setup, out_dir, per_loss, {(loss, seed): run_dir for loss, seed, run_dir in planned})
    figures = {loss: seed_spread([headline(setup, r["metrics"]) for r in runs]) for loss, runs in per_loss.items()}
    git = git_state()
    summary = {
        "dataset": config.dataset, "data_root": str(data.root), "losses": config.losses, "seeds": config.seeds,
        "max_iter": config.max_iter, "device": config.device, "weights": config.weights,
        "delta_min": config.delta_min, "fresh": bool(config.fresh),
        "git_revision": git["revision"], "git_dirty": git["dirty"],
        "versions": _versions(), "headline_metric": "top_1_small" if setup.protocol == "vehicleid" else "recall_at_1",
        "figures": figures, "spread": SPREAD, "plots": plots, "wall_seconds": time.perf_counter() - started,
        "training_seconds": {loss: [r["train"]["seconds"] for r in runs] for loss, runs in per_loss.items()},
        "runs": [{"loss": r["loss"], "seed": r["seed"], "iterations": r["train"]["iterations"],
                  "training_seconds": r["train"]["seconds"], "resumed_from": r["train"].get("resumed_from"),
                  "reused": r["reused"], "devices": sorted({seg.get("device", "?") for seg in
                                                            r["train"].get("segments", [])})}
                 for runs in per_loss.values() for r in runs],
        "setup": {k: (list(v) if isinstance(v, tuple) else v) for k, v in setup.__dict__.items()
                  if isinstance(v, (str, int, float, tuple, list))},
        # what the training batches went through (and how the authors' data layer differs), and the
        # evaluation's input (the ONNX metadata)
        "preprocessing": {**training_preprocessing(setup), "test": preprocessing(setup)},
    }
    write_text_atomic(out_dir / "run.json", json.dumps(summary, indent=2) + "\n")
    summary["table"] = markdown
    summary["closing"] = closing_summary(summary["runs"], summary["wall_seconds"])
    return summary

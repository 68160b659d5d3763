"""``caffe-compat reproduce``: train from our prototxt → snapshot → export ONNX → evaluate with ONNX
Runtime → the paper-style table, curves and ``run.json``.

One run per (loss, seed) under ``OUT/<loss>/seed<k>/`` (train_log.csv, snapshots, embedder.onnx,
metrics.json).  A finished run (metrics.json present) is reused, an interrupted one resumes from its
last snapshot, so re-running the same command continues where it stopped.  The summary files sit in
``OUT/``: ``results.md`` (Table 1/2 layout, mean over seeds, with the Recall@1 / top-1 spread),
``results.json``, ``run.json`` (configuration, git revision, library versions, figures, wall times),
``training_loss.png`` and ``recall_at_k.png`` (or ``cmc.png`` for VehicleID).
"""

from __future__ import annotations

import json
import platform
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from caffe_compat.errors import CaffeCompatError
from caffe_compat.io.atomic import write_text_atomic
from caffe_compat.reproduce.setups import SETUPS
from caffe_compat.reproduce.training import REPO_PROTOTXT, train_run

#: Toy data used by the embedded default (`reproduce digits`).
DIGITS_CLASSES, DIGITS_IMAGES_PER_CLASS = 40, 40


def _git_revision() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_PROTOTXT.parent, capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


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


def preprocessing(setup) -> dict:
    """What the exported embedder expects (stored in the ONNX metadata)."""
    return {"channel_order": "BGR", "resize": setup.resize, "crop_size": setup.crop,
            "mean_value": list(setup.mean_value), "scale": setup.scale, "input_blob": "data"}


def evaluate_run(setup, caffemodel: str, run_dir: Path, root: Path, device: str, batch_size: int = 64,
                 progress: bool = True) -> dict:
    """Export the deploy net with the trained weights to ONNX and evaluate it with ONNX Runtime."""
    from caffe_compat.reproduce.onnx_eval import evaluate_onnx_embedder, export_embedder

    onnx_path = export_embedder(REPO_PROTOTXT / setup.prototxt_dir / "deploy.prototxt", caffemodel,
                                setup.embedding_blob, run_dir / "embedder.onnx", preprocessing(setup))
    metrics = evaluate_onnx_embedder(setup, onnx_path, root, device=device, batch_size=batch_size, progress=progress)
    metrics["onnx"] = str(onnx_path)
    return metrics


def _headline(setup, metrics: dict) -> float:
    if setup.protocol == "vehicleid":
        return metrics["splits"]["small"]["top_1"]["mean"]
    return metrics["recall_at_k"]["1"]


def _mean_result(setup, runs: list[dict]) -> dict:
    """Average protocol dicts over seeds (numbers averaged leaf by leaf)."""
    def average(items):
        first = items[0]
        if isinstance(first, dict):
            return {k: average([i[k] for i in items]) for k in first if all(k in i for i in items)}
        if isinstance(first, (int, float)) and not isinstance(first, bool):
            return float(np.mean(items))
        if isinstance(first, list) and first and isinstance(first[0], (int, float)):
            return [float(v) for v in np.mean(np.asarray(items, dtype=float), axis=0)]
        return first
    return average([r["metrics"] for r in runs])


def _plots(setup, out_dir: Path, per_loss: dict) -> list[str]:
    written = []
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return written
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for loss, runs in per_loss.items():
        curves = []
        for run in runs:
            data = np.genfromtxt(run["train"]["log"], delimiter=",", names=True)
            curves.append(np.atleast_1d(data["loss"]))
        length = min(len(c) for c in curves)
        mean = np.mean([c[:length] for c in curves], axis=0)
        window = max(1, min(10, length // 10))
        smooth = np.convolve(mean, np.ones(window) / window, mode="valid")
        iters = np.arange(len(smooth)) + window  # iteration at the end of each window
        ax.plot(iters, smooth, label=f"{loss} (mean of {len(runs)} seeds)", linewidth=1.2)
    ax.set_xlabel("iteration")
    ax.set_ylabel(f"training loss, running mean of {window}")
    ax.set_yscale("log")
    ax.set_title(f"{setup.name}: training loss")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "training_loss.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(str(path))
    from caffe_compat.evaluate.plots import plot_cmc, plot_recall_at_k

    means = {loss: _mean_result(setup, runs) for loss, runs in per_loss.items()}
    if setup.protocol == "vehicleid":
        curves = {loss: m["splits"]["small"]["cmc"] for loss, m in means.items()}
        written.append(str(plot_cmc(curves, out_dir / "cmc.png", title=f"{setup.name}: CMC, small test list")))
    else:
        curves = {loss: {int(k): v for k, v in m["recall_at_k"].items()} for loss, m in means.items()}
        written.append(str(plot_recall_at_k(curves, out_dir / "recall_at_k.png", title=f"{setup.name}: Recall@K")))
    return written


def _table(setup, per_loss: dict) -> str:
    from caffe_compat.evaluate.protocols import paper_tables

    means = {loss: {setup.protocol: _mean_result(setup, runs)} for loss, runs in per_loss.items()}
    table = paper_tables(means, digits=1, with_std=setup.protocol == "vehicleid")
    metric = "top-1 (small)" if setup.protocol == "vehicleid" else "Recall@1"
    lines = [f"\n{metric} over seeds (mean ± std, %):\n", "| Method | seeds | " + metric + " | per seed |",
             "|---|---:|---:|---|"]
    for loss, runs in per_loss.items():
        values = np.array([_headline(setup, r["metrics"]) for r in runs]) * 100
        lines.append(f"| {loss} | {len(values)} | {values.mean():.1f} ± {values.std():.1f} | "
                     + ", ".join(f"{v:.1f}" for v in values) + " |")
    return table + "\n".join(lines) + "\n"


def reproduce(dataset: str, data_root=None, losses=None, seeds=None, weights=None, delta_min=None,
              device: str = "cpu", max_iter: int | None = None, out_dir=None, workers: int | None = None,
              snapshot_every: int = 0, batch_size: int | None = None, per_label: int | None = None,
              progress: bool = True) -> dict:
    """Run every (loss, seed) of ``dataset`` and write the summary files; return run.json's content
    plus ``"table"`` (the markdown table).  ``batch_size`` / ``per_label`` override the paper's batch
    (e.g. a small batch for a CPU smoke run of the full-size nets)."""
    if dataset not in SETUPS:
        raise CaffeCompatError(f"unknown data set {dataset!r}; choose one of {sorted(SETUPS)}")
    setup = SETUPS[dataset]
    if batch_size is not None or per_label is not None:
        batch_size = int(batch_size or setup.batch_size)
        per_label = int(per_label or min(setup.per_label, batch_size))
        if not 2 <= per_label <= batch_size:
            raise CaffeCompatError(f"reproduce {dataset}: need 2 <= --per-label <= --batch-size, got "
                                   f"{per_label} and {batch_size} (a batch is made of label runs)")
        setup = replace(setup, batch_size=batch_size, per_label=per_label)
    losses = list(losses or setup.losses)
    unknown = [l for l in losses if not (REPO_PROTOTXT / setup.prototxt_dir / f"train_{l}.prototxt").exists()]
    if unknown:
        raise CaffeCompatError(f"reproduce {dataset}: no prototxt for loss(es) {unknown}; "
                               f"available: {', '.join(setup.losses)}")
    seeds = list(seeds if seeds is not None else ((0, 1, 2) if setup.toy_kind else (0,)))
    max_iter = int(max_iter or setup.max_iter)
    out_dir = Path(out_dir or Path("runs") / dataset)
    out_dir.mkdir(parents=True, exist_ok=True)
    workers = (0 if setup.toy_kind else 2) if workers is None else int(workers)
    started = time.perf_counter()
    if weights is None and setup.toy_kind is None and progress:
        print(f"reproduce {dataset}: no --weights, so training starts from the prototxt's fillers (Caffe's "
              f"default filler is constant 0); the paper starts from the ImageNet caffemodel named in models/",
              flush=True)
    root = data_root_for(setup, data_root, out_dir)
    train_records = setup.read(root, setup.train_split)
    per_loss: dict[str, list[dict]] = {}
    for loss in losses:
        for seed in seeds:
            run_dir = out_dir / loss / f"seed{seed}"
            done = run_dir / "metrics.json"
            if done.exists():
                run = json.loads(done.read_text())
                if run.get("max_iter") == max_iter:
                    per_loss.setdefault(loss, []).append(run)
                    continue
            train = train_run(setup, loss, seed, train_records, run_dir, device=device, max_iter=max_iter,
                              weights=weights, delta_min=delta_min, workers=workers,
                              snapshot_every=snapshot_every, progress=progress)
            metrics = evaluate_run(setup, train["caffemodel"], run_dir, root, device, progress=progress)
            run = {"loss": loss, "seed": seed, "max_iter": max_iter, "train": train, "metrics": metrics}
            write_text_atomic(done, json.dumps(run, indent=2) + "\n")
            per_loss.setdefault(loss, []).append(run)
            if progress:
                print(f"{dataset} {loss} seed {seed}: {'top-1' if setup.protocol == 'vehicleid' else 'R@1'} "
                      f"{100 * _headline(setup, metrics):.1f}% ({train['seconds']:.0f} s training)", flush=True)
    table = _table(setup, per_loss)
    heading = f"# {dataset}: {max_iter} iterations per run\n\n"
    if dataset == "digits":
        heading += ("The digits toy set is evaluated in the CUB-200-2011 layout and protocol, hence the "
                    "column titles.\n\n")
    write_text_atomic(out_dir / "results.md", heading + table)
    results = {loss: [{"seed": r["seed"], "metrics": r["metrics"]} for r in runs] for loss, runs in per_loss.items()}
    write_text_atomic(out_dir / "results.json", json.dumps(results, indent=2) + "\n")
    plots = _plots(setup, out_dir, per_loss)
    figures = {loss: {"mean": float(np.mean([_headline(setup, r["metrics"]) for r in runs])),
                      "std": float(np.std([_headline(setup, r["metrics"]) for r in runs])),
                      "per_seed": [_headline(setup, r["metrics"]) for r in runs]} for loss, runs in per_loss.items()}
    summary = {
        "dataset": dataset, "data_root": str(root), "losses": losses, "seeds": seeds, "max_iter": max_iter,
        "device": device, "weights": weights, "delta_min": delta_min, "git_revision": _git_revision(),
        "versions": _versions(), "headline_metric": "top_1_small" if setup.protocol == "vehicleid" else "recall_at_1",
        "figures": figures, "plots": plots, "wall_seconds": time.perf_counter() - started,
        "training_seconds": {loss: [r["train"]["seconds"] for r in runs] for loss, runs in per_loss.items()},
        "setup": {k: (list(v) if isinstance(v, tuple) else v) for k, v in setup.__dict__.items()
                  if isinstance(v, (str, int, float, tuple, list))},
    }
    write_text_atomic(out_dir / "run.json", json.dumps(summary, indent=2) + "\n")
    summary["table"] = table
    return summary

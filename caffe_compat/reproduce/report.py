"""What ``reproduce`` reports from its runs: the spread over seeds, ``results.md``, ``results.json``,
the two figures and the terminal's closing summary.

Spread.  Every ± and error bar is the *sample* standard deviation over the n seeds of a loss (numpy
``ddof=1``, :func:`seed_spread`), in results.md, results.json, run.json's ``figures`` and
``recall_at_k.png`` alike; with a single seed there is none (``std`` null, no ±, no error bar).

``results.json``: ``{"dataset", "data_set" (the name the tables use), "spread" (what std means),
"losses": {loss: {"runs": [{"seed", "metrics"}], "summary": {metric: {"n", "mean", "std", "per_seed"}}}}}``
with the summary metrics of :func:`summary_metrics` (e.g. ``recall_at_1``, ``map_at_r``, ``nmi``).
"""

from __future__ import annotations

import numpy as np

SPREAD = "sample standard deviation over seeds (ddof=1); null with one seed"


def seed_spread(values) -> dict:
    """``{"n", "mean", "std", "per_seed"}`` of one figure over seeds; ``std`` is the sample standard
    deviation (ddof=1), None for a single seed."""
    values = np.asarray(values, dtype=np.float64).reshape(-1)
    return {"n": int(values.size), "mean": float(values.mean()),
            "std": float(values.std(ddof=1)) if values.size > 1 else None,
            "per_seed": [float(v) for v in values]}


def metric_columns(setup) -> list[tuple[str, str]]:
    """``(key, column title)`` of the figures summarised over seeds, the headline first."""
    if setup.protocol == "vehicleid":
        return [("top_1_small", "top-1 (small)"), ("top_5_small", "top-5 (small)")]
    columns = [("recall_at_1", "Recall@1"), ("map_at_r", "MAP@R")]
    return columns + ([("nmi", "NMI")] if setup.protocol == "cub200" else [])


def headline(setup, metrics: dict) -> float:
    """The headline figure of a run (Recall@1, or top-1 on VehicleID's small list)."""
    return metric_value(metrics, metric_columns(setup)[0][0])


def metric_value(metrics: dict, key: str) -> float:
    """One :func:`metric_columns` figure (a fraction) of a run's protocol dict."""
    if key.startswith("top_"):
        rank, split = key.rsplit("_", 1)
        return metrics["splits"][split][rank]["mean"]
    if key.startswith("recall_at_"):
        return metrics["recall_at_k"][key[len("recall_at_"):]]
    return metrics[key]


def summary_metrics(setup, runs: list[dict]) -> dict:
    """:func:`seed_spread` of every :func:`metric_columns` figure, plus ``recall_at_k`` (per K) for the
    retrieval protocols, over the ``runs`` of one loss (each ``{"seed", "metrics", ...}``)."""
    summary = {key: seed_spread([metric_value(r["metrics"], key) for r in runs]) for key, _ in metric_columns(setup)}
    if setup.protocol != "vehicleid":
        ks = runs[0]["metrics"]["recall_at_k"]
        summary["recall_at_k"] = {k: seed_spread([r["metrics"]["recall_at_k"][k] for r in runs]) for k in ks}
    return summary


def results_json(setup, per_loss: dict) -> dict:
    """The content of ``results.json`` (module docstring)."""
    return {"dataset": setup.name, "data_set": setup.display_name, "spread": SPREAD,
            "losses": {loss: {"runs": [{"seed": r["seed"], "metrics": r["metrics"]} for r in runs],
                              "summary": summary_metrics(setup, runs)} for loss, runs in per_loss.items()}}


def _cell(spread: dict) -> str:
    mean = f"{100 * spread['mean']:.1f}"
    return mean if spread["std"] is None else f"{mean} ± {100 * spread['std']:.1f}"


def spread_note(seeds) -> str:
    """The line saying what ± means (or that there is none)."""
    if len(seeds) < 2:
        return f"One seed ({', '.join(map(str, seeds))}): no spread over seeds is shown (it needs n >= 2)."
    return f"± = sample standard deviation over n = {len(seeds)} seeds ({', '.join(map(str, seeds))}; ddof = 1)."


def results_markdown(setup, per_loss: dict, *, max_iter: int, seeds, data_note: str = "") -> str:
    """``results.md``: the paper's table of the means over seeds, then every summary figure as mean ±
    sample std with the headline figure per seed."""
    from caffe_compat.evaluate.protocols import paper_tables

    means = {loss: {setup.protocol: mean_metrics(runs)} for loss, runs in per_loss.items()}
    columns = metric_columns(setup)
    lines = [f"# {setup.display_name}: {max_iter} iterations per run, {len(seeds)} seed(s) per loss", ""]
    if data_note:
        lines += [data_note, ""]
    lines += ["Means over the seeds, in the paper's layout (%):", "",
              paper_tables(means, digits=1, with_std=setup.protocol == "vehicleid",
                           titles={setup.protocol: setup.display_name}).rstrip(), ""]
    if setup.protocol == "vehicleid":
        lines += ["In Table 2, ± is the spread over the evaluation's random galleries (population std, as "
                  "`evaluate_vehicleid` reports it), averaged over seeds; the spread over seeds is below.", ""]
    lines += [f"Over seeds (mean{' ± std' if len(seeds) > 1 else ''}, %):", "", spread_note(seeds), "",
              "| Method | seeds | " + " | ".join(title for _, title in columns) + f" | {columns[0][1]} per seed |",
              "|---|---:|" + "---:|" * len(columns) + "---|"]
    for loss, runs in per_loss.items():
        summary = summary_metrics(setup, runs)
        per_seed = ", ".join(f"{100 * v:.1f}" for v in summary[columns[0][0]]["per_seed"])
        lines.append(f"| {loss} | {len(runs)} | " + " | ".join(_cell(summary[key]) for key, _ in columns)
                     + f" | {per_seed} |")
    return "\n".join(lines) + "\n"


def mean_metrics(runs: list[dict]) -> dict:
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


def read_loss_log(path) -> tuple[np.ndarray, np.ndarray]:
    """``(iterations, loss)`` from a run's ``train_log.csv``, the last row of each iteration (a resumed
    run may have logged one twice), in iteration order."""
    data = np.atleast_1d(np.genfromtxt(path, delimiter=",", names=True))
    iterations, last = np.unique(data["iter"][::-1], return_index=True)
    return iterations.astype(np.int64), np.atleast_1d(data["loss"][::-1][last])


def write_figures(setup, out_dir, per_loss: dict, run_dirs: dict) -> list[str]:
    """``training_loss.png`` and ``recall_at_k.png`` (``cmc.png`` for VehicleID) in ``out_dir``; their
    paths, none when matplotlib is missing.  ``run_dirs[(loss, seed)]``: where each run's log lies."""
    from importlib.util import find_spec

    if find_spec("matplotlib") is None:
        return []
    from caffe_compat.evaluate.plots import plot_cmc, plot_recall_at_k, plot_training_loss

    panels = {loss: {f"seed {r['seed']}": read_loss_log(run_dirs[loss, r["seed"]] / "train_log.csv")
                     for r in runs} for loss, runs in per_loss.items()}
    shortest = min(len(iters) for seeds in panels.values() for iters, _ in seeds.values())
    written = [plot_training_loss(panels, out_dir / "training_loss.png", window=max(1, min(10, shortest // 10)),
                                  title=f"{setup.display_name}: training loss")]
    if setup.protocol == "vehicleid":
        curves = {loss: mean_metrics(runs)["splits"]["small"]["cmc"] for loss, runs in per_loss.items()}
        written.append(plot_cmc(curves, out_dir / "cmc.png", title=f"{setup.display_name}: CMC, small test list"))
        return [str(p) for p in written]
    labels = {loss: f"{loss} (n = {len(runs)})" for loss, runs in per_loss.items()}
    summaries = {loss: summary_metrics(setup, runs)["recall_at_k"] for loss, runs in per_loss.items()}
    curves = {labels[loss]: {k: s["mean"] for k, s in ks.items()} for loss, ks in summaries.items()}
    spread = {labels[loss]: {k: s["std"] for k, s in ks.items()} for loss, ks in summaries.items()
              if len(per_loss[loss]) > 1}
    bars = "error bars: ± sample std over seeds" if spread else "one seed: no error bars"
    written.append(plot_recall_at_k(curves, out_dir / "recall_at_k.png", spread=spread,
                                    title=f"{setup.display_name}: Recall@K, mean over seeds\n({bars})"))
    return [str(p) for p in written]


def closing_summary(runs: list[dict], wall_seconds: float) -> str:
    """The terminal's last line about the runs: how many were reused from disk, resumed from a
    snapshot or trained here, and the wall time."""
    reused = sum(1 for r in runs if r["reused"])
    resumed = [r for r in runs if not r["reused"] and r["resumed_from"] is not None]
    trained = len(runs) - reused - len(resumed)
    parts = [f"{reused} reused from disk (weights, ONNX and metrics of an earlier invocation)"]
    if resumed:
        parts.append(f"{len(resumed)} resumed from a snapshot ("
                     + ", ".join(f"{r['loss']} seed {r['seed']} at iteration {r['resumed_from']}" for r in resumed) + ")")
    parts.append(f"{trained} trained from scratch")
    return f"{len(runs)} runs: " + "; ".join(parts) + f"; {wall_seconds:.0f} s wall"

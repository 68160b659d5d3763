"""Per-dataset evaluation protocols of the FAPPY paper, as JSON-able dicts and markdown tables.

=========  ==============================================================  =====================
protocol   metrics                                                         paper
=========  ==============================================================  =====================
cub200     Recall@1,2,4,8,16,32 + NMI (k-means, seed) + MAP@R, precision@1  Table 1, left
sop        Recall@1,10,100,1000 + MAP@R, precision@1 (no NMI: 11,316        Table 1, right
           clusters)
vehicleid  top-1 / top-5 match rate, mean ± std over 10 random galleries,  Table 2, Fig. 6
           for the small / medium / large test lists
=========  ==============================================================  =====================

Every result dict holds only str keys, ints, floats and lists, so ``json.dumps`` round-trips it
(Recall@K keys are the strings ``"1"``, ``"2"``, ...). :func:`paper_tables` lays results out like the
paper's Tables 1 and 2: values in percent with one decimal, ``/`` where a method has no result.

``device`` (CPU or CUDA) decides where the k-NN runs; the figures do not depend on it: every count-based
figure (Recall@K, precision@1, the CMC curves and their top-k mean and spread, NMI) is bit-identical on
the CPU and CUDA, MAP@R (a mean of per-query average precisions reduced on the device) agrees to float64
rounding (~1e-16).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from caffe_compat.evaluate.inputs import EvaluationInputError
from caffe_compat.evaluate.knn import DEFAULT_BUDGET_BYTES
from caffe_compat.evaluate.nmi import nmi
from caffe_compat.evaluate.retrieval import retrieval_metrics
from caffe_compat.evaluate.vehicleid import vehicleid_cmc_curves

CUB200_KS = (1, 2, 4, 8, 16, 32)
SOP_KS = (1, 10, 100, 1000)
VEHICLEID_RANKS = (1, 5)
VEHICLEID_SPLITS = ("small", "medium", "large")
DATASET_TITLES = {"cub200": "CUB-200-2011", "sop": "Stanford Online Products", "vehicleid": "VehicleID"}


def _fraction(value: float, n: int) -> float:
    """``count / n`` as the correctly rounded float64, from a device's rounding of it.

    The k-NN decisions (ranks, hits) are the same on every device; only the last division / mean may round
    differently on CUDA (e.g. by a reciprocal).  Rounding back to the integer count and dividing here makes
    every count-based figure bit-identical across devices (and equal to the CPU's value)."""
    return round(value * n) / n if n > 0 else value


def _retrieval(name, features, labels, ks, device, budget_bytes) -> dict:
    scores = retrieval_metrics(features, labels, ks, device=device, budget_bytes=budget_bytes)
    values = np.asarray(labels.detach().cpu() if isinstance(labels, torch.Tensor) else labels).reshape(-1)
    codes = np.unique(values, return_inverse=True)[1].reshape(-1)
    with_positive = int((np.bincount(codes)[codes] >= 2).sum())  # queries with another same-label item
    n = int(len(codes))
    return {
        "protocol": name,
        "num_images": n,
        "recall_at_k": {str(k): _fraction(v, n) for k, v in scores["recall_at_k"].items()},
        "map_at_r": scores["map_at_r"],
        "precision_at_1": _fraction(scores["precision_at_1"], with_positive),
    }


def evaluate_cub200(features, labels, *, seed: int = 0, device=None, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> dict:
    """CUB-200-2011 test set (5,924 images of classes 101-200): Recall@1..32, MAP@R, precision@1, NMI."""
    result = _retrieval("cub200", features, labels, CUB200_KS, device, budget_bytes)
    result["nmi"] = nmi(features, labels, seed, device=device, budget_bytes=budget_bytes)
    result["nmi_seed"] = int(seed)
    return result


def evaluate_sop(features, labels, *, device=None, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> dict:
    """Stanford Online Products test set (60,502 images): Recall@1,10,100,1000, MAP@R, precision@1."""
    return _retrieval("sop", features, labels, SOP_KS, device, budget_bytes)


def evaluate_vehicleid(
    splits: Mapping[str, tuple], *, repeats: int = 10, seed: int = 0, device=None, budget_bytes: int = DEFAULT_BUDGET_BYTES
) -> dict:
    """VehicleID: ``splits`` maps "small"/"medium"/"large" to ``(features, vehicle_ids)`` of that test
    list. Per split: top-1 and top-5 match rate (mean, std over ``repeats``) and the mean CMC curve."""
    unknown = sorted(set(splits) - set(VEHICLEID_SPLITS))
    if unknown or not splits:
        raise EvaluationInputError(f"VehicleID splits must be among {VEHICLEID_SPLITS}, got {sorted(splits)}")
    result = {"protocol": "vehicleid", "repeats": int(repeats), "seed": int(seed), "splits": {}}
    for name in VEHICLEID_SPLITS:
        if name not in splits:
            continue
        features, ids = splits[name]
        try:
            curves = vehicleid_cmc_curves(features, ids, repeats, seed, device=device, budget_bytes=budget_bytes)
        except EvaluationInputError as exc:  # which of the (up to three) test lists it is
            raise EvaluationInputError(f"VehicleID {name} test list: {exc}") from None
        queries = int(len(ids)) - int(curves.shape[1])  # per repeat: all images but one per vehicle
        curves = torch.round(curves.cpu() * queries) / queries  # counts / queries, rounded alike on every device
        entry = {"num_images": int(len(ids)), "num_vehicles": int(curves.shape[1])}
        for k in VEHICLEID_RANKS:
            column = curves[:, min(k, curves.shape[1]) - 1]
            entry[f"top_{k}"] = {"mean": float(column.mean()), "std": float(column.std(unbiased=False))}
        entry["cmc"] = [float(v) for v in curves.mean(0)]
        result["splits"][name] = entry
    return result


PROTOCOLS = {"cub200": evaluate_cub200, "sop": evaluate_sop, "vehicleid": evaluate_vehicleid}


def _percent(value, digits: int) -> str:
    return "/" if value is None else f"{100.0 * value:.{digits}f}"


def _row(cells) -> str:
    return "| " + " | ".join(cells) + " |"


def retrieval_table(results: Mapping[str, Mapping[str, dict]], digits: int = 1,
                    titles: Mapping[str, str] | None = None) -> str:
    """Table 1 layout: one row per method, Recall@K (%) for CUB-200-2011 (K = 1..32, then NMI) and
    SOP (K = 1, 10, 100, 1000); ``results[method]["cub200" | "sop"]`` are protocol dicts.  ``titles``
    renames a protocol's column group (default :data:`DATASET_TITLES`), e.g. for another data set
    evaluated with the CUB-200-2011 protocol."""
    datasets = [d for d in ("cub200", "sop") if any(d in r for r in results.values())]
    if not datasets:
        raise EvaluationInputError("no cub200 or sop result to tabulate")
    names = {**DATASET_TITLES, **(titles or {})}
    header, rule = ["Method"], ["---"]
    for d in datasets:
        ks = CUB200_KS if d == "cub200" else SOP_KS
        header += [f"{names[d]} R@{k}" if i == 0 else f"R@{k}" for i, k in enumerate(ks)]
        header += ["NMI"] if d == "cub200" else []
        rule += ["---:"] * (len(ks) + (d == "cub200"))
    lines = [_row(header), _row(rule)]
    for method, per_dataset in results.items():
        cells = [method]
        for d in datasets:
            r = per_dataset.get(d)
            ks = CUB200_KS if d == "cub200" else SOP_KS
            cells += [_percent(None if r is None else r["recall_at_k"].get(str(k)), digits) for k in ks]
            if d == "cub200":
                cells.append(_percent(None if r is None else r.get("nmi"), digits))
        lines.append(_row(cells))
    return "\n".join(lines)


def reid_table(results: Mapping[str, Mapping[str, dict]], digits: int = 1, with_std: bool = False) -> str:
    """Table 2 layout: match rate (%) top-1 / top-5 on the small, medium and large VehicleID lists."""
    header, rule = ["Method"], ["---"]
    for split in VEHICLEID_SPLITS:
        header += [f"{split.capitalize()} Top {k}" for k in VEHICLEID_RANKS]
        rule += ["---:"] * len(VEHICLEID_RANKS)
    lines = [_row(header), _row(rule)]
    for method, per_dataset in results.items():
        splits = per_dataset.get("vehicleid", {}).get("splits", {})
        cells = [method]
        for split in VEHICLEID_SPLITS:
            for k in VEHICLEID_RANKS:
                stat = splits.get(split, {}).get(f"top_{k}")
                cell = _percent(None if stat is None else stat["mean"], digits)
                if stat is not None and with_std:
                    cell += f" ± {100.0 * stat['std']:.{digits}f}"
                cells.append(cell)
        lines.append(_row(cells))
    return "\n".join(lines)


def paper_tables(results: Mapping[str, Mapping[str, dict]], digits: int = 1, with_std: bool = False,
                 titles: Mapping[str, str] | None = None) -> str:
    """Markdown for Table 1 (if any CUB/SOP result) and Table 2 (if any VehicleID result); ``titles``:
    see :func:`retrieval_table`."""
    parts = []
    if any(d in r for r in results.values() for d in ("cub200", "sop")):
        parts.append("Table 1. Recall@K (%) of fine-grained image retrieval\n\n" + retrieval_table(results, digits, titles))
    if any("vehicleid" in r for r in results.values()):
        parts.append("Table 2. Match rate (%) of vehicle re-identification\n\n" + reid_table(results, digits, with_std))
    if not parts:
        raise EvaluationInputError("no cub200, sop or vehicleid result to tabulate")
    return "\n\n".join(parts) + "\n"

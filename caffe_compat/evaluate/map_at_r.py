"""MAP@R and precision@1 (Musgrave, Belongie, Lim: "A Metric Learning Reality Check", 2020).

For a query q with ``R_q`` other items of its label (the query itself excluded):

    AP@R(q) = (1/R_q) Σ_{i=1..R_q} P(i) · rel(i),   P(i) = (1/i) Σ_{j<=i} rel(j)

over q's ranked neighbours (cosine on L2-normalised features, query masked by index, ties by lower
index first: :mod:`caffe_compat.evaluate.knn`); MAP@R is the mean over queries. Precision@1 is the
fraction of queries whose nearest other item has their label. Both average over the queries with
``R_q >= 1`` only (a label with a single item has no answer), as pytorch-metric-learning's
``AccuracyCalculator`` does, so with no such lone query precision@1 equals Recall@1.
"""

from __future__ import annotations

import torch

from caffe_compat.evaluate.inputs import EvaluationInputError, as_features, as_labels
from caffe_compat.evaluate.knn import DEFAULT_BUDGET_BYTES, SimilarityBlock, self_topk


def relevant_counts(labels: torch.Tensor) -> torch.Tensor:
    """``R_q``: the number of *other* items sharing each item's label (labels as dense codes)."""
    r = torch.bincount(labels)[labels] - 1
    if int(r.max()) < 1:
        raise EvaluationInputError("no label has two items: MAP@R and precision@1 are undefined")
    return r


def average_precision_at_r(
    columns: torch.Tensor, query_labels: torch.Tensor, reference_labels: torch.Tensor, r: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(AP@R, hit@1)`` per query (float64, bool) from its ranked neighbours ``columns`` (at least
    ``max(r)`` of them, best first); ``r`` holds the queries' ``R_q``."""
    r_max = columns.shape[1]
    relevant = reference_labels[columns] == query_labels[:, None]
    positions = torch.arange(1, r_max + 1, device=columns.device)
    relevant &= positions[None, :] <= r[:, None]
    precision = relevant.cumsum(dim=1).to(torch.float64) / positions.to(torch.float64)
    ap = (precision * relevant).sum(dim=1) / r.clamp_min(1).to(torch.float64)
    return ap, relevant[:, 0]


def block_average_precision_at_r(block: SimilarityBlock, r: torch.Tensor, r_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(AP@R, hit@1)`` per row of ``block`` (float64, bool); ``r`` holds the rows' ``R_q``."""
    _, columns = block.topk(r_max)
    return average_precision_at_r(columns, block.query_labels, block.reference_labels, r)


def ranking_scores(features, labels, *, device=None, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> dict[str, float]:
    """``{"map_at_r": ..., "precision_at_1": ...}`` from the top-``max(R_q)`` neighbours of every
    query (:func:`~caffe_compat.evaluate.knn.self_topk`: one pass over half the similarity matrix, or over whole
    rows when ``max(R_q)`` is large)."""
    x = as_features(features, device)
    y = as_labels(labels, x.shape[0], x.device)
    r = relevant_counts(y)
    aps, hits = [], []
    for start, _, columns in self_topk(x, int(r.max()), budget_bytes=budget_bytes):
        stop = start + len(columns)
        ap, hit = average_precision_at_r(columns, y[start:stop], y, r[start:stop])
        aps.append(ap)
        hits.append(hit)
    valid = r >= 1
    return {
        "map_at_r": float(torch.cat(aps)[valid].mean()),
        "precision_at_1": float(torch.cat(hits)[valid].to(torch.float64).mean()),
    }


def map_at_r(features, labels, *, device=None, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> float:
    """Mean average precision at R (queries with at least one other item of their label)."""
    return ranking_scores(features, labels, device=device, budget_bytes=budget_bytes)["map_at_r"]


def precision_at_1(features, labels, *, device=None, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> float:
    """Fraction of queries (with R_q >= 1) whose nearest other item shares their label."""
    x = as_features(features, device)
    y = as_labels(labels, x.shape[0], x.device)
    valid = relevant_counts(y) >= 1
    hits = []
    for start, _, columns in self_topk(x, 1, budget_bytes=budget_bytes):
        hits.append(y[columns[:, 0]] == y[start : start + len(columns)])
    return float(torch.cat(hits)[valid].to(torch.float64).mean())

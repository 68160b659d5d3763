"""All retrieval metrics of one feature set from a single pass over its similarity matrix.

Recall@K (:mod:`caffe_compat.evaluate.recall`), MAP@R and precision@1
(:mod:`caffe_compat.evaluate.map_at_r`) share the definitions of their modules (query masked by index,
cosine on L2-normalised features, ties by lower index first); this module only avoids computing the
chunked ``N × N`` cosine matrix once per metric, which dominates the cost on SOP-size sets.
"""

from __future__ import annotations

import torch

from caffe_compat.evaluate.inputs import as_features, as_ks, as_labels
from caffe_compat.evaluate.knn import DEFAULT_BUDGET_BYTES, similarity_blocks
from caffe_compat.evaluate.map_at_r import block_average_precision_at_r, relevant_counts
from caffe_compat.evaluate.recall import recall_from_ranks


def retrieval_metrics(
    features,
    labels,
    ks=(1, 2, 4, 8),
    *,
    with_map_at_r: bool = True,
    device=None,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
) -> dict:
    """``{"recall_at_k": {K: float}, "map_at_r": float, "precision_at_1": float}`` (the last two only
    when ``with_map_at_r``)."""
    ks = as_ks(ks)
    x = as_features(features, device)
    y = as_labels(labels, x.shape[0], x.device)
    r = relevant_counts(y) if with_map_at_r else None
    r_max = int(r.max()) if with_map_at_r else 0
    ranks, aps, hits = [], [], []
    for block in similarity_blocks(x, query_labels=y, budget_bytes=budget_bytes, extra_bytes_per_row=24 * r_max):
        ranks.append(block.first_match_rank())
        if with_map_at_r:
            ap, hit = block_average_precision_at_r(block, r[block.start : block.start + len(block.sims)], r_max)
            aps.append(ap)
            hits.append(hit)
    result = {"recall_at_k": recall_from_ranks(torch.cat(ranks), ks)}
    if with_map_at_r:
        valid = r >= 1
        result["map_at_r"] = float(torch.cat(aps)[valid].mean())
        result["precision_at_1"] = float(torch.cat(hits)[valid].to(torch.float64).mean())
    return result

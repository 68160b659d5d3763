"""Recall@K for retrieval (Song et al. 2016; the FAPPY paper's Table 1).

``Recall@K = (1/N) Σ_q [ some item of q's label is among q's K nearest other items ]``: every test
image is a query against all *other* test images (the query is masked by index, so an exact duplicate
of it is a legitimate neighbour), cosine similarity on L2-normalised features, ties ranked by lower
index first (see :mod:`caffe_compat.evaluate.knn`). Computed for all K at once from the rank of each
query's first same-label neighbour, found by counting (no top-K list, so K = 1000 on SOP costs the
same as K = 1). A query whose label has no other item scores 0 and stays in the denominator (the
paper averages "over all the query images"). Defaults: K = 1, 2, 4, 8 (CUB uses up to 32, SOP 1, 10,
100, 1000).
"""

from __future__ import annotations

import torch

from caffe_compat.evaluate.inputs import as_features, as_ks, as_labels
from caffe_compat.evaluate.knn import DEFAULT_BUDGET_BYTES, similarity_blocks


def first_match_ranks(features, labels, *, device=None, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> torch.Tensor:
    """Per query, the 0-based rank of its first same-label neighbour among the other items (-1: none)."""
    x = as_features(features, device)
    y = as_labels(labels, x.shape[0], x.device)
    return torch.cat([block.first_match_rank() for block in similarity_blocks(x, query_labels=y, budget_bytes=budget_bytes)])


def recall_from_ranks(ranks: torch.Tensor, ks) -> dict[int, float]:
    """``{K: mean(0 <= rank < K)}`` over all queries (rank -1 = no same-label item = a miss)."""
    ranks = ranks.to(torch.int64)
    found = ranks >= 0
    return {k: float((found & (ranks < k)).to(torch.float64).mean()) for k in as_ks(ks)}


def recall_at_k(
    features, labels, ks=(1, 2, 4, 8), *, device=None, budget_bytes: int = DEFAULT_BUDGET_BYTES
) -> dict[int, float]:
    """Recall@K for each K in ``ks`` (fractions in [0, 1]), keys in ascending order."""
    ks = as_ks(ks)
    return recall_from_ranks(first_match_ranks(features, labels, device=device, budget_bytes=budget_bytes), ks)

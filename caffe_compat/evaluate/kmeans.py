"""Seeded k-means (Lloyd's algorithm with k-means++ seeding) in torch, on the features' device.

Seeding (Arthur & Vassilvitskii 2007): the first centre is a uniformly drawn point, each next one a
point drawn with probability ∝ D(x)², its squared distance to the nearest centre chosen so far. Then
Lloyd iterations: assign every point to its nearest centre (ties: lowest centre index), move each
centre to the mean of its points (an empty cluster keeps its centre), until no assignment changes or
``max_iter`` (default 100) iterations. One initialisation (no ``n_init`` restarts).

Determinism: random draws come from a CPU ``torch.Generator`` seeded with ``seed``, so CPU and CUDA
draw the same numbers; cluster sums use a stable sort and a float64 cumulative sum rather than
scatter-adds (atomic adds on CUDA are not reproducible). Distances are computed in row chunks so
the N×k block stays under ``budget_bytes``.
"""

from __future__ import annotations

import torch

from caffe_compat.evaluate.inputs import EvaluationInputError
from caffe_compat.evaluate.knn import DEFAULT_BUDGET_BYTES
from caffe_compat.losses.pairwise import squared_euclidean_matrix


def nearest_centres(x: torch.Tensor, centres: torch.Tensor, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> torch.Tensor:
    """Index of the nearest centre (squared Euclidean; ties: lowest index) of every row of ``x``."""
    rows = max(1, int(budget_bytes // (16 * centres.shape[0])))
    return torch.cat([squared_euclidean_matrix(x[s : s + rows], centres).argmin(dim=1) for s in range(0, len(x), rows)])


def kmeans_plus_plus(x: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """k initial centres drawn by k-means++ (float32 rows of ``x``)."""
    n = x.shape[0]
    first = int(torch.randint(n, (1,), generator=generator))
    centres = x.new_empty((k, x.shape[1]))
    centres[0] = x[first]
    d2 = squared_euclidean_matrix(x, centres[:1])[:, 0].to(torch.float64)
    uniform = torch.rand(k, generator=generator, dtype=torch.float64).to(x.device)
    for j in range(1, k):
        cumulative = d2.cumsum(0)
        total = cumulative[-1]
        # all points already sit on a centre: fall back to a uniform draw
        target = torch.where(total > 0, uniform[j] * total, uniform[j] * n)
        weights = torch.where(total > 0, cumulative, torch.arange(1, n + 1, device=x.device, dtype=torch.float64))
        index = torch.searchsorted(weights, target.reshape(1), right=True).clamp_max(n - 1)
        centres[j] = x.index_select(0, index)[0]
        d2 = torch.minimum(d2, squared_euclidean_matrix(x, centres[j : j + 1])[:, 0].to(torch.float64))
    return centres


def cluster_means(x: torch.Tensor, assignment: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """Mean of each cluster's points (float64 segment sums, deterministic); empty clusters keep ``previous``."""
    k = previous.shape[0]
    order = torch.sort(assignment, stable=True).indices
    counts = torch.bincount(assignment, minlength=k)
    cumulative = torch.cat([x.new_zeros((1, x.shape[1]), dtype=torch.float64), x[order].to(torch.float64).cumsum(0)])
    ends = counts.cumsum(0)
    sums = cumulative[ends] - cumulative[ends - counts]
    means = (sums / counts.clamp_min(1)[:, None]).to(x.dtype)
    return torch.where((counts > 0)[:, None], means, previous)


def kmeans(
    x: torch.Tensor, k: int, *, seed: int = 0, max_iter: int = 100, budget_bytes: int = DEFAULT_BUDGET_BYTES
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(assignment, centres)`` of k-means on the rows of the float tensor ``x``."""
    if not 1 <= k <= x.shape[0]:
        raise EvaluationInputError(f"k-means needs 1 <= k <= {x.shape[0]} points, got k={k}")
    generator = torch.Generator().manual_seed(int(seed))
    centres = kmeans_plus_plus(x, k, generator)
    assignment = nearest_centres(x, centres, budget_bytes)
    for _ in range(max_iter):
        centres = cluster_means(x, assignment, centres)
        updated = nearest_centres(x, centres, budget_bytes)
        if torch.equal(updated, assignment):
            break
        assignment = updated
    return assignment, centres

"""VehicleID re-identification protocol (Liu et al. 2016, as used by the FAPPY paper's Table 2 / Fig. 6).

Per repeat: one image per vehicle, drawn at random, forms the gallery (so the gallery has one image of
every vehicle of the test list); every other image is a query. Each query ranks the gallery by cosine
similarity of L2-normalised features (ties: lower gallery position first, the gallery being ordered
by vehicle id; see :mod:`caffe_compat.evaluate.knn`); its match rank is the position of its own
vehicle's gallery image. The CMC curve is ``CMC(k) = fraction of queries with match rank < k`` for
k = 1..G, and "top-k match rate" is CMC(k). The protocol repeats the draw (default 10 times, seed 0,
draws from a CPU ``torch.Generator`` so every device sees the same splits) and reports the mean and
the population standard deviation (ddof = 0) over repeats. Vehicles with a single image add a
gallery image (a distractor) and no query.
"""

from __future__ import annotations

import numpy as np
import torch

from caffe_compat.evaluate.inputs import EvaluationInputError, as_features, as_ks, as_labels
from caffe_compat.evaluate.knn import DEFAULT_BUDGET_BYTES, similarity_blocks


def gallery_split(vehicle_codes: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gallery, queries)`` indices: one random image per vehicle (gallery sorted by vehicle), the rest."""
    codes = vehicle_codes.cpu()
    permutation = torch.randperm(len(codes), generator=generator)
    sorted_codes, order = torch.sort(codes[permutation], stable=True)
    leader = torch.ones_like(sorted_codes, dtype=torch.bool)
    leader[1:] = sorted_codes[1:] != sorted_codes[:-1]
    gallery = permutation[order[leader]]
    is_query = torch.ones(len(codes), dtype=torch.bool)
    is_query[gallery] = False
    return gallery, torch.nonzero(is_query)[:, 0]


def vehicleid_cmc_curves(
    features, vehicle_ids, repeats: int = 10, seed: int = 0, *, device=None, budget_bytes: int = DEFAULT_BUDGET_BYTES
) -> torch.Tensor:
    """CMC curve of every repeat: float64 tensor ``(repeats, G)``, entry ``[t, k-1]`` = CMC(k)."""
    if int(repeats) < 1:
        raise EvaluationInputError(f"repeats must be >= 1, got {repeats}")
    x = as_features(features, device)
    y = as_labels(vehicle_ids, x.shape[0], x.device, name="vehicle_ids")
    n_vehicles = int(y.max()) + 1
    if n_vehicles == x.shape[0]:
        raise EvaluationInputError("every vehicle has a single image: the protocol has no query")
    generator = torch.Generator().manual_seed(int(seed))
    curves = []
    for _ in range(int(repeats)):
        gallery, queries = gallery_split(y, generator)
        curves.append(_cmc(x, y, gallery.to(x.device), queries.to(x.device), budget_bytes))
    return torch.stack(curves).cpu()


def _cmc(x, y, gallery, queries, budget_bytes) -> torch.Tensor:
    blocks = similarity_blocks(x[queries], x[gallery], query_labels=y[queries], reference_labels=y[gallery], budget_bytes=budget_bytes)
    ranks = torch.cat([block.first_match_rank() for block in blocks])
    if bool((ranks < 0).any()):
        raise EvaluationInputError("some query's vehicle has no image in the gallery")
    return torch.bincount(ranks, minlength=len(gallery)).cumsum(0).to(torch.float64) / len(queries)


def gallery_cmc(
    features, vehicle_ids, gallery, *, device=None, budget_bytes: int = DEFAULT_BUDGET_BYTES
) -> np.ndarray:
    """CMC curve (length = gallery size) for one given gallery: ``gallery`` lists image indices, every
    other image is a query and must have its vehicle in the gallery. Gallery ties: gallery order."""
    x = as_features(features, device)
    y = as_labels(vehicle_ids, x.shape[0], x.device, name="vehicle_ids")
    gallery = torch.as_tensor(np.asarray(gallery), dtype=torch.int64).reshape(-1)
    if gallery.numel() == 0 or int(gallery.min()) < 0 or int(gallery.max()) >= x.shape[0] or len(torch.unique(gallery)) != len(gallery):
        raise EvaluationInputError(f"gallery must list distinct image indices in [0, {x.shape[0]})")
    is_query = torch.ones(x.shape[0], dtype=torch.bool)
    is_query[gallery] = False
    queries = torch.nonzero(is_query)[:, 0]
    if len(queries) == 0:
        raise EvaluationInputError("the gallery holds every image: no query left")
    return _cmc(x, y, gallery.to(x.device), queries.to(x.device), budget_bytes).cpu().numpy()


def vehicleid_cmc_curve(
    features, vehicle_ids, repeats: int = 10, seed: int = 0, *, device=None, budget_bytes: int = DEFAULT_BUDGET_BYTES
) -> np.ndarray:
    """Mean CMC curve over repeats, ``curve[k-1]`` = top-k match rate, k = 1..number of vehicles."""
    return vehicleid_cmc_curves(features, vehicle_ids, repeats, seed, device=device, budget_bytes=budget_bytes).mean(0).numpy()


def vehicleid_cmc(
    features,
    vehicle_ids,
    repeats: int = 10,
    seed: int = 0,
    ranks=(1, 5),
    *,
    device=None,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
) -> dict[int, tuple[float, float]]:
    """``{k: (mean, std)}`` of the top-k match rate over ``repeats`` random gallery draws."""
    ranks = as_ks(ranks, "ranks")
    curves = vehicleid_cmc_curves(features, vehicle_ids, repeats, seed, device=device, budget_bytes=budget_bytes)
    last = curves.shape[1]
    return {
        k: (float(curves[:, min(k, last) - 1].mean()), float(curves[:, min(k, last) - 1].std(unbiased=False)))
        for k in ranks
    }

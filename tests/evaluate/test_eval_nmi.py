"""NMI against scikit-learn, and the seeded torch k-means it clusters with."""

import numpy as np
import pytest
import torch
from sklearn.metrics import normalized_mutual_info_score

from caffe_compat.errors import CaffeCompatError
from caffe_compat.evaluate import kmeans, nmi, normalized_mutual_information
from caffe_compat.evaluate.kmeans import kmeans_plus_plus


@pytest.mark.parametrize("seed, n, ka, kb", [(0, 500, 7, 5), (1, 50, 20, 20), (2, 1000, 2, 90), (3, 30, 1, 4)])
def test_nmi_equals_sklearn(seed, n, ka, kb):
    rng = np.random.default_rng(seed)
    a, b = rng.integers(0, ka, n), rng.integers(0, kb, n)
    assert normalized_mutual_information(a, b) == pytest.approx(normalized_mutual_info_score(a, b), abs=1e-12)


def test_nmi_edge_cases_match_sklearn():
    cases = [([0, 0, 0], [1, 1, 1]), ([0, 1, 2], [5, 6, 7]), ([0, 0, 1, 1], [0, 1, 0, 1]), ([3, 3, 4], [0, 0, 0])]
    for a, b in cases:
        assert normalized_mutual_information(a, b) == pytest.approx(normalized_mutual_info_score(a, b), abs=1e-12)
    assert normalized_mutual_information([0, 1, 2], [5, 6, 7]) == pytest.approx(1.0, abs=1e-15)
    with pytest.raises(CaffeCompatError):
        normalized_mutual_information([0, 1], [0, 1, 2])


def blobs(seed=0, classes=6, per_class=20, spread=0.02):
    rng = np.random.default_rng(seed)
    labels = np.repeat(np.arange(classes), per_class)
    x = np.eye(16)[labels] + spread * rng.normal(size=(classes * per_class, 16))
    perm = rng.permutation(len(labels))
    return x[perm].astype(np.float32), labels[perm]


def test_kmeans_recovers_separated_clusters_and_nmi_is_one():
    x, y = blobs()
    assignment, centres = kmeans(torch.from_numpy(x), 6, seed=0)
    # a perfect partition: NMI 1 and every true class maps to exactly one cluster
    assert normalized_mutual_info_score(y, assignment.numpy()) == pytest.approx(1.0, abs=1e-12)
    for label in range(6):
        members = torch.from_numpy(x[y == label]).mean(0)
        cluster = int(assignment[np.flatnonzero(y == label)[0]])
        torch.testing.assert_close(centres[cluster], members, rtol=0, atol=1e-6)
    assert nmi(x, y, seed=0) == pytest.approx(1.0, abs=1e-12)


def test_kmeans_is_seeded_and_matches_lloyd_fixed_point():
    rng = np.random.default_rng(4)
    x = torch.from_numpy(rng.normal(size=(200, 5)).astype(np.float32))
    a1, c1 = kmeans(x, 8, seed=3)
    a2, c2 = kmeans(x, 8, seed=3)
    assert torch.equal(a1, a2) and torch.equal(c1, c2)
    # converged: every point is assigned to its nearest centre and centres are their clusters' means
    d = torch.cdist(x.double(), c1.double())
    assert torch.equal(d.argmin(1), a1)
    for j in range(8):
        torch.testing.assert_close(c1[j].double(), x[a1 == j].double().mean(0), rtol=0, atol=1e-5)


def test_kmeans_plus_plus_picks_distinct_points_first_uniformly():
    # with 3 distinct points and k = 3, D^2 sampling must pick each point exactly once
    x = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]])
    centres = kmeans_plus_plus(x, 3, torch.Generator().manual_seed(0))
    assert sorted(map(tuple, centres.tolist())) == sorted(map(tuple, x.tolist()))


def test_nmi_on_random_features_is_low_and_seed_dependent_only_through_kmeans():
    rng = np.random.default_rng(9)
    x = rng.normal(size=(300, 16)).astype(np.float32)
    y = rng.integers(0, 10, 300)
    value = nmi(x, y, seed=1)
    assert value == nmi(x, y, seed=1)
    assert 0.0 < value < 0.2
    with pytest.raises(CaffeCompatError, match="k-means needs"):
        kmeans(torch.zeros(3, 2), 4)

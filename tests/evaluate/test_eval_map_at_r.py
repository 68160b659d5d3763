"""MAP@R and precision@1: a hand-computed case, edge cases, and equality with pytorch-metric-learning."""

import numpy as np
import pytest
import torch
from pytorch_metric_learning.distances import CosineSimilarity
from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator
from pytorch_metric_learning.utils.inference import CustomKNN

from caffe_compat.errors import CaffeCompatError
from caffe_compat.evaluate import map_at_r, precision_at_1, recall_at_k, retrieval_metrics
from caffe_compat.evaluate.map_at_r import ranking_scores


def on_circle(degrees):
    a = np.deg2rad(np.asarray(degrees, dtype=np.float64))
    return np.stack([np.cos(a), np.sin(a)], axis=1)


# angles: a at 0, 10, 100; b at 40, 60, 170 (R = 2 for every query). Relevance of the top-2:
#   0: 10a 40b -> [1,0] AP 1/2      10: 0a 40b -> [1,0] 1/2      100: 60b 40b -> [0,0] 0
#  40: 60b 10a -> [1,0] 1/2         60: 40b 100a -> [1,0] 1/2    170: 100a 60b -> [0,1] (1/2)(1/2)
SIX_X = on_circle([0, 10, 100, 40, 60, 170])
SIX_Y = [0, 0, 0, 1, 1, 1]


def test_six_point_example_by_hand():
    assert map_at_r(SIX_X, SIX_Y) == pytest.approx(2.25 / 6, abs=1e-15)
    assert precision_at_1(SIX_X, SIX_Y) == pytest.approx(4 / 6, abs=1e-15)
    assert recall_at_k(SIX_X, SIX_Y, (1, 2, 4)) == pytest.approx({1: 4 / 6, 2: 5 / 6, 4: 1.0}, abs=1e-15)


def test_perfect_and_adversarial():
    labels = np.repeat(np.arange(4), 3)
    x = np.eye(8)[labels] + 0.001 * np.random.default_rng(0).normal(size=(12, 8))
    assert ranking_scores(x, labels) == {"map_at_r": 1.0, "precision_at_1": 1.0}
    # antipodal positives: R = 1 and the positive is last of 3
    assert ranking_scores(on_circle([0, 180, 90, 270]), [0, 0, 1, 1]) == {"map_at_r": 0.0, "precision_at_1": 0.0}


def test_lone_queries_are_left_out_and_all_lone_is_an_error():
    # a lone item at 290 deg is never inside any query's top-R (it is 3rd for the queries at 0 and 170)
    x = np.concatenate([SIX_X, on_circle([290])])
    y = SIX_Y + [7]
    assert map_at_r(x, y) == pytest.approx(2.25 / 6, abs=1e-15)
    assert precision_at_1(x, y) == pytest.approx(4 / 6, abs=1e-15)
    with pytest.raises(CaffeCompatError, match="no label has two items"):
        map_at_r(np.eye(3), [0, 1, 2])


def test_duplicates_of_query_count_as_relevant():
    x = np.array([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    # query 0: others 1 (same), 2 (other label, tie with 1 -> after 1 by index)
    assert map_at_r(x, [0, 0, 1, 1]) == pytest.approx((1 + 1 + 0 + 0) / 4, abs=1e-15)


def pml_scores(x, y):
    calculator = AccuracyCalculator(
        include=("precision_at_1", "mean_average_precision_at_r"),
        k="max_bin_count",
        device=torch.device("cpu"),
        knn_func=CustomKNN(CosineSimilarity()),
    )
    return calculator.get_accuracy(x, y)


@pytest.mark.parametrize("seed, n, d, classes", [(0, 400, 32, 40), (1, 257, 8, 60), (2, 600, 64, 15)])
def test_equal_to_pytorch_metric_learning(seed, n, d, classes):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(np.float32)
    y = rng.integers(0, classes, n)
    y[:3] = [classes, classes + 1, classes + 2]  # three lone queries, excluded by both
    ours = retrieval_metrics(x, y, ks=(1,), budget_bytes=50_000)
    theirs = pml_scores(torch.from_numpy(x), torch.from_numpy(y))
    assert ours["precision_at_1"] == pytest.approx(theirs["precision_at_1"], abs=1e-12)
    assert ours["map_at_r"] == pytest.approx(theirs["mean_average_precision_at_r"], abs=1e-12)
    assert map_at_r(x, y) == ours["map_at_r"]
    assert precision_at_1(x, y) == ours["precision_at_1"]


@pytest.mark.parametrize("budget", [1, 20_000])
def test_chunked_equals_unchunked(budget):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(300, 12)).astype(np.float32)
    y = rng.integers(0, 25, 300)
    whole = retrieval_metrics(x, y, ks=(1, 2, 4, 8), budget_bytes=10**12)
    assert retrieval_metrics(x, y, ks=(1, 2, 4, 8), budget_bytes=budget) == whole
    assert whole["precision_at_1"] == whole["recall_at_k"][1]


@pytest.mark.parametrize("budget", [1, 10**12])
def test_half_matrix_panels_equal_the_full_row_chunks(budget):
    # ranking_scores works on the upper triangle in panels (budget 1: three panels of 256 rows);
    # retrieval_metrics reads whole rows: same similarity bits, same neighbours, same scores
    rng = np.random.default_rng(6)
    x = rng.normal(size=(700, 10)).astype(np.float32)
    y = rng.integers(0, 30, 700)
    whole = retrieval_metrics(x, y, ks=(1,), budget_bytes=10**12)
    scores = ranking_scores(x, y, budget_bytes=budget)
    assert scores == {"map_at_r": whole["map_at_r"], "precision_at_1": whole["precision_at_1"]}

"""Recall@K on hand-built cases with closed-form answers."""

import math

import numpy as np
import pytest
import torch

from caffe_compat.errors import CaffeCompatError
from caffe_compat.evaluate import recall_at_k
from caffe_compat.evaluate.recall import first_match_ranks


def on_circle(degrees):
    a = np.deg2rad(np.asarray(degrees, dtype=np.float64))
    return np.stack([np.cos(a), np.sin(a)], axis=1)


def test_five_point_example_by_hand():
    # angle (deg), label: 0 a, 30 b, 50 a, 110 b, 200 c (c has no other item).
    # Neighbours by angular distance:
    #   0: 30b 50a ...          -> first match rank 1
    #  30: 50a 0a 110b          -> rank 2
    #  50: 30b 0a               -> rank 1
    # 110: 50a 30b              -> rank 1
    # 200: no other c           -> never
    x = on_circle([0, 30, 50, 110, 200])
    y = np.array(["a", "b", "a", "b", "c"])
    assert first_match_ranks(x, y).tolist() == [1, 2, 1, 1, -1]
    assert recall_at_k(x, y, ks=(1, 2, 3, 4)) == {1: 0.0, 2: 0.6, 3: 0.8, 4: 0.8}


def test_perfect_embeddings_give_one():
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(10), 5)
    centres = np.eye(16)[:10]
    x = centres[labels] + 0.01 * rng.normal(size=(50, 16))
    assert recall_at_k(x, labels, ks=(1, 2, 4, 8)) == {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}


def test_adversarial_embeddings_put_positives_last():
    # same-label items are antipodal: every query sees both other-label items first
    x = on_circle([0, 180, 90, 270])
    y = [0, 0, 1, 1]
    assert recall_at_k(x, y, ks=(1, 2, 3)) == {1: 0.0, 2: 0.0, 3: 1.0}


def test_ties_broken_by_lower_index():
    x = np.ones((4, 3))
    y = [0, 1, 1, 0]
    # query 0 sees 1,2,3 (match 3 at rank 2); 1 sees 0,2 (rank 1); 2 sees 0,1 (rank 1); 3 sees 0 (rank 0)
    assert first_match_ranks(x, y).tolist() == [2, 1, 1, 0]
    assert recall_at_k(x, y, ks=(1, 2, 3)) == {1: 0.25, 2: 0.75, 3: 1.0}


def test_ties_among_several_best_positives_and_negatives():
    # query 0 = [1, 0]; items 1 (neg) and 3 (pos) tie with items 2 (neg) and 4 (pos) at cos 0.6
    x = np.array([[1, 0], [0.6, 0.8], [0.6, -0.8], [0.6, 0.8], [0.6, -0.8]], dtype=np.float32)
    y = [0, 1, 1, 0, 0]
    # ranked others of query 0 (by index among ties): 1, 2, 3, 4 -> first positive 3 at rank 2
    assert first_match_ranks(x, y)[0].item() == 2


def test_query_masked_by_index_when_duplicates_exist():
    # x0 == x1 with different labels: dropping "the first neighbour" would drop x0 for query 1 and
    # leave query 1 itself as a (wrong) hit; masking by index gives the true ranks.
    x = np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.6, 0.8]])
    y = [0, 1, 1, 0]
    assert first_match_ranks(x, y).tolist() == [1, 2, 2, 1]
    assert recall_at_k(x, y, ks=(1, 2, 3)) == {1: 0.0, 2: 0.5, 3: 1.0}
    # duplicates sharing a label find each other first
    assert recall_at_k(x, [0, 0, 1, 1], ks=(1,))[1] == 1.0


@pytest.mark.parametrize("budget", [1, 5_000, 10**10])
def test_chunked_equals_unchunked(budget):
    rng = np.random.default_rng(1)
    x = torch.from_numpy(rng.normal(size=(311, 8)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, 40, 311))
    ks = (1, 2, 4, 8, 16, 32, 64)
    assert recall_at_k(x, y, ks, budget_bytes=budget) == recall_at_k(x, y, ks, budget_bytes=10**12)
    # brute force: first same-label neighbour in float64 ranking
    xn = (x / x.norm(dim=1, keepdim=True)).double()
    s = xn @ xn.T
    s.fill_diagonal_(-math.inf)
    order = torch.sort(-s, dim=1, stable=True).indices[:, :-1]
    hit = (y[order] == y[:, None])
    expected = {k: float(hit[:, :k].any(1).double().mean()) for k in ks}
    assert recall_at_k(x, y, ks, budget_bytes=budget) == expected


def test_numpy_and_torch_inputs_and_label_kinds_agree():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(60, 5))
    y = rng.integers(0, 6, 60)
    a = recall_at_k(x, y, (1, 5))
    assert recall_at_k(torch.from_numpy(x), torch.from_numpy(y), (1, 5), device="cpu") == a
    assert recall_at_k(x.astype(np.float32), y.astype(np.float32).reshape(-1, 1), (1, 5)) == a
    assert recall_at_k(x, np.array([f"class{v}" for v in y]), (1, 5)) == a


def test_bad_labels_and_ks():
    x = np.eye(3)
    with pytest.raises(CaffeCompatError, match="3 feature rows"):
        recall_at_k(x, [0, 1])
    with pytest.raises(CaffeCompatError, match="positive integers"):
        recall_at_k(x, [0, 1, 1], ks=(0, 1))
    with pytest.raises(CaffeCompatError, match="whole numbers"):
        recall_at_k(x, [0.5, 1, 1])


@pytest.mark.parametrize("budget", [1, 100_000, 10**12])
def test_first_match_rank_with_massive_ties_matches_stable_brute_force(budget):
    # items share 4 prototype vectors, labels are random: the best positive ties with negatives
    rng = np.random.default_rng(11)
    prototypes = rng.normal(size=(4, 8))
    which = rng.integers(0, 4, 150)
    labels = rng.integers(0, 12, 150)
    p = prototypes / np.linalg.norm(prototypes, axis=1, keepdims=True)
    s = (p @ p.T)[which][:, which]
    np.fill_diagonal(s, -np.inf)
    order = np.argsort(-s, axis=1, kind="stable")[:, :-1]
    hit = labels[order] == labels[:, None]
    expected = np.where(hit.any(1), hit.argmax(1), -1)
    assert first_match_ranks(prototypes[which], labels, budget_bytes=budget).tolist() == expected.tolist()

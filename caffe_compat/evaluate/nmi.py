"""Normalized mutual information of a k-means clustering of the features against their labels.

``NMI(Y, C) = I(Y; C) / ((H(Y) + H(C)) / 2)`` (arithmetic-mean normalisation, the default of
scikit-learn's ``normalized_mutual_info_score``), with natural logarithms and the sparse contingency
table of the two labelings; when both labelings have a single class the score is 1 (scikit-learn's
convention). ``nmi`` clusters the L2-normalised features with :func:`caffe_compat.evaluate.kmeans.kmeans`
into as many clusters as there are distinct labels (k-means++ seeding, ``seed`` default 0).
"""

from __future__ import annotations

import torch

from caffe_compat.evaluate.inputs import EvaluationInputError, as_features, as_labels
from caffe_compat.evaluate.kmeans import kmeans
from caffe_compat.evaluate.knn import DEFAULT_BUDGET_BYTES


def _entropy(counts: torch.Tensor, n: float) -> torch.Tensor:
    p = counts / n
    return -(p * torch.log(p)).sum()


def normalized_mutual_information(labels_true, labels_pred) -> float:
    """NMI of two labelings of the same items (any integer/str arrays or tensors)."""
    a = as_labels(labels_true, len(labels_true), "cpu", name="labels_true")
    b = as_labels(labels_pred, len(labels_pred), "cpu", name="labels_pred")
    if a.shape != b.shape:
        raise EvaluationInputError(f"labelings differ in length: {a.shape[0]} vs {b.shape[0]}")
    n = float(a.shape[0])
    count_a = torch.bincount(a).to(torch.float64)
    count_b = torch.bincount(b).to(torch.float64)
    if len(count_a) == len(count_b) == 1:
        return 1.0
    pairs, joint = torch.unique(a * len(count_b) + b, return_counts=True)
    joint = joint.to(torch.float64)
    marginal = count_a[pairs // len(count_b)] * count_b[pairs % len(count_b)]
    mutual = float((joint / n * (torch.log(joint) + torch.log(torch.tensor(n, dtype=torch.float64)) - torch.log(marginal))).sum())
    mutual = max(mutual, 0.0)
    normaliser = float(_entropy(count_a, n) + _entropy(count_b, n)) / 2.0
    return 0.0 if mutual == 0.0 else mutual / normaliser


def nmi(
    features, labels, seed: int = 0, *, device=None, max_iter: int = 100, budget_bytes: int = DEFAULT_BUDGET_BYTES
) -> float:
    """NMI between the labels and a seeded k-means (k = number of labels) of the normalised features."""
    x = as_features(features, device)
    y = as_labels(labels, x.shape[0], x.device)
    k = int(y.max()) + 1
    assignment, _ = kmeans(x, k, seed=seed, max_iter=max_iter, budget_bytes=budget_bytes)
    return normalized_mutual_information(y.cpu(), assignment.cpu())

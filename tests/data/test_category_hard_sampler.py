"""CategoryHardSampler: FastAP's two-category batches and the VehicleID variant."""

from __future__ import annotations

import collections
import itertools

import numpy as np
import pytest

from caffe_compat.data.samplers import CategoryHardSampler
from caffe_compat.errors import DataError


def _products(seed=0, categories=5, classes=40):
    """SOP-like: each class (3-7 images) in one of ``categories`` super-classes."""
    rng = np.random.RandomState(seed)
    class_category = rng.randint(categories, size=classes)
    class_category[:categories] = np.arange(categories)
    counts = rng.randint(3, 8, size=classes)
    labels = np.repeat(np.arange(classes) + 1, counts)
    cats = np.repeat(class_category, counts)
    order = rng.permutation(len(labels))
    return labels[order], cats[order]


def _vehicles(seed=0):
    """VehicleID-like: 30 vehicles with a model (6 models), 30 without (-1)."""
    rng = np.random.RandomState(seed)
    counts = rng.randint(2, 12, size=60)
    labels = np.repeat(np.arange(60), counts)
    cats = np.repeat(np.concatenate([np.arange(30) % 6, -np.ones(30, np.int64)]), counts)
    order = rng.permutation(len(labels))
    return labels[order], cats[order]


def test_two_categories_halves_pairs_and_epoch_length():
    labels, cats = _products()
    sampler = CategoryHardSampler(labels, cats, 20, seed=1, batches_per_pair=3)
    batches = [np.array(b) for b in sampler]
    assert len(batches) == len(sampler) == 10 * 3  # C(5, 2) pairs x 3
    pair_counts = collections.Counter()
    for batch in batches:
        first, second = cats[batch[:10]], cats[batch[10:]]
        assert len(set(first)) == 1 and len(set(second)) == 1 and first[0] != second[0]
        pair_counts[frozenset((first[0], second[0]))] += 1
    assert pair_counts == {frozenset(p): 3 for p in itertools.combinations(range(5), 2)}


def test_whole_classes_are_taken_consecutively():
    labels, cats = _products(2)
    sampler = CategoryHardSampler(labels, cats, 24, seed=0)
    stream = collections.defaultdict(list)
    for batch in sampler:
        for half in (batch[:12], batch[12:]):
            stream[cats[half[0]]].extend(half)
    for category, indices in stream.items():
        run_labels = labels[np.array(indices)]
        change = np.flatnonzero(np.diff(run_labels)) + 1
        starts = np.concatenate([[0], change])
        lengths = np.diff(np.concatenate([starts, [len(run_labels)]]))
        # within a category's stream, a class's images come together (a new pass may re-start it)
        for start, length in zip(starts[:-1], lengths[:-1]):
            label = run_labels[start]
            assert length % (labels == label).sum() == 0 or start == 0


def test_vehicleid_variant_halves_and_coverage():
    labels, cats = _vehicles()
    sampler = CategoryHardSampler(labels, cats, 16, seed=4, variant="vehicleid")
    sizes = {c: (cats == c).sum() for c in range(6)}
    assert len(sampler) == sum(-(-2 * n // 16) for n in sizes.values())
    for _ in range(2):
        batches = [np.array(b) for b in sampler]
        assert len(batches) == sum(-(-2 * n // 16) for n in sizes.values())
        for batch in batches:
            assert len(set(cats[batch[:8]])) == 1 and cats[batch[0]] >= 0
            assert np.all(cats[batch[8:]] == -1)
        seen = set(np.concatenate(batches).tolist())
        assert set(np.flatnonzero(cats >= 0).tolist()) <= seen  # every labelled image, every epoch
        per_category = collections.Counter(cats[b[0]] for b in batches)
        assert per_category == {c: -(-2 * n // 16) for c, n in sizes.items()}


def test_determinism_and_ddp_keeps_both_halves_on_every_rank():
    labels, cats = _products(3)
    full = list(CategoryHardSampler(labels, cats, 24, seed=5))
    assert full == list(CategoryHardSampler(labels, cats, 24, seed=5))
    assert full != list(CategoryHardSampler(labels, cats, 24, seed=6))
    ranks = [list(CategoryHardSampler(labels, cats, 24, seed=5, num_replicas=3, rank=r)) for r in range(3)]
    for i, batch in enumerate(full):
        parts = [r[i] for r in ranks]
        assert sum((p[:4] for p in parts), []) == batch[:12]
        assert sum((p[4:] for p in parts), []) == batch[12:]
        assert all(len(set(cats[p])) == 2 for p in parts)


def test_argument_errors():
    labels, cats = _vehicles()
    with pytest.raises(DataError, match="variant='vehicleid'"):
        CategoryHardSampler(labels, cats, 16)
    with pytest.raises(DataError, match="more than one category"):
        CategoryHardSampler([1, 1, 2], [0, 1, 1], 2)
    with pytest.raises(DataError, match="divisible by 2 \\* num_replicas = 4"):
        CategoryHardSampler(labels, cats, 6, variant="vehicleid", num_replicas=2, rank=0)
    with pytest.raises(DataError, match="both labelled"):
        CategoryHardSampler([1, 2], [0, 1], 2, variant="vehicleid")

"""MPerClassSampler: batch shape, full coverage per epoch, determinism, DDP split."""

from __future__ import annotations

import numpy as np
import pytest

from caffe_compat.data.samplers import MPerClassSampler
from caffe_compat.errors import DataError


def _labels(seed=0):
    rng = np.random.RandomState(seed)
    counts = rng.randint(1, 13, size=37)  # includes classes smaller than m
    labels = np.repeat(np.arange(100, 137), counts)
    return labels[rng.permutation(len(labels))]


@pytest.mark.parametrize("m, batch_size", [(4, 32), (2, 16), (5, 5)])
def test_every_batch_has_p_distinct_classes_of_m_images(m, batch_size):
    labels = _labels(1)
    sampler = MPerClassSampler(labels, m, batch_size, seed=3)
    batches = [np.array(b) for b in sampler]
    for batch in batches:
        assert len(batch) == batch_size
        blocks = labels[batch].reshape(batch_size // m, m)
        assert np.all(blocks == blocks[:, :1])  # runs of m of one class
        assert len(np.unique(blocks[:, 0])) == batch_size // m  # distinct classes
        # no image repeated inside a run unless its class has fewer than m images
        for run in batch.reshape(-1, m):
            if (labels == labels[run[0]]).sum() >= m:
                assert len(set(run.tolist())) == m


def test_every_image_is_visited_each_epoch_and_batch_count_is_tight():
    labels = _labels(2)
    sampler = MPerClassSampler(labels, 4, 24, seed=0)
    for _ in range(3):
        expected = len(sampler)
        batches = list(sampler)
        assert len(batches) == expected
        assert set(np.concatenate(batches).tolist()) == set(range(len(labels)))
        chunks = sum(-(-(labels == c).sum() // 4) for c in np.unique(labels))
        assert chunks / 6 <= len(batches) <= chunks / 6 + 6


def test_determinism_and_epochs_differ():
    labels = _labels(3)
    a, b = MPerClassSampler(labels, 3, 12, seed=9), MPerClassSampler(labels, 3, 12, seed=9)
    first, second = list(a), list(a)
    assert first != second
    b.set_epoch(1)
    assert list(b) == second
    assert list(MPerClassSampler(labels, 3, 12, seed=10)) != first


def test_ddp_split_recovers_the_global_batch():
    labels = _labels(4)
    full = list(MPerClassSampler(labels, 4, 32, seed=1))
    ranks = [list(MPerClassSampler(labels, 4, 32, seed=1, num_replicas=2, rank=r)) for r in range(2)]
    assert [r0 + r1 for r0, r1 in zip(*ranks)] == full


def test_argument_errors():
    labels = _labels(5)
    with pytest.raises(DataError, match="multiple of m"):
        MPerClassSampler(labels, 3, 16)
    with pytest.raises(DataError, match="only 37 classes"):
        MPerClassSampler(labels, 2, 2 * 38)

"""LabelShufflingSampler against a slot-by-slot transcription of the authors' layer's rules."""

from __future__ import annotations

import numpy as np
import pytest

from caffe_compat.data.samplers import LabelShufflingSampler
from caffe_compat.errors import DataError


def layer_reference(labels, batch_size, cap, seed, n_batches):
    """The layer's per-slot loop as its rules read (dict of Python lists, np.random.shuffle)."""
    rs = np.random.RandomState(seed)
    keys = {}
    for index, label in enumerate(labels):
        keys.setdefault(int(label), []).append(index)
    label_list = sorted(keys)
    rs.shuffle(label_list)
    label_index = image_index = 0
    batches = []
    for _ in range(n_batches):
        batch = []
        for _ in range(batch_size):
            current = keys[label_list[label_index]]
            if image_index >= len(current) or image_index >= cap:
                rs.shuffle(current)
                image_index = 0
                label_index += 1
            if label_index >= len(label_list):
                rs.shuffle(label_list)
                label_index = 0
            batch.append(keys[label_list[label_index]][image_index])
            image_index += 1
        batches.append(batch)
    return batches


def _labels(seed=0, classes=23):
    rng = np.random.RandomState(seed)
    counts = rng.randint(1, 17, size=classes)  # some below, some above the cap
    labels = np.repeat(rng.permutation(1000)[:classes], counts)
    return labels[rng.permutation(len(labels))]


@pytest.mark.parametrize("batch_size, cap, seed", [(16, 10, 0), (12, 4, 3), (7, None, 11), (128, 10, 5)])
def test_stream_equals_the_layer_reference(batch_size, cap, seed):
    labels = _labels(seed)
    sampler = LabelShufflingSampler(labels, batch_size, max_per_label=cap, seed=seed, batches_per_epoch=9)
    got = [b for _ in range(3) for b in sampler]  # three epochs continue one stream
    want = layer_reference(labels, batch_size, np.inf if cap is None else cap, seed, 27)
    assert got == want


def test_batch_composition_runs_and_caps():
    labels = _labels(1)
    sampler = LabelShufflingSampler(labels, 32, max_per_label=5, seed=2, batches_per_epoch=40)
    stream = np.concatenate([np.array(b) for b in sampler])
    stream_labels = labels[stream]
    change = np.flatnonzero(np.diff(stream_labels)) + 1
    runs = np.diff(np.concatenate([[0], change, [len(stream)]]))
    run_labels = stream_labels[np.concatenate([[0], change])]
    counts = {label: (labels == label).sum() for label in np.unique(labels)}
    # interior runs are exactly min(n_label, cap) long (the first one may be partial; two adjacent
    # runs of one label at a label-list wrap merge, so allow multiples)
    interior = zip(runs[1:-1], run_labels[1:-1])
    assert all(run % min(counts[label], 5) == 0 for run, label in interior)
    # every label of a full pass occurs, each of its images at most once per visit
    first_pass = stream[: sum(min(c, 5) for c in counts.values())]
    assert set(labels[first_pass]) == set(counts)


def test_default_epoch_is_one_label_pass_and_first_visit_is_in_data_order():
    labels = np.array([4, 4, 4, 9, 9, 7, 7, 7, 7, 7, 7])
    sampler = LabelShufflingSampler(labels, 3, max_per_label=4, seed=0)
    assert len(sampler) == 3  # min(3,4) + min(2,4) + min(6,4) = 9 images
    first = np.concatenate([np.array(b) for b in sampler])
    for label in (4, 9, 7):
        idx = first[labels[first] == label]
        assert np.all(np.diff(idx) > 0)  # the layer shuffles a label's list only when leaving it
    assert sorted(labels[first].tolist()) == [4, 4, 4, 7, 7, 7, 7, 9, 9]


def test_determinism_set_epoch_and_seed():
    labels = _labels(2)
    a = LabelShufflingSampler(labels, 16, 10, seed=7)
    b = LabelShufflingSampler(labels, 16, 10, seed=7)
    epochs_a = [list(a) for _ in range(3)]
    b.set_epoch(2)
    assert list(b) == epochs_a[2]
    b.set_epoch(0)
    assert list(b) == epochs_a[0]
    assert list(LabelShufflingSampler(labels, 16, 10, seed=8)) != epochs_a[0]


def test_ddp_ranks_split_each_global_batch():
    labels = _labels(3)
    full = list(LabelShufflingSampler(labels, 24, 10, seed=1, num_replicas=1, rank=0))
    parts = [list(LabelShufflingSampler(labels, 24, 10, seed=1, num_replicas=3, rank=r)) for r in range(3)]
    assert all(len(p) == len(full) for p in parts)
    for i, batch in enumerate(full):
        assert parts[0][i] + parts[1][i] + parts[2][i] == batch
        assert all(len(p[i]) == 8 for p in parts)
    with pytest.raises(DataError, match="not divisible by num_replicas 5"):
        LabelShufflingSampler(labels, 24, 10, num_replicas=5, rank=0)


def test_argument_errors():
    with pytest.raises(DataError, match="max_per_label"):
        LabelShufflingSampler([1, 2], 2, max_per_label=0)
    with pytest.raises(DataError, match="integers"):
        LabelShufflingSampler([0.5, 1.0], 2)

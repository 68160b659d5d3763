"""ImageRecordDataset with a DataLoader: batch samplers, random crops, worker seeding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from caffe_compat.data import Cub200, DataTransformer, LabelShufflingSampler, make_toy_data


@pytest.fixture(scope="module")
def cub(tmp_path_factory):
    return make_toy_data("cub", tmp_path_factory.mktemp("cub"), seed=0, size=40)


def _loader(dataset, workers, generator_seed):
    sampler = LabelShufflingSampler(dataset.labels, 8, max_per_label=4, seed=2, batches_per_epoch=6)
    return DataLoader(
        dataset, batch_sampler=sampler, num_workers=workers, generator=torch.Generator().manual_seed(generator_seed)
    )


def test_batches_follow_the_sampler_and_crops_are_random_and_in_range(cub):
    transformer = DataTransformer(crop_size=32, mirror=True, phase="TRAIN")
    dataset = Cub200(cub, "train", transformer, seed=1)
    sampler_batches = list(LabelShufflingSampler(dataset.labels, 8, max_per_label=4, seed=2, batches_per_epoch=6))
    images, labels = zip(*_loader(dataset, 0, 0))
    assert [lab.tolist() for lab in labels] == [dataset.labels[b].tolist() for b in sampler_batches]
    assert all(x.shape == (8, 3, 32, 32) for x in images)
    # a crop of the decoded image: some 32x32 window, maybe mirrored
    index = sampler_batches[0][0]
    raw = torch.from_numpy(_decoded(dataset, index).astype(np.float32))
    windows = raw.unfold(1, 32, 1).unfold(2, 32, 1).permute(1, 2, 0, 3, 4)
    crop = images[0][0]
    matches = [(windows == c).flatten(2).all(-1).any().item() for c in (crop, crop.flip(-1))]
    assert any(matches)


def _decoded(dataset, index):
    import cv2

    return cv2.imread(str(dataset.records[index].path)).transpose(2, 0, 1)


def test_workers_are_seeded_reproducibly_and_differently(cub):
    transformer = DataTransformer(crop_size=24, mirror=True, phase="TRAIN")
    dataset = Cub200(cub, "train", transformer, seed=3)
    first = torch.cat([x for x, _ in _loader(dataset, 2, 5)])
    again = torch.cat([x for x, _ in _loader(dataset, 2, 5)])
    other = torch.cat([x for x, _ in _loader(dataset, 2, 6)])
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    test_set = Cub200(cub, "test", DataTransformer(crop_size=24, phase="TEST"))
    centre = torch.stack([test_set[i][0] for i in range(4)])
    np.testing.assert_array_equal(centre.numpy(), torch.stack([test_set[i][0] for i in range(4)]).numpy())


def _stacked(dataset, indices):
    """What the DataLoader gave before ``__getitems__``: each item, then ``torch.stack``."""
    items = [dataset[i] for i in indices]
    return torch.stack([x for x, _ in items]), torch.tensor([y for _, y in items])


@pytest.mark.parametrize("transformer", [
    DataTransformer(crop_size=32, mirror=True, mean_value=(104, 117, 123), scale=0.5, phase="TRAIN"),
    DataTransformer(crop_size=24, mirror=True, mean_file=np.arange(3 * 40 * 40, dtype=np.float32).reshape(3, 40, 40),
                    phase="TRAIN"),
    DataTransformer(phase="TEST")])
def test_batches_built_in_one_buffer_equal_stacked_items(cub, transformer):
    loader = _loader(Cub200(cub, "train", transformer, seed=1), 0, 0)
    reference = Cub200(cub, "train", transformer, seed=1)  # the same RandomState draws, item by item
    sampler_batches = list(LabelShufflingSampler(reference.labels, 8, max_per_label=4, seed=2, batches_per_epoch=6))
    for (images, labels), indices in zip(loader, sampler_batches):
        expected_images, expected_labels = _stacked(reference, indices)
        assert images.dtype == torch.float32 and images.is_contiguous() and torch.equal(images, expected_images)
        assert labels.dtype == expected_labels.dtype and torch.equal(labels, expected_labels)


def test_batch_rows_are_plain_samples_to_other_collates_and_sizes_may_differ(cub):
    from caffe_compat.data.dataset import BatchRow

    dataset = Cub200(cub, "train", DataTransformer(phase="TEST"))
    rows = dataset.__getitems__([0, 1, 2])
    assert all(isinstance(r, BatchRow) and len(r) == 2 for r in rows)
    assert [tuple(r[0].shape) for r in rows] == [(3, 40, 40)] * 3
    seen = []
    batches = DataLoader(dataset, batch_size=3, collate_fn=lambda batch: seen.append(batch) or len(batch))
    assert next(iter(batches)) == 3 and torch.equal(seen[0][1][0], dataset[1][0])
    import cv2

    path = dataset.records[1].path
    original = path.read_bytes()
    cv2.imwrite(str(path), np.zeros((30, 20, 3), np.uint8))  # another size: no common buffer
    try:
        mixed = dataset.__getitems__([0, 1])
        assert not any(isinstance(r, BatchRow) for r in mixed) and mixed[1][0].shape == (3, 30, 20)
    finally:
        path.write_bytes(original)


def test_a_batch_buffer_is_written_again_only_when_nothing_references_it():
    from caffe_compat.data.dataset import _batch_buffer

    def take():
        return _batch_buffer((2, 3))[1]

    first = take()
    second = take()
    assert first.data_ptr() != second.data_ptr()
    address = first.data_ptr()
    del first
    again = take()
    assert again.data_ptr() == address  # a former batch nobody holds: no fresh pages to fault in
    row = again[0]
    array = row.numpy()
    del again, row
    assert take().data_ptr() != address  # a view (or a numpy view of one) still holds it
    del array


class _ItemByItem(Cub200):
    """The same data set through the plain path (a subclass with its own ``__getitem__``: no batch buffer)."""

    def __getitem__(self, index):
        return super().__getitem__(index)


def test_worker_batches_in_shared_memory_equal_the_plain_path(cub):
    """In DataLoader workers the batch is transformed straight into one shared-memory buffer: the same
    values and random draws as the items one by one stacked by the default collate."""
    transformer = DataTransformer(crop_size=32, mirror=True, mean_value=(104, 117, 123), scale=0.5, phase="TRAIN")
    fast = list(_loader(Cub200(cub, "train", transformer, seed=4), 2, 7))
    plain = list(_loader(_ItemByItem(cub, "train", transformer, seed=4), 2, 7))
    assert len(fast) == len(plain) == 6
    for (images, labels), (expected, expected_labels) in zip(fast, plain):
        assert images.shape == (8, 3, 32, 32) and torch.equal(images, expected) and torch.equal(labels, expected_labels)


def test_a_worker_builds_its_batch_in_shared_memory(cub, monkeypatch):
    from types import SimpleNamespace

    from caffe_compat.data import dataset as dataset_module
    from caffe_compat.data.dataset import BatchRow

    dataset = Cub200(cub, "train", DataTransformer(crop_size=32, phase="TEST"))
    expected = torch.stack([dataset[i][0] for i in (0, 3, 5)])
    worker = SimpleNamespace(id=0, seed=123, num_workers=1, dataset=dataset)
    monkeypatch.setattr(dataset_module, "get_worker_info", lambda: worker)
    rows = dataset.__getitems__([0, 3, 5])
    assert all(type(r) is BatchRow for r in rows)
    whole = rows[0].whole
    assert whole.is_shared() and torch.equal(whole, expected)
    from torch.utils.data import default_collate

    assert default_collate(rows)[0] is whole  # handed to the main process as is: no stack copy


def test_a_worker_batch_buffer_is_mapped_in_one_call_before_it_is_written(monkeypatch):
    """The shared-memory batch asks for all of its pages at once (prefault_for_writing with the buffer's
    own address and size); where the kernel populates, writing it then takes no page fault."""
    import resource

    from caffe_compat import allocator
    from caffe_compat.data import dataset as dataset_module

    asked = []
    monkeypatch.setattr(dataset_module, "prefault_for_writing",
                        lambda address, nbytes: asked.append((address, nbytes)) or allocator.prefault_for_writing(
                            address, nbytes))
    array, whole = dataset_module._shared_batch_buffer((4, 3, 128, 128))
    assert whole.is_shared() and array.ctypes.data == whole.data_ptr()
    assert asked == [(whole.data_ptr(), 4 * 3 * 128 * 128 * 4)]
    populated = allocator.prefault_for_writing(whole.data_ptr(), whole.nbytes)  # already mapped: True again
    # this thread's faults only: the suite leaves threads running (prefetch, loaders) whose own faults are
    # counted by RUSAGE_SELF (9 of them once made a 192-page write look unmapped)
    who = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)

    def write_faults(target) -> int:
        before = resource.getrusage(who).ru_minflt
        target[:] = 1.0
        return resource.getrusage(who).ru_minflt - before

    faults = write_faults(array)
    control = write_faults(torch.empty(0).set_(torch.UntypedStorage._new_shared(whole.nbytes), 0, whole.shape).numpy())
    if populated and control >= 64:  # the same write into fresh shared pages: one fault a page (192 here)
        assert faults * 8 < control, (faults, control)
    assert float(whole.sum()) == whole.numel()


def test_a_new_main_process_batch_buffer_is_mapped_in_one_call(monkeypatch):
    """At 0 workers a batch buffer nothing references any more is written again; a new one (the first
    batches, or while the program holds the former ones) asks for all of its pages at once."""
    from caffe_compat.data import dataset as dataset_module

    asked = []
    monkeypatch.setattr(dataset_module, "prefault_for_writing", lambda address, nbytes: asked.append((address, nbytes)))
    monkeypatch.setattr(dataset_module, "_SPARES", [])
    array, whole = dataset_module._batch_buffer((2, 3, 64, 64))
    assert asked == [(array.ctypes.data, 2 * 3 * 64 * 64 * 4)] and whole.data_ptr() == array.ctypes.data
    del array, whole
    again, _ = dataset_module._batch_buffer((2, 3, 64, 64))           # the spare again: nothing to map
    assert len(asked) == 1 and again.ctypes.data == asked[0][0]


def _keyed_loader(dataset, workers, keys):
    """A DataLoader over the sampler's batches, each a KeyedBatch with the given key."""
    from caffe_compat.data.dataset import KeyedBatch

    sampler = list(LabelShufflingSampler(dataset.labels, 8, max_per_label=4, seed=2, batches_per_epoch=6))
    batches = [KeyedBatch(sampler[k], k) for k in keys]
    return DataLoader(dataset, batch_sampler=batches, num_workers=workers,
                      generator=torch.Generator().manual_seed(workers))


def test_a_keyed_batch_is_the_same_from_any_worker_count_and_any_start(cub):
    """A KeyedBatch draws from RandomState((seed, key)): the stream of keys 0-5 with 0 or 2 workers, and
    keys 3-5 alone (a resume at batch 3), give the same crops and mirrors; with the running generator the
    three differ (they did for ``caffe-compat reproduce``'s real data sets)."""
    transformer = DataTransformer(crop_size=24, mirror=True, phase="TRAIN")
    dataset = Cub200(cub, "train", transformer, seed=3)
    whole = [x for x, _ in _keyed_loader(dataset, 0, range(6))]
    workers = [x for x, _ in _keyed_loader(dataset, 2, range(6))]
    resumed = [x for x, _ in _keyed_loader(dataset, 0, range(3, 6))]
    assert all(torch.equal(a, b) for a, b in zip(whole, workers))
    assert all(torch.equal(a, b) for a, b in zip(whole[3:], resumed))
    plain = [x for x, _ in _loader(Cub200(cub, "train", transformer, seed=3), 0, 0)]
    plain_resumed = list(DataLoader(Cub200(cub, "train", transformer, seed=3), batch_sampler=list(
        LabelShufflingSampler(dataset.labels, 8, max_per_label=4, seed=2, batches_per_epoch=6))[3:]))
    assert not all(torch.equal(a, b) for a, b in zip(plain[3:], [x for x, _ in plain_resumed]))


def test_keyed_batches_draw_their_own_crops(cub):
    """The key (and the data set's seed) decide the draws: the same indices under two keys are cropped
    differently, under one key the same whatever the data set drew before; the key survives pickling (a
    worker's index queue)."""
    import pickle

    from caffe_compat.data.dataset import KeyedBatch

    transformer = DataTransformer(crop_size=24, mirror=True, phase="TRAIN")
    dataset = Cub200(cub, "train", transformer, seed=3)
    indices = list(range(8))

    def batch(key, data=dataset):
        return torch.stack([x for x, _ in data.__getitems__(KeyedBatch(indices, key))])

    first = batch(7)
    dataset.__getitems__(indices)  # the running generator moves; the keyed batch does not follow it
    assert torch.equal(batch(7), first)
    assert not torch.equal(batch(8), first)
    assert not torch.equal(batch(7, Cub200(cub, "train", transformer, seed=4)), first)
    again = pickle.loads(pickle.dumps(KeyedBatch(indices, 2 ** 40 + 7)))
    assert type(again) is KeyedBatch and again == indices and again.key == 2 ** 40 + 7

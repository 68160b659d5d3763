"""Images/s of the training input pipeline: OpenCV JPEG decode + Caffe DataTransformer.

Setup as in the paper's Caffe runs: a toy CUB-200-2011 tree (real digit scans, see
``caffe_compat.data.toy``) stored at 256x256 JPEG, TRAIN-phase random 224x224 crop, random mirror,
per-channel mean values (104, 117, 123), batches from the authors' ``LabelShufflingLayer`` rule
(``max_per_label`` 10).  Rows: ``DataLoader`` with ``num_workers`` 0, 1, 2 (first batch excluded:
it holds the worker start-up), ``num_workers=0`` again with one torch intra-op thread (the
default collate's ``torch.stack`` ran on torch's thread pool in the main process, which on a busy small
machine cost more than the decode; the data sets now build each batch in one buffer through
``__getitems__``, :mod:`caffe_compat.data.dataset`, so the thread count should no longer matter; workers
always run with one thread), and the peers measured in the same run: a bare ``cv2.imread`` loop
(decode only); decode + transform in a plain loop without a DataLoader (``dataset[i]``, each image dropped
as soon as it is made, so it is rewritten in cache: the ratio the issue asks about); and that loop doing
what the DataLoader does, the 2nd peer: the sampler's batches, each image copied into one reused batch
tensor (the 19 MB a batch of 32 crops of 224 x 224 takes cannot stay in a core's cache, which the
first peer never pays for).  Every row is measured ``--repeats`` times round-robin and its median
reported (with the range); ratios are each peer's median time over each row's.

    python benchmarks/bench_input_pipeline.py [--batches 12] [--batch-size 32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import cv2
import numpy as np
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import print_header  # noqa: E402
from caffe_compat.data import Cub200, DataTransformer, LabelShufflingSampler, make_toy_data  # noqa: E402


def time_loader(dataset, batch_size: int, batches: int, workers: int) -> float:
    sampler = LabelShufflingSampler(dataset.labels, batch_size, max_per_label=10, seed=0, batches_per_epoch=batches + 1)
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=workers)
    iterator = iter(loader)
    next(iterator)  # warm-up batch (worker start-up)
    start = time.perf_counter()
    count = sum(len(labels) for _, labels in iterator)
    return count / (time.perf_counter() - start)


def time_plain(dataset, n: int, transform: bool) -> float:
    start = time.perf_counter()
    for i in range(n):
        record = dataset.records[i % len(dataset)]
        if transform:
            dataset[i % len(dataset)]
        else:
            cv2.imread(str(record.path), cv2.IMREAD_COLOR)
    return n / (time.perf_counter() - start)


def time_plain_batches(dataset, batch_size: int, batches: int) -> float:
    """A plain loop that yields what the DataLoader does: the sampler's batches, each image copied into
    one preallocated batch tensor (reused: the cheapest batch a loop without a DataLoader can make; the
    copy by numpy, single-threaded: ``batch[k] = image`` in torch ran on the intra-op pool and took ms)."""
    sampler = LabelShufflingSampler(dataset.labels, batch_size, max_per_label=10, seed=0, batches_per_epoch=batches + 1)
    order = list(sampler)[1:]  # the batches time_loader times (its first one is the warm-up)
    image, _ = dataset[0]
    batch = torch.empty((batch_size, *image.shape), dtype=image.dtype)
    rows = batch.numpy()
    start = time.perf_counter()
    count = 0
    for indices in order:
        labels = []
        for k, index in enumerate(indices):
            image, label = dataset[index]
            np.copyto(rows[k], image.numpy())
            labels.append(label)
        count += len(torch.tensor(labels))
    return count / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=12)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--crop", type=int, default=224)
    parser.add_argument("--repeats", type=int, default=5, help="round-robin repeats of every row (median reported)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        root = make_toy_data("cub", Path(tmp) / "CUB_200_2011", seed=0, size=args.size, num_classes=40, images_per_class=20)
        made = time.perf_counter() - start
        transformer = DataTransformer(crop_size=args.crop, mirror=True, mean_value=(104, 117, 123), phase="TRAIN")
        dataset = Cub200(root, "train", transformer)
        n = args.batches * args.batch_size
        threads = torch.get_num_threads()

        def one_thread_loader():  # workers run with 1 intra-op thread; the main process's collate does not
            torch.set_num_threads(1)
            try:
                return time_loader(dataset, args.batch_size, args.batches, 0)
            finally:
                torch.set_num_threads(threads)

        measures = [
            ("cv2.imread only (peer)", lambda: time_plain(dataset, n, transform=False)),
            ("decode+transform, plain loop (peer)", lambda: time_plain(dataset, n, transform=True)),
            ("same, copied into batches (2nd peer)",
             lambda: time_plain_batches(dataset, args.batch_size, args.batches)),
            *((f"DataLoader num_workers={w}", lambda w=w: time_loader(dataset, args.batch_size, args.batches, w))
              for w in (0, 1, 2)),
            ("DataLoader num_workers=0, 1 torch thread", one_thread_loader),
        ]
        samples = {name: [] for name, _ in measures}
        for _ in range(args.repeats):  # round-robin: a neighbour's load falls on every row alike
            for name, measure in measures:
                samples[name].append(measure())
        rows = [(name, statistics.median(values), min(values), max(values)) for name, values in samples.items()]
    peer = rows[1][1]  # decode+transform in a plain loop: the same work without a DataLoader
    batch_peer = rows[2][1]  # ... and the batches the DataLoader yields
    print_header("decode+transform in a plain loop (same run); ours = each DataLoader setting")
    print(
        f"toy CUB: {len(dataset)} train images {args.size}x{args.size} JPEG (made in {made:.2f} s), crop {args.crop}, "
        f"batch {args.batch_size} x {args.batches} batches; median of {args.repeats} round-robin repeats (range in "
        f"brackets); torch {torch.__version__}, OpenCV {cv2.__version__}, {os.cpu_count()} CPUs, torch threads "
        f"{torch.get_num_threads()}, cv2 threads {cv2.getNumThreads()}"
    )
    print(f"| {'pipeline':<42} | {'images/s':>9} | {'range':>15} | {'peer ÷ ours':>11} | {'2nd peer ÷ ours':>15} |")
    print(f"| {'-' * 42} | {'-' * 9} | {'-' * 15} | {'-' * 11} | {'-' * 15} |")
    for name, rate, low, high in rows:  # time per image is 1 / rate: peer time ÷ our time = our rate ÷ peer rate
        ours = not name.endswith("peer)")
        ratio = f"{rate / peer:>10.2f}x" if ours else f"{'-':>11}"
        ratio2 = f"{rate / batch_peer:>14.2f}x" if ours else f"{'-':>15}"
        print(f"| {name:<42} | {rate:>9.1f} | {f'{low:.0f}-{high:.0f}':>15} | {ratio} | {ratio2} |")


if __name__ == "__main__":
    main()

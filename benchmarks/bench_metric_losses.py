"""Forward+backward time and peak memory of the metric-learning losses against pytorch-metric-learning.

Each row runs one of our losses and its pytorch-metric-learning (PML) counterpart, configured to
compute the same quantity (the configurations the tests prove equal), on the same embeddings
(D = 512) in the same process:

* B = 128 with 10 samples per class (the last class has 8), B = 512 with 16 per class;
* CPU with 1 and 2 threads (and CUDA when available);
* time = median of forward + backward runs (ours and PML interleaved, after one warm-up each; at
  least 3 runs, more for fast losses within about a second, ``--full``: at least 10);
* memory = peak RSS growth of a forked child doing one single-threaded forward + backward on CPU,
  minus that of a no-op loss on the same batch (shown on the first thread count's row)
  (``torch.cuda.max_memory_allocated`` on CUDA).

PML's ``LiftedStructureLoss`` at B = 512 needs more than 24 GB (a #positive-pairs × #negative-pairs
mask) and is not run: its cell prints "OOM (known)".  PML's ``SmoothAPLoss`` only accepts equal class
sizes, so the Smooth-AP rows use 8 per class at B = 128.  The binomial deviance loss has no PML
counterpart.  The default (``--quick``) times a PML run that takes over 5 s only once (cold; its
ratio is marked ``*``) and skips its memory; ``--full`` repeats everything.

    python benchmarks/bench_metric_losses.py [--full] [--threads 1 2] [--batch 128 512] [--no-memory]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import print_header  # noqa: E402
from pytorch_metric_learning import distances, losses, miners  # noqa: E402  (benchmark-only import)

from caffe_compat.losses.binomial_deviance import BinomialDevianceLoss  # noqa: E402
from caffe_compat.losses.contrastive import ContrastiveLoss  # noqa: E402
from caffe_compat.losses.fastap import FastAPLoss  # noqa: E402
from caffe_compat.losses.histogram import HistogramLoss  # noqa: E402
from caffe_compat.losses.lifted_struct import LiftedStructLoss  # noqa: E402
from caffe_compat.losses.margin import MarginLoss  # noqa: E402
from caffe_compat.losses.multi_similarity import MultiSimilarityLoss  # noqa: E402
from caffe_compat.losses.raw import RAWLoss  # noqa: E402
from caffe_compat.losses.smooth_ap import SmoothAPLoss  # noqa: E402
from caffe_compat.losses.triplet import TripletLoss  # noqa: E402

DIM = 512
PER_CLASS = {128: 10, 512: 16}
KNOWN_OOM = {("lifted structure", 512)}


def pml_with_miner(loss, miner):
    return lambda x, y: loss(x, y, miner(x, y))


def cases():
    """(name, ours, PML or None, samples per class override or None)."""
    lp2 = distances.LpDistance(power=2)
    return [
        ("contrastive (p=1)", ContrastiveLoss(power=1),
         losses.ContrastiveLoss(distance=distances.LpDistance(normalize_embeddings=False)), None),
        ("triplet all", TripletLoss(reduction="mean_nonzero"), losses.TripletMarginLoss(margin=0.2, distance=lp2), None),
        ("triplet semihard", TripletLoss(triplets="semihard", reduction="mean_nonzero"),
         pml_with_miner(losses.TripletMarginLoss(margin=0.2, distance=lp2),
                        miners.TripletMarginMiner(margin=0.2, type_of_triplets="semihard", distance=lp2)), None),
        ("lifted structure", LiftedStructLoss(),
         losses.LiftedStructureLoss(distance=distances.LpDistance(normalize_embeddings=False)), None),
        ("histogram (100 bins)", HistogramLoss(num_bins=100), losses.HistogramLoss(n_bins=100), None),
        ("binomial deviance", BinomialDevianceLoss(), None, None),
        ("RAW + VTHM", RAWLoss(), pml_with_miner(losses.MultiSimilarityLoss(), miners.MultiSimilarityMiner(0.1)), None),
        ("multi-similarity", MultiSimilarityLoss(), losses.MultiSimilarityLoss(), None),
        ("margin + DW sampling", MarginLoss(),
         pml_with_miner(losses.MarginLoss(margin=0.2, beta=1.2, learn_beta=True), miners.DistanceWeightedMiner()), None),
        ("FastAP (10 bins)", FastAPLoss(num_bins=10), losses.FastAPLoss(num_bins=10), None),
        ("FastAP analytic grad", FastAPLoss(num_bins=10, analytic_gradient=True), losses.FastAPLoss(num_bins=10), None),
        ("Smooth-AP (query incl.)", SmoothAPLoss(include_query=True), losses.SmoothAPLoss(temperature=0.01), {128: 8}),
    ]


def batch(size, per_class, device):
    gen = torch.Generator().manual_seed(size)
    x = torch.randn(size, DIM, generator=gen)
    y = torch.arange(size) // per_class
    return x.to(device), y.to(device)


def fwd_bwd(fn, x, y):
    e = x.detach().clone().requires_grad_(True)
    loss = fn(e, y)
    loss.backward()
    if e.is_cuda:
        torch.cuda.synchronize()
    return loss


def _once(fn, x, y):
    start = time.perf_counter()
    fwd_bwd(fn, x, y)
    return time.perf_counter() - start


def time_pair(ours, pml, x, y, repeats, budget_s=1.0, most=50, slow_s=None):
    """Median fwd+bwd seconds of ours and PML, runs interleaved so that load from other processes hits
    both alike; fast pairs get more runs (up to ``most``, within ``budget_s``).  A PML run longer than
    ``slow_s`` is not repeated: its first (cold) run is the figure, flagged by the returned bool."""
    t_ours = [_once(ours, x, y)]  # warm-up
    first_pml = _once(pml, x, y) if pml is not None else 0.0
    single = pml is not None and slow_s is not None and first_pml > slow_s
    runs = max(repeats, min(most, int(budget_s / max(t_ours[0] + first_pml, 1e-6))))
    t_ours, t_pml = [], ([first_pml] if single else [])
    for _ in range(runs):
        t_ours.append(_once(ours, x, y))
        if pml is not None and not single:
            t_pml.append(_once(pml, x, y))
    return statistics.median(t_ours), (statistics.median(t_pml) if pml is not None else None), single


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _child_peak(fn, x, y, queue):
    torch.set_num_threads(1)  # a forked child must not wake the parent's OpenMP pool (libgomp deadlock)
    base = _rss_bytes()
    fwd_bwd(fn, x, y)
    queue.put(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base)


def _noop_loss(e, y):
    return (e * 0.0).sum()


def peak_memory_mb(fn, x, y):
    """Peak memory of one fwd+bwd beyond what a no-op loss on the same batch needs (MB)."""
    if x.is_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fwd_bwd(fn, x, y)
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    ctx = mp.get_context("fork")
    peaks = []
    for target in (_noop_loss, fn):
        queue = ctx.Queue()
        child = ctx.Process(target=_child_peak, args=(target, x, y, queue))
        child.start()
        child.join()
        if child.exitcode != 0:
            return float("nan")
        peaks.append(queue.get())
    return max(peaks[1] - peaks[0], 0) / 2**20


def fmt_time(t):
    return f"{t * 1e3:10.2f}" if isinstance(t, float) else f"{t:>10s}"


def fmt_mem(m):
    return f"{m:8.1f}" if isinstance(m, float) else f"{m:>8s}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true",
                      help="default: >= 3 runs; a PML run over 5 s is timed once (ratio marked *), no PML memory")
    mode.add_argument("--full", action="store_true", help=">= 10 runs of everything, memory of everything")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batch", type=int, nargs="+", default=[128, 512], choices=sorted(PER_CLASS))
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory column")
    parser.add_argument("--only", nargs="*", default=None, help="substrings of the loss names to run")
    parser.add_argument("--device", choices=["all", "cpu", "cuda"], default="all",
                        help="all: the CPU rows, and CUDA when present")
    args = parser.parse_args(argv)
    repeats = 10 if args.full else 3
    slow_s = None if args.full else 5.0  # quick: a PML run over 5 s is timed once, memory not measured

    devices = [("cpu", t) for t in args.threads] if args.device in ("all", "cpu") else []
    if args.device in ("all", "cuda") and torch.cuda.is_available():
        devices.append(("cuda", None))
    if not devices:
        parser.error("--device cuda: no CUDA device is available")
    print_header("pytorch-metric-learning's loss on the same embeddings (same run)")
    header = f"{'loss':26s} {'dev':8s} {'B':>4s} {'ours ms':>10s} {'PML ms':>10s} {'PML÷ours':>9s} {'ours MB':>8s} {'PML MB':>8s}"
    print(header)
    print("-" * len(header))
    for name, ours, pml, per_class_override in cases():
        if args.only and not any(s.lower() in name.lower() for s in args.only):
            continue
        for size in args.batch:
            per_class = (per_class_override or {}).get(size, PER_CLASS[size])
            for device, threads in devices:
                if threads is not None:
                    torch.set_num_threads(threads)
                x, y = batch(size, per_class, device)
                ours_fn = ours.to(device)
                # CPU memory does not depend on the thread count: measured on the first CPU row only
                skip_memory = args.no_memory or (device == "cpu" and threads != args.threads[0])
                if pml is None or (name, size) in KNOWN_OOM:
                    t_ours, _, _ = time_pair(ours_fn, None, x, y, repeats)
                    t_pml = "n/a" if pml is None else "OOM (known)"
                    m_pml = "n/a" if pml is None else "OOM"
                    ratio = "n/a" if pml is None else "-"
                else:
                    pml_fn = pml.to(device) if isinstance(pml, torch.nn.Module) else pml
                    t_ours, t_pml, single = time_pair(ours_fn, pml_fn, x, y, repeats, slow_s=slow_s)
                    m_pml = "-" if skip_memory or single else peak_memory_mb(pml_fn, x, y)
                    ratio = f"{t_pml / t_ours:8.1f}x" + ("*" if single else "")
                m_ours = "-" if skip_memory else peak_memory_mb(ours_fn, x, y)
                dev = f"{device}x{threads}" if threads is not None else device
                print(f"{name:26s} {dev:8s} {size:4d} {fmt_time(t_ours)} {fmt_time(t_pml)} {ratio:>9s} "
                      f"{fmt_mem(m_ours)} {fmt_mem(m_pml)}", flush=True)


if __name__ == "__main__":
    main()

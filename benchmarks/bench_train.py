"""Training iterations/s of the authors' CUB-200 net: GoogLeNet + fc_embedding(512) +
CosineSimilarityBatch + FAPPYLoss (delta 1e-4), one full Solver iteration (forward, backward, Caffe's
SGD update with lr_mult/decay_mult, momentum 0.9, weight decay 2e-4).

The net is ``prototxt/cub200/train_fappy.prototxt`` (our copy of the authors' CUB-200 net) with the Python ``LabelShufflingLayer``
replaced by two Input layers, ``data`` (N, 3, 224, 224) and ``label`` (N,) in runs of
``min(10, N // 4)`` images per class (the authors' sampler uses 10; small CPU batches need shorter runs
so that every batch has negatives).  Weights come from Caffe's fillers (seed 0); inputs are Gaussian.

Rows: the baseline (float32, NCHW, eager) and its variants on the same device — bf16/fp16 autocast,
channels_last, on CUDA the iterations recorded as CUDA graphs (``Solver.step_graphs``), optionally
torch.compile — each as iterations/s and the ratio to the baseline measured
in the same run.  Reference, not re-measured: real Caffe (CPU, 1 thread) needs 1.659 s for
forward+backward of the GoogLeNet part at N=8 and 6.272 s at N=32 on a 2-vCPU AMD EPYC, 3.201 s at N=8 on
a 2-vCPU Intel Xeon (FAPPY and the update excluded; its CosineSimilarityBatch+FAPPY at B=128, delta 1e-4
took 0.714 s / 0.943 s) (caffe_reference README, section 6): the row of this CPU's class is printed.
Every ratio is peer time ÷ our time (> 1: ours faster): the fp32 NCHW eager baseline ÷ the variant, and
real Caffe ÷ our fp32 baseline.

Hand-written rows (``--handwritten``, on by default): the same net written as a plain PyTorch ``nn.Module``
(``handwritten_googlenet.py``: standard PyTorch operators, ``torch.optim.SGD``, the same FAPPY loss) with
the same variant, its weights copied from ours, the two timed in turn in the same run; the row names how
far its embeddings are from ours (dropout off), and its ratio is hand-written ÷ ours (the issue's goal on
CUDA: ≥ 0.95).

Data-layer rows (``--lmdb-size S``, default 256; 0 skips them): the same net fed by the authors'
``LabelShufflingLayer`` (the port, as their prototxt names it: runs of ``min(10, N // 4)`` per label,
``scales: [1, 1]``) reading an LMDB of S×S JPEGs that the script writes in a temporary folder with the
project's own ``convert_imageset`` (``caffe-compat make-lmdb``) from a toy CUB-200 tree: once without
prefetching and once prefetching with ``--prefetch-workers`` decode threads (default 2), against the
synthetic-input step at S×S measured in the same run (the layer does not crop: the net sees S×S).

Usage: ``python benchmarks/bench_train.py [--device cpu|cuda|all] [--batch N] [--iters 3] [--compile]
[--no-handwritten] [--lmdb-size 256] [--prefetch-workers 2]``.
Defaults: CUDA batch 128 (the authors'), TF32 off; CPU batch 8 with one thread (the team machine has 2 shared
cores: batch 128 at 224² would take minutes per iteration there).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import add_malloc_option, apply_malloc_option, caffe_reference, fmt_ratio, print_header  # noqa: E402
from caffe_compat.io import read_net  # noqa: E402
from caffe_compat.proto import caffe_pb2  # noqa: E402
from caffe_compat.solver import Solver  # noqa: E402
from caffe_compat.solver.step_graphs import WARMUP_ITERATIONS, StepGraphs  # noqa: E402

#: Our copy of the authors' CUB-200 train net (tests/zoo proves it equal to theirs, data layer aside).
AUTHORS_NET = Path(__file__).resolve().parents[1] / "prototxt" / "cub200" / "train_fappy.prototxt"


def run_length(batch: int) -> int:
    return max(1, min(10, batch // 4))


def authors_net(batch: int, size: int = 224, lmdb: str | None = None, prefetch: tuple[int, int] = (0, 0)
                ) -> caffe_pb2.NetParameter:
    """The authors' train net with Input layers instead of the Python data layer, or with that layer
    reading ``lmdb`` (``prefetch``: queue depth and decode workers)."""
    source = read_net(str(AUTHORS_NET))
    net = caffe_pb2.NetParameter(name=source.name)
    for layer in source.layer:
        if layer.type == "Python" and lmdb:
            data = net.layer.add()
            data.CopyFrom(layer)
            data.python_param.param_str = (f"source: {lmdb}\nbatch_size: {batch}\nscales: [1.0, 1.0]\n"
                                           f"max_number_object_per_label: {run_length(batch)}\n"
                                           f"prefetch: {prefetch[0]}\nprefetch_workers: {prefetch[1]}\n")
        elif layer.type == "Python":
            data = net.layer.add(name="data", type="Input", top=["data"])
            data.input_param.shape.add(dim=[batch, 3, size, size])
            label = net.layer.add(name="label", type="Input", top=["label"])
            label.input_param.shape.add(dim=[batch])
        else:
            net.layer.add().CopyFrom(layer)
    return net


def authors_solver(batch: int, **net) -> caffe_pb2.SolverParameter:
    param = caffe_pb2.SolverParameter(type="SGD", base_lr=1e-5, lr_policy="step", stepsize=32000, gamma=0.7,
                                      momentum=0.9, weight_decay=2e-4, display=0, max_iter=1000, random_seed=0)
    param.net_param.CopyFrom(authors_net(batch, **net))
    return param


def batch_inputs(batch: int, size: int = 224):
    gen = np.random.RandomState(0)
    labels = (np.arange(batch) // run_length(batch)).astype(np.float32)
    return {"data": (gen.randn(batch, 3, size, size) * 50).astype(np.float32), "label": labels}


def make_jpeg_lmdb(folder: Path, size: int) -> str:
    """A toy CUB-200 tree of ``size``² JPEGs written to an LMDB of encoded Datums by convert_imageset."""
    from caffe_compat.data import Cub200, make_toy_data
    from caffe_compat.data.imageset import convert_imageset

    root = make_toy_data("cub", folder / "CUB_200_2011", seed=0, size=size, num_classes=20, images_per_class=12)
    records = Cub200(root, "train").records
    (folder / "list.txt").write_text("".join(f"{r.path} {r.label}\n" for r in records))
    convert_imageset(folder / "list.txt", "", folder / "lmdb", encoded=True, progress=False)
    return str(folder / "lmdb")


#: ``--clock thread``: the main thread's CPU time (what a shared, oversubscribed machine cannot inflate; it
#: leaves out the prefetch threads' work and any wait for them, so read it beside a wall-clock run).
CLOCK = {"clock": time.perf_counter}
#: ``--amp`` names of the autocast dtypes.
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _ours(device: str, batch: int, amp=None, channels_last=False, compile=False, size: int = 224,
          lmdb: str | None = None, prefetch: tuple[int, int] = (0, 0), cuda_graphs=False):
    """One Solver iteration of the authors' net as a callable, and what to call when done (``cuda_graphs``:
    the iterations recorded as CUDA graphs, :mod:`caffe_compat.solver.step_graphs`; the warm-up and the
    recording happen here, before any timing)."""
    solver = Solver(authors_solver(batch, size=size, lmdb=lmdb, prefetch=prefetch), device=device)
    inputs = {k: torch.from_numpy(v).to(device) for k, v in batch_inputs(batch, size).items()}
    if channels_last:
        solver.net.to(memory_format=torch.channels_last)
        solver.memory_format = torch.channels_last
    if amp:
        solver.autocast_dtype = AMP_DTYPES[amp]
        if amp == "fp16":
            solver.grad_scaler = torch.amp.GradScaler(solver.device.type)
    if compile:
        solver.forward_fn = torch.compile(solver.net)
    if lmdb is None:
        solver.data_source = iter(lambda: inputs, None)
    done = solver.net.layer("data").reset_prefetch if lmdb is not None else (lambda: None)
    if cuda_graphs:
        solver.step_graphs = StepGraphs(solver)
        if not solver.step_graphs.active:
            raise SystemExit(f"CUDA graphs: {solver.step_graphs.reason}")
        solver.step(WARMUP_ITERATIONS + 1)
        assert solver.step_graphs.recorded
    return (lambda: solver.step(1)), done, solver.net


def _handwritten(device: str, batch: int, weights_from, amp=None, channels_last=False, compile=False,
                 cuda_graphs=False):
    """One iteration of the hand-written peer (:mod:`handwritten_googlenet`, 224² inputs) with the same
    variant, its weights those of the CaffeNet ``weights_from``; also returns the two nets' embedding
    difference.  ``cuda_graphs``: the whole iteration (forward, backward, ``optimizer.step()``) recorded as
    one CUDA graph after three warm-up iterations on a side stream, PyTorch's documented recipe."""
    from handwritten_googlenet import HandWrittenGoogLeNet, copy_caffe_weights, max_embedding_difference, sgd

    param = authors_solver(batch)
    module = HandWrittenGoogLeNet().to(device)
    inputs = {k: torch.from_numpy(v).to(device) for k, v in batch_inputs(batch).items()}
    copy_caffe_weights(module, weights_from)
    difference = max_embedding_difference(module, weights_from, inputs["data"], inputs["label"])
    optimizer = sgd(module, param.base_lr, param.momentum, param.weight_decay)
    data, labels = inputs["data"], inputs["label"]
    if channels_last:
        module.to(memory_format=torch.channels_last)
        data = data.contiguous(memory_format=torch.channels_last)
    forward = torch.compile(module) if compile else module
    dtype = AMP_DTYPES.get(amp)
    scaler = torch.amp.GradScaler(torch.device(device).type) if amp == "fp16" else None

    def step():
        optimizer.zero_grad(set_to_none=True)
        # no autocast cache: a CUDA graph records this step (it would keep the casts made while recording)
        with torch.autocast(torch.device(device).type, dtype=dtype, enabled=dtype is not None, cache_enabled=False):
            loss = forward(data, labels)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    if cuda_graphs:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()  # its zero_grad(set_to_none=True) runs while recording: the backward assigns the grads
        return graph.replay, difference
    return step, difference


def time_alternately(device: str, steps, iters: int) -> list[float]:
    """Median seconds per call of each step, after one warm-up call each (compilation, prefetch threads),
    the steps called in turn so that every one sees the same machine."""
    for step in steps:
        step()
    times = [[] for _ in steps]
    for _ in range(iters):
        for step, spent in zip(steps, times):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            start = CLOCK["clock"]()
            step()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            spent.append(CLOCK["clock"]() - start)
    return [statistics.median(spent) for spent in times]


def measure(device: str, batch: int, iters: int, **variant) -> float:
    """Median seconds per Solver iteration of the authors' net (``variant``: see :func:`_ours`)."""
    step, done, _ = _ours(device, batch, **variant)
    try:
        return time_alternately(device, [step], iters)[0]
    finally:
        done()


def measure_with_handwritten(device: str, batch: int, iters: int, **variant) -> tuple[float, float, float]:
    """``(ours, hand-written, embedding difference)``: both nets from the same fillers, timed in turn."""
    ours, _, net = _ours(device, batch, **variant)
    peer, difference = _handwritten(device, batch, net, **variant)
    return (*time_alternately(device, [ours, peer], iters), difference)


def data_layer_rows(device: str, batch: int, iters: int, size: int, workers: int) -> None:
    """The LabelShufflingLayer-over-LMDB rows against the synthetic-input step at the same size."""
    with tempfile.TemporaryDirectory() as tmp:
        lmdb = make_jpeg_lmdb(Path(tmp), size)
        synthetic = measure(device, batch, iters, size=size)
        rows = [(f"synthetic input {size}² (peer)", synthetic),
                (f"LabelShufflingLayer, LMDB {size}² JPEG, no prefetch", measure(device, batch, iters, size=size,
                                                                                lmdb=lmdb)),
                (f"LabelShufflingLayer, LMDB {size}² JPEG, prefetch 3, {workers} workers",
                 measure(device, batch, iters, size=size, lmdb=lmdb, prefetch=(3, workers)))]
    for name, seconds in rows:
        print(f"| {device} | {batch} | {name} | {seconds:.3f} | {1 / seconds:.2f} | {batch / seconds:.1f} | "
              f"{fmt_ratio(synthetic, seconds, 1)} (synthetic ÷ this) |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="all", choices=["cpu", "cuda", "all"])
    parser.add_argument("--batch", type=int, default=None, help="default: 128 on CUDA, 8 on CPU")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="also time torch.compile variants")
    parser.add_argument("--lmdb-size", type=int, default=256, help="side of the LMDB's JPEGs (0: no data-layer rows)")
    parser.add_argument("--prefetch-workers", type=int, default=2)
    parser.add_argument("--variants", default="all", choices=["all", "fp32", "none"],
                        help="which synthetic-input variant rows to time (fp32: the baseline, and its compiled "
                             "twin with --compile; none: the data-layer rows only)")
    parser.add_argument("--handwritten", action=argparse.BooleanOptionalAction, default=True,
                        help="time the hand-written nn.Module peer (handwritten_googlenet.py) beside each variant, "
                             "in turn with ours (default: on)")
    parser.add_argument("--clock", default="wall", choices=["wall", "thread"],
                        help="wall clock (default) or the main thread's CPU time (see CLOCK)")
    add_malloc_option(parser)
    args = parser.parse_args()
    malloc = apply_malloc_option(args)
    CLOCK["clock"] = time.thread_time if args.clock == "thread" else time.perf_counter
    devices = ["cpu", "cuda"] if args.device == "all" else [args.device]
    if "cuda" in devices and not torch.cuda.is_available():
        print("CUDA not available: CPU rows only")
        devices = [d for d in devices if d != "cuda"]
    print_header("fp32 NCHW eager (same run) for the variants; real Caffe (recorded) for its row")
    print(malloc)
    reference, note = caffe_reference()
    caffe_seconds = {n: t[1] for n, t in (reference or {}).get("googlenet_full", {}).items()}  # fwd+bwd only
    print(note)
    print(f"clock: {args.clock}{' (main-thread CPU time)' if args.clock == 'thread' else ''}")
    print("| device | batch | variant | s/iter | iter/s | images/s | peer ÷ ours |")
    print("|---|---|---|---|---|---|---|")
    for device in devices:
        batch = args.batch or (128 if device == "cuda" else 8)
        variants = [("fp32", {}), ("fp32 channels_last", {"channels_last": True}), ("bf16 autocast", {"amp": "bf16"})]
        if device == "cpu":
            torch.set_num_threads(1)
        else:  # float32 is float32: no TF32 in cuDNN's convolutions (on by default) nor in matrix products
            torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
            print(f"{torch.cuda.get_device_name()}: TF32 off (cuDNN and cuBLAS)")
            variants += [("fp16 autocast + GradScaler", {"amp": "fp16"}),
                         ("bf16 autocast + channels_last", {"amp": "bf16", "channels_last": True}),
                         ("fp32 + CUDA graphs", {"cuda_graphs": True}),
                         ("bf16 autocast + channels_last + CUDA graphs",
                          {"amp": "bf16", "channels_last": True, "cuda_graphs": True})]
        if args.compile:
            variants += [(name + " + compile", dict(kw, compile=True)) for name, kw in list(variants)]
        variants = {"all": variants, "fp32": [v for v in variants if v[0] in ("fp32", "fp32 + compile")],
                    "none": []}[args.variants]
        base = None
        for name, kwargs in variants:
            if args.handwritten:
                seconds, peer, difference = measure_with_handwritten(device, batch, args.iters, **kwargs)
            else:
                seconds = measure(device, batch, args.iters, **kwargs)
            base = base or seconds
            print(f"| {device} | {batch} | {name} | {seconds:.3f} | {1 / seconds:.2f} | {batch / seconds:.1f} | "
                  f"{fmt_ratio(base, seconds, 1)} |", flush=True)
            if args.handwritten:
                print(f"| {device} | {batch} | hand-written nn.Module, {name} (embeddings differ by {difference:.1e} "
                      f"relative) | {peer:.3f} | {1 / peer:.2f} | {batch / peer:.1f} | {fmt_ratio(peer, seconds, 2)} "
                      f"(hand-written ÷ ours) |", flush=True)
        if args.lmdb_size:
            data_layer_rows(device, batch, args.iters, args.lmdb_size, args.prefetch_workers)
        if device == "cpu" and batch in caffe_seconds and base:
            caffe = caffe_seconds[batch]
            print(f"| cpu (real Caffe, recorded, 1 thread) | {batch} | fwd+bwd of GoogLeNet only | ~{caffe:.3f} | "
                  f"{1 / caffe:.2f} | {batch / caffe:.1f} | {fmt_ratio(caffe, base, 1)} (Caffe ÷ our fp32) |")


if __name__ == "__main__":
    main()

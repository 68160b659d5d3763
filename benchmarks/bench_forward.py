"""CPU forward throughput of converted Caffe nets against OpenCV dnn, measured in the same run.

Nets: the full-width GoogLeNet embedding net (``../shared/caffe_reference/large/googlenet_full``, output
``fc_embedding``, batch 8 and 32) and open_nsfw (``--nsfw-dir``, default ``.cache/nsfw``, where
``caffe-compat models fetch open_nsfw`` puts it; ResNet-50-1by2 with separate
BatchNorm + Scale layers, output ``prob``, batch 1 and 8); 3×224×224 inputs, the same random array
fed to both.  Peer: OpenCV 4.x ``cv2.dnn.readNetFromCaffe`` (OpenCV backend, CPU target), which runs the
same Caffe files.  Our variants: ``CaffeNet`` eager, eager with ``channels_last`` (weights and input),
``torch.compile`` (inductor) of the same call, with and without ``channels_last``, and the fused inference
net (``net.fuse_for_inference()``, :mod:`caffe_compat.fuse`: BatchNorm/Scale/ReLU/shortcut folded into
oneDNN convolutions, channels_last end to end; ``--no-fused`` skips it).

Thread count ``n`` (``--threads``, default 1) is set for both: ``torch.set_num_threads(n)`` and
``cv2.setNumThreads(n)``.  Every forward runs under ``torch.inference_mode()``.  Each runner is called once
untimed (warm-up; for the compiled variants this is where compilation happens, and its time is printed
apart), then the runners are timed round-robin ``--repeats`` times, so that load from other processes
hits every runner alike; the table shows the median.  ``OpenCV÷ours`` = OpenCV ms / our ms (> 1 means
faster than OpenCV), the convention of every ratio here (``--profile``'s too).  The last column gives,
per compared blob (GoogLeNet: ``fc_embedding``; open_nsfw: the logits ``fc_nsfw`` and ``prob``, which
random inputs saturate), the largest absolute difference between our blob and OpenCV's, from one extra
untimed call; OpenCV's row shows its largest absolute value for scale.  A variant that cannot run
(e.g. ``torch.compile`` failing on this box) shows ``n/a (reason)``.

``--profile`` adds, per net at the first batch size, the forward time split by Caffe layer type for
the eager CaffeNet (each layer timed alone) and for OpenCV (``getPerfProfile``; a layer OpenCV fused
into its predecessor reports ~0 and its cost appears under that predecessor's type).

    python benchmarks/bench_forward.py [--threads 1] [--repeats 5] [--quick]
        [--nets googlenet_full open_nsfw] [--no-compile] [--no-fused] [--profile] [--nsfw-dir DIR]
        [--clock wall|thread]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import cv2
import numpy as np
import torch
from _common import add_malloc_option, apply_malloc_option, fmt_ratio, print_header

from caffe_compat.net import CaffeNet

ROOT = Path(__file__).resolve().parents[1]
GOOGLENET = ROOT.parent / "shared" / "caffe_reference" / "large" / "googlenet_full"
#: Default of --nsfw-dir: the folder ``caffe-compat models fetch open_nsfw`` (default cache .cache) fills.
NSFW = ROOT / ".cache" / "nsfw"


@dataclass(frozen=True)
class NetSpec:
    """One benchmarked net: Caffe files, the output blob compared, batch sizes (full run, --quick)."""

    name: str
    prototxt: Path
    weights: Path
    output: str
    compared: tuple[str, ...]
    batches: tuple[int, ...]
    quick_batches: tuple[int, ...]


def net_specs(nsfw_dir: Path = NSFW) -> dict[str, NetSpec]:
    return {
        "googlenet_full": NetSpec("googlenet_full", GOOGLENET / "deploy.prototxt", GOOGLENET / "weights.caffemodel",
                                  "fc_embedding", ("fc_embedding",), (8, 32), (8,)),
        "open_nsfw": NetSpec("open_nsfw", nsfw_dir / "deploy.prototxt", nsfw_dir / "resnet_50_1by2_nsfw.caffemodel",
                             "prob", ("fc_nsfw", "prob"), (1, 8), (1,)),
    }


NETS = net_specs()

#: How to get a missing net's files.
MISSING_HINT = {
    "googlenet_full": "the shared Caffe reference fixtures (../shared/caffe_reference/large) are not there",
    "open_nsfw": "fetch it with `caffe-compat models fetch open_nsfw --cache DIR` and pass --nsfw-dir DIR/nsfw",
}


@dataclass
class Runner:
    """A named forward ``fn(x) -> output blob`` (timed), ``blobs(x, names) -> {name: array}`` (agreement
    check, untimed), or the reason it is unavailable."""

    variant: str
    fn: Callable[[np.ndarray], np.ndarray] | None
    blobs: Callable[[np.ndarray, tuple[str, ...]], dict[str, np.ndarray]] | None = None
    reason: str = ""
    note: str = ""
    model: object = None  # the cv2.dnn.Net or CaffeNet behind it, for --profile


# ---------------------------------------------------------------------------- runners


def opencv_runner(spec: NetSpec) -> Runner:
    net = cv2.dnn.readNetFromCaffe(str(spec.prototxt), str(spec.weights))
    net.setPreferableBackend(cv2.dnn.DNN_BACKEND_OPENCV)
    net.setPreferableTarget(cv2.dnn.DNN_TARGET_CPU)

    def forward(x: np.ndarray) -> np.ndarray:
        net.setInput(x)
        return net.forward(spec.output)

    def blobs(x: np.ndarray, names: tuple[str, ...]) -> dict[str, np.ndarray]:
        net.setInput(x)
        return dict(zip(names, net.forward(list(names))))

    return Runner("OpenCV dnn", forward, blobs, model=net)


def torch_runner(spec: NetSpec, channels_last: bool, compiled: bool, fused: bool = False) -> Runner:
    variant = ("torch.compile" if compiled else "eager") + (" + channels_last" if channels_last else "")
    if fused:
        variant = "fused (fuse_for_inference)"
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    try:
        net = CaffeNet(str(spec.prototxt), weights=str(spec.weights)).eval().to(memory_format=memory_format)
        if fused:
            net = net.fuse_for_inference()
    except Exception as exc:  # noqa: BLE001 - reported in the table
        return Runner(variant, None, reason=short_reason(exc))

    def outputs_of(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        blobs = net(data=x)
        return tuple(blobs[name] for name in (spec.output, *spec.compared))

    call = outputs_of
    if compiled:
        try:
            call = torch.compile(outputs_of, dynamic=False)
        except Exception as exc:  # noqa: BLE001 - reported in the table
            return Runner(variant, None, reason=short_reason(exc))

    def run(x: np.ndarray) -> tuple[torch.Tensor, ...]:
        with torch.inference_mode():
            return call(torch.from_numpy(x).contiguous(memory_format=memory_format))

    def forward(x: np.ndarray) -> np.ndarray:
        return run(x)[0].numpy()

    def blobs(x: np.ndarray, names: tuple[str, ...]) -> dict[str, np.ndarray]:
        return {name: out.numpy() for name, out in zip(spec.compared, run(x)[1:]) if name in names}

    return Runner(variant, forward, blobs, model=net)


def short_reason(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first[:70]}" if first else type(exc).__name__


# ---------------------------------------------------------------------------- timing


def warm_up(runner: Runner, x: np.ndarray) -> None:
    """One untimed call (compilation happens here); a failure makes the runner unavailable."""
    if runner.fn is None:
        return
    start = time.perf_counter()
    try:
        runner.fn(x)
    except Exception as exc:  # noqa: BLE001 - reported in the table
        runner.fn, runner.reason = None, short_reason(exc)
        return
    if runner.variant.startswith("torch.compile"):
        runner.note = f"compile+first call {time.perf_counter() - start:.1f} s"


#: ``--clock``: wall time, or this thread's CPU time (with one thread every engine computes in the calling
#: thread, so time other processes take from the CPU is not counted: steadier on a shared machine).
CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}
clock = time.perf_counter


def time_round_robin(runners: list[Runner], x: np.ndarray, repeats: int) -> dict[str, float]:
    """Median seconds per call of every available runner."""
    times: dict[str, list[float]] = defaultdict(list)
    for _ in range(repeats):
        for runner in runners:
            if runner.fn is None:
                continue
            start = clock()
            try:
                runner.fn(x)
            except Exception as exc:  # noqa: BLE001 - reported in the table
                runner.fn, runner.reason = None, short_reason(exc)
                times.pop(runner.variant, None)
                continue
            times[runner.variant].append(clock() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def agreement(runner: Runner, reference: dict[str, np.ndarray] | None, x: np.ndarray,
              names: tuple[str, ...]) -> str:
    """``blob Δ`` per compared blob: max |ours − OpenCV|, or OpenCV's max |value| on its own row."""
    if reference is None:
        return "-"
    if runner.variant == "OpenCV dnn":
        return "  ".join(f"{n} max|v| {np.abs(reference[n]).max():.3g}" for n in names)
    ours = runner.blobs(x, names)
    return "  ".join(f"{n} {np.abs(ours[n] - reference[n]).max():.1e}" for n in names)


# ---------------------------------------------------------------------------- profile by layer type


def caffenet_profile(net: CaffeNet, x: np.ndarray, repeats: int) -> dict[str, float]:
    """Seconds per forward spent in each Caffe layer type (each layer's module call timed alone)."""
    totals: dict[str, float] = defaultdict(float)
    with torch.inference_mode():
        for _ in range(repeats):
            values = {"data": torch.from_numpy(x)}
            for step in net.steps:
                if step.module_key is None:  # automatic Split: views only
                    for top in step.tops:
                        values[top] = values[step.bottoms[0]]
                    continue
                if not step.bottoms:
                    continue
                start = time.perf_counter()
                outs = net.layers[step.module_key](*[values[b] for b in step.bottoms])
                totals[step.type] += time.perf_counter() - start
                values.update(zip(step.tops, (outs,) if torch.is_tensor(outs) else outs))
    return {k: v / repeats for k, v in totals.items()}


def opencv_profile(cv_net, x: np.ndarray, repeats: int) -> dict[str, float]:
    """Seconds per forward in each layer type as OpenCV's ``getPerfProfile`` reports it."""
    totals: dict[str, float] = defaultdict(float)
    names = cv_net.getLayerNames()
    ticks = cv2.getTickFrequency()
    for _ in range(repeats):
        cv_net.setInput(x)
        cv_net.forward()
        _, per_layer = cv_net.getPerfProfile()
        for name, t in zip(names, np.asarray(per_layer).reshape(-1)):
            totals[cv_net.getLayer(name).type] += float(t) / ticks
    return {k: v / repeats for k, v in totals.items()}


def print_profile(spec: NetSpec, batch: int, ours: dict[str, float], theirs: dict[str, float]) -> None:
    print(f"\n{spec.name}, batch {batch}: ms per forward by layer type (eager CaffeNet vs OpenCV getPerfProfile)")
    print(f"{'layer type':<16}{'CaffeNet ms':>13}{'OpenCV ms':>11}{'OpenCV÷ours':>13}")
    kinds = sorted(set(ours) | set(theirs), key=lambda k: -max(ours.get(k, 0.0), theirs.get(k, 0.0)))
    for kind in kinds:
        a, b = ours.get(kind, 0.0) * 1e3, theirs.get(kind, 0.0) * 1e3
        ratio = fmt_ratio(b, a, 13) if b > 1e-3 and a > 1e-3 else f"{'-':>13}"
        print(f"{kind:<16}{a:>13.1f}{b:>11.1f}{ratio}")
    print(f"{'total':<16}{sum(ours.values()) * 1e3:>13.1f}{sum(theirs.values()) * 1e3:>11.1f}")


# ---------------------------------------------------------------------------- main


def measure(spec: NetSpec, runners: list[Runner], x: np.ndarray, repeats: int, rows: list, notes: list) -> None:
    """Warm up, time round-robin, check agreement; append one table row per runner (OpenCV first)."""
    for runner in runners:
        runner.note = ""
        warm_up(runner, x)
    seconds = time_round_robin(runners, x, repeats)
    opencv = runners[0]
    reference = opencv.blobs(x, spec.compared) if opencv.fn is not None else None
    base = seconds.get(opencv.variant)
    batch = x.shape[0]
    for runner in runners:
        if runner.variant not in seconds:
            rows.append((spec.name, batch, runner.variant, None, None, None, f"n/a ({runner.reason})"))
            continue
        s = seconds[runner.variant]
        diff = agreement(runner, reference, x, spec.compared)
        rows.append((spec.name, batch, runner.variant, s * 1e3, batch / s, base / s if base else None, diff))
        if runner.note:
            notes.append(f"{spec.name} b{batch} {runner.variant}: {runner.note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="first batch size of each net, 2 repeats")
    parser.add_argument("--nets", nargs="+", choices=sorted(NETS), default=list(NETS))
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile variants")
    parser.add_argument("--no-fused", action="store_true", help="skip the fused inference variant")
    parser.add_argument("--profile", action="store_true", help="per-layer-type times, eager vs OpenCV")
    parser.add_argument("--nsfw-dir", type=Path, default=NSFW,
                        help="folder with open_nsfw's deploy.prototxt and resnet_50_1by2_nsfw.caffemodel "
                             "(default: .cache/nsfw, where `caffe-compat models fetch open_nsfw` puts them)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall time (default) or the thread's CPU time (meaningful with --threads 1)")
    add_malloc_option(parser)
    args = parser.parse_args()
    malloc = apply_malloc_option(args)
    global clock
    clock = CLOCKS[args.clock]
    nets = net_specs(args.nsfw_dir)
    print_header("OpenCV dnn on the same Caffe files (same run); ours = CaffeNet variants")
    print(malloc)
    repeats = 2 if args.quick else args.repeats
    torch.set_num_threads(args.threads)
    cv2.setNumThreads(args.threads)

    rows, notes = [], []
    for name in args.nets:
        spec = nets[name]
        if not spec.weights.exists():
            print(f"{name}: skipped, {spec.weights} is missing; {MISSING_HINT[name]}")
            continue
        runners = [opencv_runner(spec)]
        for compiled in ((False,) if args.no_compile else (False, True)):
            for channels_last in (False, True):
                runners.append(torch_runner(spec, channels_last, compiled))
        if not args.no_fused:
            runners.append(torch_runner(spec, False, False, fused=True))
        batches = spec.quick_batches if args.quick else spec.batches
        for batch in batches:
            x = (np.random.default_rng(batch).standard_normal((batch, 3, 224, 224)) * 50).astype(np.float32)
            measure(spec, runners, x, repeats, rows, notes)
            eager, opencv = runners[1], runners[0]
            if args.profile and batch == batches[0] and eager.model is not None and opencv.model is not None:
                print_profile(spec, batch, caffenet_profile(eager.model, x, repeats),
                              opencv_profile(opencv.model, x, repeats))

    print(f"\nCPU forward, {args.threads} thread(s), median of {repeats} round-robin repeats after 1 warm-up "
          f"({args.clock} clock); "
          f"torch {torch.__version__}, OpenCV {cv2.__version__}")
    print(f"{'net':<16}{'batch':>6}  {'variant':<32}{'ms/batch':>10}{'images/s':>10}{'OpenCV÷ours':>12}"
          f"  max|ours - OpenCV| per blob")
    for name, batch, variant, ms, ips, ratio, diff in rows:
        if ms is None:
            print(f"{name:<16}{batch:>6}  {variant:<32}{'-':>10}{'-':>10}{'-':>12}  {diff}")
            continue
        r = f"{ratio:>11.2f}x" if ratio is not None else f"{'-':>12}"
        print(f"{name:<16}{batch:>6}  {variant:<32}{ms:>10.1f}{ips:>10.1f}{r}  {diff}")
    for note in notes:
        print(f"  note: {note} (not in the timing)")


if __name__ == "__main__":
    main()

"""Embedding throughput of the GoogLeNet embedding net: ONNX Runtime (CPU) vs PyTorch eager (CPU).

Net: the full-width GoogLeNet embedding net (``large/googlenet_full``, fc_embedding 512, 224x224) when the
shared reference is present, else the /4 fixture.  Peer measured in the same run: the same cut net in
PyTorch eager mode (:class:`caffe_compat.export.Embedder` under ``torch.no_grad``).  Rows: ONNX Runtime
(its default graph optimisations, ``ORT_ENABLE_ALL``) on the plain export and on ``export_onnx(fuse=True)``
(:mod:`caffe_compat.fuse`), and PyTorch's fused inference net (``fuse_for_inference``, channels_last).  Every
engine gets the same intra-op thread count (``--threads``, default all cores); the table states it.
Throughput is ``batch / median seconds per forward`` over ``--repeats`` timed runs after one warm-up run,
the engines timed round-robin so that load from other processes hits each alike.

``--net open_nsfw`` (with ``--nsfw-dir``, default ``.cache/nsfw``) measures open_nsfw cut at its logits
``fc_nsfw`` instead: a ResNet whose BatchNorm + Scale layers only ``export --fuse`` folds away (the plain
export writes them as element-wise Sub/Div/Mul/Add, which ONNX Runtime does not fold into the Conv).

    python benchmarks/bench_onnx.py [--batch 32] [--repeats 5] [--threads N] [--net googlenet|open_nsfw]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _common import add_malloc_option, apply_malloc_option, fmt_ratio, print_header  # noqa: E402
from caffe_compat.export import export_onnx  # noqa: E402
from caffe_compat.export.onnx_export import build_embedder  # noqa: E402
from caffe_compat.export.runtime import EmbedderSession  # noqa: E402

SHARED = REPO.parent / "shared" / "caffe_reference"
CANDIDATES = (SHARED / "large" / "googlenet_full", REPO / "tests" / "fixtures" / "nets" / "googlenet_small",
              SHARED / "nets" / "googlenet_small")


def timed_round_robin(fns: dict, repeats: int) -> dict:
    """Median seconds per call of each ``fns`` entry, after one warm-up call each, timed in turn."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--net", choices=["googlenet", "open_nsfw"], default="googlenet")
    parser.add_argument("--nsfw-dir", type=Path, default=REPO / ".cache" / "nsfw")
    add_malloc_option(parser)
    args = parser.parse_args()
    malloc = apply_malloc_option(args)
    output = "fc_embedding"
    if args.net == "open_nsfw":
        net_dir, output = args.nsfw_dir, "fc_nsfw"
        prototxt, weights = str(net_dir / "deploy.prototxt"), str(net_dir / "resnet_50_1by2_nsfw.caffemodel")
        if not Path(weights).is_file():
            raise SystemExit(f"{weights} is missing: `caffe-compat models fetch open_nsfw --cache DIR`, --nsfw-dir DIR/nsfw")
    else:
        net_dir = next(d for d in CANDIDATES if (d / "weights.caffemodel").is_file())
        prototxt, weights = str(net_dir / "deploy.prototxt"), str(net_dir / "weights.caffemodel")
    torch.set_num_threads(args.threads)
    data = (np.random.RandomState(0).randn(args.batch, 3, 224, 224) * 50).astype(np.float32)

    eager = build_embedder(prototxt, weights, output_blob=output)
    fused_net = eager.net.fuse_for_inference()
    x = torch.from_numpy(data)

    def pytorch_forward():
        with torch.no_grad():
            return eager(x)

    def fused_forward():
        return fused_net(data=x)[output]

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        path = export_onnx(prototxt, weights=weights, output_blob=output, path=Path(tmp) / "plain.onnx",
                           preprocessing={"resize": 224})
        export_seconds = time.perf_counter() - start
        fused_path = export_onnx(prototxt, weights=weights, output_blob=output, path=Path(tmp) / "fused.onnx",
                                 preprocessing={"resize": 224}, fuse=True)
        session = EmbedderSession(path, "cpu", threads=args.threads)
        fused_session = EmbedderSession(fused_path, "cpu", threads=args.threads)
        unfused = pytorch_forward().numpy()
        difference = float(np.abs(session(data) - unfused).max())
        fused_difference = float(np.abs(fused_session(data) - unfused).max())
        torch_fused_difference = float(np.abs(fused_forward().reshape(unfused.shape).numpy() - unfused).max())
        caffe_note = ""
        # the large fixture: real Caffe's fc_embedding on its own input
        if args.net == "googlenet" and (net_dir / "outputs.npz").is_file():
            caffe = np.load(net_dir / "outputs.npz")
            caffe_error = float(np.abs(session(caffe["data"]) - caffe["fc_embedding"]).max())
            caffe_note = f"; max |ORT - Caffe| on the fixture = {caffe_error:.2e} (|fc_embedding| <= " \
                         f"{float(np.abs(caffe['fc_embedding']).max()):.2f})"
        seconds = timed_round_robin({
            "PyTorch eager CPU (peer)": pytorch_forward,
            "PyTorch fused (fuse_for_inference)": fused_forward,
            "ONNX Runtime CPU": lambda: session(data),
            "ONNX Runtime CPU, export --fuse": lambda: fused_session(data),
        }, args.repeats)
    eager_seconds = seconds["PyTorch eager CPU (peer)"]

    import onnxruntime

    print_header("PyTorch eager on CPU (same run); ours = the exported model in ONNX Runtime")
    print(malloc)
    print(f"net: {net_dir.name} ({prototxt}), batch {args.batch}, 224x224, {args.repeats} timed runs (median), "
          f"{args.threads} intra-op threads each (os.cpu_count() = {os.cpu_count()})")
    print(f"torch {torch.__version__}, onnxruntime {onnxruntime.__version__}; export took {export_seconds:.1f} s; "
          f"max |ORT - PyTorch| on this batch = {difference:.2e}{caffe_note}")
    print(f"fused vs the unfused PyTorch net on this batch (|{output}| <= {float(np.abs(unfused).max()):.2f}): "
          f"max |ORT fused - PyTorch| = {fused_difference:.2e}, max |PyTorch fused - PyTorch| = "
          f"{torch_fused_difference:.2e}")
    print()
    print("| engine | threads | s / batch | images / s | PyTorch eager ÷ this |")
    print("|---|---:|---:|---:|---:|")
    for name, s in seconds.items():
        print(f"| {name} | {args.threads} | {s:.3f} | {args.batch / s:.1f} | {fmt_ratio(eager_seconds, s, 1)} |")


if __name__ == "__main__":
    main()

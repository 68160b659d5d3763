"""Embedding throughput of the GoogLeNet embedding net: ONNX Runtime (CPU) vs PyTorch eager (CPU).

Net: the full-width GoogLeNet embedding net (``large/googlenet_full``, fc_embedding 512, 224x224) when the
shared reference is present, else the /4 fixture.  Peer measured in the same run: the same cut net in
PyTorch eager mode (:class:`caffe_compat.export.Embedder` under ``torch.no_grad``).  Both engines get the
same intra-op thread count (``--threads``, default all cores); the table states it.  Throughput is
``batch / median seconds per forward`` over ``--repeats`` timed runs after one warm-up run.

    python benchmarks/bench_onnx.py [--batch 32] [--repeats 5] [--threads N]
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

from _common import fmt_ratio, print_header  # noqa: E402
from caffe_compat.export import export_onnx  # noqa: E402
from caffe_compat.export.onnx_export import build_embedder  # noqa: E402
from caffe_compat.export.runtime import EmbedderSession  # noqa: E402

SHARED = REPO.parent / "shared" / "caffe_reference"
CANDIDATES = (SHARED / "large" / "googlenet_full", REPO / "tests" / "fixtures" / "nets" / "googlenet_small",
              SHARED / "nets" / "googlenet_small")


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    net_dir = next(d for d in CANDIDATES if (d / "weights.caffemodel").is_file())
    prototxt, weights = str(net_dir / "deploy.prototxt"), str(net_dir / "weights.caffemodel")
    torch.set_num_threads(args.threads)
    data = (np.random.RandomState(0).randn(args.batch, 3, 224, 224) * 50).astype(np.float32)

    eager = build_embedder(prototxt, weights, output_blob="fc_embedding")
    x = torch.from_numpy(data)

    def pytorch_forward():
        with torch.no_grad():
            return eager(x)

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        path = export_onnx(prototxt, weights=weights, path=Path(tmp) / "googlenet.onnx")
        export_seconds = time.perf_counter() - start
        session = EmbedderSession(path, "cpu", threads=args.threads)
        difference = float(np.abs(session(data) - pytorch_forward().numpy()).max())
        caffe_note = ""
        if (net_dir / "outputs.npz").is_file():  # the large fixture: real Caffe's fc_embedding on its own input
            caffe = np.load(net_dir / "outputs.npz")
            caffe_error = float(np.abs(session(caffe["data"]) - caffe["fc_embedding"]).max())
            caffe_note = f"; max |ORT - Caffe| on the fixture = {caffe_error:.2e} (|fc_embedding| <= " \
                         f"{float(np.abs(caffe['fc_embedding']).max()):.2f})"
        ort_seconds = timed(lambda: session(data), args.repeats)
    eager_seconds = timed(pytorch_forward, args.repeats)

    import onnxruntime

    print_header("PyTorch eager on CPU (same run); ours = the exported model in ONNX Runtime")
    print(f"net: {net_dir.name} ({prototxt}), batch {args.batch}, 224x224, {args.repeats} timed runs (median), "
          f"{args.threads} intra-op threads each (os.cpu_count() = {os.cpu_count()})")
    print(f"torch {torch.__version__}, onnxruntime {onnxruntime.__version__}; export took {export_seconds:.1f} s; "
          f"max |ORT - PyTorch| on this batch = {difference:.2e}{caffe_note}")
    print()
    print("| engine | threads | s / batch | images / s | PyTorch eager ÷ this |")
    print("|---|---:|---:|---:|---:|")
    for name, seconds in (("PyTorch eager CPU (peer)", eager_seconds), ("ONNX Runtime CPU", ort_seconds)):
        print(f"| {name} | {args.threads} | {seconds:.3f} | {args.batch / seconds:.1f} | "
              f"{fmt_ratio(eager_seconds, seconds, 1)} |")


if __name__ == "__main__":
    main()

"""Load time of a Caffe model: caffe-compat's readers vs OpenCV 4.x ``cv2.dnn.readNetFromCaffe``.

Every row parses the prototxt and the caffemodel and ends with every weight blob in memory:

* ``reader``: ``read_net(deploy)`` + ``read_weights(caffemodel)``: the NetParameter of the deploy file
  and a numpy array per blob (read-only views of the memory-mapped caffemodel; the pages are mapped
  and resident when it returns);
* ``NetParameter``: ``read_net`` on both files, then ``blob_to_array`` on every blob (protobuf's parser
  copies the floats into its arena, numpy copies them again);
* ``torch module``: ``load_net(deploy, caffemodel)``, the PyTorch module with its weights (also builds
  every layer port and copies the weights into parameters);
* OpenCV: its ``dnn::Net`` with the weights in its own blobs.

Median of N runs after one warm-up; each ratio is OpenCV time / ours (> 1: we are faster).
``--fresh K`` (default 5) adds a second table: the *first* load in a new process, what a program that
loads one model pays (K processes per side, alternated, each importing torch, OpenCV and caffe_compat
before its clock starts; a first load pays the page faults of fresh memory and cold caches that
repeated loads in one process reuse).  The
GoogLeNet row reads the team's caffemodel when the shared folder (``$CAFFE_COMPAT_SHARED``, else
``../shared``) has it, else one this script writes
from the fixture prototxt (``tests/fixtures/large/googlenet_full``) filled with its seeded fillers
(the same 26 MB of float32 blobs: load time does not depend on the values).  ``--cpu-time`` measures
this process's CPU time instead of wall time (steadier on a machine shared with other work).

    python benchmarks/bench_load.py [--repeats 7] [--fresh 5] [--nsfw-cache .cache] [--cpu-time]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO, fmt_ratio, median_time, print_header

SHARED = Path(os.environ.get("CAFFE_COMPAT_SHARED") or REPO.parent / "shared") / "caffe_reference"


CLOCK = time.perf_counter


def googlenet_files(scratch: Path) -> tuple[Path, Path, str]:
    """The full GoogLeNet's deploy prototxt and a caffemodel: the shared one, else one written here."""
    large = SHARED / "large" / "googlenet_full"
    if (large / "weights.caffemodel").exists():
        return large / "deploy.prototxt", large / "weights.caffemodel", "shared weights"
    from caffe_compat.net import CaffeNet

    deploy = REPO / "tests" / "fixtures" / "large" / "googlenet_full" / "deploy.prototxt"
    weights = scratch / "googlenet_filled.caffemodel"
    CaffeNet(str(deploy), seed=0).save_caffemodel(weights)
    return deploy, weights, "filled, written here"


def reader(deploy, weights):
    from caffe_compat.io import read_net
    from caffe_compat.io.weights import read_weights

    read_net(deploy)
    return [blob.values for _, blobs in read_weights(weights) for blob in blobs]


def netparameter(deploy, weights):
    from caffe_compat.io import blob_to_array, read_net

    read_net(deploy)
    model = read_net(weights)
    return [blob_to_array(b) for layer in model.layer for b in layer.blobs]


def ours_torch(deploy, weights):
    from caffe_compat.net import load_net

    return load_net(deploy, weights)


def opencv(deploy, weights):
    import cv2

    return cv2.dnn.readNetFromCaffe(str(deploy), str(weights))


#: One timed first load in a new process: argv = (who, deploy, weights, clock); prints milliseconds.
FIRST_LOAD = """
import sys, time
import cv2, torch
from caffe_compat.net import load_net
torch.set_num_threads(1); cv2.setNumThreads(1)
who, deploy, weights, clock = sys.argv[1:5]
clock = time.process_time if clock == "cpu" else time.perf_counter
start = clock()
cv2.dnn.readNetFromCaffe(deploy, weights) if who == "opencv" else load_net(deploy, weights)
print((clock() - start) * 1e3)
"""


def first_load_ms(who: str, deploy, weights, runs: int, cpu: bool) -> float:
    """Median of ``runs`` first loads, each in a new Python process."""
    times = []
    for _ in range(runs):
        command = [sys.executable, "-c", FIRST_LOAD, who, str(deploy), str(weights), "cpu" if cpu else "wall"]
        out = subprocess.run(command, check=True, capture_output=True, text=True, cwd=REPO)
        times.append(float(out.stdout.split()[-1]))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--nsfw-cache", default=str(REPO / ".cache"))
    parser.add_argument("--fresh", type=int, default=5, metavar="K",
                        help="first loads in K new processes per side (0: skip that table)")
    parser.add_argument("--cpu-time", action="store_true", help="time this process's CPU time, not wall time")
    args = parser.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.cpu_time else time.perf_counter
    import cv2
    import torch

    torch.set_num_threads(1)
    cv2.setNumThreads(1)
    from caffe_compat.models import fetch_nsfw

    nsfw = fetch_nsfw(args.nsfw_cache)
    scratch = tempfile.TemporaryDirectory()
    deploy, weights, origin = googlenet_files(Path(scratch.name))
    models = [("open_nsfw (23.8 MB)", nsfw / "deploy.prototxt", nsfw / "resnet_50_1by2_nsfw.caffemodel"),
              ("GoogLeNet full (26 MB)", deploy, weights)]
    rows = [("reader", reader), ("NetParameter", netparameter), ("torch module", ours_torch)]
    print_header("OpenCV dnn readNetFromCaffe; ours = each reader")
    clock = "CPU time of this process" if args.cpu_time else "wall time"
    print(f"OpenCV {cv2.__version__}, one thread, median of {args.repeats} ({clock}); GoogLeNet weights: {origin}; "
          f"ratio = OpenCV time / ours")
    header = f"{'model':24s} {'OpenCV ms':>9s}" + "".join(f" {name + ' ms':>17s} {'CV÷ours':>8s}" for name, _ in rows)
    print(header)
    print("-" * len(header))
    for name, deploy, weights in models:
        t_cv = median_time(lambda: opencv(deploy, weights), args.repeats, clock=CLOCK)
        line = f"{name:24s} {t_cv * 1e3:9.1f}"
        for _, fn in rows:
            t = median_time(lambda: fn(deploy, weights), args.repeats, clock=CLOCK)
            line += f" {t * 1e3:17.1f} {fmt_ratio(t_cv, t)}"
        print(line)
    if args.fresh > 0:
        print(f"\nFirst load in a new process (median of {args.fresh} processes per side, alternated; {clock})")
        header = f"{'model':24s} {'OpenCV ms':>9s} {'torch module ms':>17s} {'CV÷ours':>8s}"
        print(header)
        print("-" * len(header))
        for name, deploy, weights in models:
            t_cv, t_ours = [], []
            for _ in range(args.fresh):  # alternated, so that a slow phase of the machine hits both sides
                t_cv.append(first_load_ms("opencv", deploy, weights, 1, args.cpu_time))
                t_ours.append(first_load_ms("ours", deploy, weights, 1, args.cpu_time))
            cv_ms, ours_ms = statistics.median(t_cv), statistics.median(t_ours)
            print(f"{name:24s} {cv_ms:9.1f} {ours_ms:17.1f} {fmt_ratio(cv_ms / 1e3, ours_ms / 1e3)}")


if __name__ == "__main__":
    main()

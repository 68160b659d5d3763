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

    python benchmarks/bench_load.py [--repeats 7] [--nsfw-cache .cache]
"""

from __future__ import annotations

import argparse
import statistics
import time

from _common import REPO, fmt_ratio, print_header

SHARED = REPO.parent / "shared" / "caffe_reference"


def median_time(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--nsfw-cache", default=str(REPO / ".cache"))
    args = parser.parse_args()
    import cv2
    import torch

    torch.set_num_threads(1)
    cv2.setNumThreads(1)
    from caffe_compat.models import fetch_nsfw

    nsfw = fetch_nsfw(args.nsfw_cache)
    models = [("open_nsfw (23.8 MB)", nsfw / "deploy.prototxt", nsfw / "resnet_50_1by2_nsfw.caffemodel")]
    large = SHARED / "large" / "googlenet_full"
    if large.exists():
        models.append(("GoogLeNet full (26 MB)", large / "deploy.prototxt", large / "weights.caffemodel"))
    rows = [("reader", reader), ("NetParameter", netparameter), ("torch module", ours_torch)]
    print_header("OpenCV dnn readNetFromCaffe; ours = each reader")
    print(f"OpenCV {cv2.__version__}, one thread, median of {args.repeats}; ratio = OpenCV time / ours")
    header = f"{'model':24s} {'OpenCV ms':>9s}" + "".join(f" {name + ' ms':>17s} {'CV÷ours':>8s}" for name, _ in rows)
    print(header)
    print("-" * len(header))
    for name, deploy, weights in models:
        t_cv = median_time(lambda: opencv(deploy, weights), args.repeats)
        line = f"{name:24s} {t_cv * 1e3:9.1f}"
        for _, fn in rows:
            t = median_time(lambda: fn(deploy, weights), args.repeats)
            line += f" {t * 1e3:17.1f} {fmt_ratio(t_cv, t)}"
        print(line)


if __name__ == "__main__":
    main()

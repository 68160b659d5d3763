"""Load time of a Caffe model: caffe-compat's reader vs OpenCV 4.x ``cv2.dnn.readNetFromCaffe``.

Both sides parse the prototxt and the caffemodel and end with every weight blob in memory
(ours: numpy arrays via ``read_net`` + ``blob_to_array``; OpenCV: its dnn::Net).  When
``caffe_compat.net`` is present a third row times ``load_net`` (the PyTorch module with weights).
Median of N runs after one warm-up; the ratio column is OpenCV time / ours (> 1: we are faster).

    python benchmarks/bench_load.py [--repeats 5] [--nsfw-cache .cache]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "caffe_reference"


def median_time(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def ours(deploy, weights):
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
    parser.add_argument("--repeats", type=int, default=5)
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
    try:
        import caffe_compat.net  # noqa: F401
        have_net = True
    except ImportError:
        have_net = False
    print(f"OpenCV {cv2.__version__}, one thread, median of {args.repeats}")
    print(f"{'model':26s} {'OpenCV s':>9s} {'ours (numpy) s':>15s} {'ratio':>6s} {'ours (torch module) s':>22s} {'ratio':>6s}")
    for name, deploy, weights in models:
        t_cv = median_time(lambda: opencv(deploy, weights), args.repeats)
        t_np = median_time(lambda: ours(deploy, weights), args.repeats)
        line = f"{name:26s} {t_cv:9.4f} {t_np:15.4f} {t_cv / t_np:6.2f}x"
        if have_net:
            t_pt = median_time(lambda: ours_torch(deploy, weights), args.repeats)
            line += f" {t_pt:22.4f} {t_cv / t_pt:6.2f}x"
        print(line)


if __name__ == "__main__":
    main()

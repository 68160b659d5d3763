"""MAX pooling in training on the CPU: forward + backward of the Caffe pooling layer against PyTorch's own.

Rows: the poolings of the digits net (the main command's ``pool1``-``pool3``, 2 x 2 windows of stride 2 that
tile their bottoms) and four of GoogLeNet's (3 x 3 windows of stride 2 with Caffe's rounding up, and of
stride 1 with padding, in the inception modules: overlapping), at the batch each net trains with.  Columns,
each the median of ``--repeats`` forward + backward passes after three warm-up passes, measured in the same
run:

* ``layer``: the Pooling port as a net runs it in training (``MaxPoolRouted``, Caffe's choice kept from the
  forward; the tiled windows take the offset-row scan, :func:`caffe_compat.layers.pooling_numpy.tiles`);
* ``general``: the same port with the tiled road switched off (the NHWC scan every geometry can take: what
  the tiled rows ran before it existed);
* peer: ``F.max_pool2d`` forward + backward (PyTorch's choice on ties and NaN, not Caffe's).

Ratios are peer time ÷ ours (above 1: ours faster); the threads are torch's default (the command line's).

    python benchmarks/bench_pooling.py [--repeats 30]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from _common import add_malloc_option, apply_malloc_option, fmt_ratio, median_time, print_header
from google.protobuf import text_format

from caffe_compat.layers import pooling_numpy
from caffe_compat.layers.registry import layer_class
from caffe_compat.proto import caffe_pb2

#: (name, pooling_param, bottom shape)
CASES = [
    ("digits pool1", "kernel_size: 2 stride: 2", (64, 16, 32, 32)),
    ("digits pool2", "kernel_size: 2 stride: 2", (64, 32, 16, 16)),
    ("digits pool3", "kernel_size: 2 stride: 2", (64, 64, 8, 8)),
    ("GoogLeNet pool2/3x3_s2", "kernel_size: 3 stride: 2", (8, 192, 56, 56)),
    ("GoogLeNet inception_3a/pool", "kernel_size: 3 stride: 1 pad: 1", (8, 192, 28, 28)),
    ("GoogLeNet pool3/3x3_s2", "kernel_size: 3 stride: 2", (8, 480, 28, 28)),
    ("GoogLeNet inception_4a/pool", "kernel_size: 3 stride: 1 pad: 1", (8, 480, 14, 14)),
]


def pooling_port(pooling: str, shape):
    param = text_format.Parse(f'name: "pool" type: "Pooling" pooling_param {{ pool: MAX {pooling} }}',
                              caffe_pb2.LayerParameter())
    return layer_class(param)(param, [shape], "train")


def median_ms(fn, repeats: int) -> float:
    return median_time(fn, repeats, warmup=3) * 1e3


def layer_pass(port, x, dy):
    def run():
        xt = x.detach().requires_grad_()
        (top,) = port(xt)
        torch.autograd.grad(top, xt, dy)
    return run


def torch_pass(kernel, stride, pad, x, dy):
    def run():
        xt = x.detach().requires_grad_()
        torch.autograd.grad(F.max_pool2d(xt, kernel, stride, pad, ceil_mode=True), xt, dy)
    return run


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    add_malloc_option(parser)
    args = parser.parse_args(argv)
    malloc = apply_malloc_option(args)
    print_header("PyTorch F.max_pool2d forward + backward (same run); ours = the Caffe Pooling layer, training")
    print(f"{malloc}; torch {torch.__version__}, {torch.get_num_threads()} threads; median of {args.repeats}")
    head = (f"{'pooling':28} {'bottom':>18} {'tiled':>5} | {'layer ms':>9} {'general ms':>10} {'torch ms':>9} | "
            f"{'torch÷layer':>11} {'general÷layer':>13}")
    print(head)
    print("-" * len(head))
    generator = torch.Generator().manual_seed(0)
    for name, pooling, shape in CASES:
        port = pooling_port(pooling, shape)
        kernel, stride, pad, out = port.geometry_for(*shape[2:])
        x = torch.relu(torch.randn(shape, generator=generator))
        dy = torch.randn((shape[0], shape[1], *out), generator=generator)
        tiled = pooling_numpy.tiles(kernel, stride, pad, out, shape[2:])
        ours = median_ms(layer_pass(port, x, dy), args.repeats)
        real_tiles = pooling_numpy.tiles
        pooling_numpy.tiles = lambda *a: False
        try:
            general = median_ms(layer_pass(port, x, dy), args.repeats)
        finally:
            pooling_numpy.tiles = real_tiles
        peer = median_ms(torch_pass(kernel, stride, pad, x, dy), args.repeats)
        print(f"{name:28} {'x'.join(map(str, shape)):>18} {'yes' if tiled else 'no':>5} | {ours:9.2f} {general:10.2f} "
              f"{peer:9.2f} | {fmt_ratio(peer, ours, 11)} {fmt_ratio(general, ours, 13)}")


if __name__ == "__main__":
    main()

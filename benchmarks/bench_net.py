"""CaffeNet speed on the full-width GoogLeNet embedding net (large/googlenet_full), single thread.

Peer measured in the same run: the same layer ports called in a bare loop over the layers (no blob
bookkeeping, no split views), i.e. the overhead CaffeNet adds.  Real Caffe's times (README section 6,
same net, single thread, the column of this CPU's class: 2-vCPU AMD EPYC or Intel Xeon VM) are printed
as an external reference, not a same-run peer.  Every ratio is peer time ÷ CaffeNet time (> 1: CaffeNet
faster).

    python benchmarks/bench_net.py [--batch 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from _common import add_malloc_option, apply_malloc_option, caffe_reference, fmt_ratio, median_time, print_header

from caffe_compat.net import CaffeNet

#: The full-width GoogLeNet saved by real Caffe, in the team's shared folder (CAFFE_COMPAT_SHARED or ../shared).
REFERENCE = (Path(os.environ.get("CAFFE_COMPAT_SHARED") or Path(__file__).resolve().parents[1].parent / "shared")
             / "caffe_reference" / "large" / "googlenet_full")


def bare_forward(net: CaffeNet, data: torch.Tensor) -> torch.Tensor:
    values = {"data": data}
    for step in net.steps:
        if step.module_key is None:
            for top in step.tops:
                values[top] = values[step.bottoms[0]]
            continue
        if not step.bottoms:
            continue
        outs = net.layers[step.module_key](*[values[b] for b in step.bottoms])
        values.update(zip(step.tops, outs))
    return values["fc_embedding"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--reference", type=Path, default=REFERENCE,
                        help="folder with the full GoogLeNet's deploy.prototxt and weights.caffemodel (default: %(default)s)")
    add_malloc_option(parser)
    args = parser.parse_args()
    malloc = apply_malloc_option(args)
    torch.set_num_threads(1)
    if not (args.reference / "weights.caffemodel").is_file():
        raise SystemExit(f"bench_net: {args.reference / 'weights.caffemodel'} not found (the team's shared folder: "
                         f"set CAFFE_COMPAT_SHARED or pass --reference)")
    net = CaffeNet(str(args.reference / "deploy.prototxt"), weights=str(args.reference / "weights.caffemodel"))
    data = torch.randn(args.batch, 3, 224, 224) * 50
    top_diff = torch.randn(args.batch, 512)

    def caffenet_forward():
        with torch.no_grad():
            net(data=data)

    def caffenet_backward():
        blobs = net.run({"data": data}, input_grad=True)
        net.backward(blobs, {"fc_embedding": top_diff}, loss=False, retain_graph=False)

    def bare_fwd():
        with torch.no_grad():
            bare_forward(net, data)

    def bare_backward():
        x = data.clone().requires_grad_()
        out = bare_forward(net, x)
        torch.autograd.backward(out, top_diff)

    rows = [("forward", median_time(caffenet_forward, args.repeats), median_time(bare_fwd, args.repeats), 0),
            ("forward+backward", median_time(caffenet_backward, args.repeats),
             median_time(bare_backward, args.repeats), 1)]
    reference, note = caffe_reference()
    caffe = (reference or {}).get("googlenet_full", {}).get(args.batch)
    print_header("the bare loop over the same layer ports (same run); real Caffe (recorded); ours = CaffeNet")
    print(malloc)
    print(note)
    print(f"googlenet_full, N={args.batch}, 1 thread, median of {args.repeats}")
    print(f"{'pass':<18}{'CaffeNet s':>12}{'bare loop s':>13}{'bare÷ours':>11}{'Caffe s (README)':>18}"
          f"{'Caffe÷ours':>12}")
    for name, ours, bare, i in rows:
        ref = f"{caffe[i]:>18.3f}{fmt_ratio(caffe[i], ours, 12)}" if caffe else f"{'-':>18}{'-':>12}"
        print(f"{name:<18}{ours:>12.3f}{bare:>13.3f}{fmt_ratio(bare, ours, 11)}{ref}")


if __name__ == "__main__":
    main()

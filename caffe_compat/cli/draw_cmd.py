"""``caffe-compat draw NET.prototxt OUT.png [--rankdir LR|TB|BT|RL] [--phase TRAIN|TEST|ALL] [--display-lrm]``: Caffe's
``python/draw_net.py`` (:mod:`caffe_compat.draw`).  The format comes from OUT's extension (png, svg, pdf,
...; ``.raw``: the DOT source).  Needs pydot and graphviz (the error says what to install).
"""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("draw", help="draw a net as a graph image (python/draw_net.py)")
    p.add_argument("input_net_proto_file", help="the net (prototxt, any Caffe version)")
    p.add_argument("output_image_file", help="the image to write; its extension picks the format (.png, .svg, ...)")
    p.add_argument("--rankdir", choices=["LR", "TB", "BT", "RL"], default="LR",
                   help="direction of the graph layout: LR left-right, TB top-bottom, ... (default LR)")
    p.add_argument("--phase", type=str.upper, choices=["TRAIN", "TEST", "ALL"], default="ALL",
                   help="draw only the layers of this phase (default ALL)")
    p.add_argument("--display-lrm", "--display_lrm", action="store_true",
                   help="label convolution and inner-product layers with their weight and bias lr_mult")
    p.set_defaults(func=run)


def run(args) -> int:
    from caffe_compat.draw import draw_net_to_file, layer_in_phase
    from caffe_compat.cli.output import require_output_folders
    from caffe_compat.io import read_net

    require_output_folders(args.output_image_file)
    net = read_net(args.input_net_proto_file)
    print(f"Drawing net to {args.output_image_file}")
    draw_net_to_file(net, args.output_image_file, args.rankdir, phase=args.phase, display_lrm=args.display_lrm)
    drawn = sum(layer_in_phase(layer, args.phase) for layer in net.layer)
    print(f"{net.name or 'net'}: {drawn} of {len(net.layer)} layers drawn (phase {args.phase}, rankdir "
          f"{args.rankdir}) -> {args.output_image_file}")
    return 0

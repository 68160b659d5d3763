"""``caffe-compat convert NET.prototxt W.caffemodel -o model.pt [--phase test]`` and
``caffe-compat convert --to-caffe model.pt -o OUT_PREFIX`` (writes OUT_PREFIX.prototxt and .caffemodel).

Exit status: 0 written, 2 bad input (unreadable files, weights that do not fit the net, net layers with
blobs the caffemodel does not cover unless ``--allow-missing``, caffemodel layers the net lacks with
``--strict``, wrong arguments, an output folder that does not exist: it is not created, an output that is
one of the inputs: it would be replaced).
"""

from __future__ import annotations

import os


def register(sub) -> None:
    p = sub.add_parser("convert", help="Caffe prototxt+caffemodel <-> caffe-compat PyTorch checkpoint")
    p.add_argument("inputs", nargs="+", metavar="FILE",
                   help="NET.prototxt W.caffemodel (to a checkpoint), or model.pt with --to-caffe")
    p.add_argument("-o", "--output", required=True, help="checkpoint path, or the output prefix with --to-caffe")
    p.add_argument("--to-caffe", action="store_true", help="convert a checkpoint back to .prototxt + .caffemodel")
    p.add_argument("--phase", choices=("train", "test"), default="test", help="phase the net is built in")
    names = p.add_mutually_exclusive_group()
    names.add_argument("--allow-missing", action="store_true",
                       help="accept a caffemodel without weights for some learnable layers (they keep filler values)")
    names.add_argument("--strict", action="store_true",
                       help="also refuse (exit 2) caffemodel layers with blobs that the net lacks (by default they "
                            "are ignored, as Caffe does, with a warning)")
    p.set_defaults(func=run)


def run(args) -> int:
    from caffe_compat.errors import CaffeCompatError
    from caffe_compat.io.atomic import require_folder

    expected = 1 if args.to_caffe else 2
    if len(args.inputs) != expected:
        raise CaffeCompatError(f"--to-caffe takes one checkpoint, got {len(args.inputs)} files" if args.to_caffe
                               else f"expected NET.prototxt W.caffemodel, got {len(args.inputs)} files")
    require_folder(args.output)
    outputs = [f"{args.output}.prototxt", f"{args.output}.caffemodel"] if args.to_caffe else [args.output]
    for written in outputs:
        for given in args.inputs:
            if os.path.exists(written) and os.path.exists(given) and os.path.samefile(written, given):
                raise CaffeCompatError(f"{written}: the output is the input {given}; converting would replace it "
                                       f"(name another output with -o)")
    if args.to_caffe:
        from caffe_compat.convert import convert_torch_to_caffe

        prototxt, caffemodel = convert_torch_to_caffe(args.inputs[0], args.output)
        print(f"wrote {prototxt} and {caffemodel}")
        return 0
    from caffe_compat.convert import convert_caffe_to_torch

    net = convert_caffe_to_torch(args.inputs[0], args.inputs[1], args.output, phase=args.phase,
                                 strict=not args.allow_missing, strict_weights=args.strict)
    count = sum(t.numel() for blobs in net.params.values() for t in blobs)
    print(f"wrote {args.output}: net '{net.name}', phase {net.phase}, {len(net.steps)} layers, {count:,} values")
    return 0

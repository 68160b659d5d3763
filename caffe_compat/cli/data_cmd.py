"""Data tools: ``make-toy-data``, ``make-lmdb`` (Caffe's convert_imageset), ``compute-mean``."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("make-toy-data", help="write a small real data set (sklearn digits) in a native layout")
    p.add_argument("kind", choices=["cub", "sop", "vehicleid"])
    p.add_argument("out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--size", type=int, default=64, help="image side in pixels")
    p.set_defaults(func=run_toy)

    p = sub.add_parser("make-lmdb", help="Caffe's convert_imageset: list file of 'path label' -> LMDB of Datum")
    p.add_argument("list_file")
    p.add_argument("root", help="folder the list's paths are relative to")
    p.add_argument("out", help="new LMDB folder")
    p.add_argument("--resize", nargs=2, type=int, metavar=("H", "W"))
    p.add_argument("--gray", action="store_true")
    p.add_argument("--encoded", action="store_true", help="store encoded image files (JPEG/PNG bytes)")
    p.add_argument("--encode-type", default="", help="re-encode as this type (png, jpg) when --encoded")
    p.add_argument("--shuffle", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run_lmdb)

    p = sub.add_parser("compute-mean", help="Caffe's compute_image_mean: LMDB -> mean .binaryproto")
    p.add_argument("db")
    p.add_argument("out")
    p.set_defaults(func=run_mean)


def run_toy(args) -> int:
    from caffe_compat.data import make_toy_data

    root = make_toy_data(args.kind, args.out, seed=args.seed, size=args.size)
    print(f"wrote a toy {args.kind} tree at {root}")
    return 0


def run_lmdb(args) -> int:
    from caffe_compat.data.imageset import convert_imageset

    count = convert_imageset(args.list_file, args.root, args.out, resize=tuple(args.resize) if args.resize else None,
                             gray=args.gray, encoded=args.encoded, encode_type=args.encode_type,
                             shuffle=args.shuffle, seed=args.seed)
    print(f"wrote {count} records to {args.out}")
    return 0


def run_mean(args) -> int:
    from caffe_compat.data.imageset import compute_image_mean
    from caffe_compat.io import write_blob

    mean = compute_image_mean(args.db)
    write_blob(mean, args.out)
    per_channel = ", ".join(f"{v:.3f}" for v in mean[0].reshape(mean.shape[1], -1).mean(axis=1))
    print(f"wrote {args.out}: shape {mean.shape}, channel means {per_channel}")
    return 0

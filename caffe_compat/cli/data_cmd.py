"""Data tools: ``make-toy-data``, ``make-lmdb`` (Caffe's convert_imageset), ``compute-mean``.

The folder an output goes into must exist: it is checked before anything is read (exit 2), never created.
"""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("make-toy-data", help="write a small real data set (sklearn digits) in a native layout")
    p.add_argument("kind", choices=["cub", "sop", "vehicleid"],
                   help="layout to write: CUB-200-2011, Stanford Online Products or VehicleID")
    p.add_argument("out", help="new folder (must not exist, or be empty); written complete or not at all")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the images' assignment to classes and splits (default 0; same seed, same bytes)")
    p.add_argument("--size", type=int, default=64, help="image side in pixels")
    p.set_defaults(func=run_toy)

    p = sub.add_parser("make-lmdb", help="Caffe's convert_imageset: list file of 'path label' -> LMDB of Datum")
    p.add_argument("list_file", help="text file of 'relative/path.jpg label' lines")
    p.add_argument("root", help="folder the list's paths are relative to")
    p.add_argument("out", help="new LMDB folder")
    p.add_argument("--resize", nargs=2, type=int, metavar=("H", "W"),
                   help="resize every image to H x W pixels (when both are > 0, as Caffe)")
    p.add_argument("--gray", action="store_true",
                   help="decode as grey (raw records; with --encoded and no --resize Caffe stores the file's "
                        "own bytes, colour included)")
    p.add_argument("--encoded", action="store_true", help="store encoded image files (JPEG/PNG bytes)")
    p.add_argument("--encode-type", default="",
                   help="encode as this type (png, jpg); implies --encoded, like Caffe's --encode_type")
    p.add_argument("--shuffle", action="store_true", help="store the records in a random order")
    p.add_argument("--seed", type=int, default=0, help="seed of --shuffle's order (default 0)")
    p.add_argument("--strict", action="store_true",
                   help="stop at the first missing/unreadable image (Caffe skips it with a log line)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run_lmdb)

    p = sub.add_parser("compute-mean", help="Caffe's compute_image_mean: LMDB -> mean .binaryproto")
    p.add_argument("db", help="the LMDB of Datum records to average (make-lmdb's output)")
    p.add_argument("out", help="the mean .binaryproto to write (its folder must exist)")
    p.set_defaults(func=run_mean)


def run_toy(args) -> int:
    from caffe_compat.data import make_toy_data
    from caffe_compat.io.atomic import require_folder

    require_folder(args.out)
    root = make_toy_data(args.kind, args.out, seed=args.seed, size=args.size)
    print(f"wrote a toy {args.kind} tree at {root}")
    return 0


def run_lmdb(args) -> int:
    """Caffe's convert_imageset; unreadable images are skipped with a warning naming ``list:line``
    (as Caffe skips them), and the summary line counts them."""
    import sys

    from caffe_compat.data.imageset import convert_imageset
    from caffe_compat.io.atomic import require_folder

    require_folder(args.out)
    progress = not args.quiet

    def warn(message: str) -> None:
        line = f"caffe-compat make-lmdb: warning: {message}"
        if progress:
            from tqdm import tqdm

            tqdm.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr)

    skipped: list[str] = []
    count = convert_imageset(args.list_file, args.root, args.out, resize=tuple(args.resize) if args.resize else None,
                             gray=args.gray, encoded=args.encoded, encode_type=args.encode_type,
                             shuffle=args.shuffle, seed=args.seed, progress=progress, strict=args.strict,
                             on_skip=warn, skipped=skipped)
    summary = f"wrote {count} records to {args.out}"
    if skipped:
        shown = ", ".join(skipped[:10]) + (f", ... ({len(skipped) - 10} more)" if len(skipped) > 10 else "")
        summary += f"; skipped {len(skipped)} unreadable image(s), as Caffe's convert_imageset does: {shown}"
    print(summary)
    return 0


def run_mean(args) -> int:
    from caffe_compat.data.imageset import compute_image_mean
    from caffe_compat.io import write_blob
    from caffe_compat.io.atomic import require_folder

    require_folder(args.out)
    mean = compute_image_mean(args.db)
    write_blob(mean, args.out)
    per_channel = ", ".join(f"{v:.3f}" for v in mean[0].reshape(mean.shape[1], -1).mean(axis=1))
    print(f"wrote {args.out}: shape {mean.shape}, channel means {per_channel}")
    return 0

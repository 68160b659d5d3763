"""Data tools: ``make-toy-data``, ``make-lmdb`` (Caffe's convert_imageset), ``compute-mean``.

``convert_imageset`` and ``compute_image_mean`` are the same two tools with Caffe's own command lines, so a
Caffe script (``create_imagenet.sh``, ``make_imagenet_mean.sh``) runs with only the program's name changed:
``convert_imageset [--resize_height=H --resize_width=W --gray --shuffle --check_size --encoded --encode_type=T
--backend=lmdb] ROOTFOLDER/ LISTFILE DB_NAME`` (root first; gflags' ``--flag=true|false`` and
``--noflag`` spellings of the switches, the last one winning) and ``compute_image_mean [--backend=lmdb]
INPUT_DB [OUTPUT_FILE]`` (the mean image written when an output is given; the channel means printed either
way, as Caffe logs them).  LMDB is the only backend (``leveldb`` exits 2).

The folder an output goes into must exist: it is checked before anything is read (exit 2), never created.
"""

from __future__ import annotations

import sys


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
    p.add_argument("--check-size", action="store_true",
                   help="every raw record must have the first one's size (Caffe's --check_size)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run_lmdb)

    p = sub.add_parser("compute-mean", help="Caffe's compute_image_mean: LMDB -> mean .binaryproto")
    p.add_argument("db", help="the LMDB of Datum records to average (make-lmdb's output)")
    p.add_argument("out", help="the mean .binaryproto to write (its folder must exist)")
    p.set_defaults(func=run_mean)
    _register_caffe_spellings(sub)


_GFLAG_VALUES = {"true": True, "t": True, "yes": True, "y": True, "1": True,
                 "false": False, "f": False, "no": False, "n": False, "0": False}


def _accept_gflag_switches(parser, names: tuple[str, ...]) -> None:
    """Let ``parser``'s switches ``names`` be given as gflags spells booleans: ``-name`` / ``--name``,
    ``--name=true|false`` (and gflags' other words: yes/no, t/f, y/n, 1/0) and ``-noname`` / ``--noname``;
    as gflags, the last spelling of a switch wins (``--gray --nogray``: off).  Arguments after ``--`` are
    left alone."""
    parse = parser.parse_known_args

    def switch(token: str) -> tuple[str, bool] | None:
        """``(name, value)`` when ``token`` spells one of the switches, else None."""
        dashes = len(token) - len(token.lstrip("-"))
        if not 1 <= dashes <= 2:
            return None
        flag, equals, value = token[dashes:].partition("=")
        if not equals:
            if flag in names:
                return flag, True
            if flag.startswith("no") and flag[2:] in names:
                return flag[2:], False
            return None
        if flag in names and value.lower() in _GFLAG_VALUES:
            return flag, _GFLAG_VALUES[value.lower()]
        return None

    def parse_known_args(args=None, namespace=None):
        tokens = list(sys.argv[1:] if args is None else args)
        rest = tokens.index("--") if "--" in tokens else len(tokens)
        state: dict[str, bool] = {}
        others = []
        for token in tokens[:rest]:
            spelled = switch(token)
            if spelled is None:
                others.append(token)
            else:
                state[spelled[0]] = spelled[1]
        on = [f"--{name}" for name, value in state.items() if value]
        return parse(on + others + tokens[rest:], namespace)

    parser.parse_known_args = parse_known_args


def _register_caffe_spellings(sub) -> None:
    p = sub.add_parser("convert_imageset", help="make-lmdb with Caffe's convert_imageset command line "
                       "(ROOTFOLDER/ LISTFILE DB_NAME and its flags)")
    p.add_argument("root", metavar="ROOTFOLDER/", help="folder the list's paths are relative to")
    p.add_argument("list_file", metavar="LISTFILE", help="text file of 'relative/path.jpg label' lines")
    p.add_argument("out", metavar="DB_NAME", help="new LMDB folder")
    switches = {"gray": "decode as grey", "shuffle": "store the records in a random order (seeded: --seed)",
                "check_size": "every raw record must have the first one's size", "encoded": "store encoded image files"}
    for name, text in switches.items():
        p.add_argument(f"--{name}", f"-{name}", action="store_true",
                       help=text + " (--NAME=true|false and --noNAME too)")
    _accept_gflag_switches(p, tuple(switches))
    p.add_argument("--encode_type", "-encode_type", default="", help="encode as this type (png, jpg)")
    p.add_argument("--resize_height", "-resize_height", type=int, default=0, help="resize height (both > 0)")
    p.add_argument("--resize_width", "-resize_width", type=int, default=0, help="resize width (both > 0)")
    p.add_argument("--backend", "-backend", default="lmdb", help="the database: lmdb (leveldb is not supported)")
    p.add_argument("--seed", type=int, default=0, help="seed of --shuffle's order (default 0)")
    p.set_defaults(func=_run_convert_imageset)

    p = sub.add_parser("compute_image_mean", help="compute-mean with Caffe's compute_image_mean command line "
                       "(INPUT_DB [OUTPUT_FILE])")
    p.add_argument("db", metavar="INPUT_DB", help="the LMDB of Datum records to average")
    p.add_argument("out", metavar="OUTPUT_FILE", nargs="?", help="the mean .binaryproto to write (optional)")
    p.add_argument("--backend", "-backend", default="lmdb", help="the database: lmdb (leveldb is not supported)")
    p.set_defaults(func=_run_compute_image_mean)


def _lmdb_only(backend: str) -> None:
    from caffe_compat.errors import CaffeCompatError

    if backend.strip().lower() != "lmdb":
        raise CaffeCompatError(f"--backend {backend}: only lmdb is supported (LevelDB databases cannot be read or "
                               f"written here)")


def _run_convert_imageset(args) -> int:
    _lmdb_only(args.backend)
    # Caffe takes std::max(0, FLAGS_resize_*): a negative side is 0 (no resize), not an error
    sides = (max(0, args.resize_height), max(0, args.resize_width))
    args.resize = sides if any(sides) else None  # Caffe resizes when both are > 0
    args.strict, args.quiet = False, False
    return run_lmdb(args)


def caffe_channel_means(mean) -> list:
    """compute_image_mean's per-channel means of a 1xCxHxW mean image as Caffe computes them: a float
    (float32) running sum over the channel's H*W values in order, divided by H*W (NumPy's pairwise mean
    rounds differently in the 5th-6th digit on image-sized channels)."""
    import numpy as np

    planes = np.asarray(mean, dtype=np.float32)[0].reshape(mean.shape[1], -1)
    return [np.float32(np.cumsum(plane, dtype=np.float32)[-1]) / np.float32(plane.size) for plane in planes]


def _run_compute_image_mean(args) -> int:
    """Caffe's compute_image_mean: the mean image is written when OUTPUT_FILE is given, and the channel means
    are printed either way, as Caffe logs them (``mean_value channel [c]:v``, no space after the colon)."""
    _lmdb_only(args.backend)
    from caffe_compat.io.glog import g6

    mean = _mean_image(args.db, args.out)
    for c, value in enumerate(caffe_channel_means(mean)):
        print(f"mean_value channel [{c}]:{g6(value)}")
    return 0


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

    if args.shuffle and not 0 <= args.seed < 2 ** 32:  # numpy's RandomState takes 0 .. 2**32 - 1
        from caffe_compat.errors import CaffeCompatError

        raise CaffeCompatError(f"--seed must be 0 to 2**32 - 1, got {args.seed}")
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
                             on_skip=warn, skipped=skipped, check_size=args.check_size)
    summary = f"wrote {count} records to {args.out}"
    if skipped:
        shown = ", ".join(skipped[:10]) + (f", ... ({len(skipped) - 10} more)" if len(skipped) > 10 else "")
        summary += f"; skipped {len(skipped)} unreadable image(s), as Caffe's convert_imageset does: {shown}"
    print(summary)
    return 0


def _mean_image(db, out):
    """The LMDB's mean image, written to ``out`` when given (its folder checked before anything is read)."""
    from caffe_compat.data.imageset import compute_image_mean
    from caffe_compat.io import write_blob
    from caffe_compat.io.atomic import require_folder

    if out is not None:
        require_folder(out)
    mean = compute_image_mean(db)
    if out is not None:
        write_blob(mean, out)
    return mean


def run_mean(args) -> int:
    mean = _mean_image(args.db, args.out)
    per_channel = ", ".join(f"{v:.3f}" for v in mean[0].reshape(mean.shape[1], -1).mean(axis=1))
    print(f"wrote {args.out}: shape {mean.shape}, channel means {per_channel}")
    return 0

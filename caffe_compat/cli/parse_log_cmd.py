"""``caffe-compat parse-log LOGFILE OUTPUT_DIR [--delimiter ,] [--plot CURVES.png]``: Caffe's
``tools/extra/parse_log.py``.

Writes ``OUTPUT_DIR/<log name>.train`` and ``.test``: CSVs with the columns ``NumIters, Seconds,
LearningRate`` and the net's outputs (:mod:`caffe_compat.tools.parse_log`), from Caffe's logs (glog
prefixes ``I1124 ...`` and ``I20261124 ...``) and ours (``caffe-compat train --caffe-log``).  ``--plot``
also draws the training curves (loss; other outputs; learning rate) against iterations or seconds.
OUTPUT_DIR and the folders of ``--plot``/``--json`` must exist (exit 2 before the log is read), as Caffe's
script needs its output folder.
"""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("parse-log", aliases=["parse_log"],
                       help="train/test CSVs (and a curves PNG) from a Caffe training log (tools/extra/parse_log.py)")
    p.add_argument("logfile_path", help="the training log (Caffe's, or caffe-compat train --caffe-log)")
    p.add_argument("output_dir", help="folder for <log name>.train and <log name>.test")
    p.add_argument("--delimiter", default=",", help="column delimiter of the CSVs (default ',')")
    p.add_argument("--verbose", action="store_true", help="print the names of the written files (Caffe's flag)")
    p.add_argument("--year", type=int, help="year of the log's MMDD dates (default: the file's modification year)")
    p.add_argument("--plot", metavar="PNG", help="also write the training curves to this PNG")
    p.add_argument("--x", choices=["iterations", "seconds"], default="iterations",
                   help="x axis of the PNG (default iterations)")
    p.add_argument("--json", metavar="PATH", help="also write the two tables as JSON to PATH ('-': stdout)")
    p.set_defaults(func=run)


def _names(columns: list[str]) -> str:
    if not columns:
        return "no outputs"
    return ", ".join(columns[:5]) + (f", ... ({len(columns)} outputs)" if len(columns) > 5 else "")


def run(args) -> int:
    import os
    from pathlib import Path

    from caffe_compat.cli.output import dump_json, require_output_folders
    from caffe_compat.errors import CaffeCompatError
    from caffe_compat.io.atomic import refuse_special_target
    from caffe_compat.tools.parse_log import parse_log, plot_training_log, save_csv_files

    if len(args.delimiter) != 1:
        raise CaffeCompatError(f"--delimiter must be one character, got {args.delimiter!r}")
    table = Path(args.output_dir) / f"{os.path.basename(args.logfile_path)}.train"  # as Caffe's script: it must exist
    require_output_folders(table, args.plot, args.json)
    log = parse_log(args.logfile_path, year=args.year)
    if args.json not in (None, "-"):
        refuse_special_target(Path(args.json))
    # the plot first: a log it cannot draw is refused before any file is written
    plot = [str(plot_training_log(log, args.plot, x=args.x))] if args.plot else []
    train_path, test_path = save_csv_files(log, args.logfile_path, args.output_dir, args.delimiter)
    written = [str(train_path), str(test_path), *plot]
    if args.json != "-":
        if args.verbose:
            for path in written:
                print(f"Wrote {path}")
        print(f"{args.logfile_path}: {len(log.train)} train rows ({_names(log.train_columns[3:])}), "
              f"{len(log.test)} test rows ({_names(log.test_columns[3:])}) -> {', '.join(written)}")
    if args.json:
        dump_json({"train": log.train, "test": log.test, "files": written}, args.json)
    return 0

"""``caffe-compat reproduce {cub200,sop,vehicleid,digits}``: the paper's setup end to end.

Train from our prototxt → snapshot → export ONNX → evaluate with ONNX Runtime → paper-style table,
curves and run.json under ``--out`` (default ``runs/<dataset>``).  Re-running the same command resumes:
finished runs are reused, interrupted ones continue from their last snapshot.  Every run directory records
the settings that decide its result (settings.json); a re-run whose settings differ (another --max-iter,
--weights, --delta-min, --batch-size, --per-label, data root, ...) is refused with exit status 2 before
anything is trained or written: pass a new ``--out``, or ``--fresh`` to discard those runs and retrain.
``--device``: ``auto`` (default: cuda when torch sees one), ``cpu``, ``cuda`` or ``cuda:N``; a device torch
cannot use is refused (exit 2).  ``digits`` needs no data: it generates the toy data set and is the README's
main command.
"""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("reproduce", help="train -> snapshot -> ONNX -> ONNX Runtime evaluation -> paper tables")
    p.add_argument("dataset", choices=["cub200", "sop", "vehicleid", "digits"],
                   help="the paper's data set to reproduce, or digits (the embedded toy data, no download)")
    p.add_argument("--data-root", help="the data set in its native layout (digits: generated when omitted)")
    p.add_argument("--weights", help="initialisation caffemodel (e.g. bvlc_googlenet.caffemodel)")
    p.add_argument("--loss", action="append", dest="losses", metavar="LOSS",
                   help="fappy, contrastive, triplet, lifted, histogram (repeatable; default: the paper's table)")
    p.add_argument("--seeds", type=int, nargs="+", help="training seeds (default: 0 1 2 for digits, 0 otherwise)")
    p.add_argument("--delta-min", type=float, help="FAPPY's finest bin width (the authors' 1e-4 by default)")
    p.add_argument("--device", default="auto",
                   help="auto (default: cuda when torch has it, else cpu), cpu, cuda or cuda:N")
    p.add_argument("--max-iter", type=int, help="iterations per run (default: per data set)")
    p.add_argument("--workers", type=int, help="data-loading worker processes (default: 0 for digits; on CUDA "
                   "the usable CPUs but one, 2 to 8; else 2); the count changes no number")
    p.add_argument("--snapshot-every", type=int, default=0, help="also snapshot every N iterations (resume points)")
    p.add_argument("--batch-size", type=int, help="override the paper's batch size (e.g. small for a CPU smoke run)")
    p.add_argument("--per-label", type=int, help="images per label run in a batch (label-shuffling sampler)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the training net (one graph: its data comes in through Input layers); meant "
                        "for CUDA: slower than eager on the CPU (warns)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="record each training iteration as CUDA graphs and replay them (the eager numbers; warns "
                        "and trains eagerly off CUDA)")
    p.add_argument("--out", help="run directory (default runs/<dataset>)")
    p.add_argument("--fresh", action="store_true",
                   help="discard what the requested runs' directories hold (snapshots, metrics) and retrain them")
    p.set_defaults(func=run)


def run(args) -> int:
    from caffe_compat.evaluate.inputs import parse_device
    from caffe_compat.export.notices import cli_warnings
    from caffe_compat.reproduce.config import ReproduceConfig
    from caffe_compat.reproduce.pipeline import reproduce

    device = str(parse_device(args.device, option="--device"))  # refused here with the option's name
    config = ReproduceConfig(args.dataset, data_root=args.data_root, losses=args.losses, seeds=args.seeds,
                             weights=args.weights, delta_min=args.delta_min, device=device, max_iter=args.max_iter,
                             out_dir=args.out, workers=args.workers, snapshot_every=args.snapshot_every,
                             batch_size=args.batch_size, per_label=args.per_label, fresh=args.fresh,
                             compile=args.compile, cuda_graphs=args.cuda_graphs)
    with cli_warnings("reproduce"):
        summary = reproduce(config)
    print()
    print(summary["table"])
    out = args.out or f"runs/{args.dataset}"
    print(f"wrote {out}/results.md, results.json, run.json and the plots {', '.join(summary['plots'])}")
    print(f"{summary['closing']} on {device}")
    return 0

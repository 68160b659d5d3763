"""``caffe-compat evaluate embedder.onnx --dataset cub200|sop|vehicleid --data-root DIR [--provider cuda|cpu]
[--batch-size N] [--device auto|cpu|cuda|cuda:N] [--json out.json] [--plot curve.png] [--split S] [--no-progress]``

Calls :func:`caffe_compat.export.evaluate_onnx`, prints which execution provider ONNX Runtime used and a
markdown table laid out like the paper's Table 1 (CUB/SOP Recall@K) or Table 2 (VehicleID match rate
with its spread).  ``--json`` writes the result dict, ``--plot`` the Recall@K curve (CUB, SOP) or the CMC
curves (VehicleID, Fig. 6); both are rendered to temporary files and renamed into place only when
everything succeeded.  ``--provider`` picks ONNX Runtime's execution provider (features; a CUDA request
that falls back to the CPU is reported on stderr), ``--device`` where the exact k-NN of the metrics runs
(``auto``: CUDA when torch has it; the metrics are the same on both).  Exit status: 0 done, 2 bad input
(an unusable ``--device``, a ``--json``/``--plot`` folder that does not exist, a ``--plot`` named other than
``.png`` included; nothing written).
"""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("evaluate",
                       help="embed a data set's test split with ONNX Runtime and evaluate (paper tables)")
    p.add_argument("model", metavar="embedder.onnx", help="model written by caffe-compat export")
    p.add_argument("--dataset", required=True, choices=["cub200", "sop", "vehicleid"],
                   help="which data set --data-root holds (it decides the split and the paper table)")
    p.add_argument("--data-root", required=True, metavar="DIR", help="the data set in its native layout")
    p.add_argument("--provider", choices=["cuda", "cpu"], default=None,
                   help="execution provider (default: CUDA when it works, else CPU)")
    p.add_argument("--batch-size", type=int, default=64, help="images per ONNX Runtime call (default 64)")
    p.add_argument("--device", default="auto",
                   help="device of the k-NN search: auto (default: cuda when torch has it), cpu, cuda or cuda:N")
    p.add_argument("--split", action="append",
                   help="override the test split (VehicleID: small/medium/large, repeatable)")
    p.add_argument("--json", metavar="out.json", help="write the metrics as JSON")
    p.add_argument("--plot", metavar="curve.png", help="write the Recall@K (CUB/SOP) or CMC (VehicleID) curve")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args) -> int:
    import json
    from contextlib import ExitStack
    from pathlib import Path

    from caffe_compat.errors import CaffeCompatError
    from caffe_compat.evaluate import paper_tables
    from caffe_compat.evaluate.inputs import parse_device
    from caffe_compat.evaluate.plots import plot_cmc, plot_recall_at_k
    from caffe_compat.export import evaluate_onnx
    from caffe_compat.export.notices import cli_warnings
    from caffe_compat.io.atomic import atomic_path, require_folder

    if args.batch_size < 1:
        raise CaffeCompatError(f"--batch-size must be >= 1, got {args.batch_size}")
    device = parse_device(args.device, option="--device")
    for output in (args.json, args.plot):
        if output:
            require_folder(output)
    if args.plot and Path(args.plot).suffix.lower() not in ("", ".png"):  # not PNG bytes in a .pdf or .svg
        raise CaffeCompatError(f"--plot {args.plot}: the plot is a PNG image; name it .png")
    split = None
    if args.split:
        split = args.split if args.dataset == "vehicleid" else args.split[-1]
    with cli_warnings("evaluate"):
        result = evaluate_onnx(args.model, args.dataset, args.data_root, provider=args.provider,
                               batch_size=args.batch_size, progress=not args.no_progress, split=split, device=device)
    method = Path(args.model).stem
    print(f"features: ONNX Runtime {result['provider']}; k-NN on {result['knn_device']}")
    print()
    print(paper_tables({method: {args.dataset: result}}, with_std=args.dataset == "vehicleid"))
    if args.dataset != "vehicleid":
        print(f"MAP@R {100 * result['map_at_r']:.2f}  precision@1 {100 * result['precision_at_1']:.2f}"
              + (f"  NMI {100 * result['nmi']:.2f}" if "nmi" in result else ""))
    with ExitStack() as stack:  # every file appears only if all of them could be written
        if args.plot:
            tmp = stack.enter_context(atomic_path(args.plot))
            if args.dataset == "vehicleid":
                curves = {f"{name} ({entry['num_vehicles']} vehicles)": entry["cmc"]
                          for name, entry in result["splits"].items()}
                plot_cmc(curves, tmp, max_rank=min(50, min(len(c) for c in curves.values())),
                         title=f"CMC, {method}")
            else:
                plot_recall_at_k({method: result["recall_at_k"]}, tmp, title=f"Recall@K, {method}")
        if args.json:
            tmp = stack.enter_context(atomic_path(args.json))
            tmp.write_text(json.dumps(result, indent=2) + "\n")
    for name in (args.json, args.plot):
        if name:
            print(f"wrote {name}")
    return 0

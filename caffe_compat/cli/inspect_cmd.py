"""``caffe-compat inspect NET.prototxt [--weights W.caffemodel] [--phase TRAIN|TEST] [--json]``.

The net is the one Caffe builds for a phase (``Net::FilterNet``: the layers whose include/exclude rules
the state ``--phase`` (default TRAIN, as ``caffe time``), ``--level``, ``--stage`` meets), so a
``train_val.prototxt`` with a Data layer per phase is inspected as Caffe would build it; a deploy net
(no rules) is the same in either phase.

Exit status: 0 consistent, 1 when the net defines no layers (a warning on stderr: an empty or wrong file)
or the weights check finds missing or mismatched blobs or cannot check some
(shapes unknown without ``--input-shape``), 2 with ``--strict`` when layer names of the net and the
``--weights`` do not match (caffemodel layers the net lacks, net layers it does not cover), 2 when a file is
unreadable or the net is invalid (a layer type neither Caffe 1.0 nor a registered port knows, shapes or
parameters Caffe would refuse), with one line naming the file or layer on stderr.
"""

from __future__ import annotations

import sys

from caffe_compat.cli.output import dump_json, print_table


def register(sub) -> None:
    p = sub.add_parser("inspect", help="layer table, shapes, parameter counts; check a caffemodel against a net")
    p.add_argument("net", help="prototxt (any Caffe version) or caffemodel")
    p.add_argument("--weights", help="caffemodel to check against the net by layer name and shape")
    p.add_argument("--strict", action="store_true",
                   help="with --weights: exit 2 (an error naming the layers) when layer names do not match: "
                        "caffemodel layers with blobs the net lacks, or net layers with blobs it does not cover")
    p.add_argument("--input-shape", action="append", default=[], metavar="BLOB=N,C,H,W",
                   help="shape of a blob the net cannot infer (e.g. the top of a Python data layer); repeatable")
    p.add_argument("--phase", "-phase", type=str.upper, choices=["TRAIN", "TEST"], default="TRAIN",
                   help="the phase whose layers are inspected (include/exclude rules; default TRAIN, as caffe time)")
    p.add_argument("--level", "-level", type=int, default=None, help="network level (default: the net's own state)")
    p.add_argument("--stage", "-stage", default="", metavar="S1,S2", help="network stages, comma-separated")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)


def parse_input_shapes(items: list[str]) -> dict[str, tuple[int, ...]]:
    from caffe_compat.errors import CaffeCompatError

    shapes = {}
    for item in items:
        name, _, dims = item.partition("=")
        try:
            shapes[name] = tuple(int(d) for d in dims.split(","))
        except ValueError:
            raise CaffeCompatError(f"--input-shape {item!r}: expected BLOB=N,C,H,W with integers") from None
        if not name or not shapes[name]:
            raise CaffeCompatError(f"--input-shape {item!r}: expected BLOB=N,C,H,W")
    return shapes


def _refuse_name_mismatch(path, net, check) -> None:
    """FormatError naming the caffemodel layers the net lacks and the net layers it does not cover."""
    from caffe_compat.errors import FormatError
    from caffe_compat.io.weights import mismatch_message

    if check["extra"] or check["missing"]:
        raise FormatError(mismatch_message(path, net.name, [f"'{i['layer']}'" for i in check["extra"]],
                                           [f"'{i['layer']}'" for i in check["missing"]]))


def _shape(s):
    return "?" if s is None else "x".join(str(d) for d in s) or "scalar"


def run(args) -> int:
    from caffe_compat.io import read_net
    from caffe_compat.net_report import inspect_net

    from caffe_compat.errors import CaffeCompatError, naming_file
    from caffe_compat.net_graph import filter_net, make_state

    written = read_net(args.net)
    weights = read_net(args.weights) if args.weights else None
    try:
        state = make_state(written, args.phase, args.level, [s.strip() for s in args.stage.split(",") if s.strip()])
        net = filter_net(written, state)
    except CaffeCompatError as exc:
        raise naming_file(exc, args.net, args.weights) from exc
    left_out = len(written.layer) - len(net.layer)

    from caffe_compat.net_shapes import check_memory_budget

    try:
        check_memory_budget(net, f"net '{net.name}'")  # as load_net: a net too large to build is refused
        report = inspect_net(net, weights, input_shapes=parse_input_shapes(args.input_shape))
    except CaffeCompatError as exc:  # a setup error names the layer: the file too
        raise naming_file(exc, args.net, args.weights) from exc
    if args.strict and weights is not None:
        _refuse_name_mismatch(args.weights, net, report["weights_check"])
    if args.json:
        dump_json(report)
    elif net.layer:
        rows = [[r["name"], r["type"], ",".join(r["bottoms"]) + " -> " + ",".join(r["tops"]),
                 " ".join(_shape(s) for s in r["top_shapes"]), " ".join(_shape(s) for s in r["param_shapes"]),
                 f"{r['params']:,}"] for r in report["layers"]]
        print_table(rows, ["layer", "type", "bottoms -> tops", "output", "learnable blobs", "params"])
        unresolved = report["unresolved_layers"]
        bound = "at least " if unresolved else ""
        phase = f" (phase {args.phase}; {left_out} layers of other phases or stages left out)" if left_out else ""
        print(f"\n{len(report['layers'])} layers{phase}, {bound}{report['total_params']:,} parameters, "
              f"{bound}{report['total_macs']:,} multiply-adds")
        if unresolved:
            print(f"{len(unresolved)} layers have unknown shapes (not in the totals; give --input-shape BLOB=N,C,H,W "
                  f"for the data layer's tops): {', '.join(unresolved[:5])}{', ...' if len(unresolved) > 5 else ''}")
        if report["types_without_shape_rule"]:
            print(f"no shape rule for layer type(s) {', '.join(report['types_without_shape_rule'])}: their outputs "
                  f"are unknown unless given with --input-shape")
        check = report.get("weights_check")
        if check:
            print(f"weights: {check['matched_blobs']} blobs match", end="")
            for kind in ("missing", "mismatched", "unchecked", "extra"):
                if check[kind]:
                    print(f"; {len(check[kind])} {kind}", end="")
            print()
            for kind in ("missing", "mismatched", "unchecked", "extra"):
                for item in check[kind]:
                    print(f"  {kind}: layer '{item['layer']}': {item['reason']}")
    if not written.layer:
        print(f"caffe-compat inspect: warning: {args.net} defines no layers (an empty net: is it the right file?)",
              file=sys.stderr)
        return 1
    check = report.get("weights_check")
    return 0 if check is None or check["consistent"] else 1

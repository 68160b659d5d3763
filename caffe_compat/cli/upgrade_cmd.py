"""``caffe-compat upgrade OLD NEW``: Caffe's upgrade_net_proto_text / _binary (and solver files).

The output format follows NEW's suffix (``.caffemodel``/``.binaryproto`` → binary, else prototxt) unless
``--binary``/``--text`` is given.  The file is written atomically; NEW's folder must exist (exit 2).

Caffe's three tools also answer to their own names and command lines, so a script runs with only the
program renamed: ``upgrade_net_proto_text IN OUT`` (OUT a prototxt whatever its name),
``upgrade_net_proto_binary IN OUT`` (OUT a binary NetParameter whatever its name) and
``upgrade_solver_proto_text IN OUT``.  Each prints Caffe's lines: ``File already in latest proto format:
IN`` when nothing needed upgrading (the file is written all the same), then ``Wrote upgraded NetParameter
text proto to OUT`` (``binary proto``, ``SolverParameter text proto``).
"""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("upgrade", help="upgrade a V0/V1 net (prototxt or caffemodel) or an old solver file")
    p.add_argument("old", help="the V0/V1 net (prototxt or caffemodel), or with --solver the old solver file")
    p.add_argument("new", help="the file to write (its folder must exist)")
    p.add_argument("--solver", action="store_true", help="the input is a solver prototxt")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--binary", dest="binary", action="store_true", default=None,
                     help="write binary protobuf (default for .caffemodel/.binaryproto names)")
    fmt.add_argument("--text", dest="binary", action="store_false", help="write a text prototxt (default otherwise)")
    p.set_defaults(func=run)
    for name, what in (("upgrade_net_proto_text", "a net to a text prototxt"),
                       ("upgrade_net_proto_binary", "a net (caffemodel) to a binary NetParameter"),
                       ("upgrade_solver_proto_text", "a solver prototxt")):
        p = sub.add_parser(name, help=f"Caffe's {name}: upgrade {what} (IN OUT, OUT's format fixed by the tool)")
        p.add_argument("old", metavar="IN", help="the file to upgrade")
        p.add_argument("new", metavar="OUT", help="the file to write (its folder must exist)")
        p.set_defaults(func=_run_caffe_tool, tool=name)


def _run_caffe_tool(args) -> int:
    """Caffe's upgrade_net_proto_text / _binary / upgrade_solver_proto_text: the output format is the tool's
    (text, binary, text), not OUT's suffix; an input already current is written as it is, after Caffe's
    ``File already in latest proto format`` line."""
    from caffe_compat.io import read_net, read_solver, write_net
    from caffe_compat.io.atomic import require_folder
    from caffe_compat.io.protofiles import write_message

    require_folder(args.new)
    if args.tool == "upgrade_solver_proto_text":
        before, message = read_solver(args.old, upgrade=False), read_solver(args.old)
        kind = "SolverParameter text"
    else:
        before, message = read_net(args.old, upgrade=False), read_net(args.old)
        kind = "NetParameter binary" if args.tool == "upgrade_net_proto_binary" else "NetParameter text"
    if before == message:
        print(f"File already in latest proto format: {args.old}")
    if args.tool == "upgrade_solver_proto_text":
        write_message(message, args.new, binary=False)
    else:
        write_net(message, args.new, binary=args.tool == "upgrade_net_proto_binary")
    print(f"Wrote upgraded {kind} proto to {args.new}")
    return 0


def run(args) -> int:
    from caffe_compat.io import read_net, read_solver, write_net
    from caffe_compat.io.atomic import require_folder
    from caffe_compat.io.protofiles import write_message

    require_folder(args.new)
    if args.solver:
        solver = read_solver(args.old)
        write_message(solver, args.new, binary=bool(args.binary))
        print(f"wrote {args.new} (solver type {solver.type})")
        return 0
    before = read_net(args.old, upgrade=False)
    net = read_net(args.old)
    write_net(net, args.new, binary=args.binary)
    changed = "upgraded" if before != net else "already current; copied"
    print(f"wrote {args.new}: {len(net.layer)} layers ({changed})")
    return 0

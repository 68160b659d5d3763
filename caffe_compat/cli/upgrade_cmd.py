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


def _upgrade(old, new, solver: bool, binary: bool):
    """Read ``old`` as it is and upgraded, write the upgraded message to ``new`` (its folder must exist):
    ``(upgraded message, whether upgrading changed it)``."""
    from caffe_compat.io import read_net, read_solver, write_net
    from caffe_compat.io.atomic import require_folder
    from caffe_compat.io.protofiles import write_message

    require_folder(new)
    read = read_solver if solver else read_net
    before, message = read(old, upgrade=False), read(old)
    if solver:
        write_message(message, new, binary=binary)
    else:
        write_net(message, new, binary=binary)
    return message, before != message


def _run_caffe_tool(args) -> int:
    """Caffe's upgrade_net_proto_text / _binary / upgrade_solver_proto_text: the output format is the tool's
    (text, binary, text), not OUT's suffix; an input already current is written as it is, after Caffe's
    ``File already in latest proto format`` line."""
    solver, binary = args.tool == "upgrade_solver_proto_text", args.tool == "upgrade_net_proto_binary"
    _, changed = _upgrade(args.old, args.new, solver, binary)
    if not changed:
        print(f"File already in latest proto format: {args.old}")
    kind = "SolverParameter text" if solver else "NetParameter binary" if binary else "NetParameter text"
    print(f"Wrote upgraded {kind} proto to {args.new}")
    return 0


def run(args) -> int:
    message, changed = _upgrade(args.old, args.new, bool(args.solver), bool(args.binary))
    if args.solver:
        print(f"wrote {args.new} (solver type {message.type})")
    else:
        print(f"wrote {args.new}: {len(message.layer)} layers ({'upgraded' if changed else 'already current; copied'})")
    return 0

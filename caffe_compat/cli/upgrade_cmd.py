"""``caffe-compat upgrade OLD NEW``: Caffe's upgrade_net_proto_text / _binary (and solver files).

The output format follows NEW's suffix (``.caffemodel``/``.binaryproto`` → binary, else prototxt) unless
``--binary``/``--text`` is given.  The file is written atomically; NEW's folder must exist (exit 2).
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

"""``caffe-compat test -model NET -weights W [-iterations N] [-gpu ID]``: Caffe's ``caffe test``.

Runs the TEST-phase net N times and prints Caffe's lines: ``Use CPU.`` or ``Use GPU with device ID N`` and
``GPU device name: ...``, ``Running for N iterations.``, then (:mod:`caffe_compat.tools.score`)
``Batch i, name = value`` per batch and output element, ``Loss: x``, then ``name = mean`` per output
element with `` (* w = w·mean loss)`` for loss outputs.  ``--json PATH`` also writes them as JSON.
"""

from __future__ import annotations

from caffe_compat.cli.caffe_flags import accept_caffe_flags, add_net_flags, check_iterations


def register(sub) -> None:
    p = sub.add_parser("test", help="score a model: N forward passes of the TEST net, means of its outputs "
                                    "(caffe test)")
    add_net_flags(p, weights_help="the trained weights to score (required when the net has learnable blobs; a "
                                  "comma-separated list is copied in order)",
                  iterations_help="number of forward passes (batches)")
    accept_caffe_flags(p)  # the caffe binary's other flags, accepted and unread (gflags)
    p.set_defaults(func=run)


def run(args) -> int:
    from caffe_compat.cli.output import dump_json, require_output_folders
    from caffe_compat.tools.netsetup import build_net, device_lines, load_inputs, resolve_device
    from caffe_compat.tools.score import batch_lines, score_net

    check_iterations(args)
    require_output_folders(args.json)
    device = resolve_device(args.gpu, args.device)
    net = build_net(args.model, args.weights, phase="test", level=args.level, stages=args.stage, device=device,
                    require_weights=True)
    inputs = load_inputs(args.input, net)
    quiet = args.json == "-"

    def show(i, values):
        if not quiet:
            print("\n".join(batch_lines(i, values)), flush=True)

    if not quiet:
        print("\n".join(device_lines(device, with_name=True)))
        print(f"Running for {args.iterations} iterations.")
    result = score_net(net, args.iterations, inputs, on_batch=show, keep_batches=bool(args.json))
    if not quiet:
        print("\n".join(result.caffe_lines()))
    if args.json:
        dump_json(result.as_dict(), args.json)
    return 0

"""``caffe-compat time -model NET [-weights W] [-iterations N] [-gpu ID] [-phase TRAIN|TEST]``: Caffe's
``caffe time``.

Prints Caffe's benchmark lines (:mod:`caffe_compat.tools.timing`): ``Iteration: j forward-backward time:
x ms.`` as it goes, then per layer ``<name>\\tforward: x ms.`` / ``<name>\\tbackward: x ms.`` and
``Average Forward pass``, ``Average Backward pass``, ``Average Forward-Backward``, ``Total Time``.
On CUDA the device is synchronised around every timed span.  ``--json PATH`` also writes the numbers.
"""

from __future__ import annotations

from caffe_compat.cli.caffe_flags import accept_caffe_flags, add_net_flags, check_iterations


def register(sub) -> None:
    p = sub.add_parser("time", help="benchmark a model: per-layer forward/backward milliseconds (caffe time)")
    add_net_flags(p, weights_help="optional weights (caffemodel, comma-separated list) copied in before timing",
                  iterations_help="number of timed forward-backward iterations", phase="TRAIN")
    accept_caffe_flags(p)  # the caffe binary's other flags, accepted and unread (gflags)
    p.set_defaults(func=run)


def run(args) -> int:
    from caffe_compat.cli.output import dump_json, require_output_folders
    from caffe_compat.tools.netsetup import build_net, device_lines, load_inputs, resolve_device
    from caffe_compat.tools.timing import time_net

    check_iterations(args)
    require_output_folders(args.json)
    device = resolve_device(args.gpu, args.device)
    phase = (args.phase or "TRAIN").lower()  # Caffe's get_phase_from_flags(TRAIN): an empty -phase is the default
    net = build_net(args.model, args.weights, phase=phase, level=args.level, stages=args.stage, device=device)
    inputs = load_inputs(args.input, net)
    quiet = args.json == "-"

    def say(text):
        if not quiet:
            print(text, flush=True)

    say("\n".join(device_lines(device)))  # Use CPU. / Use GPU with device ID N
    say("Performing Forward")

    def initial(loss):
        from caffe_compat.io.glog import g6

        say(f"Initial loss: {g6(loss)}")
        say("Performing Backward")
        say("*** Benchmark begins ***")
        say(f"Testing for {args.iterations} iterations.")

    def iteration(j, ms):
        from caffe_compat.io.glog import g6

        say(f"Iteration: {j} forward-backward time: {g6(ms)} ms.")

    result = time_net(net, args.iterations, inputs, on_iteration=iteration, on_initial=initial)
    say("\n".join(result.caffe_lines()))
    if args.json:
        dump_json(result.as_dict(), args.json)
    return 0

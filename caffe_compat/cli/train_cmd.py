"""``caffe-compat train SOLVER.prototxt``: Caffe's ``caffe train`` on PyTorch (CPU or CUDA).

Caffe's flags are taken as ``caffe train`` spells them (gflags: one dash or two, ``-flag=value`` too):
``-solver SOLVER.prototxt`` (instead of the positional SOLVER; giving both, or neither, exits 2, as Caffe's
"Need a solver definition to train"), ``-weights``, ``-snapshot`` and ``-gpu ID`` (one device: data-parallel
training over several GPUs runs under torchrun, see below).  ``-snapshot`` with ``-weights`` exits 2, as
Caffe's "Give a snapshot to resume training or weights to finetune but not both" (the solverstate's
weights would replace the caffemodel's).

Reads the net relative to the working directory, then to the solver's folder; ``--weights`` copies a
caffemodel in first (fine-tuning), ``--snapshot`` (or ``--resume``) resumes from a ``.solverstate``: with the
``<prefix>_iter_N.trainstate`` written beside it (data-layer positions, RNG states, loss window), the run
continues as the uninterrupted one would (same losses with ``--deterministic --seed S``); without it (a
Caffe snapshot) only Caffe's state is restored and the data layers and RNGs restart, as in Caffe (a
warning says so).

Log lines as ``caffe train`` writes them around the solver's: ``Resuming from <snapshot>`` (before the
restore), ``Starting Optimization``, and after training one more ``Optimization Done.`` (Caffe's tool logs
it after ``Solve``'s own, also after an early stop).

``-level N`` and ``-stage S1,S2`` set the train net's state as ``caffe train`` does (the level always: 0
unless given, even over a level the net's own ``state`` names; the stages added to the solver's
``train_state``).

Signals as ``caffe train`` handles them (:mod:`caffe_compat.cli.signal_effects`): Ctrl-C (SIGINT) stops
after the current iteration with the snapshot after training and exit 0, SIGHUP writes a snapshot and goes
on; ``-sigint_effect``/``-sighup_effect`` ``stop|snapshot|none`` change that (not under torchrun, where the
launcher's signals stop every rank).

Data come from the net's data layers (Data/LMDB, ImageData, HDF5Data, DummyData, the authors'
LabelShufflingLayer port); a net that reads its batches only from Input layers is refused (exit status
2): feed those through the Python API (``caffe_compat.solver.train.train(solver, data=...)``).

Data parallel: ``torchrun --nproc_per_node N -m caffe_compat.cli train SOLVER.prototxt`` (or the
``caffe-compat`` script under ``torchrun --no-python``) splits every global batch of the net's data
layers over the N ranks, the pair losses see the gathered global batch, and rank 0 alone writes the
snapshots, the logs and the summary line (see :mod:`caffe_compat.solver.train`).
``--no-distributed`` trains each rank alone.

Python layers: a ``type: "Python"`` layer runs when it has a native port; ``--python-path DIR`` (repeatable)
lets its ``python_param.module`` be imported from DIR (the user's opt-in, logged; see
:mod:`caffe_compat.layers.python_user`).  Without it such a layer is refused (exit 2, naming the layer and
the flag).

The ``--log`` and ``--caffe-log`` files' folders must exist (exit 2 before training); ``--tensorboard``
folders are created.
"""

from __future__ import annotations

import argparse
import logging
import os

from caffe_compat.cli.caffe_flags import accept_caffe_flags
from caffe_compat.cli.signal_effects import EFFECTS


def register(sub) -> None:
    p = sub.add_parser("train", help="train a Caffe net from its solver prototxt")
    p.add_argument("solver", nargs="?", help="solver prototxt naming the net (net: \"train.prototxt\")")
    p.add_argument("--solver", "-solver", dest="solver_flag", metavar="SOLVER.prototxt",
                   help="Caffe's flag for the solver prototxt (instead of the positional SOLVER)")
    p.add_argument("--weights", "-weights", help="caffemodel(s) to start from (comma-separated, like caffe train)")
    p.add_argument("--strict", action="store_true",
                   help="with --weights: refuse (exit 2) caffemodels whose layer names do not match the train net "
                        "(layers the net lacks, or net layers with blobs none covers); without it, a warning")
    p.add_argument("--snapshot", "-snapshot", "--resume", dest="snapshot", metavar="SOLVERSTATE",
                   help="a .solverstate to resume from (with the .trainstate beside it, when train wrote one, the "
                        "run continues exactly as if uninterrupted in --deterministic mode)")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: the solver's solver_mode when available)")
    p.add_argument("--sigint-effect", "-sigint_effect", "--sigint_effect", choices=EFFECTS, default="stop",
                   help="what Ctrl-C (SIGINT) does: stop after the iteration with a snapshot (default, as Caffe), "
                        "snapshot and go on, or none")
    p.add_argument("--sighup-effect", "-sighup_effect", "--sighup_effect", choices=EFFECTS, default="snapshot",
                   help="what SIGHUP does: snapshot and go on (default, as Caffe), stop, or none")
    p.add_argument("--gpu", "-gpu", metavar="ID",
                   help="Caffe's flag: train on CUDA device ID (instead of --device; one device: several GPUs "
                        "train under torchrun)")
    p.add_argument("--level", "-level", type=int, default=0,
                   help="the train net's level (default 0, as caffe train, which sets it even where the net's own "
                        "state names another)")
    p.add_argument("--stage", "-stage", default="", metavar="S1,S2",
                   help="stages added to the train net's state, comma-separated (caffe train's -stage)")
    p.add_argument("--iters", type=int, help="iterations to run (default: up to max_iter)")
    p.add_argument("--amp", choices=["bf16", "fp16"], help="autocast forward/backward")
    p.add_argument("--channels-last", action="store_true",
                   help="NHWC memory order (the convolutions round their sums differently: ~4e-7 relative)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the net's forward (fullgraph; the data layers run ahead of the graph, user "
                        "Python layers and torchrun's gathers eagerly between graphs); "
                        "meant for CUDA: slower than eager on the CPU (warns)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="record each iteration (forward and backward, Caffe's update) as CUDA graphs and replay "
                        "them: thousands of kernel launches at once on a fast GPU; where a graph cannot hold the "
                        "iteration (not CUDA, iter_size > 1, clip_gradients, fp16, Adam, user Python layers, "
                        "torchrun) it warns and trains eagerly")
    p.add_argument("--seed", type=int, help="seed of torch's generator (fillers, dropout); with --deterministic also "
                                           "numpy's and random's")
    p.add_argument("--deterministic", action="store_true",
                   help="seeded runs that repeat exactly (deterministic kernels, no cuDNN autotuning)")
    p.add_argument("--log", help="CSV log of loss and lr per iteration")
    p.add_argument("--caffe-log", metavar="FILE",
                   help="also write the solver's log in Caffe's glog format (Iteration N, lr = ...; Train/Test "
                        "net output #k: ...) to FILE ('-': stderr), readable by caffe-compat parse-log and "
                        "Caffe's tools/extra/parse_log.py")
    p.add_argument("--tensorboard", help="TensorBoard log folder (when tensorboard is installed)")
    p.add_argument("--distributed", action=argparse.BooleanOptionalAction, default=None,
                   help="data-parallel training over the torchrun ranks (default: when WORLD_SIZE > 1)")
    p.add_argument("--python-path", action="append", default=[], metavar="DIR",
                   help="allow the net's Python layers to import their python_param.module from DIR (repeatable); "
                        "without it a Python layer runs only when it has a native port (code named by a model "
                        "file is never imported unless allowed)")
    accept_caffe_flags(p)  # the caffe binary's other flags, accepted and unread (gflags)
    p.set_defaults(func=run)


def _solver_path(args) -> str:
    """The solver from the positional SOLVER or Caffe's ``-solver`` (exactly one of them)."""
    from caffe_compat.errors import CaffeCompatError

    if args.solver and args.solver_flag:
        raise CaffeCompatError(f"give the solver once: {args.solver} (positional) or -solver {args.solver_flag}")
    if not (args.solver or args.solver_flag):
        raise CaffeCompatError("need a solver definition to train: caffe-compat train SOLVER.prototxt "
                               "(or -solver SOLVER.prototxt)")
    return args.solver or args.solver_flag


def _device(args, parse_device) -> str | None:
    """``--device``, or Caffe's ``-gpu ID`` (one id; ``all`` on a one-GPU machine), or None (the solver's
    solver_mode).  Several ids are refused: Caffe trains on all of them, this process would use one."""
    from caffe_compat.errors import CaffeCompatError
    from caffe_compat.tools.netsetup import resolve_device, split_list

    if args.gpu is None:
        return None if args.device is None else str(parse_device(args.device, option="--device", allow_auto=False))
    import torch

    several = torch.cuda.device_count() > 1 if args.gpu.strip().lower() == "all" else len(split_list(args.gpu)) > 1
    if several:
        raise CaffeCompatError(f"-gpu {args.gpu}: train runs on one device per process; train on several GPUs "
                               f"with torchrun --nproc_per_node N (see caffe-compat train --help)")
    return str(resolve_device(args.gpu, args.device))


def _train_state(args):
    """caffe train's ``solver_param.mutable_train_state()->set_level(FLAGS_level)`` and ``add_stage`` per
    ``-stage``: the level is set whether given or not (0 by default), so it replaces a level the net's own
    ``state`` names, as in Caffe; the stages are added to the solver's."""
    from caffe_compat.net_graph import level_value
    from caffe_compat.proto import caffe_pb2
    from caffe_compat.tools.netsetup import split_list

    return caffe_pb2.NetState(level=level_value(args.level), stage=split_list(args.stage))


def run(args) -> int:
    import contextlib

    from caffe_compat.evaluate.inputs import parse_device
    from caffe_compat.export.notices import cli_warnings
    from caffe_compat.io.atomic import require_folder
    from caffe_compat.solver import distributed as ddp
    from caffe_compat.solver.train import train
    from caffe_compat.io.glog import caffe_log

    solver = _solver_path(args)
    if args.iters is not None and args.iters < 1:
        from caffe_compat.errors import CaffeCompatError

        raise CaffeCompatError(f"--iters must be >= 1, got {args.iters} (leave it out to train up to max_iter)")
    if args.snapshot and args.weights:
        from caffe_compat.errors import CaffeCompatError

        raise CaffeCompatError("give a snapshot to resume training or weights to fine-tune, not both "
                               "(-snapshot replaces the weights with the solverstate's)")
    for output in (args.log, args.caffe_log):
        if output and output != "-":
            require_folder(output)
    if args.python_path:
        from caffe_compat.layers.python_user import allow_python_imports

        allow_python_imports(args.python_path)
    device = _device(args, parse_device)
    with contextlib.ExitStack() as stack:
        stack.enter_context(cli_warnings("train"))
        if args.caffe_log and int(os.environ.get("RANK", "0")) == 0:  # rank 0 alone logs, as train() does
            stack.enter_context(caffe_log(args.caffe_log))
        effects = None
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or args.distributed is False:
            from caffe_compat.cli.signal_effects import SignalEffects

            effects = stack.enter_context(SignalEffects(args.sigint_effect, args.sighup_effect).installed())
        summary = train(solver, iters=args.iters, weights=args.weights, resume=args.snapshot, device=device,
                        amp=args.amp, channels_last=args.channels_last, compile=args.compile, csv_log=args.log,
                        tensorboard=args.tensorboard, deterministic=args.deterministic, seed=args.seed,
                        distributed=args.distributed, strict_weights=args.strict, cuda_graphs=args.cuda_graphs,
                        action_request=effects, train_state=_train_state(args))
        logging.getLogger("caffe_compat.solver").info("Optimization Done.")  # caffe train's, after Solve's own
    main = ddp.is_main_process()
    ddp.shutdown_distributed()
    if not main:
        return 0
    print(f"trained {summary.iterations} iterations in {summary.seconds:.1f} s ({summary.iters_per_s:.2f} it/s) on "
          f"{summary.device}; loss {summary.first_loss:.6g} -> {summary.last_loss:.6g}; "
          f"snapshots: {', '.join(summary.snapshots) or 'none'}"
          + ("; stopped early (Optimization stopped early, as Caffe's -sigint_effect stop)" if summary.stopped_early
             else ""))
    return 0

"""Options shared by the commands that mirror Caffe's tools, each with Caffe's single-dash spelling too
(``-model``, ``-weights``, ``-iterations``, ``-gpu``, ``-phase``, ``-level``, ``-stage``; ``-model=x`` works).

The ``caffe`` binary's flags are gflags, defined once for all its commands: ``caffe test -solver s.prototxt``
or ``caffe device_query -gpu 0 -model m`` parse and ignore what the command does not read.
:func:`accept_caffe_flags` gives a command the flags of :data:`CAFFE_FLAGS` it does not take, accepted and
unread (an int32 flag still has to be an integer, as gflags checks)."""

from __future__ import annotations


def int32(text: str) -> int:
    """An int32 gflag's value (argparse ``type``): an integer from -2**31 to 2**31 - 1, as gflags refuses
    others ("illegal value"); ``-iterations 9223372036854775808`` had ``caffe time`` loop for ever."""
    import argparse

    value = int(text)  # not an integer: argparse's "invalid int32 value"
    if not -2 ** 31 <= value <= 2 ** 31 - 1:
        raise argparse.ArgumentTypeError(f"{text!r} is out of range for an int32 flag (-2147483648 to 2147483647)")
    return value


#: tools/caffe.cpp's gflags: name -> value type (DEFINE_string / DEFINE_int32)
CAFFE_FLAGS = {"gpu": str, "solver": str, "model": str, "phase": str, "level": int32, "stage": str, "snapshot": str,
               "weights": str, "iterations": int32, "sigint_effect": str, "sighup_effect": str}


def accept_caffe_flags(p) -> None:
    """Add to parser ``p`` each flag of :data:`CAFFE_FLAGS` it lacks (``-name``, ``--name``), accepted and
    ignored, as the ``caffe`` binary's gflags are for a command that does not read them."""
    for name, kind in CAFFE_FLAGS.items():
        if f"-{name}" not in p._option_string_actions:
            p.add_argument(f"--{name}", f"-{name}", dest=f"unused_caffe_flag_{name}", type=kind,
                           metavar="INT" if kind is int32 else "VALUE",
                           help="the caffe binary's flag, accepted and not read by this command")


def add_net_flags(p, *, weights_help: str, iterations_help: str, phase: str | None = None) -> None:
    p.add_argument("--model", "-model", required=True, metavar="NET.prototxt",
                   help="the model definition (prototxt; data layers read their sources relative to the working "
                        "directory, as in Caffe)")
    p.add_argument("--weights", "-weights", metavar="W.caffemodel", help=weights_help)
    p.add_argument("--iterations", "-iterations", type=int32, default=50, metavar="N",
                   help=iterations_help + " (default 50, as Caffe)")
    if phase is not None:  # Caffe's get_phase_from_flags: "" is the default, else exactly TRAIN or TEST
        p.add_argument("--phase", "-phase", choices=["TRAIN", "TEST", ""], default=phase,
                       help=f"network phase, TRAIN or TEST spelt so (default, or empty: {phase}, as Caffe)")
    p.add_argument("--level", "-level", type=int, default=0, help="network level (default 0, as Caffe)")
    p.add_argument("--stage", "-stage", default="", metavar="S1,S2",
                   help="network stages, comma-separated (not to be confused with the phase)")
    add_device_flags(p)
    p.add_argument("--input", action="append", default=[], metavar="BLOB=FILE",
                   help="feed an Input blob the same values every iteration: BLOB=FILE.npy or BLOB=FILE.npz[:KEY] "
                        "(repeatable; Caffe leaves Input blobs at zero)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH ('-': stdout)")


def check_iterations(args) -> None:
    """``-iterations`` below 1 exits 2 before anything is loaded or printed (one line, no Caffe header)."""
    from caffe_compat.errors import CaffeCompatError

    if args.iterations < 1:
        raise CaffeCompatError(f"-iterations must be >= 1, got {args.iterations}")


def add_device_flags(p) -> None:
    p.add_argument("--gpu", "-gpu", metavar="ID",
                   help="Caffe's flag: run on CUDA device ID (a list or 'all': the first is used); default CPU")
    p.add_argument("--device", help="cpu, cuda, cuda:N or auto (instead of -gpu)")


def atoi(text: str) -> int:
    """C's ``atoi``, as Caffe's tools read their positional numbers: leading white space, an optional sign,
    then the digits up to the first other character; no digits is 0 (``atoi("abc")``, ``atoi("2x")`` = 2):
    the list files' :func:`~caffe_compat.data.imageset.caffe_atoi`, imported when a tool needs it."""
    from caffe_compat.data.imageset import caffe_atoi

    return caffe_atoi(text)

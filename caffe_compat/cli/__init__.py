"""The ``caffe-compat`` command line: argument parsing only; every command calls the library.

Each module ``caffe_compat/cli/<name>_cmd.py`` defines ``register(subparsers)``, which adds its
sub-command and sets ``func``.  Errors from the user's input (:class:`CaffeCompatError`) print one line
and exit with status 2, with no traceback.  A :class:`~caffe_compat.errors.WeightsMismatchWarning` (a
caffemodel whose layer names do not match the net's) prints as one line ``caffe-compat <command>:
warning: ...``; the commands that load weights take ``--strict`` to make it an error (exit 2).
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import warnings
from contextlib import contextmanager

from caffe_compat.errors import CaffeCompatError, WeightsMismatchWarning


def package_version() -> str:
    """The installed distribution's version (``importlib.metadata``), else ``caffe_compat.__version__`` (a
    checkout run without installing), else ``"unknown"``."""
    from importlib import metadata

    try:
        return metadata.version("caffe-compat")
    except metadata.PackageNotFoundError:
        import caffe_compat

        return getattr(caffe_compat, "__version__", "unknown")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="caffe-compat",
                                     description="Caffe-era metric learning on PyTorch / ONNX Runtime.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}",
                        help="print the package version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND",
                                help="the command to run (COMMAND --help: its arguments)")
    sub.required = True
    package = sys.modules[__name__]
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if info.name.endswith("_cmd"):
            importlib.import_module(f"{__name__}.{info.name}").register(sub)
    return parser


@contextmanager
def _weights_warnings(command: str):
    """Print each WeightsMismatchWarning as one stderr line (other warnings as before)."""
    with warnings.catch_warnings():
        previous = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if issubclass(category, WeightsMismatchWarning):
                print(f"caffe-compat {command}: warning: {message}", file=sys.stderr, flush=True)
            else:
                previous(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        yield


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        with _weights_warnings(args.command):
            status = args.func(args)
    except CaffeCompatError as exc:
        print(f"caffe-compat {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"caffe-compat {args.command}: interrupted", file=sys.stderr)
        return 130
    return int(status or 0)


def console_main() -> int:
    """The ``caffe-compat`` executable: :func:`main` in a process that keeps freed memory for reuse
    (:func:`caffe_compat.allocator.retain_unless_switched_off`; a caller of :func:`main` in its own
    process keeps its malloc as it is) and whose console streams escape the characters their encoding
    lacks (:func:`~caffe_compat.cli.output.tolerate_narrow_encodings`)."""
    from caffe_compat.allocator import retain_unless_switched_off
    from caffe_compat.cli.output import tolerate_narrow_encodings

    retain_unless_switched_off()
    tolerate_narrow_encodings()
    return main()


if __name__ == "__main__":
    raise SystemExit(console_main())

"""``caffe-compat run SCRIPT.py [ARGS...]`` / ``caffe-compat run -m MODULE [ARGS...]``: run a pycaffe
script unchanged, with ``import caffe`` (and ``caffe.io``, ``caffe.proto``, ``caffe.draw``, ...) resolving to
caffe_compat (:func:`caffe_compat.install_alias`).

As ``python SCRIPT.py ARGS`` would: ``sys.argv`` is ``[SCRIPT.py, *ARGS]``, the script's folder is first on
``sys.path``, it runs as ``__main__``; with ``-m`` (``python -m MODULE``) the module is found on
``sys.path`` with the working directory first.  ``--python-path DIR`` (repeatable) lets Python layers be
imported from DIR (``caffe_compat.allow_python_imports``; without it no module named by a model file is
imported).  An error in the script is the script's: its traceback is printed (caffe_compat's frames left
out) and the exit status is 1, as Python's; ``sys.exit(n)`` in the script exits with ``n``.  A script
file that does not exist is exit 2, without a traceback.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import traceback

from caffe_compat.errors import CaffeCompatError


def register(sub) -> None:
    p = sub.add_parser("run", help="run a pycaffe script unchanged: 'import caffe' is caffe_compat")
    p.add_argument("--python-path", action="append", default=[], metavar="DIR",
                   help="a folder Python layers may be imported from (repeatable; logged)")
    p.add_argument("-m", dest="module", nargs=argparse.REMAINDER, metavar="MODULE ARGS",
                   help="run a module as 'python -m MODULE ARGS' does, instead of a script file (last option)")
    p.add_argument("script", nargs="?", help="the pycaffe script to run (omit with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments (its sys.argv[1:])")
    p.set_defaults(func=run)


def _allow_python_imports(paths: list[str]) -> None:
    import caffe_compat

    allow = getattr(caffe_compat, "allow_python_imports", None)
    if allow is None:
        raise CaffeCompatError("--python-path needs Python-layer support (caffe_compat.allow_python_imports), "
                               "which this installation lacks")
    allow(list(paths))


def _user_traceback(exc: BaseException) -> None:
    """Print the traceback from the first frame that is not this runner's (``runpy``, this module)."""
    ours = {os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<frozen runpy>"}
    tb = exc.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename in ours
                              or os.path.abspath(tb.tb_frame.f_code.co_filename) in ours):
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb)


def run(args) -> int:
    from caffe_compat import install_alias

    if args.module is not None:  # -m MODULE ARGS: everything after -m is the module and its arguments
        if args.script is not None or not args.module:
            raise CaffeCompatError("give either a script or -m MODULE (as the last option)")
        args.module, args.args = args.module[0], args.module[1:]
    elif args.script is None:
        raise CaffeCompatError("give a script (caffe-compat run SCRIPT.py ARGS) or -m MODULE ARGS")
    if args.module is None:
        from caffe_compat.io.safe_open import require_regular_file

        # a FIFO, a device or a folder is named as such
        require_regular_file(args.script, "the script", missing=f"{args.script}: no such script file")
    if args.python_path:
        _allow_python_imports(args.python_path)
    install_alias()
    saved_argv, saved_path, saved_main = sys.argv[:], sys.path[:], sys.modules.get("__main__")
    try:
        if args.module is not None:
            sys.argv = [args.module, *args.args]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(args.module, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [args.script, *args.args]
            sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)))
            runpy.run_path(args.script, run_name="__main__")
    except SystemExit:
        raise
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # the script's own error: its traceback, exit 1 (as python would)
        _user_traceback(exc)
        return 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
        if saved_main is not None:
            sys.modules["__main__"] = saved_main
    return 0

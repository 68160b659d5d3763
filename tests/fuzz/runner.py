"""Running one fuzz case in a forked child: a time limit, an address-space limit, and the outcome.

The parent imports the readers once; each case forks (so a case costs milliseconds, not an interpreter
start), the child lowers ``RLIMIT_AS`` to its current size plus ``memory_bytes``, sends stdout/stderr to
``/dev/null``, runs the reader and reports ``[outcome, detail]`` through a pipe.  The parent kills a child
that outlives ``timeout`` seconds (``timeout``), and reads a child that dies without reporting as
``crash`` with its signal or exit status.
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import resource
import select
import signal
import time
import traceback

from caffe_compat.errors import CaffeCompatError

OUTCOMES = ("ok", "typed", "untyped", "crash", "timeout", "memory")
BUGS = ("untyped", "crash", "timeout", "memory")

# An allocator's failure that is not a MemoryError: torch's, OpenCV's, the C++ runtime's, mmap's.
_ALLOCATION = re.compile(r"alloc|out of memory|Insufficient memory|Cannot allocate memory|bad_alloc", re.I)


def _vm_size() -> int:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def classify(func, *args) -> tuple[str, str]:
    """Run ``func(*args)`` here and name the outcome (see the module docstring)."""
    try:
        func(*args)
    except CaffeCompatError as exc:
        return "typed", f"{type(exc).__name__}: {exc}"[:400]
    except BaseException as exc:  # noqa: BLE001 - everything else is what the fuzzer looks for
        message = f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
        frames = traceback.extract_tb(exc.__traceback__)
        where = " | ".join(f"{os.path.relpath(f.filename)}:{f.lineno} {f.name}" for f in frames[-3:])
        memory = isinstance(exc, MemoryError) or (_ALLOCATION.search(str(exc)) is not None
                                                  and not isinstance(exc, (KeyError, SystemExit)))
        return "memory" if memory else "untyped", f"{message[:300]} at {where}"
    return "ok", ""


def run_case(func, args: tuple, timeout: float = 10.0, memory_bytes: int = 2 << 30) -> tuple[str, str]:
    """``(outcome, detail)`` of ``func(*args)`` run in a forked child (see the module docstring)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        status = 0
        try:
            faulthandler.disable()  # a crash is the parent's to report, not a traceback dump on a shared fd
            os.close(read_end)
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, 1)
            os.dup2(null, 2)
            limit = _vm_size() + memory_bytes
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            result = classify(func, *args)
            os.write(write_end, json.dumps(result).encode())
        except BaseException:  # noqa: BLE001
            status = 3
        finally:
            os._exit(status)
    os.close(write_end)
    data, deadline, timed_out = b"", time.monotonic() + timeout, False
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                os.kill(pid, signal.SIGKILL)
                break
            ready, _, _ = select.select([read_end], [], [], remaining)
            if ready:
                chunk = os.read(read_end, 1 << 16)
                if not chunk:
                    break
                data += chunk
    finally:
        os.close(read_end)
        _, status = os.waitpid(pid, 0)
    if timed_out:
        return "timeout", f"still running after {timeout:g} s"
    if os.WIFSIGNALED(status):
        return "crash", f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    if not data:
        return "crash", f"exited with status {os.WEXITSTATUS(status)} without a result"
    outcome, detail = json.loads(data)
    return outcome, detail

"""What every benchmark script shares: the ratio convention, the header line naming the CPU, and real
Caffe's recorded times (``../shared/caffe_reference/README.md`` section 6) for the CPU class it runs on.

Ratio convention, in every script: **peer time ÷ our time** (above 1: ours is faster).  Importing this
module also puts the repository root first on ``sys.path``, so a script run as
``python benchmarks/<script>.py`` measures this checkout's ``caffe_compat``.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from caffe_compat.hardware import cpu_capability, cpu_class, cpu_model_name  # noqa: E402

#: The header line every script prints; tests look for it.
RATIO_CONVENTION = "ratio = peer time ÷ our time (> 1: ours faster)"

#: Real Caffe, 1 thread, median of 5 (README section 6), per CPU class.  FAPPY rows are keyed by
#: (B, D, run length, delta), ``fappy_inputs`` says on which inputs they were timed; GoogLeNet full width
#: by batch: (forward, forward+backward) seconds.  Section 6 asks for both sides timed on the same input
#: (the vectorised port's time depends on it, the C++ layer's barely): on the Intel VM it gives the
#: layer's times on ``bench_fappy.py``'s own batches, which are used; the AMD column has only the table's
#: standard-normal features.
CAFFE_REFERENCE = {
    "AMD EPYC": {
        "machine": "2-vCPU AMD EPYC VM (AVX2+FMA)",
        "capability": "AVX2",
        "fappy": {(128, 512, 10, 1e-2): 0.261, (128, 512, 10, 1e-3): 0.361, (128, 512, 10, 1e-4): 0.714,
                  (150, 1024, 16, 1e-4): 1.607},
        "fappy_inputs": ("standard-normal features, not this script's batches (the layer's time barely depends "
                         "on the input: on the Intel VM, at delta 1e-2, 307 ms on those and 315 on these)"),
        "googlenet_full": {8: (0.697, 1.659), 32: (2.824, 6.272)},
    },
    "Intel Xeon": {
        "machine": "2-vCPU Intel Xeon VM (family 6 model 207, AVX-512, no AMX)",
        "capability": "AVX512",
        "fappy": {(128, 512, 10, 1e-2): 0.315, (128, 512, 10, 1e-3): 0.408, (128, 512, 10, 1e-4): 0.943,
                  (150, 1024, 16, 1e-4): 2.108},
        "fappy_inputs": "this script's own batches, as ours",
        "googlenet_full": {8: (1.344, 3.201)},
    },
}


def add_malloc_option(parser) -> None:
    """``--system-malloc``: leave glibc's malloc as it is instead of retaining freed memory as the
    ``caffe-compat`` command does (:mod:`caffe_compat.allocator`); a net's forward allocates its activations
    anew at each call, and fresh pages fault on their first write."""
    parser.add_argument("--system-malloc", action="store_true",
                        help="keep glibc's default malloc (the caffe-compat command retains freed memory "
                             "for reuse, caffe_compat.allocator; this measures without it)")


def apply_malloc_option(args) -> str:
    """Apply ``--system-malloc`` (see :func:`add_malloc_option`); the header line saying which is in force."""
    from caffe_compat.allocator import retain_freed_memory

    if getattr(args, "system_malloc", False):
        return "malloc: glibc's defaults (--system-malloc)"
    if retain_freed_memory():
        return "malloc: freed memory retained for reuse, as the caffe-compat command (caffe_compat.allocator)"
    return "malloc: this C library's own (not glibc: nothing to retain)"


def cpu_line() -> str:
    """``CPU: <model name> (torch CPU capability X, N logical CPUs)``."""
    capability = cpu_capability() or "unknown"
    return f"CPU: {cpu_model_name()} (torch CPU capability {capability}, {os.cpu_count()} logical CPUs)"


def print_header(peer: str) -> None:
    """The two header lines of every script: the CPU it runs on and the ratio convention with its peer."""
    print(cpu_line())
    print(f"{RATIO_CONVENTION}; peer: {peer}")


def caffe_reference() -> tuple[dict | None, str]:
    """Real Caffe's times recorded on this CPU's class, and a line saying which (or that none applies, or that
    this CPU's vector extensions differ from those of the machine the column was timed on)."""
    kind = cpu_class()
    if kind is None:
        return None, (f"real Caffe (README section 6) was timed on AMD EPYC and Intel Xeon VMs only; this CPU "
                      f"({cpu_model_name()}) is neither, so no ratio against it is printed")
    table = CAFFE_REFERENCE[kind]
    note = f"real Caffe reference: the {table['machine']} column of README section 6 (this CPU is {kind}"
    capability = cpu_capability()
    if capability and capability.upper() != table["capability"]:
        # one class name covers several microarchitectures (an AVX2 EPYC and an AVX-512 one were both seen here):
        # the vector width changes real Caffe's time too, so the column was timed on another machine
        return table, (f"{note}, but its torch CPU capability is {capability}, the column's machine's "
                       f"{table['capability']}: the ratios are against another machine, not this CPU)")
    return table, note + ")"


def fmt_ratio(peer_seconds: float | None, our_seconds: float | None, width: int = 8, digits: int = 2) -> str:
    """``peer ÷ ours`` formatted as ``1.23x``, or ``-`` when either is missing."""
    if not peer_seconds or not our_seconds:
        return f"{'-':>{width}}"
    return f"{peer_seconds / our_seconds:>{width - 1}.{digits}f}x"


def median_time(fn, repeats: int, warmup: int = 1, clock=time.perf_counter) -> float:
    """The median of ``repeats`` timed calls of ``fn`` (seconds, by ``clock``), after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times)


@contextlib.contextmanager
def without_profiler_chatter(prefix: bytes = b"USDT:"):
    """Run the block with the process's standard error (file descriptor 2) caught, then replay every line
    that does not start with ``prefix``: torch 2.13's profiler writes two ``USDT: ... profiler_start/stop``
    lines to it from C++ at every ``profile()`` block, whatever the log level, which split the tables."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = b"".join(line for line in caught if not line.startswith(prefix))
            if kept:
                sys.stderr.buffer.write(kept)
                sys.stderr.flush()

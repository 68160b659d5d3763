"""Warnings the deployment code gives, and how the command line prints them.

The library emits them with :func:`warnings.warn` (so Python callers can filter, record or turn them into
errors); :func:`cli_warnings` prints them at once on stderr as ``caffe-compat <command>: warning: ...``
(one line, no source location), whatever the interpreter's warning filters say.

* :class:`PreprocessingAssumedWarning`: an export stored preprocessing that was neither given nor read
  from the net's TEST-phase data layer (the message names every assumed value);
* :class:`ProviderFallbackWarning`: ONNX Runtime was asked for CUDA but runs on another provider (the
  message names the one used).
"""

from __future__ import annotations

import sys
import warnings
from contextlib import contextmanager

from caffe_compat.errors import CaffeCompatWarning

__all__ = ["CaffeCompatWarning", "PreprocessingAssumedWarning", "ProviderFallbackWarning", "cli_warnings"]


class PreprocessingAssumedWarning(CaffeCompatWarning):
    """The stored preprocessing was assumed, not given nor read from the net."""


class ProviderFallbackWarning(CaffeCompatWarning):
    """ONNX Runtime does not run on the execution provider that was asked for."""


@contextmanager
def cli_warnings(command: str, stream=None):
    """Print every :class:`CaffeCompatWarning` raised inside as one stderr line (each time it occurs)."""
    out = stream if stream is not None else sys.stderr

    with warnings.catch_warnings():
        previous = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if issubclass(category, CaffeCompatWarning):
                print(f"caffe-compat {command}: warning: {message}", file=out, flush=True)
            else:
                previous(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        warnings.simplefilter("always", CaffeCompatWarning)
        yield

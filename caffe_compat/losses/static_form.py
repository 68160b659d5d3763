"""When a computation must take its *static form*: fixed shapes and no host synchronisation.

:func:`static_form` is true while ``torch.compile`` traces the code (Dynamo records a graph), while a CUDA
graph is being captured on the current stream (reading a value on the host there is an error), and on
the ``meta`` device (tensors without values: shape and memory planning, and the tests' proof that a step
reads nothing on the host).  The losses and ports whose eager code branches on values (FAPPY's row
layout, label and index checks) switch on it: the same numbers, their checks assertions in the graph
(``torch._assert_async``)."""

from __future__ import annotations

import torch

__all__ = ["asserted_in_graph", "static_form"]


def static_form(t: torch.Tensor) -> bool:
    """Whether the computation on ``t`` must not read values on the host (module docstring)."""
    if torch.compiler.is_compiling() or t.device.type == "meta":
        return True
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def asserted_in_graph(ok: torch.Tensor, message: str) -> bool:
    """In the static form, assert the 0-d bool ``ok`` inside the graph (``torch._assert_async``: no host
    sync; a failure names no value) and return True, so that the caller skips its eager check, which reads
    the host to name the offending value; elsewhere False."""
    if not static_form(ok):
        return False
    torch._assert_async(ok, message)
    return True

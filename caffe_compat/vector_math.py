"""One single-threaded call into PyTorch's vector math before any multi-threaded one, once per process.

Why: PyTorch's CPU build computes float ``sqrt``, ``exp``, ``log``, ``tanh`` and other element-wise
functions through Intel MKL's vector math library (VML), in chunks of 2,048 elements spread over its
OpenMP threads.  With torch 2.13.0 (MKL 2024.2) on the team's 2-vCPU Intel Xeon, when a process's *first*
such call is split over two threads, one chunk is sometimes computed with ~12-bit accuracy (relative
error up to 3.0e-4 instead of MKL's half an ulp): ``F.linear`` then ``torch.sqrt`` of a 64 x 64 tensor in
a fresh process gave 2,033 inaccurate values in 14 of 188 processes, and none in 147 processes where one
call on a tensor below the chunk size (one thread) had come first.  In training it changed the cosines'
denominators in CosineSimilarityBatch at the first iteration (the digits FAPPY net: 4 of 30 processes;
0 of 36 with this module), and with them the FAPPY loss (its bins are 1e-4 wide), so the digits main
command's FAPPY figures differed from process to process (seed 0: Recall@1 96.4 or 96.9).  No later
call was seen affected, so :func:`initialise` makes the first calls on one thread.  :mod:`caffe_compat.losses`,
the lowest layer that computes with torch, calls it when it is imported; the nets (through their layers)
and the evaluation import it first.  It costs a few microseconds and changes no setting; on a torch
built without MKL it is merely redundant.
"""

from __future__ import annotations

import threading

import torch

_DONE = False
_LOCK = threading.Lock()

#: Below the 2,048-element chunk of PyTorch's parallel element-wise loops: computed on the calling thread.
_ONE_THREAD = 16


def initialise() -> bool:
    """Make this process's first vector-math calls on one thread (idempotent); True when it ran them now."""
    global _DONE
    if _DONE:
        return False
    with _LOCK:
        if _DONE:
            return False
        values = torch.linspace(0.5, 2.0, _ONE_THREAD)
        for function in (torch.sqrt, torch.exp, torch.log, torch.tanh):
            function(values)
        _DONE = True
        return True

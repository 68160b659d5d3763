"""The cut of a net at one output blob: the layers that blob's final value depends on, found by names.

:func:`cut_indices` walks ``(bottoms, tops)`` records (one per layer, in execution order) backwards: a
record is kept when it writes a blob still needed; an in-place writer (the blob among its bottoms too)
keeps the blob needed, an ordinary producer retires it (earlier writers of that name are irrelevant);
the bottoms of a kept record become needed.  Both forms of a net use it: prototxt LayerParameters
(:meth:`caffe_compat.export.source.TestPhaseNet.cut`, before the net is built) and a built net's steps
(:func:`caffe_compat.export.embedder.cut_steps`, automatic Split steps included).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["cut_indices"]


def cut_indices(records: Sequence[tuple[Iterable[str], Iterable[str]]], output_blob: str) -> list[int]:
    """The indices (ascending) of the ``(bottoms, tops)`` records that ``output_blob``'s final value
    depends on (see the module docstring)."""
    needed = {output_blob}
    kept = []
    for index in range(len(records) - 1, -1, -1):
        bottoms, tops = (list(names) for names in records[index])
        written = [t for t in tops if t in needed]
        if not written:
            continue
        kept.append(index)
        for top in written:
            if top not in bottoms:
                needed.discard(top)
        needed.update(bottoms)
    kept.reverse()
    return kept

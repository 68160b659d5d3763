"""pycaffe's batch helpers of ``caffe.Net``: ``forward_all``, ``forward_backward_all`` and ``_batch``
(BVLC ``pycaffe.py``), as :class:`NetBatchMixin`.

* ``_batch(arrays)``: the arrays (same length N) cut into batches of the net's batch size (the first
  axis of its first blob); a last partial batch is padded with zeros to the full size.  A batch size of 0
  is pycaffe's ZeroDivisionError (its ``num % batch_size``), raised when the first batch is asked for.
* ``forward_all(blobs=None, **inputs)``: one ``forward`` per batch of the keyword inputs (which must name
  the net's inputs); returns ``{blob: array}`` for the outputs and ``blobs``, the batches' rows
  concatenated and the padding rows removed.
* ``forward_backward_all(blobs=None, diffs=None, **kwargs)``: keyword arrays named like inputs are
  batched for ``forward``, those named like outputs for ``backward`` (as top diffs); returns the outputs
  (plus ``blobs``) and the input diffs (plus ``diffs``), each concatenated and unpadded.
"""

from __future__ import annotations

from itertools import zip_longest

import numpy as np

from caffe_compat.errors import CaffeCompatError

__all__ = ["NetBatchMixin"]


def _concatenated(parts: dict, pad: int) -> dict:
    out = {}
    for name, rows in parts.items():
        value = np.concatenate(rows) if rows else np.zeros((0,), np.float32)
        out[name] = value[:len(value) - pad] if pad else value
    return out


class NetBatchMixin:
    """The batch helpers of :class:`~caffe_compat.pycaffe.net.Net` (see the module docstring)."""

    def _batch(self, arrays: dict):
        if not arrays:
            return
        lengths = {name: len(value) for name, value in arrays.items()}
        if len(set(lengths.values())) != 1:
            raise CaffeCompatError(f"_batch: the arrays have different lengths {lengths}")
        num = next(iter(lengths.values()))
        first = next(iter(self.blobs))
        batch_size = self.blobs[first].shape[0]
        if not batch_size:  # pycaffe's remainder = num % batch_size: the same exception, with what it means
            raise ZeroDivisionError(f"_batch: the net's first blob '{first}' has batch size 0, so {num} rows cannot be "
                                    f"cut into batches (pycaffe's num % batch_size is an integer modulo by zero)")
        for start in range(0, num - num % batch_size, batch_size):
            yield {name: np.asarray(value[start:start + batch_size]) for name, value in arrays.items()}
        remainder = num % batch_size
        if remainder:
            padded = {}
            for name, value in arrays.items():
                value = np.asarray(value)
                padding = np.zeros((batch_size - remainder,) + value.shape[1:], dtype=value.dtype)
                padded[name] = np.concatenate([value[num - remainder:], padding])
            yield padded

    def _padding(self, kwargs: dict) -> int:
        if not kwargs:
            return 0
        num = len(next(iter(kwargs.values())))
        batch_size = next(iter(self.blobs.values())).shape[0]
        return (-num) % batch_size

    def forward_all(self, blobs=None, **kwargs) -> dict:
        """``forward`` over every batch of the keyword inputs; the outputs (and ``blobs``) concatenated."""
        outs = {name: [] for name in set(self.outputs + list(blobs or []))}
        for batch in self._batch(kwargs):
            for name, value in self.forward(blobs=blobs, **batch).items():
                outs[name].append(np.array(value, copy=True).reshape((-1,) + value.shape[1:]))
        return _concatenated(outs, self._padding(kwargs))

    def forward_backward_all(self, blobs=None, diffs=None, **kwargs) -> tuple[dict, dict]:
        """``forward`` and ``backward`` over every batch; (outputs, input diffs), each concatenated."""
        outs = {name: [] for name in set(self.outputs + list(blobs or []))}
        grads = {name: [] for name in set(self.inputs + list(diffs or []))}
        forward_batches = self._batch({n: kwargs[n] for n in self.inputs if n in kwargs})
        backward_batches = self._batch({n: kwargs[n] for n in self.outputs if n in kwargs})
        for fb, bb in zip_longest(forward_batches, backward_batches, fillvalue={}):
            for name, value in self.forward(blobs=blobs, **fb).items():
                outs[name].append(np.array(value, copy=True).reshape((-1,) + value.shape[1:]))
            for name, value in self.backward(diffs=diffs, **bb).items():
                grads[name].append(np.array(value, copy=True).reshape((-1,) + value.shape[1:]))
        pad = self._padding(kwargs)
        return _concatenated(outs, pad), _concatenated(grads, pad)

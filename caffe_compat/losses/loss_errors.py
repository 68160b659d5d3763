"""Input errors of the metric-learning loss functions.

:class:`LossInputError` is raised for shapes Caffe's ``CHECK`` macros would abort on, and for values on
which the authors' C++ layers have undefined behaviour (out-of-bounds histogram writes, NaN bin
indices).  It is a :class:`~caffe_compat.errors.CaffeCompatError` (the CLI reports it as bad input) and a
``ValueError`` (plain Python callers can catch it as such).
"""

from __future__ import annotations

from caffe_compat.errors import CaffeCompatError


class LossInputError(CaffeCompatError, ValueError):
    """A loss received a tensor of the wrong shape, or values the Caffe layer cannot handle."""


class LossArgumentError(LossInputError, TypeError):
    """A loss was called with one of pytorch-metric-learning's optional arguments (``indices_tuple``,
    ``ref_emb``, ``ref_labels``) that it has no meaning for: the message names the loss and the argument.
    Also a ``TypeError``, the error such a call raised before these arguments were accepted."""

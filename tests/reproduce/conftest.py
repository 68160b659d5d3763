"""The small digits run the reproduce tests share: 2 losses x 2 seeds x 6 iterations on CPU."""

from __future__ import annotations

import pytest

from caffe_compat.reproduce.pipeline import reproduce

#: The arguments of :func:`digits_run` (a test re-running the same command passes them again).
DIGITS_RUN = dict(losses=["fappy", "triplet"], seeds=[0, 1], max_iter=6)


@pytest.fixture(scope="session")
def digits_run(tmp_path_factory):
    """``(out_dir, summary)`` of ``reproduce("digits", **DIGITS_RUN)``, made once per session."""
    out = tmp_path_factory.mktemp("digits")
    summary = reproduce("digits", out_dir=out, progress=False, **DIGITS_RUN)
    return out, summary

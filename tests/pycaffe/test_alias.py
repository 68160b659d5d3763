"""``import caffe`` through :func:`caffe_compat.install_alias`: the alias names are caffe_compat's very modules,
unknown ``caffe.X`` fail naming their target, a real ``caffe`` already imported is refused, and nothing is
installed by default.  Also pycaffe's module functions (``layer_type_list``, the NCCL/solver globals, Timer)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import time
import types

import numpy as np
import pytest
import torch

import caffe_compat
from caffe_compat.errors import CaffeCompatError


@pytest.fixture
def alias():
    caffe_compat.install_alias()
    yield
    caffe_compat.uninstall_alias()


def test_alias_names_are_caffe_compat_modules(alias):
    import caffe
    import caffe.draw
    import caffe.io
    from caffe.proto import caffe_pb2

    import caffe_compat.draw
    import caffe_compat.pycaffe
    import caffe_compat.pycaffe.io
    from caffe_compat.proto import caffe_pb2 as ours

    assert caffe is caffe_compat.pycaffe and importlib.import_module("caffe.pycaffe") is caffe_compat.pycaffe
    assert caffe_pb2 is ours and caffe.proto.caffe_pb2 is ours
    assert caffe.io is caffe_compat.pycaffe.io and caffe.draw is caffe_compat.draw
    assert importlib.import_module("caffe._caffe") is importlib.import_module("caffe_compat.pycaffe._caffe")
    assert caffe.Net is caffe_compat.Net and caffe.SGDSolver is caffe_compat.SGDSolver
    assert (caffe.TRAIN, caffe.TEST) == (0, 1)
    datum = caffe.io.array_to_datum(np.ones((1, 2, 2), np.uint8), label=3)
    assert isinstance(datum, caffe_pb2.Datum) and datum.label == 3 and datum.data == b"\x01" * 4


def test_unknown_submodule_names_its_target(alias):
    with pytest.raises(ModuleNotFoundError, match=r"'caffe.no_such_thing'.*caffe_compat.pycaffe.no_such_thing"):
        importlib.import_module("caffe.no_such_thing")


def test_install_is_idempotent_and_uninstall_cleans(alias):
    from caffe_compat.alias import _FINDER

    caffe_compat.install_alias()
    assert sys.meta_path.count(_FINDER) == 1
    import caffe  # noqa: F401
    caffe_compat.uninstall_alias()
    assert _FINDER not in sys.meta_path and "caffe" not in sys.modules


def test_a_real_caffe_already_imported_is_refused(monkeypatch):
    real = types.ModuleType("caffe")
    real.__file__ = "/opt/caffe/python/caffe/__init__.py"
    monkeypatch.setitem(sys.modules, "caffe", real)
    with pytest.raises(CaffeCompatError, match=r"real 'caffe' module is already imported \(from /opt/caffe"):
        caffe_compat.install_alias()
    from caffe_compat.alias import alias_installed
    assert not alias_installed()


def test_nothing_is_installed_by_default():
    code = ("import sys, caffe_compat, caffe_compat.pycaffe, importlib.util; "
            "print(importlib.util.find_spec('caffe') is None, 'caffe' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["True", "False"]


def test_layer_type_list_is_caffes_type_names():
    types_ = caffe_compat.layer_type_list()
    assert {"Data", "Convolution", "InnerProduct", "SoftmaxWithLoss", "Input", "Python"} <= set(types_)
    assert types_ == sorted(types_) and not any(t.startswith("Python:") for t in types_)


def test_nccl_and_solver_globals_tell_the_truth():
    from caffe_compat.pycaffe import _caffe

    nccl = bool(torch.cuda.is_available() and torch.distributed.is_available()
                and torch.distributed.is_nccl_available())
    assert caffe_compat.has_nccl() is nccl
    uid = caffe_compat.NCCL.new_uid()
    assert isinstance(uid, bytes) and len(uid) == 128 and uid != caffe_compat.NCCL.new_uid()
    if not nccl:
        with pytest.raises(CaffeCompatError, match="NCCL is not available"):
            caffe_compat.NCCL(None, uid)
    saved = dict(_caffe._GLOBALS)
    try:
        assert (caffe_compat.solver_count(), caffe_compat.solver_rank()) == (1, 0)  # no process group here
        caffe_compat.set_solver_count(4)
        caffe_compat.set_solver_rank(2)
        caffe_compat.set_multiprocess(True)
        assert (caffe_compat.solver_count(), caffe_compat.solver_rank(), _caffe.multiprocess()) == (4, 2, True)
        with pytest.raises(CaffeCompatError, match=">= 1"):
            caffe_compat.set_solver_count(0)
    finally:
        _caffe._GLOBALS.update(saved)


def test_timer_measures_milliseconds():
    from caffe_compat.pycaffe import Timer

    timer = Timer()
    timer.start()
    time.sleep(0.02)
    timer.stop()
    assert 15.0 <= timer.ms < 2000.0

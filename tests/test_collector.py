"""caffe_compat.collector: the cyclic collector paused while a net is built, restored exactly after."""

import gc
import threading

import pytest

from caffe_compat.collector import collection_paused
from caffe_compat.errors import FormatError
from caffe_compat.net import CaffeNet


@pytest.fixture(autouse=True)
def collector_enabled():
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_paused_within_and_enabled_after():
    with collection_paused():
        assert not gc.isenabled()
        with collection_paused():  # re-entrant: the inner end does not enable it
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_disabled_collector_stays_disabled():
    gc.disable()
    with collection_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_enabled_again_after_an_exception():
    with pytest.raises(RuntimeError):
        with collection_paused():
            raise RuntimeError("boom")
    assert gc.isenabled()


def test_overlapping_pauses_in_threads_enable_it_once_the_last_ends():
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def first():
        with collection_paused():
            first_in.set()
            second_in.wait(10)
        first_out.set()

    def second():
        first_in.wait(10)
        with collection_paused():
            second_in.set()
            first_out.wait(10)
            seen["after_first_ended"] = gc.isenabled()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == {"after_first_ended": False}
    assert gc.isenabled()


def test_a_net_is_built_with_the_collector_paused_and_restored(monkeypatch):
    seen = []
    original = CaffeNet._build

    def spy(self, *args, **kwargs):
        seen.append(gc.isenabled())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(CaffeNet, "_build", spy)
    CaffeNet('name: "n" layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 1 dim: 2 } } }')
    assert seen == [False]
    assert gc.isenabled()


def test_a_failing_build_restores_the_collector():
    with pytest.raises(FormatError):
        CaffeNet('name: "n" layer { name: "r" type: "ReLU" bottom: "missing" top: "y" }')
    assert gc.isenabled()

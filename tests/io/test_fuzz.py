"""Fuzzing the readers: mutated prototxt text and caffemodel bytes raise only the project's typed
errors (or parse), never a crash, a hang or a foreign exception."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from caffe_compat.errors import CaffeCompatError
from caffe_compat.io import infer_shapes, read_net
from tests.conftest import fixture_path

PROTOTXT = fixture_path("layer_zoo/deploy.prototxt").read_text()
CAFFEMODEL = fixture_path("losses/infogain_H.binaryproto").read_bytes() + \
    fixture_path("nets/vgg_cnn_m_1024_small/weights.caffemodel").read_bytes()[:4096]


def _read(data):
    try:
        net = read_net(data)
        infer_shapes(net)
    except CaffeCompatError:
        pass


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_prototxt_only_typed_errors(data):
    text = PROTOTXT
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, max(len(text) - 1, 0)))
        op = data.draw(st.sampled_from(["delete", "insert", "replace", "truncate"]))
        chunk = data.draw(st.sampled_from(["{", "}", ":", '"', "layer", "dim: -3", "0", "axis: 9", "\x00", "é", " "]))
        if op == "delete":
            text = text[:i] + text[i + 1:]
        elif op == "insert":
            text = text[:i] + chunk + text[i:]
        elif op == "replace":
            text = text[:i] + chunk + text[i + len(chunk):]
        else:
            text = text[:i]
    _read(text.encode("utf-8"))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_caffemodel_bytes_only_typed_errors(data):
    raw = bytearray(fixture_path("nets/googlenet_small_v1/weights_v1.caffemodel").read_bytes()[:20000])
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(1, len(raw)))
    _read(bytes(raw[:cut]))

"""The in-place caffemodel reader (:func:`caffe_compat.io.weights.read_weights`) against protobuf's parser,
differentially: the same bytes (real caffemodels and thousands of mutations of them by the fuzz
mutators) go to both.  The fast path may *defer* (hand the file to protobuf: legacy layers, unpacked
floats, anything unusual), but whatever it accepts protobuf accepts too, with the same layer names and
the same shape, kind and values of every blob; whatever protobuf rejects, ``read_weights`` rejects with
a typed error naming the file."""

from __future__ import annotations

import os
import random
import struct
import subprocess
import sys

import numpy as np
import pytest
from google.protobuf.message import DecodeError

from caffe_compat.errors import CaffeCompatError, ParseError
from caffe_compat.io import weights
from caffe_compat.io.weights import from_netparameter, read_weights
from caffe_compat.proto import caffe_pb2
from tests.conftest import REPO, fixture_path
from tests.fuzz import mutate

SEEDS = [fixture_path(name).read_bytes() for name in
         ("layer_zoo/weights.caffemodel", "layer_zoo_nondiff/weights.caffemodel", "solvers/adam/init.caffemodel",
          "solvers/sgd_fappy_authors_setup/init.caffemodel")]


def protobuf_layers(data: bytes):
    """``from_netparameter`` of protobuf's parse, or None where protobuf rejects the bytes (its pure-Python
    backend reports invalid UTF-8 in a string field as UnicodeDecodeError, upb as DecodeError)."""
    net = caffe_pb2.NetParameter()
    try:
        net.ParseFromString(data)
    except (DecodeError, UnicodeDecodeError):
        return None
    return net


def fast_layers(data: bytes):
    """The fast reader's result, or None where it defers to protobuf."""
    try:
        return weights.parse_in_place(data)
    except weights.Deferred:
        return None


def disagreement(data: bytes) -> str | None:
    """Why the two readers disagree on ``data``, or None when they agree."""
    fast = fast_layers(data)
    if fast is None:
        return None  # deferred: read_weights gives protobuf's own answer (checked below on files)
    net = protobuf_layers(data)
    if net is None:
        return "the fast reader accepts bytes protobuf rejects"
    if net.layers:
        return "the fast reader accepts legacy V1 layers without upgrading them"
    slow = from_netparameter(net)
    if [name for name, _ in fast] != [name for name, _ in slow]:
        return f"layer names differ: {[n for n, _ in fast][:5]} vs {[n for n, _ in slow][:5]}"
    for (name, got), (_, want) in zip(fast, slow):
        if len(got) != len(want):
            return f"layer {name!r}: {len(got)} blobs vs {len(want)}"
        for i, (a, b) in enumerate(zip(got, want)):
            if (a.shape, a.legacy, a.values.dtype) != (b.shape, b.legacy, b.values.dtype):
                return f"layer {name!r} blob {i}: {(a.shape, a.legacy, a.values.dtype)} vs {(b.shape, b.legacy, b.values.dtype)}"
            if not np.array_equal(a.values, b.values, equal_nan=True):
                return f"layer {name!r} blob {i}: values differ"
            if (a.diff is None) != (b.diff is None) or (a.diff is not None and (
                    a.diff.dtype != b.diff.dtype or not np.array_equal(a.diff, b.diff, equal_nan=True))):
                return f"layer {name!r} blob {i}: diffs differ"
    return None


def _mutations(count: int, seed: int):
    rng = random.Random(seed)
    for _ in range(count):
        data = rng.choice(SEEDS)
        for _ in range(rng.choice([1, 1, 2, 3])):
            data = mutate.mutate_protobuf(rng, data) if rng.random() < 0.75 else mutate.mutate_bytes(rng, data, SEEDS)
        yield data


def test_seeds_are_read_in_place_and_agree():
    for data in SEEDS:
        assert fast_layers(data) is not None  # the seeds take the fast path: the comparison is meaningful
        assert disagreement(data) is None


@pytest.mark.parametrize("seed", range(4))
def test_mutated_caffemodels_agree_with_protobuf(seed):
    """1500 mutations per seed; every disagreement is listed (none may remain)."""
    found, fast_accepted, protobuf_rejected = [], 0, 0
    for i, data in enumerate(_mutations(1500, seed)):
        reason = disagreement(data)
        if reason:
            found.append(f"case {i}: {reason}")
        fast_accepted += fast_layers(data) is not None
        protobuf_rejected += protobuf_layers(data) is None
    assert not found, f"{len(found)} disagreements, e.g. {found[:5]}"
    # the mutations exercise both sides: many are read in place, many are corrupt
    assert fast_accepted > 300 and protobuf_rejected > 100


_PURE_PYTHON_CHILD = """
from google.protobuf.internal import api_implementation
from tests.io.test_weights_differential import _mutations, disagreement
assert api_implementation.Type() == "python", api_implementation.Type()
found = [f"case {i}: {why}" for i, data in enumerate(_mutations(250, 0)) if (why := disagreement(data))]
print(len(found), found[:3])
"""


def test_mutations_agree_with_protobufs_pure_python_backend_too():
    """The in-place reader hands all but the blobs' values to the protobuf installed, so it agrees with its
    pure-Python backend as with upb (that backend, unlike upb, refuses invalid UTF-8 in every string field
    of caffe.proto's proto2 messages: the reader that checked the fields itself disagreed on 8 of these 250)."""
    env = dict(os.environ, PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION="python")
    child = subprocess.run([sys.executable, "-c", _PURE_PYTHON_CHILD], capture_output=True, text=True, cwd=REPO,
                           env=env, timeout=600, check=False)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.startswith("0 "), child.stdout


def test_what_protobuf_rejects_read_weights_rejects_naming_the_file(tmp_path):
    checked = 0
    for i, data in enumerate(_mutations(300, 99)):
        if protobuf_layers(data) is not None:
            continue
        path = tmp_path / f"m{i}.caffemodel"
        path.write_bytes(data)
        with pytest.raises(CaffeCompatError, match=f"m{i}.caffemodel"):
            read_weights(path)
        checked += 1
    assert checked > 30


# Hand-made cases, one per disagreement the mutation loop found in the old reader.

def _varint(value: int) -> bytes:
    return mutate.varint(value)


def _field(number: int, wire: int, payload: bytes) -> bytes:
    if wire == 2:
        return _varint(number << 3 | 2) + _varint(len(payload)) + payload
    return _varint(number << 3 | wire) + payload


def _net(blob: bytes, layer_extra: bytes = b"", net_extra: bytes = b"") -> bytes:
    layer = _field(1, 2, b"conv") + _field(7, 2, blob) + layer_extra
    return net_extra + _field(100, 2, layer)


DATA = _field(5, 2, struct.pack("<2f", 1.0, 2.0))
SHAPE = _field(7, 2, _field(1, 0, _varint(2)))

HOSTILE = {
    # protobuf parses every known sub-message, so corruption in a field the fast reader skips is corruption
    "diff_not_whole_floats": _net(SHAPE + DATA + _field(6, 2, b"abc")),
    "double_diff_not_whole_doubles": _net(SHAPE + DATA + _field(9, 2, b"abcdefg")),
    "param_spec_truncated_varint": _net(SHAPE + DATA, layer_extra=_field(6, 2, _field(3, 0, b"\x80"))),
    "conv_param_bad_packed_varint": _net(SHAPE + DATA, layer_extra=_field(106, 2, _field(3, 2, b"\x80\x80"))),
    "net_state_corrupt": _net(SHAPE + DATA, net_extra=_field(6, 2, b"\x0a\x05ab")),
    "input_shape_corrupt": _net(SHAPE + DATA, net_extra=_field(8, 2, _field(1, 2, b"\xff"))),
    "wire_type_6_in_param": _net(SHAPE + DATA, layer_extra=_field(106, 2, b"\x0e")),
    "end_group_without_start": _net(SHAPE + DATA, layer_extra=_field(106, 2, b"\x0c")),
}

DIFFERENT_VALUES = {
    # protobuf keeps the low 32 bits of an int32 varint (then the sign); the low 64 of an over-long varint
    "legacy_dim_over_32_bits": _net(_field(1, 0, _varint((1 << 32) + 1)) + _field(2, 0, _varint(2)) + DATA),
    "shape_dim_tenth_byte_high_bits": _net(_field(7, 2, _field(1, 0, b"\x82\x80\x80\x80\x80\x80\x80\x80\x80\x7e"))
                                           + DATA),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_corruption_in_fields_the_fast_reader_skips_is_rejected(tmp_path, name):
    data = HOSTILE[name]
    assert protobuf_layers(data) is None
    assert disagreement(data) is None
    path = tmp_path / f"{name}.caffemodel"
    path.write_bytes(data)
    with pytest.raises(ParseError, match=f"{name}.caffemodel"):
        read_weights(path)


@pytest.mark.parametrize("name", sorted(DIFFERENT_VALUES))
def test_integer_truncation_follows_protobuf(tmp_path, name):
    data = DIFFERENT_VALUES[name]
    assert protobuf_layers(data) is not None
    assert disagreement(data) is None
    path = tmp_path / f"{name}.caffemodel"
    path.write_bytes(data)
    got = read_weights(path)
    want = from_netparameter(protobuf_layers(data))
    assert [b.shape for b in got[0][1]] == [b.shape for b in want[0][1]]


def _groups(depth: int) -> bytes:
    """``depth`` nested groups of unknown field 15 (start-group key 0x7b, end-group key 0x7c)."""
    return b"\x7b" * depth + b"\x7c" * depth


READ_IN_PLACE = {
    # everything but the blobs' values goes through protobuf's own parser, so what protobuf accepts there is
    # read in place, with protobuf's values (these once made the fast reader hand the whole file over)
    "num_output_as_fixed32": _net(SHAPE + DATA, layer_extra=_field(106, 2, _field(1, 5, b"\x01\x00\x00\x00"))),
    "group_in_conv_param": _net(SHAPE + DATA, layer_extra=_field(106, 2, _groups(3))),
    "name_twice_last_wins": _net(SHAPE + DATA, layer_extra=_field(1, 2, b"conv2")),
    "shape_twice_merged": _net(SHAPE + DATA + _field(7, 2, _field(1, 0, _varint(1)))),
    "blobs_field_as_varint": _net(SHAPE + DATA, layer_extra=_field(7, 0, _varint(5))),
}


@pytest.mark.parametrize("name", sorted(READ_IN_PLACE))
def test_what_protobuf_accepts_outside_the_values_is_read_in_place(name):
    data = READ_IN_PLACE[name]
    net = protobuf_layers(data)
    assert net is not None
    got = weights.parse_in_place(data)  # no Deferred
    assert disagreement(data) is None
    assert [layer for layer, _ in got] == [layer.name for layer in net.layer]
    assert [b.shape for b in got[0][1]] == [tuple(b.shape.dim) for b in net.layer[0].blobs]


def test_nesting_depth_is_protobufs():
    """Groups nested in a layer's parameters: protobuf's depth limit decides, on the fast path too."""
    deepest_read = None
    for depth in (10, 90, 95, 96, 97, 98, 99, 100, 101, 150, 400):
        data = _net(SHAPE + DATA, layer_extra=_field(106, 2, _groups(depth)))
        accepted = protobuf_layers(data) is not None
        assert disagreement(data) is None
        if accepted:
            deepest_read = depth
            assert weights.parse_in_place(data)[0][0] == "conv"
        else:
            with pytest.raises(weights.Deferred):
                weights.parse_in_place(data)
    assert deepest_read is not None and deepest_read < 400

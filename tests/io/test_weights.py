"""read_weights (framing-only caffemodel reader) gives exactly what protobuf's parser gives."""

from __future__ import annotations

import glob
import struct

import numpy as np
import pytest

from caffe_compat.errors import ParseError
from caffe_compat.io import read_net
from caffe_compat.io.weights import StoredBlob, from_netparameter, read_weights
from caffe_compat.proto import caffe_pb2
from tests.conftest import FIXTURES

CAFFEMODELS = sorted(glob.glob(str(FIXTURES / "**" / "*.caffemodel"), recursive=True))


def assert_same(fast, slow):
    assert [name for name, _ in fast] == [name for name, _ in slow]
    for (name, blobs), (_, expected) in zip(fast, slow):
        assert len(blobs) == len(expected), name
        for got, want in zip(blobs, expected):
            assert (got.shape, got.legacy, got.values.dtype) == (want.shape, want.legacy, want.values.dtype), name
            np.testing.assert_array_equal(got.values, want.values)
            assert (got.diff is None) == (want.diff is None), name
            if got.diff is not None:
                assert got.diff.dtype == want.diff.dtype, name
                np.testing.assert_array_equal(got.diff, want.diff)


@pytest.mark.parametrize("path", CAFFEMODELS, ids=lambda p: p.split("fixtures/", 1)[-1])
def test_fixture_caffemodels_match_protobuf(path):
    assert_same(read_weights(path), from_netparameter(read_net(path)))


def test_published_model_matches_protobuf_and_is_read_in_place(nsfw_dir):
    path = nsfw_dir / "resnet_50_1by2_nsfw.caffemodel"
    fast = read_weights(path)
    assert_same(fast, from_netparameter(read_net(path)))
    assert len(fast) == 245 and sum(b.values.size for _, blobs in fast for b in blobs) > 5_000_000
    values = fast[1][1][0].values
    assert not values.flags.writeable  # a view of the mapped file, not a copy
    with pytest.raises(ValueError):
        values[0] = 1.0


def _key(field: int, wire: int) -> bytes:
    return _varint(field << 3 | wire)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append(value & 0x7F | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


def _delimited(field: int, payload: bytes) -> bytes:
    return _key(field, 2) + _varint(len(payload)) + payload


def _write(tmp_path, data: bytes, name="m.caffemodel"):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_protobuf_merge_rules_are_kept(tmp_path):
    """Split packed runs concatenate, shapes merge, the last name wins, double_data beats data, a blob
    without data is empty, legacy dims are sign-extended int32 — each compared with protobuf's parse."""
    floats = struct.pack("<3f", 1.5, -2.0, 3.25)
    blob_split = (_delimited(7, _delimited(1, _varint(2)))               # shape { dim: 2 }
                  + _delimited(5, floats[:8]) + _delimited(5, floats[8:])  # data in two runs
                  + _delimited(7, _delimited(1, _varint(1))))              # shape { dim: 1 } merges
    blob_double = _delimited(5, floats) + _delimited(8, struct.pack("<3d", 0.1, 0.2, 0.3))
    blob_legacy = (_key(1, 0) + _varint(1) + _key(2, 0) + _varint((1 << 64) - 3)
                   + _key(4, 0) + _varint(2) + _delimited(5, floats[:8]))
    layer = (_delimited(1, b"first") + _delimited(2, b"Convolution") + _delimited(7, blob_split)
             + _delimited(7, blob_double) + _delimited(1, "zweite-ß".encode()) + _delimited(7, blob_legacy)
             + _delimited(7, b""))
    net = _delimited(1, b"net") + _delimited(100, layer) + _delimited(100, _delimited(1, b"empty"))
    path = _write(tmp_path, net)
    fast = read_weights(path)
    assert_same(fast, from_netparameter(read_net(path)))
    name, blobs = fast[0]
    assert name == "zweite-ß" and [b.shape for b in blobs] == [(2, 1), (), (1, -3, 0, 2), ()]
    assert blobs[1].values.dtype == np.float64 and blobs[2].legacy
    np.testing.assert_array_equal(blobs[0].values, [1.5, -2.0, 3.25])


@pytest.mark.parametrize("case", ["unpacked", "v1", "text"])
def test_other_encodings_go_through_protobuf(tmp_path, case):
    if case == "unpacked":  # data = 5 as single fixed32 values: valid protobuf, not what Caffe writes
        blob = _key(5, 5) + struct.pack("<f", 0.5) + _key(5, 5) + struct.pack("<f", -1.0)
        path = _write(tmp_path, _delimited(100, _delimited(1, b"a") + _delimited(7, blob)))
        expected = [("a", [StoredBlob((), False, np.array([0.5, -1.0], np.float32))])]
    elif case == "v1":  # legacy `layers` are upgraded first, like Caffe
        path = FIXTURES / "nets" / "googlenet_small_v1" / "weights_v1.caffemodel"
        expected = from_netparameter(read_net(path))
        assert expected and any(blobs for _, blobs in expected)
    else:
        net = caffe_pb2.NetParameter()
        net.layer.add(name="t").blobs.add(data=[1.0, 2.0]).shape.dim.append(2)
        path = tmp_path / "text.caffemodel"
        from google.protobuf import text_format
        path.write_text(text_format.MessageToString(net))
        expected = [("t", [StoredBlob((2,), False, np.array([1.0, 2.0], np.float32))])]
    assert_same(read_weights(path), expected)


@pytest.mark.parametrize("damage", ["truncated", "bad_length", "missing", "empty"])
def test_damaged_files_raise_protobufs_error_naming_the_file(tmp_path, damage):
    layer = _delimited(1, b"a") + _delimited(7, _delimited(5, struct.pack("<4f", 1, 2, 3, 4)))
    good = _delimited(100, layer)
    if damage == "missing":
        path = tmp_path / "nowhere.caffemodel"
        with pytest.raises(ParseError, match="nowhere.caffemodel: no such file"):
            read_weights(path)
        return
    if damage == "empty":  # an empty message is a valid, empty net
        assert read_weights(_write(tmp_path, b"")) == []
        return
    data = good[:-3] if damage == "truncated" else _key(100, 2) + _varint(len(layer) + 50) + layer
    path = _write(tmp_path, data, f"{damage}.caffemodel")
    with pytest.raises(ParseError, match=f"{damage}.caffemodel: not a valid binary NetParameter"):
        read_weights(path)


def test_a_caffemodel_of_hundreds_of_megabytes_round_trips(tmp_path):
    """A 268 MB caffemodel (one 8192 x 8192 InnerProduct, like VGG's fc6 at 400 MB) is written by
    save_caffemodel and read back, through read_weights, protobuf and load_net, to the same values."""
    import torch

    from caffe_compat import load_net

    proto = ('layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 8192 } } }\n'
             'layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 8192 } }\n')
    net = load_net(proto)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        net.params["ip"][0].copy_(torch.rand(8192, 8192, generator=generator))
        net.params["ip"][1].copy_(torch.rand(8192, generator=generator))
    path = tmp_path / "big.caffemodel"
    net.save_caffemodel(path)
    assert path.stat().st_size > 268_000_000
    (name, (weight, bias)), = [entry for entry in read_weights(path) if entry[1]]
    assert name == "ip" and weight.shape == (8192, 8192) and bias.shape == (8192,)
    np.testing.assert_array_equal(weight.values, net.params["ip"][0].detach().numpy().ravel())
    stored = [layer for layer in read_net(path).layer if layer.blobs][0]
    assert list(stored.blobs[0].shape.dim) == [8192, 8192]
    np.testing.assert_array_equal(np.asarray(stored.blobs[1].data, dtype=np.float32), net.params["ip"][1].detach().numpy())
    again = load_net(proto, path)
    assert torch.equal(again.params["ip"][0], net.params["ip"][0]) and torch.equal(again.params["ip"][1], net.params["ip"][1])


def test_over_protobufs_2gb_limit_is_a_named_error(monkeypatch):
    """protobuf cannot parse one message over 2 GB: the error names the file and the limit (the limit is
    lowered here so that the test needs no 2 GB file)."""
    from caffe_compat.io import protofiles

    path = CAFFEMODELS[0]
    monkeypatch.setattr(protofiles, "PROTOBUF_LIMIT", 100)
    with pytest.raises(ParseError, match=r"caffemodel: \d+ bytes exceed protobuf's 2 GB message limit"):
        read_net(path)


def test_packed_float_writer_equals_protobufs_own_extend():
    from caffe_compat.io.blobs import set_packed_floats

    values = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    for field in ("data", "diff"):
        ours, theirs = caffe_pb2.BlobProto(), caffe_pb2.BlobProto()
        ours.shape.dim.extend([10, 100])
        theirs.shape.dim.extend([10, 100])
        set_packed_floats(ours, values, field)
        getattr(theirs, field).extend(values)
        assert ours.SerializeToString() == theirs.SerializeToString()
    empty = caffe_pb2.BlobProto()
    set_packed_floats(empty, np.zeros(0))
    assert empty.SerializeToString() == b""


def test_stored_diffs_are_read_like_protobuf(tmp_path):
    """A snapshot_diff: true snapshot carries each blob's diff (BlobProto field 6, packed float; 9, packed
    double), which Caffe's Blob::FromProto copies too (double_diff when present); the fast reader read neither."""
    packed = lambda field, fmt, values: _delimited(field, struct.pack(f"<{len(values)}{fmt}", *values))  # noqa: E731
    shape = _delimited(7, _delimited(1, _varint(3)))
    float_diff = shape + packed(5, "f", [1, 2, 3]) + packed(6, "f", [0.5]) + packed(6, "f", [0.25, -1])
    double_diff = shape + packed(5, "f", [1, 2, 3]) + packed(6, "f", [9, 9, 9]) + packed(9, "d", [0.1, 0.2, 0.3])
    no_diff = shape + packed(5, "f", [1, 2, 3]) + _delimited(6, b"")
    layer = _delimited(1, b"a") + _delimited(7, float_diff) + _delimited(7, double_diff) + _delimited(7, no_diff)
    path = _write(tmp_path, _delimited(100, layer))
    fast = read_weights(path)
    assert_same(fast, from_netparameter(read_net(path)))
    first, second, third = fast[0][1]
    np.testing.assert_array_equal(first.diff, np.array([0.5, 0.25, -1], np.float32))
    assert second.diff.dtype == np.float64 and second.diff.tolist() == [0.1, 0.2, 0.3]
    assert third.diff is None

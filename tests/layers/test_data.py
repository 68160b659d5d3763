"""Input, DummyData and MemoryData: shapes, fillers, and MemoryData's batch cycling checked against a real
Caffe run (the sgd_iter_size2 solver fixture feeds a MemoryData layer with set_input_arrays)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from google.protobuf import text_format

from caffe_compat.errors import DataError, FormatError, ShapeMismatchError
from caffe_compat.layers import layer_class
from caffe_compat.net import CaffeNet
from caffe_compat.proto import caffe_pb2
from tests.conftest import fixture_path


def _layer(text: str):
    param = text_format.Parse(text, caffe_pb2.LayerParameter())
    return layer_class(param)(param, [], "test")


def test_input_shapes_and_zero_output():
    layer = _layer('name: "in" type: "Input" top: "a" top: "b" input_param { shape { dim: 2 dim: 3 } }')
    assert layer.output_shapes() == [(2, 3), (2, 3)]
    a, b = layer()
    assert a.shape == (2, 3) and torch.count_nonzero(a) == 0 and b.shape == (2, 3)
    with pytest.raises(FormatError, match="once per top"):
        _layer('name: "in" type: "Input" top: "a" top: "b" top: "c" input_param { shape { dim: 1 } shape { dim: 2 } }')


def test_dummy_data_constant_once_random_refilled():
    layer = _layer('name: "d" type: "DummyData" top: "c" top: "g" dummy_data_param { '
                   'data_filler { type: "constant" value: 2.5 } data_filler { type: "gaussian" std: 3 } '
                   'shape { dim: 4 dim: 2 } shape { dim: 1000 } }')
    layer.fill(torch.Generator().manual_seed(0))
    c1, g1 = layer()
    c2, g2 = layer()
    assert torch.all(c1 == 2.5) and torch.equal(c1, c2)
    assert not torch.equal(g1, g2)  # a non-constant filler refills at every forward, as in Caffe
    assert 2.7 < float(g1.std()) < 3.3
    legacy = _layer('name: "d" type: "DummyData" top: "x" dummy_data_param { num: 2 channels: 3 height: 4 width: 5 }')
    (x,) = legacy()
    assert x.shape == (2, 3, 4, 5) and torch.count_nonzero(x) == 0  # no filler: constant 0


def test_memory_data_cycles_and_wraps_like_caffe():
    layer = _layer('name: "m" type: "MemoryData" top: "data" top: "label" '
                   'memory_data_param { batch_size: 2 channels: 1 height: 1 width: 2 }')
    with pytest.raises(DataError, match="set_input_arrays"):
        layer()
    data = np.arange(12, dtype=np.float32).reshape(6, 1, 1, 2)
    labels = np.arange(6, dtype=np.float32)
    layer.set_input_arrays(data, labels.reshape(6, 1, 1, 1))
    served = [layer() for _ in range(4)]
    assert {tuple(s[1].shape) for s in served} == {(2, 1, 1, 1)}  # Caffe's Forward_cpu: (batch_size, 1, 1, 1)
    assert [s[1].reshape(-1).tolist() for s in served] == [[0, 1], [2, 3], [4, 5], [0, 1]]
    assert torch.equal(served[3][0], torch.from_numpy(data[:2]))
    with pytest.raises(ShapeMismatchError, match="multiple of batch_size 2"):
        layer.set_input_arrays(data[:3], labels[:3])
    with pytest.raises(ShapeMismatchError, match="n × 1 × 1 × 2"):
        layer.set_input_arrays(np.zeros((2, 1, 2, 1), np.float32), labels[:2])


def test_memory_data_net_matches_caffe_loss():
    directory = fixture_path("solvers/sgd_iter_size2")
    net = CaffeNet(str(directory / "net.prototxt"), phase="train", weights=str(directory / "init.caffemodel"))
    inputs = np.load(directory / "inputs.npz")
    net.layer("data").set_input_arrays(inputs["data"].reshape(-1, 3, 10, 10), inputs["label"].reshape(-1))
    first = net()
    second = net()  # iteration 0 ran sub-batches 0 and 1; Caffe's loss top then holds sub-batch 1's loss
    np.testing.assert_array_equal(second["data"].numpy(), inputs["data"][0, 1])
    np.testing.assert_array_equal(first["label"].numpy(), inputs["label"][0, 0].reshape(-1, 1, 1, 1))
    expected = float(np.load(directory / "trajectory.npz")["loss_blob"][0])
    assert float(second["loss"].detach()) == pytest.approx(expected, rel=1e-5)
    fed = net(data=torch.from_numpy(inputs["data"][0, 1]), label=torch.from_numpy(inputs["label"][0, 1]))
    assert float(fed["loss"].detach()) == pytest.approx(expected, rel=1e-5)  # kwargs replace the layer's arrays


def test_memory_data_needs_exactly_two_tops_like_caffe():
    """Caffe's MemoryDataLayer declares ``ExactNumTopBlobs() == 2`` (data and label): one top fails the
    layer's setup check; before, ours accepted a data-only MemoryData."""
    params = 'memory_data_param { batch_size: 2 channels: 1 height: 1 width: 2 }'
    with pytest.raises(FormatError, match=r"'m'.*needs 2 top blob\(s\), got 1"):
        _layer(f'name: "m" type: "MemoryData" top: "data" {params}')
    layer = _layer(f'name: "m" type: "MemoryData" top: "data" top: "label" {params}')
    assert layer.output_shapes() == [(2, 1, 1, 2), (2,)]

"""caffe.NetSpec / layers / params / to_proto: the NetParameter equals the one Caffe's net_spec builds
for the same calls (hand-written expected prototxt), and the nets it writes build and run."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from google.protobuf import text_format

from caffe_compat.errors import FormatError
from caffe_compat.net import CaffeNet
from caffe_compat.proto import caffe_pb2
from caffe_compat.pycaffe.net_spec import (NetSpec, NotATopError, UnknownFieldError, layers as L, params as P,
                                           param_message_of, to_proto)


def _lenet(batch: int) -> NetSpec:
    n = NetSpec()
    n.data, n.label = L.DummyData(shape=[dict(dim=[batch, 1, 28, 28]), dict(dim=[batch, 1, 1, 1])],
                                  transform_param=dict(scale=1. / 255), ntop=2)
    n.conv1 = L.Convolution(n.data, kernel_size=5, num_output=20, weight_filler=dict(type="xavier"),
                            param=[dict(lr_mult=1), dict(lr_mult=2, decay_mult=0)])
    n.pool1 = L.Pooling(n.conv1, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    n.ip1 = L.InnerProduct(n.pool1, num_output=50, weight_filler=dict(type="xavier"))
    n.relu1 = L.ReLU(n.ip1, in_place=True)
    n.ip2 = L.InnerProduct(n.relu1, num_output=10, weight_filler=dict(type="xavier"))
    n.accuracy = L.Accuracy(n.ip2, n.label, include=dict(phase=caffe_pb2.TEST))
    n.loss = L.SoftmaxWithLoss(n.ip2, n.label, loss_weight=0.5)
    return n


LENET = """
layer { name: "data" type: "DummyData" top: "data" top: "label"
        transform_param { scale: 0.00392156886 }
        dummy_data_param { shape { dim: 4 dim: 1 dim: 28 dim: 28 } shape { dim: 4 dim: 1 dim: 1 dim: 1 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
        param { lr_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
        convolution_param { num_output: 20 kernel_size: 5 weight_filler { type: "xavier" } } }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
        pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "ip1" type: "InnerProduct" bottom: "pool1" top: "ip1"
        inner_product_param { num_output: 50 weight_filler { type: "xavier" } } }
layer { name: "relu1" type: "ReLU" bottom: "ip1" top: "ip1" }
layer { name: "ip2" type: "InnerProduct" bottom: "ip1" top: "ip2"
        inner_product_param { num_output: 10 weight_filler { type: "xavier" } } }
layer { name: "accuracy" type: "Accuracy" bottom: "ip2" bottom: "label" top: "accuracy"
        include { phase: TEST } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip2" bottom: "label" top: "loss" loss_weight: 0.5 }
"""


def _parse(text: str) -> caffe_pb2.NetParameter:
    return text_format.Parse(text, caffe_pb2.NetParameter())


def test_lenet_equals_the_hand_written_prototxt():
    proto = _lenet(4).to_proto()
    assert proto == _parse(LENET)
    assert str(proto) == str(_parse(LENET))  # same field order as protobuf prints Caffe's message
    assert proto.layer[4].bottom == proto.layer[4].top == ["ip1"]  # in_place


def test_lenet_builds_and_runs_in_both_phases():
    proto = _lenet(4).to_proto()
    train, test = CaffeNet(proto, phase="train"), CaffeNet(proto, phase="test")
    assert [s.name for s in train.steps] == ["data", "conv1", "pool1", "ip1", "relu1", "ip2", "loss"]
    assert [s.name for s in test.steps] == ["data", "label_data_1_split", "conv1", "pool1", "ip1", "relu1", "ip2", "ip2_ip2_0_split",
                                            "accuracy", "loss"]
    assert train.loss_weights == {"loss": 0.5}
    conv = train.layer("conv1").caffe_blobs()
    assert (conv[0].lr_mult, conv[1].lr_mult, conv[1].decay_mult) == (1.0, 2.0, 0.0)
    blobs = train(data=torch.zeros(4, 1, 28, 28), label=torch.zeros(4, 1, 1, 1))
    assert tuple(blobs["ip2"].shape) == (4, 10)
    # all-zero input: ip2 is its biases (0), so the softmax is uniform: loss = ln 10
    assert float(blobs["loss"].detach()) == pytest.approx(np.log(10), rel=1e-6)


def test_anonymous_lenet_gets_caffes_automatic_names():
    data, label = L.DummyData(shape=[dict(dim=[2, 1, 28, 28]), dict(dim=[2, 1, 1, 1])], ntop=2)
    conv1 = L.Convolution(data, kernel_size=5, num_output=20)
    pool1 = L.Pooling(conv1, kernel_size=2, stride=2, pool=P.Pooling.MAX)
    conv2 = L.Convolution(pool1, kernel_size=5, num_output=50)
    ip1 = L.InnerProduct(conv2, num_output=500)
    relu1 = L.ReLU(ip1, in_place=True)
    ip2 = L.InnerProduct(relu1, num_output=10)
    proto = L.SoftmaxWithLoss(ip2, label).to_proto()
    assert [(l.name, list(l.bottom), list(l.top)) for l in proto.layer] == [
        ("DummyData1", [], ["DummyData1", "DummyData2"]),
        ("Convolution1", ["DummyData1"], ["Convolution1"]),
        ("Pooling1", ["Convolution1"], ["Pooling1"]),
        ("Convolution2", ["Pooling1"], ["Convolution2"]),
        ("InnerProduct1", ["Convolution2"], ["InnerProduct1"]),
        ("ReLU1", ["InnerProduct1"], ["InnerProduct1"]),
        ("InnerProduct2", ["InnerProduct1"], ["InnerProduct2"]),
        ("SoftmaxWithLoss1", ["InnerProduct2", "DummyData2"], ["SoftmaxWithLoss1"]),
    ]
    assert len(CaffeNet(proto).steps) == 8


def test_mixed_naming_counts_per_type_in_serialisation_order():
    n = NetSpec()
    n.data = L.Input(shape=dict(dim=[1, 3]))
    a = L.ReLU(n.data)
    b = L.ReLU(n.data)
    n.out = L.Eltwise(a, b, L.Sigmoid(a), operation=P.Eltwise.SUM)
    proto = n.to_proto()
    assert [(l.name, l.type, list(l.bottom)) for l in proto.layer] == [
        ("data", "Input", []), ("ReLU1", "ReLU", ["data"]), ("ReLU2", "ReLU", ["data"]),
        ("Sigmoid1", "Sigmoid", ["ReLU1"]), ("out", "Eltwise", ["ReLU1", "ReLU2", "Sigmoid1"])]
    assert proto.layer[4].eltwise_param.operation == caffe_pb2.EltwiseParameter.SUM == P.Eltwise.SUM == 1
    x = torch.tensor([[-1.0, 0.5, 2.0]])
    out = CaffeNet(proto)(data=x)["out"]
    torch.testing.assert_close(out, 2 * x.clamp(min=0) + torch.sigmoid(x.clamp(min=0)))


def test_zero_tops_and_name_override_and_single_values_for_repeated_fields():
    n = NetSpec()
    n.data, n.data2 = L.DummyData(shape=dict(dim=3), ntop=2)
    n.silence_data = L.Silence(n.data, ntop=0)
    L.Silence(n.data2, ntop=0)  # never assigned nor reached: not part of the net
    n.p = L.Power(n.data2, power=2, name="square", propagate_down=False)
    proto = n.to_proto()
    assert proto == _parse("""
        layer { name: "data" type: "DummyData" top: "data" top: "data2" dummy_data_param { shape { dim: 3 } } }
        layer { name: "silence_data" type: "Silence" bottom: "data" }
        layer { name: "square" type: "Power" bottom: "data2" top: "p" propagate_down: false
                power_param { power: 2 } }""")
    anon = to_proto(L.Silence(*L.DummyData(shape=dict(dim=3), ntop=2), ntop=0))
    assert [l.name for l in anon.layer] == ["DummyData1", "Silence1"]
    assert list(anon.layer[1].bottom) == ["DummyData1", "DummyData2"]


def test_param_message_comes_from_the_ports_fact_then_caffes_convention():
    assert param_message_of("Convolution") == "convolution_param"
    assert param_message_of("Deconvolution") == "convolution_param"  # the port's fact (not <type>_param)
    assert param_message_of("Python") == "python_param"  # no port keyed "Python": the convention
    assert param_message_of("WindowData") == "window_data_param"  # its port names it (the convention agrees)
    assert param_message_of("Silence") is None
    n = NetSpec()
    n.data = L.Input(shape=dict(dim=[1, 2, 3, 3]))
    n.up = L.Deconvolution(n.data, num_output=4, kernel_size=2, stride=2, bias_term=False)
    n.py = L.Python(n.up, module="my_module", layer="MyLayer", param_str="k: 1")
    proto = n.to_proto()
    assert proto.layer[1].convolution_param == text_format.Parse(
        "num_output: 4 kernel_size: 2 stride: 2 bias_term: false", caffe_pb2.ConvolutionParameter())
    assert (proto.layer[2].python_param.module, proto.layer[2].python_param.layer,
            proto.layer[2].python_param.param_str) == ("my_module", "MyLayer", "k: 1")


def test_errors_are_typed_and_name_the_layer():
    data = L.DummyData(ntop=2)
    with pytest.raises(TypeError, match=r"^Silence input 0 is not a Top \(type is <class 'tuple'>\)$"):
        L.Silence(data, ntop=0)
    with pytest.raises(NotATopError):
        L.ReLU(np.zeros(3))
    n = NetSpec()
    n.data = L.Input(shape=dict(dim=[1]))
    n.bad = L.ReLU(n.data, kernel_size=3)
    with pytest.raises(UnknownFieldError, match=r"layer 'bad' \(ReLU\): keyword 'kernel_size'") as err:
        n.to_proto()
    assert isinstance(err.value, (FormatError, AttributeError))
    n.bad = L.Convolution(n.data, num_output="many")
    with pytest.raises(FormatError, match="layer 'bad'.*num_output"):
        n.to_proto()
    with pytest.raises(AttributeError, match="no top 'missing'"):
        n.missing


def test_repeated_message_fields_take_messages_as_caffes_extend_does():
    """Caffe's assign_proto extends a repeated field with a list that is not of dicts (``param=[ParamSpec]``)
    and wraps a single value in a list first (``include=NetStateRule``): the messages are copied in."""
    n = NetSpec()
    n.data = L.Input(shape=[caffe_pb2.BlobShape(dim=[1, 2, 3, 3])])
    weight, bias = caffe_pb2.ParamSpec(lr_mult=1), caffe_pb2.ParamSpec(lr_mult=2, decay_mult=0)
    n.conv = L.Convolution(n.data, num_output=4, kernel_size=1, param=[weight, bias],
                           include=caffe_pb2.NetStateRule(phase=caffe_pb2.TEST))
    proto = n.to_proto()
    assert proto == _parse("""
        layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 2 dim: 3 dim: 3 } } }
        layer { name: "conv" type: "Convolution" bottom: "data" top: "conv" include { phase: TEST }
                param { lr_mult: 1 } param { lr_mult: 2 decay_mult: 0 }
                convolution_param { num_output: 4 kernel_size: 1 } }""")
    weight.lr_mult = 5  # copied into the NetParameter, as protobuf's extend copies
    assert proto.layer[1].param[0].lr_mult == 1
    n.conv = L.Convolution(n.data, num_output=4, kernel_size=1, param=[caffe_pb2.NetStateRule()])
    with pytest.raises(FormatError, match="layer 'conv'.*'param'"):
        n.to_proto()

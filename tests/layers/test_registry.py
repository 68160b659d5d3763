"""The ports are the one home of their types' facts: every port declares them, and the tables other
modules use are derived from the registry (a new port that forgets a fact fails here, naming it)."""

from __future__ import annotations

import re

import pytest

from caffe_compat.errors import FormatError
from caffe_compat.layers.facts import ANY
from caffe_compat.layers.registry import (CAFFE_1_0_UNPORTED, CaffeLayer, caffe_1_0_types, couples_batch_types,
                                          registered_ports)
from caffe_compat.proto import caffe_pb2

#: BVLC Caffe 1.0's LayerRegistry (the REGISTER_LAYER_CLASS / REGISTER_LAYER_CREATOR names of its src/caffe/layers).
CAFFE_1_0 = {
    "AbsVal", "Accuracy", "ArgMax", "BatchNorm", "BatchReindex", "Bias", "BNLL", "Concat", "ContrastiveLoss",
    "Convolution", "Crop", "Data", "Deconvolution", "Dropout", "DummyData", "Eltwise", "ELU", "Embed",
    "EuclideanLoss", "Exp", "Filter", "Flatten", "HDF5Data", "HDF5Output", "HingeLoss", "Im2col", "ImageData",
    "InfogainLoss", "InnerProduct", "Input", "Log", "LRN", "LSTM", "LSTMUnit", "MemoryData",
    "MultinomialLogisticLoss", "MVN", "Parameter", "Pooling", "Power", "PReLU", "Python", "Reduction", "ReLU",
    "Reshape", "RNN", "Scale", "Sigmoid", "SigmoidCrossEntropyLoss", "Silence", "Slice", "Softmax",
    "SoftmaxWithLoss", "Split", "SPP", "TanH", "Threshold", "Tile", "WindowData"}


def test_the_caffe_1_0_type_list_derived_from_the_ports_is_caffes():
    assert caffe_1_0_types() == CAFFE_1_0


def test_no_unported_type_has_a_port():
    ported = sorted(set(CAFFE_1_0_UNPORTED) & set(registered_ports()))
    assert not ported, f"{ported} now have ports: remove them from CAFFE_1_0_UNPORTED"


@pytest.mark.parametrize("key", sorted(registered_ports()))
def test_every_port_declares_its_facts(key):
    port = registered_ports()[key]
    assert port.bottoms is not ANY, f"{key}: declare bottoms = BlobCount(...) (Caffe's ExactNumBottomBlobs etc.)"
    assert port.tops is not ANY, f"{key}: declare tops = BlobCount(...)"
    assert port.infer.__func__ is not CaffeLayer.infer.__func__, f"{key}: define the shape rule infer()"
    assert vars(port).get("__doc__") or port.__doc__, f"{key}: document the formula and the Caffe quirk"


def test_the_batch_coupling_layers_are_the_pair_and_batch_loss_layers():
    assert set(couples_batch_types()) == {
        "CosineSimilarityBatch", "FAPPYLoss", "BatchContrastiveLoss", "LiftedStructSimilaritySoftmaxLoss",
        "HistogramLoss", "TripletLoss", "BinomialDevianceLoss", "MultiSimilarityLoss", "RAWLoss", "MarginLoss",
        "FastAPLoss", "SmoothAPLoss", "Python:distribution_loss_layer.DistributionLossLayer"}


def test_blob_counts_are_checked_once_for_every_port_with_one_message():
    param = caffe_pb2.LayerParameter(name="x", type="InnerProduct", bottom=["a", "b"], top=["y"])
    param.inner_product_param.num_output = 2
    with pytest.raises(FormatError, match=r"layer 'x' \(InnerProduct\): needs 1 bottom blob\(s\), got 2"):
        registered_ports()["InnerProduct"](param, [(2, 3), (2, 3)])
    param = caffe_pb2.LayerParameter(name="p", type="Pooling", bottom=["a"], top=["y", "m", "z"])
    param.pooling_param.kernel_size = 2
    with pytest.raises(FormatError, match=r"layer 'p' \(Pooling\): needs 1 to 2 top blob\(s\), got 3"):
        registered_ports()["Pooling"](param, [(1, 1, 4, 4)])


def test_the_readme_table_lists_every_registered_type():
    """The README's "Supported layers" table names every registered type (the docs are checked against
    the registry, not the other way round)."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Supported layers", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[2] for line in section.splitlines() if line.startswith("| ") and "`" in line]
    listed = {word for row in rows for word in re.findall(r"[A-Za-z0-9]+", row)}
    missing = sorted(key for key in registered_ports() if not key.startswith("Python:") and key not in listed)
    assert not missing, f"README's Supported layers table lacks {missing}"


def test_parameter_messages_are_layer_parameter_fields():
    fields = set(caffe_pb2.LayerParameter.DESCRIPTOR.fields_by_name)
    messages = {key: port.param_message for key, port in registered_ports().items()}
    assert {m for m in messages.values() if m} <= fields
    assert messages["Convolution"] == messages["Deconvolution"] == "convolution_param"
    assert messages["InnerProduct"] == "inner_product_param" and messages["SPP"] == "spp_param"
    assert messages["TripletLoss"] == "metric_loss_param" and messages["ReLU"] == "relu_param"
    assert messages["Python:label_shuffling_layer.LabelShufflingLayer"] == "python_param"

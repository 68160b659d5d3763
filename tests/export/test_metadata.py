"""Preprocessing and export settings round-trip through the ONNX metadata_props; bad dicts are refused."""

from __future__ import annotations

import json

import onnx
import onnxruntime as ort
import pytest

from caffe_compat.errors import FormatError
from caffe_compat.export import cut_steps, export_onnx, read_metadata
from caffe_compat.net import load_net
from tests.export.helpers import TINY_PREPROCESSING, write_tiny_net


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_net(tmp_path_factory.mktemp("tiny"))


def test_given_preprocessing_round_trips_as_json_values(tiny, tmp_path):
    prototxt, weights = tiny
    path = export_onnx(prototxt, weights=weights, path=tmp_path / "m.onnx", normalize=True, opset=13,
                       preprocessing=TINY_PREPROCESSING)
    meta = read_metadata(path)
    assert meta["channel_order"] == "BGR" and meta["resize"] == [28, 28] and meta["crop_size"] == 24
    assert meta["mean_value"] == [104.0, 117.0, 123.0] and meta["scale"] == 1.0 / 64
    assert meta["input_blob"] == "data" and meta["input_shape"] == [3, 24, 24]
    assert meta["output_blob"] == "fc_embedding" and meta["embedding_dim"] == 16
    assert meta["normalize"] is True and meta["fp16"] is False and meta["batch"] == "dynamic" and meta["opset"] == 13
    assert meta["preprocessing_derived"] is False
    assert meta["source"] == {"net": "tiny_embedder", "prototxt": str(prototxt), "weights": str(weights),
                              "checkpoint": None}
    model = onnx.load(str(path))
    assert model.opset_import[0].version == 13
    # stored as plain JSON strings, readable by ONNX Runtime without caffe-compat
    custom = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).get_modelmeta().custom_metadata_map
    assert json.loads(custom["mean_value"]) == [104.0, 117.0, 123.0] and json.loads(custom["crop_size"]) == 24


def test_no_preprocessing_derives_the_input_size(tiny, tmp_path):
    prototxt, weights = tiny
    meta = read_metadata(export_onnx(prototxt, weights=weights, path=tmp_path / "m.onnx"))
    assert meta["resize"] == [24, 24] and meta["crop_size"] == 0 and meta["mean_value"] == []
    assert meta["scale"] == 1.0 and meta["channel_order"] == "BGR" and meta["preprocessing_derived"] is True


def test_cut_drops_the_loss_head_and_label_input(tiny, tmp_path):
    prototxt, _ = tiny
    net = load_net(str(prototxt))
    assert [s.name for s in cut_steps(net, "fc_embedding")] == ["data", "conv1", "relu1", "pool1", "fc_embedding"]
    model = onnx.load(str(export_onnx(prototxt, path=tmp_path / "m.onnx")))
    assert [i.name for i in model.graph.input] == ["data"] and [o.name for o in model.graph.output] == ["fc_embedding"]
    # cutting at an in-place blob keeps its in-place layer (pycaffe's post-ReLU value)
    assert [s.name for s in cut_steps(net, "conv1")] == ["data", "conv1", "relu1"]


@pytest.mark.parametrize("bad, message", [
    ({"crop_size": 20, "resize": 28}, r"yields 20x20 images, input blob 'data' is 24x24"),
    ({"resize": [30, 32]}, r"yields 30x32 images"),
    ({"crop_size": 24, "resize": 20}, r"resize \[20, 20\] is smaller than crop_size 24"),
    ({"crop_size": 24, "mean_value": [1, 2]}, r"mean_value needs 1 or 3 values, got 2"),
    ({"crop_size": 24, "channel_order": "BRG"}, r"channel_order must be 'BGR' or 'RGB'"),
    ({"crop_size": 24, "mirror": True}, r"unknown preprocessing keys \['mirror'\]"),
    ({"crop_size": 24, "input_blob": "image"}, r"names input blob 'image'.*reads 'data'"),
])
def test_bad_preprocessing_is_refused_and_nothing_written(tiny, tmp_path, bad, message):
    prototxt, weights = tiny
    with pytest.raises(FormatError, match=message):
        export_onnx(prototxt, weights=weights, path=tmp_path / "m.onnx", preprocessing=bad)
    assert list(tmp_path.iterdir()) == []


def test_read_metadata_refuses_a_foreign_model(tmp_path):
    graph = onnx.helper.make_graph([onnx.helper.make_node("Relu", ["x"], ["y"])], "g",
                                   [onnx.helper.make_tensor_value_info("x", 1, [1])],
                                   [onnx.helper.make_tensor_value_info("y", 1, [1])])
    path = tmp_path / "foreign.onnx"
    onnx.save(onnx.helper.make_model(graph), str(path))
    with pytest.raises(FormatError, match="not a caffe-compat embedder"):
        read_metadata(path)
    (tmp_path / "junk.onnx").write_bytes(b"\x00not a model")
    with pytest.raises(FormatError, match="junk.onnx: not a readable ONNX model"):
        read_metadata(tmp_path / "junk.onnx")

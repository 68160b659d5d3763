"""Shared helpers of the export tests: a tiny embedding net and ONNX graph inspection."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

TINY_PROTOTXT = """
name: "tiny_embedder"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 dim: 24 dim: 24 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 8 kernel_size: 3 stride: 2
    weight_filler { type: "xavier" } bias_filler { type: "constant" value: 0.1 } } }
layer { name: "relu1" type: "ReLU" bottom: "conv1" top: "conv1" }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
  pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 } }
layer { name: "fc_embedding" type: "InnerProduct" bottom: "pool1" top: "fc_embedding"
  inner_product_param { num_output: 16 weight_filler { type: "xavier" } } }
layer { name: "label" type: "Input" top: "label" input_param { shape { dim: 1 } } }
layer { name: "loss" type: "EuclideanLoss" bottom: "fc_embedding" bottom: "fc_embedding" top: "loss" }
"""

# 24x24 from a 28x28 resize with a centre crop; values scaled to about [-2, 2]
TINY_PREPROCESSING = {"channel_order": "BGR", "resize": 28, "crop_size": 24, "mean_value": [104.0, 117.0, 123.0],
                      "scale": 1.0 / 64, "input_blob": "data"}


def write_tiny_net(directory: Path) -> tuple[Path, Path]:
    """The tiny net's prototxt and a caffemodel of its seed-0 filler weights."""
    from caffe_compat.net import load_net

    prototxt = directory / "tiny.prototxt"
    prototxt.write_text(TINY_PROTOTXT)
    weights = directory / "tiny.caffemodel"
    load_net(str(prototxt)).save_caffemodel(weights)
    return prototxt, weights


def pool_nodes(path) -> list[dict]:
    """Attributes of every MaxPool / AveragePool node of an ONNX file."""
    model = onnx.load(str(path))
    found = []
    for node in model.graph.node:
        if node.op_type in ("MaxPool", "AveragePool"):
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            attrs["op_type"], attrs["node"] = node.op_type, node.name
            found.append(attrs)
    return found


def _ceil_mode_is_unambiguous(attrs: dict, spatial: list[int]) -> bool:
    """ONNX's ceil-mode size rule is read two ways (dropping, or not, a last window that would start in
    the right padding, as Caffe and PyTorch drop it); True when no such window arises, so both agree."""
    pads = attrs.get("pads", [0] * 2 * len(spatial))
    for axis, size in enumerate(spatial):
        k, s = attrs["kernel_shape"][axis], attrs.get("strides", [1] * len(spatial))[axis]
        begin, end = pads[axis], pads[axis + len(spatial)]
        count = -(-(size + begin + end - k) // s) + 1
        if (count - 1) * s >= size + begin:
            return False
    return True


def pool_input_shapes(path) -> dict:
    """Pool node name -> the shape of its input (ONNX shape inference)."""
    model = onnx.shape_inference.infer_shapes(onnx.load(str(path)))
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
              for v in [*model.graph.value_info, *model.graph.input]}
    return {n.name: shapes.get(n.input[0]) for n in model.graph.node if n.op_type in ("MaxPool", "AveragePool")}


def assert_caffe_pooling_form(path, prototxt=None) -> int:
    """Every pool node of ``path`` has windows no ONNX runtime can read otherwise: an AveragePool never has
    ceil_mode, nor implicit pads when it is a Caffe Pooling layer's (its padding is an explicit Pad node:
    ONNX's count_include_pad is not Caffe's divisor); a MaxPool has ceil_mode and pads only where both
    readings of ONNX's ceil-mode size rule agree.  Returns the number of Pooling-layer nodes (with
    ``prototxt``; every AveragePool counts as a Caffe layer's without it)."""
    pooling = None
    if prototxt is not None:
        from caffe_compat.net import load_net

        pooling = {s.module_key for s in load_net(str(prototxt)).steps if s.type == "Pooling"}
    inputs = pool_input_shapes(path)
    count = 0
    for attrs in pool_nodes(path):
        caffe_layer = pooling is None or attrs["node"].split("/")[1] in pooling
        count += caffe_layer
        if attrs["op_type"] == "MaxPool" and (attrs.get("ceil_mode", 0) or any(attrs.get("pads", [0]))):
            spatial = (inputs[attrs["node"]] or [])[2:]
            assert spatial and all(spatial) and _ceil_mode_is_unambiguous(attrs, spatial), (attrs, spatial)
            continue
        assert attrs.get("ceil_mode", 0) == 0, attrs
        if caffe_layer:
            assert not any(attrs.get("pads", [0])), attrs
    return count


def fixture_net_paths(name: str):
    """A fixture net's deploy prototxt and caffemodel (as str) and its Caffe blobs (``blobs.npz``)."""
    from tests.conftest import fixture_path

    return (str(fixture_path(f"nets/{name}/deploy.prototxt")), str(fixture_path(f"nets/{name}/weights.caffemodel")),
            np.load(fixture_path(f"nets/{name}/blobs.npz")))


def run_onnx(path, x):
    """The first output of the ONNX model at ``path`` on the CPU for the (float32) input ``x``."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: np.ascontiguousarray(x, dtype=np.float32)})[0]

"""Shape inference against the shapes real Caffe produced."""

from __future__ import annotations

import json

import numpy as np
import pytest

from caffe_compat.io import read_net
from caffe_compat.layers.geometry import pooled_size
from caffe_compat.net_shapes import infer_shapes
from tests.conftest import fixture_path


def test_pooled_size_caffe_rules():
    assert pooled_size(112, 3, 2) == 56           # ceil((112-3)/2)+1
    assert pooled_size(7, 2, 2, pad=1) == 4        # ceil(7/2)+1 = 5, but (5-1)*2 = 8 >= 7+1: clipped to 4
    assert pooled_size(8, 2, 2, pad=1) == 5        # (5-1)*2 = 8 < 8+1: the last window starts in the pad
    assert pooled_size(7, 3, 2, pad=1) == 4
    assert pooled_size(13, 3, 3) == 5              # partial window kept by ceil
    assert pooled_size(13, 3, 3, ceil_mode=False) == 4


@pytest.mark.parametrize("net_dir", ["layer_zoo", "layer_zoo_nondiff"])
def test_layer_zoo_shapes(net_dir):
    info = json.loads(fixture_path(f"{net_dir}/info.json").read_text())
    net = read_net(fixture_path(f"{net_dir}/deploy.prototxt"))
    blobs, _ = infer_shapes(net)
    checked = 0
    for name, shape in info["blob_shapes"].items():
        if "_split_" in name:
            continue
        assert blobs[name] == tuple(shape), name
        checked += 1
    assert checked >= 11


@pytest.mark.parametrize("net_dir,count", [("googlenet_small", 409_372), ("vgg_cnn_m_1024_small", 1_349_584)])
def test_reference_nets_shapes_and_parameter_counts(net_dir, count):
    net = read_net(fixture_path(f"nets/{net_dir}/deploy.prototxt"))
    blobs, table = infer_shapes(net)
    with np.load(fixture_path(f"nets/{net_dir}/grads.npz")) as grads:
        for key in grads.files:
            if key.startswith("param_diff:"):
                layer, index = key[len("param_diff:"):].rsplit(":", 1)
                entry = [t for t in table if t.name == layer][0]
                assert entry.param_shapes[int(index)] == grads[key].shape, key
    assert sum(int(np.prod(s)) for t in table for s in t.param_shapes) == count


def test_prelu_channel_shared_slope_is_a_0_axis_blob_like_caffes():
    """Caffe's PReLULayer stores the shared slope as Blob(vector<int>(0)): shape (), one value."""
    from caffe_compat.io.blobs import blob_shape

    net = read_net(fixture_path("layer_zoo/deploy.prototxt"))
    _, table = infer_shapes(net)
    inferred = {t.name: t.param_shapes for t in table}
    weights = {layer.name: layer for layer in read_net(fixture_path("layer_zoo/weights.caffemodel")).layer}
    assert inferred["prelu_shared"] == [()]
    assert inferred["prelu_ch"] == [(6,)]
    for name in ("prelu_shared", "prelu_ch"):
        assert [blob_shape(b) for b in weights[name].blobs] == inferred[name], name


def _net(layer: str, dims=(2, 6, 5, 5)) -> str:
    shape = " ".join(f"dim: {d}" for d in dims)
    return (f'layer {{ name: "data" type: "Input" top: "data" input_param {{ shape {{ {shape} }} }} }}\n'
            f'layer {{ name: "l" bottom: "data" top: "out" {layer} }}\n')


@pytest.mark.parametrize("layer, dims, message", [
    ('type: "Convolution" convolution_param { num_output: 4 kernel_size: 3 }', (2, 6, 5),
     "layer 'l' (Convolution): input 'data' has shape (2, 6, 5) (3 axes); expected 4 axes (N, C, H, W)"),
    ('type: "Deconvolution" convolution_param { num_output: 4 kernel_size: 3 }', (2, 6, 5, 5, 5),
     "layer 'l' (Deconvolution): input 'data' has shape (2, 6, 5, 5, 5) (5 axes); expected 4 axes"),
    ('type: "Convolution" convolution_param { num_output: 4 kernel_size: 3 group: 0 }', (2, 6, 5, 5),
     "layer 'l' (Convolution): convolution_param.group must be >= 1, got 0"),
    ('type: "Convolution" convolution_param { num_output: 4 kernel_size: 3 group: 4 }', (2, 6, 5, 5),
     "layer 'l' (Convolution): the input's 6 channels are not divisible by convolution_param.group 4"),
    ('type: "Convolution" convolution_param { num_output: 5 kernel_size: 3 group: 2 }', (2, 6, 5, 5),
     "layer 'l' (Convolution): convolution_param.num_output 5 is not divisible by convolution_param.group 2"),
    ('type: "Pooling" pooling_param { pool: MAX kernel_size: 2 }', (2, 6, 5),
     "layer 'l' (Pooling): input 'data' has shape (2, 6, 5) (3 axes); expected 4 axes"),
    ('type: "Reshape" reshape_param { shape { dim: 0 dim: -1 } axis: 9 }', (2, 6, 5),
     "layer 'l' (Reshape): reshape_param.axis 9 is out of range for the 3-axis input (2, 6, 5) (expected -4 to 3)"),
    ('type: "Reshape" reshape_param { shape { dim: -1 } axis: -5 }', (2, 6, 5),
     "reshape_param.axis -5 is out of range for the 3-axis input"),
    ('type: "Reshape" reshape_param { shape { dim: -1 } axis: 1 num_axes: 3 }', (2, 6, 5),
     "reshape_param.axis + num_axes = 4 is out of range for the 3-axis input"),
    ('type: "Reshape" reshape_param { shape { dim: 0 dim: 0 } axis: 2 }', (2, 6, 5),
     "reshape_param.shape dim 1 is 0, but the input (2, 6, 5) has no axis 3 to copy"),
    ('type: "Reshape" reshape_param { shape { dim: -1 dim: -1 } }', (2, 6, 5),
     "reshape_param.shape has more than one -1"),
    ('type: "Reshape" reshape_param { shape { dim: 7 dim: -1 } }', (2, 6, 5),
     "the input count 60 is not divisible by the product of the given dims (7)"),
    ('type: "Reshape" reshape_param { shape { dim: 7 dim: 3 } }', (2, 6, 5),
     "reshape_param.shape gives (7, 3) (21 values), the input (2, 6, 5) has 60"),
    ('type: "BatchNorm"', (5,), "layer 'l' (BatchNorm): input 'data' has shape (5,) (1 axes); expected at least 2"),
    ('type: "PReLU"', (5,), "layer 'l' (PReLU): input 'data' has shape (5,) (1 axes); expected at least 2"),
])
def test_invalid_layers_raise_format_error_naming_layer_and_field(layer, dims, message):
    from caffe_compat.errors import FormatError

    with pytest.raises(FormatError) as info:
        infer_shapes(read_net(_net(layer, dims)))
    assert message in str(info.value)


def test_reshape_rules_follow_caffe():
    """Caffe's ReshapeLayer examples: axis -1 appends after the last axis; 0 copies; -1 is inferred."""
    def top(layer, dims):
        return infer_shapes(read_net(_net(layer, dims)))[0]["out"]

    assert top('type: "Reshape" reshape_param { shape { dim: 1 } axis: -1 }', (2, 6, 5)) == (2, 6, 5, 1)
    assert top('type: "Reshape" reshape_param { shape { dim: 1 } axis: 3 }', (2, 6, 5)) == (2, 6, 5, 1)
    assert top('type: "Reshape" reshape_param { shape { dim: 0 dim: -1 } }', (2, 6, 5)) == (2, 30)
    split = 'type: "Reshape" reshape_param { shape { dim: 3 dim: 2 } axis: 1 num_axes: 1 }'
    assert top(split, (2, 6, 5)) == (2, 3, 2, 5)
    assert top('type: "Reshape" reshape_param { shape { } axis: 1 num_axes: 0 }', (2, 6, 5)) == (2, 6, 5)


def test_missing_bottom_is_a_format_error():
    from caffe_compat.errors import FormatError

    text = _net('type: "Eltwise"')  # one bottom; Caffe's EltwiseLayer has MinBottomBlobs 2
    with pytest.raises(FormatError, match=r"layer 'l' \(Eltwise\): needs at least 2 bottom blob\(s\), got 1"):
        infer_shapes(read_net(text))


SETUP_CHECKS = [
    ('layer { name: "a" type: "ReLU" bottom: "data" top: "r" }\n'
     'layer { name: "b" type: "Sigmoid" bottom: "data" top: "r" }',
     "layer 'b': top blob 'r' is produced by multiple sources (already produced by layer 'a')"),
    ('layer { name: "p" type: "Pooling" bottom: "data" top: "p" pooling_param { kernel_size: 9 pool: MAX round_mode: FLOOR } }',
     "layer 'p' (Pooling): kernel (9, 9) with pad (0, 0) does not fit the 5x5 input"),
    # PoolingLayer::LayerSetUp: CHECK(pad_h_ == 0 && pad_w_ == 0 && stride_h_ == 1 && stride_w_ == 1) under
    # global pooling (the shape rule, not only the port, now says so)
    ('layer { name: "p" type: "Pooling" bottom: "data" top: "p" pooling_param { global_pooling: true stride: 2 } }',
     "layer 'p' (Pooling): with global_pooling only pad 0 and stride 1 are allowed, got pad (0, 0) and stride (2, 2)"),
    ('layer { name: "p" type: "Pooling" bottom: "data" top: "p" pooling_param { global_pooling: true pad_h: 0 '
     'pad_w: 1 } }', "with global_pooling only pad 0 and stride 1 are allowed, got pad (0, 1) and stride (1, 1)"),
]


@pytest.mark.parametrize("layers,message", SETUP_CHECKS)
def test_caffes_setup_checks_are_format_errors(layers, message):
    """Caffe aborts these nets in Net::Init (a CHECK): inspect's inference names the layer instead."""
    from caffe_compat.errors import FormatError

    text = ('layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 dim: 5 dim: 5 } } }\n'
            + layers)
    with pytest.raises(FormatError) as info:
        infer_shapes(read_net(text))
    assert message in str(info.value)

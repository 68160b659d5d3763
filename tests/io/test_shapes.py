"""Shape inference against the shapes real Caffe produced."""

from __future__ import annotations

import json

import numpy as np
import pytest

from caffe_compat.io import infer_shapes, pooled_size, read_net
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

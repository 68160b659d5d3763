"""CaffeNet's inference path (no autograd): in-place prototxt layers overwrite their bottom as Caffe does,
memory-bound layers run in blocks of samples, and none of it changes a value, an input or a weight."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from google.protobuf import text_format

from caffe_compat import load_net
from caffe_compat.net import CaffeNet
from caffe_compat.proto import caffe_pb2
from tests.conftest import fixture_path


@pytest.mark.parametrize("directory", ["nets/googlenet_small", "nets/vgg_cnn_m_1024_small", "layer_zoo"])
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_inference_forward_equals_autograd_forward(directory, mode):
    net = load_net(str(fixture_path(f"{directory}/deploy.prototxt")),
                   str(fixture_path(f"{directory}/weights.caffemodel")))
    reference = np.load(fixture_path(f"{directory}/blobs.npz"))
    inputs = {name: torch.from_numpy(reference[name].copy()) for name in net.feedable_names}
    kept = {name: t.clone() for name, t in inputs.items()}
    weights = [t.clone() for t in net.state_dict().values()]
    with_grad = {name: t.detach().clone() for name, t in net(**inputs).items()}
    with (torch.no_grad() if mode == "no_grad" else torch.inference_mode()):
        without = net(**inputs)
    assert set(without) == set(with_grad)
    for name, value in with_grad.items():
        # equal, up to pow's last bit where a block of samples ends inside a SIMD vector (lrn_within)
        if value.numel():
            assert float((without[name] - value).abs().max()) <= 2.5e-7 * float(value.abs().max()), name
    for name, value in inputs.items():  # fed inputs are never written, even under an in-place first layer
        assert torch.equal(value, kept[name]), name
    for before, after in zip(weights, net.state_dict().values()):
        assert torch.equal(before, after)


def _net(text: str) -> CaffeNet:
    return CaffeNet(text_format.Parse(text, caffe_pb2.NetParameter()), seed=1)


SHARED_VIEW = """
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 4 dim: 4 } } }
layer { name: "relu_in" type: "ReLU" bottom: "data" top: "data" }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
        convolution_param { num_output: 2 kernel_size: 1 weight_filler { type: "gaussian" std: 1 } } }
layer { name: "flat" type: "Flatten" bottom: "conv" top: "flat" }
layer { name: "relu" type: "ReLU" bottom: "flat" top: "flat" }
"""


def test_in_place_layers_never_write_a_shared_blob_or_a_fed_input():
    net = _net(SHARED_VIEW)
    x = torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    x_before = x.clone()
    with_grad = {name: t.detach().clone() for name, t in net(data=x).items()}
    with torch.no_grad():
        blobs = net(data=x)
    assert torch.equal(x, x_before)  # the input itself is untouched ...
    assert torch.equal(blobs["data"], torch.relu(x_before))  # ... while the blob shows the in-place value
    # "flat" is a view of "conv": the ReLU on it must not run in place, so "conv" keeps its negatives
    assert (blobs["conv"] < 0).any()
    assert torch.equal(blobs["flat"], torch.relu(blobs["conv"].flatten(1)))
    for name, value in with_grad.items():
        assert torch.equal(blobs[name], value), name


def test_in_place_chain_writes_one_tensor_under_inference():
    text = """
    layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 5 dim: 5 } } }
    layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
            convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "gaussian" std: 1 } } }
    layer { name: "bn" type: "BatchNorm" bottom: "conv" top: "conv" }
    layer { name: "scale" type: "Scale" bottom: "conv" top: "conv"
            scale_param { bias_term: true filler { type: "uniform" } bias_filler { type: "uniform" } } }
    layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" relu_param { negative_slope: 0.1 } }
    """
    net = _net(text)
    bn = net.layer("bn")
    with torch.no_grad():
        bn.mean.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0]))
        bn.variance.copy_(torch.tensor([4.0, 1.0, 9.0, 0.25]))
        bn.scale_factor.fill_(2.0)
    x = torch.randn(2, 3, 5, 5, generator=torch.Generator().manual_seed(4))
    expected = net(data=x)["conv"].detach()
    with torch.inference_mode():
        first = net(data=x)["conv"]
        assert torch.equal(first, expected)
        # the folded BatchNorm statistics are cached; changing a stored blob must invalidate them
    with torch.no_grad():
        bn.variance.mul_(4.0)
    changed = net(data=x)["conv"].detach()
    with torch.no_grad():
        assert torch.equal(net(data=x)["conv"], changed)
    assert not torch.equal(changed, expected)

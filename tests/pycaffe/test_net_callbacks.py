"""The private members of ``caffe.Net`` that scripts reach for (``_blobs``, ``_blob_loss_weights``, ``_inputs``,
``_outputs``, ``_top_ids``, ``_bottom_ids``, ``_set_input_arrays``)."""

from __future__ import annotations

import numpy as np
import pytest

import caffe_compat as caffe
from caffe_compat.errors import CaffeCompatError, ShapeMismatchError

LAYERS = """
layer { name: 'conv' type: 'Convolution' bottom: 'data' top: 'conv'
  convolution_param { num_output: 3 kernel_size: 2 weight_filler { type: 'gaussian' std: 0.5 }
                      bias_filler { type: 'constant' value: -0.1 } } }
layer { name: 'relu' type: 'ReLU' bottom: 'conv' top: 'conv' }
layer { name: 'ip' type: 'InnerProduct' bottom: 'conv' top: 'ip'
  inner_product_param { num_output: 3 weight_filler { type: 'gaussian' std: 0.3 } } }
"""
TRAIN = """name: 'callbacks'
layer { name: 'data' type: 'Input' top: 'data' top: 'label'
  input_param { shape { dim: 4 dim: 2 dim: 3 dim: 3 } shape { dim: 4 } } }
""" + LAYERS + """
layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip' bottom: 'label' top: 'loss' }
layer { name: 'acc' type: 'Accuracy' bottom: 'ip' bottom: 'label' top: 'acc' }
"""
# layers: 0 data, 1 label_data_1_split, 2 conv, 3 relu, 4 ip, 5 ip_ip_0_split, 6 loss, 7 acc
DEPLOY = """name: 'deploy'
layer { name: 'data' type: 'Input' top: 'data' input_param { shape { dim: 4 dim: 2 dim: 3 dim: 3 } } }
""" + LAYERS  # no loss: the forward runs without autograd (an in-place ReLU overwrites its bottom)


def _net(tmp_path, text=TRAIN, seed=0):
    path = tmp_path / "net.prototxt"
    path.write_text(text)
    caffe.set_random_seed(seed)
    net = caffe.Net(str(path), caffe.TRAIN)
    rng = np.random.default_rng(seed)
    net.blobs["data"].data[...] = rng.standard_normal(net.blobs["data"].shape)
    if "label" in net.blobs:
        net.blobs["label"].data[...] = [0, 1, 2, 1]
    return net


def test_private_members_are_views_of_the_public_ones(tmp_path):
    net = _net(tmp_path)
    names = net._blob_names
    assert [names[i] for i in net._inputs] == net.inputs == ["data", "label"]
    assert [names[i] for i in net._outputs] == net.outputs
    assert [b.name for b in net._blobs] == names and all(net._blobs[i] is net.blobs[n] for i, n in enumerate(names))
    assert net._blob_loss_weights == list(net.blob_loss_weights.values())
    assert net._blob_loss_weights[names.index("loss")] == 1.0
    for i, layer in enumerate(net._layer_names):
        assert [names[k] for k in net._top_ids(i)] == net.top_names[layer]
        assert [names[k] for k in net._bottom_ids(i)] == net.bottom_names[layer]
    relu = net._layer_names.index("relu")
    assert net._top_ids(relu) == net._bottom_ids(relu) == [names.index("conv")]  # in place: one blob
    with pytest.raises(CaffeCompatError, match="out of range"):
        net._top_ids(len(net.layers))


MEMORY = """name: 'memory'
layer { name: 'data' type: 'MemoryData' top: 'data' top: 'label'
  memory_data_param { batch_size: 2 channels: 1 height: 2 width: 2 } }
"""


def test_set_input_arrays_binding_takes_4d_labels(tmp_path):
    path = tmp_path / "memory.prototxt"
    path.write_text(MEMORY)
    net = caffe.Net(str(path), caffe.TEST)
    data = np.arange(16, dtype=np.float32).reshape(4, 1, 2, 2)
    with pytest.raises(ShapeMismatchError, match="4-d"):
        net._set_input_arrays(data, np.arange(4, dtype=np.float32))  # pycaffe's wrapper reshapes; the binding not
    net._set_input_arrays(data, np.arange(4, dtype=np.float32).reshape(4, 1, 1, 1))
    net.forward()
    np.testing.assert_array_equal(net.blobs["data"].data, data[:2])
    np.testing.assert_array_equal(net.blobs["label"].data, [0, 1])

"""User Python layers (``type: "Python"``) as pycaffe scripts drive them through ``caffe.Net``: the
layer's ``self.blobs`` are the net's parameter blobs, what the layer writes into them stays."""

from __future__ import annotations

import numpy as np
import pytest

import caffe_compat as caffe
from caffe_compat.layers import python_user


class _CountingLayer(caffe.Layer):
    """Passes its bottom through; ``self.blobs[0]`` counts the forwards, ``self.blobs[1]`` the backwards
    (state kept in the layer's blobs, as Caffe layers keep an iteration counter or a running statistic)."""

    def setup(self, bottom, top):
        self.blobs.add_blob(1)
        self.blobs.add_blob(1)

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        self.blobs[0].data[...] += 1
        top[0].data[...] = bottom[0].data * self.blobs[0].data[0]

    def backward(self, top, propagate_down, bottom):
        self.blobs[1].data[...] += 1
        bottom[0].diff[...] = top[0].diff


@pytest.fixture
def counting_net(tmp_path):
    path = tmp_path / "count.prototxt"
    path.write_text("""name: 'count' force_backward: true
layer { name: 'data' type: 'Input' top: 'data' input_param { shape { dim: 2 dim: 3 } } }
layer { name: 'count' type: 'Python' bottom: 'data' top: 'y' python_param { module: 'pl_net' layer: 'Count' } }""")
    caffe.register_python_layer("pl_net", "Count", _CountingLayer)
    try:
        yield caffe.Net(str(path), caffe.TRAIN)
    finally:
        python_user.unregister_python_layer("pl_net", "Count")


def test_what_a_python_layer_writes_into_its_blobs_stays(counting_net, tmp_path):
    """Caffe's ``self.blobs`` of a Python layer are the layer's parameter blobs: a write in ``forward`` or
    ``backward`` is the parameter's value from then on (``net.params``, the next forward, a snapshot)."""
    net = counting_net
    net.blobs["data"].data[...] = 1
    net.forward()
    np.testing.assert_array_equal(net.forward()["y"], np.full((2, 3), 2.0))  # the second forward read 1, wrote 2
    net.backward()
    assert net.params["count"][0].data.tolist() == [2.0] and net.params["count"][1].data.tolist() == [1.0]
    net.params["count"][0].data[...] = 10  # what the script writes is what the layer reads next
    np.testing.assert_array_equal(net.forward()["y"], np.full((2, 3), 11.0))
    net.save(str(tmp_path / "count.caffemodel"))
    net.params["count"][0].data[...] = 0
    net.copy_from(str(tmp_path / "count.caffemodel"))
    assert net.params["count"][0].data.tolist() == [11.0]

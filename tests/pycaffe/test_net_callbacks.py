"""pycaffe's layer callbacks, ``net.before_forward/after_forward/before_backward/after_backward(fn)``
(Caffe's ``Net::ForwardFromTo``/``BackwardFromTo`` call them with the layer index around each layer), and the
private members of ``caffe.Net`` that scripts reach for (``_blobs``, ``_blob_loss_weights``, ``_inputs``,
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


def _record(net, calls, kinds=("before_forward", "after_forward", "before_backward", "after_backward")):
    for kind in kinds:
        getattr(net, kind)(lambda i, kind=kind: calls.append((kind, i)))


def test_numbering_is_the_layer_names_split_layers_counted(tmp_path):
    net = _net(tmp_path)
    assert net._layer_names == ["data", "label_data_1_split", "conv", "relu", "ip", "ip_ip_0_split", "loss", "acc"]


def test_full_forward_and_backward_call_every_layer_in_order(tmp_path):
    net = _net(tmp_path)
    calls = []
    _record(net, calls)
    net.forward()
    n = len(net.layers)
    assert calls == [(kind, i) for i in range(n) for kind in ("before_forward", "after_forward")]
    calls.clear()
    net.backward()  # every layer, those that need no backward (data, label split, acc) included
    assert calls == [(kind, i) for i in reversed(range(n)) for kind in ("before_backward", "after_backward")]
    assert all(type(i) is int for _, i in calls)


def test_ranges_call_only_the_layers_run(tmp_path):
    net = _net(tmp_path)
    net.forward()
    calls = []
    _record(net, calls)
    net.forward(start="relu", end="ip")
    assert calls == [("before_forward", 3), ("after_forward", 3), ("before_forward", 4), ("after_forward", 4)]
    calls.clear()
    net._forward(2, 2)
    assert calls == [("before_forward", 2), ("after_forward", 2)]
    calls.clear()
    net.backward(start="ip", end="conv")
    assert calls == [(kind, i) for i in (4, 3, 2) for kind in ("before_backward", "after_backward")]
    calls.clear()
    net._backward(7, 5)
    assert calls == [(kind, i) for i in (7, 6, 5) for kind in ("before_backward", "after_backward")]


def test_several_callbacks_run_in_registration_order(tmp_path):
    net = _net(tmp_path)
    calls = []
    for name in ("a", "b", "c"):
        net.before_forward(lambda i, name=name: calls.append((name, i)))
        net.before_backward(lambda i, name=name: calls.append((name, -i)))
    net.forward(start="conv", end="relu")
    net.backward(start="relu", end="conv")
    assert calls == [("a", 2), ("b", 2), ("c", 2), ("a", 3), ("b", 3), ("c", 3),
                     ("a", -3), ("b", -3), ("c", -3), ("a", -2), ("b", -2), ("c", -2)]


@pytest.mark.parametrize("text", [TRAIN, DEPLOY], ids=["autograd", "in-place-without-autograd"])
def test_forward_callbacks_see_each_layer_s_tops(tmp_path, text):
    net = _net(tmp_path, text)
    seen = {}
    net.before_forward(lambda i: seen.__setitem__(("before", i), {n: b.data.copy() for n, b in net.blobs.items()}))
    net.after_forward(lambda i: seen.__setitem__(("after", i), {n: b.data.copy() for n, b in net.blobs.items()}))
    net.forward()
    conv, relu, ip = (net._layer_names.index(name) for name in ("conv", "relu", "ip"))
    np.testing.assert_array_equal(seen["after", ip]["ip"], net.blobs["ip"].data)  # a top of its own
    assert not seen["before", ip]["ip"].any()  # not computed yet: the blob still holds its zeros
    pre = seen["before", relu]["conv"]  # the in-place ReLU: its bottom's value before, its top's after
    np.testing.assert_array_equal(pre, seen["after", conv]["conv"])
    assert (pre < 0).any() and (pre > 0).any()
    np.testing.assert_array_equal(seen["after", relu]["conv"], np.maximum(pre, 0))
    np.testing.assert_array_equal(net.blobs["conv"].data, np.maximum(pre, 0))


@pytest.mark.parametrize("text", [TRAIN, DEPLOY], ids=["autograd", "without-autograd"])
def test_weights_written_before_a_layer_are_what_it_reads(tmp_path, text):
    net = _net(tmp_path, text)
    ip = net._layer_names.index("ip")
    kept = {}

    def zero(i):  # e.g. a quantization script: other weights for this layer's forward only
        if i == ip:
            kept["w"] = net.params["ip"][0].data.copy()
            net.params["ip"][0].data[...] = 0

    def restore(i):
        if i == ip:
            net.params["ip"][0].data[...] = kept["w"]
    net.before_forward(zero)
    net.after_forward(restore)
    net.forward()
    assert not net.blobs["ip"].data.any()  # zero weights, zero bias
    assert net.params["ip"][0].data.any()


def test_backward_callbacks_see_each_layer_s_diffs(tmp_path):
    net = _net(tmp_path)
    net.forward()
    net.backward()
    expected = {n: b.diff.copy() for n, b in net.blobs.items()}
    grads = {layer: [p.diff.copy() for p in blobs] for layer, blobs in net.params.items()}
    net.clear_param_diffs()
    for blob in net.blobs.values():
        if blob.name != "loss":
            blob.diff[...] = 0
    seen = {}

    def look(when):
        return lambda i: seen.__setitem__((when, i), ({n: b.diff.copy() for n, b in net.blobs.items()},
                                                      net.params["ip"][0].diff.copy()))
    net.before_backward(look("before"))
    net.after_backward(look("after"))
    net.forward()
    net.backward()
    relu, ip = net._layer_names.index("relu"), net._layer_names.index("ip")
    before_ip, after_ip = seen["before", ip], seen["after", ip]
    assert not before_ip[0]["conv"].any() and not before_ip[1].any()
    np.testing.assert_allclose(after_ip[1], grads["ip"][0], rtol=1e-6, atol=1e-7)  # ip's weight diff is in
    on_relu_top = after_ip[0]["conv"]  # ip wrote d/d(ReLU's output); the ReLU then writes d/d(its input)
    np.testing.assert_array_equal(seen["before", relu][0]["conv"], on_relu_top)
    np.testing.assert_allclose(seen["after", relu][0]["conv"], expected["conv"], rtol=1e-6, atol=1e-7)
    assert not np.array_equal(on_relu_top, expected["conv"])
    for name, diff in expected.items():  # one layer at a time: the diffs of the whole-net backward
        np.testing.assert_allclose(net.blobs[name].diff, diff, rtol=1e-6, atol=1e-7)
    for layer, diffs in grads.items():
        for k, diff in enumerate(diffs):
            np.testing.assert_allclose(net.params[layer][k].diff, diff, rtol=1e-6, atol=1e-7)


def test_a_diff_written_by_a_callback_is_what_the_next_layers_read(tmp_path):
    plain = _net(tmp_path)
    plain.forward()
    plain.backward()
    net = _net(tmp_path)
    relu = net._layer_names.index("relu")

    def double(i):
        if i == relu:
            net.blobs["conv"].diff[...] *= 2  # Caffe's memory: the ReLU's Backward reads this top diff
    net.before_backward(double)
    net.forward()
    net.backward()
    np.testing.assert_allclose(net.params["conv"][0].diff, 2 * plain.params["conv"][0].diff, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(net.params["ip"][0].diff, plain.params["ip"][0].diff, rtol=1e-6, atol=1e-7)


def test_backward_range_with_callbacks_equals_without(tmp_path):
    results = []
    for with_callbacks in (False, True):
        net = _net(tmp_path)
        if with_callbacks:
            net.after_backward(lambda i: None)
        net.forward()
        net.backward(start="loss", end="ip")
        net.backward(start="relu", end="conv")
        results.append(({n: b.diff.copy() for n, b in net.blobs.items()},
                        {k: [p.diff.copy() for p in v] for k, v in net.params.items()}))
    (blobs0, params0), (blobs1, params1) = results
    assert np.abs(blobs1["conv"]).max() > 0
    for name in blobs0:
        np.testing.assert_allclose(blobs1[name], blobs0[name], rtol=1e-6, atol=1e-7)
    for layer in params0:
        for a, b in zip(params0[layer], params1[layer]):
            np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)


SHARED = """name: 'shared' force_backward: true
layer { name: 'data' type: 'Input' top: 'data' input_param { shape { dim: 3 dim: 4 } } }
layer { name: 'ip1' type: 'InnerProduct' bottom: 'data' top: 'ip1' param { name: 'w' } param { name: 'b' }
  inner_product_param { num_output: 4 weight_filler { type: 'gaussian' std: 0.5 } } }
layer { name: 'ip2' type: 'InnerProduct' bottom: 'ip1' top: 'ip2' param { name: 'w' } param { name: 'b' }
  inner_product_param { num_output: 4 weight_filler { type: 'gaussian' std: 0.5 } } }
layer { name: 'loss' type: 'EuclideanLoss' bottom: 'ip2' bottom: 'data' top: 'loss' }
"""


def test_weights_shared_with_an_earlier_layer_are_counted_once(tmp_path):
    results = []
    for with_callbacks in (False, True):
        net = _net(tmp_path, SHARED)
        if with_callbacks:
            net.before_backward(lambda i: None)
        net.forward()
        net.backward()
        results.append((net.blobs["data"].diff.copy(), [p.diff.copy() for p in net.params["ip1"]]))
    (data0, params0), (data1, params1) = results
    np.testing.assert_allclose(data1, data0, rtol=1e-5, atol=1e-6)
    for a, b in zip(params0, params1):
        assert np.abs(a).max() > 0
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_a_net_without_loss_still_visits_the_layers_backward(tmp_path):
    net = _net(tmp_path, DEPLOY)
    calls = []
    _record(net, calls, ("before_backward", "after_backward"))
    net.forward()
    with pytest.warns(RuntimeWarning, match="no loss"):
        net.backward()
    assert calls == [(kind, i) for i in (3, 2, 1, 0) for kind in ("before_backward", "after_backward")]


def test_callbacks_survive_an_input_reshape(tmp_path):
    net = _net(tmp_path, DEPLOY)
    calls = []
    net.after_forward(calls.append)
    net.blobs["data"].reshape(2, 2, 3, 3)
    net.forward()
    assert calls == [0, 1, 2, 3]


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
    np.testing.assert_array_equal(net.blobs["label"].data, np.reshape([0, 1], (2, 1, 1, 1)))

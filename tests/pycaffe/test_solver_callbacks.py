"""A solver's iterations call its nets' layer callbacks, as Caffe's ``Solver::Step`` runs
``Net::ForwardBackward`` (``ForwardFromTo`` and ``BackwardFromTo`` call them around each layer) and
``Solver::Test`` the TEST net's ``Forward``; diffs a backward callback writes are what the update uses; data a
forward callback writes is what the later layers read (in ``solver.step`` and in ``net.forward``)."""

from __future__ import annotations

import numpy as np
import pytest

import caffe_compat as caffe
from caffe_compat.pycaffe import _caffe

NET = """name: 'tiny'
layer { name: 'data' type: 'DummyData' top: 'data' top: 'label'
  dummy_data_param { shape { dim: 6 dim: 2 dim: 3 dim: 3 } shape { dim: 6 }
                     data_filler { type: 'gaussian' std: 1 } data_filler { type: 'constant' } } }
layer { name: 'conv' type: 'Convolution' bottom: 'data' top: 'conv'
  convolution_param { num_output: 3 kernel_size: 2 weight_filler { type: 'gaussian' std: 0.5 } } }
layer { name: 'relu' type: 'ReLU' bottom: 'conv' top: 'conv' }
layer { name: 'ip' type: 'InnerProduct' bottom: 'conv' top: 'ip'
  inner_product_param { num_output: 4 weight_filler { type: 'gaussian' std: 0.5 }
                        bias_filler { type: 'constant' value: 0.25 } } }
layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip' bottom: 'label' top: 'loss' }
"""


@pytest.fixture
def solver_file(tmp_path):
    net = tmp_path / "net.prototxt"
    net.write_text(NET)
    solver = tmp_path / "solver.prototxt"
    solver.write_text(f'net: "{net}"\ntest_iter: 2\ntest_interval: 1000\nbase_lr: 0.1\nmomentum: 0.9\n'
                      f'lr_policy: "fixed"\nrandom_seed: 3\nsnapshot_prefix: "{tmp_path / "snap"}"\n')
    return str(solver)


def _solver(path):
    solver = caffe.SGDSolver(path)
    solver.net.blobs["label"].data[...] = [0, 1, 2, 3, 0, 1]
    solver.test_nets[0].blobs["label"].data[...] = [0, 1, 2, 3, 0, 1]
    return solver


def test_step_calls_the_train_net_callbacks_around_each_layer(solver_file):
    solver = _solver(solver_file)
    net = solver.net
    assert net._layer_names == ["data", "conv", "relu", "ip", "loss"]
    calls = []
    for kind in ("before_forward", "after_forward", "before_backward", "after_backward"):
        getattr(net, kind)(lambda i, kind=kind: calls.append((kind, i)))
    solver.step(2)
    one = ([(kind, i) for i in range(5) for kind in ("before_forward", "after_forward")]
           + [(kind, i) for i in reversed(range(5)) for kind in ("before_backward", "after_backward")])
    assert calls == one * 2


def test_test_calls_the_test_net_forward_callbacks(solver_file):
    solver = _solver(solver_file)
    calls = []
    solver.test_nets[0].after_forward(calls.append)
    solver.step(2)  # Caffe tests at iteration 0 (test_initialization), test_iter 2 forwards
    assert calls == list(range(5)) * 2
    calls.clear()
    solver.test(0)
    assert calls == list(range(5)) * 2


def test_no_op_callbacks_leave_the_trajectory_unchanged(solver_file):
    plain, watched = _solver(solver_file), _solver(solver_file)
    for kind in ("before_forward", "after_forward", "before_backward", "after_backward"):
        getattr(watched.net, kind)(lambda i: None)
    plain.step(3)
    watched.step(3)
    # the layer-by-layer backward sums the same products per layer as the whole-net one (a chain, no
    # shared blob): float32 round-off of the last bits at most over three updates
    for name in ("conv", "ip"):
        for a, b in zip(plain.net.params[name], watched.net.params[name]):
            np.testing.assert_allclose(b.data, a.data, rtol=1e-6, atol=1e-7)
            assert np.abs(b.data).max() > 0
    assert float(watched.net.blobs["loss"].data) == pytest.approx(float(plain.net.blobs["loss"].data), rel=1e-6)


def test_a_diff_zeroed_by_an_after_backward_callback_is_what_the_update_uses(solver_file):
    solver = _solver(solver_file)
    net = solver.net
    ip = net._layer_names.index("ip")

    def freeze_ip(i):  # e.g. a script that freezes a layer by hand
        if i == ip:
            for blob in net.params["ip"]:
                blob.diff[...] = 0
    net.after_backward(freeze_ip)
    ip_before = [b.data.copy() for b in net.params["ip"]]
    conv_before = net.params["conv"][0].data.copy()
    solver.step(2)
    for blob, old in zip(net.params["ip"], ip_before):
        np.testing.assert_array_equal(blob.data, old)
    assert np.abs(net.params["conv"][0].data - conv_before).max() > 1e-4  # the layers below still learn


def test_data_written_by_an_after_forward_callback_is_what_the_later_layers_read(solver_file):
    solver = _solver(solver_file)
    net = solver.net
    relu = net._layer_names.index("relu")
    net.after_forward(lambda i: net.blobs["conv"].data.__setitem__(Ellipsis, 0) if i == relu else None)
    weights = net.params["ip"][0].data.copy()
    solver.step(1)
    # zero features: every score is the bias (0.25), a uniform softmax, ip's weights get no gradient
    np.testing.assert_array_equal(net.blobs["conv"].data, 0)
    np.testing.assert_allclose(net.blobs["ip"].data, 0.25, rtol=0, atol=0)
    assert float(net.blobs["loss"].data) == pytest.approx(np.log(4), rel=1e-6)
    np.testing.assert_array_equal(net.params["ip"][0].data, weights)


def test_data_written_before_a_layer_runs_is_what_it_reads_in_a_plain_net(tmp_path):
    path = tmp_path / "net.prototxt"
    path.write_text(NET)
    net = caffe.Net(str(path), caffe.TEST)
    ip = net._layer_names.index("ip")
    net.before_forward(lambda i: net.blobs["conv"].data.__setitem__(Ellipsis, 1.0) if i == ip else None)
    net.forward()
    w, b = (blob.data for blob in net.params["ip"])
    expected = np.ones((6, w.shape[1]), np.float32) @ w.T + b
    np.testing.assert_allclose(net.blobs["ip"].data, expected, rtol=1e-6)
    np.testing.assert_array_equal(net.blobs["conv"].data, 1.0)


def test_caffe_train_py_registers_nccl_as_an_after_backward_callback(solver_file):
    solver = _solver(solver_file)
    nccl = object.__new__(_caffe.NCCL)  # (a real one needs CUDA and NCCL) as caffe/python/train.py does:
    solver.add_callback(nccl)            # solver.add_callback(nccl); solver.net.after_backward(nccl)
    solver.net.after_backward(nccl)
    nccl(3)  # a layer callback: its reduction runs at on_gradients_ready, after the whole backward
    assert not solver.net._has_backward_callbacks  # so the net keeps its one whole-net backward

"""pycaffe's solver surface: ``apply_update`` with a hand-set diff, ``.data`` written between steps, the
blobs' data and diffs after a step equal to a ``caffe.Net`` forward/backward, test nets sharing the train
net's weights, ``share_weights``, ``add_callback``, constant DummyData labels written by the script, and
nets that outlive their solver."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import caffe_compat as caffe

NET = """name: 'tiny' force_backward: true
layer { name: 'data' type: 'DummyData' top: 'data' top: 'label'
  dummy_data_param { shape { dim: 6 dim: 2 dim: 3 dim: 3 } shape { dim: 6 }
                     data_filler { type: 'gaussian' std: 1 } data_filler { type: 'constant' } } }
layer { name: 'conv' type: 'Convolution' bottom: 'data' top: 'conv'
  convolution_param { num_output: 3 kernel_size: 2 weight_filler { type: 'gaussian' std: 0.5 } } }
layer { name: 'ip' type: 'InnerProduct' bottom: 'conv' top: 'ip'
  inner_product_param { num_output: 4 weight_filler { type: 'gaussian' std: 0.5 } } }
layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip' bottom: 'label' top: 'loss' }
"""


@pytest.fixture
def files(tmp_path):
    net = tmp_path / "net.prototxt"
    net.write_text(NET)
    solver = tmp_path / "solver.prototxt"
    solver.write_text(f'net: "{net}"\ntest_iter: 1\ntest_interval: 1000\nbase_lr: 0.1\nlr_policy: "fixed"\n'
                      f'snapshot_prefix: "{tmp_path / "snap"}"\n')
    return str(net), str(solver)


def test_apply_update_uses_the_hand_set_diff(files):
    solver = caffe.SGDSolver(files[1])
    weights = solver.net.layers[1].blobs[0].data  # conv weights: a view of the trained tensor
    weights[...] = 0.5
    solver.net.params["conv"][0].diff[...] = np.arange(24, dtype=np.float32).reshape(3, 2, 2, 2)
    solver.apply_update()
    np.testing.assert_allclose(weights, 0.5 - 0.1 * np.arange(24).reshape(3, 2, 2, 2), rtol=1e-6)
    assert solver.iter == 0  # Caffe's ApplyUpdate does not count an iteration


def test_data_written_between_steps_takes_effect(files):
    solver = caffe.SGDSolver(files[1])
    solver.step(1)
    for blob in solver.net.params["ip"]:
        blob.data[...] = 0  # zero scores: a uniform softmax over 4 classes
    solver.step(1)
    assert float(solver.net.blobs["loss"].data) == pytest.approx(np.log(4), rel=1e-6)


def test_blobs_after_a_step_are_that_steps_forward_and_backward(files, tmp_path):
    net_file, solver_file = files
    solver = caffe.SGDSolver(solver_file)
    solver.net.blobs["label"].data[...] = [0, 1, 2, 3, 0, 1]  # a constant DummyData top: training reads it
    before = tmp_path / "before.caffemodel"
    solver.net.save(str(before))
    solver.step(1)
    reference = caffe.Net(net_file, str(before), caffe.TRAIN)
    reference.blobs["label"].data[...] = [0, 1, 2, 3, 0, 1]
    reference.blobs["data"].data[...] = solver.net.blobs["data"].data  # the step's gaussian batch
    reference.forward(start="conv")
    reference.backward()
    for name in ("conv", "ip", "loss"):
        np.testing.assert_allclose(solver.net.blobs[name].data, reference.blobs[name].data, rtol=1e-5, atol=1e-6)
    for name in ("data", "conv", "ip"):
        np.testing.assert_allclose(solver.net.blobs[name].diff, reference.blobs[name].diff, rtol=1e-5, atol=1e-7)
    assert np.abs(solver.net.blobs["conv"].diff).max() > 0
    assert np.array_equal(solver.net.blobs["label"].data, [0, 1, 2, 3, 0, 1])


def test_test_nets_share_the_trained_weights_and_outlive_the_solver(files):
    solver = caffe.SGDSolver(files[1])
    train, test = solver.net, solver.test_nets[0]
    assert np.shares_memory(train.params["ip"][0].data, test.params["ip"][0].data)
    solver.step(3)
    np.testing.assert_array_equal(test.params["conv"][0].data, train.params["conv"][0].data)
    train.blobs["label"].data[...] = test.blobs["label"].data
    test.blobs["label"].data[...] = [3, 2, 1, 0, 3, 2]
    loss = float(test.forward()["loss"])
    del solver
    gc.collect()
    data = test.blobs["data"].data.copy()
    assert float(test.forward(start="conv")["loss"]) == pytest.approx(loss, rel=1e-6)  # same weights, same data
    np.testing.assert_array_equal(test.blobs["data"].data, data)
    train.forward()  # the train net still computes, on its last input arrays
    assert np.isfinite(float(train.blobs["loss"].data))


def test_share_weights_and_callbacks(files):
    net_file, solver_file = files
    solver = caffe.SGDSolver(solver_file)
    other = caffe.Net(net_file, caffe.TEST)
    solver.share_weights(other)
    assert np.shares_memory(other.params["conv"][0].data, solver.net.params["conv"][0].data)
    calls = []

    def on_gradients_ready():
        calls.append(("grad", float(np.abs(solver.net.params["ip"][0].diff).sum())))
        for blobs in solver.net.params.values():
            for blob in blobs:
                blob.diff[...] = 0  # nothing to apply: the weights must not move

    solver.add_callback(lambda: calls.append(("start", solver.iter)), on_gradients_ready)
    start = solver.net.params["ip"][0].data.copy()
    solver.step(2)
    assert [c[0] for c in calls] == ["start", "grad", "start", "grad"] and calls[2] == ("start", 1)
    assert calls[1][1] > 0
    np.testing.assert_array_equal(solver.net.params["ip"][0].data, start)
    np.testing.assert_array_equal(other.params["ip"][0].data, start)

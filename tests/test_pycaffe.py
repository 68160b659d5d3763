"""The pycaffe facade (``import caffe_compat as caffe``) against real Caffe's numbers and the torch API."""

from __future__ import annotations

import warnings

import cv2
import numpy as np
import pytest
import torch

import caffe_compat as caffe
from caffe_compat.errors import CaffeCompatError, ShapeMismatchError
from caffe_compat.io import blob_to_array, read_net
from caffe_compat.net import load_net
from tests.conftest import fixture_path, leading_rows

NSFW_MEAN = np.array([104.0, 117.0, 123.0], dtype=np.float32)


def _rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _files(directory: str) -> tuple[str, str]:
    return str(fixture_path(f"{directory}/deploy.prototxt")), str(fixture_path(f"{directory}/weights.caffemodel"))


@pytest.fixture(autouse=True)
def _cpu_mode():
    caffe.set_mode_cpu()
    yield
    caffe.set_mode_cpu()


@pytest.fixture
def googlenet_small():
    proto, weights = _files("nets/googlenet_small")
    return (caffe.Net(proto, weights, caffe.TEST), np.load(fixture_path("nets/googlenet_small/blobs.npz")),
            np.load(fixture_path("nets/googlenet_small/grads.npz")))


def _china_png(tmp_path) -> str:
    from sklearn.datasets import load_sample_images

    rgb = load_sample_images().images[0]  # china.jpg, 427x640
    bgr = cv2.resize(np.ascontiguousarray(rgb[:, :, ::-1]), (224, 224), interpolation=cv2.INTER_AREA)
    path = str(tmp_path / "china224.png")  # lossless: the script and the torch API read the same pixels
    cv2.imwrite(path, bgr)
    return path


def test_classic_inference_script_equals_torch_api(nsfw_dir, tmp_path):
    image_path = _china_png(tmp_path)
    proto, weights = str(nsfw_dir / "deploy.prototxt"), str(nsfw_dir / "resnet_50_1by2_nsfw.caffemodel")
    # --- the old pycaffe script, unchanged but for the import
    net = caffe.Net(proto, weights, caffe.TEST)
    transformer = caffe.io.Transformer({"data": net.blobs["data"].data.shape})
    transformer.set_transpose("data", (2, 0, 1))
    transformer.set_mean("data", NSFW_MEAN)
    transformer.set_raw_scale("data", 255)
    transformer.set_channel_swap("data", (2, 1, 0))
    net.blobs["data"].data[...] = transformer.preprocess("data", caffe.io.load_image(image_path))
    prob = net.forward()["prob"].copy()
    # --- the torch API on the same image, preprocessed by hand (BGR pixels minus the mean)
    x = (cv2.imread(image_path).astype(np.float32) - NSFW_MEAN).transpose(2, 0, 1)[None]
    np.testing.assert_allclose(net.blobs["data"].data, x, rtol=0, atol=2e-5)  # /255 then *255 round-off
    torch_net = load_net(proto, weights)
    with torch.no_grad():
        expected = torch_net(data=torch.from_numpy(x))["prob"].numpy()
    assert prob.shape == (1, 2) and abs(prob.sum() - 1) < 1e-6
    np.testing.assert_allclose(prob, expected, rtol=1e-5, atol=1e-7)
    # the facade adds no arithmetic: the same array in gives the same bits out
    assert np.array_equal(net.forward(data=x)["prob"], expected)


def test_blobs_in_caffe_order_and_values(googlenet_small):
    net, ref, _ = googlenet_small
    assert list(net.blobs) == list(ref["__blob_order__"])  # Split tops included
    assert net.inputs == ["data"] and net.outputs == ["fc_embedding"]
    out = net.forward(data=ref["data"])
    assert list(out) == ["fc_embedding"]
    assert np.shares_memory(out["fc_embedding"], net.blobs["fc_embedding"].data)  # pycaffe returns the blob
    errors = {name: _rel(leading_rows(net.blobs[name].data, ref[name]), ref[name]) for name in net.blobs}
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-4, (worst, errors[worst])
    assert net.blobs["pool5/7x7_s1"].shape == (2, 1024 // 4, 1, 1) and net.blobs["data"].num == 2
    partial = net.forward(end="inception_3a/output")
    assert list(partial) == ["inception_3a/output"]


def test_backward_matches_caffe_and_param_diffs_accumulate(googlenet_small):
    net, ref, grads = googlenet_small
    net.forward(data=ref["data"])
    net.blobs["fc_embedding"].diff[...] = grads["diff:fc_embedding"]
    result = net.backward()
    assert set(result) == {"data"}
    assert _rel(result["data"], grads["diff:data"]) < 1e-4
    keys = [k for k in grads.files if k.startswith("param_diff:")]
    assert len(keys) == sum(len(v) for v in net.params.values())
    for key in keys:
        layer, index = key[len("param_diff:"):].rsplit(":", 1)
        assert _rel(net.params[layer][int(index)].diff, grads[key]) < 1e-3, key
    view = net.params["conv1/7x7_s2"][0].diff  # taken before the second backward
    once = {k: net.params[k.split(":")[1]][int(k.rsplit(":", 1)[1])].diff.copy() for k in keys}
    data_diff = net.blobs["data"].diff.copy()
    net.backward()
    for key, first in once.items():  # Caffe accumulates parameter diffs: exactly twice now
        layer, index = key[len("param_diff:"):].rsplit(":", 1)
        assert np.array_equal(net.params[layer][int(index)].diff, 2 * first), key
    assert np.array_equal(view, 2 * once["param_diff:conv1/7x7_s2:0"])  # the same memory, updated
    assert np.array_equal(net.blobs["data"].diff, data_diff)  # blob diffs are overwritten, not accumulated
    torch_grad = net.torch_net.params["conv1/7x7_s2"][0].grad.numpy()
    assert np.shares_memory(view, torch_grad)


def test_loss_net_backward_uses_loss_weight():
    """EuclideanLoss with loss_weight 0.5: no diff set by hand, the loss top's diff is its weight."""
    ref = np.load(fixture_path("losses/euclidean_lw0.5.npz"))
    net = caffe.Net(str(fixture_path("losses/euclidean_lw0.5.prototxt")), caffe.TEST)
    assert float(net.blobs["loss"].diff) == 0.5  # Caffe's SetLossWeights
    out = net.forward(pred=ref["pred"], target=ref["target"])
    assert float(out["loss"]) == pytest.approx(float(ref["loss"]), rel=1e-6)
    diffs = net.backward()
    for name in ("pred", "target"):
        np.testing.assert_allclose(diffs[name], ref[f"diff:{name}"], rtol=1e-5, atol=1e-7)


def test_loss_net_param_diffs_equal_caffe_sgd_first_step():
    """solver_tiny (no force_backward): the param diffs of one backward are the gradient Caffe's first SGD
    step used, g = (w0 - w1) / (lr * lr_mult) - weight_decay * decay_mult * w0; the data diff stays 0."""
    case = fixture_path("solvers/sgd_step_momentum")
    net = caffe.Net(str(case / "net.prototxt"), str(case / "init.caffemodel"), caffe.TEST)
    inputs, trajectory = np.load(case / "inputs.npz"), np.load(case / "trajectory.npz")
    out = net.forward(data=inputs["data"][0], label=inputs["label"][0])
    assert float(out["loss"]) == pytest.approx(float(trajectory["loss_blob"][0]), rel=1e-5)
    net.backward()
    specs = {"conv1": ((1, 1), (2, 0)), "ip1": ((10, 1), (20, 0))}  # (lr_mult, decay_mult) per blob
    for layer, blobs in specs.items():
        for i, (lr_mult, decay_mult) in enumerate(blobs):
            w0, w1 = trajectory[f"param:{layer}:{i}"][0].astype(np.float64), trajectory[f"param:{layer}:{i}"][1]
            expected = (w0 - w1) / (0.01 * lr_mult) - 2e-4 * decay_mult * w0
            assert _rel(net.params[layer][i].diff, expected) < 2e-3, (layer, i)
    assert not np.any(net.blobs["data"].diff)  # Caffe computes no data diff without force_backward


def test_param_views_write_through(googlenet_small):
    net, ref, _ = googlenet_small
    before = net.forward(data=ref["data"])["fc_embedding"].copy()
    bias = net.params["fc_embedding"][1].data
    bias[...] += 1.0
    assert np.shares_memory(bias, net.torch_net.params["fc_embedding"][1].detach().numpy())
    after = net.forward()["fc_embedding"]
    np.testing.assert_allclose(after, before + 1.0, rtol=0, atol=1e-5)
    net.params["conv1/7x7_s2"][0].data[...] = 0  # a zero first conv: conv1 becomes relu(bias)
    net.forward()
    expected = np.maximum(net.params["conv1/7x7_s2"][1].data, 0)[None, :, None, None]
    assert np.array_equal(net.blobs["conv1/7x7_s2"].data, np.broadcast_to(expected, net.blobs["conv1/7x7_s2"].shape))


def test_set_input_arrays_advances_and_wraps():
    """The iter_size-2 solver case: Caffe consumed the 10 sub-batches of set_input_arrays in order."""
    case = fixture_path("solvers/sgd_iter_size2")
    net = caffe.Net(str(case / "net.prototxt"), str(case / "init.caffemodel"), caffe.TRAIN)
    inputs, trajectory = np.load(case / "inputs.npz"), np.load(case / "trajectory.npz")
    data = np.ascontiguousarray(inputs["data"].reshape(-1, 3, 10, 10), dtype=np.float32)
    labels = np.ascontiguousarray(inputs["label"].reshape(-1), dtype=np.float32)
    net.set_input_arrays(data, labels)
    seen = []
    for t in range(11):
        out = net.forward()
        seen.append((net.blobs["data"].data.copy(), net.blobs["label"].data.copy(), float(out["loss"])))
    for t in range(10):
        assert np.array_equal(seen[t][0], data[4 * t:4 * t + 4])
        assert np.array_equal(seen[t][1], labels[4 * t:4 * t + 4].reshape(4, 1, 1, 1))  # Caffe's label top shape
    assert np.array_equal(seen[10][0], data[:4])  # wraps to the start
    assert seen[1][2] == pytest.approx(float(trajectory["loss_blob"][0]), rel=1e-5)  # last sub-batch of step 0
    with pytest.raises(CaffeCompatError, match="float32"):
        net.set_input_arrays(data.astype(np.float64), labels)
    with pytest.raises(ShapeMismatchError, match="multiple of batch_size"):
        net.set_input_arrays(data[:6], labels[:6])
    deploy = caffe.Net(_files("nets/googlenet_small")[0], caffe.TEST)
    with pytest.raises(CaffeCompatError, match="MemoryData"):
        deploy.set_input_arrays(data, labels)


def test_reshape_reinfers_shapes_and_keeps_views(googlenet_small):
    net, ref, _ = googlenet_small
    bias_view = net.params["fc_embedding"][1].data
    batch = net.blobs["data"].shape[0]
    net.blobs["data"].reshape(1, 3, 224, 224)
    assert net.blobs["data"].shape == (1, 3, 224, 224)
    # Caffe's Blob::Reshape changes that blob alone: the others follow at net.reshape() (or the next forward)
    assert net.blobs["conv1/7x7_s2"].shape[0] == batch != 1 and net.blobs["fc_embedding"].shape == (batch, 128)
    net.reshape()
    assert net.blobs["conv1/7x7_s2"].shape[0] == 1 and net.blobs["fc_embedding"].shape == (1, 128)
    net.blobs["data"].data[...] = ref["data"][:1]
    out = net.forward()
    assert _rel(out["fc_embedding"], ref["fc_embedding"][:1]) < 1e-4
    bias_view[...] += 2.0  # the view taken before the reshape still drives the net
    np.testing.assert_allclose(net.forward()["fc_embedding"], ref["fc_embedding"][:1] + 2.0, rtol=0, atol=1e-3)
    net.blobs["data"].reshape(2, 3, 256, 256)  # pool5 becomes 2x2: fc_embedding's weights no longer fit
    with pytest.raises(ShapeMismatchError, match="fc_embedding"):
        net.forward()


def test_constructor_forms_seed_copy_from_and_save(tmp_path):
    proto, weights = _files("nets/googlenet_small")
    ref = np.load(fixture_path("nets/googlenet_small/blobs.npz"))
    keyword = caffe.Net(proto, caffe.TEST, weights=weights)
    assert _rel(keyword.forward(data=ref["data"])["fc_embedding"], ref["fc_embedding"]) < 1e-4
    with pytest.raises(CaffeCompatError, match="phase"):
        caffe.Net(proto)
    caffe.set_random_seed(3)
    a = caffe.Net(proto, caffe.TEST)
    caffe.set_random_seed(3)
    b = caffe.Net(proto, caffe.TEST)
    caffe.set_random_seed(4)
    c = caffe.Net(proto, caffe.TEST)
    w = lambda n: n.params["inception_3a/1x1"][0].data  # noqa: E731
    assert np.array_equal(w(a), w(b)) and not np.array_equal(w(a), w(c)) and np.abs(w(a)).max() > 0
    a.copy_from(weights)
    assert _rel(a.forward(data=ref["data"])["fc_embedding"], ref["fc_embedding"]) < 1e-4
    a.save(tmp_path / "saved.caffemodel")
    saved = {l.name: [blob_to_array(x) for x in l.blobs] for l in read_net(str(tmp_path / "saved.caffemodel")).layer}
    for layer in read_net(weights).layer:
        for i, blob in enumerate(layer.blobs):
            assert np.array_equal(saved[layer.name][i], blob_to_array(blob)), layer.name
    assert [l.type for l in a.layers][:2] == ["Input", "Convolution"] and a._layer_names[1] == "conv1/7x7_s2"
    assert a.top_names["conv1/7x7_s2"] == ["conv1/7x7_s2"]


def test_gpu_mode_runs_on_cuda_or_warns_and_uses_cpu(googlenet_small):
    _, ref, grads = googlenet_small
    caffe.set_mode_gpu()
    caffe.set_device(0)
    proto, weights = _files("nets/googlenet_small")
    if torch.cuda.is_available():
        net = caffe.Net(proto, weights, caffe.TEST)
        assert net.torch_net.params["conv1/7x7_s2"][0].device.type == "cuda"
    else:
        with pytest.warns(RuntimeWarning, match="CUDA is not available"):
            net = caffe.Net(proto, weights, caffe.TEST)
        assert net.torch_net.params["conv1/7x7_s2"][0].device.type == "cpu"
    net.blobs["data"].data[...] = ref["data"]  # a host write, synced before the forward
    assert _rel(net.forward()["fc_embedding"], ref["fc_embedding"]) < 1e-4
    net.params["fc_embedding"][1].data[...] += 1.0  # host write of a parameter, synced before the forward
    assert _rel(net.forward()["fc_embedding"], ref["fc_embedding"] + 1.0) < 1e-4
    net.blobs["fc_embedding"].diff[...] = grads["diff:fc_embedding"]
    assert _rel(net.backward()["data"], grads["diff:data"]) < 1e-3


def test_backward_without_loss_or_force_backward_changes_nothing(nsfw_dir):
    net = caffe.Net(str(nsfw_dir / "deploy.prototxt"), caffe.TEST)
    net.forward(data=np.ones((1, 3, 224, 224), np.float32))
    net.blobs["prob"].diff[...] = 1.0
    with pytest.warns(RuntimeWarning, match="no loss and no force_backward"):
        net.backward()
    assert not np.any(net.blobs["data"].diff) and not np.any(net.params["conv_1"][0].diff)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        net.backward()  # warned once per net

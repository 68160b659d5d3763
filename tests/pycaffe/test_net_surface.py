"""pycaffe's ``caffe.Net`` surface beyond inference: backward ranges (a slice of the full backward, and
Caffe's reading of the blobs without a forward), forward from a layer, clear_param_diffs, layer_dict,
blob_loss_weights, HDF5 weights, share_with, forward_all, layers[i].reshape, constant DummyData tops that
keep what the script writes, parameters that outlive their net, Caffe's legacy accessors, a Python layer (the
user's object, kept when an input is reshaped), the RuntimeError of a file that cannot be opened and Caffe's
Blob::Reshape, which keeps the memory within the blob's capacity."""

from __future__ import annotations

import gc

import h5py
import numpy as np
import pytest

import caffe_compat as caffe
from caffe_compat.errors import CaffeCompatError, ShapeMismatchError
from caffe_compat.layers import python_user
from caffe_compat.pycaffe import Blob

NET = """name: 'surface' force_backward: true
layer { name: 'data' type: 'Input' top: 'data' top: 'label'
  input_param { shape { dim: 5 dim: 2 dim: 3 dim: 4 } shape { dim: 5 } } }
layer { name: 'conv' type: 'Convolution' bottom: 'data' top: 'conv'
  convolution_param { num_output: 3 kernel_size: 2 pad: 1 weight_filler { type: 'gaussian' std: 0.5 }
                      bias_filler { type: 'constant' value: 0.1 } } }
layer { name: 'relu' type: 'ReLU' bottom: 'conv' top: 'conv' }
layer { name: 'ip' type: 'InnerProduct' bottom: 'conv' top: 'ip'
  inner_product_param { num_output: 4 weight_filler { type: 'gaussian' std: 0.3 } } }
layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'ip' bottom: 'label' top: 'loss' }
"""


@pytest.fixture
def proto(tmp_path):
    path = tmp_path / "net.prototxt"
    path.write_text(NET)
    return str(path)


def _fed(proto, seed=0):
    caffe.set_random_seed(seed)
    net = caffe.Net(proto, caffe.TRAIN)
    rng = np.random.default_rng(seed)
    net.blobs["data"].data[...] = rng.standard_normal((5, 2, 3, 4))
    net.blobs["label"].data[...] = [0, 1, 2, 3, 1]
    return net


def test_backward_range_equals_the_slice_of_the_full_backward(proto):
    net = _fed(proto)
    net.forward()
    full = net.backward()
    expected = {name: net.blobs[name].diff.copy() for name in ("data", "conv", "ip")}
    grads = {layer: [p.diff.copy() for p in blobs] for layer, blobs in net.params.items()}
    assert np.abs(expected["data"]).max() > 0 and np.array_equal(full["data"], expected["data"])
    net.clear_param_diffs()
    for name in ("data", "conv", "ip"):
        net.blobs[name].diff[...] = 0
    only_loss = net.backward(start="loss", end="loss")  # the loss layer alone: ip's diff, bottoms of 'loss'
    assert set(only_loss) == {"ip", "label"}
    np.testing.assert_array_equal(net.blobs["ip"].diff, expected["ip"])
    assert not net.blobs["conv"].diff.any() and not net.params["ip"][0].diff.any()
    out = net.backward(start="ip", end="conv")  # then ip, relu, conv: the rest of the chain
    assert set(out) == {"data"}
    np.testing.assert_allclose(net.blobs["conv"].diff, expected["conv"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(net.blobs["data"].diff, expected["data"], rtol=1e-6, atol=1e-7)
    for layer, diffs in grads.items():
        for i, diff in enumerate(diffs):
            np.testing.assert_allclose(net.params[layer][i].diff, diff, rtol=1e-6, atol=1e-7)


def test_backward_of_one_layer_reads_the_blobs_without_a_forward(proto):
    net = _fed(proto)
    top = np.random.default_rng(1).standard_normal((5, 4)).astype(np.float32)
    net.blobs["ip"].diff[...] = top
    net._backward(3, 3)  # index of 'ip': Caffe's BackwardFromTo on the blobs in memory (conv data: zeros)
    weights = net.params["ip"][0].data
    np.testing.assert_allclose(net.blobs["conv"].diff.reshape(5, -1), top @ weights, rtol=1e-5, atol=1e-6)
    assert not net.params["ip"][0].diff.any()  # d(W) = top^T · conv data, and conv data is still zero
    np.testing.assert_allclose(net.params["ip"][1].diff, top.sum(0), rtol=1e-5)


def test_forward_from_a_layer_reads_the_stored_blob(proto):
    net = _fed(proto)
    conv = np.random.default_rng(2).uniform(size=net.blobs["conv"].shape).astype(np.float32)
    net.blobs["conv"].data[...] = conv
    out = net.forward(start="ip", end="ip")
    assert list(out) == ["ip"]
    w, b = net.params["ip"][0].data, net.params["ip"][1].data
    np.testing.assert_allclose(out["ip"], conv.reshape(5, -1) @ w.T + b, rtol=1e-5, atol=1e-6)
    net._forward(0, 1)  # data, conv: conv is recomputed from data
    assert not np.allclose(net.blobs["conv"].data, conv)


def test_clear_param_diffs_zeroes_the_same_memory(proto):
    net = _fed(proto)
    net.forward()
    net.backward()
    view = net.params["conv"][0].diff
    assert np.abs(view).max() > 0
    net.clear_param_diffs()
    assert not view.any() and not net.torch_net.params["conv"][0].grad.any()


def test_structure_names(proto):
    net = _fed(proto)
    assert list(net.layer_dict) == net._layer_names == ["data", "conv", "relu", "ip", "loss"]
    assert [layer.type for layer in net.layer_dict.values()] == ["Input", "Convolution", "ReLU", "InnerProduct",
                                                                  "SoftmaxWithLoss"]
    assert net.blob_loss_weights == {"data": 0.0, "label": 0.0, "conv": 0.0, "ip": 0.0, "loss": 1.0}
    assert net._blob_names == ["data", "label", "conv", "ip", "loss"] and net.name == "surface"
    conv = net.layers[1]
    assert [tuple(b.shape) for b in conv.blobs] == [(3, 2, 2, 2), (3,)]
    top = net.blobs["conv"]
    conv.reshape([Blob("x", (2, 2, 7, 7), net._device, net)], [top])  # Caffe's Layer::Reshape
    assert top.shape == (2, 3, 8, 8)


def test_every_layer_in_net_layers_is_a_caffe_layer(proto):
    """pycaffe's ``net.layers`` holds built-in layers as instances of the one ``Layer`` class _caffe.cpp
    registers (``caffe.Layer``, the Python-layer base): ``isinstance(layer, caffe.Layer)`` is true for every
    entry and a built-in's ``__class__`` is ``caffe.Layer``.  Before, a built-in was no ``caffe.Layer``."""
    layers = caffe.Net(proto, caffe.TEST).layers
    assert [isinstance(layer, caffe.Layer) for layer in layers] == [True] * 5
    assert [layer.__class__ for layer in layers] == [caffe.Layer] * 5
    assert [len(layer.blobs) for layer in layers] == [0, 2, 0, 2, 0]


def test_set_input_arrays_refusals_are_pycaffes_runtime_error(proto, tmp_path):
    """pycaffe's ``set_input_arrays`` checks in C++ (``Net_SetInputArrays``, ``CheckContiguousArray``) and
    throws ``std::runtime_error``: a RuntimeError for a net without a MemoryData first layer, float64 or
    non-contiguous arrays, wrong channels, a row count that is no multiple of the batch.  Before, ours raised
    CaffeCompatError / ShapeMismatchError, which are no RuntimeError."""
    path = tmp_path / "memory.prototxt"
    path.write_text("""name: 'memory'
layer { name: 'data' type: 'MemoryData' top: 'data' top: 'label'
  memory_data_param { batch_size: 2 channels: 3 height: 2 width: 2 } }""")
    net = caffe.Net(str(path), caffe.TEST)
    data, labels = np.arange(48, dtype=np.float32).reshape(4, 3, 2, 2), np.array([5, 6, 7, 8], np.float32)
    bad = [(data.astype(np.float64), labels), (data[:, :, :, ::-1], labels), (data[:, :2], labels),
           (data[:3], labels[:3]), (data, labels.astype(np.int64))]
    for d, lab in bad:
        with pytest.raises(RuntimeError):
            net.set_input_arrays(d, lab)
    with pytest.raises(RuntimeError, match="MemoryData"):
        caffe.Net(proto, caffe.TEST).set_input_arrays(data, labels)
    net.set_input_arrays(data, labels)
    out = net.forward()
    assert out["label"].reshape(-1).tolist() == [5.0, 6.0] and out["data"].tolist() == data[:2].tolist()


def test_memory_data_label_top_is_reshaped_to_4d_by_each_forward(tmp_path):
    """Caffe's MemoryDataLayer sets the label top up as (batch_size,) but its Forward_cpu reshapes it to
    (batch_size, 1, 1, 1), so after a forward pycaffe shows a 4-D label, and the layers after it (a Power
    here, which shapes its top like its bottom) see 4-D too.  Before, ours kept (batch_size,)."""
    path = tmp_path / "memory.prototxt"
    path.write_text("""name: 'memory'
layer { name: 'data' type: 'MemoryData' top: 'data' top: 'label'
  memory_data_param { batch_size: 2 channels: 1 height: 1 width: 2 } }
layer { name: 'p' type: 'Power' bottom: 'label' top: 'p' power_param { scale: 2 shift: 1 } }""")
    net = caffe.Net(str(path), caffe.TEST)
    assert (net.blobs["label"].shape, net.blobs["p"].shape) == ((2,), (2,))  # as set up
    net.set_input_arrays(np.zeros((4, 1, 1, 2), np.float32), np.array([3, 4, 5, 6], np.float32))
    out = net.forward()
    assert net.blobs["label"].data.shape == (2, 1, 1, 1) and out["p"].shape == (2, 1, 1, 1)
    assert net.blobs["label"].data.reshape(-1).tolist() == [3.0, 4.0] and out["p"].reshape(-1).tolist() == [7.0, 9.0]


def test_a_param_blob_reshapes_as_caffes_blob_and_saves_in_its_new_shape(proto, tmp_path):
    """pycaffe's ``net.params[layer][i]`` is a Blob with ``reshape`` (Caffe's ``Blob::Reshape``): within its
    capacity the memory is kept and seen in the new shape (growing back restores the values), past it the
    data and diff are zeros; ``net.save`` writes the new shape.  Before, ours had no ``reshape``."""
    net = caffe.Net(proto, caffe.TEST)
    weight = net.params["ip"][0]
    old = weight.data.copy()
    assert old.shape == (4, 60)  # conv's 3 x 4 x 5 outputs
    weight.reshape(2, 48)
    assert (weight.shape, weight.count, weight.diff.shape) == ((2, 48), 96, (2, 48))
    assert np.array_equal(weight.data, old.reshape(-1)[:96].reshape(2, 48))
    weight.reshape(4, 60)
    assert np.array_equal(weight.data, old)
    weight.reshape(5, 60)
    assert weight.data.shape == (5, 60) and not weight.data.any() and not weight.diff.any()
    weight.reshape(3, 2)
    weight.data[...] = 7
    net.save(str(tmp_path / "surgery.caffemodel"))
    saved = caffe.proto.caffe_pb2.NetParameter.FromString((tmp_path / "surgery.caffemodel").read_bytes())
    blob = next(layer for layer in saved.layer if layer.name == "ip").blobs[0]
    assert list(blob.shape.dim) == [3, 2] and list(blob.data) == [7.0] * 6


def test_hdf5_weights_round_trip_and_mismatch(proto, tmp_path):
    a, b = _fed(proto, seed=0), _fed(proto, seed=1)
    assert not np.array_equal(a.params["conv"][0].data, b.params["conv"][0].data)
    path = tmp_path / "w.h5"
    a.save_hdf5(str(path))
    with h5py.File(path, "r") as f:
        assert sorted(f["data"]) == ["conv", "data", "ip", "loss", "relu"]
        assert sorted(f["data/conv"]) == ["0", "1"] and f["data/ip/0"].shape == (4, 60)
    b.load_hdf5(str(path))
    for layer in a.params:
        for pa, pb in zip(a.params[layer], b.params[layer]):
            np.testing.assert_array_equal(pa.data, pb.data)
    c = _fed(proto, seed=2)
    c.copy_from(str(path))  # Caffe reads *.h5 as HDF5
    np.testing.assert_array_equal(c.params["ip"][0].data, a.params["ip"][0].data)
    with h5py.File(path, "r+") as f:
        del f["data/ip/0"]
        f["data/ip/0"] = np.zeros((4, 5), np.float32)
    with pytest.raises(ShapeMismatchError, match=r"layer 'ip' blob 0 has shape \(4, 5\)"):
        c.load_hdf5(str(path))


SIAMESE = """name: 'siamese'
layer { name: 'data' type: 'Input' top: 'a' top: 'b'
  input_param { shape { dim: 1 dim: 3 } shape { dim: 1 dim: 3 } } }
layer { name: 'ip' type: 'InnerProduct' bottom: 'a' top: 'fa' param { name: 'w' } param { name: 'bias' }
  inner_product_param { num_output: 2 } }
layer { name: 'ip_p' type: 'InnerProduct' bottom: 'b' top: 'fb' param { name: 'w' } param { name: 'bias' }
  inner_product_param { num_output: 2 } }
layer { name: 'solo' type: 'InnerProduct' bottom: 'b' top: 'fc' inner_product_param { num_output: 2 } }
"""


def test_hdf5_weights_of_a_weight_shared_net_as_caffe_writes_them(tmp_path):
    """Caffe's Net::ToHDF5 (net.cpp) writes a dataset only for the blobs a layer owns, so in a siamese net's
    file the sharing layer's group is empty, and CopyTrainedLayersFromHDF5 skips a missing dataset when the
    target blob is shared (param_owners_ != -1), refuses it otherwise and refuses more datasets than blobs
    (CHECK_LE, "Incompatible number of blobs").  Ours refused the empty group: 'has 0 blobs, the net's has 2'."""
    proto = tmp_path / "siamese.prototxt"
    proto.write_text(SIAMESE)
    w, bias = np.arange(6, dtype=np.float32).reshape(2, 3), np.array([1, 2], np.float32)
    path = tmp_path / "siamese.caffemodel.h5"
    with h5py.File(path, "w") as f:  # the layout Caffe's ToHDF5 writes
        for layer in ("data", "ip", "ip_p", "solo"):
            f.create_group(f"data/{layer}")
        f["data/ip/0"], f["data/ip/1"] = w, bias
        f["data/solo/0"], f["data/solo/1"] = w + 10, bias + 10
    net = caffe.Net(str(proto), str(path), caffe.TEST)
    for layer, offset in (("ip", 0), ("ip_p", 0), ("solo", 10)):
        np.testing.assert_array_equal(net.params[layer][0].data, w + offset)
        np.testing.assert_array_equal(net.params[layer][1].data, bias + offset)
    out = net.forward(a=np.array([[1, 0, -1]], np.float32), b=np.array([[1, 0, -1]], np.float32))
    np.testing.assert_array_equal(out["fb"], [[-1.0, 0.0]])  # [0 - 2 + 1, 3 - 5 + 2]
    with h5py.File(path, "r+") as f:
        del f["data/solo/1"]  # not shared: Caffe's LOG(FATAL) "Incompatible number of blobs for layer solo"
    with pytest.raises(ShapeMismatchError, match="layer 'solo' has no dataset '1'"):
        net.copy_from(str(path))
    with h5py.File(path, "r+") as f:
        f["data/solo/1"], f["data/solo/2"] = bias, bias
    with pytest.raises(ShapeMismatchError, match="layer 'solo' has 3 blobs, the net's has 2"):
        net.copy_from(str(path))


def test_save_hdf5_writes_only_owned_blobs_as_caffe(tmp_path):
    """Net::ToHDF5 saves a dataset only for a blob whose param_owners_ is -1 ("Only save params that own
    themselves"): the sharing layer's group stays empty.  Ours wrote the shared blobs again."""
    proto = tmp_path / "siamese.prototxt"
    proto.write_text(SIAMESE)
    net = caffe.Net(str(proto), caffe.TEST)
    path = tmp_path / "saved.caffemodel.h5"
    net.save_hdf5(str(path))
    with h5py.File(path, "r") as f:
        assert sorted(f["data"]) == ["b_data_1_split", "data", "ip", "ip_p", "solo"]  # every layer, Split included
        assert sorted(f["data/ip"]) == ["0", "1"] and sorted(f["data/solo"]) == ["0", "1"]
        assert len(f["data/ip_p"]) == 0 and len(f["data/data"]) == 0
    again = caffe.Net(str(proto), str(path), caffe.TEST)
    for layer in ("ip", "ip_p", "solo"):
        for mine, theirs in zip(net.params[layer], again.params[layer]):
            np.testing.assert_array_equal(mine.data, theirs.data)


def test_save_hdf5_writes_nothing_half_way(tmp_path, monkeypatch):
    """A failed save leaves the file that was there (written to a temporary file, renamed when complete)."""
    proto = tmp_path / "siamese.prototxt"
    proto.write_text(SIAMESE)
    net = caffe.Net(str(proto), caffe.TEST)
    path = tmp_path / "w.h5"
    path.write_bytes(b"the previous weights")

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(h5py.Group, "create_dataset", fail)
    with pytest.raises(CaffeCompatError, match="save_hdf5: cannot write"):
        net.save_hdf5(str(path))
    assert path.read_bytes() == b"the previous weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["siamese.prototxt", "w.h5"]


@pytest.mark.parametrize("name", ["snapshot_iter_10.caffemodel.h5", "weights.caffemodel"])
def test_the_net_constructor_reads_hdf5_weights_as_copy_from_does(proto, tmp_path, name):
    """``caffe.Net(prototxt, weights, phase)`` calls CopyTrainedLayersFrom, which reads an HDF5 file (Caffe
    asks H5Fis_hdf5: its signature, whatever the name) as HDF5; here the constructor tried it as a
    caffemodel ("not a valid binary NetParameter ... looks like an HDF5 file")."""
    a = _fed(proto, seed=0)
    path = tmp_path / name
    a.save_hdf5(str(path))
    b = caffe.Net(proto, str(path), caffe.TEST)
    c = caffe.Net(proto, caffe.TEST, weights=path)
    d = _fed(proto, seed=2)
    d.copy_from(str(path))
    for net in (b, c, d):
        for layer in a.params:
            for pa, pb in zip(a.params[layer], net.params[layer]):
                np.testing.assert_array_equal(pa.data, pb.data)


def test_share_with_shares_the_memory(proto):
    a, b = _fed(proto, seed=0), _fed(proto, seed=1)
    b.share_with(a)
    assert np.shares_memory(a.params["ip"][0].data, b.params["ip"][0].data)
    a.params["ip"][1].data[...] = 5.0
    b.blobs["data"].data[...] = a.blobs["data"].data
    np.testing.assert_allclose(b.forward(blobs=["ip"])["ip"], a.forward(blobs=["ip"])["ip"], rtol=0, atol=0)


_DUP = """layer {{ name: 'data' type: 'Input' top: 'data' input_param {{ shape {{ dim: 1 dim: 3 }} }} }}
layer {{ name: '{first}' type: 'InnerProduct' bottom: 'data' top: 'ip'
  inner_product_param {{ num_output: 2 weight_filler {{ type: 'gaussian' std: {std} }} }} }}
layer {{ name: '{second}' type: 'ReLU' bottom: 'ip' top: 'ip' }}
"""


def test_share_with_matches_layers_as_share_trained_layers_with(tmp_path):
    """Caffe's Net::ShareTrainedLayersWith (net.cpp) walks the source net's layers, blob-less ones included, and
    gives each to the *first* target layer of its name, CHECKing equal blob counts.  With an InnerProduct and a
    ReLU both called 'ip', the InnerProduct shares and the ReLU is left alone (ours also tried the ReLU:
    'layer 'ip' has 0 blobs, the source net's has 2'); a blob-less source layer named like a target layer with
    blobs fails Caffe's CHECK (ours skipped it silently)."""
    paths = []
    for i, (first, second, std) in enumerate([("ip", "relu", 1), ("ip", "ip", 2), ("relu", "ip", 3)]):
        paths.append(tmp_path / f"net{i}.prototxt")
        paths[-1].write_text(_DUP.format(first=first, second=second, std=std))
    source, target, blobless_source = (caffe.Net(str(p), caffe.TEST) for p in paths)
    target.share_with(source)
    assert np.shares_memory(target.params["ip"][0].data, source.params["ip"][0].data)
    with pytest.raises(ShapeMismatchError, match="layer 'ip' has 2 blobs, the source net's has 0"):
        target.share_with(blobless_source)


def test_forward_all_batches_pads_and_trims(tmp_path):
    path = tmp_path / "deploy.prototxt"
    path.write_text("""layer { name: 'data' type: 'Input' top: 'data' input_param { shape { dim: 3 dim: 6 } } }
layer { name: 'ip' type: 'InnerProduct' bottom: 'data' top: 'ip'
  inner_product_param { num_output: 2 weight_filler { type: 'gaussian' std: 1 } bias_filler { type: 'constant' value: 0.5 } } }""")
    net = caffe.Net(str(path), caffe.TEST)
    x = np.random.default_rng(3).standard_normal((7, 6)).astype(np.float32)
    out = net.forward_all(data=x)
    w, b = net.params["ip"][0].data, net.params["ip"][1].data
    assert out["ip"].shape == (7, 2)  # batches of 3: 3 + 3 + 1 padded with 2 zero rows, padding removed
    np.testing.assert_allclose(out["ip"], x @ w.T + b, rtol=1e-5, atol=1e-6)
    assert net.blobs["ip"].data.shape == (3, 2)
    np.testing.assert_allclose(net.blobs["ip"].data[1:], b.reshape(1, 2).repeat(2, 0), rtol=0, atol=0)  # padding


def test_constant_dummydata_tops_keep_what_the_script_writes(tmp_path):
    path = tmp_path / "dummy.prototxt"
    path.write_text("""layer { name: 'data' type: 'DummyData' top: 'x' top: 'label'
  dummy_data_param { shape { dim: 4 dim: 3 } shape { dim: 4 } data_filler { type: 'constant' value: 0.25 }
                     data_filler { type: 'constant' value: 2 } } }
layer { name: 'loss' type: 'SoftmaxWithLoss' bottom: 'x' bottom: 'label' top: 'loss' }""")
    net = caffe.Net(str(path), caffe.TRAIN)
    assert np.all(net.blobs["label"].data == 2) and np.all(net.blobs["x"].data == 0.25)  # filled at setup
    net.blobs["x"].data[...] = np.log([[1, 1, 2]] * 4)  # softmax (1/4, 1/4, 1/2)
    net.blobs["label"].data[...] = [0, 1, 2, 2]
    loss = float(net.forward()["loss"])
    assert loss == pytest.approx((2 * np.log(4) + 2 * np.log(2)) / 4, rel=1e-6)
    assert np.array_equal(net.blobs["label"].data, [0, 1, 2, 2])  # not refilled


def test_params_and_blobs_outlive_the_net(proto):
    net = _fed(proto)
    expected = net.params["conv"][0].data.sum()
    params, blobs = net.params, list(net.blobs.values())
    del net
    gc.collect()
    assert params["conv"][0].data.sum() == expected and params["conv"][0].diff.shape == (3, 2, 2, 2)
    assert blobs[0].data.shape == (5, 2, 3, 4)


def test_legacy_accessors_count_missing_axes_as_one(proto):
    """Caffe's LegacyShape: an axis a blob lacks is 1, so a (N, C) blob has num N, channels C, height and
    width 1; a 1-D blob num N; parameter blobs have the accessors too."""
    net = _fed(proto)
    legacy = lambda blob: (blob.num, blob.channels, blob.height, blob.width)  # noqa: E731
    assert legacy(net.blobs["data"]) == (5, 2, 3, 4)
    assert legacy(net.blobs["ip"]) == (5, 4, 1, 1) and legacy(net.blobs["label"]) == (5, 1, 1, 1)
    assert legacy(net.blobs["loss"]) == (1, 1, 1, 1)
    assert legacy(net.params["conv"][0]) == (3, 2, 2, 2) and legacy(net.params["conv"][1]) == (3, 1, 1, 1)
    assert legacy(net.params["ip"][0]) == (4, 3 * 4 * 5, 1, 1)


class _FeedLayer(caffe.Layer):
    """A Python data layer fed by the script through its own method (py-faster-rcnn's ``set_roidb`` style)."""

    def setup(self, bottom, top):
        self.batch = np.zeros((2, 3), np.float32)

    def set_batch(self, batch):
        self.batch = np.asarray(batch, np.float32)

    def reshape(self, bottom, top):
        top[0].reshape(*self.batch.shape)

    def forward(self, bottom, top):
        top[0].data[...] = self.batch * self.scale if hasattr(self, "scale") else self.batch

    def backward(self, top, propagate_down, bottom):
        pass


def test_python_layer_is_the_user_object(tmp_path):
    """pycaffe's ``net.layers[i]`` of a Python layer is the user's own object: its methods run, its
    attributes (``param_str``, the script's) are read and set there; ``type``/``blobs`` are Caffe's."""
    path = tmp_path / "feed.prototxt"
    path.write_text("""name: 'feed'
layer { name: 'feed' type: 'Python' top: 'x' python_param { module: 'surface_feed' layer: 'Feed' param_str: 'p' } }
layer { name: 'ip' type: 'InnerProduct' bottom: 'x' top: 'y'
  inner_product_param { num_output: 2 weight_filler { type: 'constant' value: 1 } } }""")
    caffe.register_python_layer("surface_feed", "Feed", _FeedLayer)
    try:
        net = caffe.Net(str(path), caffe.TEST)
        layer = net.layers[0]
        assert (layer.type, layer.blobs, layer.param_str, net.layer_dict["feed"].param_str) == ("Python", [], "p", "p")
        layer.set_batch(np.ones((2, 3)))
        np.testing.assert_array_equal(net.forward()["y"], np.full((2, 2), 3.0))
        net.layers[0].scale = 2.0  # set on the user object: the next forward reads it
        assert net.layer_dict["feed"].scale == 2.0
        np.testing.assert_array_equal(net.forward()["y"], np.full((2, 2), 6.0))
        with pytest.raises(AttributeError):
            net.layers[1].set_batch
    finally:
        python_user.unregister_python_layer("surface_feed", "Feed")


class _ScaleLayer(caffe.Layer):
    """Multiplies by ``self.k``; counts its setups."""

    setups = 0

    def setup(self, bottom, top):
        type(self).setups += 1
        self.k = 1.0

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        top[0].data[...] = self.k * bottom[0].data

    def backward(self, top, propagate_down, bottom):
        bottom[0].diff[...] = self.k * top[0].diff


def test_reshaping_an_input_keeps_the_python_layer_object(tmp_path):
    """Caffe's Net::Reshape reshapes every layer and never runs setup again: a Python layer keeps its state
    (here what the script set on it) when an input blob is reshaped."""
    path = tmp_path / "scale.prototxt"
    path.write_text("""name: 'scale'
layer { name: 'data' type: 'Input' top: 'data' input_param { shape { dim: 2 dim: 3 } } }
layer { name: 'scale' type: 'Python' bottom: 'data' top: 'y' python_param { module: 'surface_scale' layer: 'S' } }""")
    caffe.register_python_layer("surface_scale", "S", _ScaleLayer)
    _ScaleLayer.setups = 0
    try:
        net = caffe.Net(str(path), caffe.TEST)
        user = net.torch_net.layers["scale"].user
        user.k = 5.0
        net.blobs["data"].reshape(4, 3)
        net.blobs["data"].data[...] = 1
        np.testing.assert_array_equal(net.forward()["y"], np.full((4, 3), 5.0))
        assert _ScaleLayer.setups == 1 and net.torch_net.layers["scale"].user is user
    finally:
        python_user.unregister_python_layer("surface_scale", "S")


def test_a_net_or_weights_file_that_cannot_be_opened_is_pycaffes_runtime_error(proto, tmp_path):
    """pycaffe's Net checks both files (its CheckFile) before building and raises RuntimeError naming the
    file, in every constructor form; scripts catch RuntimeError there."""
    missing_net, missing_weights = str(tmp_path / "no.prototxt"), str(tmp_path / "no.caffemodel")
    with pytest.raises(RuntimeError, match="no.prototxt"):
        caffe.Net(missing_net, caffe.TEST)
    with pytest.raises(RuntimeError, match="no.caffemodel"):
        caffe.Net(proto, missing_weights, caffe.TEST)
    with pytest.raises(RuntimeError, match="no.caffemodel"):
        caffe.Net(proto, caffe.TEST, weights=missing_weights)


def test_blob_reshape_keeps_the_memory_within_its_capacity(tmp_path):
    """Caffe's Blob::Reshape reallocates only when the count exceeds the capacity (the largest count so far):
    reshaping an input to its own shape after writing it keeps what was written (and the arrays the script
    holds), a smaller shape sees the first values, growing back within the capacity sees them all, and
    only growing past it gives new zeros."""
    path = tmp_path / "sum.prototxt"
    path.write_text("""name: 'sum'
layer { name: 'data' type: 'Input' top: 'data' input_param { shape { dim: 2 dim: 3 } } }
layer { name: 'ip' type: 'InnerProduct' bottom: 'data' top: 'ip'
  inner_product_param { num_output: 1 weight_filler { type: 'constant' value: 1 } } }""")
    net = caffe.Net(str(path), caffe.TEST)
    held = net.blobs["data"].data
    held[...] = np.arange(6).reshape(2, 3)
    net.blobs["data"].reshape(2, 3)
    assert net.forward()["ip"].ravel().tolist() == [3.0, 12.0]
    held[0, 0] = 10  # still the blob's memory
    assert net.forward()["ip"].ravel().tolist() == [13.0, 12.0]
    net.blobs["data"].reshape(1, 3)
    assert net.forward()["ip"].ravel().tolist() == [13.0]
    net.blobs["data"].reshape(2, 3)
    assert net.forward()["ip"].ravel().tolist() == [13.0, 12.0]
    net.blobs["data"].reshape(3, 3)
    assert net.forward()["ip"].ravel().tolist() == [0.0, 0.0, 0.0]


def test_a_start_or_end_naming_no_layer_is_a_value_error(proto):
    """pycaffe finds ``start``/``end`` with ``list(net._layer_names).index(name)``: a name the net lacks is
    a ValueError, in forward and backward alike."""
    net = _fed(proto)
    for call in (lambda: net.forward(end="nope"), lambda: net.forward(start="nope"),
                 lambda: net.backward(start="nope"), lambda: net.backward(end="nope")):
        with pytest.raises(ValueError, match="no layer named 'nope'"):
            call()


def test_a_caffemodel_named_h5_is_read_as_a_caffemodel(proto, tmp_path):
    """Caffe's Net::CopyTrainedLayersFrom (net.cpp) picks the reader by H5Fis_hdf5, the file's signature, not
    by its name: a binary caffemodel saved as 'weights.h5' is read as a caffemodel.  Ours sent every '*.h5' to
    h5py ('cannot read ... as HDF5')."""
    a = _fed(proto, seed=0)
    path = tmp_path / "weights.h5"
    a.save(str(path))
    for net in (caffe.Net(proto, str(path), caffe.TEST), _fed(proto, seed=2)):
        net.copy_from(str(path))
        np.testing.assert_array_equal(net.params["ip"][0].data, a.params["ip"][0].data)


def test_net_layers_have_pycaffes_layer_methods(proto, tmp_path):
    """_caffe.cpp binds ``blobs``, ``setup`` (``LayerSetUp``), ``reshape`` and ``type`` on ``caffe.Layer``, the
    class of every ``net.layers`` entry, and no ``forward``/``backward``.  A built-in's ``setup`` is a
    LayerSetupError, a TypeError as pycaffe's (it takes no Python lists); a Python layer's is the user's."""
    net = caffe.Net(proto, caffe.TEST)
    conv = net.layers[1]
    assert callable(conv.setup) and callable(conv.reshape)
    with pytest.raises(TypeError, match="conv"):
        conv.setup([net.blobs["data"]], [net.blobs["conv"]])
    for name in ("forward", "backward"):
        assert not hasattr(conv, name)
    path = tmp_path / "user.prototxt"
    path.write_text("""name: 'user'
layer { name: 'data' type: 'Input' top: 'data' input_param { shape { dim: 2 dim: 3 } } }
layer { name: 'py' type: 'Python' bottom: 'data' top: 'y' python_param { module: 'surface_setup' layer: 'S' } }""")

    class _Setups(caffe.Layer):
        calls = 0

        def setup(self, bottom, top):
            type(self).calls += 1

        def reshape(self, bottom, top):
            top[0].reshape(*bottom[0].data.shape)

        def forward(self, bottom, top):
            top[0].data[...] = bottom[0].data

    caffe.register_python_layer("surface_setup", "S", _Setups)
    try:
        user = caffe.Net(str(path), caffe.TEST)
        user.layers[1].setup([], [])
        assert _Setups.calls == 2
    finally:
        python_user.unregister_python_layer("surface_setup", "S")

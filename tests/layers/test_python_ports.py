"""Native ports of Python layers: the label-shuffling data layer and madkn's histogram (distribution) loss,
checked against hand-built expectations and a literal per-point transcription of the published algorithm."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from google.protobuf import text_format

import caffe_compat as caffe
from caffe_compat.data.samplers import LabelShufflingStream
from caffe_compat.errors import DataError, FormatError, UnknownLayerError
from caffe_compat.io import read_blob, read_net
from caffe_compat.layers import layer_class
from caffe_compat.layers.python_ports import parse_param_str
from caffe_compat.net import CaffeNet
from caffe_compat.proto import caffe_pb2
from tests.conftest import fixture_path

DATA_DIR = fixture_path("data/cases.json").parent


def _param(text: str) -> caffe_pb2.LayerParameter:
    return text_format.Parse(text, caffe_pb2.LayerParameter())


def _shuffling(param_str: str, top: str = 'top: "data" top: "label"'):
    param = _param(f'name: "data" type: "Python" {top} python_param {{ module: "label_shuffling_layer" '
                   f'layer: "LabelShufflingLayer" param_str: "{param_str}" }}')
    return layer_class(param)(param, [], "train")


@pytest.fixture
def in_data_dir(monkeypatch):
    monkeypatch.chdir(DATA_DIR)
    return DATA_DIR


# python_param.param_str of the authors' cub200/train.prototxt and vehicleID/VGG1024_CCL_train.prototxt, verbatim
AUTHORS_CUB = (" mean_file: imagenet_mean.binaryproto \n source: ./db/cub200_train_lmdb \n batch_size: 128 \n "
               "scales : [1, 1.] \n max_number_object_per_label : 10 ")
AUTHORS_VEHICLEID = (" source: ../db/vehicleID_train_lmdb \n mean_file: VGG_mean.binaryproto \n batch_size: 150 \n "
                     "scales : [1.0, 1.0] \n max_number_object_per_label : 16 ")


def test_param_str_of_the_authors_prototxts():
    assert parse_param_str(AUTHORS_CUB, "data") == {"mean_file": "imagenet_mean.binaryproto",
                                                    "source": "./db/cub200_train_lmdb", "batch_size": 128,
                                                    "scales": [1, 1.0], "max_number_object_per_label": 10}
    assert parse_param_str(AUTHORS_VEHICLEID, "data") == {
        "source": "../db/vehicleID_train_lmdb", "mean_file": "VGG_mean.binaryproto", "batch_size": 150,
        "scales": [1.0, 1.0], "max_number_object_per_label": 16}


def test_param_str_values_and_errors():
    parsed = parse_param_str(" a : 1. \n b: [0.00390625, 1.]\n c: hist \n d: True\n e: 'quoted: text'\n", "x")
    assert parsed == {"a": 1.0, "b": [0.00390625, 1.0], "c": "hist", "d": True, "e": "quoted: text"}
    with pytest.raises(FormatError, match="layer 'x'.*not 'key: value'"):
        parse_param_str("source lmdb", "x")


def test_label_shuffling_ignores_mean_file_like_the_published_layer(in_data_dir):
    # the published layer never reads mean_file: top = (pixels - subtract) * scales, no mean
    with pytest.warns(UserWarning, match=r"layer 'data' \(LabelShufflingLayer\): mean_file 'mean.binaryproto' is "
                                         r"ignored.*apply_mean_file: true"):
        layer = _shuffling(r" mean_file: mean.binaryproto \n source: lmdb_raw \n batch_size: 5 \n scales : [0.5, 2.] "
                           r"\n subtract: [1, 3] \n max_number_object_per_label : 2 \n seed: 11")
    assert layer.mean is None and layer.output_shapes() == [(5, 3, 16, 20), (5, 1, 1, 1)]
    source = np.load("source_images.npz")
    images, labels = source["images_chw_bgr_uint8"].astype(np.float64), source["labels"]
    stream = LabelShufflingStream(labels, 2, 11)
    for _ in range(4):
        picked = stream.take(5)
        data, label = layer()
        assert data.dtype == torch.float32 and label.shape == (5, 1, 1, 1)
        expected = ((images[picked] - 1) * 0.5).astype(np.float32)
        assert np.array_equal(data.numpy(), expected)
        assert np.array_equal(label.numpy().reshape(-1), ((labels[picked] - 3.0) * 2.0).astype(np.float32))


def test_label_shuffling_authors_param_str_needs_no_mean_file_on_disk(in_data_dir):
    # the authors' cub200 param_str names imagenet_mean.binaryproto; the published layer never opens it
    text = AUTHORS_CUB.replace("./db/cub200_train_lmdb", "lmdb_raw").replace("128", "4").replace("\n", r"\n")
    with pytest.warns(UserWarning, match="imagenet_mean.binaryproto' is ignored"):
        layer = _shuffling(text + r"\n seed: 2")
    data, label = layer()
    images = np.load("source_images.npz")["images_chw_bgr_uint8"].astype(np.float32)
    picked = LabelShufflingStream(np.load("source_images.npz")["labels"], 10, 2).take(4)
    assert np.array_equal(data.numpy(), images[picked])  # scales [1, 1.]: the raw pixels


def test_label_shuffling_apply_mean_file_opt_in_subtracts_it(in_data_dir):
    layer = _shuffling(r" mean_file: mean.binaryproto \n apply_mean_file: true \n source: lmdb_raw \n batch_size: 5 "
                       r"\n scales : [0.5, 2.] \n subtract: [1, 3] \n max_number_object_per_label : 2 \n seed: 11")
    source = np.load("source_images.npz")
    images, labels = source["images_chw_bgr_uint8"].astype(np.float64), source["labels"]
    mean = read_blob("mean.binaryproto")[0].astype(np.float64)
    stream = LabelShufflingStream(labels, 2, 11)
    for _ in range(4):
        picked = stream.take(5)
        data, label = layer()
        expected = ((images[picked] - mean - 1) * 0.5).astype(np.float32)
        assert np.array_equal(data.numpy(), expected)
        assert np.array_equal(label.numpy().reshape(-1), ((labels[picked] - 3.0) * 2.0).astype(np.float32))
    with pytest.raises(FormatError, match=r"layer 'data' \(LabelShufflingLayer\): apply_mean_file: true needs a "
                                          r"mean_file"):
        _shuffling(r"source: lmdb_raw \n batch_size: 2 \n scales: [1, 1] \n apply_mean_file: true")
    with pytest.raises(FormatError, match="apply_mean_file must be true or false, got 'sometimes'"):
        _shuffling(r"source: lmdb_raw \n mean_file: mean.binaryproto \n batch_size: 2 \n scales: [1, 1] "
                   r"\n apply_mean_file: sometimes")


def test_label_shuffling_runs_respect_the_cap(in_data_dir):
    layer = _shuffling(r"source: lmdb_png \n batch_size: 6 \n scales: [1, 1] \n max_number_object_per_label: 1 "
                       r"\n seed: 0")
    labels = np.concatenate([layer()[1].reshape(-1).numpy() for _ in range(5)])
    # labels 1 (x2), 5, 8, 4, 7: with at most one image per visit no label repeats within a pass of 5 labels
    for start in range(0, 25, 5):
        assert sorted(labels[start:start + 5].tolist()) == [1, 4, 5, 7, 8]


def test_label_shuffling_over_a_list_file(tmp_path, monkeypatch):
    import cv2

    rng = np.random.RandomState(0)
    lines = []
    for i in range(6):
        image = rng.randint(0, 256, size=(4, 5, 3)).astype(np.uint8)
        cv2.imwrite(str(tmp_path / f"{i}.png"), image)
        lines.append(f"{i}.png {i // 2}\n")
    (tmp_path / "train.txt").write_text("".join(lines))
    monkeypatch.chdir(tmp_path)
    layer = _shuffling(r"source: train.txt \n root_folder: ./ \n batch_size: 4 \n scales: [1, 1] \n seed: 5")
    stream = LabelShufflingStream(np.array([0, 0, 1, 1, 2, 2]), math.inf, 5)
    picked = stream.take(4)
    data, label = layer()
    for k, i in enumerate(picked):
        assert np.array_equal(data[k].numpy(), cv2.imread(f"{i}.png").transpose(2, 0, 1).astype(np.float32))
    assert label.reshape(-1).tolist() == [i // 2 for i in picked]


@pytest.mark.parametrize("kind, dataset, split", [("cub", "cub200", "train"), ("sop", "sop", "test"),
                                                   ("vehicleid", "vehicleid", "small")])
def test_label_shuffling_over_a_native_data_set(tmp_path, kind, dataset, split):
    """``dataset`` + ``source`` = the data set's root: the records of ``split`` as the readers give them,
    batches in the sampler's order, images decoded by OpenCV (resized when asked)."""
    import cv2

    from caffe_compat.data import make_toy_data
    from caffe_compat.data.cub200 import read_cub200
    from caffe_compat.data.sop import read_sop
    from caffe_compat.data.vehicleid import read_vehicleid

    root = make_toy_data(kind, tmp_path / kind, seed=1, size=16)
    records = {"cub200": read_cub200, "sop": read_sop, "vehicleid": read_vehicleid}[dataset](root, split)
    layer = _shuffling(rf"dataset: {dataset} \n source: {root} \n split: {split} \n new_height: 12 \n "
                       rf"new_width: 10 \n batch_size: 6 \n scales: [1, 1] \n seed: 2")
    labels = np.array([r.label for r in records])
    picked = LabelShufflingStream(labels, math.inf, 2).take(6)
    data, label = layer()
    assert tuple(data.shape) == (6, 3, 12, 10)
    assert label.reshape(-1).tolist() == labels[picked].tolist()
    for k, i in enumerate(picked):
        expected = cv2.resize(cv2.imread(str(records[i].path)), (10, 12)).transpose(2, 0, 1)
        assert np.array_equal(data[k].numpy(), expected.astype(np.float32))


def test_label_shuffling_native_data_set_errors(tmp_path):
    with pytest.raises(FormatError, match=r"layer 'data' \(LabelShufflingLayer\): param_str 'dataset' must be one of"):
        _shuffling(rf"dataset: imagenet \n source: {tmp_path} \n batch_size: 2 \n scales: [1, 1]")
    with pytest.raises(DataError, match=r"layer 'data' \(LabelShufflingLayer\): .*classes.txt: file not found"):
        _shuffling(rf"dataset: cub200 \n source: {tmp_path} \n batch_size: 2 \n scales: [1, 1]")


def test_label_shuffling_seeded_by_the_net_and_through_the_facade(in_data_dir, tmp_path, monkeypatch):
    proto = tmp_path / "net.prototxt"
    proto.write_text('layer { name: "data" type: "Python" top: "data" top: "label" python_param { '
                     'module: "label_shuffling_layer" layer: "LabelShufflingLayer" '
                     r'param_str: "source: lmdb_jpeg \nbatch_size: 4 \nscales: [0.00390625, 1.] \n'
                     r'max_number_object_per_label: 2" } }')
    import caffe_compat.pycaffe

    monkeypatch.setitem(caffe_compat.pycaffe._MODE, "seed", None)  # restored after the test
    caffe.set_random_seed(3)
    first, second = caffe.Net(str(proto), caffe.TRAIN), caffe.Net(str(proto), caffe.TRAIN)
    other = CaffeNet(read_net(proto), phase="train", seed=4)
    labels = []
    for _ in range(3):
        a, b, c = first.forward(), second.forward(), other.forward()
        assert np.array_equal(a["data"], b["data"]) and np.array_equal(a["label"], b["label"])
        labels.append((a["label"].reshape(-1).tolist(), c["label"].reshape(-1).tolist()))
        assert first.blobs["data"].data.shape == (4, 3, 16, 20) and first.blobs["data"].data.max() <= 1.0
    assert [x for x, _ in labels] != [y for _, y in labels]  # another net seed, another stream


def test_label_shuffling_errors(in_data_dir):
    with pytest.raises(FormatError, match="param_str needs 'scales'"):
        _shuffling(r"source: lmdb_raw \n batch_size: 2")
    with pytest.raises(DataError, match="neither an LMDB directory nor a list file"):
        _shuffling(r"source: nowhere \n batch_size: 2 \n scales: [1, 1]")
    with pytest.raises(FormatError, match="one value per top"):
        _shuffling(r"source: lmdb_raw \n batch_size: 2 \n scales: [1]")
    data_only = _shuffling(r"source: lmdb_raw \n batch_size: 2 \n scales: [1]", top='top: "data"')
    assert data_only.output_shapes() == [(2, 3, 16, 20)] and len(data_only()) == 1


def test_label_shuffling_mean_of_another_size(in_data_dir, tmp_path):
    from caffe_compat.io import write_blob

    write_blob(np.zeros((1, 3, 8, 8), np.float32), tmp_path / "small_mean.binaryproto")
    with pytest.raises(DataError, match=r"mean_file .* has shape \(3, 8, 8\), the records \(3, 16, 20\)"):
        _shuffling(rf"source: lmdb_raw \n mean_file: {tmp_path / 'small_mean.binaryproto'} \n batch_size: 2 "
                   r"\n scales: [1, 1] \n apply_mean_file: true")
    with pytest.warns(UserWarning, match="is ignored"):  # without the opt-in the mismatch does not matter
        layer = _shuffling(rf"source: lmdb_raw \n mean_file: {tmp_path / 'small_mean.binaryproto'} \n batch_size: 2 "
                           r"\n scales: [1, 1]")
    assert layer()[0].shape == (2, 3, 16, 20)


def test_unregistered_python_layer_names_itself_and_the_way_out():
    param = _param('name: "my_loss" type: "Python" bottom: "x" top: "y" '
                   'python_param { module: "my_module" layer: "MyLayer" }')
    with pytest.raises(UnknownLayerError) as info:
        layer_class(param)
    message = str(info.value)
    assert "my_loss" in message and "my_module.MyLayer" in message
    assert "register_layer('Python:my_module.MyLayer')" in message and "never imports" in message


# ------------------------------------------------------------------------------------------- histogram loss

def _distribution_loss(param_str: str, count: int):
    param = _param('name: "loss" type: "Python" bottom: "cosine" bottom: "pair_label" top: "loss" loss_weight: 1 '
                   'python_param { module: "distribution_loss_layer" layer: "DistributionLossLayer" '
                   f'param_str: "{param_str}" }}')
    return layer_class(param)(param, [(count, 1, 1, 1), (count, 1, 1, 1)], "train")


def _reference(cos, labels, delta, kind, margin=0.0, alpha=1.0):
    """The published layer's steps, one point and one grid node at a time (float64)."""
    grid = np.arange(-1.0, 1.0 + delta, delta)
    x = np.clip(cos.astype(np.float32), -1, 1).astype(np.float64)
    L = np.zeros((len(grid), len(grid)))
    for i in range(len(grid)):
        for j in range(len(grid)):
            if kind == "simple":
                L[i, j] = float(grid[i] <= grid[j])
            elif kind == "linear":
                L[i, j] = max(0.0, margin - grid[i] + grid[j])
            else:
                L[i, j] = math.log(math.exp(alpha * (margin + grid[j] - grid[i])) + 1)

    def places(values):
        out = {}
        for k in np.argsort(values):
            node = 1
            while node < len(grid) and values[k] > grid[node]:
                node += 1
            if node == len(grid):
                break  # this value and every larger one stay unbinned
            out[k] = node
        return out

    def histogram(values, place):
        p = np.zeros(len(grid))
        for k, node in place.items():
            p[node] += values[k] - grid[node - 1]
            p[node - 1] += grid[node] - values[k]
        return p / (len(values) * delta)

    pos, neg = x[labels == 1], x[labels == -1]
    place_pos, place_neg = places(pos), places(neg)
    p_pos, p_neg = histogram(pos, place_pos), histogram(neg, place_neg)
    loss = p_pos @ L @ p_neg
    g_pos, g_neg = L @ p_neg, p_pos @ L
    grad = np.zeros(len(x))
    for values, place, g, mask in ((pos, place_pos, g_pos, labels == 1), (neg, place_neg, g_neg, labels == -1)):
        where = np.flatnonzero(mask)
        for k, node in place.items():
            grad[where[k]] = (g[node] - g[node - 1]) / (delta * len(values))
    return loss, grad


@pytest.mark.parametrize("kind,extra", [("simple", ""), ("linear", r"\n margin: 0.3"),
                                        ("exp", r"\n margin: 0.1 \n alpha: 3")])
def test_distribution_loss_matches_the_published_algorithm(kind, extra):
    rng = np.random.RandomState(2)
    count, delta = 40, 0.1
    cos = np.clip(rng.randn(count) * 0.5, -1.2, 1.2).astype(np.float32)  # some values beyond ±1 get clipped
    cos[:3] = [1.0, -1.0, 0.3]  # exactly on grid nodes
    labels = rng.choice([1, -1], size=count).astype(np.float32)
    margin = 0.3 if kind == "linear" else 0.1 if kind == "exp" else 0.0
    ref_loss, ref_grad = _reference(cos, labels, delta, kind, margin, 3.0)
    layer = _distribution_loss(rf"grid_delta : {delta} \n loss : {kind} \n distr_type : hist {extra}", count)
    x = torch.from_numpy(cos).reshape(count, 1, 1, 1).requires_grad_()
    (loss,) = layer(x, torch.from_numpy(labels).reshape(count, 1, 1, 1))
    assert loss.shape == (1,) and loss.dtype == torch.float32
    assert loss.item() == pytest.approx(ref_loss, rel=1e-6, abs=1e-7)
    loss.sum().backward()
    np.testing.assert_allclose(x.grad.reshape(-1).numpy(), ref_grad, rtol=1e-5, atol=1e-6)
    assert np.count_nonzero(ref_grad) > count // 2


def test_distribution_loss_gradcheck_float64():
    layer = _distribution_loss(r"grid_delta: 0.25 \n loss: exp \n alpha: 2", 12)
    rng = np.random.RandomState(5)
    nodes = np.arange(-1, 1.01, 0.25)
    values = rng.uniform(-0.95, 0.95, 12)
    values = np.where(np.abs(values[:, None] - nodes).min(1) < 1e-3, values + 0.01, values)  # off the kinks
    x = torch.tensor(values, dtype=torch.float64).reshape(12, 1, 1, 1).requires_grad_()
    labels = torch.tensor([1, -1, -1] * 4, dtype=torch.float64).reshape(12, 1, 1, 1)
    assert torch.autograd.gradcheck(lambda v: layer(v, labels)[0], (x,), eps=1e-6, atol=1e-7)


def test_distribution_loss_perfect_separation_and_errors():
    layer = _distribution_loss(r"grid_delta: 0.5", 4)
    cos = torch.tensor([0.75, 0.75, -0.75, -0.75]).reshape(4, 1, 1, 1)
    labels = torch.tensor([1.0, 1.0, -1.0, -1.0]).reshape(4, 1, 1, 1)
    assert layer(cos, labels)[0].item() == 0.0  # every positive more similar than every negative
    assert layer(-cos, labels)[0].item() == 1.0  # every positive less similar
    with pytest.raises(DataError, match="at least one positive and one negative"):
        layer(cos, torch.ones(4, 1, 1, 1))
    with pytest.raises(FormatError, match="distr_type 'beta' is not ported"):
        _distribution_loss(r"grid_delta: 0.1 \n distr_type: beta", 4)
    with pytest.raises(FormatError, match="param_str needs 'grid_delta'"):
        _distribution_loss(r"loss: simple", 4)
    with pytest.raises(FormatError, match="unknown loss 'square'"):
        _distribution_loss(r"grid_delta: 0.1 \n loss: square", 4)


def test_distribution_loss_without_negative_pairs_stops_eagerly_and_compiled():
    """Eagerly the error names the counts; in a graph (no host read there) it is an assertion naming the
    layer.  The histograms mask the pairs of the other kind instead of dropping them (no boolean indexing)."""
    layer = _distribution_loss(r"grid_delta: 0.5", 4)
    cos = torch.tensor([0.75, 0.25, -0.75, -0.25]).reshape(4, 1, 1, 1)
    with pytest.raises(DataError, match="needs at least one positive and one negative pair, got 4 and 0"):
        layer(cos, torch.ones(4, 1, 1, 1))
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    with pytest.raises(RuntimeError, match=r"layer 'loss' \(DistributionLossLayer\): needs at least one positive"):
        compiled(cos, torch.ones(4, 1, 1, 1))
    labels = torch.tensor([1.0, 0.0, -1.0, -1.0]).reshape(4, 1, 1, 1)  # 0: ignored
    assert compiled(cos, labels)[0].item() == layer(cos, labels)[0].item() == 0.0


def test_distribution_loss_in_a_net_after_cosine_similarity_batch():
    net_text = (
        'force_backward: true '
        'layer { name: "in" type: "Input" top: "feat" top: "label" input_param { shape { dim: 6 dim: 4 } '
        'shape { dim: 6 } } } '
        'layer { name: "cos" type: "CosineSimilarityBatch" bottom: "feat" bottom: "label" top: "cosine" '
        'top: "pair_label" } '
        'layer { name: "loss" type: "Python" bottom: "cosine" bottom: "pair_label" top: "loss" loss_weight: 1 '
        'python_param { module: "distribution_loss_layer" layer: "DistributionLossLayer" '
        r'param_str: " grid_delta : 0.01 \n loss : simple \n distr_type : hist " } }')
    net = CaffeNet(text_format.Parse(net_text, caffe_pb2.NetParameter()), phase="train")
    assert net.loss_weights == {"loss": 1.0}
    feat = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    blobs = net.forward(feat=feat, label=torch.tensor([0.0, 0, 1, 1, 2, 2]))
    assert 0.0 <= blobs["loss"].item() <= 1.0

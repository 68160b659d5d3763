"""NetBuilder, the loss heads and the toy digits net: errors, options, and a forward pass."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from caffe_compat.errors import FormatError
from caffe_compat.net_shapes import infer_shapes
from caffe_compat.net import CaffeNet
from caffe_compat.zoo import (InputData, LabelShufflingData, NetBuilder, add_loss_head, digits_embedding,
                              googlenet_embedding, paper_solver, vgg_cnn_m_1024_embedding)
from caffe_compat.zoo.data_layers import parse_param_str


def test_builder_sets_only_the_fields_given():
    b = NetBuilder("t")
    b.input("data", (2, 3, 8, 8))
    b.conv("c", "data", 4, 3)
    b.pool("p", "c", "AVE", kernel=2)
    conv, pool = b.net.layer[1].convolution_param, b.net.layer[2].pooling_param
    assert list(conv.stride) == [] and list(conv.pad) == [] and not conv.HasField("weight_filler")
    assert not pool.HasField("stride") and pool.pool == pool.AVE
    assert infer_shapes(b.net)[0]["p"] == (2, 4, 5, 5)  # conv 8 -> 6, pool k2 with stride unset (1) -> 5


def test_builder_refuses_a_bottom_nobody_produced():
    b = NetBuilder("t")
    b.input("data", (1, 3, 8, 8))
    with pytest.raises(FormatError, match="'conv9'.*'nodata'"):
        b.conv("conv9", "nodata", 4, 3)


def test_loss_head_errors():
    b = NetBuilder("t")
    b.input("x", (4, 8))
    b.input("label", (4,))
    with pytest.raises(FormatError, match="unknown loss head 'arcface'"):
        add_loss_head(b, "arcface", "x", "label")
    with pytest.raises(FormatError, match="only delta"):
        add_loss_head(b, "fappy", "x", "label", margin=0.5)
    with pytest.raises(FormatError, match="no field 'radius'"):
        add_loss_head(b, "triplet", "x", "label", radius=1.0)
    with pytest.raises(FormatError, match="needs a label blob"):
        add_loss_head(b, "histogram", "x", None)
    with pytest.raises(FormatError, match="needs a label blob"):
        googlenet_embedding(InputData((1, 3, 224, 224)), loss="fappy")


def test_loss_head_overrides_reach_metric_loss_param():
    b = NetBuilder("t")
    b.input("x", (4, 8))
    b.input("label", (4,))
    add_loss_head(b, "triplet", "x", "label", margin=0.5, mining="hard")
    head = b.net.layer[-1]
    assert head.type == "TripletLoss" and head.metric_loss_param.margin == 0.5
    assert head.metric_loss_param.mining == "hard"


def test_embedding_size_and_delta_options():
    net = vgg_cnn_m_1024_embedding(InputData((2, 3, 224, 224), label=True), embedding_size=256, delta=0.01)
    blobs, _ = infer_shapes(net)
    assert blobs["fc7"] == (2, 256) and blobs["cosine"] == (1, 1, 1, 1)
    assert net.layer[-1].fappy_loss_param.delta == pytest.approx(0.01)
    net = googlenet_embedding(LabelShufflingData("db/x", "m.binaryproto", 32, 4), embedding_size=128, loss="lifted")
    assert [l.type for l in net.layer[-2:]] == ["InnerProduct", "LiftedStructSimilaritySoftmaxLoss"]
    assert net.layer[-2].inner_product_param.num_output == 128
    assert parse_param_str(net.layer[0].python_param.param_str) == {
        "source": "db/x", "mean_file": "m.binaryproto", "batch_size": 32, "scales": [1.0, 1.0],
        "max_number_object_per_label": 4}


def test_parse_param_str_rejects_a_line_without_colon():
    with pytest.raises(FormatError, match="not 'key: value'"):
        parse_param_str("source: a\nbatch_size 3\n")


def test_paper_solver_unknown_dataset():
    with pytest.raises(FormatError, match="no authors' solver for data set 'cars196'"):
        paper_solver("cars196", "n.prototxt", "snap")


@pytest.mark.parametrize("size,fc_in", [(32, 1024), (64, 1024)])
def test_digits_net_sizes(size, fc_in):
    blobs, table = infer_shapes(digits_embedding(batch_size=8, image_size=size, loss=None))
    assert blobs["pool3"] == (8, 64, 4, 4)
    assert dict((l.name, l.param_shapes) for l in table)["fc_embedding"] == [(64, fc_in), (64,)]
    with pytest.raises(FormatError, match="32 or 64"):
        digits_embedding(image_size=48)


def test_digits_train_net_runs_and_its_loss_is_fappy_of_its_embedding():
    from caffe_compat.losses.fappy import FAPPYLoss

    net = CaffeNet(digits_embedding(batch_size=16, image_size=32), phase="train", seed=0)
    rng = np.random.RandomState(0)
    data = torch.from_numpy(rng.randn(16, 3, 32, 32).astype(np.float32) * 50)
    label = torch.tensor(np.repeat(np.arange(4), 4), dtype=torch.float32)
    blobs = {k: v.detach() for k, v in net(data=data, label=label).items()}
    expected = FAPPYLoss(delta=1e-4)(blobs["fc_embedding"].double(), label.long())
    assert torch.isfinite(blobs["loss"]) and float(blobs["loss"]) > 0
    assert float(blobs["loss"]) == pytest.approx(float(expected), rel=1e-4)

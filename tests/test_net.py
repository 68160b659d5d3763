"""CaffeNet against real Caffe: every blob, every parameter diff and the input diff of whole nets, plus the
net plumbing (include/exclude rules, automatic Split names, weight sharing, caffemodel I/O)."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch
from google.protobuf import text_format

from caffe_compat.errors import FormatError, ShapeMismatchError
from caffe_compat.io import read_net
from caffe_compat.net import CaffeNet, load_net
from caffe_compat.net_graph import insert_splits
from caffe_compat.proto import caffe_pb2
from tests.conftest import fixture_path, leading_rows, shared_reference

FORWARD_RTOL = 1e-4
BACKWARD_RTOL = 1e-3
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)) if b.size else 0.0


def _load(directory: str, device: str = "cpu"):
    net = load_net(str(fixture_path(f"{directory}/deploy.prototxt")), str(fixture_path(f"{directory}/weights.caffemodel")))
    return net.to(device), np.load(fixture_path(f"{directory}/blobs.npz")), np.load(fixture_path(f"{directory}/grads.npz"))


def _forward_backward(net, blobs_ref, grads_ref):
    device = next(net.parameters()).device
    blobs = net(**{n: torch.from_numpy(blobs_ref[n]).to(device) for n in net.input_names})
    top = {n: torch.from_numpy(grads_ref[f"diff:{n}"]).to(device)
           for n in net.output_names if f"diff:{n}" in grads_ref}
    net.zero_grad(set_to_none=True)
    diffs = net.backward(blobs, top, loss=False)
    return blobs, top, diffs


def _param_errors(net, grads_ref) -> dict[str, float]:
    errors = {}
    for key in grads_ref.files:
        if key.startswith("param_diff:"):
            layer, index = key[len("param_diff:"):].rsplit(":", 1)
            blob = net.params[layer][int(index)]
            grad = blob.grad if blob.grad is not None else torch.zeros_like(blob)
            errors[key] = _rel(grad.detach().cpu().numpy(), grads_ref[key])
    return errors


def _forward_errors(blobs, blobs_ref) -> dict[str, float]:
    assert list(blobs) == list(blobs_ref["__blob_order__"])  # every blob, split tops included, in Caffe's order
    return {name: _rel(leading_rows(blobs[name].detach().cpu().numpy(), blobs_ref[name]), blobs_ref[name])
            for name in blobs}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("directory", ["nets/googlenet_small", "nets/vgg_cnn_m_1024_small"])
def test_whole_net_matches_caffe_forward_and_backward(directory, device):
    net, blobs_ref, grads_ref = _load(directory, device)
    blobs, _, diffs = _forward_backward(net, blobs_ref, grads_ref)
    forward = _forward_errors(blobs, blobs_ref)
    worst = max(forward, key=forward.get)
    assert forward[worst] < FORWARD_RTOL, (worst, forward[worst])
    params = _param_errors(net, grads_ref)
    assert len(params) == sum(len(v) for v in net.params.values())
    worst = max(params, key=params.get)
    assert params[worst] < BACKWARD_RTOL, (worst, params[worst])
    assert _rel(diffs["data"].cpu().numpy(), grads_ref["diff:data"]) < BACKWARD_RTOL


# Caffe's LRN Backward reads its *top data*; in layer_zoo an in-place PReLU (prelu_ch) has overwritten that
# top before LRN's backward runs, so Caffe back-propagates with the post-PReLU values.  We compute the exact
# gradient instead; these blobs (upstream of lrn_across) inherit the difference.  See
# test_layer_zoo_lrn_backward_quirk, which reproduces Caffe's numbers from ours.
LRN_STALE_TOP = {"pool_ave_pad_pool_ave_pad_0_split_0", "pool_ave_pad", "data_data_0_split_3"}


@pytest.mark.parametrize("device", DEVICES)
def test_layer_zoo_matches_caffe_forward_and_backward(device):
    net, blobs_ref, grads_ref = _load("layer_zoo", device)
    blobs, top, diffs = _forward_backward(net, blobs_ref, grads_ref)
    forward = _forward_errors(blobs, blobs_ref)
    worst = max(forward, key=forward.get)
    assert forward[worst] < FORWARD_RTOL, (worst, forward[worst])
    params = _param_errors(net, grads_ref)
    worst = max(params, key=params.get)
    assert params[worst] < BACKWARD_RTOL, (worst, params[worst])
    # Every blob diff (outputs hold the diff that was set, so they are inputs here, not results).
    checked = 0
    for key in grads_ref.files:
        name = key[len("diff:"):]
        if not key.startswith("diff:") or name in top or name in LRN_STALE_TOP:
            continue
        ours, ref = diffs[name].cpu().numpy(), grads_ref[key]
        np.testing.assert_allclose(ours, ref, rtol=0, atol=BACKWARD_RTOL * np.abs(ref).max() + 1e-6, err_msg=name)
        checked += 1
    assert checked == len(net.blob_shapes) - len(top) - len(LRN_STALE_TOP)  # every other blob has a Caffe diff
    # in-place convention: diff of conv_g is w.r.t. the convolution output, before the leaky ReLU
    assert not torch.equal(blobs.diff_targets["conv_g"], blobs["conv_g"])
    # the quirk's blobs still agree loosely (the stale top only touches negative PReLU inputs)
    for name in LRN_STALE_TOP:
        assert _rel(diffs[name].cpu().numpy(), grads_ref[f"diff:{name}"]) < 2e-2


def test_layer_zoo_lrn_backward_quirk():
    """Caffe's number for the LRN bottom = the LRN gradient formula with the top data after prelu_ch."""
    net, blobs_ref, grads_ref = _load("layer_zoo")
    blobs, _, diffs = _forward_backward(net, blobs_ref, grads_ref)
    x = torch.from_numpy(blobs_ref["pool_ave_pad"]).double()
    stale_top = torch.from_numpy(blobs_ref["lrn_across"]).double()  # post-PReLU, what Caffe's LRN reads
    top_diff = diffs["lrn_across"].double()  # ours: d loss / d LRN output
    n, alpha, beta, k = 3, 0.5, 0.6, 1.5
    channels = x.shape[1]
    padded = torch.nn.functional.pad(x * x, (0, 0, 0, 0, 1, 1))
    scale = k + alpha / n * sum(padded[:, i:i + channels] for i in range(n))
    ratio = torch.nn.functional.pad(top_diff * stale_top / scale, (0, 0, 0, 0, 1, 1))
    caffe = top_diff * scale ** -beta - 2 * alpha * beta / n * x * sum(ratio[:, i:i + channels] for i in range(n))
    reference = grads_ref["diff:pool_ave_pad_pool_ave_pad_0_split_0"]
    assert _rel(caffe.numpy(), reference) < 1e-5
    assert _rel(diffs["pool_ave_pad_pool_ave_pad_0_split_0"].numpy(), reference) > 1e-3


def test_loss_weights_drive_the_objective_layer_zoo_nondiff():
    net, blobs_ref, grads_ref = _load("layer_zoo_nondiff")
    assert dict(net.loss_weights) == {"embed_sumsq": 1.0, "embed_nb_sum": 0.5}
    blobs = net(**{n: torch.from_numpy(blobs_ref[n]) for n in net.input_names})
    assert max(_forward_errors(blobs, blobs_ref).values()) < FORWARD_RTOL
    expected = float(blobs_ref["embed_sumsq"]) + 0.5 * float(blobs_ref["embed_nb_sum"])
    assert float(net.objective(blobs).detach()) == pytest.approx(expected, rel=1e-6)
    net.backward(blobs)  # no top diffs: the loss weights alone
    params = _param_errors(net, grads_ref)
    assert len(params) == 3 and max(params.values()) < 1e-5


def test_full_googlenet_outputs():
    directory = shared_reference("large/googlenet_full/weights.caffemodel").parent
    net = load_net(str(directory / "deploy.prototxt"), str(directory / "weights.caffemodel"))
    reference = np.load(directory / "outputs.npz")
    with torch.no_grad():
        blobs = net(data=torch.from_numpy(reference["data"]))
    errors = {name: _rel(blobs[name].numpy(), reference[name]) for name in reference.files if not name.startswith("__")}
    assert len(errors) == 7 and max(errors.values()) < FORWARD_RTOL, errors


@pytest.mark.parametrize("prototxt, weights", [
    ("googlenet_small_v1/deploy_v1.prototxt", "googlenet_small_v1/weights_v1.caffemodel"),
    ("googlenet_small/deploy.prototxt", "googlenet_small_v1/weights_v1.caffemodel"),
    ("googlenet_small_v1/deploy_v1.prototxt", "googlenet_small/weights.caffemodel"),
])
def test_legacy_v1_files_load_like_caffe(prototxt, weights):
    net = load_net(str(fixture_path(f"nets/{prototxt}")), str(fixture_path(f"nets/{weights}")))
    reference = np.load(fixture_path("nets/googlenet_small_v1/outputs.npz"))
    data = np.load(fixture_path("nets/googlenet_small/blobs.npz"))["data"]
    with torch.no_grad():
        blobs = net(data=torch.from_numpy(data))
    names = [n for n in reference.files if not n.startswith("__")]
    assert len(names) == 3
    for name in names:
        assert _rel(blobs[name].numpy(), reference[name]) < FORWARD_RTOL, name
    assert net.input_names == ["data"]


def test_legacy_v1_twin_matches_every_caffe_blob_and_gradient_of_googlenet_small():
    """The V1 prototxt + V1 caffemodel hold the same net and weights as googlenet_small: every blob,
    every parameter diff and the input diff match Caffe's googlenet_small fixture."""
    net = load_net(str(fixture_path("nets/googlenet_small_v1/deploy_v1.prototxt")),
                   str(fixture_path("nets/googlenet_small_v1/weights_v1.caffemodel")))
    blobs_ref = np.load(fixture_path("nets/googlenet_small/blobs.npz"))
    grads_ref = np.load(fixture_path("nets/googlenet_small/grads.npz"))
    blobs, _, diffs = _forward_backward(net, blobs_ref, grads_ref)
    forward = _forward_errors(blobs, blobs_ref)
    assert len(forward) > 100 and max(forward.values()) < FORWARD_RTOL
    params = _param_errors(net, grads_ref)
    assert len(params) == sum(len(v) for v in net.params.values()) and max(params.values()) < BACKWARD_RTOL
    assert _rel(diffs["data"].numpy(), grads_ref["diff:data"]) < BACKWARD_RTOL


# ---------------------------------------------------------------------------- plumbing on small nets

RULES_NET = """
name: "rules"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 } } }
layer { name: "train_only" type: "InnerProduct" bottom: "data" top: "a" include { phase: TRAIN }
        inner_product_param { num_output: 2 } }
layer { name: "test_only" type: "InnerProduct" bottom: "data" top: "a" include { phase: TEST }
        inner_product_param { num_output: 2 } }
layer { name: "level2" type: "InnerProduct" bottom: "data" top: "b" include { min_level: 2 }
        inner_product_param { num_output: 2 } }
layer { name: "upto1" type: "InnerProduct" bottom: "data" top: "c" include { max_level: 1 }
        inner_product_param { num_output: 2 } }
layer { name: "staged" type: "InnerProduct" bottom: "data" top: "d" include { stage: "x" stage: "y" }
        inner_product_param { num_output: 2 } }
layer { name: "not_x" type: "InnerProduct" bottom: "data" top: "e" include { not_stage: "x" }
        inner_product_param { num_output: 2 } }
layer { name: "excl_test" type: "InnerProduct" bottom: "data" top: "f" exclude { phase: TEST }
        inner_product_param { num_output: 2 } }
layer { name: "either" type: "InnerProduct" bottom: "data" top: "g" include { stage: "y" } include { phase: TRAIN }
        inner_product_param { num_output: 2 } }
"""


def _names(net):
    return [n for n in net.layer_names if not n.endswith("_split")]


@pytest.mark.parametrize("kwargs, expected", [
    ({"phase": "test"}, ["data", "test_only", "upto1", "not_x"]),
    ({"phase": "train"}, ["data", "train_only", "upto1", "not_x", "excl_test", "either"]),
    ({"phase": "test", "level": 2}, ["data", "test_only", "level2", "not_x"]),
    ({"phase": "test", "level": 1, "stages": ["x"]}, ["data", "test_only", "upto1"]),
    ({"phase": "test", "stages": ["x", "y"]}, ["data", "test_only", "upto1", "staged", "either"]),
    ({"phase": "test", "stages": ["y"]}, ["data", "test_only", "upto1", "not_x", "either"]),
])
def test_netstate_rules_include_exclude(kwargs, expected):
    net = CaffeNet(RULES_NET, **kwargs)
    assert _names(net) == expected
    assert net.phase == kwargs["phase"] and net.training == (kwargs["phase"] == "train")


def test_include_and_exclude_together_is_an_error():
    text = RULES_NET + 'layer { name: "bad" type: "InnerProduct" bottom: "data" top: "h" include { phase: TEST } ' \
                       'exclude { phase: TRAIN } inner_product_param { num_output: 2 } }'
    with pytest.raises(FormatError, match="'bad'.*either include rules or exclude rules"):
        CaffeNet(text)


SPLIT_NET = """
name: "split"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 4 dim: 4 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv" convolution_param { num_output: 2 kernel_size: 1
        weight_filler { type: "gaussian" } } }
layer { name: "relu" type: "ReLU" bottom: "conv" top: "conv" }
layer { name: "p1" type: "Pooling" bottom: "conv" top: "p1" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "p2" type: "Pooling" bottom: "conv" top: "p2" pooling_param { pool: AVE kernel_size: 2 stride: 2 } }
layer { name: "loss" type: "EuclideanLoss" bottom: "p1" bottom: "p2" top: "loss" }
"""


def test_automatic_splits_use_caffe_names_and_diffs_add_up():
    net = CaffeNet(SPLIT_NET)
    assert list(net.blob_shapes) == ["data", "conv", "conv_relu_0_split_0", "conv_relu_0_split_1", "p1", "p2", "loss"]
    assert "conv_relu_0_split" in net.layer_names
    assert net.output_names == ["loss"] and net.input_names == ["data"]
    assert dict(net.loss_weights) == {"loss": 1.0}  # a loss layer's top 0 weighs 1 by default
    blobs = net(data=torch.randn(2, 3, 4, 4))
    assert torch.equal(blobs["conv_relu_0_split_0"], blobs["conv"])
    torch.testing.assert_close(net.objective(blobs), blobs["loss"])
    diffs = net.backward(blobs)
    relu_mask = (blobs["conv"] > 0).float()
    expected = (diffs["conv_relu_0_split_0"] + diffs["conv_relu_0_split_1"]) * relu_mask
    torch.testing.assert_close(diffs["conv"], expected)  # w.r.t. the conv output: through the in-place ReLU
    assert float(diffs["conv_relu_0_split_0"].abs().sum()) > 0


def test_split_inherits_loss_weight_like_caffe():
    text = """
    layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 } } }
    layer { name: "id" type: "Power" bottom: "x" top: "y" loss_weight: 2.0 }
    layer { name: "sq" type: "Power" bottom: "y" top: "z" power_param { power: 2 } loss_weight: 1.0 }
    """
    split = insert_splits(text_format.Parse(text, caffe_pb2.NetParameter()))
    assert [layer.name for layer in split.layer] == ["in", "id", "y_id_0_split", "sq"]
    assert list(split.layer[2].loss_weight) == [2.0, 0.0] and not split.layer[1].loss_weight
    net = CaffeNet(text)
    x = torch.tensor([1.0, -3.0])
    blobs = net(x=x)
    assert float(net.objective(blobs)) == pytest.approx(2 * (1 - 3) + (1 + 9))


SHARED_NET = """
name: "shared"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 3 dim: 4 } } }
layer { name: "ip_a" type: "InnerProduct" bottom: "data" top: "a"
        param { name: "w" lr_mult: 3 } param { name: "b" decay_mult: 0 }
        inner_product_param { num_output: 2 weight_filler { type: "gaussian" } bias_filler { type: "constant" value: 1 } } }
layer { name: "ip_b" type: "InnerProduct" bottom: "data" top: "b"
        param { name: "w" } param { name: "b" }
        inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 100 } } }
layer { name: "frozen" type: "InnerProduct" bottom: "data" top: "c" param { lr_mult: 0 } param { lr_mult: 0 }
        inner_product_param { num_output: 2 } }
layer { name: "sum" type: "Eltwise" bottom: "a" bottom: "b" top: "s" }
"""


def test_weight_sharing_and_param_specs():
    net = CaffeNet(SHARED_NET, seed=1)
    wa, ba = net.params["ip_a"]
    wb, bb = net.params["ip_b"]
    assert wa is wb and ba is bb
    assert float(wa.detach().abs().max()) < 10  # the owner's filler, not the sharer's std 100
    assert torch.all(ba == 1)
    assert (wa.lr_mult, wa.decay_mult, ba.lr_mult, ba.decay_mult) == (3.0, 1.0, 1.0, 0.0)
    frozen = net.params["frozen"]
    assert [p.lr_mult for p in frozen] == [0.0, 0.0] and not any(p.requires_grad for p in frozen)
    assert len(list(net.parameters())) == 4  # unique tensors: shared w, b + frozen pair
    x = torch.randn(3, 4)
    blobs = net(data=x)
    diff = torch.randn(3, 2)
    net.backward(blobs, {"s": diff}, loss=False)
    torch.testing.assert_close(wa.grad, 2 * diff.T @ x)  # both uses add up, as Caffe's shared diff
    net.backward(blobs, {"s": diff}, loss=False)
    torch.testing.assert_close(wa.grad, 4 * diff.T @ x)  # Caffe accumulates param diffs
    moved = net.to(torch.float64)
    assert moved.params["ip_a"][0] is moved.params["ip_b"][0] and moved.params["ip_a"][0].dtype == torch.float64
    assert moved.params["ip_a"][0].lr_mult == 3.0


def test_sharing_shape_mismatch_is_reported():
    text = SHARED_NET.replace('param { name: "w" } param { name: "b" }\n        inner_product_param { num_output: 2',
                              'param { name: "w" } param { name: "b" }\n        inner_product_param { num_output: 5')
    with pytest.raises(ShapeMismatchError, match="'ip_b'.*'w'.*'ip_a'"):
        CaffeNet(text)


def test_fillers_seed_and_defaults():
    a, b, c = CaffeNet(SPLIT_NET, seed=5), CaffeNet(SPLIT_NET, seed=5), CaffeNet(SPLIT_NET, seed=6)
    assert torch.equal(a.params["conv"][0], b.params["conv"][0])
    assert not torch.equal(a.params["conv"][0], c.params["conv"][0])
    assert torch.count_nonzero(a.params["conv"][1]) == 0  # no bias_filler: Caffe's constant 0


def test_caffemodel_round_trip_is_byte_identical_to_caffe(tmp_path):
    net, _, _ = _load("nets/googlenet_small")
    out = tmp_path / "copy.caffemodel"
    net.save_caffemodel(out)
    assert out.read_bytes() == fixture_path("nets/googlenet_small/weights.caffemodel").read_bytes()
    with torch.no_grad():
        for blobs in net.params.values():
            for blob in blobs:
                blob.add_(torch.randn_like(blob))
    net.save_caffemodel(out)
    fresh = load_net(str(fixture_path("nets/googlenet_small/deploy.prototxt")), str(out))
    for name, blobs in net.params.items():
        for mine, theirs in zip(blobs, fresh.params[name]):
            assert torch.equal(mine, theirs)
    assert not list(tmp_path.glob(".*tmp"))  # written through a temporary file, then renamed


def _model_with(mutate):
    model = caffe_pb2.NetParameter.FromString(fixture_path("nets/googlenet_small/weights.caffemodel").read_bytes())
    mutate(model)
    return model


def test_load_caffemodel_shape_mismatch_message():
    net = load_net(str(fixture_path("nets/googlenet_small/deploy.prototxt")))

    def wrong_shape(model):
        blob = next(layer for layer in model.layer if layer.name == "inception_3a/1x1").blobs[0]
        blob.shape.dim[1] = 47
        del blob.data[47 * 16:]

    with pytest.raises(ShapeMismatchError, match=r"layer 'inception_3a/1x1' blob 0: .*\(16, 47, 1, 1\).*\(16, 48, 1, 1\)"):
        net.load_caffemodel(_model_with(wrong_shape))

    def one_blob(model):
        del next(layer for layer in model.layer if layer.name == "fc_embedding").blobs[1]

    with pytest.raises(ShapeMismatchError, match="'fc_embedding'.*1 blobs.*expects 2"):
        net.load_caffemodel(_model_with(one_blob))


def test_load_caffemodel_mismatch_names_the_file(tmp_path):
    """A caffemodel given by path is named in a blob count or shape error (which of ``weights: "a,b"``
    disagrees; caffe-compat test/train --weights named only the layer)."""
    net = load_net(str(fixture_path("nets/googlenet_small/deploy.prototxt")))
    good, bad = str(fixture_path("nets/googlenet_small/weights.caffemodel")), tmp_path / "bad.caffemodel"

    def wrong_shape(model):
        blob = next(layer for layer in model.layer if layer.name == "inception_3a/1x1").blobs[0]
        blob.shape.dim[1] = 47
        del blob.data[47 * 16:]

    bad.write_bytes(_model_with(wrong_shape).SerializeToString())
    with pytest.raises(ShapeMismatchError, match=rf"^{re.escape(str(bad))}: layer 'inception_3a/1x1' blob 0: "):
        net.load_caffemodels([good, str(bad)])


def test_load_caffemodel_by_name_keeps_absent_layers_and_accepts_legacy_dims():
    net = load_net(str(fixture_path("nets/googlenet_small/deploy.prototxt")), seed=3)
    before = net.params["conv1/7x7_s2"][0].detach().clone()

    def legacy_and_partial(model):
        keep = [layer for layer in model.layer if layer.name in ("fc_embedding", "not_in_the_net")]
        fc = keep[0]
        for blob in fc.blobs:  # legacy 4-D dims: weight 1x1xMxK, bias 1x1x1xN
            dims = list(blob.shape.dim)
            blob.ClearField("shape")
            blob.num, blob.channels = 1, 1
            blob.height, blob.width = (dims[0], dims[1]) if len(dims) == 2 else (1, dims[0])
        extra = caffe_pb2.LayerParameter(name="not_in_the_net", type="InnerProduct")
        extra.blobs.add().data.append(1.0)
        del model.layer[:]
        model.layer.extend([fc, extra])

    net.load_caffemodel(_model_with(legacy_and_partial))
    assert torch.equal(net.params["conv1/7x7_s2"][0], before)
    assert tuple(net.params["fc_embedding"][0].shape) == (128, 256)
    reference = caffe_pb2.NetParameter.FromString(fixture_path("nets/googlenet_small/weights.caffemodel").read_bytes())
    fc = next(layer for layer in reference.layer if layer.name == "fc_embedding")
    np.testing.assert_array_equal(net.params["fc_embedding"][0].detach().numpy().ravel(), np.asarray(fc.blobs[0].data))


_TWO_LAYERS_NAMED_IP = """
name: "dup"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 } } }
layer { name: "ip" type: "%s" bottom: "data" top: "a" %s }
layer { name: "ip" type: "%s" bottom: "a" top: "%s" %s }
"""


def _ip_caffemodel(path):
    model = caffe_pb2.NetParameter()
    layer = model.layer.add(name="ip", type="InnerProduct")
    weight = layer.blobs.add()
    weight.shape.dim.extend([2, 3])
    weight.data.extend([0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    bias = layer.blobs.add()
    bias.shape.dim.append(2)
    bias.data.extend([1.0, 2.0])
    path.write_bytes(model.SerializeToString())
    return str(path)


def test_a_caffemodel_layer_goes_to_the_first_net_layer_of_its_name(tmp_path):
    """Caffe's Net::CopyTrainedLayersFrom (net.cpp) finds its target by a linear search of layer_names_: the first
    layer of the name.  An InnerProduct 'ip' followed by a ReLU also called 'ip' takes the weights (we copied into
    the last 'ip', the ReLU: 'the weights have 2 blobs, the net expects 0'); with the ReLU first, Caffe's CHECK
    'Incompatible number of blobs for layer ip' (2 vs. 0) fails."""
    weights = _ip_caffemodel(tmp_path / "ip.caffemodel")
    ip = "inner_product_param { num_output: 2 }"
    net = load_net(_TWO_LAYERS_NAMED_IP % ("InnerProduct", ip, "ReLU", "a", ""), weights, strict=True)
    out = net(data=torch.tensor([[1.0, -1.0, 2.0]]))["a"]
    # x . w_row + b: [0 - 1 + 4 + 1, 3 - 4 + 10 + 2]
    np.testing.assert_array_equal(out.detach().numpy(), [[4.0, 11.0]])
    with pytest.raises(ShapeMismatchError, match="'ip'.*2 blobs.*expects 0"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the InnerProduct 'ip' is reported left at its fillers first
        load_net(_TWO_LAYERS_NAMED_IP % ("ReLU", "", "InnerProduct", "b", ip), weights)


def test_a_stored_diff_is_loaded_into_the_param_diff_like_blob_from_proto(tmp_path):
    """Caffe's Blob::FromProto (blob.cpp) also copies a BlobProto's diff into the blob's diff (double_diff when
    present), CHECKing its count, so a snapshot_diff: true snapshot brings its diffs back (pycaffe's .diff, and
    the sum a later backward accumulates onto); ours dropped them and left the diffs at zero."""
    model = caffe_pb2.NetParameter()
    layer = model.layer.add(name="ip", type="InnerProduct")
    weight = layer.blobs.add(data=[0.0, 1.0, 2.0, 3.0, 4.0, 5.0], diff=[0.5, -0.5, 1.5, 2.5, 3.5, 4.5])
    weight.shape.dim.extend([2, 3])
    bias = layer.blobs.add(data=[1.0, 2.0], double_diff=[0.1, 0.2], diff=[7.0, 7.0])
    bias.shape.dim.append(2)
    path = tmp_path / "snapshot_with_diffs.caffemodel"
    path.write_bytes(model.SerializeToString())
    prototxt = _TWO_LAYERS_NAMED_IP % ("InnerProduct", "inner_product_param { num_output: 2 }", "ReLU", "a", "")
    net = load_net(prototxt, str(path))
    w, b = net.params["ip"]
    np.testing.assert_array_equal(w.grad.numpy(), [[0.5, -0.5, 1.5], [2.5, 3.5, 4.5]])
    np.testing.assert_array_equal(b.grad.numpy(), np.array([0.1, 0.2], np.float32))
    del bias.double_diff[:]
    bias.diff.append(7.0)  # three diff values for a blob of two: Caffe's CHECK_EQ(count_, proto.diff_size())
    path.write_bytes(model.SerializeToString())
    with pytest.raises(FormatError, match=r"layer 'ip' blob 1: the blob holds 3 diff values, its shape \(2,\) needs 2"):
        load_net(prototxt, str(path))


def test_state_dict_keys_and_round_trip():
    net, _, _ = _load("nets/googlenet_small")
    state = net.state_dict()
    assert "layers.conv1__7x7_s2.weight" in state and "layers.inception_3a__1x1.bias" in state
    assert net.module_names["inception_3a/1x1"] == "inception_3a__1x1"
    fresh = load_net(str(fixture_path("nets/googlenet_small/deploy.prototxt")), seed=9)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.params["fc_embedding"][0], net.params["fc_embedding"][0])


def test_param_specs_from_the_prototxt():
    net, _, _ = _load("nets/googlenet_small")
    w, b = net.params["fc_embedding"]
    assert (w.lr_mult, w.decay_mult, b.lr_mult, b.decay_mult) == (10.0, 1.0, 20.0, 0.0)
    assert list(net.params)[0] == "conv1/7x7_s2" and len(net.params) == 58


def test_inputs_numpy_unknown_names_and_partial_runs():
    net = CaffeNet(SPLIT_NET, seed=2)
    x = np.random.RandomState(0).randn(2, 3, 4, 4).astype(np.float32)
    full = net(data=x)
    with pytest.raises(FormatError, match="cannot feed.*conv"):
        net(conv=torch.zeros(2, 2, 4, 4))
    partial = net.run({"conv_relu_0_split_0": full["conv"], "conv_relu_0_split_1": full["conv"]}, start="p1")
    torch.testing.assert_close(partial["loss"], full["loss"])
    head = net.run({"data": x}, end="relu")
    assert list(head) == ["data", "conv"] and torch.equal(head["conv"], full["conv"])
    with torch.no_grad():
        assert not net(data=x)["loss"].requires_grad


def test_train_eval_do_not_change_the_caffe_phase():
    net = CaffeNet(RULES_NET, phase="train")
    net.eval()
    assert net.phase == "train" and not net.training
    assert all(net.layer(name).phase == "train" for name in _names(net))


def test_layers_the_caffemodel_supplies_draw_nothing_from_the_fillers(tmp_path):
    """load_net(weights=...) fills only the layers the caffemodel lacks (here all but fc_embedding), in
    net order from the seeded generator; the supplied layer holds the stored values."""
    deploy = str(fixture_path("nets/googlenet_small/deploy.prototxt"))
    partial = tmp_path / "only_conv1.caffemodel"

    def only_conv1(model):
        keep = [layer for layer in model.layer if layer.name == "conv1/7x7_s2"]
        del model.layer[:]
        model.layer.extend(keep)

    partial.write_bytes(_model_with(only_conv1).SerializeToString())
    loaded = load_net(deploy, str(partial), seed=4)
    stored = read_net(str(partial)).layer[0]
    np.testing.assert_array_equal(loaded.params["conv1/7x7_s2"][0].detach().numpy().ravel(), np.asarray(stored.blobs[0].data))
    # every other layer as reinitialize() fills it when conv1 is skipped
    expected = load_net(deploy, seed=0)
    expected.reinitialize(4, skip=frozenset({expected.module_names["conv1/7x7_s2"]}))
    for name, blobs in expected.params.items():
        if name != "conv1/7x7_s2":
            for want, got in zip(blobs, loaded.params[name]):
                assert torch.equal(want, got), name
    # and differently from a fill of every layer (conv1's draws are skipped)
    assert not torch.equal(load_net(deploy, seed=4).params["conv2/3x3"][0], loaded.params["conv2/3x3"][0])


# ------------------------------------------------------------------ .train()/.eval() follow Caffe's phases

MODES_NET = """
name: "modes"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 4 dim: 3 dim: 2 dim: 2 } } }
layer { name: "bn" type: "BatchNorm" bottom: "data" top: "bn" batch_norm_param { moving_average_fraction: 0.5 } }
layer { name: "bn_batch" type: "BatchNorm" bottom: "data" top: "bn_batch"
        batch_norm_param { use_global_stats: false moving_average_fraction: 0.5 } }
layer { name: "bn_test" type: "BatchNorm" bottom: "data" top: "bn_test" phase: TEST }
layer { name: "drop" type: "Dropout" bottom: "data" top: "drop" dropout_param { dropout_ratio: 0.5 } }
layer { name: "mc_drop" type: "Dropout" bottom: "data" top: "mc_drop" phase: TRAIN }
layer { name: "train_only" type: "Power" bottom: "data" top: "t" include { phase: TRAIN } }
"""
_BN_MEAN, _BN_VAR, _BN_FACTOR = np.array([2.0, 4.0, 6.0]), np.array([8.0, 18.0, 32.0]), 2.0  # global: m 1,2,3; v 4,9,16


def _modes_net(phase):
    net = CaffeNet(MODES_NET, phase=phase)
    with torch.no_grad():
        for name in ("bn", "bn_batch", "bn_test"):
            mean, var, factor = net.params[name]
            mean.copy_(torch.tensor(_BN_MEAN)), var.copy_(torch.tensor(_BN_VAR)), factor.fill_(_BN_FACTOR)
    for name in ("drop", "mc_drop"):
        net.layer(name).generator = torch.Generator().manual_seed(3)
    return net


def _modes_input():
    return np.random.RandomState(11).randn(4, 3, 2, 2).astype(np.float32) * 3 + 1


def _global_bn(x):  # Caffe's TEST BatchNorm: (x - mean/s) / sqrt(var/s + eps), eps = float32(1e-5)
    eps = float(np.float32(1e-5))
    mean, var = (_BN_MEAN / _BN_FACTOR).reshape(1, 3, 1, 1), (_BN_VAR / _BN_FACTOR).reshape(1, 3, 1, 1)
    return (x.astype(np.float64) - mean) / np.sqrt(var + eps)


def _batch_bn(x):  # Caffe's TRAIN BatchNorm: biased batch variance; stats λ·blob + μ, λ·blob + m/(m-1)·σ²
    x = x.astype(np.float64)
    mu, var = x.mean(axis=(0, 2, 3)), x.var(axis=(0, 2, 3))
    m = x.size // 3
    y = (x - mu.reshape(1, 3, 1, 1)) / np.sqrt(var.reshape(1, 3, 1, 1) + float(np.float32(1e-5)))
    return y, 0.5 * _BN_MEAN + mu, 0.5 * _BN_VAR + m / (m - 1) * var, 0.5 * _BN_FACTOR + 1


def _assert_dropped(net, blobs, name, x):
    mask = net.layer(name).last_mask.numpy()
    assert 0 < mask.sum() < mask.size
    np.testing.assert_array_equal(blobs[name].numpy(), np.where(mask, x * np.float32(2.0), 0))


def _assert_stats(net, name, mean, var, factor):
    got = [b.detach().numpy().astype(np.float64) for b in net.params[name]]
    np.testing.assert_allclose(got[0], mean, rtol=1e-6), np.testing.assert_allclose(got[1], var, rtol=1e-6)
    np.testing.assert_allclose(got[2], [factor], rtol=1e-7)


def test_eval_on_a_train_net_gives_caffe_test_behaviour_and_keeps_the_layer_set():
    x = _modes_input()
    net = _modes_net("train")
    assert net.training and net.layer("drop").training and not net.layer("bn_test").training  # pinned: own phase
    before = net(data=x)
    _assert_dropped(net, before, "drop", x)
    y, mean, var, factor = _batch_bn(x)
    np.testing.assert_allclose(before["bn"].detach().numpy(), y, rtol=1e-5, atol=1e-5)
    _assert_stats(net, "bn", mean, var, factor)

    net = _modes_net("train").eval()
    assert not net.training and net.phase == "train" and "t" in net.blob_shapes  # same layer set
    assert net.layer("mc_drop").phase == "train" and not net.layer("mc_drop").training  # equals the net's: follows
    with torch.no_grad():
        blobs = net(data=torch.from_numpy(x))
    assert torch.equal(blobs["drop"], torch.from_numpy(x)) and torch.equal(blobs["mc_drop"], torch.from_numpy(x))
    np.testing.assert_allclose(blobs["bn"].numpy(), _global_bn(x), rtol=1e-5, atol=1e-6)
    _assert_stats(net, "bn", _BN_MEAN, _BN_VAR, _BN_FACTOR)  # no moving-average update in TEST
    y, mean, var, factor = _batch_bn(x)  # explicit use_global_stats: false is kept in eval mode
    np.testing.assert_allclose(blobs["bn_batch"].numpy(), y, rtol=1e-5, atol=1e-5)
    _assert_stats(net, "bn_batch", mean, var, factor)
    np.testing.assert_allclose(blobs["bn_test"].numpy(), _global_bn(x), rtol=1e-5, atol=1e-6)
    assert torch.equal(blobs["t"], torch.from_numpy(x))


def test_train_on_a_test_net_gives_caffe_train_behaviour_and_eval_restores_it():
    x = _modes_input()
    reference = _modes_net("test")
    assert not reference.training and reference.layer("mc_drop").training  # pinned to TRAIN in a TEST net
    expected = reference(data=x)
    assert torch.equal(expected["drop"], torch.from_numpy(x))
    _assert_dropped(reference, expected, "mc_drop", x)
    net = _modes_net("test").train()
    assert net.phase == "test" and "t" not in net.blob_shapes
    blobs = net(data=x)
    _assert_dropped(net, blobs, "drop", x)
    y, mean, var, factor = _batch_bn(x)
    np.testing.assert_allclose(blobs["bn"].detach().numpy(), y, rtol=1e-5, atol=1e-5)
    _assert_stats(net, "bn", mean, var, factor)
    np.testing.assert_allclose(blobs["bn_test"].detach().numpy(), y, rtol=1e-5, atol=1e-5)  # phase = net's: follows
    _assert_dropped(net, blobs, "mc_drop", x)  # pinned to TRAIN
    net = _modes_net("test").train().eval()  # back to the phase's own behaviour, bit for bit
    blobs = net(data=x)
    for name in expected:
        assert torch.equal(blobs[name], expected[name]), name


def test_checkpoint_round_trip_keeps_train_eval_semantics(tmp_path):
    """Saved nets write every layer's phase (Caffe's ToProto does): a phase equal to the net's still follows
    the mode after reloading, a pinned one stays pinned."""
    from caffe_compat.checkpoint import load_checkpoint, save_checkpoint

    save_checkpoint(_modes_net("train"), tmp_path / "m.pt")
    net = load_checkpoint(tmp_path / "m.pt").eval()
    x = _modes_input()
    blobs = net(data=x)
    assert torch.equal(blobs["drop"], torch.from_numpy(x))
    np.testing.assert_allclose(blobs["bn"].detach().numpy(), _global_bn(x), rtol=1e-5, atol=1e-6)
    assert not net.layer("bn_test").training and net.train().layer("bn_test").training is False


def test_unknown_layer_type_error_names_layer_type_and_how_to_register():
    from caffe_compat.errors import UnknownLayerError

    text = """name: "unknown"
    layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 2 } } }
    layer { name: "mystery/1" type: "FancyNorm" bottom: "data" top: "out" }
    """
    with pytest.raises(UnknownLayerError) as info:
        load_net(text)
    message = str(info.value)
    assert "layer 'mystery/1'" in message and "unknown layer type 'FancyNorm'" in message
    assert "@caffe_compat.layers.register_layer('FancyNorm')" in message and "CaffeLayer subclass" in message
    assert "Python layer" not in message


def test_layers_named_like_module_dict_attributes_build_and_round_trip(tmp_path):
    """Caffe allows any layer name; ``items``, ``train`` or ``forward`` are ModuleDict attributes, so their
    module keys get a suffix while pycaffe-style names, forward and the caffemodel keep the Caffe names."""
    text = """name: "n"
    layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 } } }
    layer { name: "items" type: "InnerProduct" bottom: "x" top: "a" inner_product_param { num_output: 4
            weight_filler { type: "gaussian" std: 1 } } }
    layer { name: "train" type: "ReLU" bottom: "a" top: "a" }
    layer { name: "forward" type: "InnerProduct" bottom: "a" top: "b" inner_product_param { num_output: 2
            weight_filler { type: "gaussian" std: 1 } bias_filler { type: "constant" value: 0.5 } } }"""
    net = CaffeNet(text, seed=3)
    assert net.module_names == {"in": "in", "items": "items_2", "train": "train_2", "forward": "forward_2"}
    assert callable(net.layers.items) and callable(net.layers.train)  # the ModuleDict's own methods intact
    x = torch.randn(2, 3)
    w1, w2, b2 = net.params["items"][0], net.params["forward"][0], net.params["forward"][1]
    expected = torch.relu(x @ w1.T) @ w2.T + b2
    assert torch.equal(net(x=x)["b"], expected)
    path = tmp_path / "named.caffemodel"
    net.save_caffemodel(path)
    again = CaffeNet(text, seed=9, weights=str(path))
    assert torch.equal(again(x=x)["b"], expected)
    assert [layer.name for layer in read_net(path).layer] == ["in", "items", "train", "forward"]


@pytest.mark.parametrize("phase", ["train", "test"])
def test_built_modes_equal_what_train_sets(phase):
    """A built net's torch flags (set without visiting every port) are those ``net.train(phase == "train")``
    sets: the net, its ModuleDict and every port, a layer pinned to the other phase keeping its own."""
    text = """name: "n"
    layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 4 dim: 3 dim: 2 dim: 2 } } }
    layer { name: "bn" type: "BatchNorm" bottom: "x" top: "y" }
    layer { name: "drop" type: "Dropout" bottom: "y" top: "z" phase: TEST }
    layer { name: "drop2" type: "Dropout" bottom: "z" top: "w" phase: TRAIN }"""
    nets = [CaffeNet(text, phase=phase),
            CaffeNet(str(fixture_path("nets/googlenet_small/deploy.prototxt")), phase=phase, fill=False)]
    for net in nets:
        built = {name: module.training for name, module in net.named_modules()}
        net.train(net.phase == "train")
        assert built == {name: module.training for name, module in net.named_modules()}
    pinned = nets[0].layers
    assert (pinned["drop"].training, pinned["drop2"].training, pinned["bn"].training) == (False, True, phase == "train")

"""Caffe's loss layers against real-Caffe fixtures (tests/fixtures/losses), gradcheck and closed forms."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from google.protobuf import text_format

from caffe_compat.errors import DataError, FormatError, ParseError
from caffe_compat.layers import layer_class
from caffe_compat.proto import caffe_pb2
from tests.conftest import fixture_path
from tests.layers.zoo_single_layer import make_layer

LOSS_DIR = fixture_path("losses")
CASES = json.loads((LOSS_DIR / "cases.json").read_text())


def parse_net(text: str) -> caffe_pb2.NetParameter:
    return text_format.Parse(text, caffe_pb2.NetParameter())


def build(net: caffe_pb2.NetParameter, **kwargs):
    """The loss layer of a case net, with bottom shapes from its Input layers."""
    shapes = {l.top[0]: tuple(l.input_param.shape[0].dim) for l in net.layer if l.type == "Input"}
    (param,) = [l for l in net.layer if l.type != "Input"]
    return layer_class(param)(param, [shapes[b] for b in param.bottom], "train", **kwargs), param


def layer_from(type_name: str, bottom_shapes, extra: str = "", tops=("loss",)):
    text = f'name: "l" type: "{type_name}" ' + " ".join(f'top: "{t}"' for t in tops) + " " + extra
    for i in range(len(bottom_shapes)):
        text += f' bottom: "b{i}"'
    param = text_format.Parse(text, caffe_pb2.LayerParameter())
    return layer_class(param)(param, bottom_shapes, "train")


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_matches_caffe(case):
    net = parse_net((LOSS_DIR / f"{case['name']}.prototxt").read_text())
    kwargs = {"source_dir": LOSS_DIR} if case["type"] == "InfogainLoss" else {}
    layer, param = build(net, **kwargs)
    assert layer.is_loss and layer.caffe_type == case["type"]
    ref = np.load(LOSS_DIR / f"{case['name']}.npz")
    bottoms = [torch.tensor(ref[b], requires_grad=f"diff:{b}" in ref.files) for b in param.bottom]
    (loss,) = layer(*bottoms)
    assert loss.shape == () and loss.dtype == torch.float32
    assert layer.output_shapes() == [()]
    want = float(ref["loss"])
    assert want == pytest.approx(case["loss"], rel=0, abs=0)
    np.testing.assert_allclose(loss.item(), want, rtol=1e-5, atol=1e-6)
    (float(ref["loss_weight"]) * loss).backward()
    for name, x in zip(param.bottom, bottoms):
        key = f"diff:{name}"
        if key not in ref.files:
            continue
        np.testing.assert_allclose(x.grad.numpy(), ref[key], rtol=1e-5, atol=1e-6, err_msg=f"{case['name']} {key}")


def test_every_fixture_case_is_covered_and_every_type_appears():
    types = {c["type"] for c in CASES}
    assert types == {"ContrastiveLoss", "EuclideanLoss", "SoftmaxWithLoss", "SigmoidCrossEntropyLoss", "HingeLoss",
                     "InfogainLoss", "MultinomialLogisticLoss"}
    assert len(CASES) == len(list(LOSS_DIR.glob("*.prototxt")))


def test_worst_relative_loss_error_is_small():
    """Reports (and bounds) the worst relative loss error over all cases."""
    worst = 0.0
    for case in CASES:
        net = parse_net((LOSS_DIR / f"{case['name']}.prototxt").read_text())
        kwargs = {"source_dir": LOSS_DIR} if case["type"] == "InfogainLoss" else {}
        layer, param = build(net, **kwargs)
        ref = np.load(LOSS_DIR / f"{case['name']}.npz")
        (loss,) = layer(*[torch.tensor(ref[b]) for b in param.bottom])
        want = float(ref["loss"])
        worst = max(worst, abs(loss.item() - want) / max(abs(want), 1e-12) if want else abs(loss.item()))
    print(f"worst relative loss error over {len(CASES)} cases: {worst:.3g}")
    assert worst < 1e-5


# --------------------------------------------------------------------------- InfogainLoss sources

def test_infogain_source_relative_to_working_directory(monkeypatch):
    net = parse_net((LOSS_DIR / "infogain.prototxt").read_text())
    monkeypatch.chdir(LOSS_DIR)
    layer, _ = build(net)
    np.testing.assert_array_equal(layer.infogain.numpy(), np.load(LOSS_DIR / "infogain.npz")["infogain_H"])


def test_infogain_missing_source_raises(tmp_path, monkeypatch):
    net = parse_net((LOSS_DIR / "infogain.prototxt").read_text())
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ParseError, match="loss_layer.*infogain_H.binaryproto"):
        build(net)


def test_infogain_third_bottom_equals_source():
    ref = np.load(LOSS_DIR / "infogain_spatial_ignore3_lw0.5.npz")
    net = parse_net((LOSS_DIR / "infogain_spatial_ignore3_lw0.5.prototxt").read_text())
    layer, _ = build(net, source_dir=LOSS_DIR)
    param = net.layer[-1]
    param.bottom.append("H")
    three = layer_class(param)(param, [ref["score"].shape, ref["label"].shape, (4, 4)], "train")
    x = torch.tensor(ref["score"], requires_grad=True)
    h = torch.tensor(ref["infogain_H"], requires_grad=True)
    (loss,) = three(x, torch.tensor(ref["label"]), h)
    np.testing.assert_allclose(loss.item(), float(ref["loss"]), rtol=1e-5)
    (0.5 * loss).backward()
    np.testing.assert_allclose(x.grad.numpy(), ref["diff:score"], rtol=1e-5, atol=1e-6)
    assert h.grad is None  # Caffe cannot backpropagate to the infogain matrix


def test_infogain_identity_equals_softmax_loss():
    ref = np.load(LOSS_DIR / "infogain_identity_H.npz")
    x, y = torch.tensor(ref["score"]), torch.tensor(ref["label"])
    soft = layer_from("SoftmaxWithLoss", [x.shape, y.shape])
    np.testing.assert_allclose(soft(x, y)[0].item(), float(ref["loss"]), rtol=1e-6)


# --------------------------------------------------------------------------- closed forms and quirks

def test_contrastive_closed_form():
    """N=2: similar pair with a-b = (3,4), d²=25; dissimilar pair at d=5 with margin 7 → (7-5)²=4.
    L = (25 + 4)/(2·2) = 7.25.  Gradients: (a-b)/N and -(m-d)/(d+1e-4)·(a-b)/N."""
    layer = layer_from("ContrastiveLoss", [(2, 2), (2, 2), (2,)], "contrastive_loss_param { margin: 7 }")
    a = torch.tensor([[3.0, 4.0], [1.0, 5.0]], dtype=torch.float64, requires_grad=True)
    b = torch.tensor([[0.0, 0.0], [-2.0, 1.0]], dtype=torch.float64, requires_grad=True)
    (loss,) = layer(a, b, torch.tensor([1.0, 0.0]))
    assert loss.item() == pytest.approx(7.25, rel=1e-15)
    loss.backward()
    expected = torch.tensor([[1.5, 2.0], [-2 / 5.0001 * 1.5, -2 / 5.0001 * 2.0]], dtype=torch.float64)
    torch.testing.assert_close(a.grad, expected, rtol=1e-14, atol=0)
    torch.testing.assert_close(b.grad, -expected, rtol=1e-14, atol=0)


@pytest.mark.parametrize("shapes", [
    [(2, 3, 2, 1), (2, 3, 2, 1), (2,)],     # a feature map: height 2
    [(2, 2, 1, 3), (2, 2, 1, 3), (2,)],     # width 3
    [(2, 6), (2, 3, 2), (2,)],              # same count per sample, channels 6 vs 3
    [(2, 3), (2, 3), (2, 2)],               # two similarity values per pair
    [(2, 3, 1, 1, 1), (2, 3, 1, 1, 1), (2,)],  # 5 axes: the legacy accessors' CHECK
])
def test_contrastive_shapes_are_caffes_legacy_checks(shapes):
    # ContrastiveLossLayer::LayerSetUp: CHECK_EQ(a.channels(), b.channels()), a/b height() == width() == 1,
    # sim channels() == height() == width() == 1 (legacy accessors): no flattening of feature maps.
    with pytest.raises(FormatError):
        layer_from("ContrastiveLoss", shapes)


@pytest.mark.parametrize("type_name, shapes", [
    ("EuclideanLoss", [(2, 3, 1, 1, 1), (2, 3)]),          # num() of bottom 0 (Forward) ...
    ("EuclideanLoss", [(2, 3), (2, 3, 1, 1, 1)]),          # ... and of bottom 1 (Backward)
    ("HingeLoss", [(2, 3, 1, 1, 1), (2,)]),                # num() in Forward
    ("MultinomialLogisticLoss", [(2, 3, 1, 1, 1), (2,)]),  # num() in Forward
    ("MultinomialLogisticLoss", [(2, 3), (2, 1, 1, 1, 1)]),  # the labels' channels() in Reshape
    ("MultinomialLogisticLoss", [(2, 3), (2, 2)]),         # channels() == 1
])
def test_losses_reading_legacy_accessors_refuse_more_than_4_axes(type_name, shapes):
    with pytest.raises(FormatError, match="legacy accessors|one label per sample"):
        layer_from(type_name, shapes)


@pytest.mark.parametrize("type_name", ["EuclideanLoss", "HingeLoss", "MultinomialLogisticLoss", "SoftmaxWithLoss",
                                       "SigmoidCrossEntropyLoss", "InfogainLoss"])
def test_a_0_axis_loss_bottom_is_a_format_error(type_name):
    # LossLayer::Reshape compares bottom[0]->shape(0) with bottom[1]->shape(0): a 0-axis blob fails shape(0)'s
    # axis CHECK (we raised IndexError)
    with pytest.raises(FormatError, match="0-axis bottom"):
        layer_from(type_name, [(), ()])


def test_empty_batch_euclidean_is_caffes_nan_and_hinge_is_refused():
    # euclidean_loss_layer.cpp: dot (0 over no values) / num() (0) / 2 = NaN; hinge_loss_layer.cpp divides
    # count by num() in int: a division by zero (we raised a reshape RuntimeError for both)
    (loss,) = layer_from("EuclideanLoss", [(0, 3), (0, 3)])(torch.zeros(0, 3), torch.zeros(0, 3))
    assert math.isnan(loss.item())
    with pytest.raises(FormatError, match="empty batch"):
        layer_from("HingeLoss", [(0, 3), (0,)])


def test_hinge_reads_the_first_n_label_values_in_memory():
    # hinge_loss_layer.cpp: label[i] for i < num(); LossLayer only checks the labels' first dimension, so
    # a (N, 2) label blob [[2, 0], [1, 2]] gives the labels 2 and 0 (not its first column 2, 1)
    x = torch.tensor([[0.5, -0.5, 2.0], [0.0, 0.25, -1.0]])
    layer = layer_from("HingeLoss", [(2, 3), (2, 2)])
    (loss,) = layer(x, torch.tensor([[2.0, 0.0], [1.0, 2.0]]))
    # sample 0, label 2: max(0, 1 + 0.5) + max(0, 1 - 0.5) + max(0, 1 - 2) = 2; sample 1, label 0:
    # max(0, 1 - 0) + max(0, 1 + 0.25) + max(0, 1 - 1) = 2.25; L1 / N = 4.25 / 2
    assert loss.item() == 2.125


def test_contrastive_takes_legacy_four_axis_features():
    a = torch.tensor([[1.0, 2.0], [0.0, 0.0]]).reshape(2, 2, 1, 1)
    b = torch.tensor([[1.0, 0.0], [3.0, 4.0]]).reshape(2, 2, 1, 1)
    layer = layer_from("ContrastiveLoss", [(2, 2, 1, 1), (2, 2, 1, 1), (2, 1, 1, 1)],
                       "contrastive_loss_param { margin: 7 }")
    (loss,) = layer(a, b, torch.tensor([1.0, 0.0]).reshape(2, 1, 1, 1))
    assert loss.item() == pytest.approx((4.0 + (7.0 - 5.0) ** 2) / 4)


def test_contrastive_epsilon_dominates_at_tiny_distance_and_legacy_is_exact():
    """At d = 1e-3 Caffe's 1/(d + 1e-4) is 1/1.1e-3, 9 % below the true 1/d; the legacy form is exact."""
    a = torch.tensor([[1e-3, 0.0]], dtype=torch.float64, requires_grad=True)
    b = torch.zeros(1, 2, dtype=torch.float64)
    new = layer_from("ContrastiveLoss", [(1, 2), (1, 2), (1,)], "contrastive_loss_param { margin: 1 }")
    (loss,) = new(a, b, torch.tensor([0.0]))
    assert loss.item() == pytest.approx((1 - 1e-3) ** 2 / 2, rel=1e-14)
    loss.backward()
    assert a.grad[0, 0].item() == pytest.approx(-(1 - 1e-3) / 1.1e-3 * 1e-3, rel=1e-12)
    a.grad = None
    legacy = layer_from("ContrastiveLoss", [(1, 2), (1, 2), (1,)],
                        "contrastive_loss_param { margin: 1 legacy_version: true }")
    (loss,) = legacy(a, b, torch.tensor([0.0]))
    assert loss.item() == pytest.approx((1 - 1e-6) / 2, rel=1e-14)
    loss.backward()
    assert a.grad[0, 0].item() == pytest.approx(-1e-3, rel=1e-12)


def test_contrastive_zero_distance_dissimilar_has_finite_gradient():
    layer = layer_from("ContrastiveLoss", [(1, 3), (1, 3), (1,)])
    a = torch.ones(1, 3, requires_grad=True)
    (loss,) = layer(a, torch.ones(1, 3), torch.tensor([0.0]))
    loss.backward()
    assert loss.item() == pytest.approx(0.5) and torch.equal(a.grad, torch.zeros(1, 3))


def test_softmax_closed_form_with_ignore_and_normalizations():
    """Rows (0,0,ln2) label 2 → p=1/2; (ln3,0,0) label 0 → p=3/5; third row ignored (label 7 = ignore).
    Sum = ln2 + ln(5/3); VALID divides by 2, FULL by 3, BATCH_SIZE by 3 (outer), NONE by 1."""
    x = torch.tensor([[0.0, 0.0, math.log(2)], [math.log(3), 0.0, 0.0], [5.0, 1.0, 2.0]], dtype=torch.float64)
    y = torch.tensor([2.0, 0.0, 7.0])
    total = math.log(2) + math.log(5 / 3)
    for mode, div in (("VALID", 2), ("FULL", 3), ("BATCH_SIZE", 3), ("NONE", 1)):
        layer = layer_from("SoftmaxWithLoss", [(3, 3), (3,)], f"loss_param {{ ignore_label: 7 normalization: {mode} }}")
        xs = x.clone().requires_grad_(True)
        (loss,) = layer(xs, y)
        assert loss.item() == pytest.approx(total / div, rel=1e-14), mode
        loss.backward()
        expected = torch.tensor([[0.25, 0.25, -0.5], [-0.4, 0.2, 0.2], [0.0, 0.0, 0.0]], dtype=torch.float64) / div
        torch.testing.assert_close(xs.grad, expected, rtol=1e-13, atol=1e-15)


def test_softmax_log_clip_and_caffe_gradient():
    """p_y underflows: Caffe's loss is -log(FLT_MIN) = 87.3365, its gradient still p - onehot = (1, -1)."""
    layer = layer_from("SoftmaxWithLoss", [(1, 2), (1,)])
    x = torch.tensor([[0.0, -200.0]], requires_grad=True)
    (loss,) = layer(x, torch.tensor([1.0]))
    assert loss.item() == pytest.approx(87.33654475, rel=1e-6)
    loss.backward()
    torch.testing.assert_close(x.grad, torch.tensor([[1.0, -1.0]]))


def test_softmax_legacy_normalize_and_prob_top():
    x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([[0.0, 1, 2, 0], [2, 2, 1, 0]])
    norm_true = layer_from("SoftmaxWithLoss", [(2, 3, 4), (2, 4)], "loss_param { normalize: true }",
                           tops=("loss", "prob"))
    norm_false = layer_from("SoftmaxWithLoss", [(2, 3, 4), (2, 4)], "loss_param { normalize: false }")
    nll = torch.nn.functional.cross_entropy(x, y.long(), reduction="sum")
    loss, prob = norm_true(x, y)
    torch.testing.assert_close(loss, nll / 8)
    torch.testing.assert_close(norm_false(x, y)[0], nll / 2)
    torch.testing.assert_close(prob, torch.softmax(x, dim=1))
    assert norm_true.output_shapes() == [(), (2, 3, 4)]


def test_multinomial_zero_probability_costs_46_05():
    layer = layer_from("MultinomialLogisticLoss", [(2, 2), (2,)])
    p = torch.tensor([[0.0, 1.0], [0.25, 0.75]], requires_grad=True)
    (loss,) = layer(p, torch.tensor([0.0, 1.0]))
    assert loss.item() == pytest.approx((46.0517 - math.log(0.75)) / 2, rel=1e-5)
    loss.backward()
    assert p.grad[0, 0].item() == pytest.approx(-0.5e20, rel=1e-6)


def test_sigmoid_ce_extreme_logits_are_finite_and_default_is_batch_size():
    layer = layer_from("SigmoidCrossEntropyLoss", [(2, 2), (2, 2)])
    x = torch.tensor([[100.0, -100.0], [0.0, 3.0]])
    t = torch.tensor([[0.0, 1.0], [0.5, 1.0]])
    expected = torch.nn.functional.binary_cross_entropy_with_logits(x.double(), t.double(), reduction="sum") / 2
    np.testing.assert_allclose(layer(x, t)[0].item(), expected.item(), rtol=1e-6)


# --------------------------------------------------------------------------- gradcheck (float64)

def _gradcheck(layer, inputs):
    assert torch.autograd.gradcheck(lambda *xs: layer(*xs)[0], inputs)


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


def test_gradcheck_contrastive_legacy():
    a, b = (torch.randn(6, 4, generator=_g(i), dtype=torch.float64, requires_grad=True) for i in (1, 2))
    layer = layer_from("ContrastiveLoss", [(6, 4), (6, 4), (6,)],
                       "contrastive_loss_param { margin: 10 legacy_version: true }")
    _gradcheck(layer, (a, b, torch.tensor([1.0, 0, 0, 1, 0, 2])))


def test_gradcheck_contrastive_new_within_caffe_epsilon():
    """Caffe's d + 1e-4 makes the gradient differ from the derivative by ~1e-4/d relative; gradcheck's
    rtol 1e-3 admits that at d ~ 3, so this checks the rest of the formula."""
    a, b = (torch.randn(6, 4, generator=_g(i), dtype=torch.float64, requires_grad=True) for i in (3, 4))
    layer = layer_from("ContrastiveLoss", [(6, 4), (6, 4), (6,)], "contrastive_loss_param { margin: 4 }")
    _gradcheck(layer, (a, b, torch.tensor([1.0, 0, 0, 1, 0, 0])))


def test_gradcheck_euclidean():
    a, b = (torch.randn(3, 2, 2, generator=_g(i), dtype=torch.float64, requires_grad=True) for i in (5, 6))
    _gradcheck(layer_from("EuclideanLoss", [(3, 2, 2), (3, 4)]), (a, b.reshape(3, 4).detach().requires_grad_(True)))


@pytest.mark.parametrize("extra", ["", "loss_param { ignore_label: 1 normalization: FULL }",
                                   "softmax_param { axis: 2 }"])
def test_gradcheck_softmax(extra):
    x = torch.randn(2, 3, 4, generator=_g(7), dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 3, (2, 4) if "axis" not in extra else (2, 3), generator=_g(8)).double()
    _gradcheck(layer_from("SoftmaxWithLoss", [(2, 3, 4), tuple(y.shape)], extra), (x, y))


@pytest.mark.parametrize("mode", ["VALID", "BATCH_SIZE"])
def test_gradcheck_sigmoid_ce(mode):
    x = torch.randn(3, 5, generator=_g(9), dtype=torch.float64, requires_grad=True) * 3
    t = torch.rand(3, 5, generator=_g(10), dtype=torch.float64)
    t[0, :2] = -1
    layer = layer_from("SigmoidCrossEntropyLoss", [(3, 5), (3, 5)],
                       f"loss_param {{ ignore_label: -1 normalization: {mode} }}")
    _gradcheck(layer, (x.detach().requires_grad_(True), t))


@pytest.mark.parametrize("norm", ["L1", "L2"])
def test_gradcheck_hinge(norm):
    x = torch.randn(4, 5, generator=_g(11), dtype=torch.float64, requires_grad=True)
    layer = layer_from("HingeLoss", [(4, 5), (4,)], f"hinge_loss_param {{ norm: {norm} }}")
    _gradcheck(layer, (x, torch.tensor([0.0, 4, 2, 2])))


def test_gradcheck_infogain_third_bottom():
    x = torch.randn(2, 3, 2, generator=_g(12), dtype=torch.float64, requires_grad=True)
    h = torch.rand(3, 3, generator=_g(13), dtype=torch.float64)
    layer = layer_from("InfogainLoss", [(2, 3, 2), (2, 2), (3, 3)], "loss_param { ignore_label: 1 }")
    _gradcheck(layer, (x, torch.tensor([[0.0, 1], [2, 2]]), h))


def test_gradcheck_multinomial_logistic():
    p = torch.rand(4, 3, generator=_g(14), dtype=torch.float64) + 0.05
    layer = layer_from("MultinomialLogisticLoss", [(4, 3, 1, 1), (4,)])
    _gradcheck(layer, (p.reshape(4, 3, 1, 1).requires_grad_(True), torch.tensor([0.0, 2, 1, 1])))


# --------------------------------------------------------------------------- bad input

def test_bad_shapes_and_labels_raise():
    with pytest.raises(FormatError, match="same first dimension"):
        layer_from("EuclideanLoss", [(3, 4), (2, 4)])
    with pytest.raises(FormatError, match="number of labels"):
        layer_from("SoftmaxWithLoss", [(4, 5, 2), (4, 3)])
    with pytest.raises(FormatError, match="infogain"):
        layer_from("InfogainLoss", [(4, 5), (4,)])
    layer = layer_from("SoftmaxWithLoss", [(2, 3), (2,)])
    with pytest.raises(DataError, match="label 3 is outside"):
        layer(torch.zeros(2, 3), torch.tensor([0.0, 3.0]))


def test_multinomial_logistic_loss_with_an_empty_batch_is_a_format_error():
    # multinomial_logistic_loss_layer.cpp Forward_cpu: dim = count / num() in int, num() = 0 a division by zero
    # (we raised torch's RuntimeError on reshape(0, -1))
    with pytest.raises(FormatError, match="empty batch"):
        make_layer('type: "MultinomialLogisticLoss" bottom: "p" bottom: "y"', [(0, 3, 1, 1), (0,)])


@pytest.mark.parametrize("scores, labels", [((0, 0, 0, 0), (0,)), ((2, 0), (2,)), ((2, 0, 3), (2, 3))])
def test_softmax_with_loss_with_no_class(scores, labels):
    # softmax_loss_layer.cpp Forward_cpu: no position (N = 0) sums nothing, loss 0 / max(1, count) = 0; a label
    # with no class (C = 0) is out of range (Caffe's DCHECK_LT, an out-of-bounds read in a release build): a
    # DataError.  We raised torch's RuntimeError (reshape(-1, 0), one_hot with 0 classes).
    port = make_layer('type: "SoftmaxWithLoss" bottom: "x" bottom: "y"', [scores, labels])
    x = torch.zeros(scores, requires_grad=True)
    if scores[0]:
        with pytest.raises(DataError, match=r"outside \[0, 0\)"):
            port(x, torch.zeros(labels))
        return
    (loss,) = port(x, torch.zeros(labels))
    assert loss.item() == 0.0
    loss.backward()
    assert x.grad.shape == x.shape


def test_contrastive_loss_of_an_empty_batch_is_caffes_nan():
    # contrastive_loss_layer.cpp Forward_cpu: loss = 0 / num() / 2 in Dtype, 0 / 0 = NaN (we raised torch's
    # RuntimeError on reshape(0, -1))
    shapes = [(0, 3, 1, 1), (0, 3, 1, 1), (0, 1, 1, 1)]
    port = make_layer('type: "ContrastiveLoss" bottom: "a" bottom: "b" bottom: "s"', shapes)
    (loss,) = port(torch.zeros(0, 3, 1, 1), torch.zeros(0, 3, 1, 1), torch.zeros(0, 1, 1, 1))
    assert math.isnan(loss.item())


@pytest.mark.parametrize("kind", ["HingeLoss", "MultinomialLogisticLoss"])
def test_fed_an_empty_batch_at_run_time_is_a_shape_mismatch_error(kind):
    # set up for (2, 3) and fed (0, 3): Caffe's Forward_cpu computes dim = count / num() in int, a division by zero
    # (we raised torch's RuntimeError on reshape(0, -1))
    from caffe_compat.errors import ShapeMismatchError

    port = make_layer(f'type: "{kind}" bottom: "x" bottom: "y"', [(2, 3), (2,)])
    with pytest.raises(ShapeMismatchError, match="empty batch"):
        port(torch.zeros(0, 3), torch.zeros(0))


@pytest.mark.parametrize("kind", ["SoftmaxWithLoss", "InfogainLoss"])
@pytest.mark.parametrize("normalization", ["FULL", "VALID", "BATCH_SIZE", "NONE"])
def test_softmax_and_infogain_loss_of_no_position_is_positive_zero(kind, normalization):
    # softmax_loss_layer.cpp / infogain_loss_layer.cpp Forward_cpu: Dtype loss = 0; loss -= ... per valid position,
    # then loss / get_normalizer(...), which is std::max(1.0, normalizer): no position (an empty batch, or every
    # label ignored) leaves +0.0 / 1 = +0.0.  We computed -(sum) / normaliser: -0.0.
    h = 'bottom: "h"' if kind == "InfogainLoss" else ""
    text = (f'type: "{kind}" bottom: "x" bottom: "y" {h} '
            f'loss_param {{ normalization: {normalization} ignore_label: 1 }}')
    extra = [torch.eye(3)] if h else []
    port = make_layer(text, [(0, 3), (0,)] + [(3, 3)] * len(extra))
    (loss,) = port(torch.zeros(0, 3), torch.zeros(0), *extra)
    assert loss.item() == 0.0 and math.copysign(1.0, loss.item()) == 1.0
    port = make_layer(text, [(2, 3), (2,)] + [(3, 3)] * len(extra))
    scores = torch.tensor([[0.5, -1.0, 2.0], [1.0, 0.0, 0.25]], requires_grad=True)
    (loss,) = port(scores, torch.ones(2), *extra)  # every label ignored
    assert loss.item() == 0.0 and math.copysign(1.0, loss.item()) == 1.0
    (loss,) = port(scores, torch.tensor([2.0, 1.0]), *extra)  # one valid position: -log p, still negated
    expected = -torch.log_softmax(scores.detach()[0], 0)[2].item() / {"FULL": 2, "BATCH_SIZE": 2}.get(normalization, 1)
    assert loss.item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("type_name, label_shape, extra", [
    ("SoftmaxWithLoss", (4, 2, 3), ""),
    ("InfogainLoss", (4, 2, 3), 'bottom: "h"'),
    ("EuclideanLoss", (4, 5, 2, 3), ""),
])
def test_a_loss_computed_in_place_is_refused_as_caffe_does_at_setup(type_name, label_shape, extra):
    """The net fuzz target's finding (``top: "score"`` on a SoftmaxWithLoss whose bottom 0 is ``score``): Caffe's
    LossLayer::Reshape reshapes top 0, the same Blob as bottom 0, to the 0-axis loss, and the type's Reshape then
    reads that blob's axes (softmax_loss_layer.cpp Reshape -> SoftmaxLayer::Reshape's CanonicalAxisIndex;
    euclidean_loss_layer.cpp Reshape's count(1)): a CHECK failure.  The build accepted it, and a forward fed the
    blob's shape after building (the scalar) raised an IndexError."""
    from caffe_compat.net import CaffeNet

    h = 'layer { name: "h" type: "Input" top: "h" input_param { shape { dim: 5 dim: 5 } } }' if extra else ""
    dims = " ".join(f"dim: {d}" for d in label_shape)
    text = f"""
    layer {{ name: "score" type: "Input" top: "score" input_param {{ shape {{ dim: 4 dim: 5 dim: 2 dim: 3 }} }} }}
    layer {{ name: "label" type: "Input" top: "label" input_param {{ shape {{ {dims} }} }} }}
    {h}
    layer {{ name: "loss_layer" type: "{type_name}" bottom: "score" bottom: "label" {extra} top: "score" }}"""
    with pytest.raises(FormatError, match=f"layer 'loss_layer' \\({type_name}\\): computed in place"):
        CaffeNet(parse_net(text))
    CaffeNet(parse_net(text.replace('top: "score" }', 'top: "loss" }')))  # not in place: built


@pytest.mark.parametrize("n", [8, 5])
def test_contrastive_pairs_a_and_b_of_different_legacy_forms_element_by_element(n):
    """The net fuzz target's finding: a (N, 5, 1) against b (N, 5), which Caffe's legacy CHECKs accept and its
    Forward subtracts element by element over the count (contrastive_loss_layer.cpp Forward_cpu: caffe_sub), raised
    torch's RuntimeError for N = 8 and broadcast to an (N, N, 5) difference, silently wrong, for N = 5."""
    torch.manual_seed(0)
    a, b = torch.rand(n, 5, 1, requires_grad=True), torch.rand(n, 5)
    sim = (torch.arange(n) % 2).float()
    margin = "contrastive_loss_param { margin: 7 }"
    layer = layer_from("ContrastiveLoss", [tuple(a.shape), tuple(b.shape), (n,)], margin)
    flat = layer_from("ContrastiveLoss", [(n, 5), (n, 5), (n,)], margin)
    (loss,) = layer(a, b, sim)
    (expected,) = flat(a.detach().reshape(n, 5), b, sim)
    assert loss.shape == () and torch.allclose(loss, expected)
    loss.backward()
    assert a.grad.shape == (n, 5, 1)

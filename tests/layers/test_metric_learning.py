"""CosineSimilarityBatch + FAPPYLoss as Caffe layers inside a CaffeNet, against real Caffe; the batch
loss layer types equal their loss modules, map every metric_loss_param field they document, reject the
others, and pass float64 gradcheck."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from caffe_compat.io import read_net
from caffe_compat.net import CaffeNet
from tests.conftest import fixture_path

CASES = json.loads(fixture_path("fappy/cases.json").read_text())
RUN = [c["name"] for c in CASES if c["returncode"] == 0 and not c["name"].startswith("fappy_only")]


def _net(name):
    return CaffeNet(read_net(fixture_path(f"fappy/{name}.prototxt")), phase="test")


@pytest.mark.parametrize("name", RUN)
def test_fappy_net_matches_caffe(name):
    z = np.load(fixture_path(f"fappy/{name}.npz"))
    net = _net(name)
    feat = torch.tensor(z["feat"], requires_grad=True)
    blobs = net(feat=feat, label=torch.tensor(z["label"]))
    np.testing.assert_allclose(blobs["cosine"].detach().numpy(), z["cosine"], rtol=1e-5, atol=5e-7)
    np.testing.assert_array_equal(blobs["pair_label"].numpy(), z["pair_label"])
    loss = blobs["loss"]
    if np.isnan(z["loss"]):
        assert torch.isnan(loss)
        return
    np.testing.assert_allclose(loss.item(), float(z["loss"]), rtol=2e-5, atol=1e-7)
    g_cos, g_feat = torch.autograd.grad(net.objective(blobs), [blobs["cosine"], feat])
    # Our float32 cosines differ from Caffe's sgemm ones by up to 6e-7, which moves the triangular bin
    # weights by up to 6e-7/Δ: at Δ = 1e-4 the diffs then differ by up to 1.5e-3 of their scale (measured;
    # FAPPY fed with Caffe's own cosines matches far closer, see tests/losses/test_fappy.py).
    tol = 2e-3 if float(z["delta"]) < 1e-3 else 3e-4
    scale = np.abs(z["cosine_diff"]).max()
    np.testing.assert_allclose(g_cos.numpy(), z["cosine_diff"], rtol=0, atol=tol * scale)
    np.testing.assert_allclose(g_feat.numpy(), z["feat_diff"], rtol=0, atol=tol * np.abs(z["feat_diff"]).max())


def test_loss_weight_scales_diff_not_top():
    z = np.load(fixture_path("fappy/b16_d8_delta0.1_loss_weight0.5.npz"))
    net = _net("b16_d8_delta0.1_loss_weight0.5")
    feat = torch.tensor(z["feat"], requires_grad=True)
    blobs = net(feat=feat, label=torch.tensor(z["label"]))
    assert blobs["loss"].item() == pytest.approx(float(z["loss"]), rel=2e-5)
    (g,) = torch.autograd.grad(net.objective(blobs), [feat])
    np.testing.assert_allclose(g.numpy(), z["feat_diff"], rtol=1e-3, atol=2e-7)


LOSS_LAYERS = [
    ("BatchContrastiveLoss", "margin: 0.7", "ContrastiveLoss", {"margin": 0.7}),
    ("TripletLoss", 'margin: 0.3 mining: "semihard"', "TripletLoss", {"margin": 0.3, "triplets": "semihard"}),
    ("LiftedStructSimilaritySoftmaxLoss", "margin: 1.0", "LiftedStructLoss", {"margin": 1.0}),
    ("HistogramLoss", "num_bins: 25", "HistogramLoss", {"num_bins": 25}),
    ("BinomialDevianceLoss", "alpha: 2 gamma: 0.5 cost: 25", "BinomialDevianceLoss",
     {"alpha": 2.0, "gamma": 0.5, "neg_cost": 25.0}),
    ("BinomialDevianceLoss", "beta: 10", "BinomialDevianceLoss", {"beta": 10.0}),
    ("MultiSimilarityLoss", "alpha: 2 beta: 40 base: 0.5", "MultiSimilarityLoss", {"alpha": 2.0, "beta": 40.0, "base": 0.5}),
    ("RAWLoss", "", "RAWLoss", {}),
    ("MarginLoss", 'margin: 0.25 beta: 1.1 num_classes: 4 mining: "none"', "MarginLoss",
     {"margin": 0.25, "beta": 1.1, "num_classes": 4, "distance_weighted": False}),
    ("FastAPLoss", "num_bins: 10", "FastAPLoss", {"num_bins": 10}),
    ("SmoothAPLoss", "temperature: 0.01", "SmoothAPLoss", {"temperature": 0.01}),
]


@pytest.mark.parametrize("layer_type,params,loss_name,kwargs", LOSS_LAYERS,
                         ids=[f"{t[0]}-{i}" for i, t in enumerate(LOSS_LAYERS)])
def test_batch_loss_layers_equal_modules(layer_type, params, loss_name, kwargs):
    import caffe_compat.losses as losses

    text = f"""
    layer {{ name: "x" type: "Input" top: "x" input_param {{ shape {{ dim: 12 dim: 6 }} }} }}
    layer {{ name: "y" type: "Input" top: "y" input_param {{ shape {{ dim: 12 }} }} }}
    layer {{ name: "loss" type: "{layer_type}" bottom: "x" bottom: "y" top: "loss" loss_weight: 2
            metric_loss_param {{ {params} }} }}
    """
    net = CaffeNet(read_net(text), phase="train")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(12, 6, generator=gen, dtype=torch.float32)
    y = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3], dtype=torch.float32)
    blobs = net(x=x, y=y)
    expected = getattr(losses, loss_name)(**kwargs)(x, y)
    assert blobs["loss"].item() == pytest.approx(expected.item(), rel=1e-6, abs=1e-7)
    assert net.objective(blobs).item() == pytest.approx(2 * expected.item(), rel=1e-6, abs=1e-7)


# ---- every documented metric_loss_param field is mapped; every other one is a FormatError ----

from caffe_compat.errors import FormatError  # noqa: E402
from caffe_compat.layers.metric_learning import BATCH_LOSSES  # noqa: E402
from caffe_compat.layers.registry import layer_class  # noqa: E402
from caffe_compat.losses import DistanceWeightedMiner, EasyPositiveMiner, VTHMMiner  # noqa: E402
from caffe_compat.proto import caffe_pb2  # noqa: E402

FIELDS = [f.name for f in caffe_pb2.MetricLossParameter.DESCRIPTOR.fields]
LABELS = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 3, 3], dtype=torch.float32)  # unequal classes


def _loss_net(layer_type, params, dims=(12, 6), loss_weight=2.0):
    text = f"""
    layer {{ name: "x" type: "Input" top: "x" input_param {{ shape {{ dim: {dims[0]} dim: {dims[1]} }} }} }}
    layer {{ name: "y" type: "Input" top: "y" input_param {{ shape {{ dim: {dims[0]} }} }} }}
    layer {{ name: "loss" type: "{layer_type}" bottom: "x" bottom: "y" top: "loss" loss_weight: {loss_weight}
            metric_loss_param {{ {params} }} }}
    """
    return CaffeNet(read_net(text), phase="train")


def _field_text(field, value=None):
    kind = caffe_pb2.MetricLossParameter.DESCRIPTOR.fields_by_name[field].type
    if field == "mining":
        return f'mining: "{value or "vthm"}"'
    if kind == caffe_pb2.MetricLossParameter.DESCRIPTOR.fields_by_name["num_bins"].type:
        return f"{field}: {value or 7}"
    return f"{field}: {value or 0.375}"


def _layer(layer_type, params):
    net = _loss_net(layer_type, params)
    return net.layer("loss")


@pytest.mark.parametrize("layer_type", sorted(BATCH_LOSSES))
def test_every_documented_plain_field_reaches_the_module(layer_type):
    spec = BATCH_LOSSES[layer_type]
    for field, (keyword, _) in spec.fields.items():
        value = 7 if field in ("num_bins", "num_classes") else 0.375
        loss = _layer(layer_type, _field_text(field, value)).loss
        got = getattr(loss, keyword)
        got = float(got.detach().reshape(-1)[0]) if torch.is_tensor(got) else float(got)
        assert got == pytest.approx(value), (layer_type, field)


@pytest.mark.parametrize("layer_type", sorted(BATCH_LOSSES))
def test_unused_fields_are_format_errors(layer_type):
    accepted = BATCH_LOSSES[layer_type].accepted
    rejected = [f for f in FIELDS if f not in accepted]
    assert set(accepted) | set(rejected) == set(FIELDS)
    for field in rejected:
        with pytest.raises(FormatError) as info:
            _loss_net(layer_type, _field_text(field))
        message = str(info.value)
        assert "'loss'" in message and layer_type in message and f"metric_loss_param.{field}" in message
        assert f"it accepts: {', '.join(accepted)}" in message


@pytest.mark.parametrize("layer_type", sorted(BATCH_LOSSES))
def test_docstring_lists_the_accepted_fields(layer_type):
    doc = layer_class(caffe_pb2.LayerParameter(type=layer_type)).__doc__
    for field in BATCH_LOSSES[layer_type].accepted:
        assert f"``{field}``" in doc
    for value in BATCH_LOSSES[layer_type].mining:
        assert f"``{value}``" in doc


def test_audit_cases():
    # binomial's beta reaches the module (it was dropped), contrastive's mining is used or refused
    x = torch.randn(12, 6, generator=torch.Generator().manual_seed(3))
    net = _loss_net("BinomialDevianceLoss", "beta: 10")
    from caffe_compat.losses import BinomialDevianceLoss, ContrastiveLoss

    assert net(x=x, y=LABELS)["loss"].item() == pytest.approx(BinomialDevianceLoss(beta=10)(x, LABELS).item(), rel=1e-6)
    assert BinomialDevianceLoss(beta=10)(x, LABELS).item() != pytest.approx(BinomialDevianceLoss()(x, LABELS).item())
    layer = _layer("BatchContrastiveLoss", 'mining: "easy_positive"')
    assert isinstance(layer.loss.miner, EasyPositiveMiner)
    net = _loss_net("BatchContrastiveLoss", 'mining: "easy_positive"')
    expected = ContrastiveLoss(miner=EasyPositiveMiner())(x, LABELS)
    assert net(x=x, y=LABELS)["loss"].item() == pytest.approx(expected.item(), rel=1e-6)
    assert expected.item() != pytest.approx(ContrastiveLoss()(x, LABELS).item())


MINING_CASES = [
    ("BatchContrastiveLoss", "vthm", {"miner": VTHMMiner}),
    ("BatchContrastiveLoss", "distance_weighted", {"miner": DistanceWeightedMiner}),
    ("BatchContrastiveLoss", "none", {"miner": type(None)}),
    ("LiftedStructSimilaritySoftmaxLoss", "vthm", {"miner": VTHMMiner}),
    ("BinomialDevianceLoss", "vthm", {"miner": VTHMMiner}),
    ("BinomialDevianceLoss", "easy_positive", {"miner": EasyPositiveMiner}),
    ("MultiSimilarityLoss", "vthm", {"miner": VTHMMiner}),
    ("MultiSimilarityLoss", "easy_positive", {"miner": EasyPositiveMiner}),
    ("RAWLoss", "vthm", {"miner": VTHMMiner}),
    ("RAWLoss", "none", {"miner": type(None)}),
    ("RAWLoss", "distance_weighted", {"miner": DistanceWeightedMiner}),
    ("MarginLoss", "distance_weighted", {"miner": DistanceWeightedMiner}),
    ("MarginLoss", "none", {"miner": type(None)}),
    ("MarginLoss", "easy_positive", {"miner": EasyPositiveMiner}),
    ("MarginLoss", "vthm", {"miner": VTHMMiner}),
    ("TripletLoss", "all", {"miner": type(None), "triplets": "all"}),
    ("TripletLoss", "hard", {"miner": type(None), "triplets": "hard"}),
    ("TripletLoss", "easy_positive", {"miner": EasyPositiveMiner, "triplets": "all"}),
    ("TripletLoss", "easy_positive+semihard", {"miner": EasyPositiveMiner, "triplets": "semihard"}),
    ("TripletLoss", "distance_weighted+hard", {"miner": DistanceWeightedMiner, "triplets": "hard"}),
]


@pytest.mark.parametrize("layer_type,mining,expect", MINING_CASES, ids=[f"{t}-{m}" for t, m, _ in MINING_CASES])
def test_mining_selects_the_miner(layer_type, mining, expect):
    loss = _layer(layer_type, f'mining: "{mining}"').loss
    assert type(loss.miner) is expect["miner"]
    if "triplets" in expect:
        assert loss.triplets == expect["triplets"]


def test_mined_layers_equal_modules_and_lambda_is_the_vthm_margin():
    import caffe_compat.losses as losses

    x = torch.randn(12, 6, generator=torch.Generator().manual_seed(4))
    cases = [
        ("BinomialDevianceLoss", 'mining: "vthm" lambda: 0.3', losses.BinomialDevianceLoss(miner=VTHMMiner(0.3))),
        ("MultiSimilarityLoss", 'beta: 40 mining: "vthm" lambda: 0.2',
         losses.MultiSimilarityLoss(beta=40, miner=VTHMMiner(0.2))),
        ("RAWLoss", "lambda: 0.05", losses.RAWLoss(vthm_margin=0.05)),
        ("RAWLoss", 'mining: "none"', losses.RAWLoss(vthm=False)),
        ("LiftedStructSimilaritySoftmaxLoss", 'mining: "vthm" lambda: 0.4', losses.LiftedStructLoss(miner=VTHMMiner(0.4))),
        ("TripletLoss", 'margin: 0.3 mining: "easy_positive+semihard"',
         losses.TripletLoss(margin=0.3, triplets="semihard", miner=EasyPositiveMiner())),
        ("TripletLoss", 'mining: "vthm+hard" lambda: 0.5', losses.TripletLoss(triplets="hard", miner=VTHMMiner(0.5))),
        ("MarginLoss", 'mining: "easy_positive"', losses.MarginLoss(miner=EasyPositiveMiner())),
    ]
    for layer_type, params, module in cases:
        got = _loss_net(layer_type, params)(x=x, y=LABELS)["loss"]
        assert got.item() == pytest.approx(module(x, LABELS).item(), rel=1e-6, abs=1e-7), (layer_type, params)
    assert _layer("RAWLoss", "lambda: 0.05").loss.miner.margin == pytest.approx(0.05)
    assert _layer("TripletLoss", 'mining: "vthm" lambda: 0.5').loss.miner.margin == pytest.approx(0.5)


@pytest.mark.parametrize("layer_type", sorted(t for t, s in BATCH_LOSSES.items() if s.mining))
def test_unknown_mining_lists_the_valid_values(layer_type):
    with pytest.raises(FormatError) as info:
        _loss_net(layer_type, 'mining: "batch_hard"')
    message = str(info.value)
    assert "'loss'" in message and "'batch_hard'" in message
    assert ", ".join(BATCH_LOSSES[layer_type].mining) in message


def test_lambda_without_vthm_and_beta_with_cost_are_format_errors():
    with pytest.raises(FormatError, match=r"metric_loss_param.lambda .*not used with mining 'none'.*it accepts"):
        _loss_net("BinomialDevianceLoss", "lambda: 0.2")
    with pytest.raises(FormatError, match=r"metric_loss_param.lambda .*'distance_weighted'"):
        _loss_net("RAWLoss", 'mining: "distance_weighted" lambda: 0.2')
    with pytest.raises(FormatError, match=r"metric_loss_param.lambda .*'semihard'"):
        _loss_net("TripletLoss", 'mining: "semihard" lambda: 0.2')
    with pytest.raises(FormatError, match=r"'loss' \(BinomialDevianceLoss\): metric_loss_param.cost is not used when beta"):
        _loss_net("BinomialDevianceLoss", "beta: 10 cost: 25")


def test_module_rejections_become_format_errors():
    with pytest.raises(FormatError, match=r"'loss' \(TripletLoss\): bad metric_loss_param: .*margin must be >= 0"):
        _loss_net("TripletLoss", "margin: -1")
    with pytest.raises(FormatError, match=r"'loss' \(SmoothAPLoss\): bad metric_loss_param"):
        _loss_net("SmoothAPLoss", "temperature: 0")


@pytest.mark.parametrize("layer_type", ["CosineSimilarityBatch", "FAPPYLoss"])
def test_authors_layers_take_no_metric_loss_param(layer_type):
    text = f"""
    layer {{ name: "x" type: "Input" top: "x" input_param {{ shape {{ dim: 6 dim: 1 dim: 1 dim: 1 }} }} }}
    layer {{ name: "y" type: "Input" top: "y" input_param {{ shape {{ dim: 6 }} }} }}
    layer {{ name: "loss" type: "{layer_type}" bottom: "x" bottom: "y" top: "out" metric_loss_param {{ margin: 1 }} }}
    """
    with pytest.raises(FormatError, match=rf"'loss' \({layer_type}\): metric_loss_param.margin .*no metric_loss_param field"):
        CaffeNet(read_net(text), phase="train")


# ---- MarginLoss layer: seeded distance-weighted miner, learnable per-class beta ----

def test_margin_loss_layer_with_seeded_miner_equals_module():
    from caffe_compat.losses import MarginLoss

    x = torch.randn(12, 6, generator=torch.Generator().manual_seed(6))
    net = _loss_net("MarginLoss", "margin: 0.25 beta: 1.1 num_classes: 4", loss_weight=1.0)
    layer = net.layer("loss")
    assert isinstance(layer.loss.miner, DistanceWeightedMiner)  # Wu et al.'s sampling by default
    (beta_blob,) = layer.caffe_blobs()
    assert beta_blob.shape == (4,) and beta_blob.requires_grad
    module = MarginLoss(num_classes=4, margin=0.25, beta=1.1)
    xg, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
    values = []
    for seed in (11, 12, 13):
        torch.manual_seed(seed)
        blobs = net(x=xg, y=LABELS)
        torch.manual_seed(seed)
        expected = module(xm, LABELS)
        assert blobs["loss"].item() == pytest.approx(expected.item(), rel=1e-6, abs=1e-7)
        values.append(expected.item())
        g_net = torch.autograd.grad(net.objective(blobs), [xg, beta_blob])
        g_mod = torch.autograd.grad(expected, [xm, module.beta])
        for a, b in zip(g_net, g_mod):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    torch.manual_seed(11)
    assert net(x=x, y=LABELS)["loss"].item() == values[0]  # same seed, same draws
    assert len(set(values)) > 1  # the seed drives the negative draws


# ---- float64 gradcheck through every batch-loss layer (in a CaffeNet, loss_weight 2) ----

GRAD_PARAMS = {
    "BatchContrastiveLoss": "margin: 0.7",
    "TripletLoss": 'margin: 0.3 mining: "semihard"',
    "LiftedStructSimilaritySoftmaxLoss": "margin: 1.0",
    "HistogramLoss": "num_bins: 25",
    "BinomialDevianceLoss": 'beta: 10 mining: "vthm" lambda: 0.3',
    "MultiSimilarityLoss": "alpha: 2 beta: 10 base: 0.5",
    "RAWLoss": "beta: 10 lambda: 0.3",
    "MarginLoss": "margin: 0.25 num_classes: 4",
    "FastAPLoss": "num_bins: 10",
    "SmoothAPLoss": "temperature: 0.1",
}


def test_grad_params_cover_every_layer_type():
    assert set(GRAD_PARAMS) == set(BATCH_LOSSES)


@pytest.mark.parametrize("layer_type", sorted(GRAD_PARAMS))
def test_batch_loss_layer_gradcheck(layer_type):
    net = _loss_net(layer_type, GRAD_PARAMS[layer_type], dims=(12, 4))
    x = torch.randn(12, 4, generator=torch.Generator().manual_seed(7), dtype=torch.float64, requires_grad=True)
    y = LABELS.to(torch.float64)

    def objective(e):
        with torch.random.fork_rng(devices=[]):  # the distance-weighted miner draws: same draws every call
            torch.manual_seed(0)
            return net.objective(net(x=e, y=y))

    assert objective(x).dtype == torch.float64
    assert torch.autograd.gradcheck(objective, (x,), eps=1e-6, atol=1e-5, rtol=1e-4)


def _metric_net(layer: str, feat: str = "dim: 6 dim: 5", label: str = "dim: 6") -> str:
    return (f'layer {{ name: "in" type: "Input" top: "feat" top: "label" input_param {{ shape {{ {feat} }} '
            f'shape {{ {label} }} }} }}\nlayer {{ name: "m" bottom: "feat" bottom: "label" {layer} }}\n')


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_cosine_similarity_batch_labels_must_be_finite(value):
    """pos_label: nan (or inf) raised ValueError (cannot convert float NaN to integer) / OverflowError at the
    forward: the authors' layer makes an int of it."""
    from caffe_compat.errors import FormatError

    text = _metric_net('type: "CosineSimilarityBatch" top: "cos" cosine_similarity_batch_param { pos_label: '
                       f'{value} }}')
    with pytest.raises(FormatError, match=r"layer 'm' \(CosineSimilarityBatch\): cosine_similarity_batch_param."
                                          r"pos_label must be finite"):
        CaffeNet(text).forward()


def test_a_feature_without_a_batch_axis_is_a_format_error():
    """A scalar feature blob (``shape { }``): IndexError from the rule (bottoms[0][0]) while the net was built."""
    from caffe_compat.errors import FormatError

    text = _metric_net('type: "CosineSimilarityBatch" top: "cos"', feat="")
    with pytest.raises(FormatError, match=r"layer 'm' \(CosineSimilarityBatch\): cannot infer its output shapes"):
        CaffeNet(text)


@pytest.mark.parametrize("layer", ['type: "CosineSimilarityBatch" top: "cos"', 'type: "MarginLoss" top: "loss"',
                                   'type: "RAWLoss" top: "loss"', 'type: "TripletLoss" top: "loss"'])
def test_an_empty_batch_gives_no_pairs_and_no_loss(layer):
    """A batch of 0 samples: RuntimeError (cannot reshape tensor of 0 elements into shape [0, -1]), and the
    miners' IndexError (max(): Expected reduction dim 1 to have non-zero size) for MarginLoss and RAWLoss."""
    blobs = CaffeNet(_metric_net(layer, feat="dim: 0 dim: 5", label="dim: 0")).forward()
    top = blobs["cos" if "Cosine" in layer else "loss"]
    assert top.numel() == 0 if "Cosine" in layer else float(top) == 0.0


@pytest.mark.parametrize("layer", ['type: "MarginLoss" metric_loss_param { num_classes: 33554432 }',
                                   'type: "HistogramLoss" metric_loss_param { num_bins: 1000000 }',
                                   'type: "FastAPLoss" metric_loss_param { num_bins: 1000000 }'])
def test_num_bins_and_num_classes_are_budgeted(monkeypatch, layer):
    """num_classes / num_bins 2^32 - 1 asked the allocator for 17 GB (MarginLoss's per-class beta, at build) or
    17 to 103 GB (the histograms, at the forward).  Here 134 MB and 96 MB against a budget of 1 MB."""
    from caffe_compat.errors import MemoryBudgetError

    monkeypatch.setenv("CAFFE_COMPAT_MEMORY_BUDGET", "1M")
    with pytest.raises(MemoryBudgetError, match=r"layer 'm' \(\w+\): metric_loss_param.num_(bins|classes) \d+ needs"):
        CaffeNet(_metric_net(layer + ' top: "loss"'))


@pytest.mark.parametrize("layer_type", sorted(BATCH_LOSSES))
def test_a_0_axis_embedding_is_a_format_error(layer_type):
    # the embedding's first axis is the batch; a 0-axis one has none (its forward raised IndexError on shape[0])
    text = f"""
    layer {{ name: "x" type: "Input" top: "x" input_param {{ shape {{ }} }} }}
    layer {{ name: "y" type: "Input" top: "y" input_param {{ shape {{ }} }} }}
    layer {{ name: "loss" type: "{layer_type}" bottom: "x" bottom: "y" top: "loss" }}
    """
    with pytest.raises(FormatError, match="needs a batch axis"):
        CaffeNet(read_net(text), phase="train")

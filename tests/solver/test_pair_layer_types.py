"""``PAIR_LAYER_TYPES``: every registered layer whose output couples the samples of the batch is gathered
across ranks by :func:`gather_loss_bottoms` (a layer missing from the list silently trains on each rank's
share of the pairs only)."""

from __future__ import annotations

import inspect

import pytest
import torch

from caffe_compat.layers.registry import layer_class, registered_types
from caffe_compat.net import CaffeNet
from caffe_compat.proto import caffe_pb2
from caffe_compat.solver.distributed import PAIR_LAYER_TYPES, GatherBottoms, gather_loss_bottoms

METRIC_LEARNING_MODULE = "caffe_compat.layers.metric_learning"
BATCH_BOTTOMS = ("embedding", "feature", "cosine")  # a batch of embeddings, or the cosines of its pairs
LABEL_BOTTOMS = ("label", "pair_label")


def _param(key: str, **fields) -> caffe_pb2.LayerParameter:
    """A LayerParameter whose registry key is ``key`` (``Python:<module>.<layer>`` for Python ports)."""
    param = caffe_pb2.LayerParameter(name="layer", bottom=["x", "label"], top=["out"], **fields)
    if key.startswith("Python:"):
        module, layer = key[len("Python:"):].rsplit(".", 1)
        param.type = "Python"
        param.python_param.module, param.python_param.layer = module, layer
    else:
        param.type = key
    return param


def _bottom_names(key: str) -> list[str]:
    forward = layer_class(_param(key)).forward
    return [n for n, p in inspect.signature(forward).parameters.items()
            if n != "self" and p.kind == p.POSITIONAL_OR_KEYWORD]


def pair_layer_types_in_registry() -> set[str]:
    """From the registry: the metric-learning family (every layer of its module: the pair cosines and the
    losses over a batch of embeddings or over those cosines), and any other port taking the same bottoms
    (a batch of embeddings or pair cosines, with labels), e.g. madkn's Python DistributionLossLayer."""
    found = set()
    for key in registered_types():
        cls = layer_class(_param(key))
        bottoms = _bottom_names(key)
        by_bottoms = len(bottoms) == 2 and bottoms[0] in BATCH_BOTTOMS and bottoms[1] in LABEL_BOTTOMS
        if cls.__module__ == METRIC_LEARNING_MODULE or by_bottoms:
            found.add(key)
    return found


def test_every_pair_layer_of_the_registry_is_gathered():
    expected = pair_layer_types_in_registry()
    # the derivation finds what the audit named (a guard on the derivation itself)
    assert {"CosineSimilarityBatch", "FAPPYLoss", "BatchContrastiveLoss", "RAWLoss",
            "Python:distribution_loss_layer.DistributionLossLayer"} <= expected
    missing = sorted(expected - set(PAIR_LAYER_TYPES))
    assert not missing, f"pair layers not gathered across ranks: {missing}"
    unknown = sorted(set(PAIR_LAYER_TYPES) - set(registered_types()))
    assert not unknown, f"PAIR_LAYER_TYPES names unregistered layer types: {unknown}"
    assert "SoftmaxWithLoss" not in PAIR_LAYER_TYPES


def _loss(key: str, x: torch.Tensor, labels: torch.Tensor) -> float:
    param = _param(key)
    layer = layer_class(param)(param, [tuple(x.shape), tuple(labels.shape)], "train")
    torch.manual_seed(0)  # miners that sample (distance-weighted) draw from torch's generator
    return float(layer(x, labels)[0].detach())


EMBEDDING_LOSSES = [k for k in sorted(pair_layer_types_in_registry()) if _bottom_names(k)[0] == "embedding"]


@pytest.mark.parametrize("key", EMBEDDING_LOSSES)
def test_listed_batch_losses_couple_the_batch(key):
    """Why they must be gathered: their loss over a batch is not the mean of the losses of its halves
    (pairs across the halves count), unlike a per-sample loss (the control below)."""
    g = torch.Generator().manual_seed(3)
    x = torch.nn.functional.normalize(torch.randn(12, 5, generator=g, dtype=torch.float64)).float()
    labels = torch.tensor([0.0, 0, 1, 1, 2, 2] * 2)
    whole = _loss(key, x, labels)
    halves = (_loss(key, x[:6], labels[:6]) + _loss(key, x[6:], labels[6:])) / 2
    assert abs(whole - halves) > 1e-3 * abs(whole), (key, whole, halves)


def test_per_sample_loss_is_the_mean_of_its_halves():
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(12, 3, generator=g)
    labels = torch.tensor([0.0, 0, 1, 1, 2, 2] * 2)
    whole = _loss("SoftmaxWithLoss", scores, labels)
    halves = (_loss("SoftmaxWithLoss", scores[:6], labels[:6]) + _loss("SoftmaxWithLoss", scores[6:], labels[6:])) / 2
    assert whole == pytest.approx(halves, rel=1e-6)


NET = """
name: "pairs"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 8 dim: 4 } } }
layer { name: "label" type: "Input" top: "label" input_param { shape { dim: 8 } } }
layer { name: "embed" type: "InnerProduct" bottom: "data" top: "embed"
  inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "contrastive" type: "BatchContrastiveLoss" bottom: "embed" bottom: "label" top: "contrastive" }
layer { name: "raw" type: "RAWLoss" bottom: "embed" bottom: "label" top: "raw" }
"""


def test_gather_loss_bottoms_wraps_the_registered_contrastive_and_raw_layers():
    net = CaffeNet(NET, phase="train")
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0.0, 0, 1, 1, 2, 2, 3, 3])
    before = net(data=x, label=labels)
    assert gather_loss_bottoms(net) == ["contrastive", "raw"]
    assert isinstance(net.layer("contrastive"), GatherBottoms) and isinstance(net.layer("raw"), GatherBottoms)
    after = net(data=x, label=labels)  # one process: the gather is the identity
    for name in ("contrastive", "raw"):
        assert float(after[name].detach()) == float(before[name].detach())


PYTHON_HISTOGRAM_NET = """
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 8 dim: 4 } } }
layer { name: "label" type: "Input" top: "label" input_param { shape { dim: 8 } } }
layer { name: "embed" type: "InnerProduct" bottom: "data" top: "embed"
  inner_product_param { num_output: 3 weight_filler { type: "xavier" } } }
layer { name: "cos" type: "CosineSimilarityBatch" bottom: "embed" bottom: "label" top: "cosine" top: "pair_label" }
layer { name: "hist" type: "Python" bottom: "cosine" bottom: "pair_label" top: "loss" loss_weight: 1
  python_param { module: "distribution_loss_layer" layer: "DistributionLossLayer"
    param_str: "grid_delta: 0.25\\nloss: exp\\ndistr_type: hist" } }
"""


def test_python_pair_layer_is_matched_by_its_registry_key():
    """The authors' histogram loss is a Python layer (step type "Python"): gather_loss_bottoms finds it by
    its registry key.  Fed by CosineSimilarityBatch, its bottoms are already global, so only the cosine
    layer is wrapped; fed directly by the features' layer, it would be wrapped itself."""
    net = CaffeNet(PYTHON_HISTOGRAM_NET, phase="train")
    assert gather_loss_bottoms(net) == ["cos"]
    assert not isinstance(net.layer("hist"), GatherBottoms)
    direct = CaffeNet(PYTHON_HISTOGRAM_NET.replace('bottom: "cosine" bottom: "pair_label" top: "loss"',
                                                   'bottom: "cosine_in" bottom: "pair_in" top: "loss"')
                      .replace('layer { name: "cos"',
                               'layer { name: "cin" type: "Input" top: "cosine_in" top: "pair_in" input_param { '
                               'shape { dim: 28 dim: 1 dim: 1 dim: 1 } shape { dim: 28 dim: 1 dim: 1 dim: 1 } } }\n'
                               'layer { name: "cos"'), phase="train")
    assert "hist" in gather_loss_bottoms(direct)

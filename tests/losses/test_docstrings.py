"""Every public loss, miner and module of caffe_compat.losses documents itself (help() must not show
torch.nn.Module's generic text), with its constructor parameters."""

from __future__ import annotations

import inspect

import pytest
import torch

from caffe_compat import losses

CLASSES = [getattr(losses, name) for name in losses.__all__ if inspect.isclass(getattr(losses, name))]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_class_has_its_own_docstring(cls):
    doc = vars(cls).get("__doc__")
    assert doc and doc.strip(), f"{cls.__name__} has no class docstring"
    if issubclass(cls, torch.nn.Module):
        assert doc != torch.nn.Module.__doc__


LOSSES = ["ContrastiveLoss", "TripletLoss", "LiftedStructLoss", "HistogramLoss", "BinomialDevianceLoss",
          "RAWLoss", "MultiSimilarityLoss", "MarginLoss", "FastAPLoss", "SmoothAPLoss", "CosineSimilarityBatch"]


@pytest.mark.parametrize("name", LOSSES)
def test_docstring_names_every_constructor_parameter(name):
    cls = getattr(losses, name)
    doc = inspect.getdoc(cls)
    for param in inspect.signature(cls.__init__).parameters:
        if param != "self":
            assert f"{param}:" in doc, (name, param)
    assert "Args:" in doc


def test_margin_loss_says_beta_is_shared_without_num_classes():
    doc = " ".join(inspect.getdoc(losses.MarginLoss).split())
    assert "β is one shared learnable scalar unless ``num_classes`` is given" in doc


# keywords of the loss modules that no MetricLossParameter field reaches (listed in the layer docstring)
MODULE_ONLY = {
    "ContrastiveLoss": ["power", "normalize"],
    "TripletLoss": ["squared", "normalize", "reduction"],
    "BinomialDevianceLoss": ["normalization"],
    "MultiSimilarityLoss": ["skip_incomplete_anchors"],
    "MarginLoss": ["learn_beta", "cutoff", "nonzero_loss_cutoff"],
    "FastAPLoss": ["analytic_gradient"],
    "SmoothAPLoss": ["include_query"],
}
# keywords set through metric_loss_param.mining / lambda
VIA_MINING = {"miner", "triplets", "vthm", "vthm_margin", "distance_weighted"}


def test_module_only_options_are_exactly_those_without_a_proto_field():
    from caffe_compat.layers import metric_learning
    from caffe_compat.proto import caffe_pb2

    proto_fields = set(caffe_pb2.MetricLossParameter.DESCRIPTOR.fields_by_name)
    doc = metric_learning.__doc__
    for spec in metric_learning.BATCH_LOSSES.values():
        params = set(inspect.signature(getattr(losses, spec.loss).__init__).parameters) - {"self"}
        from_proto = {keyword for keyword, _ in spec.fields.values()}
        assert set(spec.fields) <= proto_fields
        only = set(MODULE_ONLY.get(spec.loss, []))
        assert params - from_proto - VIA_MINING == only, spec.loss
        for name in only:
            assert f"``{name}``" in doc, (spec.loss, name)
    assert "MultiSimilarityLoss.official()" in doc

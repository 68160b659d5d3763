"""Every loss in float32 on each device (CPU, and CUDA when present) against its float64 CPU value and
gradient: the vectorised code must give the same numbers wherever it runs."""

from __future__ import annotations

import pytest
import torch

from caffe_compat import losses

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# Deterministic losses with their defaults (miners that draw random samples are tested in their files).
LOSSES = {
    "BinomialDevianceLoss": losses.BinomialDevianceLoss,
    "ContrastiveLoss": losses.ContrastiveLoss,
    "FAPPYLoss caffe": lambda: losses.FAPPYLoss(delta=0.01, mode="caffe"),
    "FAPPYLoss paper": lambda: losses.FAPPYLoss(delta=0.01, mode="paper"),
    "FastAPLoss": losses.FastAPLoss,
    "HistogramLoss": losses.HistogramLoss,
    "LiftedStructLoss": losses.LiftedStructLoss,
    "MultiSimilarityLoss": losses.MultiSimilarityLoss,
    "RAWLoss": losses.RAWLoss,
    "SmoothAPLoss": losses.SmoothAPLoss,
    "TripletLoss": losses.TripletLoss,
}


def _batch():
    gen = torch.Generator().manual_seed(11)
    labels = torch.arange(48) // 6
    centres = torch.randn(8, 32, generator=gen, dtype=torch.float64)
    features = centres[labels] + 0.8 * torch.randn(48, 32, generator=gen, dtype=torch.float64)
    return features, labels


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_float32_on_device_equals_float64_on_cpu(name, device):
    features, labels = _batch()
    reference_x = features.clone().requires_grad_()
    reference = LOSSES[name]()(reference_x, labels)
    reference.backward()
    x = features.float().to(device).requires_grad_()
    value = LOSSES[name]()(x, labels.to(device))
    value.backward()
    value, reference = float(value.detach()), float(reference.detach())
    assert x.grad.device.type == device
    assert reference != 0.0 and reference_x.grad.abs().max() > 0
    assert abs(value - reference) <= 2e-5 * abs(reference) + 1e-6, (value, reference)
    scale = float(reference_x.grad.abs().max())
    # bin and margin boundaries are crossed by float32 rounding only on a set of measure zero; the
    # tolerance is float32's accumulated rounding in sums over B² pairs
    assert float((x.grad.double().cpu() - reference_x.grad).abs().max()) <= 2e-4 * scale

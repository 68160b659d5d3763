"""Metric-learning layers: the FAPPY authors' two layers and our batch-loss layer types.

**CosineSimilarityBatch** (the authors' layer; bottoms ``feature (B, D…)``, ``label (B)``; tops
``cosine``, ``pair_label``, both ``(M, 1, 1, 1)`` with M = B(B−1)/2 pairs i<j in row-major order).
``cosine_similarity_batch_param { pos_label neg_label }`` (defaults 1, −1).  ``pair_label`` reproduces
the C++ off-by-one (element 0 stays 0, element k+1 holds pair k's label); see
:mod:`caffe_compat.losses.cosine_similarity_batch`.

**FAPPYLoss** (the authors' layer; bottoms ``cosine``, ``label``; top ``loss``).
``fappy_loss_param { delta }`` (proto default 0.001; the authors train with 1e-4).  Forward is the C++
layer's loss with its analytic diff as the gradient (accumulating per-level normalisation, Δ levels
2, 1, 1/2, … down to the last power-of-two fraction ≥ delta); see :mod:`caffe_compat.losses.fappy`.

**Batch loss layers** (ours, for the papers' baselines; bottoms ``embedding (B, D…)``, ``label (B)``;
top the scalar loss; parameters in the extension message ``metric_loss_param`` (LayerParameter field
9200), unset fields keep each loss's documented default):

| type | loss module | metric_loss_param fields read |
| --- | --- | --- |
| BatchContrastiveLoss | ContrastiveLoss | margin |
| TripletLoss | TripletLoss | margin, mining (all / semihard / hard) |
| LiftedStructSimilaritySoftmaxLoss | LiftedStructLoss | margin |
| HistogramLoss | HistogramLoss | num_bins |
| BinomialDevianceLoss | BinomialDevianceLoss | alpha, gamma, cost |
| MultiSimilarityLoss | MultiSimilarityLoss | alpha, beta, base |
| RAWLoss | RAWLoss | alpha, beta, gamma, lambda (VTHM margin), mining ("none" turns VTHM off) |
| MarginLoss | MarginLoss | margin, beta, num_classes |
| FastAPLoss | FastAPLoss | num_bins |
| SmoothAPLoss | SmoothAPLoss | temperature |
"""

from __future__ import annotations

import torch

from caffe_compat.errors import FormatError
from caffe_compat.layers.registry import CaffeLayer, register_layer
from caffe_compat.losses.cosine_similarity_batch import cosine_similarity_batch
from caffe_compat.losses.fappy import fappy_caffe


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], -1)


def _check_bottoms(layer: CaffeLayer, count: int) -> None:
    if len(layer.bottom_shapes) != count:
        raise FormatError(f"layer '{layer.layer_name}' ({layer.caffe_type}): needs {count} bottoms, "
                          f"got {len(layer.bottom_shapes)}")


@register_layer("CosineSimilarityBatch")
class CosineSimilarityBatch(CaffeLayer):
    """Pairwise cosines of a batch and Caffe's pair labels (see the module docstring)."""

    def __init__(self, param, bottom_shapes, phase="test"):
        super().__init__(param, bottom_shapes, phase)
        _check_bottoms(self, 2)
        p = param.cosine_similarity_batch_param
        self.pos_label, self.neg_label = float(p.pos_label), float(p.neg_label)

    def output_shapes(self):
        b = self.bottom_shapes[0][0]
        m = b * (b - 1) // 2
        return [(m, 1, 1, 1)] * len(self.param.top)

    def forward(self, feature, label):
        cosine, pair_label = cosine_similarity_batch(_rows(feature), label.reshape(-1), self.pos_label, self.neg_label)
        return (cosine, pair_label)[:len(self.param.top)]


@register_layer("FAPPYLoss")
class FAPPYLossLayer(CaffeLayer):
    """The authors' FAPPY loss on CosineSimilarityBatch's cosines (see the module docstring)."""

    is_loss = True

    def __init__(self, param, bottom_shapes, phase="test"):
        super().__init__(param, bottom_shapes, phase)
        _check_bottoms(self, 2)
        self.delta = float(param.fappy_loss_param.delta)

    def output_shapes(self):
        return [()]

    def forward(self, cosine, label):
        return (fappy_caffe(cosine.reshape(-1), label.reshape(-1), self.delta),)


def _opt(p, name):
    return getattr(p, name) if p.HasField(name) else None


def _kwargs(p, mapping: dict[str, str]) -> dict:
    out = {}
    for field, keyword in mapping.items():
        value = _opt(p, field)
        if value is not None:
            out[keyword] = value
    return out


def _triplet_kwargs(p):
    kw = _kwargs(p, {"margin": "margin"})
    if p.HasField("mining"):
        kw["triplets"] = p.mining
    return kw


def _raw_kwargs(p):
    kw = _kwargs(p, {"alpha": "alpha", "beta": "beta", "gamma": "gamma", "lambda": "vthm_margin"})
    if p.HasField("mining"):
        if p.mining not in ("vthm", "none"):
            raise FormatError(f"RAWLoss: metric_loss_param.mining must be 'vthm' or 'none', got {p.mining!r}")
        kw["vthm"] = p.mining == "vthm"
    return kw


#: layer type -> (loss class name in caffe_compat.losses, metric_loss_param -> keyword arguments)
BATCH_LOSSES = {
    "BatchContrastiveLoss": ("ContrastiveLoss", lambda p: _kwargs(p, {"margin": "margin"})),
    "TripletLoss": ("TripletLoss", _triplet_kwargs),
    "LiftedStructSimilaritySoftmaxLoss": ("LiftedStructLoss", lambda p: _kwargs(p, {"margin": "margin"})),
    "HistogramLoss": ("HistogramLoss", lambda p: _kwargs(p, {"num_bins": "num_bins"})),
    "BinomialDevianceLoss": ("BinomialDevianceLoss",
                             lambda p: _kwargs(p, {"alpha": "alpha", "gamma": "gamma", "cost": "neg_cost"})),
    "MultiSimilarityLoss": ("MultiSimilarityLoss", lambda p: _kwargs(p, {"alpha": "alpha", "beta": "beta", "base": "base"})),
    "RAWLoss": ("RAWLoss", _raw_kwargs),
    "MarginLoss": ("MarginLoss", lambda p: _kwargs(p, {"margin": "margin", "beta": "beta", "num_classes": "num_classes"})),
    "FastAPLoss": ("FastAPLoss", lambda p: _kwargs(p, {"num_bins": "num_bins"})),
    "SmoothAPLoss": ("SmoothAPLoss", lambda p: _kwargs(p, {"temperature": "temperature"})),
}


class BatchLossLayer(CaffeLayer):
    """Adapter: a ``caffe_compat.losses`` module as a Caffe loss layer over (embedding, label)."""

    is_loss = True
    loss_name = ""
    make_kwargs = staticmethod(lambda p: {})

    def __init__(self, param, bottom_shapes, phase="test"):
        super().__init__(param, bottom_shapes, phase)
        _check_bottoms(self, 2)
        import caffe_compat.losses as losses

        try:
            self.loss = getattr(losses, self.loss_name)(**self.make_kwargs(param.metric_loss_param))
        except TypeError as exc:
            raise FormatError(f"layer '{self.layer_name}' ({self.caffe_type}): bad metric_loss_param: {exc}") from None

    def caffe_blobs(self):
        return list(self.loss.parameters())  # MarginLoss's learnable per-class beta

    def output_shapes(self):
        return [()]

    def forward(self, embedding, label):
        return (self.loss(_rows(embedding), label.reshape(-1)),)


for _type, (_name, _make) in BATCH_LOSSES.items():
    register_layer(_type)(type(f"{_type}Layer", (BatchLossLayer,),
                               {"loss_name": _name, "make_kwargs": staticmethod(_make),
                                "__doc__": f"Caffe layer type {_type!r} over caffe_compat.losses.{_name}."}))

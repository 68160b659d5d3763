"""Loss heads appended to an embedding blob: FAPPY (the authors' two layers) or a baseline loss layer.

``fappy`` is exactly the authors' head::

    CosineSimilarityBatch(embedding, label) -> cosine, pair_label      (M = B(B-1)/2 cosines)
    FAPPYLoss(cosine, label) -> loss      fappy_loss_param { delta }   (authors: delta 1e-4)

The baselines of the paper's Tables 1-2 are one layer each, ``<Type>(embedding, label) -> loss``, with
their settings in ``metric_loss_param`` (caffe-compat's extension message, field 9200):

* ``contrastive``: ``BatchContrastiveLoss``, ``margin: 1`` (Caffe ContrastiveLoss's default);
* ``triplet``: ``TripletLoss``, ``margin: 0.2``, ``mining: "semihard"`` (FaceNet);
* ``lifted``: ``LiftedStructSimilaritySoftmaxLoss``, ``margin: 1`` (Oh Song et al.);
* ``histogram``: ``HistogramLoss``, ``num_bins: 100`` (bin width 2/100 = 0.02).

The FAPPY paper states none of the baselines' settings.  Margins follow the original papers where
they give one (FaceNet's alpha = 0.2, lifted structure's m = 1); the histogram bin count is
pytorch-metric-learning's default, not checked against Ustinova & Lempitsky.  Override per call.
"""

from __future__ import annotations

from caffe_compat.errors import FormatError
from caffe_compat.zoo.builder import NetBuilder

#: FAPPY's minimum bin width in the authors' prototxt (all three data sets).
AUTHORS_DELTA = 1e-4

BASELINES = {
    "contrastive": ("BatchContrastiveLoss", {"margin": 1.0}),
    "triplet": ("TripletLoss", {"margin": 0.2, "mining": "semihard"}),
    "lifted": ("LiftedStructSimilaritySoftmaxLoss", {"margin": 1.0}),
    "histogram": ("HistogramLoss", {"num_bins": 100}),
}

LOSSES = ("fappy",) + tuple(BASELINES)


def add_loss_head(b: NetBuilder, loss: str, embedding: str, label: str | None, delta: float = AUTHORS_DELTA,
                  **settings) -> str:
    """Append the head named ``loss`` (one of :data:`LOSSES`) reading ``embedding`` and ``label``;
    ``settings`` override the baseline's ``metric_loss_param`` fields.  Returns the loss blob."""
    if label is None:
        raise FormatError(f"the {loss} head needs a label blob; the data layer provides none")
    if loss == "fappy":
        if settings:
            raise FormatError(f"the fappy head takes only delta, got {sorted(settings)}")
        b.add("cosine", "CosineSimilarityBatch", [embedding, label], ["cosine", "pair_label"])
        b.add("loss", "FAPPYLoss", ["cosine", label], ["loss"]).fappy_loss_param.delta = delta
        return "loss"
    if loss not in BASELINES:
        raise FormatError(f"unknown loss head '{loss}'; expected one of {', '.join(LOSSES)}")
    type_, defaults = BASELINES[loss]
    layer = b.add("loss", type_, [embedding, label], ["loss"])
    param = layer.metric_loss_param
    for key, value in {**defaults, **settings}.items():
        if key not in param.DESCRIPTOR.fields_by_name:
            raise FormatError(f"{type_}: metric_loss_param has no field '{key}'")
        setattr(param, key, value)
    return "loss"

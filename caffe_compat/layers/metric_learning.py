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
9200), unset fields keep each loss's documented default).  Each layer maps every ``metric_loss_param``
field its loss module has an option for; a field the layer does not use (including ``lambda`` when no
VTHM miner runs, and ``cost`` together with ``beta``) is a :class:`~caffe_compat.errors.FormatError`
naming the layer, the field and the fields it accepts, never silently ignored:

Each layer type is one class below, declaring its ``spec`` (:class:`BatchLossSpec`: the loss module,
the fields and the mining values); its docstring, :data:`BATCH_LOSSES` and the field checks are made from
that spec, so ``help()`` on a layer class lists exactly what it accepts.

``mining`` picks the pair miner of :mod:`caffe_compat.losses.miners` put in front of the loss (its
``miner=`` argument): ``vthm`` (:class:`VTHMMiner`, margin ``lambda``, default 0.1; the unified-view
paper's Binomial+VTHM, RAW+VTHM, lifted+VTHM, and multi-similarity's own pair mining),
``easy_positive`` (:class:`EasyPositiveMiner`, Levi et al.'s EPS with triplet, margin and MS losses),
``distance_weighted`` (:class:`DistanceWeightedMiner` with Wu et al.'s cutoffs 0.5 / 1.4, drawing from
torch's global generator: seed it with ``torch.manual_seed``; the paper's margin loss, RAW+DW), ``none``
(every pair).  The miners work in front of any pair loss, so every layer with a miner takes all three.
For ``TripletLoss``, ``all`` / ``semihard`` / ``hard`` choose the triplet set (the module's
``triplets``) and ``<miner>+semihard`` / ``<miner>+hard`` combine a miner with a set (e.g.
``easy_positive+semihard``).  Unknown values raise a FormatError listing the valid ones.
``CosineSimilarityBatch`` and ``FAPPYLoss`` take no ``metric_loss_param`` field.

**MarginLoss's β**: without ``num_classes`` the layer learns *one shared* β (a single-element blob);
Wu et al. learn one β per class: set ``num_classes`` (labels must be integers in [0, num_classes)).

**Module-only options.**  ``metric_loss_param`` (proto message ``MetricLossParameter``) has no field
for these keywords of the loss modules; a layer always uses their defaults (in parentheses).  To change
one, use the module from ``caffe_compat.losses`` directly:

* ``ContrastiveLoss``: ``power`` (2), ``normalize`` (False);
* ``TripletLoss``: ``squared`` (True), ``normalize`` (True), ``reduction`` ("mean");
* ``BinomialDevianceLoss``: ``normalization`` ("pairs"; "anchor" is unified-view Eq. (12));
* ``MultiSimilarityLoss``: ``skip_incomplete_anchors`` (False), hence the ``MultiSimilarityLoss.official()``
  preset (α=2, β=40, base 0.5, VTHM ε=0.1, incomplete anchors skipped) — the layer gets α, β, base and
  ``mining: "vthm"`` with ``lambda`` but not the skip;
* ``MarginLoss``: ``learn_beta`` (True), ``cutoff`` (0.5), ``nonzero_loss_cutoff`` (1.4);
* ``FastAPLoss``: ``analytic_gradient`` (False; the value and gradient are the same either way);
* ``SmoothAPLoss``: ``include_query`` (False; True is the authors' code and PML);
* the miners' options: ``EasyPositiveMiner(normalize)`` (True), ``DistanceWeightedMiner(cutoff,
  nonzero_loss_cutoff, generator)`` (0.5, 1.4, torch's global generator), ``VTHMMiner``'s margin only
  through ``lambda``;
* ``caffe_compat.losses.CosineSimilarityBatch(faithful=False)`` (the corrected ``pair_label``) and
  ``FAPPYLoss(mode="paper")`` (Algorithm 1 as printed): the layers are always the authors' C++ behaviour.

``HistogramLoss``, ``FastAPLoss`` and ``SmoothAPLoss`` take no ``mining`` (their modules have no
``miner=``: histogram / list-wise losses over every pair).
"""

from __future__ import annotations

import math

import torch

from caffe_compat.errors import FormatError, MemoryBudgetError
from caffe_compat.io.safe_open import memory_budget
from caffe_compat.layers.facts import BlobCount, Shapes
from caffe_compat.layers.registry import CaffeLayer, register_layer
from caffe_compat.losses.cosine_similarity_batch import cosine_similarity_batch
from caffe_compat.losses.fappy import fappy_caffe


def scalar_loss(cls, layer, bottoms) -> Shapes:
    """The shape rule of a loss layer: one scalar top."""
    return Shapes([()])


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], math.prod(x.shape[1:]))  # not -1: ambiguous for an empty batch (RuntimeError)


@register_layer("CosineSimilarityBatch")
class CosineSimilarityBatchLayer(CaffeLayer):
    """Pairwise cosines of a batch and Caffe's pair labels (see the module docstring).

    Reads ``cosine_similarity_batch_param { pos_label neg_label }``; accepts no ``metric_loss_param`` field
    (one set is a FormatError)."""

    bottoms = BlobCount.exact(2)
    tops = BlobCount(1, 2)
    couples_batch = True

    @classmethod
    def infer(cls, layer, bottoms):
        """``(M, 1, 1, 1)`` for each top, M = B(B−1)/2 pairs of the batch of B."""
        b = bottoms[0][0]
        return Shapes([(b * (b - 1) // 2, 1, 1, 1)] * len(layer.top))

    def __init__(self, param, bottom_shapes, phase="test"):
        super().__init__(param, bottom_shapes, phase)
        _reject_unused(self, param.metric_loss_param, ())
        p = param.cosine_similarity_batch_param
        self.pos_label, self.neg_label = float(p.pos_label), float(p.neg_label)
        for field, value in (("pos_label", self.pos_label), ("neg_label", self.neg_label)):
            if not math.isfinite(value):  # the authors' layer makes an int of it (NaN: ValueError, inf: OverflowError)
                raise FormatError(f"layer '{self.layer_name}' (CosineSimilarityBatch): "
                                  f"cosine_similarity_batch_param.{field} must be finite, got {value}")
        self.num_tops = len(param.top)

    def forward(self, feature, label):
        cosine, pair_label = cosine_similarity_batch(_rows(feature), label.reshape(-1), self.pos_label, self.neg_label)
        return (cosine, pair_label)[:self.num_tops]


@register_layer("FAPPYLoss")
class FAPPYLossLayer(CaffeLayer):
    """The authors' FAPPY loss on CosineSimilarityBatch's cosines (see the module docstring).

    Reads ``fappy_loss_param { delta }``; accepts no ``metric_loss_param`` field (one set is a FormatError)."""

    is_loss = True
    bottoms = BlobCount.exact(2)
    tops = BlobCount(0, 1)
    couples_batch = True
    infer = classmethod(scalar_loss)
    refuses_forced_backward = (1,)  # LossLayer::AllowForceBackward: no diff for the labels

    def __init__(self, param, bottom_shapes, phase="test"):
        super().__init__(param, bottom_shapes, phase)
        _reject_unused(self, param.metric_loss_param, ())
        self.delta = float(param.fappy_loss_param.delta)

    def forward(self, cosine, label):
        return (fappy_caffe(cosine.reshape(-1), label.reshape(-1), self.delta),)


# ---- batch loss layers: metric_loss_param -> loss module keywords ----

MINERS = ("vthm", "easy_positive", "distance_weighted")


def _make_miner(name: str, vthm_margin):
    from caffe_compat.losses import DistanceWeightedMiner, EasyPositiveMiner, VTHMMiner

    if name == "vthm":
        return VTHMMiner() if vthm_margin is None else VTHMMiner(vthm_margin)
    if name == "easy_positive":
        return EasyPositiveMiner()
    return DistanceWeightedMiner()


def _pair_mining() -> dict:
    """``mining`` of a loss with a ``miner=`` argument: ``none`` or one of :data:`MINERS`."""
    table = {"none": lambda lam: {}}
    for name in MINERS:
        table[name] = lambda lam, name=name: {"miner": _make_miner(name, lam)}
    return table


def _triplet_mining() -> dict:
    table = {t: (lambda lam, t=t: {"triplets": t}) for t in ("all", "semihard", "hard")}
    for name in MINERS:
        table[name] = lambda lam, name=name: {"miner": _make_miner(name, lam)}
    for name in MINERS:
        for t in ("semihard", "hard"):
            table[f"{name}+{t}"] = lambda lam, name=name, t=t: {"miner": _make_miner(name, lam), "triplets": t}
    return table


def _raw_mining() -> dict:
    table = {
        "vthm": lambda lam: {"vthm": True} if lam is None else {"vthm": True, "vthm_margin": lam},
        "none": lambda lam: {"vthm": False},
    }
    for name in ("easy_positive", "distance_weighted"):
        table[name] = lambda lam, name=name: {"miner": _make_miner(name, lam)}
    return table


def _margin_mining() -> dict:
    table = {"distance_weighted": lambda lam: {}, "none": lambda lam: {"distance_weighted": False}}
    for name in ("vthm", "easy_positive"):
        table[name] = lambda lam, name=name: {"miner": _make_miner(name, lam)}
    return table


class BatchLossSpec:
    """How one layer type reads ``metric_loss_param``.

    ``fields``: plain field -> (loss keyword, description); ``mining``: accepted ``mining`` values ->
    ``f(lambda_or_None) -> keywords`` (empty: the layer takes no ``mining``), ``default_mining`` the value
    used when the field is unset; ``lambda`` (the VTHM margin) is accepted iff a VTHM value exists and is
    used iff the effective value involves ``vthm``.
    """

    def __init__(self, loss: str, fields: dict, mining: dict | None = None, default_mining: str = "",
                 summary: str = ""):
        self.loss = loss
        self.fields = fields
        self.mining = mining or {}
        self.default_mining = default_mining
        self.summary = summary

    @property
    def accepted(self) -> tuple[str, ...]:
        names = list(self.fields)
        if self.mining:
            names.append("mining")
            if any("vthm" in v.split("+") for v in self.mining):
                names.append("lambda")
        return tuple(names)

    def docstring(self, layer_type: str) -> str:
        lines = [f"Caffe layer type {layer_type!r} over :class:`caffe_compat.losses.{self.loss}`.", ""]
        if self.summary:
            lines += [self.summary, ""]
        lines.append("Accepted ``metric_loss_param`` fields (unset: the module's default):")
        lines.append("")
        for field, (keyword, text) in self.fields.items():
            lines.append(f"* ``{field}`` → ``{keyword}``: {text}")
        if self.mining:
            values = ", ".join(f"``{v}``" for v in self.mining)
            lines.append(f"* ``mining``: the pair miner in front of the loss, one of {values} "
                         f"(default ``{self.default_mining}``)")
            if "lambda" in self.accepted:
                lines.append("* ``lambda``: VTHM margin λ (default 0.1); only with a ``vthm`` mining value")
        lines += ["", "Any other field set is a FormatError naming the layer, the field and these fields."]
        return "\n".join(lines)


def _set_fields(message) -> list[str]:
    return [descriptor.name for descriptor, _ in message.ListFields()]


def _reject_unused(layer: CaffeLayer, message, accepted, why: dict | None = None) -> None:
    """FormatError for the first field of ``metric_loss_param`` that is set but not in ``accepted``."""
    for field in _set_fields(message):
        if field not in accepted:
            reason = (why or {}).get(field, "is not used by this layer type")
            raise FormatError(
                f"layer '{layer.layer_name}' ({layer.caffe_type}): metric_loss_param.{field} {reason}; "
                f"it accepts: {', '.join(accepted) if accepted else 'no metric_loss_param field'}")


def loss_kwargs(layer: CaffeLayer, spec: BatchLossSpec, p) -> dict:
    """The loss module keywords for ``metric_loss_param`` ``p``; FormatError for an unused field."""
    _reject_unused(layer, p, spec.accepted)
    where = f"layer '{layer.layer_name}' ({layer.caffe_type})"
    kw = {keyword: getattr(p, field) for field, (keyword, _) in spec.fields.items() if p.HasField(field)}
    if p.HasField("beta") and p.HasField("cost") and "cost" in spec.fields:
        raise FormatError(f"{where}: metric_loss_param.cost is not used when beta is set (β = α·cost unless "
                          f"beta is given); set one of them; it accepts: {', '.join(spec.accepted)}")
    if spec.mining:
        mining = p.mining if p.HasField("mining") else spec.default_mining
        if mining not in spec.mining:
            raise FormatError(f"{where}: metric_loss_param.mining {mining!r} is not one of: "
                              f"{', '.join(spec.mining)}")
        lam = getattr(p, "lambda") if p.HasField("lambda") else None
        if lam is not None and "vthm" not in mining.split("+"):
            raise FormatError(f"{where}: metric_loss_param.lambda (the VTHM margin) is not used with mining "
                              f"{mining!r}; it needs a 'vthm' mining value; it accepts: {', '.join(spec.accepted)}")
        kw.update(spec.mining[mining](lam))
    return kw


class BatchLossLayer(CaffeLayer):
    """Adapter: a ``caffe_compat.losses`` module as a Caffe loss layer over (embedding, label).  A subclass
    declares ``spec``; its docstring is generated from it."""

    is_loss = True
    bottoms = BlobCount.exact(2)
    tops = BlobCount(0, 1)
    couples_batch = True
    param_message = "metric_loss_param"
    refuses_forced_backward = (1,)  # LossLayer::AllowForceBackward: no diff for the labels
    spec: BatchLossSpec

    @classmethod
    def infer(cls, layer, bottoms):
        """A scalar loss over the embedding's rows: its first axis is the batch, so a 0-axis embedding (no batch
        axis) is a FormatError."""
        if not len(bottoms[0]):
            raise FormatError(f"layer '{layer.name}' ({layer.type}): the embedding bottom needs a batch axis "
                              f"(B, ...), got a 0-axis bottom")
        return Shapes([()])

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "spec" in vars(cls) and vars(cls).get("__doc__") is None:
            cls.__doc__ = cls.spec.docstring(cls.__name__.removesuffix("Layer"))

    def __init__(self, param, bottom_shapes, phase="test"):
        super().__init__(param, bottom_shapes, phase)
        import caffe_compat.losses as losses

        kwargs = loss_kwargs(self, self.spec, param.metric_loss_param)
        self._check_sizes(kwargs)
        try:
            self.loss = getattr(losses, self.spec.loss)(**kwargs)
        except (TypeError, ValueError) as exc:
            raise FormatError(f"layer '{self.layer_name}' ({self.caffe_type}): bad metric_loss_param: {exc}") from None

    def _check_sizes(self, kwargs: dict) -> None:
        """MemoryBudgetError before the loss allocates what ``num_bins`` (a histogram row of num_bins + 1 per
        sample) or ``num_classes`` (a learnable beta per class) ask for: 2^32 - 1 asked for 17 to 103 GB."""
        batch = max(1, int(self.bottom_shapes[0][0])) if self.bottom_shapes and self.bottom_shapes[0] else 1
        for field, per in (("num_bins", 4 * 4 * batch), ("num_classes", 4)):
            value = kwargs.get(field)
            needed = per * (value + 1) if isinstance(value, int) and value > 0 else 0
            if needed > (64 << 20) and needed > memory_budget(fraction=1.0):
                raise MemoryBudgetError(f"layer '{self.layer_name}' ({self.caffe_type}): metric_loss_param.{field} "
                                        f"{value} needs {needed / 2 ** 30:.3g} GiB, more than the memory available; "
                                        f"set CAFFE_COMPAT_MEMORY_BUDGET to allow more")

    def caffe_blobs(self):
        return list(self.loss.parameters())  # MarginLoss's learnable per-class beta

    def forward(self, embedding, label):
        if embedding.shape[0] == 0 and label.numel() == 0:  # no pair, no loss (the miners' reductions over an
            return (_rows(embedding).sum() * 0.0,)  # empty batch raised IndexError: MarginLoss, RAWLoss)
        return (self.loss(_rows(embedding), label.reshape(-1)),)


@register_layer("BatchContrastiveLoss")
class BatchContrastiveLossLayer(BatchLossLayer):
    spec = BatchLossSpec(
        "ContrastiveLoss", {"margin": ("margin", "m of the dissimilar hinge (default 1.0)")}, _pair_mining(), "none")


@register_layer("TripletLoss")
class TripletLossLayer(BatchLossLayer):
    spec = BatchLossSpec(
        "TripletLoss", {"margin": ("margin", "triplet margin (default 0.2)")}, _triplet_mining(), "all",
        "``mining``: ``all`` / ``semihard`` / ``hard`` set ``triplets``; a miner name sets ``miner`` (over all "
        "triplets), ``<miner>+semihard`` / ``<miner>+hard`` both (e.g. EPS: ``easy_positive``).")


@register_layer("LiftedStructSimilaritySoftmaxLoss")
class LiftedStructSimilaritySoftmaxLossLayer(BatchLossLayer):
    spec = BatchLossSpec(
        "LiftedStructLoss", {"margin": ("margin", "m in exp(m − D) (default 1.0)")}, _pair_mining(), "none")


@register_layer("HistogramLoss")
class HistogramLossLayer(BatchLossLayer):
    spec = BatchLossSpec(
        "HistogramLoss", {"num_bins": ("num_bins", "number of bins, Δ = 2/num_bins (default 100)")})


@register_layer("BinomialDevianceLoss")
class BinomialDevianceLossLayer(BatchLossLayer):
    spec = BatchLossSpec(
        "BinomialDevianceLoss",
        {"alpha": ("alpha", "α, positive-pair scale (default 2)"),
         "beta": ("beta", "β, negative-pair scale (default α·C = 50); not together with cost"),
         "gamma": ("gamma", "γ, similarity threshold (default 0.5)"),
         "cost": ("neg_cost", "Yi's negative cost C, β = α·C (default 25); not together with beta")},
        _pair_mining(), "none",
        "Normalisation is Yi et al.'s batch-wide pair counts; the unified view's per-anchor Eq. (12) "
        "(``normalization='anchor'``) is module-only.")


@register_layer("MultiSimilarityLoss")
class MultiSimilarityLossLayer(BatchLossLayer):
    spec = BatchLossSpec(
        "MultiSimilarityLoss",
        {"alpha": ("alpha", "α (default 2)"), "beta": ("beta", "β (default 50; the authors' release: 40)"),
         "base": ("base", "similarity threshold λ of the MS paper (default 0.5)")},
        _pair_mining(), "none",
        "``mining: \"vthm\"`` with ``lambda`` = ε is the MS paper's pair mining "
        "(``MultiSimilarityLoss.official()`` also skips incomplete anchors: module only).")


@register_layer("RAWLoss")
class RAWLossLayer(BatchLossLayer):
    spec = BatchLossSpec(
        "RAWLoss",
        {"alpha": ("alpha", "α (default 2)"), "beta": ("beta", "β (default 50)"),
         "gamma": ("gamma", "γ (default 0.5)")},
        _raw_mining(), "vthm",
        "``mining: \"vthm\"`` (default) is RAW+VTHM with ``lambda`` → ``vthm_margin``; ``none`` is plain RAW "
        "(``vthm=False``); ``distance_weighted`` is RAW+DW.")


@register_layer("MarginLoss")
class MarginLossLayer(BatchLossLayer):
    spec = BatchLossSpec(
        "MarginLoss",
        {"margin": ("margin", "α (default 0.2)"),
         "beta": ("beta", "initial value of the learnable β (default 1.2)"),
         "num_classes": ("num_classes", "one learnable β per class, as Wu et al. (labels in [0, num_classes)); "
                                        "unset: ONE shared β for all classes")},
        _margin_mining(), "distance_weighted",
        "**β is one shared learnable scalar unless ``num_classes`` is set** (Wu et al. learn β per class: "
        "set ``num_classes``).  "
        "``mining: \"distance_weighted\"`` (default) is Wu et al.'s sampling (global torch generator); "
        "``none`` uses every pair (``distance_weighted=False``); ``easy_positive`` is EPS + margin.")


@register_layer("FastAPLoss")
class FastAPLossLayer(BatchLossLayer):
    spec = BatchLossSpec(
        "FastAPLoss", {"num_bins": ("num_bins", "L, bin centres linspace(0, 4, L+1) (default 10)")})


@register_layer("SmoothAPLoss")
class SmoothAPLossLayer(BatchLossLayer):
    spec = BatchLossSpec(
        "SmoothAPLoss", {"temperature": ("temperature", "sigmoid temperature τ (default 0.01)")})


#: Layer type -> spec, derived from the registered batch-loss classes.
BATCH_LOSSES: dict[str, BatchLossSpec] = {cls.caffe_type: cls.spec for cls in BatchLossLayer.__subclasses__()}

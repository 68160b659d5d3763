"""Shape inference without running a network: every blob's shape from the layer ports' shape rules.

:func:`infer_shapes` walks a (V2) NetParameter in order and asks each layer's port (through the registry,
without building it) for its rule (``CaffeLayer.infer``: top shapes, learnable blob shapes, multiply-adds;
the rules themselves are torch-free and live with the ports).  Caffe's bottom/top counts are checked
first (``CaffeLayer.check_blob_counts``).  A top is ``None`` (unknown) when it depends on data (a Data
layer's images) or on an unknown bottom; a layer type that has no rule at all (a Caffe 1.0 type without a
port, a ``Python`` layer without a native port) gives unknown tops too and is listed by
:func:`types_without_rule`, so ``inspect`` can say which type lacks one.  The catch-all kept from Caffe's
conventions: such a layer with a ``loss_weight`` (or a ``*Loss`` type) has a scalar top 0.

Bad input raises :class:`~caffe_compat.errors.FormatError` naming the layer, its type and the field or
input at fault, where Caffe would stop with a failed CHECK; any arithmetic failure on malformed shapes
becomes such an error too (no bare ValueError reaches the CLI).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from caffe_compat.errors import FormatError, MemoryBudgetError
from caffe_compat.io.safe_open import memory_budget
from caffe_compat.layers.facts import Shapes, count
from caffe_compat.layers.registry import CaffeLayer, port_for


@dataclass
class LayerShapes:
    name: str
    type: str
    bottoms: list[str]
    tops: list[str]
    top_shapes: list[tuple[int, ...] | None]
    param_shapes: list[tuple[int, ...]] = field(default_factory=list)
    macs: int = 0
    #: The bottoms' shapes the rule was asked with, and its answer (None when a bottom was unknown or the
    #: type has no rule): what building the net hands to the port (``CaffeLayer.build``) instead of asking again.
    bottom_shapes: list[tuple[int, ...] | None] = field(default_factory=list)
    rule: Shapes | None = None


def has_shape_rule(layer) -> bool:
    """True when the layer's port has a shape rule (``infer`` is overridden)."""
    return _has_rule(port_for(layer))


def _has_rule(port) -> bool:
    return port is not None and port.infer.__func__ is not _NO_RULE


_NO_RULE = CaffeLayer.infer.__func__


def types_without_rule(net) -> list[str]:
    """The layer types (registry keys for Python layers) of ``net`` that have no shape rule."""
    from caffe_compat.layers.registry import registry_key

    return sorted({registry_key(layer) for layer in net.layer if not has_shape_rule(layer)})


def layer_shapes(layer, bottoms) -> Shapes:
    """One layer's shapes: its port's rule after Caffe's count checks (unknown tops without a rule)."""
    return _layer_shapes(layer, port_for(layer), bottoms, len(layer.top))


def _layer_shapes(layer, port, bottoms, num_tops: int) -> Shapes:
    if port is not None:
        port.check_blob_counts(layer, len(bottoms))
    if any(b is None for b in bottoms):
        return Shapes([None] * num_tops)
    if not _has_rule(port):
        if layer.type.endswith("Loss") or layer.loss_weight:
            return Shapes([()] + [None] * (num_tops - 1))
        return Shapes([None] * num_tops)
    try:
        return port.infer(layer, bottoms)
    except (ArithmeticError, IndexError, TypeError, ValueError) as exc:
        raise FormatError(f"layer '{layer.name}' ({layer.type}): cannot infer its output shapes from the input "
                          f"shapes {[tuple(b) for b in bottoms]}: {exc}") from None


def infer_shapes(net, input_shapes: dict[str, tuple[int, ...]] | None = None,
                 lenient: bool = False) -> tuple[dict, list[LayerShapes]]:
    """Every blob's shape (``None`` when it depends on data, e.g. a Data layer) and, per layer, the top
    shapes, learnable blob shapes and multiply-adds.  ``input_shapes`` overrides/assigns blob shapes.
    ``lenient``: instead of the FormatError of the first layer that raises one, that layer and every later one
    get unknown tops, no rule and unknown bottom shapes (``bottom_shapes`` None: a build asks their ports)."""
    given = {name: None if shape is None else tuple(int(d) for d in shape)
             for name, shape in (input_shapes or {}).items()}
    blobs: dict[str, tuple[int, ...] | None] = dict(given)
    producers: dict[str, str] = {}
    table = []
    for index, layer in enumerate(net.layer):
        try:
            table.append(_infer_layer(layer, blobs, given, producers))
        except FormatError:
            if not lenient:
                raise
            for rest in net.layer[index:]:
                for top in rest.top:  # a blob an earlier layer shaped keeps its shape (it is allocated)
                    blobs.setdefault(top, None)
                table.append(LayerShapes(rest.name, rest.type, list(rest.bottom), list(rest.top),
                                         [None] * len(rest.top), bottom_shapes=None))
            break
    return blobs, table


def _infer_layer(layer, blobs: dict, given: dict, producers: dict) -> LayerShapes:
    """:func:`infer_shapes` of one layer, ``blobs`` and ``producers`` updated with its tops."""
    name, bottom_names, top_names = layer.name, list(layer.bottom), list(layer.top)
    for j, top in enumerate(top_names):  # Caffe's Net::AppendTop: one producer per blob, in-place aside
        if top in producers and not (j < len(bottom_names) and bottom_names[j] == top):
            raise FormatError(f"layer '{name}': top blob '{top}' is produced by multiple sources "
                              f"(already produced by layer '{producers[top]}')")
        producers[top] = name
    bottoms = []
    for bottom in bottom_names:
        if bottom not in blobs:
            raise FormatError(f"layer '{name}' ({layer.type}): unknown bottom blob '{bottom}'")
        bottoms.append(blobs[bottom])
    port = port_for(layer)
    shapes = _layer_shapes(layer, port, bottoms, len(top_names))
    ruled = _has_rule(port) and None not in bottoms
    tops = list(shapes.tops) + [None] * (len(top_names) - len(shapes.tops))
    for top, shape in zip(top_names, tops):
        if top in given and given[top] is not None:  # a shape the caller gave wins (a data layer's top, say)
            shape = given[top]
        blobs[top] = shape = None if shape is None else tuple(map(int, shape))
        if shape and min(shape) < 0:  # Blob::Reshape CHECK_GE(shape[i], 0)
            raise FormatError(f"layer '{name}' ({layer.type}): top '{top}' would have the negative "
                              f"shape {blobs[top]} (Caffe's Blob::Reshape CHECKs every dimension >= 0)")
    return LayerShapes(name, layer.type, bottom_names, top_names, [blobs[t] for t in top_names],
                       [tuple(p) for p in shapes.params], int(shapes.macs), bottoms, shapes if ruled else None)


def memory_needed(blobs: dict, table: list[LayerShapes], bytes_per_value: int = 4) -> tuple[int, str]:
    """Bytes of the known blobs (each name once, as Caffe allocates them) and learnable blobs, and the layer
    with the most."""
    by_layer = {}
    for entry in table:
        tops = {name: shape for name, shape in zip(entry.tops, entry.top_shapes) if shape is not None}
        by_layer[entry.name] = (sum(count(s) for s in tops.values()) + sum(count(p) for p in entry.param_shapes))
    total = sum(count(s) for s in blobs.values() if s is not None) + sum(
        count(p) for entry in table for p in entry.param_shapes)
    largest = max(by_layer, key=by_layer.get) if by_layer else ""
    return total * bytes_per_value, largest


class BudgetTracker:
    """The memory budget kept up to date while a net is built, in O(1) per learned shape.

    Starts from the inference's blobs (each name once, its final shape) and learnable blobs; as the build
    learns what the inference could not know (a data layer's tops once its source is open, then the layers
    that follow from them), :meth:`learn` replaces a layer's tops and learnable blobs with the real ones and
    refuses, before anything of that layer is allocated, a net whose total exceeds the budget.  (A whole new
    inference per data layer made a prototxt of 1,000 ImageData layers take 37 s to build: O(layers²).)"""

    def __init__(self, blobs: dict, table: list[LayerShapes], where: str, budget: int):
        self.where, self.budget = where, budget
        self.shapes = dict(blobs)
        self.layers = {entry.name: (list(entry.tops), sum(count(p) for p in entry.param_shapes)) for entry in table}
        self.total = memory_needed(blobs, table, bytes_per_value=1)[0]  # values

    def learn(self, layer: str, tops: dict, param_shapes=None) -> None:
        """Layer ``layer``'s tops (name -> shape) and, when given, its learnable blobs' shapes, as they will be
        allocated; MemoryBudgetError when the net no longer fits."""
        for name, shape in tops.items():
            shape = None if shape is None else tuple(int(d) for d in shape)
            old = self.shapes.get(name)
            self.total += (0 if shape is None else count(shape)) - (0 if old is None else count(old))
            self.shapes[name] = shape
        if param_shapes is not None:
            names, params = self.layers.get(layer, (list(tops), 0))
            new = sum(count(p) for p in param_shapes)
            self.total += new - params
            self.layers[layer] = (names, new)
        self.check()

    def check(self) -> None:
        needed = self.total * 4
        if needed > self.budget:
            shares = {name: sum(count(self.shapes[t]) for t in dict.fromkeys(tops) if self.shapes.get(t) is not None)
                      + params for name, (tops, params) in self.layers.items()}
            _refuse(self.where, needed, max(shares, key=shares.get) if shares else "", self.budget)


def _refuse(where: str, needed: int, largest: str, budget: int) -> None:
    raise MemoryBudgetError(f"{where}: its blobs and parameters need {needed / 2 ** 30:.3g} GiB (float32; the "
                            f"largest share at layer '{largest}'), more than the {budget / 2 ** 30:.3g} GiB of "
                            f"memory available; set CAFFE_COMPAT_MEMORY_BUDGET (e.g. 64G) to allow more")


def budget_tracker(net, where: str, budget: int | None = None,
                   lenient: bool = False) -> tuple[list[LayerShapes] | None, BudgetTracker | None]:
    """:func:`check_memory_budget`'s inference table and a :class:`BudgetTracker` to keep the budget while the
    net is built (both None when the inference failed: the build reports the net's own error).  ``lenient``
    (building a net): the layers before the first one whose rule fails are budgeted, that one and the later
    ones as the build learns their shapes (it builds every layer before the failing one: unbudgeted, an
    InnerProduct of 10^5 x 10^5 before a layer with a bad parameter allocated 40 GB)."""
    budget = memory_budget(fraction=1.0) if budget is None else budget
    try:
        blobs, table = infer_shapes(net, lenient=lenient)
    except FormatError:
        return None, None
    tracker = BudgetTracker(blobs, table, where, budget)
    tracker.check()
    return table, tracker


def check_memory_budget(net, where: str, budget: int | None = None) -> list[LayerShapes] | None:
    """FormatError before anything is allocated when the net's blobs and parameters (float32, from the
    shape rules) exceed ``budget`` bytes (default: all the memory available, or ``CAFFE_COMPAT_MEMORY_BUDGET``,
    :func:`caffe_compat.io.safe_open.memory_budget`): a hostile or mistyped
    prototxt (an Input of 10^6 × 10^6, ``num_output: 2000000000``) is refused with the layer named,
    instead of exhausting memory.  Caffe allocates every blob in ``Net::Init`` too, so a net it could
    build passes.  Shapes that cannot be inferred (data layers, errors the build reports itself) are
    left out: the check never refuses what it cannot measure (a build budgets them once known,
    :func:`budget_tracker`).  Returns the inference's per-layer table (None when the inference failed)."""
    return budget_tracker(net, where, budget)[0]


__all__ = ["BudgetTracker", "LayerShapes", "budget_tracker", "check_memory_budget", "count", "has_shape_rule",
           "infer_shapes", "layer_shapes", "memory_needed", "types_without_rule"]

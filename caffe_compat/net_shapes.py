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
from caffe_compat.layers.registry import port_for


@dataclass
class LayerShapes:
    name: str
    type: str
    bottoms: list[str]
    tops: list[str]
    top_shapes: list[tuple[int, ...] | None]
    param_shapes: list[tuple[int, ...]] = field(default_factory=list)
    macs: int = 0


def has_shape_rule(layer) -> bool:
    """True when the layer's port has a shape rule (``infer`` is overridden)."""
    port = port_for(layer)
    return port is not None and port.infer.__func__ is not _base_infer()


def _base_infer():
    from caffe_compat.layers.registry import CaffeLayer

    return CaffeLayer.infer.__func__


def types_without_rule(net) -> list[str]:
    """The layer types (registry keys for Python layers) of ``net`` that have no shape rule."""
    from caffe_compat.layers.registry import registry_key

    return sorted({registry_key(layer) for layer in net.layer if not has_shape_rule(layer)})


def layer_shapes(layer, bottoms) -> Shapes:
    """One layer's shapes: its port's rule after Caffe's count checks (unknown tops without a rule)."""
    port = port_for(layer)
    if port is not None:
        port.check_blob_counts(layer, len(bottoms))
    if any(b is None for b in bottoms):
        return Shapes([None] * len(layer.top))
    if port is None or not has_shape_rule(layer):
        if layer.type.endswith("Loss") or layer.loss_weight:
            return Shapes([()] + [None] * (len(layer.top) - 1))
        return Shapes([None] * len(layer.top))
    try:
        return port.infer(layer, [tuple(int(d) for d in b) for b in bottoms])
    except (ArithmeticError, IndexError, TypeError, ValueError) as exc:
        raise FormatError(f"layer '{layer.name}' ({layer.type}): cannot infer its output shapes from the input "
                          f"shapes {[tuple(b) for b in bottoms]}: {exc}") from None


def infer_shapes(net, input_shapes: dict[str, tuple[int, ...]] | None = None) -> tuple[dict, list[LayerShapes]]:
    """Every blob's shape (``None`` when it depends on data, e.g. a Data layer) and, per layer, the top
    shapes, learnable blob shapes and multiply-adds.  ``input_shapes`` overrides/assigns blob shapes."""
    given = dict(input_shapes or {})
    blobs: dict[str, tuple[int, ...] | None] = dict(given)
    producers: dict[str, str] = {}
    table = []
    for layer in net.layer:
        for j, top in enumerate(layer.top):  # Caffe's Net::AppendTop: one producer per blob, in-place aside
            if top in producers and not (j < len(layer.bottom) and layer.bottom[j] == top):
                raise FormatError(f"layer '{layer.name}': top blob '{top}' is produced by multiple sources "
                                  f"(already produced by layer '{producers[top]}')")
            producers[top] = layer.name
        bottoms = []
        for name in layer.bottom:
            if name not in blobs:
                raise FormatError(f"layer '{layer.name}' ({layer.type}): unknown bottom blob '{name}'")
            bottoms.append(blobs[name])
        shapes = layer_shapes(layer, bottoms)
        tops = list(shapes.tops) + [None] * (len(layer.top) - len(shapes.tops))
        known = [blobs.get(name) if name in given else None for name in layer.top]
        for name, shape, kept in zip(layer.top, tops, known):
            if kept is not None:  # a shape the caller gave wins (a data layer's top, say)
                shape = kept
            blobs[name] = None if shape is None else tuple(int(d) for d in shape)
            if blobs[name] is not None and min(blobs[name], default=0) < 0:  # Blob::Reshape CHECK_GE(shape[i], 0)
                raise FormatError(f"layer '{layer.name}' ({layer.type}): top '{name}' would have the negative "
                                  f"shape {blobs[name]} (Caffe's Blob::Reshape CHECKs every dimension >= 0)")
        table.append(LayerShapes(layer.name, layer.type, list(layer.bottom), list(layer.top),
                                 [blobs[t] for t in layer.top], [tuple(p) for p in shapes.params], int(shapes.macs)))
    return blobs, table


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


def check_memory_budget(net, where: str, budget: int | None = None) -> None:
    """FormatError before anything is allocated when the net's blobs and parameters (float32, from the
    shape rules) exceed ``budget`` bytes (default: all the memory available, or ``CAFFE_COMPAT_MEMORY_BUDGET``,
    :func:`caffe_compat.io.safe_open.memory_budget`): a hostile or mistyped
    prototxt (an Input of 10^6 × 10^6, ``num_output: 2000000000``) is refused with the layer named,
    instead of exhausting memory.  Caffe allocates every blob in ``Net::Init`` too, so a net it could
    build passes.  Shapes that cannot be inferred (data layers, errors the build reports itself) are
    left out: the check never refuses what it cannot measure."""
    budget = memory_budget(fraction=1.0) if budget is None else budget
    try:
        blobs, table = infer_shapes(net)
    except FormatError:
        return  # the build reports the net's own error, with the port's message
    needed, largest = memory_needed(blobs, table)
    if needed > budget:
        raise MemoryBudgetError(f"{where}: its blobs and parameters need {needed / 2 ** 30:.3g} GiB (float32; the largest "
                          f"share at layer '{largest}'), more than the {budget / 2 ** 30:.3g} GiB of memory available; "
                          f"set CAFFE_COMPAT_MEMORY_BUDGET (e.g. 64G) to allow more")


__all__ = ["LayerShapes", "check_memory_budget", "count", "has_shape_rule", "infer_shapes",
           "layer_shapes", "memory_needed", "types_without_rule"]

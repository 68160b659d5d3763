"""Caffe's two NetParameter rewrites before a net is built (no torch here): FilterNet and InsertSplits.

* :func:`filter_net` keeps the layers whose include/exclude rules the :class:`NetState` meets
  (``Net::FilterNet``).  A rule is met when every field it sets holds: ``phase`` equal, ``level >=
  min_level``, ``level <= max_level``, all of its ``stage`` present in the state and none of its
  ``not_stage``.  A layer without include rules is kept unless it meets one of its exclude rules; with
  include rules it is kept only if it meets one.  Giving both kinds raises FormatError, as in Caffe.
  Layers without an explicit ``phase`` get the net's phase (what Caffe's ToProto writes).
* :func:`insert_splits` adds Caffe's ``Split`` layers (``InsertSplits``): every top consumed by more
  than one bottom (a non-zero ``loss_weight`` counts as one more consumer) is followed by a Split layer
  named ``<blob>_<producer>_<top index>_split`` with tops ``<blob>_<producer>_<top index>_split_<k>``,
  and the k-th consumer (in layer order) reads top k.  The producer is the *last* layer that wrote the
  blob, so after an in-place ReLU on ``conv`` the names read ``conv_relu_0_split_<k>``.  When the split
  blob carries a loss weight, the Split layer's first top takes it over.  Split layers get the net
  state's phase (as Caffe's Net::Init sets it on every layer without one).
"""

from __future__ import annotations

from caffe_compat.errors import FormatError
from caffe_compat.proto import caffe_pb2

PHASES = {"train": caffe_pb2.TRAIN, "test": caffe_pb2.TEST}
PHASE_NAMES = {v: k for k, v in PHASES.items()}


def phase_value(phase) -> int:
    """``"train"``/``"test"`` (any case) or the caffe_pb2 enum value -> the enum value."""
    if isinstance(phase, str):
        try:
            return PHASES[phase.lower()]
        except KeyError:
            raise FormatError(f"phase must be 'train' or 'test', got {phase!r}") from None
    if phase in PHASE_NAMES:
        return int(phase)
    raise FormatError(f"phase must be 'train' or 'test', got {phase!r}")


def make_state(net: caffe_pb2.NetParameter, phase="test", level: int | None = None, stages=()) -> caffe_pb2.NetState:
    """The NetState Caffe's ``Net(file, phase, level, stages)`` uses: the net's own state with the phase
    replaced, ``level`` replaced when given, and ``stages`` appended."""
    state = caffe_pb2.NetState()
    state.CopyFrom(net.state)
    state.phase = phase_value(phase)
    if level is not None:
        state.level = level_value(level)
    state.stage.extend(stages or ())
    return state


def level_value(level) -> int:
    """``level`` as NetState's int32 (Caffe's ``-level`` flag is an int32); FormatError outside its range
    (protobuf's ValueError, a traceback from ``inspect --level 99999999999999999999``)."""
    value = int(level)
    if not -2 ** 31 <= value < 2 ** 31:
        raise FormatError(f"level must be a 32-bit integer (Caffe's NetState.level), got {value}")
    return value


def state_meets_rule(state: caffe_pb2.NetState, rule: caffe_pb2.NetStateRule) -> bool:
    """Caffe's ``Net::StateMeetsRule``."""
    if rule.HasField("phase") and rule.phase != state.phase:
        return False
    if rule.HasField("min_level") and state.level < rule.min_level:
        return False
    if rule.HasField("max_level") and state.level > rule.max_level:
        return False
    stages = set(state.stage)
    if any(s not in stages for s in rule.stage):
        return False
    return not any(s in stages for s in rule.not_stage)


def layer_included(layer: caffe_pb2.LayerParameter, state: caffe_pb2.NetState) -> bool:
    include, exclude = layer.include, layer.exclude
    if not include and not exclude:  # most layers: kept, nothing to evaluate
        return True
    if include and exclude:
        raise FormatError(f"layer '{layer.name}': specify either include rules or exclude rules; not both")
    if include:
        return any(state_meets_rule(state, rule) for rule in include)
    return not any(state_meets_rule(state, rule) for rule in exclude)


def filter_net(net: caffe_pb2.NetParameter, state: caffe_pb2.NetState) -> caffe_pb2.NetParameter:
    """A copy of ``net`` with only the layers ``state`` includes, each with its phase set."""
    included = [layer_included(layer, state) for layer in net.layer]
    out = caffe_pb2.NetParameter()
    out.CopyFrom(net)  # one copy of the whole message (then the excluded layers dropped) is cheaper than one per layer
    if not all(included):
        del out.layer[:]
        out.layer.extend(layer for layer, kept in zip(net.layer, included) if kept)
    out.state.CopyFrom(state)
    for kept in out.layer:
        if not kept.HasField("phase"):
            kept.phase = state.phase
    return out


def net_outputs(layers) -> list[str]:
    """The outputs of a net given as ``(bottoms, tops)`` per layer in order: every blob no later layer reads,
    an in-place layer making its blob available again, sorted by name (Caffe's ``Net::Init`` keeps them in a
    ``std::set``; pycaffe's ``net.outputs``)."""
    available: set[str] = set()
    for bottoms, tops in layers:
        available.difference_update(bottoms)
        available.update(tops)
    return sorted(available)


def split_layer_name(blob: str, producer: str, top_index: int) -> str:
    return f"{blob}_{producer}_{top_index}_split"


def split_blob_name(blob: str, producer: str, top_index: int, k: int) -> str:
    return f"{blob}_{producer}_{top_index}_split_{k}"


def insert_splits(net: caffe_pb2.NetParameter) -> caffe_pb2.NetParameter:
    """A copy of ``net`` with Caffe's automatic Split layers (see module docstring).  (Each layer's bottoms,
    tops and loss weights are read from the message once: protobuf field access dominates otherwise.)"""
    layers = list(net.layer)
    bottoms_of = [list(layer.bottom) for layer in layers]
    tops_of = [list(layer.top) for layer in layers]
    last_top: dict[str, tuple[int, int]] = {}
    source_of_bottom: dict[tuple[int, int], tuple[int, int]] = {}
    consumers: dict[tuple[int, int], int] = {}
    loss_weight: dict[tuple[int, int], float] = {}
    for i, layer in enumerate(layers):
        for j, blob in enumerate(bottoms_of[i]):
            source = last_top.get(blob)
            if source is None:
                raise FormatError(f"layer '{layer.name}' ({layer.type}): unknown bottom blob '{blob}' "
                                  f"(bottom index {j})")
            source_of_bottom[(i, j)] = source
            consumers[source] = consumers.get(source, 0) + 1
        tops = tops_of[i]
        for j, blob in enumerate(tops):
            last_top[blob] = (i, j)
        weights = layer.loss_weight
        if weights:
            for j, weight in enumerate(list(weights)[:len(tops)]):
                source = last_top[tops[j]]
                loss_weight[source] = weight
                if weight:
                    consumers[source] = consumers.get(source, 0) + 1

    split = {source for source, count in consumers.items() if count > 1}
    out = caffe_pb2.NetParameter()
    out.CopyFrom(net)
    del out.layer[:]
    next_split: dict[tuple[int, int], int] = {}
    has_state = net.HasField("state")
    for i, layer in enumerate(layers):
        copy = out.layer.add()
        copy.CopyFrom(layer)
        if not split:
            continue
        for j, blob in enumerate(bottoms_of[i]):
            source = source_of_bottom[(i, j)]
            if source in split:
                k = next_split.get(source, 0)
                next_split[source] = k + 1
                copy.bottom[j] = split_blob_name(blob, layers[source[0]].name, source[1], k)
        for j, blob in enumerate(tops_of[i]):
            if (i, j) not in split:
                continue
            count = consumers[(i, j)]
            split_layer = out.layer.add()
            split_layer.name = split_layer_name(blob, layer.name, j)
            split_layer.type = "Split"
            split_layer.bottom.append(blob)
            split_layer.top.extend(split_blob_name(blob, layer.name, j, k) for k in range(count))
            weight = loss_weight.get((i, j), 0.0)
            if weight:
                split_layer.loss_weight.extend([weight] + [0.0] * (count - 1))
                del copy.loss_weight[:]
                next_split[(i, j)] = next_split.get((i, j), 0) + 1
            if has_state:
                split_layer.phase = net.state.phase
    return out

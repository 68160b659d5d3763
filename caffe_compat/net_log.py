"""The lines Caffe's ``Net::Init`` logs while it builds a net (``net.cpp``, Caffe 1.0), logged once a
:class:`~caffe_compat.net.CaffeNet` is built.

In Caffe's order (every line ``LOG_IF(INFO, Caffe::root_solver())``; a net is built on the root solver):

* ``FilterNet``: for each rule a layer's NetState breaks while the layer's inclusion is being decided, one of
  ``The NetState phase (<p>) differed from the phase (<p>) specified by a rule in layer <layer>`` (phases as
  numbers), ``The NetState level (<l>) is above the min_level (<m>) ...`` (sic), ``... above the max_level ...``,
  ``The NetState did not contain stage '<s>' ...``, ``The NetState contained a not_stage '<s>' ...``;
* ``Initializing net from parameters: `` then, on the following lines without a glog prefix, the filtered
  NetParameter's ``DebugString()`` (the net's ``state`` included, no automatic Split layer, and no layer
  ``phase`` unless the prototxt gave one: Caffe stamps the phase after this line);
* per layer, Split layers included: ``Creating Layer <layer>``; ``<layer> <- <bottom>`` per bottom;
  ``<layer> -> <top>`` per top (``<layer> -> <top> (in-place)`` when top *j* is bottom *j*); the layer's
  ``SetUp``; ``Setting up <layer>``; per top ``Top shape: <d0> <d1> ... (<count>)`` (``Blob::shape_string``;
  ``Top shape: (1)`` for a scalar) followed by ``    with loss weight <w>`` when the top's loss weight is not
  0; ``Memory required for data: <bytes>``: the running sum of the counts of every layer's tops (an in-place
  top counts again, as Caffe adds each ``top_vecs_`` entry) times ``sizeof(float)``; then, per blob of the
  layer that a ParamSpec name shares, ``Sharing parameters '<name>' owned by layer '<owner>', param index <i>``;
* from the last layer to the first: ``<layer> needs backward computation.`` or ``<layer> does not need
  backward computation.`` (before ``force_backward`` is applied, as in Caffe);
* ``This network produces output <blob>`` per output blob, sorted by name (a ``std::set<string>``);
* ``Network initialization done.``

``DebugString`` is C++ protobuf's text format, which :func:`debug_string` writes: fields in field-number order,
two-space indentation, enums by name, strings C-escaped (octal for bytes outside printable ASCII), floats as
``SimpleFtoa`` (``%.6g``, ``%.9g`` when that does not read back as the same float), doubles as ``SimpleDtoa``
(``%.15g``/``%.17g``).  (Python's ``text_format`` has the same layout but prints floats otherwise: ``2.0`` where
C++ prints ``2``, ``0.33333334`` (the fewest digits that read back) where C++ prints ``0.333333343``.)

Not reproduced: a port's own set-up lines come before all of these (Caffe interleaves them with its layer's
lines), and a loss layer without tops (Caffe's ``(automatic)`` top) is refused when the net is built.

Cost: nothing unless the ``caffe_compat.net`` logger is enabled for INFO (``--caffe-log``, pycaffe's
``caffe.init_log``, a program's logging set-up); then the lines are computed from the built net.  A net rebuilt
where Caffe only reshapes (pycaffe's ``reshape`` with new input shapes) is built within :func:`quiet`.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math

import numpy as np
from google.protobuf import text_encoding
from google.protobuf.descriptor import FieldDescriptor

from caffe_compat.io.glog import g6
from caffe_compat.net_debug import loss_reach
from caffe_compat.net_graph import net_outputs
from caffe_compat.proto import caffe_pb2

__all__ = ["debug_string", "filter_lines", "init_lines", "log_net_init", "quiet"]

log = logging.getLogger("caffe_compat.net")

_QUIET = contextvars.ContextVar("caffe_compat_net_log_quiet", default=False)

#: a record with this attribute set is written with the glog prefix on its first line only, as glog writes a
#: message that spans several lines (``GlogFormatter``)
BARE_CONTINUATION = {"glog_bare_continuation": True}


@contextlib.contextmanager
def quiet():
    """Nets built within the block log no ``Net::Init`` lines (a rebuild Caffe does not do)."""
    token = _QUIET.set(True)
    try:
        yield
    finally:
        _QUIET.reset(token)


def log_net_init(net, source: caffe_pb2.NetParameter) -> None:
    """Log ``Net::Init``'s lines for the built ``net`` (``source``: the NetParameter it was built from, before
    filtering), when the ``caffe_compat.net`` logger listens at INFO."""
    if not log.isEnabledFor(logging.INFO) or _QUIET.get():
        return
    filtered = caffe_pb2.NetParameter()
    filtered.CopyFrom(source)
    filtered.state.CopyFrom(net.state)
    del filtered.layer[:]
    rule_lines = filter_lines(source.layer, net.state, filtered)
    for line in rule_lines:
        log.info("%s", line)
    text = debug_string(filtered).rstrip("\n")
    log.info("Initializing net from parameters: \n%s", text, extra=BARE_CONTINUATION)
    for line in init_lines(net):
        log.info("%s", line)


# ------------------------------------------------------------------------------ FilterNet


def _broken(state: caffe_pb2.NetState, rule: caffe_pb2.NetStateRule, layer: str) -> str | None:
    """``StateMeetsRule``: None when ``state`` meets ``rule``, else the line Caffe logs for the first check
    it fails."""
    if rule.HasField("phase") and rule.phase != state.phase:
        return (f"The NetState phase ({state.phase}) differed from the phase ({rule.phase}) specified by a rule "
                f"in layer {layer}")
    if rule.HasField("min_level") and state.level < rule.min_level:
        return (f"The NetState level ({state.level}) is above the min_level ({rule.min_level}) specified by a "
                f"rule in layer {layer}")
    if rule.HasField("max_level") and state.level > rule.max_level:
        return (f"The NetState level ({state.level}) is above the max_level ({rule.max_level}) specified by a "
                f"rule in layer {layer}")
    stages = set(state.stage)
    for stage in rule.stage:
        if stage not in stages:
            return f"The NetState did not contain stage '{stage}' specified by a rule in layer {layer}"
    for stage in rule.not_stage:
        if stage in stages:
            return f"The NetState contained a not_stage '{stage}' specified by a rule in layer {layer}"
    return None


def filter_lines(layers, state: caffe_pb2.NetState, kept: caffe_pb2.NetParameter | None = None) -> list[str]:
    """The lines ``FilterNet`` logs for ``layers`` under ``state``, in its order (exclude rules while the layer
    is included, then include rules while it is not); the included layers are appended to ``kept``."""
    lines: list[str] = []
    for layer in layers:
        included = _rules_met(layer.exclude, state, layer.name, not layer.include, False, lines)
        included = _rules_met(layer.include, state, layer.name, included, True, lines)
        if included and kept is not None:
            kept.layer.add().CopyFrom(layer)
    return lines


def _rules_met(rules, state, name: str, included: bool, met_gives: bool, lines: list[str]) -> bool:
    """The layer's inclusion after ``rules`` (a rule the state meets sets it to ``met_gives``; the scan stops
    once it is), each broken rule's line appended to ``lines``."""
    for rule in rules:
        if included == met_gives:
            break
        broken = _broken(state, rule, name)
        if broken is None:
            included = met_gives
        else:
            lines.append(broken)
    return included


# ------------------------------------------------------------------------------ DebugString


def _shortest(value: float, digits: int, more: int, kind) -> str:
    """C++ protobuf's ``SimpleFtoa``/``SimpleDtoa``: ``%.<digits>g`` when it reads back as the same ``kind``
    (np.float32 or float), else ``%.<more>g``."""
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if math.isnan(value):
        return "nan"
    text = f"{value:.{digits}g}"
    return text if kind(text) == kind(value) else f"{value:.{more}g}"


def _simple_ftoa(value: float) -> str:
    return _shortest(value, 6, 9, np.float32)


def _simple_dtoa(value: float) -> str:
    return _shortest(value, 15, 17, float)


def _scalar(field: FieldDescriptor, value) -> str:
    kind = field.type
    if kind == FieldDescriptor.TYPE_ENUM:
        known = field.enum_type.values_by_number.get(value)
        return known.name if known is not None else str(value)
    if kind == FieldDescriptor.TYPE_STRING:
        return '"' + text_encoding.CEscape(value.encode("utf-8"), as_utf8=False) + '"'
    if kind == FieldDescriptor.TYPE_BYTES:
        return '"' + text_encoding.CEscape(value, as_utf8=False) + '"'
    if kind == FieldDescriptor.TYPE_BOOL:
        return "true" if value else "false"
    if kind == FieldDescriptor.TYPE_FLOAT:
        return _simple_ftoa(value)
    if kind == FieldDescriptor.TYPE_DOUBLE:
        return _simple_dtoa(value)
    return str(value)


def _repeated(field: FieldDescriptor) -> bool:
    repeated = getattr(field, "is_repeated", None)  # protobuf >= 6 (``label`` is gone in newer releases)
    return repeated if repeated is not None else field.label == FieldDescriptor.LABEL_REPEATED


def _print(message, indent: str, out: list[str]) -> None:
    for field, value in message.ListFields():
        values = value if _repeated(field) else (value,)
        if field.type in (FieldDescriptor.TYPE_MESSAGE, FieldDescriptor.TYPE_GROUP):
            for item in values:
                out.append(f"{indent}{field.name} {{\n")
                _print(item, indent + "  ", out)
                out.append(f"{indent}}}\n")
        else:
            out.extend(f"{indent}{field.name}: {_scalar(field, item)}\n" for item in values)


def debug_string(message) -> str:
    """``message.DebugString()`` as C++ protobuf writes it (module docstring)."""
    out: list[str] = []
    _print(message, "", out)
    return "".join(out)


# ------------------------------------------------------------------------------ Net::Init


def _shape_string(shape) -> str:
    return "".join(f"{d} " for d in shape) + f"({math.prod(shape)})"


def init_lines(net) -> list[str]:
    """The lines ``Net::Init`` logs from ``Creating Layer`` to ``Network initialization done.`` for ``net``."""
    lines: list[str] = []
    shapes: dict[str, tuple[int, ...]] = {}
    owner_names = {step.module_key: step.name for step in net.steps if step.module_key is not None}
    shared = net.shared_blobs()
    memory = 0
    for step, layer in zip(net.steps, net.net_param.layer):
        name = step.name
        lines.append(f"Creating Layer {name}")
        lines.extend(f"{name} <- {bottom}" for bottom in step.bottoms)
        for j, top in enumerate(step.tops):
            in_place = j < len(step.bottoms) and step.bottoms[j] == top
            lines.append(f"{name} -> {top} (in-place)" if in_place else f"{name} -> {top}")
        lines.append(f"Setting up {name}")
        if step.module_key is None:  # a Split layer: every top has its bottom's shape
            top_shapes = [shapes[step.bottoms[0]]] * len(step.tops)
        else:
            top_shapes = [tuple(int(d) for d in s) for s in net.layers[step.module_key].output_shapes()]
        for top, shape, weight in zip(step.tops, top_shapes, step.loss_weights):
            shapes[top] = shape
            lines.append(f"Top shape: {_shape_string(shape)}")
            if weight:
                lines.append(f"    with loss weight {g6(weight)}")
            memory += math.prod(shape)
        lines.append(f"Memory required for data: {memory * 4}")
        if step.module_key is not None and shared:
            for i in range(len(net.step_blobs(step))):
                owner = shared.get((step.module_key, i))
                if owner is not None:
                    lines.append(f"Sharing parameters '{layer.param[i].name}' owned by layer "
                                 f"'{owner_names[owner[0]]}', param index {owner[1]}")
    layer_need = loss_reach(net)[0]
    for step, need in zip(reversed(net.steps), reversed(layer_need)):
        lines.append(f"{step.name} needs backward computation." if need
                     else f"{step.name} does not need backward computation.")
    lines.extend(f"This network produces output {blob}"
                 for blob in net_outputs((step.bottoms, step.tops) for step in net.steps))
    lines.append("Network initialization done.")
    return lines

"""Drawing a Caffe net (a ``NetParameter``) as a graph, with pycaffe's ``caffe.draw`` API names.

``get_pydot_graph(caffe_net, rankdir, label_edges=True, phase=None, display_lrm=False)`` builds a ``pydot.Dot``:
one node per layer (``<name>_<type>``, labelled with its name and type, convolution and pooling with
kernel size, stride and pad, pooling with its method; in-place layers in green, convolutions red,
pooling orange, inner products purple, others blue) and one octagon per blob (``<blob>_blob``), edges
from bottom blobs to the layer and from the layer to its top blobs, those labelled (``label_edges``)
with the batch size of data layers and the ``num_output`` of convolution and inner-product layers.
``phase`` (``caffe_pb2.TRAIN``/``TEST``, or ``"TRAIN"``/``"TEST"``; ``None``/``"ALL"``: every layer)
keeps the layers with no ``include`` rule and those whose ``include`` names that phase, minus those
whose ``exclude`` names it — the filter of Caffe's ``draw.py`` (phase only: levels and stages are not
considered).  ``rankdir``: graphviz's ``LR``, ``TB``, ``BT`` or ``RL``.  ``display_lrm`` (BVLC's
``draw_net.py --display_lrm``) adds ``lr mult: W, B`` to convolution, deconvolution and inner-product
labels, the layer's weight and bias ``lr_mult`` (1 when not given), unless both are 0.

``draw_net(caffe_net, rankdir, ext='png', phase=None, display_lrm=False)`` returns the rendered image
bytes; ``draw_net_to_file(caffe_net, filename, rankdir='LR', phase=None, display_lrm=False)`` writes them
(the format from the file's extension; ``.raw`` writes the DOT source), atomically.

Rendering needs ``pydot`` (``pip install pydot``) and graphviz's ``dot`` program (``apt-get install
graphviz`` / ``brew install graphviz`` / ``conda install graphviz``); without them
:class:`GraphvizMissing` (a :class:`~caffe_compat.errors.CaffeCompatError`) says what to install.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from caffe_compat.errors import CaffeCompatError
from caffe_compat.proto import caffe_pb2

__all__ = ["GraphvizMissing", "draw_net", "draw_net_to_file", "get_edge_label", "get_layer_label",
           "get_layer_lr_mult", "get_pydot_graph", "layer_in_phase"]

LAYER_STYLE_DEFAULT = {"shape": "record", "fillcolor": "#6495ED", "style": "filled"}
NEURON_LAYER_STYLE = {"shape": "record", "fillcolor": "#90EE90", "style": "filled"}
BLOB_STYLE = {"shape": "octagon", "fillcolor": "#E0E0E0", "style": "filled"}
LAYER_COLORS = {"Convolution": "#FF5050", "Deconvolution": "#FF5050", "Pooling": "#FF9900",
                "InnerProduct": "#CC33FF"}
RANKDIRS = ("LR", "TB", "BT", "RL")
_LR_MULT_TYPES = ("Convolution", "Deconvolution", "InnerProduct")
_POOL_METHODS = {v: k for k, v in caffe_pb2.PoolingParameter.PoolMethod.items()}


class GraphvizMissing(CaffeCompatError):
    """pydot or graphviz's ``dot`` is not installed: the message says what to install."""


def _pydot():
    try:
        import pydot
    except ImportError:
        raise GraphvizMissing("drawing a net needs the pydot package (pip install pydot) and graphviz's dot "
                              "program (apt-get install graphviz, brew install graphviz or conda install "
                              "graphviz)") from None
    return pydot


def _phase_value(phase):
    if phase is None:
        return None
    if isinstance(phase, str):
        text = phase.strip().upper()
        if text == "ALL":
            return None
        if text in ("TRAIN", "TEST"):
            return caffe_pb2.TRAIN if text == "TRAIN" else caffe_pb2.TEST
        raise CaffeCompatError(f"phase must be TRAIN, TEST or ALL, got {phase!r}")
    if phase in (caffe_pb2.TRAIN, caffe_pb2.TEST):
        return int(phase)
    raise CaffeCompatError(f"phase must be caffe_pb2.TRAIN, caffe_pb2.TEST or None, got {phase!r}")


def layer_in_phase(layer: caffe_pb2.LayerParameter, phase) -> bool:
    """Whether Caffe's ``draw.py`` draws ``layer`` for ``phase`` (module docstring)."""
    phase = _phase_value(phase)
    if phase is None:
        return True
    if layer.include and layer.exclude:
        raise CaffeCompatError(f"layer '{layer.name}' specifies both include and exclude rules")
    included = not layer.include or any(rule.phase == phase for rule in layer.include if rule.HasField("phase"))
    return included and not any(rule.HasField("phase") and rule.phase == phase for rule in layer.exclude)


def _first(values, default=None):
    return values[0] if len(values) else default


def get_layer_lr_mult(layer: caffe_pb2.LayerParameter) -> tuple[float, float]:
    """The weight and bias ``lr_mult`` of a convolution, deconvolution or inner-product layer (1 when its
    ``param`` does not give one); other types and more than two ``param`` are refused, as draw.py's."""
    if layer.type not in _LR_MULT_TYPES:
        raise CaffeCompatError(f"{layer.type} layers do not have a learning rate multiplier")
    if len(layer.param) > 2:
        raise CaffeCompatError(f"layer '{layer.name}': could not parse the learning rate multiplier "
                               f"({len(layer.param)} param entries)")
    mults = [float(spec.lr_mult) for spec in layer.param]
    return tuple(mults + [1.0] * (2 - len(mults)))


def get_layer_label(layer: caffe_pb2.LayerParameter, rankdir: str, display_lrm: bool = False) -> str:
    """``name (type)``, plus kernel size, stride and pad of convolution/pooling layers (and the pooling
    method), and with ``display_lrm`` the lr mults of learning layers (module docstring); fields one per
    line when the graph runs left-right, on one line when it runs top-bottom."""
    separator = " " if rankdir in ("TB", "BT") else "\\n"
    # the node is a graphviz record: { } < > | in a name are its syntax (a '{' or '<' failed the drawing)
    parts = [re.sub(r"([{}<>|])", r"\\\1", text) for text in (layer.name, f"({layer.type})")]
    if layer.type in ("Convolution", "Deconvolution"):
        p = layer.convolution_param
        kernel = _first(p.kernel_size, p.kernel_h or 1)
        parts += [f"kernel size: {kernel}", f"stride: {_first(p.stride, p.stride_h or 1)}",
                  f"pad: {_first(p.pad, p.pad_h or 0)}"]
    elif layer.type == "Pooling":
        p = layer.pooling_param
        parts += [f"pool type: {_POOL_METHODS.get(p.pool, p.pool)}",
                  f"kernel size: {p.kernel_size or p.kernel_h or ('global' if p.global_pooling else 0)}",
                  f"stride: {p.stride or p.stride_h or 1}", f"pad: {p.pad or p.pad_h or 0}"]
    if display_lrm and layer.type in _LR_MULT_TYPES:
        weights, bias = get_layer_lr_mult(layer)
        if weights or bias:
            parts.append(f"lr mult: {weights:.1f}, {bias:.1f}")
    return separator.join(str(part) for part in parts)


def get_edge_label(layer: caffe_pb2.LayerParameter):
    """The label of a layer's outgoing edges: ``Batch N`` for data layers, ``num_output`` for convolution
    and inner-product layers, else None."""
    if layer.type == "Data":
        return f"Batch {layer.data_param.batch_size}"
    if layer.type in ("Convolution", "Deconvolution"):
        return str(layer.convolution_param.num_output)
    if layer.type == "InnerProduct":
        return str(layer.inner_product_param.num_output)
    return None


def _as_net(caffe_net) -> caffe_pb2.NetParameter:
    if isinstance(caffe_net, caffe_pb2.NetParameter):
        if caffe_net.layers and not caffe_net.layer:  # V1 layers: upgrade as Caffe's reader would
            from caffe_compat.io import read_net

            return read_net(caffe_net.SerializeToString())
        return caffe_net
    from caffe_compat.io import read_net

    return read_net(caffe_net)


def get_pydot_graph(caffe_net, rankdir: str, label_edges: bool = True, phase=None, display_lrm: bool = False):
    """The ``pydot.Dot`` of ``caffe_net`` (a NetParameter; a prototxt path is read) — module docstring."""
    pydot = _pydot()
    if rankdir not in RANKDIRS:
        raise CaffeCompatError(f"rankdir must be one of {', '.join(RANKDIRS)}, got {rankdir!r}")
    net = _as_net(caffe_net)
    graph = pydot.Dot(net.name or "Default", graph_type="digraph", rankdir=rankdir)
    nodes: dict = {}
    edges = []
    for layer in net.layer:
        if not layer_in_phase(layer, phase):
            continue
        node = f"{layer.name}_{layer.type}"
        inplace = len(layer.bottom) == 1 and len(layer.top) == 1 and layer.bottom[0] == layer.top[0]
        style = dict(NEURON_LAYER_STYLE if inplace else LAYER_STYLE_DEFAULT)
        if not inplace:
            style["fillcolor"] = LAYER_COLORS.get(layer.type, style["fillcolor"])
        nodes[node] = pydot.Node(_quote(node), label=_quote(get_layer_label(layer, rankdir, display_lrm)),
                                  **style)
        for blob in layer.bottom:
            nodes.setdefault(f"{blob}_blob", pydot.Node(_quote(f"{blob}_blob"), label=_quote(blob), **BLOB_STYLE))
            edges.append((f"{blob}_blob", node, None))
        label = get_edge_label(layer) if label_edges else None
        for blob in layer.top:
            nodes.setdefault(f"{blob}_blob", pydot.Node(_quote(f"{blob}_blob"), label=_quote(blob), **BLOB_STYLE))
            edges.append((node, f"{blob}_blob", label))
    for node in nodes.values():
        graph.add_node(node)
    for source, target, label in edges:
        extra = {"label": _quote(label)} if label else {}
        graph.add_edge(pydot.Edge(nodes[source], nodes[target], **extra))
    return graph


def _quote(text: str) -> str:
    """A DOT ID in double quotes (names with ``/``, ``:`` or spaces stay one ID; ``\\n`` stays a newline).
    Backslashes before a quote or the end are doubled and NUL bytes written as ``\\0``: a name ending in
    ``\\`` (or holding ``\\"``) ended the quoted ID early, and dot failed on the whole drawing."""
    text = re.sub(r'\\+(?="|\Z)', lambda m: m.group(0) * 2, str(text)).replace("\0", "\\\\0")
    return '"' + text.replace('"', '\\"') + '"'


def draw_net(caffe_net, rankdir: str, ext: str = "png", phase=None, display_lrm: bool = False) -> bytes:
    """The net drawn by graphviz in format ``ext`` (png, svg, pdf, ...; ``raw``: the DOT source)."""
    graph = get_pydot_graph(caffe_net, rankdir, phase=phase, display_lrm=display_lrm)
    if ext == "raw":
        return graph.to_string().encode("utf-8")
    try:
        return graph.create(format=ext)
    except FileNotFoundError:
        raise GraphvizMissing("drawing a net needs graphviz's dot program on PATH (apt-get install graphviz, "
                              "brew install graphviz or conda install graphviz)") from None
    except AssertionError as exc:  # pydot: format unknown to graphviz
        raise CaffeCompatError(f"graphviz cannot write format {ext!r}: {exc}") from None
    except Exception as exc:
        if "dot" in str(exc) and ("not found" in str(exc) or "No such file" in str(exc)):
            raise GraphvizMissing("drawing a net needs graphviz's dot program on PATH (apt-get install graphviz)") \
                from None
        raise CaffeCompatError(f"graphviz failed to draw the net as {ext}: {str(exc).strip().splitlines()[0]}") \
            from None


def draw_net_to_file(caffe_net, filename, rankdir: str = "LR", phase=None, display_lrm: bool = False) -> None:
    """Write the drawing to ``filename`` in the format of its extension (``.raw``: the DOT source)."""
    from caffe_compat.io.atomic import write_bytes_atomic

    ext = os.fspath(filename).rpartition(".")[2] if "." in Path(filename).name else ""
    if not ext:
        raise CaffeCompatError(f"{filename}: no extension to choose the image format from (e.g. .png, .svg, .pdf)")
    write_bytes_atomic(filename, draw_net(caffe_net, rankdir, ext=ext.lower(), phase=phase, display_lrm=display_lrm))

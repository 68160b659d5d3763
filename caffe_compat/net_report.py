"""``caffe-compat inspect``'s content: a layer table and a weights-vs-net check.

:func:`inspect_net` returns a JSON-able dict: one row per layer (name, type, bottoms, tops, output
shapes, learnable blob shapes, parameter count, multiply-adds), totals, and with weights the list of
missing / extra / mismatched blobs, matched by layer name and blob index as Caffe's
``CopyTrainedLayersFrom`` does (legacy 4-D blob shapes accepted when Caffe accepts them).

Shapes come from the ports' shape rules (:mod:`caffe_compat.net_shapes`), so this module loads the layer
registry (torch); reading the files themselves (:mod:`caffe_compat.io`) does not.

A layer whose type neither Caffe 1.0 nor this project knows (a typo such as ``Convolutoin``) raises
:class:`~caffe_compat.errors.UnknownLayerError` naming the layer and the type, as Caffe refuses the net
("Unknown layer type").  Caffe 1.0 types without a port here (none is left but ``Python``:
``caffe_compat.layers.registry.CAFFE_1_0_UNPORTED``) and ``Python`` layers without a native port are accepted: their output shapes are unknown (``?``) unless
given as input shapes, and ``types_without_shape_rule`` names them.  Layers downstream of an unknown
shape are listed in ``unresolved_layers`` (their parameters and multiply-adds are not in the totals),
and the weights check lists their caffemodel blobs as ``unchecked``: the net is then not reported
consistent (exit 1 from the CLI), since nothing proved it.
"""

from __future__ import annotations

import math

from caffe_compat.errors import FormatError
from caffe_compat.io.blobs import blob_shape, legacy_shape_equals
from caffe_compat.layers.registry import caffe_1_0_types, layer_class, port_for
from caffe_compat.net_shapes import infer_shapes, types_without_rule


def check_layer_types(net) -> None:
    """UnknownLayerError (from the layer registry, naming layer and type) for a layer whose type is neither
    a Caffe 1.0 type nor a registered port."""
    known = caffe_1_0_types()
    for layer in net.layer:
        if layer.type not in known and port_for(layer) is None:
            layer_class(layer)


def inspect_net(net, weights=None, input_shapes=None) -> dict:
    check_layer_types(net)
    blobs, table = infer_shapes(net, input_shapes)
    rows = []
    for entry in table:
        params = sum(math.prod(s) for s in entry.param_shapes)
        rows.append({"name": entry.name, "type": entry.type, "bottoms": entry.bottoms, "tops": entry.tops,
                     "top_shapes": [list(s) if s is not None else None for s in entry.top_shapes],
                     "param_shapes": [list(s) for s in entry.param_shapes], "params": int(params),
                     "macs": entry.macs})
    report = {"name": net.name, "layers": rows,
              "total_params": int(sum(r["params"] for r in rows)),
              "total_macs": int(sum(r["macs"] for r in rows)),
              "unresolved_layers": [e.name for e in table if unresolved(e)],
              "types_without_shape_rule": types_without_rule(net)}
    if weights is not None:
        report["weights_check"] = check_weights(table, weights)
    return report


def unresolved(entry) -> bool:
    """True when a layer's output shapes (hence its learnable blob shapes, parameters and multiply-adds)
    could not be inferred because a bottom's shape depends on data (e.g. a Python data layer's top)."""
    return bool(entry.bottoms) and any(s is None for s in entry.top_shapes)


def check_weights(table, weights) -> dict:
    """Compare the net's learnable blob shapes with a caffemodel's, by layer name."""
    stored = {layer.name: layer for layer in weights.layer if len(layer.blobs)}
    missing, mismatched, unchecked, matched = [], [], [], 0
    for entry in table:
        if unresolved(entry) and not entry.param_shapes:
            if entry.name in stored:
                unchecked.append({"layer": entry.name, "reason": f"{len(stored[entry.name].blobs)} blobs in the "
                                  "caffemodel, not checked: the layer's input shape is unknown (give --input-shape)"})
            continue
        if not entry.param_shapes:
            continue
        source = stored.get(entry.name)
        if source is None:
            missing.append({"layer": entry.name, "reason": "not in the caffemodel (keeps its initialisation)"})
            continue
        if len(source.blobs) != len(entry.param_shapes):
            mismatched.append({"layer": entry.name, "blob": None,
                               "expected": len(entry.param_shapes), "found": len(source.blobs),
                               "reason": f"{len(source.blobs)} blobs in the caffemodel, the net has "
                                         f"{len(entry.param_shapes)}"})
            continue
        for i, (blob, shape) in enumerate(zip(source.blobs, entry.param_shapes)):
            values = max(len(blob.data), len(blob.double_data))
            if values != math.prod(blob_shape(blob)):  # Caffe's Blob::FromProto CHECKs the count
                raise FormatError(f"layer '{entry.name}' blob {i}: the caffemodel declares shape "
                                  f"{tuple(blob_shape(blob))} ({math.prod(blob_shape(blob))} values) but holds "
                                  f"{values}")
            if legacy_shape_equals(blob, shape):
                matched += 1
            else:
                mismatched.append({"layer": entry.name, "blob": i, "expected": list(shape),
                                   "found": list(blob_shape(blob)),
                                   "reason": f"blob {i}: caffemodel {tuple(blob_shape(blob))} vs net {tuple(shape)}"})
    net_layers = {entry.name for entry in table}
    extra = [{"layer": name, "reason": "in the caffemodel, not in the net (ignored, as Caffe does)"}
             for name in stored if name not in net_layers]
    return {"matched_blobs": matched, "missing": missing, "extra": extra, "mismatched": mismatched,
            "unchecked": unchecked, "consistent": not missing and not mismatched and not unchecked}

"""``caffe-compat inspect``'s content: a layer table and a weights-vs-net check (no torch).

:func:`inspect_net` returns a JSON-able dict: one row per layer (name, type, bottoms, tops, output
shapes, learnable blob shapes, parameter count, multiply-adds), totals, and with weights the list of
missing / extra / mismatched blobs, matched by layer name and blob index as Caffe's
``CopyTrainedLayersFrom`` does (legacy 4-D blob shapes accepted when Caffe accepts them).
"""

from __future__ import annotations

import math

from caffe_compat.io.blobs import blob_shape, legacy_shape_equals
from caffe_compat.io.shapes import infer_shapes


def inspect_net(net, weights=None, input_shapes=None) -> dict:
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
              "total_macs": int(sum(r["macs"] for r in rows))}
    if weights is not None:
        report["weights_check"] = check_weights(table, weights)
    return report


def check_weights(table, weights) -> dict:
    """Compare the net's learnable blob shapes with a caffemodel's, by layer name."""
    stored = {layer.name: layer for layer in weights.layer if len(layer.blobs)}
    missing, mismatched, matched = [], [], 0
    for entry in table:
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
            "consistent": not missing and not mismatched}

"""Constant folding of an exported ONNX graph (a small pass over the legacy exporter's output).

PyTorch's TorchScript exporter writes ``F.pad``'s pad list as a little subgraph (ConstantOfShape, Concat,
Reshape, Slice, Transpose, Cast) that its own folding leaves in place.  ONNX shape inference cannot see
through it, so a ``Pad`` (and everything after it) gets unknown dimensions, and runtimes that need
constant pads (TensorRT, some compilers) refuse it.  This pass evaluates every node whose inputs are all
constants (initializers or ``Constant`` outputs) with ``onnx.reference`` and replaces it by an
initializer, repeating in graph (topological) order; initializers left unused are dropped.

Not folded: nodes with no inputs other than ``Constant`` itself (random generators have none here but are
excluded by name to be safe) and nodes of non-default domains.  The result equals the input graph
value for value (the same operators computed once at export instead of at every run).
"""

from __future__ import annotations

import onnx
from onnx import helper, numpy_helper

__all__ = ["fold_constants"]

_NEVER = {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli"}


def _evaluate(node, values: dict, opset: int) -> list:
    from onnx.reference import ReferenceEvaluator

    inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(values[n].dtype), values[n].shape)
              for n in node.input if n]
    outputs = [helper.make_tensor_value_info(n, onnx.TensorProto.UNDEFINED, None) for n in node.output]
    graph = helper.make_graph([node], "fold", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return ReferenceEvaluator(model).run(None, {n: values[n] for n in node.input if n})


def fold_constants(model: onnx.ModelProto) -> onnx.ModelProto:
    """Fold constant subgraphs of ``model`` in place (see the module docstring); returns it."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)
    graph = model.graph
    values = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    graph_outputs = {o.name for o in graph.output}
    kept, new_inits = [], []
    for node in graph.node:
        constant_inputs = all((not n) or n in values for n in node.input)
        foldable = (node.domain in ("", "ai.onnx") and node.op_type not in _NEVER and constant_inputs
                    and not any(o in graph_outputs for o in node.output))
        if foldable:
            try:
                results = _evaluate(node, values, opset)
            except Exception:  # an op the reference runtime lacks: keep the node as it is
                kept.append(node)
                continue
            for name, value in zip(node.output, results):
                values[name] = value
                new_inits.append(numpy_helper.from_array(value, name))
            continue
        kept.append(node)
    used = {n for node in kept for n in node.input} | graph_outputs
    initializers = [i for i in list(graph.initializer) + new_inits if i.name in used]
    del graph.node[:]
    graph.node.extend(kept)
    del graph.initializer[:]
    graph.initializer.extend(initializers)
    kept_names = {i.name for i in initializers} | {o for node in kept for o in node.output}
    stale = [v for v in graph.value_info if v.name not in kept_names]
    for v in stale:
        graph.value_info.remove(v)
    return model

"""Every registered layer type on degenerate shapes, through a net: an empty batch, no channel, an empty
plane, a 0-axis bottom.  Caffe either computes a result (often an empty top) or aborts (a CHECK, an integer
division by zero); we must give Caffe's result or a typed caffe_compat error, never an untyped exception
(torch's RuntimeError on an ambiguous ``reshape(0, -1)``, an IndexError, a ZeroDivisionError).  The
layer files' own tests pin Caffe's result for each case fixed here; this sweep guards against regressions.
"""

from __future__ import annotations

import pytest
import torch

from caffe_compat.errors import CaffeCompatError
from caffe_compat.layers.registry import registered_types
from caffe_compat.net import load_net

PARAMS = {
    "Convolution": "convolution_param { num_output: 2 kernel_size: 1 }",
    "Deconvolution": "convolution_param { num_output: 2 kernel_size: 1 }",
    "Im2col": "convolution_param { kernel_size: 1 }",
    "InnerProduct": "inner_product_param { num_output: 2 }",
    "Embed": "embed_param { num_output: 2 input_dim: 5 }",
    "Pooling": "pooling_param { kernel_size: 1 }",
    "SPP": "spp_param { pyramid_height: 2 }",
    "Reshape": "reshape_param { shape { dim: 0 dim: -1 } }",
    "LSTM": "recurrent_param { num_output: 2 }",
    "RNN": "recurrent_param { num_output: 2 }",
    "Tile": "tile_param { tiles: 2 }",
}
TWO_SAME = {"Crop", "Eltwise", "Concat", "Bias"}
WITH_LABEL = {"Accuracy", "ContrastiveLoss", "EuclideanLoss", "HingeLoss", "InfogainLoss", "MultinomialLogisticLoss",
              "SigmoidCrossEntropyLoss", "SoftmaxWithLoss", "BatchContrastiveLoss", "BinomialDevianceLoss",
              "FAPPYLoss", "FastAPLoss", "HistogramLoss", "LiftedStructSimilaritySoftmaxLoss", "MarginLoss",
              "MultiSimilarityLoss", "RAWLoss", "SmoothAPLoss", "TripletLoss", "CosineSimilarityBatch"}
NO_BOTTOM_OR_FILE = {"Data", "HDF5Data", "HDF5Output", "ImageData", "MemoryData", "WindowData", "Input",
                     "DummyData", "Parameter", "Silence"}
BASES = [(0, 3, 4, 4), (2, 0, 4, 4), (2, 3, 0, 4), (2, 3, 4, 0), (), (0,), (2, 0), (0, 3), (0, 0, 0, 0)]
EXTRA = [  # (type, bottom shapes, layer parameters)
    ("Pooling", [(2, 3, 1, 1)], "pooling_param { kernel_size: 3 stride: 2 }"),
    ("Pooling", [(2, 0, 5, 5)], "pooling_param { kernel_size: 3 stride: 2 pool: AVE }"),
    ("LRN", [(2, 3, 0, 4)], "lrn_param { norm_region: WITHIN_CHANNEL }"),
    ("Reduction", [(0, 3)], "reduction_param { axis: 1 operation: SUMSQ }"),
    ("ContrastiveLoss", [(0, 3), (0, 3), (0,)], ""),
    ("LSTM", [(3, 0, 4), (3, 0)], "recurrent_param { num_output: 2 }"),
    ("SoftmaxWithLoss", [(2, 3, 0), (2, 0)], ""),
    ("Filter", [(2, 3), (2,)], ""),
]


def _bottoms(kind: str, shape: tuple) -> list[tuple]:
    if kind in WITH_LABEL:
        return [shape, shape[:1]]
    if kind in ("LSTM", "RNN"):
        return [shape, shape[:2]]
    if kind in ("Filter", "BatchReindex"):
        return [shape, shape[:1]]
    if kind == "LSTMUnit":
        return [(1, *shape[:1], 3), (1, *shape[:1], 12), (1, *shape[:1])] if shape else [(), (), ()]
    return [shape] * (2 if kind in TWO_SAME else 1)


def _cases():
    for kind in registered_types():
        if kind in NO_BOTTOM_OR_FILE or kind.startswith("Python:"):
            continue
        for shape in BASES:
            yield kind, _bottoms(kind, shape), PARAMS.get(kind, "")
    yield from EXTRA


def _net_text(kind: str, shapes, params: str, conv_first: bool = False) -> str:
    lines = [f'layer {{ name: "in{i}" type: "Input" top: "b{i}" input_param {{ shape {{ '
             f'{" ".join(f"dim: {d}" for d in s)} }} }} }}' for i, s in enumerate(shapes)]
    if conv_first:  # b0 is a Convolution's top instead: kernel 3 on (N, C, 2, 2) gives (N, 2, 0, 0), an empty top
        lines[0] = lines[0].replace('top: "b0"', 'top: "x0"')
        lines.insert(1, 'layer { name: "conv" type: "Convolution" bottom: "x0" top: "b0" '
                        'convolution_param { num_output: 2 kernel_size: 3 } }')
    bottoms = " ".join(f'bottom: "b{i}"' for i in range(len(shapes)))
    lines.append(f'layer {{ name: "l" type: "{kind}" {bottoms} top: "t" {params} }}')
    return "\n".join(lines)


def _finished(untyped: list, label: str, run) -> bool:
    """``run()``: True when it finished, False on a typed error; an untyped exception is added to ``untyped``."""
    try:
        run()
        return True
    except CaffeCompatError:
        return False
    except Exception as exc:  # noqa: BLE001 - collecting every untyped escape is the point
        untyped.append(f"{label}: {type(exc).__name__}: {str(exc)[:100]}")
        return False


@pytest.mark.parametrize("phase", ["test", "train"])
def test_degenerate_shapes_give_caffes_result_or_a_typed_error(phase):
    untyped = []
    for kind, shapes, params in _cases():
        def run():
            net = load_net(_net_text(kind, shapes, params), phase=phase)
            net.force_backward = True
            blobs = net.forward(**{f"b{i}": torch.zeros(s) for i, s in enumerate(shapes)})
            net.backward(blobs)

        _finished(untyped, f"{kind} {shapes} {params}", run)
    assert not untyped, "\n".join(untyped)


@pytest.mark.parametrize("phase", ["test", "train"])
def test_an_empty_convolution_top_feeds_every_layer_as_an_empty_bottom(phase):
    # a Convolution whose output size is 0 builds (Caffe's Blob::Reshape accepts the 0) and its empty top then
    # feeds the next layer, which must give Caffe's result on an empty bottom or a typed error
    untyped, ran = [], set()
    for kind in registered_types():
        if kind in NO_BOTTOM_OR_FILE or kind.startswith("Python:"):
            continue
        shapes = _bottoms(kind, (2, 2, 0, 0))
        shapes[0] = (2, 3, 2, 2)
        params = PARAMS.get(kind, "")

        def run():
            net = load_net(_net_text(kind, shapes, params, conv_first=True), phase=phase)
            assert tuple(net.blob_shapes["b0"]) == (2, 2, 0, 0)
            net.force_backward = True
            inputs = {f"b{i}": torch.zeros(s) for i, s in enumerate(shapes)}
            inputs["x0"] = inputs.pop("b0")
            blobs = net.forward(**inputs)
            assert tuple(blobs["b0"].shape) == (2, 2, 0, 0)
            net.backward(blobs)

        if _finished(untyped, f"{kind} {shapes} {params}", run):
            ran.add(kind)
    assert not untyped, "\n".join(untyped)
    assert {"ReLU", "Pooling", "Convolution", "Eltwise", "Concat", "Softmax", "Flatten"} <= ran, sorted(ran)

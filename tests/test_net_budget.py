"""Memory is budgeted before allocation: CaffeNet refuses a net whose blobs and parameters (from the shape
rules) exceed the memory available, naming the layer, before any tensor is made."""

from __future__ import annotations

import numpy as np
import pytest

from caffe_compat.errors import FormatError, MemoryBudgetError
from caffe_compat.io import read_net
from caffe_compat.net import CaffeNet
from caffe_compat.net_shapes import check_memory_budget, infer_shapes, memory_needed

INPUT = 'layer {{ name: "data" type: "Input" top: "data" input_param {{ shape {{ {dims} }} }} }}\n'


def _net(dims: str, extra: str = "") -> str:
    return INPUT.format(dims=" ".join(f"dim: {d}" for d in dims.split())) + extra


def test_memory_needed_counts_blobs_once_and_parameters():
    text = _net("2 3", 'layer { name: "fc" type: "InnerProduct" bottom: "data" top: "y" '
                       'inner_product_param { num_output: 5 } }\n'
                       'layer { name: "relu" type: "ReLU" bottom: "y" top: "y" }')
    blobs, table = infer_shapes(read_net(text))
    # data 2·3, y 2·5 (the in-place ReLU adds no blob), W 5·3 and b 5: 36 float32 values
    assert memory_needed(blobs, table) == (36 * 4, "fc")


def test_a_giant_input_is_refused_before_allocation():
    with pytest.raises(FormatError, match=r"net '.*': its blobs and parameters need .* GiB .* layer 'data'.*"
                                          r"CAFFE_COMPAT_MEMORY_BUDGET"):
        CaffeNet(_net("1 1 1000000 1000000"))


def test_a_giant_num_output_is_refused_naming_the_layer():
    text = _net("1 1000", 'layer { name: "fc" type: "InnerProduct" bottom: "data" top: "y" '
                          'inner_product_param { num_output: 2000000000 } }')
    with pytest.raises(FormatError, match="the largest share at layer 'fc'"):
        CaffeNet(text)


def test_the_budget_follows_the_environment(monkeypatch):
    text = _net("1 1000", 'layer { name: "fc" type: "InnerProduct" bottom: "data" top: "y" '
                          'inner_product_param { num_output: 1000 } }')  # ≈ 1.0e6 values, 4 MB
    monkeypatch.setenv("CAFFE_COMPAT_MEMORY_BUDGET", "1M")
    with pytest.raises(FormatError, match="more than the 0.000977 GiB"):
        CaffeNet(text)
    monkeypatch.setenv("CAFFE_COMPAT_MEMORY_BUDGET", "8M")
    assert CaffeNet(text).blob_shapes["y"] == (1, 1000)
    monkeypatch.setenv("CAFFE_COMPAT_MEMORY_BUDGET", "lots")
    with pytest.raises(FormatError, match="is not a size"):
        CaffeNet(text)


def test_a_net_the_rules_cannot_measure_is_left_to_the_build():
    """An error the shape rules raise first is not reported by the budget: the build's own message wins."""
    text = _net("2 3", 'layer { name: "e" type: "Eltwise" bottom: "data" top: "e" }')
    check_memory_budget(read_net(text), "net", budget=1)  # no FormatError from the budget
    with pytest.raises(FormatError, match=r"needs at least 2 bottom blob\(s\), got 1"):
        CaffeNet(text)


def _data_net(batch_size: int, extra: str = "") -> str:
    from pathlib import Path

    source = Path(__file__).parent / "fixtures" / "data" / "lmdb_raw"
    return (f'layer {{ name: "data" type: "Data" top: "data" top: "label" data_param {{ source: "{source}" '
            f'batch_size: {batch_size} backend: LMDB }} }}\n' + extra)


def test_a_giant_batch_of_a_data_layer_is_refused_at_build():
    """A data layer's tops are unknown until its source is open: the budget is checked again then, before the
    first batch is stacked (batch_size 2e9 ran out of memory in the prefetch thread, exit 1)."""
    with pytest.raises(MemoryBudgetError, match="the largest share at layer 'data'"):
        CaffeNet(_data_net(2000000000))


def test_a_giant_layer_after_a_data_layer_is_refused_before_allocation(monkeypatch):
    """An InnerProduct whose weights follow from the images' size (unknown before the build) is budgeted too
    (num_output 4e8 after a Data layer asked torch for 1.4 TB: a RuntimeError)."""
    text = _data_net(2, 'layer { name: "fc" type: "InnerProduct" bottom: "data" top: "y" '
                        'inner_product_param { num_output: 1000 } }')
    assert CaffeNet(text).blob_shapes["y"] == (2, 1000)
    monkeypatch.setenv("CAFFE_COMPAT_MEMORY_BUDGET", "64K")
    with pytest.raises(MemoryBudgetError, match="the largest share at layer 'fc'"):
        CaffeNet(text)


def test_the_budget_is_kept_without_a_new_inference_per_data_layer(monkeypatch):
    """Each data layer's tops (and the layers after it) are budgeted as they become known, not by inferring
    the whole net again: a prototxt of 1,000 ImageData layers took 37 s to build (O(layers²)), 0.8 s now."""
    import caffe_compat.net_shapes as net_shapes

    calls = []
    real = net_shapes.infer_shapes
    monkeypatch.setattr(net_shapes, "infer_shapes", lambda *a, **k: calls.append(1) or real(*a, **k))
    layers = "".join(_data_net(2).replace('name: "data"', f'name: "d{i}"').replace('top: "data" top: "label"',
                                                                                  f'top: "x{i}" top: "l{i}"')
                     + f'layer {{ name: "fc{i}" type: "InnerProduct" bottom: "x{i}" top: "y{i}" '
                       f'inner_product_param {{ num_output: 3 }} }}\n' for i in range(20))
    net = CaffeNet(layers)
    assert len(calls) == 1 and net.blob_shapes["y19"] == (2, 3)
    # the last data layer's InnerProduct alone breaks a budget the rest fits in: refused, naming it
    per_fc = 3 * (int(np.prod(net.blob_shapes["x0"][1:])) + 1)
    fits = sum(int(np.prod(s)) for s in net.blob_shapes.values()) + 20 * per_fc
    monkeypatch.setenv("CAFFE_COMPAT_MEMORY_BUDGET", str(4 * fits))
    CaffeNet(layers)
    big = layers.replace("num_output: 3 } }\n", "num_output: 3000 } }\n")
    big = layers[:layers.rindex("num_output: 3")] + big[big.rindex("num_output: 3000"):]
    with pytest.raises(MemoryBudgetError, match="the largest share at layer 'fc19'"):
        CaffeNet(big)


def test_the_layers_before_one_whose_rule_fails_are_budgeted(monkeypatch):
    """A layer whose shape rule fails (a Parameter of negative dimension) made the build skip the budget for
    every layer: an InnerProduct of 10^5 x 10^5 before it tried to allocate 40 GB (the allocator's
    RuntimeError, or the machine's memory).  Here 4 MB against a budget of 1 MB."""
    text = _net("1 1000", 'layer { name: "fc" type: "InnerProduct" bottom: "data" top: "y" '
                          'inner_product_param { num_output: 1000 } }\n'
                          'layer { name: "p" type: "Parameter" top: "p" parameter_param { shape { dim: -1 } } }')
    monkeypatch.setenv("CAFFE_COMPAT_MEMORY_BUDGET", "1M")
    with pytest.raises(MemoryBudgetError, match="the largest share at layer 'fc'"):
        CaffeNet(text)
    monkeypatch.setenv("CAFFE_COMPAT_MEMORY_BUDGET", "8M")  # fits: the failing layer's own error
    with pytest.raises(FormatError, match=r"layer 'p' \(Parameter\): a top would have the negative shape \(-1,\)"):
        CaffeNet(text)


@pytest.mark.parametrize("layer", [
    'layer { name: "p" type: "Parameter" top: "p" parameter_param { shape { dim: 2 dim: -1 } } }',
    'layer { name: "p" type: "DummyData" top: "p" dummy_data_param { shape { dim: 2 dim: -1 } } }'])
def test_a_negative_dimension_is_a_format_error_naming_the_layer(layer):
    """torch's RuntimeError before (zeros: Dimension size must be non-negative), at build or forward."""
    with pytest.raises(FormatError, match=r"layer 'p' \((Parameter|DummyData)\): a top would have the negative "
                                          r"shape \(2, -1\)"):
        CaffeNet(layer).forward()

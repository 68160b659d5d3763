"""Filter: rows with a nonzero selector, for every filtered bottom; gradient only to kept rows; Caffe's
setup shapes and CHECKs; ONNX Runtime (NonZero + Gather)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from caffe_compat.errors import FormatError
from caffe_compat.io import read_net
from caffe_compat.net_shapes import infer_shapes
from tests.layers.zoo_single_layer import make_layer

FILTER = 'type: "Filter" bottom: "a" bottom: "b" bottom: "s" top: "fa" top: "fb"'


def test_keeps_the_selected_rows_of_every_bottom():
    a = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    b = torch.arange(4, dtype=torch.float32).reshape(4, 1, 1) * 10
    selector = torch.tensor([0.0, 2.5, 0.0, float("nan")]).reshape(4, 1)  # NaN is nonzero, as in C
    port = make_layer(FILTER, [a.shape, b.shape, selector.shape])
    fa, fb = port(a, b, selector)
    assert fa.tolist() == [[3, 4, 5], [9, 10, 11]] and fb.flatten().tolist() == [10, 30]
    assert port.output_shapes() == [(4, 3), (4, 1, 1)]  # Caffe's first Reshape keeps all N rows


def test_gradient_reaches_only_the_kept_rows():
    a = torch.randn(5, 2, dtype=torch.float64, requires_grad=True)
    selector = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0])
    port = make_layer('type: "Filter" bottom: "a" bottom: "s" top: "f"', [a.shape, selector.shape])
    (top,) = port(a, selector)
    diff = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], dtype=torch.float64)
    top.backward(diff)
    assert a.grad.tolist() == [[1, 2], [0, 0], [0, 0], [3, 4], [5, 6]]
    b = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: port(t, selector)[0], (b,))


def test_nothing_selected_gives_an_empty_top_and_a_zero_gradient():
    a = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    port = make_layer('type: "Filter" bottom: "a" bottom: "s" top: "f"', [a.shape, (3,)])
    (top,) = port(a, torch.zeros(3))
    assert tuple(top.shape) == (0, 2)
    top.sum().backward()
    assert a.grad.abs().sum() == 0


def test_setup_checks_and_inspect():
    with pytest.raises(FormatError, match="selector blob dimensions must be singletons"):
        make_layer('type: "Filter" bottom: "a" bottom: "s" top: "f"', [(4, 3), (4, 2)])
    with pytest.raises(FormatError, match="must have the selector's 0th dimension 4"):
        make_layer('type: "Filter" bottom: "a" bottom: "s" top: "f"', [(3, 3), (4,)])
    with pytest.raises(FormatError, match=r"needs one top per filtered bottom \(2\), got 1"):
        make_layer('type: "Filter" bottom: "a" bottom: "b" bottom: "s" top: "f"', [(4,), (4,), (4,)])
    text = ('layer { name: "d" type: "Input" top: "a" top: "s" input_param { shape { dim: 6 dim: 2 } '
            'shape { dim: 6 dim: 1 dim: 1 } } }\n'
            'layer { name: "f" type: "Filter" bottom: "a" bottom: "s" top: "fa" }\n')
    blobs, _ = infer_shapes(read_net(text))
    assert blobs["fa"] == (6, 2)


def test_onnx_runtime_agrees():
    ort = pytest.importorskip("onnxruntime")
    from caffe_compat.export.onnx_export import _OneLayer, _trace

    port = make_layer('type: "Filter" bottom: "a" bottom: "s" top: "f"', [(5, 3), (5,)])
    a = np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32)
    selector = np.array([1, 0, 1, 1, 0], dtype=np.float32)
    data = _trace(_OneLayer(port).eval(), (torch.from_numpy(a), torch.from_numpy(selector)), 17, ["a", "s"], ["f"],
                  {"a": {0: "n"}, "s": {0: "n"}, "f": {0: "k"}})
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {"a": a, "s": selector})
    np.testing.assert_array_equal(got, a[[0, 2, 3]])
    (other,) = session.run(None, {"a": a, "s": np.array([0, 0, 0, 0, 7], dtype=np.float32)})
    np.testing.assert_array_equal(other, a[[4]])


def test_an_empty_batch_is_refused():
    # filter_layer.cpp Forward_cpu: dim = count / shape(0) in int for every filtered bottom: N = 0 is a division
    # by zero (a crash).  We raised torch's RuntimeError (reshape(0, -1) of the selector).
    from caffe_compat.errors import ShapeMismatchError

    with pytest.raises(FormatError, match="empty batch"):
        make_layer('type: "Filter" bottom: "a" bottom: "s" top: "f"', [(0, 3), (0,)])
    port = make_layer('type: "Filter" bottom: "a" bottom: "s" top: "f"', [(2, 3), (2,)])
    with pytest.raises(ShapeMismatchError):
        port(torch.zeros(0, 3), torch.zeros(0))

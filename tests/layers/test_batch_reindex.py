"""BatchReindex: rows picked by truncated float indices, Caffe's CHECKs, gradients accumulated per row."""

from __future__ import annotations

import pytest
import torch

from caffe_compat.errors import DataError, FormatError
from tests.layers.zoo_single_layer import make_layer


def test_rows_are_picked_repeated_and_dropped():
    data = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    index = torch.tensor([2.9, 0.0, 2.0, -0.5])  # static_cast<int>: 2, 0, 2, 0
    port = make_layer('type: "BatchReindex"', [(4, 3), (4,)])
    (top,) = port(data, index)
    assert top.tolist() == [[6, 7, 8], [0, 1, 2], [6, 7, 8], [0, 1, 2]]
    assert port.output_shapes() == [(4, 3)]


def test_gradient_accumulates_into_the_picked_rows():
    data = torch.zeros(3, 2, 2, dtype=torch.float64, requires_grad=True)
    port = make_layer('type: "BatchReindex"', [(3, 2, 2), (5,)])
    (top,) = port(data, torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0]))
    top.backward(torch.ones_like(top))
    assert data.grad[:, 0, 0].tolist() == [2.0, 3.0, 0.0]  # row 2 is never picked


def test_gradcheck():
    data = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    port = make_layer('type: "BatchReindex"', [(4, 3), (6,)])
    index = torch.tensor([3.0, 1.0, 1.0, 0.0, 2.0, 3.0])
    assert torch.autograd.gradcheck(lambda d: port(d, index)[0], (data,))


def test_index_outside_the_batch_is_a_data_error():
    port = make_layer('type: "BatchReindex"', [(2, 3), (2,)])
    with pytest.raises(DataError, match=r"index 2.0 is outside \[0, 2\)"):
        port(torch.zeros(2, 3), torch.tensor([0.0, 2.0]))


def test_caffes_setup_checks():
    with pytest.raises(FormatError, match="the index bottom must have one axis"):
        make_layer('type: "BatchReindex"', [(2, 3), (2, 1)])
    with pytest.raises(FormatError, match=r"needs 2 bottom blob\(s\), got 1"):
        make_layer('type: "BatchReindex"', [(2, 3)])


def test_onnx_runtime_agrees():
    """BatchReindex traced alone (two inputs: data and indices) runs in ONNX Runtime as a Gather."""
    import numpy as np

    ort = pytest.importorskip("onnxruntime")
    from caffe_compat.export.onnx_export import _OneLayer, _trace

    port = make_layer('type: "BatchReindex"', [(4, 3), (5,)])
    data = np.random.default_rng(2).standard_normal((4, 3)).astype(np.float32)
    index = np.array([3.0, 0.0, 3.0, 1.9, 2.0], dtype=np.float32)
    model = _trace(_OneLayer(port).eval(), (torch.from_numpy(data), torch.from_numpy(index)), 17, ["d", "i"], ["t"],
                   {"d": {0: "n"}, "i": {0: "k"}, "t": {0: "k"}})
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {"d": data, "i": index})
    np.testing.assert_array_equal(got, data[[3, 0, 3, 1, 2]])

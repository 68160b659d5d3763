"""Caffe 1.0's pooled-size clip is guarded by ``if (pad_h_ || pad_w_)``: with either pad nonzero, both
axes are clipped.  Closed case: 11×11 input, kernel 2, stride 4, ``pad_h: 1 pad_w: 0``.

Caffe's PoolingLayer::Reshape: ``ceil((11 + 2·1 − 2)/4) + 1 = 4`` rows, ``(4 − 1)·4 = 12 >= 11 + 1`` → 3;
``ceil((11 − 2)/4) + 1 = 4`` columns, ``(4 − 1)·4 = 12 >= 11 + 0`` → 3 (clipped although ``pad_w`` is 0,
because ``pad_h`` is not).  Output 3×3; a per-axis rule would give 3×4.

Forward_cpu, for ``x = arange(121).reshape(11, 11)``: row windows start at ``4·i − 1`` (``[-1, 1)``,
``[3, 5)``, ``[7, 9)``), column windows at ``4·j`` (``[0, 2)``, ``[4, 6)``, ``[8, 10)``).  MAX takes the
bottom-right element of the clipped window, ``x[(0, 4, 8)][:, (1, 5, 9)]``; AVE divides the sum by
``(hend − hstart)·(wend − wstart)`` before clipping to the image, = 2·2 = 4 everywhere (the pad row counts).
"""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf import text_format

from caffe_compat.io import read_net
from caffe_compat.layers.geometry import pooled_size
from caffe_compat.net_shapes import infer_shapes
from caffe_compat.layers.geometry import pooled_hw
from caffe_compat.proto import caffe_pb2

POOL = 'pooling_param {{ pool: {method} kernel_size: 2 stride: 4 pad_h: 1 pad_w: 0 }}'
NET = ('layer {{ name: "data" type: "Input" top: "data" '
       'input_param {{ shape {{ dim: 1 dim: 1 dim: 11 dim: 11 }} }} }}\n'
       'layer {{ name: "pool" type: "Pooling" bottom: "data" top: "pool" ' + POOL + ' }}\n')

X = np.arange(121, dtype=np.float32).reshape(1, 1, 11, 11)
EXPECTED = {
    "MAX": np.array([[1, 5, 9], [45, 49, 53], [89, 93, 97]], dtype=np.float32),
    # row 0 window holds the pad row and image row 0: (x[0, c] + x[0, c + 1]) / 4; rows 1, 2: 2x2 windows / 4
    "AVE": np.array([[(0 + 1) / 4, (4 + 5) / 4, (8 + 9) / 4],
                     [(33 + 34 + 44 + 45) / 4, (37 + 38 + 48 + 49) / 4, (41 + 42 + 52 + 53) / 4],
                     [(77 + 78 + 88 + 89) / 4, (81 + 82 + 92 + 93) / 4, (85 + 86 + 96 + 97) / 4]], dtype=np.float32),
}


def test_pooled_hw_clips_both_axes_when_either_pad_is_set():
    assert pooled_hw((11, 11), (2, 2), (4, 4), (1, 0)) == (3, 3)
    assert pooled_hw((11, 11), (2, 2), (4, 4), (0, 1)) == (3, 3)
    assert pooled_hw((11, 11), (2, 2), (4, 4), (0, 0)) == (4, 4)  # no pad: no clip (a window past the end)
    # the per-axis helper needs to be told that the layer is padded
    assert pooled_size(11, 2, 4, pad=0) == 4
    assert pooled_size(11, 2, 4, pad=0, padded=True) == 3


@pytest.mark.parametrize("method", ["MAX", "AVE"])
def test_shape_inference_mixed_pads(method):
    blobs, table = infer_shapes(read_net(NET.format(method=method)))
    assert blobs["pool"] == (1, 1, 3, 3)
    assert table[1].top_shapes == [(1, 1, 3, 3)]


@pytest.mark.parametrize("method", ["MAX", "AVE"])
def test_pooling_port_mixed_pads_shape_and_values(method):
    import torch

    from caffe_compat.layers import layer_class

    param = text_format.Parse(f'name: "pool" type: "Pooling" bottom: "data" top: "pool" '
                              f'{POOL.format(method=method)}', caffe_pb2.LayerParameter())
    layer = layer_class(param)(param, [(1, 1, 11, 11)], "test")
    assert layer.output_shapes() == [(1, 1, 3, 3)]
    kernel, stride, pad, out = layer.geometry_for(11, 11)
    assert out == (3, 3)
    x = torch.from_numpy(X)
    (eager,) = layer(x)
    (explicit,) = layer._explicit_pool(x, kernel, stride, pad, out)  # the form ONNX export traces
    for top in (eager, explicit):
        assert tuple(top.shape) == (1, 1, 3, 3)
        np.testing.assert_array_equal(top.numpy()[0, 0], EXPECTED[method])


def test_caffe_net_mixed_pads_end_to_end():
    import torch

    from caffe_compat.net import CaffeNet

    net = CaffeNet(NET.format(method="MAX"))
    top = net(data=torch.from_numpy(X))["pool"]
    np.testing.assert_array_equal(top.detach().numpy()[0, 0], EXPECTED["MAX"])


def test_a_stride_outside_caffes_int_is_a_format_error():
    """stride 2^32 - 1 (Caffe's int reads -1): torch's RuntimeError (Storage size calculation overflowed,
    value cannot be converted to type int) at the forward."""
    from caffe_compat.errors import FormatError
    from tests.layers.zoo_single_layer import make_layer

    for field in ("stride: 4294967295", "stride_h: 1 stride_w: 2147483648", "pad: 2147483648"):
        with pytest.raises(FormatError, match="must be at most 2147483647"):
            make_layer(f'type: "Pooling" pooling_param {{ pool: MAX kernel_size: 2 {field} }}', [(1, 1, 8, 8)])


def test_a_huge_stride_is_refused_before_the_overhang_is_padded(monkeypatch):
    """Caffe's last window of ``stride: 1048576`` on an 8 x 8 input starts past its end; the port pads the input
    to reach it: 52 TB asked of the allocator.  Here 4096 (67 MB) against a budget of 1 MB."""
    from caffe_compat.errors import MemoryBudgetError
    from tests.layers.zoo_single_layer import make_layer

    monkeypatch.setenv("CAFFE_COMPAT_MEMORY_BUDGET", "1M")
    with pytest.raises(MemoryBudgetError, match=r"layer 'pooling' \(Pooling\): .* stride \(4096, 4096\) .* padded to "
                                                r"4098x4098"):
        make_layer('type: "Pooling" pooling_param { pool: AVE kernel_size: 2 stride: 4096 }', [(1, 1, 8, 8)])

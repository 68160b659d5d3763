"""pycaffe's batch helpers (``forward_all``, ``forward_backward_all``, ``_batch``) on a net whose batch size is 0."""

from __future__ import annotations

import numpy as np
import pytest

import caffe_compat as caffe

EMPTY_BATCH = """layer { name: 'data' type: 'Input' top: 'data' input_param { shape { dim: 0 dim: 3 } } }
layer { name: 'ip' type: 'InnerProduct' bottom: 'data' top: 'ip'
  inner_product_param { num_output: 2 weight_filler { type: 'constant' value: 1 } } }"""


@pytest.mark.parametrize("rows", [5, 0])
def test_forward_all_of_a_net_with_batch_size_0_is_pycaffes_zero_division_error(tmp_path, rows):
    # pycaffe.py _Net_batch: remainder = num % batch_size with batch_size = the first blob's num (0): Python's
    # ZeroDivisionError, raised when forward_all / forward_backward_all ask for the first batch, whatever num is
    path = tmp_path / "empty.prototxt"
    path.write_text(EMPTY_BATCH)
    net = caffe.Net(str(path), caffe.TEST)
    x = np.ones((rows, 3), np.float32)
    with pytest.raises(ZeroDivisionError, match="first blob 'data' has batch size 0"):
        net.forward_all(data=x)
    with pytest.raises(ZeroDivisionError, match="first blob 'data' has batch size 0"):
        net.forward_backward_all(data=x)
    assert list(net._batch({})) == []  # nothing to batch: no batch asked for, nothing raised


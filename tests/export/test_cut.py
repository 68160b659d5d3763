"""The one cut at an output blob (on names), the prototxt and built-net forms of it, and the one
"weights or checkpoint, not both" check behind every export entry point."""

from __future__ import annotations

import pytest

from caffe_compat.errors import CaffeCompatError
from caffe_compat.export import cut_steps
from caffe_compat.export.cut import cut_indices
from caffe_compat.export.onnx_export import build_embedder
from caffe_compat.export import source
from caffe_compat.export.source import load_test_net, proto_cut
from caffe_compat.io import read_net
from caffe_compat.net import load_net
from tests.export.helpers import TINY_PROTOTXT, write_tiny_net


def test_cut_indices_keeps_in_place_writers_and_drops_side_branches():
    records = [((), ("data",)), (("data",), ("a",)), (("a",), ("a",)), (("a",), ("side",)),
               (("a",), ("b",)), (("b", "label"), ("loss",)), ((), ("label",))]
    assert cut_indices(records, "b") == [0, 1, 2, 4]
    assert cut_indices(records, "a") == [0, 1, 2]
    assert cut_indices(records, "label") == [6]
    assert cut_indices(records, "missing") == []


def test_prototxt_and_built_net_cuts_agree():
    param = read_net(TINY_PROTOTXT)
    net = load_net(TINY_PROTOTXT)
    for blob in ("fc_embedding", "conv1", "pool1"):  # (the loss reads an automatic Split the prototxt lacks)
        assert [layer.name for layer in proto_cut(param.layer, blob)] == [s.name for s in cut_steps(net, blob)]


def test_weights_and_checkpoint_together_are_refused_everywhere(tmp_path):
    prototxt, weights = write_tiny_net(tmp_path)
    for call in (lambda: load_test_net(prototxt, weights=weights, checkpoint=weights),
                 lambda: build_embedder(prototxt, weights=weights, checkpoint=weights),
                 lambda: source.TestPhaseNet(prototxt, checkpoint=weights, weights=weights)):
        with pytest.raises(CaffeCompatError, match="give either weights \\(a caffemodel\\) or a checkpoint, not both"):
            call()


def test_test_phase_net_names_its_file_only_for_a_path(tmp_path):
    prototxt, weights = write_tiny_net(tmp_path)
    assert source.TestPhaseNet(prototxt, weights=weights).path == str(prototxt)
    text = source.TestPhaseNet(TINY_PROTOTXT)
    assert text.path is None and text.where == "net 'tiny_embedder'"

"""caffe-compat draw (python/draw_net.py) and caffe_compat.draw (pycaffe's caffe.draw API).

The FAPPY authors' CUB-200 GoogLeNet (tests/fixtures/authors/cub200/train.prototxt, copied from the
authors' files) is drawn to a PNG that OpenCV decodes; the phase filter keeps a phase's layers only.
"""

from __future__ import annotations

import shutil
import sys

import cv2
import pytest
from google.protobuf import text_format

from caffe_compat import draw
from caffe_compat.cli import main
from caffe_compat.io import read_net
from caffe_compat.proto import caffe_pb2
from tests.conftest import fixture_path

pydot = pytest.importorskip("pydot")
CUB = fixture_path("authors/cub200/train.prototxt")
# Rendering runs graphviz's dot, a system program pip cannot install (.ci/run installs it); the graphs
# themselves, the DOT source and the errors are checked without it.
needs_dot = pytest.mark.skipif(shutil.which("dot") is None,
                               reason="graphviz's dot is not on PATH (apt-get install graphviz)")

PHASED = """
name: "phased"
layer { name: "train_data" type: "Data" top: "data" top: "label" include { phase: TRAIN }
        data_param { source: "train_lmdb" batch_size: 64 } }
layer { name: "test_data" type: "Data" top: "data" top: "label" include { phase: TEST }
        data_param { source: "test_lmdb" batch_size: 100 } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 10 } }
layer { name: "relu" type: "ReLU" bottom: "ip" top: "ip" }
layer { name: "accuracy" type: "Accuracy" bottom: "ip" bottom: "label" top: "accuracy" include { phase: TEST } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" exclude { phase: TEST } }
"""


def _names(graph) -> set[str]:
    return {node.get_name().strip('"') for node in graph.get_nodes()}


@needs_dot
def test_draw_cub_net_png(tmp_path, capsys):
    out = tmp_path / "cub.png"
    assert main(["draw", str(CUB), str(out), "--rankdir", "TB"]) == 0
    image = cv2.imread(str(out))
    assert image is not None and image.shape[0] > 1000 and image.shape[1] > 200  # 144 layers top to bottom
    net = read_net(CUB)
    assert f"{len(net.layer)} of {len(net.layer)} layers drawn" in capsys.readouterr().out


def test_cub_net_graph_has_every_layer_blob_and_edge_label(tmp_path, capsys):
    net = read_net(CUB)
    out = tmp_path / "cub.raw"  # the DOT source: the command's whole path but graphviz's rendering
    assert main(["draw", str(CUB), str(out)]) == 0
    assert f"{len(net.layer)} of {len(net.layer)} layers drawn" in capsys.readouterr().out
    graph = draw.get_pydot_graph(net, "LR")
    assert out.read_text() == graph.to_string()
    names = _names(graph)
    assert {f"{layer.name}_{layer.type}" for layer in net.layer} <= names
    assert {f"{blob}_blob" for layer in net.layer for blob in layer.top} <= names
    labels = {e.get_label().strip('"') for e in graph.get_edges() if e.get_label()}
    assert "64" in labels  # conv1/7x7_s2's num_output labels its edge


def test_phase_filter_drops_the_other_phase():
    net = text_format.Parse(PHASED, caffe_pb2.NetParameter())
    train = _names(draw.get_pydot_graph(net, "LR", phase=caffe_pb2.TRAIN))
    test = _names(draw.get_pydot_graph(net, "LR", phase="TEST"))
    every = _names(draw.get_pydot_graph(net, "LR"))
    assert {"train_data_Data", "loss_SoftmaxWithLoss", "ip_InnerProduct", "relu_ReLU"} <= train
    assert not {"test_data_Data", "accuracy_Accuracy", "accuracy_blob"} & train
    assert {"test_data_Data", "accuracy_Accuracy", "accuracy_blob"} <= test
    assert not {"train_data_Data", "loss_SoftmaxWithLoss", "loss_blob"} & test
    assert train | test == every
    edges = {e.get_label().strip('"') for e in draw.get_pydot_graph(net, "LR", phase="TEST").get_edges()
             if e.get_label()}
    assert edges == {"Batch 100", "10"}


def test_draw_net_to_file_writes_the_dot_source_as_raw(tmp_path):
    net = text_format.Parse(PHASED, caffe_pb2.NetParameter())
    draw.draw_net_to_file(net, tmp_path / "n.raw", "BT", phase="TRAIN")
    assert (tmp_path / "n.raw").read_text().startswith("digraph phased")


def test_display_lrm_labels_the_learning_layers(tmp_path):
    """BVLC's draw_net.py passes display_lrm (``draw_net_to_file(net, file, rankdir, phase, display_lrm)``):
    convolution/inner-product labels get their weight and bias lr_mult (1 when not given), none when both
    are 0; other layers and display_lrm=False are unchanged."""
    net = text_format.Parse(PHASED + """
layer { name: "frozen" type: "InnerProduct" bottom: "ip" top: "f" param { lr_mult: 0 } param { lr_mult: 0 }
        inner_product_param { num_output: 2 } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "c" param { lr_mult: 1 } param { lr_mult: 2 }
        convolution_param { num_output: 2 kernel_size: 1 } }""", caffe_pb2.NetParameter())
    layers = {layer.name: layer for layer in net.layer}
    assert draw.get_layer_label(layers["ip"], "TB", display_lrm=True) == "ip (InnerProduct) lr mult: 1.0, 1.0"
    assert draw.get_layer_label(layers["conv"], "TB", True).endswith("pad: 0 lr mult: 1.0, 2.0")
    assert draw.get_layer_label(layers["frozen"], "TB", True) == "frozen (InnerProduct)"
    assert draw.get_layer_label(layers["relu"], "TB", True) == draw.get_layer_label(layers["relu"], "TB")
    assert "lr mult" not in draw.get_layer_label(layers["ip"], "TB")
    draw.draw_net_to_file(net, tmp_path / "n.raw", "TB", caffe_pb2.TRAIN, True)  # draw_net.py's call
    assert "lr mult: 1.0, 2.0" in (tmp_path / "n.raw").read_text()
    prototxt = tmp_path / "n.prototxt"
    prototxt.write_text(text_format.MessageToString(net))
    for flag in ("--display-lrm", "--display_lrm"):  # draw_net.py spells it with an underscore
        assert main(["draw", str(prototxt), str(tmp_path / "cli.raw"), "--rankdir", "TB", flag]) == 0
        assert "lr mult: 1.0, 2.0" in (tmp_path / "cli.raw").read_text()
    assert main(["draw", str(prototxt), str(tmp_path / "cli.raw")]) == 0
    assert "lr mult" not in (tmp_path / "cli.raw").read_text()


@needs_dot
def test_draw_net_to_file_formats(tmp_path):
    net = text_format.Parse(PHASED, caffe_pb2.NetParameter())
    draw.draw_net_to_file(net, str(tmp_path / "n.png"))
    assert cv2.imread(str(tmp_path / "n.png")) is not None
    assert draw.draw_net(net, "RL", ext="svg").lstrip().startswith(b"<?xml")


def test_missing_pydot_or_graphviz_is_a_typed_error(tmp_path, monkeypatch, capsys):
    net = text_format.Parse(PHASED, caffe_pb2.NetParameter())
    monkeypatch.setenv("PATH", str(tmp_path))  # no dot on PATH
    with pytest.raises(draw.GraphvizMissing, match="apt-get install graphviz"):
        draw.draw_net(net, "LR")
    monkeypatch.setitem(sys.modules, "pydot", None)
    assert main(["draw", str(CUB), str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install pydot" in err[0] and not (tmp_path / "x.png").exists()
    with pytest.raises(SystemExit) as exit_info:  # argparse's own exit status 2
        main(["draw", str(CUB), str(tmp_path / "x.png"), "--rankdir", "XY"])
    assert exit_info.value.code == 2


@needs_dot
@pytest.mark.parametrize("name", ["ends\\\\", 'quote\\\\\\"d', "nul\\x00", "brace{", "angle<x", "a}b>|c"])
def test_names_dot_would_misread_are_escaped(tmp_path, name):
    """Layer and blob names with a trailing backslash, a NUL, or the record syntax { } < > | were written into
    the DOT source as they are: dot failed on the whole drawing ('graphviz cannot write format png')."""
    text = (f'layer {{ name: "{name}" type: "Input" top: "{name}" input_param {{ shape {{ dim: 1 dim: 2 }} }} }}\n'
            f'layer {{ name: "r" type: "ReLU" bottom: "{name}" top: "out" }}\n')
    (tmp_path / "net.prototxt").write_text(text)
    draw.draw_net_to_file(read_net(tmp_path / "net.prototxt"), tmp_path / "net.png")
    assert cv2.imread(str(tmp_path / "net.png")) is not None

"""Caffe's ``Net::Init`` lines (``caffe_compat.net_log``): what a net logs while it is built, checked against
lines derived here by hand from Caffe 1.0's ``net.cpp`` rules (shapes, running top counts × 4 bytes, the
backward analysis, the sorted outputs), plus ``FilterNet``'s rule lines and the ``DebugString`` dump."""

from __future__ import annotations

import logging

from google.protobuf import text_format

import caffe_compat as caffe
import caffe_compat.net_log as net_log
from caffe_compat.io.glog import caffe_log, parse_line
from caffe_compat.net import CaffeNet
from caffe_compat.net_debug import backward_needs
from caffe_compat.net_log import debug_string, quiet
from caffe_compat.proto import caffe_pb2
from caffe_compat.solver import Solver

NET = """name: "log" {header}
layer {{ name: "data" type: "Input" top: "data" top: "label"
        input_param {{ shape {{ dim: 4 dim: 3 }} shape {{ dim: 4 }} }} }}
layer {{ name: "ip" type: "InnerProduct" bottom: "data" top: "ip" param {{ name: "w" }} param {{ lr_mult: 2 }}
        inner_product_param {{ num_output: 2 }} }}
layer {{ name: "relu" type: "ReLU" bottom: "ip" top: "ip" }}
layer {{ name: "ip2" type: "InnerProduct" bottom: "data" top: "ip2" param {{ name: "w" }} param {{ lr_mult: 0 }}
        inner_product_param {{ num_output: 2 }} }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }}
layer {{ name: "acc" type: "Accuracy" bottom: "ip" bottom: "label" top: "acc" }}
"""

# Top counts: data 12 + label 4 = 16 (64 bytes); data split 2 x 12 -> 40 (160); label split 2 x 4 -> 48 (192);
# ip 4x2 -> 56 (224); relu in place counts its top again -> 64 (256); ip split 2 x 8 -> 80 (320); ip2 -> 88 (352);
# loss, a scalar -> 89 (356); acc -> 90 (360).
LAYER_LINES = [
    "Creating Layer data", "data -> data", "data -> label", "Setting up data",
    "Top shape: 4 3 (12)", "Top shape: 4 (4)", "Memory required for data: 64",
    "Creating Layer data_data_0_split", "data_data_0_split <- data",
    "data_data_0_split -> data_data_0_split_0", "data_data_0_split -> data_data_0_split_1",
    "Setting up data_data_0_split", "Top shape: 4 3 (12)", "Top shape: 4 3 (12)", "Memory required for data: 160",
    "Creating Layer label_data_1_split", "label_data_1_split <- label",
    "label_data_1_split -> label_data_1_split_0", "label_data_1_split -> label_data_1_split_1",
    "Setting up label_data_1_split", "Top shape: 4 (4)", "Top shape: 4 (4)", "Memory required for data: 192",
    "Creating Layer ip", "ip <- data_data_0_split_0", "ip -> ip", "Setting up ip", "Top shape: 4 2 (8)",
    "Memory required for data: 224",
    "Creating Layer relu", "relu <- ip", "relu -> ip (in-place)", "Setting up relu", "Top shape: 4 2 (8)",
    "Memory required for data: 256",
    "Creating Layer ip_relu_0_split", "ip_relu_0_split <- ip", "ip_relu_0_split -> ip_relu_0_split_0",
    "ip_relu_0_split -> ip_relu_0_split_1", "Setting up ip_relu_0_split", "Top shape: 4 2 (8)",
    "Top shape: 4 2 (8)", "Memory required for data: 320",
    "Creating Layer ip2", "ip2 <- data_data_0_split_1", "ip2 -> ip2", "Setting up ip2", "Top shape: 4 2 (8)",
    "Memory required for data: 352", "Sharing parameters 'w' owned by layer 'ip', param index 0",
    "Creating Layer loss", "loss <- ip_relu_0_split_0", "loss <- label_data_1_split_0", "loss -> loss",
    "Setting up loss", "Top shape: (1)", "    with loss weight 1", "Memory required for data: 356",
    "Creating Layer acc", "acc <- ip_relu_0_split_1", "acc <- label_data_1_split_1", "acc -> acc",
    "Setting up acc", "Top shape: (1)", "Memory required for data: 360",
]
# Backwards: acc and ip2 reach no loss; the Input and the Splits of data and label have nothing learnable below.
BACKWARD_LINES = [
    "acc does not need backward computation.", "loss needs backward computation.",
    "ip2 does not need backward computation.", "ip_relu_0_split needs backward computation.",
    "relu needs backward computation.", "ip needs backward computation.",
    "label_data_1_split does not need backward computation.",
    "data_data_0_split does not need backward computation.", "data does not need backward computation.",
]
END_LINES = ["This network produces output acc", "This network produces output ip2",
             "This network produces output loss", "Network initialization done."]


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "caffe_compat.net"]


def _init_lines(caplog) -> list[str]:
    """The lines after the DebugString dump."""
    lines = _messages(caplog)
    start = next(i for i, line in enumerate(lines) if line.startswith("Initializing net from parameters: \n"))
    return lines[start + 1:]


def test_net_init_lines_in_caffes_order(caplog):
    caplog.set_level(logging.INFO, logger="caffe_compat.net")
    CaffeNet(NET.format(header=""), phase="train")
    assert _init_lines(caplog) == LAYER_LINES + BACKWARD_LINES + END_LINES


def test_backward_lines_are_those_before_force_backward(caplog):
    """Caffe logs the needs-backward lines before it applies force_backward (which then turns every layer on)."""
    caplog.set_level(logging.INFO, logger="caffe_compat.net")
    net = CaffeNet(NET.format(header="force_backward: true"), phase="train")
    assert _init_lines(caplog) == LAYER_LINES + BACKWARD_LINES + END_LINES
    assert all(backward_needs(net).layer)


def test_debug_string_dump_and_filter_lines(caplog):
    caplog.set_level(logging.INFO, logger="caffe_compat.net")
    CaffeNet("""name: "f\\"é"
state { stage: "s" }
layer { name: "in" type: "Input" top: "x" input_param { shape { dim: 2 dim: 3 } } exclude { phase: TEST } }
layer { name: "test_only" type: "ReLU" bottom: "x" top: "a" include { phase: TEST } }
layer { name: "deep" type: "ReLU" bottom: "x" top: "b" include { min_level: 2 } include { stage: "t" } }
layer { name: "shallow" type: "ReLU" bottom: "x" top: "c" include { max_level: -1 } }
layer { name: "not_s" type: "ReLU" bottom: "x" top: "d" include { not_stage: "s" } }
layer { name: "scale" type: "Power" bottom: "x" top: "e" phase: TRAIN
        power_param { scale: 0.33333334 shift: 0.01 } }
""", phase="train", level=0)
    lines = _messages(caplog)
    assert lines[:6] == [
        "The NetState phase (0) differed from the phase (1) specified by a rule in layer in",
        "The NetState phase (0) differed from the phase (1) specified by a rule in layer test_only",
        "The NetState level (0) is above the min_level (2) specified by a rule in layer deep",
        "The NetState did not contain stage 't' specified by a rule in layer deep",
        "The NetState level (0) is above the max_level (-1) specified by a rule in layer shallow",
        "The NetState contained a not_stage 's' specified by a rule in layer not_s",
    ]
    # C++ DebugString: the state Net::Init was given, the included layers as written (no phase stamped on "in"),
    # strings C-escaped (octal bytes), floats as SimpleFtoa (9 digits when 6 do not read back)
    assert lines[6] == """Initializing net from parameters: 
name: "f\\"\\303\\251"
state {
  phase: TRAIN
  level: 0
  stage: "s"
}
layer {
  name: "in"
  type: "Input"
  top: "x"
  exclude {
    phase: TEST
  }
  input_param {
    shape {
      dim: 2
      dim: 3
    }
  }
}
layer {
  name: "scale"
  type: "Power"
  bottom: "x"
  top: "e"
  phase: TRAIN
  power_param {
    scale: 0.333333343
    shift: 0.01
  }
}"""  # noqa: W291 (Caffe's line ends with a space)
    assert lines[7:9] == ["Creating Layer in", "in -> x"]


def test_debug_string_numbers_and_order():
    """Fields in field-number order (base_lr 5, max_iter 7, momentum 11, weight_decay 12, delta 31,
    clip_gradients 35, type 40), floats as SimpleFtoa; elsewhere the layout is text_format's."""
    param = caffe_pb2.SolverParameter(type="SGD", delta=1e-8, clip_gradients=float("inf"), weight_decay=0.0005,
                                      momentum=0.9, max_iter=10, base_lr=0.1)
    assert debug_string(param) == ('base_lr: 0.1\nmax_iter: 10\nmomentum: 0.9\nweight_decay: 0.0005\ndelta: 1e-08\n'
                                   'clip_gradients: inf\ntype: "SGD"\n')
    layer = caffe_pb2.LayerParameter(name="a\nb'", loss_weight=[1.0 / 3, 2.0, 1e-5])
    assert debug_string(layer) == 'name: "a\\nb\\\'"\nloss_weight: 0.333333343\nloss_weight: 2\nloss_weight: 1e-05\n'
    net = caffe_pb2.NetParameter()
    text_format.Parse(NET.format(header="force_backward: true"), net)
    python = text_format.MessageToString(net)  # the same layout, but "2.0" where C++ writes "2"
    assert debug_string(net) == python.replace("lr_mult: 2.0\n", "lr_mult: 2\n").replace("lr_mult: 0.0\n",
                                                                                        "lr_mult: 0\n")
    assert "lr_mult: 2.0" in python


def test_nothing_is_built_unless_the_net_logger_listens(caplog, monkeypatch):
    def refuse(*args):
        raise AssertionError("computed while nobody listens")

    caplog.set_level(logging.WARNING, logger="caffe_compat.net")
    with monkeypatch.context() as patch:
        patch.setattr(net_log, "init_lines", refuse)
        patch.setattr(net_log, "debug_string", refuse)
        patch.setattr(net_log, "filter_lines", refuse)
        CaffeNet(NET.format(header=""), phase="train")
    assert not _messages(caplog)
    caplog.set_level(logging.INFO, logger="caffe_compat.net")
    CaffeNet(NET.format(header=""), phase="train")
    assert _messages(caplog)[-1] == "Network initialization done."


def test_glog_file_has_the_dump_without_prefixes(tmp_path):
    path = tmp_path / "caffe.log"
    with caffe_log(path):
        CaffeNet(NET.format(header=""), phase="train")
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.endswith("] Initializing net from parameters: "))
    assert parse_line(lines[start]) is not None
    assert lines[start + 1:start + 4] == ['name: "log"', "state {", "  phase: TRAIN"]
    end = next(i for i, line in enumerate(lines) if line.endswith("] Creating Layer data"))
    assert all(parse_line(line) is None for line in lines[start + 1:end])
    assert [parse_line(line).message for line in lines[end:]] == LAYER_LINES + BACKWARD_LINES + END_LINES


def test_quiet_and_pycaffe_reshape_log_no_second_init(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="caffe_compat.net")
    with quiet():
        CaffeNet(NET.format(header=""), phase="train")
    assert not _messages(caplog)
    path = tmp_path / "net.prototxt"
    path.write_text(NET.format(header=""))
    net = caffe.Net(str(path), caffe.TRAIN)
    assert _init_lines(caplog)[-1] == "Network initialization done."
    caplog.clear()
    net.blobs["data"].reshape(8, 3)
    net.blobs["label"].reshape(8)
    net.reshape()  # Caffe reshapes its layers: no second Net::Init
    net.forward()
    assert net.blobs["ip"].data.shape == (8, 2)
    assert not [line for line in _messages(caplog) if not line.startswith("    [")]


def test_solver_logs_the_train_net_init_after_its_creating_line(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="caffe_compat")
    (tmp_path / "net.prototxt").write_text(NET.format(header=""))
    Solver(caffe_pb2.SolverParameter(net=str(tmp_path / "net.prototxt"), base_lr=0.1, lr_policy="fixed",
                                     solver_mode=caffe_pb2.SolverParameter.CPU))
    lines = [r.getMessage() for r in caplog.records]
    creating = next(i for i, line in enumerate(lines) if line.startswith("Creating training net from net file: "))
    assert lines[creating + 1].startswith("Initializing net from parameters: \n")
    assert lines[creating + 2:creating + 2 + len(LAYER_LINES)] == LAYER_LINES
    assert lines.index("Network initialization done.") > creating

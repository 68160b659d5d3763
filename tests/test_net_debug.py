"""Caffe's ``debug_info`` lines (``caffe_compat.net_debug``): ``Net::ForwardDebugInfo``/``BackwardDebugInfo``, the
``All net params`` line of ``Net::Backward``, which layers need backward (``Net::Init``), and when a solver logs
them (``Solver::Step``: ``display && debug_info``).

The values are checked against a closed form of the net below computed here in float64: Input (4×3 data, 4
labels) → InnerProduct (2 outputs, weights set) → ReLU in place → SoftmaxWithLoss, plus an Accuracy.  A line
prints a float32 mean with 6 significant digits (``%g``): rounding to 6 digits is at most 5e-6 relative, the
float32 arithmetic ~1e-7, so a printed number agrees with the float64 value to 1e-5 relative.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch

import caffe_compat as caffe
from caffe_compat.net import CaffeNet
from caffe_compat.net_debug import _mean_text, backward_needs, caffe_float
from caffe_compat.proto import caffe_pb2
from caffe_compat.solver import Solver

NET = """name: "dbg" {header}
layer {{ name: "data" type: "Input" top: "data" top: "label"
        input_param {{ shape {{ dim: 4 dim: 3 }} shape {{ dim: 4 }} }} }}
layer {{ name: "ip" type: "InnerProduct" bottom: "data" top: "ip" {ip_extra}
        inner_product_param {{ num_output: 2 weight_filler {{ type: "gaussian" }} }} }}
layer {{ name: "relu" type: "ReLU" bottom: "ip" top: "ip" }}
layer {{ name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" {loss_extra} }}
layer {{ name: "acc" type: "Accuracy" bottom: "ip" bottom: "label" top: "acc" }}
"""
X = np.array([[1.0, -2.0, 0.5], [0.3, 0.8, -1.5], [-0.7, 0.2, 2.0], [1.2, 1.1, -0.4]])
LABEL = np.array([0.0, 1.0, 1.0, 0.0])
W = np.array([[0.5, -0.25, 0.75], [-0.6, 0.4, 0.2]])
B = np.array([0.1, -0.3])
STEPS = ["data", "label_data_1_split", "ip", "relu", "ip_relu_0_split", "loss", "acc"]


def _net(header="debug_info: true", ip_extra="", loss_extra=""):
    net = CaffeNet(NET.format(header=header, ip_extra=ip_extra, loss_extra=loss_extra), phase="train")
    with torch.no_grad():
        net.layers["ip"].caffe_blobs()[0].copy_(torch.tensor(W, dtype=torch.float32))
        net.layers["ip"].caffe_blobs()[1].copy_(torch.tensor(B, dtype=torch.float32))
    return net


def _inputs():
    return {"data": torch.tensor(X, dtype=torch.float32), "label": torch.tensor(LABEL, dtype=torch.float32)}


def _closed_form():
    """(forward lines, backward lines, (L1 data, L1 diff, L2 data, L2 diff)) of one forward and backward."""
    ip = X @ W.T + B
    r = np.maximum(ip, 0.0)
    e = np.exp(r - r.max(1, keepdims=True))
    p = e / e.sum(1, keepdims=True)
    onehot = np.eye(2)[LABEL.astype(int)]
    loss = -np.mean(np.log(p[np.arange(4), LABEL.astype(int)]))
    acc = np.mean(r.argmax(1) == LABEL)
    dr = (p - onehot) / 4
    dip = dr * (ip > 0)
    dw, db = dip.T @ X, dip.sum(0)
    mean = lambda a: float(np.mean(np.abs(a)))  # noqa: E731
    forward = [("data", "top blob data data", mean(X)), ("data", "top blob label data", mean(LABEL)),
               ("label_data_1_split", "top blob label_data_1_split_0 data", mean(LABEL)),
               ("label_data_1_split", "top blob label_data_1_split_1 data", mean(LABEL)),
               ("ip", "top blob ip data", mean(ip)), ("ip", "param blob 0 data", mean(W)),
               ("ip", "param blob 1 data", mean(B)), ("relu", "top blob ip data", mean(r)),
               ("ip_relu_0_split", "top blob ip_relu_0_split_0 data", mean(r)),
               ("ip_relu_0_split", "top blob ip_relu_0_split_1 data", mean(r)),
               ("loss", "top blob loss data", loss), ("acc", "top blob acc data", acc)]
    backward = [("loss", "bottom blob ip_relu_0_split_0 diff", mean(dr)),
                ("ip_relu_0_split", "bottom blob ip diff", mean(dr)), ("relu", "bottom blob ip diff", mean(dip)),
                ("ip", "param blob 0 diff", mean(dw)), ("ip", "param blob 1 diff", mean(db))]
    norms = (np.abs(W).sum() + np.abs(B).sum(), np.abs(dw).sum() + np.abs(db).sum(),
             math.sqrt((W ** 2).sum() + (B ** 2).sum()), math.sqrt((dw ** 2).sum() + (db ** 2).sum()))
    assert 0 < (ip > 0).sum() < ip.size  # the ReLU cuts: its bottom diff differs from its top's
    return forward, backward, norms


def _lines(caplog):
    """The debug_info lines (each starts with four spaces and a bracket; building a net logs Net::Init's too)."""
    lines = [r.getMessage() for r in caplog.records if r.name == "caffe_compat.net"]
    return [line for line in lines if line.startswith("    [")]


def _check(lines, expected, kind):
    assert len(lines) == len(expected), lines
    for line, (layer, what, value) in zip(lines, expected):
        head, _, number = line.rpartition(": ")
        assert head == f"    [{kind}] Layer {layer}, {what}"
        assert float(number) == pytest.approx(value, rel=1e-5, abs=1e-30)


def _check_norms(line, norms):
    head, _, rest = line.partition("L1 norm = (")
    assert head == "    [Backward] All net params (data, diff): "
    l1, _, l2 = rest.partition("); L2 norm = (")
    values = [float(v) for v in l1.split(", ") + l2.rstrip(")").split(", ")]
    assert values == pytest.approx([norms[0], norms[1], norms[2], norms[3]], rel=1e-5)


def test_forward_and_backward_lines_match_the_closed_form(caplog):
    caplog.set_level(logging.INFO, logger="caffe_compat.net")
    net = _net()
    forward, backward, norms = _closed_form()
    blobs = net(**_inputs())
    _check(_lines(caplog), forward, "Forward")
    caplog.clear()
    net.objective(blobs).backward()
    blobs.debug.log_backward(whole=True)
    records = [r for r in caplog.records if r.name == "caffe_compat.net"]
    _check([r.getMessage() for r in records[:-1]], backward, "Backward")
    assert records[-1].levelno == logging.ERROR  # Net::Backward logs it with LOG(ERROR)
    _check_norms(records[-1].getMessage(), norms)


def test_nothing_is_computed_when_nobody_listens(caplog):
    caplog.set_level(logging.WARNING, logger="caffe_compat.net")
    blobs = _net()(**_inputs())
    assert blobs.debug is None and not _lines(caplog)


def test_a_net_without_debug_info_logs_nothing(caplog):
    caplog.set_level(logging.INFO, logger="caffe_compat.net")
    blobs = _net(header="")(**_inputs())
    assert blobs.debug is None and not _lines(caplog)


def test_backward_needs_follow_net_init():
    needs = backward_needs(_net())
    # data and the label split: no learnable blob below; Accuracy: reaches no loss
    assert needs.layer == (False, False, True, True, True, True, False)
    assert needs.bottom == ((), (False,), (False,), (True,), (True,), (True, False), (False, False))
    assert needs.param == ((), (), (True, True), (), (), (), ())


def test_backward_needs_lr_mult_zero_and_propagate_down():
    frozen = backward_needs(_net(ip_extra="param { lr_mult: 0 } param { lr_mult: 0 }"))
    assert frozen.layer == (False,) * 7 and frozen.param[2] == (False, False)
    # propagate_down false on the loss's data: nothing below the loss needs backward any more
    cut = backward_needs(_net(loss_extra="propagate_down: false propagate_down: false"))
    assert cut.layer == (False, False, False, False, False, True, False)
    assert cut.bottom[5] == (False, False)
    # propagate_down true replaces the analysis: a diff for the labels too (AppendBottom)
    forced = backward_needs(_net(loss_extra="propagate_down: true propagate_down: true"))
    assert forced.bottom[5] == (True, True) and forced.layer[1] is False


def test_backward_needs_force_backward_spares_the_labels():
    needs = backward_needs(_net(header="force_backward: true"))
    assert needs.layer == (True,) * 7
    assert needs.bottom[5] == (True, False)  # LossLayer::AllowForceBackward(1) is false
    assert needs.bottom[6] == (True, True)  # Accuracy is no LossLayer
    assert needs.bottom[2] == (True,)


def test_batch_norm_needs_backward_without_param_specs():
    """Caffe reads lr_mult from the net's layer parameter, before BatchNorm's own LayerSetUp adds lr_mult 0."""
    text = NET.format(header="", ip_extra="", loss_extra="").replace(
        'layer { name: "relu"', 'layer { name: "bn" type: "BatchNorm" bottom: "ip" top: "ip" }\nlayer { name: "relu"')
    bn = CaffeNet(text, phase="train")
    needs = backward_needs(bn)
    index = [s.name for s in bn.steps].index("bn")
    assert needs.layer[index] and needs.param[index] == (True, True, True)
    fixed = CaffeNet(text.replace('top: "ip" }\nlayer { name: "relu"', 'top: "ip" param { lr_mult: 0 } '
                                  'param { lr_mult: 0 } param { lr_mult: 0 } }\nlayer { name: "relu"'), phase="train")
    assert backward_needs(fixed).param[index] == (False, False, False)


def test_shared_blob_display_name(caplog):
    caplog.set_level(logging.INFO, logger="caffe_compat.net")
    net = _net(ip_extra='param { name: "w" }')
    net(**_inputs())
    assert "    [Forward] Layer ip, param blob w data: " in [line.rpartition(": ")[0] + ": " for line in _lines(caplog)]


def test_float_printing():
    assert _mean_text(0.0, 0) == "-nan"  # 0.0f / 0 on x86
    assert caffe_float(float("nan")) == "nan" and caffe_float(-float("nan")) == "-nan"
    assert caffe_float(1e-7) == "1e-07" and caffe_float(123456789.0) == "1.23457e+08"
    assert _mean_text(1.0, 3) == "0.333333" and caffe_float(float("inf")) == "inf"


def _solver(tmp_path, *, display, debug_info, header=""):
    (tmp_path / "net.prototxt").write_text(NET.format(header=header, ip_extra="", loss_extra=""))
    solver = Solver(caffe_pb2.SolverParameter(
        net=str(tmp_path / "net.prototxt"), base_lr=0.1, lr_policy="fixed", momentum=0.9, display=display,
        debug_info=debug_info, solver_mode=caffe_pb2.SolverParameter.CPU))
    with torch.no_grad():
        solver.net.layers["ip"].caffe_blobs()[0].copy_(torch.tensor(W, dtype=torch.float32))
        solver.net.layers["ip"].caffe_blobs()[1].copy_(torch.tensor(B, dtype=torch.float32))
    solver.feed(**_inputs())
    return solver


def test_solver_logs_on_display_iterations_and_trains_the_same(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="caffe_compat.net")
    quiet = _solver(tmp_path, display=2, debug_info=False)
    quiet.step(3)
    assert not _lines(caplog)
    loud = _solver(tmp_path, display=2, debug_info=True)
    loud.step(3)
    lines = _lines(caplog)
    forward, backward, norms = _closed_form()
    per_iteration = len(forward) + len(backward) + 1
    assert len(lines) == 2 * per_iteration  # iterations 0 and 2 (display 2)
    _check(lines[:len(forward)], forward, "Forward")  # iteration 0: the weights set above
    _check(lines[len(forward):per_iteration - 1], backward, "Backward")
    _check_norms(lines[per_iteration - 1], norms)
    for a, b in zip(quiet.net.parameters(), loud.net.parameters()):
        assert torch.equal(a, b)  # the lines change no number


def test_solver_overrides_the_net_files_flag(tmp_path, caplog):
    """Solver::Step sets the TRAIN net's flag at every iteration: the net file's debug_info alone logs nothing."""
    caplog.set_level(logging.INFO, logger="caffe_compat.net")
    _solver(tmp_path, display=1, debug_info=False, header="debug_info: true").step(2)
    assert not _lines(caplog)


def test_pycaffe_backward_logs_no_norm_line(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="caffe_compat.net")
    path = tmp_path / "net.prototxt"
    path.write_text(NET.format(header="debug_info: true", ip_extra="", loss_extra=""))
    net = caffe.Net(str(path), caffe.TRAIN)
    net.params["ip"][0].data[...] = W
    net.params["ip"][1].data[...] = B
    net.blobs["data"].data[...] = X
    net.blobs["label"].data[...] = LABEL
    forward, backward, _ = _closed_form()
    net.forward()
    _check(_lines(caplog), forward, "Forward")
    caplog.clear()
    net.backward()  # Caffe's BackwardFromTo: per-layer lines, no "All net params" line
    _check(_lines(caplog), backward, "Backward")


def test_pycaffe_solver_logs_through_its_train_net(tmp_path, caplog):
    """pycaffe's solvers run the core's Step on a pycaffe view of the TRAIN net: the flag reaches the CaffeNet."""
    caplog.set_level(logging.INFO, logger="caffe_compat.net")
    (tmp_path / "net.prototxt").write_text(NET.format(header="", ip_extra="", loss_extra=""))
    (tmp_path / "solver.prototxt").write_text(
        f'net: "{tmp_path / "net.prototxt"}" base_lr: 0.1 lr_policy: "fixed" display: 1 debug_info: true '
        f'max_iter: 1 solver_mode: CPU')
    solver = caffe.SGDSolver(str(tmp_path / "solver.prototxt"))
    solver.net.params["ip"][0].data[...] = W
    solver.net.params["ip"][1].data[...] = B
    solver.net.blobs["data"].data[...] = X
    solver.net.blobs["label"].data[...] = LABEL
    solver.step(1)
    forward, backward, norms = _closed_form()
    lines = _lines(caplog)
    _check(lines[:len(forward)], forward, "Forward")
    _check(lines[len(forward):-1], backward, "Backward")
    _check_norms(lines[-1], norms)


def test_backward_needs_follow_a_force_backward_set_after_building():
    net = _net()
    assert backward_needs(net).layer[0] is False
    net.force_backward = True  # scripts set it on a built net (the cached flags must not outlive it)
    assert backward_needs(net).layer == (True,) * 7

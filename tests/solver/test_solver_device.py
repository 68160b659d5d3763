"""The Solver's default device, as ``caffe train`` picks the mode (tools/caffe.cpp): without ``-gpu``, GPU
only when the solver file *sets* ``solver_mode: GPU`` (``has_solver_mode()``; ``device_id`` or 0); a file
without ``solver_mode`` trains on the CPU although the field's proto default is GPU."""

from __future__ import annotations

import pytest
import torch

from caffe_compat.proto import caffe_pb2
from caffe_compat.solver import Solver

NET = """name: "d"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 1 } }
layer { name: "loss" type: "Reduction" bottom: "ip" top: "loss" loss_weight: 1 }
"""


@pytest.mark.parametrize("mode", [None, "CPU"], ids=["unset", "CPU"])
def test_without_an_explicit_gpu_mode_the_solver_runs_on_the_cpu(tmp_path, monkeypatch, mode):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU would be there to take
    (tmp_path / "net.prototxt").write_text(NET)
    param = caffe_pb2.SolverParameter(net=str(tmp_path / "net.prototxt"), base_lr=0.1, lr_policy="fixed")
    if mode is not None:
        param.solver_mode = getattr(caffe_pb2.SolverParameter, mode)
    assert not param.HasField("solver_mode") or mode == "CPU"
    solver = Solver(param)
    assert solver.device == torch.device("cpu")
    assert all(p.device.type == "cpu" for p in solver.net.parameters())

"""The solver's ``weights`` (and ``caffe train -weights``) reach the TEST nets too, as Caffe's
``LoadNetWeights`` in ``Solver::InitTrainNet`` *and* ``InitTestNets``: a TEST-only layer starts from the
caffemodel, not from its fillers (``ShareTrainedLayersWith`` only replaces the layers the TRAIN net has).

Net: Input data (1×2) → ip (2 outputs, both phases) → TEST-only ip_test (1 output, constant-0 fillers)
→ score.  Weights: ip = [[1, 2], [3, 4]] + [0.5, -0.5], ip_test = [[10, 100]] + [7].  With data [1, 1]:
ip = [3.5, 6.5], score = 10·3.5 + 100·6.5 + 7 = 692 (0 at the fillers).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from caffe_compat.net import CaffeNet
from caffe_compat.solver import Solver
from caffe_compat.solver.train import train

NET = """name: "w"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 2 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 2 } }
layer { name: "loss" type: "Reduction" bottom: "ip" top: "loss" loss_weight: 1 include { phase: TRAIN } }
layer { name: "ip_test" type: "InnerProduct" bottom: "ip" top: "score" include { phase: TEST }
        inner_product_param { num_output: 1 } }
"""
SCORE = np.float32(10 * 3.5 + 100 * 6.5 + 7)  # 692


def _files(tmp_path, solver_weights: bool) -> str:
    (tmp_path / "net.prototxt").write_text(NET)
    full = CaffeNet(str(tmp_path / "net.prototxt"), phase="test")
    with torch.no_grad():
        full.params["ip"][0].copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
        full.params["ip"][1].copy_(torch.tensor([0.5, -0.5]))
        full.params["ip_test"][0].copy_(torch.tensor([[10.0, 100.0]]))
        full.params["ip_test"][1].copy_(torch.tensor([7.0]))
    full.save_caffemodel(tmp_path / "init.caffemodel")
    text = ('net: "net.prototxt"\ntest_iter: 1\ntest_interval: 100\nbase_lr: 0.1\nlr_policy: "fixed"\n'
            'max_iter: 1\nsolver_mode: CPU\nsnapshot_after_train: false\n')
    if solver_weights:
        text += f'weights: "{tmp_path / "init.caffemodel"}"\n'
    (tmp_path / "solver.prototxt").write_text(text)
    return str(tmp_path / "solver.prototxt")


def _score(solver) -> np.ndarray:
    solver.test_inputs[0]["data"] = np.ones((1, 2), np.float32)
    return solver.test(0)["score"]


@pytest.mark.filterwarnings("ignore::caffe_compat.errors.WeightsMismatchWarning")  # the TRAIN net lacks ip_test
@pytest.mark.parametrize("how", ["solver field", "weights argument", "train() on a built Solver"])
def test_weights_reach_test_only_layers(tmp_path, how):
    path = _files(tmp_path, solver_weights=how == "solver field")
    init = str(tmp_path / "init.caffemodel")
    solver = Solver(path, weights=init) if how == "weights argument" else Solver(path)
    if how == "train() on a built Solver":
        assert _score(solver).tolist() == [[0.0]]  # ip_test at its constant-0 fillers before the weights
        train(solver, iters=0, weights=init)
    np.testing.assert_array_equal(solver.test_nets[0].params["ip_test"][0].detach().numpy(), [[10.0, 100.0]])
    np.testing.assert_array_equal(solver.test_nets[0].params["ip_test"][1].detach().numpy(), [7.0])
    assert _score(solver).tolist() == [[SCORE]]

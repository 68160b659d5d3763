"""A net without learnable blobs trains, as in Caffe: ``SGDSolver::PreSolve`` makes no history,
``ApplyUpdate`` loops over no parameter (``ClipGradients`` sums nothing), snapshots hold no history.

Net: Input data (2×3) → Reduction SUMSQ as the loss; fed 2s, the loss is 6·4 = 24 at every iteration.
"""

from __future__ import annotations

import numpy as np
import pytest

from caffe_compat.proto import caffe_pb2
from caffe_compat.solver import Solver

NET = """name: "n"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 } } }
layer { name: "loss" type: "Reduction" bottom: "data" top: "loss" loss_weight: 1
        reduction_param { operation: SUMSQ } }
"""


@pytest.mark.parametrize("kind", ["SGD", "Nesterov", "AdaGrad", "RMSProp", "AdaDelta", "Adam"])
def test_a_net_without_learnable_blobs_trains_and_snapshots(tmp_path, kind):
    (tmp_path / "net.prototxt").write_text(NET)
    solver = Solver(caffe_pb2.SolverParameter(
        net=str(tmp_path / "net.prototxt"), base_lr=0.1, lr_policy="fixed", weight_decay=0.1,
        momentum=0.0 if kind in ("AdaGrad", "RMSProp") else 0.9,
        clip_gradients=1.0, type=kind, solver_mode=caffe_pb2.SolverParameter.CPU,
        snapshot_prefix=str(tmp_path / "run")))
    solver.feed(data=np.full((2, 3), 2, np.float32))
    assert solver.step(3) == 24.0 and solver.iter == 3
    solver.snapshot()
    state = caffe_pb2.SolverState()
    state.ParseFromString((tmp_path / "run_iter_3.solverstate").read_bytes())
    assert state.iter == 3 and len(state.history) == 0
    solver.restore(str(tmp_path / "run_iter_3.solverstate"))
    assert solver.iter == 3 and solver.step(1) == 24.0

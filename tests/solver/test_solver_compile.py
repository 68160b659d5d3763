"""``--compile``: the Solver with a torch.compile'd forward (``solver.forward_fn``) trains like eager."""

from __future__ import annotations

import numpy as np
import torch

from tests.solver.caffe_cases import feed, load_case, make_solver, param_arrays

CASE = "sgd_step_momentum"


def test_compiled_forward_steps_like_eager():
    """What ``train(compile=True)`` sets: ``forward_fn = torch.compile(solver.net)``.  A counting backend
    (dynamo traces the net, the graphs run as traced) keeps it fast on CPU and proves the compiled
    forward is the one that ran; the numbers are eager's and Caffe's."""
    _, reference = load_case(CASE)
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    eager, compiled = make_solver(CASE), make_solver(CASE)
    compiled.forward_fn = torch.compile(compiled.net, backend=counting_backend)
    for t in range(2):
        for solver in (eager, compiled):
            feed(solver, CASE, t)
            solver.step(1)
        assert compiled.last_loss == eager.last_loss
        np.testing.assert_allclose(compiled.last_loss, reference["loss_blob"][t], rtol=2e-6)
        assert float(compiled.outputs["loss"]) == float(eager.outputs["loss"])
    assert graphs, "the compiled forward was not used"
    ours, theirs = param_arrays(compiled), param_arrays(eager)
    for key, value in theirs.items():
        np.testing.assert_array_equal(ours[key], value, err_msg=key)

"""Iterations recorded as CUDA graphs (``caffe_compat.solver.step_graphs``).

On the CPU a stand-in backend runs each recorded function again at every replay: the orchestration (the
warm-up, the graphs' input tensors, the diffs written by the forward-backward graph, the update graph
recorded again when the lr policy changes a rate, a batch of another shape, a failed recording, the
refusals) is checked against eager training bit for bit on the Caffe solver fixtures.  On CUDA the real
graphs run the same trajectory (CUDA only)."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from caffe_compat.errors import CaffeCompatWarning
from caffe_compat.solver import Solver, SolverObserver
from caffe_compat.solver.step_graphs import WARMUP_ITERATIONS, StepGraphs, refusal
from tests.solver.caffe_cases import case_dir as solver_case_dir, feed, make_solver, param_arrays

ITERATIONS = 8  # lr_policy "step", stepsize 2: the rate changes at iterations 2, 4 and 6


class FailingUpdate:
    """A stand-in whose update graph cannot be recorded (the forward-backward graph can)."""

    def __new__(cls):
        backend = Rerun()
        record = backend.record

        def record_or_fail(fn, pool=None):
            if fn.__name__ == "apply_update":
                raise RuntimeError("operation not permitted when stream is capturing")
            return record(fn, pool)
        backend.record = record_or_fail
        return backend


class Rerun:
    """Stand-in backend: recording keeps the function, a replay runs it again (no CUDA needed).  As a CUDA
    graph holds the scalars of the Python code it was recorded from, a replay runs with the rates the
    optimizer had when the function was recorded (an update graph not recorded again after a rate change
    keeps its old rate)."""

    def __init__(self, fail: bool = False):
        self.records, self.replays, self.fail, self.optimizer = [], 0, fail, None

    def warm_up(self):
        return contextlib.nullcontext()

    def record(self, fn, pool=None):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.records.append(fn.__name__)
        return fn, [group["lr"] for group in self.optimizer.param_groups]

    @staticmethod
    def pool(graph):
        return None

    def replay(self, graph):
        fn, rates = graph
        self.replays += 1
        now = [group["lr"] for group in self.optimizer.param_groups]
        for group, rate in zip(self.optimizer.param_groups, rates):
            group["lr"] = rate
        try:
            return fn()
        finally:
            for group, rate in zip(self.optimizer.param_groups, now):
                group["lr"] = rate


def _train(case: str, graphs=None, iterations: int = ITERATIONS, batches=None):
    """Losses and weights after each iteration; ``batches(t)`` feeds iteration t (default: the case's)."""
    solver = make_solver(case)
    if graphs is not None:
        graphs.optimizer = solver.optimizer
        solver.step_graphs = StepGraphs(solver, backend=graphs)
    losses, weights, solver.rates = [], [], []
    for t in range(iterations):
        if batches is None:
            feed(solver, case, t)
        else:
            solver.inputs.update(batches(t))
        solver.step(1)
        losses.append(solver.last_loss)
        weights.append(param_arrays(solver))
        solver.rates.append(solver.last_lr)
    return solver, losses, weights


def _same(a, b) -> None:
    (_, losses_a, weights_a), (_, losses_b, weights_b) = a, b
    assert losses_a == losses_b
    for t, (wa, wb) in enumerate(zip(weights_a, weights_b)):
        assert wa.keys() == wb.keys()
        for name in wa:
            assert np.array_equal(wa[name], wb[name]), f"iteration {t}: {name}"


@pytest.mark.parametrize("case", ["sgd_step_momentum", "sgd_fappy_authors_setup", "nesterov"])
def test_replayed_iterations_equal_eager_training_bit_for_bit(case):
    backend = Rerun()
    graphed = _train(case, backend)
    _same(graphed, _train(case))
    # one forward-backward graph after the warm-up; the update recorded at its first replay and again at
    # each rate change of the lr policy (sgd: "step", stepsize 2)
    solver = graphed[0]
    rates = solver.rates[WARMUP_ITERATIONS:]
    updates = 1 + sum(a != b for a, b in zip(rates, rates[1:]))
    assert backend.records == ["forward_backward"] + ["apply_update"] * updates
    assert backend.replays == 2 * (ITERATIONS - WARMUP_ITERATIONS)
    assert solver.optimizer.iter == ITERATIONS and solver.step_graphs.recorded


def test_a_batch_of_another_shape_runs_eagerly_and_the_graphs_are_recorded_again():
    case = "sgd_step_momentum"
    solver = make_solver(case)
    shapes = {name: tuple(solver.inputs[name].shape) for name in ("data", "label")}

    def batches(t):
        n = shapes["data"][0] - (1 if t == 5 else 0)  # iteration 5: one sample fewer
        return {"data": np.random.RandomState(t).randn(n, *shapes["data"][1:]).astype(np.float32),
                "label": (np.arange(n) // 2).astype(np.float32).reshape(n, *shapes["label"][1:])}

    backend = Rerun()
    graphed = _train(case, backend, batches=batches)
    _same(graphed, _train(case, batches=batches))
    assert backend.records.count("forward_backward") == 2  # recorded at iteration 3, again at 6


def test_a_failed_recording_warns_once_and_training_goes_on_eagerly():
    case = "sgd_step_momentum"
    with pytest.warns(CaffeCompatWarning, match="recording the forward and backward failed"):
        graphed = _train(case, Rerun(fail=True))
    _same(graphed, _train(case))
    assert not graphed[0].step_graphs.active


def test_a_failed_update_recording_leaves_the_diffs_to_the_solver_again():
    """The forward-backward graph's diffs are not cleared between iterations; when the update cannot be
    recorded the graphs go, and the following eager iterations clear their diffs again (else they would
    accumulate onto the graph's)."""
    case = "sgd_step_momentum"
    with pytest.warns(CaffeCompatWarning, match="recording Caffe's update failed"):
        graphed = _train(case, FailingUpdate())
    _same(graphed, _train(case))
    assert not graphed[0].step_graphs.active and not graphed[0].step_graphs.recorded


def test_a_layer_whose_top_sizes_follow_the_values_is_refused_by_name(tmp_path):
    """Filter keeps as many rows as its selector has nonzeros, and a CUDA graph replays fixed sizes: the
    solver names the layer (the port's ``sizes_follow_values``) instead of a failed recording's error."""
    (tmp_path / "net.prototxt").write_text("""
    name: "filtered"
    layer { name: "input" type: "Input" top: "data" top: "sel" input_param { shape { dim: 4 dim: 3 } shape { dim: 4 } } }
    layer { name: "ip" type: "InnerProduct" bottom: "data" top: "emb"
      inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 0.5 } } }
    layer { name: "keep" type: "Filter" bottom: "emb" bottom: "sel" top: "kept" }
    layer { name: "loss" type: "Reduction" bottom: "kept" top: "loss" loss_weight: 1 }
    """)
    (tmp_path / "solver.prototxt").write_text(f'net: "{tmp_path / "net.prototxt"}"\nbase_lr: 0.1\nlr_policy: "fixed"\n'
                                              'solver_mode: CPU\n')
    solver = Solver(tmp_path / "solver.prototxt")
    assert refusal(solver, need_cuda=False) == (
        "layer 'keep' (Filter) makes tops whose sizes follow the values, a graph replays fixed sizes")


def test_what_a_graph_cannot_hold_is_refused_with_the_reason():
    solver = make_solver("sgd_step_momentum")
    assert refusal(solver) == "the device is cpu, CUDA graphs need a CUDA device"
    assert refusal(solver, need_cuda=False) is None
    assert "iter_size 2" in refusal(make_solver("sgd_iter_size2"), need_cuda=False)
    assert "clip_gradients" in refusal(make_solver("sgd_clip_gradients"), need_cuda=False)
    assert "Adam" in refusal(make_solver("adam"), need_cuda=False)
    solver.observers.append(SolverObserver(after_forward=lambda solver, net, blobs: None))
    assert "acts around each forward" in refusal(solver, need_cuda=False)
    # refused: the solver trains eagerly, as without graphs
    solver = make_solver("sgd_step_momentum")
    solver.step_graphs = StepGraphs(solver)
    assert not solver.step_graphs.active
    feed(solver, "sgd_step_momentum", 0)
    solver.step(1)
    assert not solver.step_graphs.recorded


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("case", ["sgd_step_momentum", "sgd_fappy_authors_setup"])
def test_cuda_graphs_train_the_eager_trajectory(case):
    """Real CUDA graphs: the eager CUDA run's losses and weights (the same kernels; cuDNN may pick other
    algorithms per run, so float32 agreement: each weight moved by at most a few ulps of its size per
    iteration)."""
    def run(graphs: bool):
        solver = make_solver(case, device="cuda")
        if graphs:
            solver.step_graphs = StepGraphs(solver)
            assert solver.step_graphs.active, solver.step_graphs.reason
        losses = []
        for t in range(ITERATIONS):
            feed(solver, case, t)
            solver.step(1)
            losses.append(solver.last_loss)
        return solver, losses, param_arrays(solver)

    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    graphed, eager = run(True), run(False)
    assert graphed[0].step_graphs.recorded
    np.testing.assert_allclose(graphed[1], eager[1], rtol=1e-5)
    for name, value in eager[2].items():
        np.testing.assert_allclose(graphed[2][name], value, rtol=1e-5, atol=1e-6 * float(np.abs(value).max()),
                                   err_msg=name)


def test_train_cuda_graphs_on_the_cpu_warns_and_trains_the_eager_weights(tmp_path, capsys):
    """``caffe-compat train --cuda-graphs`` off a GPU: the reason on stderr, the eager training's weights."""
    from caffe_compat.cli import main
    from caffe_compat.io import read_weights
    from tests.solver.test_distributed import FAPPY_CASE, _label_shuffling_solver

    init = str(solver_case_dir(FAPPY_CASE) / "init.caffemodel")
    assert main(["train", _label_shuffling_solver(tmp_path, "eager"), "--weights", init]) == 0
    assert main(["train", _label_shuffling_solver(tmp_path, "graphs"), "--weights", init, "--cuda-graphs"]) == 0
    out, err = capsys.readouterr()
    assert out.count("trained 2 iterations") == 2
    assert "cuda_graphs: the device is cpu, CUDA graphs need a CUDA device; the iterations run eagerly" in err
    eager = dict(read_weights(tmp_path / "eager" / "snap_iter_2.caffemodel"))
    graphs = dict(read_weights(tmp_path / "graphs" / "snap_iter_2.caffemodel"))
    assert eager.keys() == graphs.keys()
    for layer, blobs in eager.items():
        for a, b in zip(blobs, graphs[layer]):
            assert np.array_equal(np.array(a.values), np.array(b.values)), layer

"""Driving our Solver through the real-Caffe solver fixtures (tests/fixtures/solvers/<case>/).

Caffe was driven like pycaffe scripts drive it: for t = 0..4 the batch t is written into the input blobs,
then ``solver.step(1)``.  The MemoryData case (``sgd_iter_size2``) got every sub-batch up front through
``set_input_arrays``, in the order Caffe consumed them.
"""

from __future__ import annotations

import json

import numpy as np

from caffe_compat.solver import Solver
from tests.conftest import fixture_path

CASES_JSON = fixture_path("solvers/cases.json")
CASES = [c["name"] for c in json.loads(CASES_JSON.read_text())]


def case_dir(case: str):
    return fixture_path(f"solvers/{case}")


def load_case(case: str):
    d = case_dir(case)
    return np.load(d / "inputs.npz"), np.load(d / "trajectory.npz")


def make_solver(case: str, device: str = "cpu", **kwargs) -> Solver:
    d = case_dir(case)
    solver = Solver(d / "solver.prototxt", weights=d / "init.caffemodel", device=device, **kwargs)
    inputs, _ = load_case(case)
    if not solver.net.input_names:  # MemoryData: every sub-batch in consumption order
        data = inputs["data"].reshape(-1, *inputs["data"].shape[-3:])
        solver.net.layer("data").set_input_arrays(data, inputs["label"].reshape(-1))
    return solver


def feed(solver: Solver, case: str, t: int) -> None:
    """Write batch ``t`` (mod 5) into the solver's input blobs, the pycaffe way (no-op for MemoryData)."""
    if solver.net.input_names:
        inputs, _ = load_case(case)
        solver.inputs["data"][...] = inputs["data"][t % 5]
        solver.inputs["label"][...] = inputs["label"][t % 5]


def param_arrays(solver: Solver) -> dict[str, np.ndarray]:
    return {f"param:{layer}:{i}": blob.detach().cpu().numpy().copy()
            for layer, blobs in solver.net.params.items() for i, blob in enumerate(blobs)}

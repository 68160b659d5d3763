"""Caffe's lr policies: the fixtures' logged rates and hand-computed values of every formula."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from caffe_compat.errors import FormatError
from caffe_compat.io import read_solver
from caffe_compat.proto import caffe_pb2
from caffe_compat.solver import learning_rate
from tests.conftest import fixture_path


def solver_param(**fields) -> caffe_pb2.SolverParameter:
    p = caffe_pb2.SolverParameter()
    stepvalue = fields.pop("stepvalue", [])
    for k, v in fields.items():
        setattr(p, k, v)
    p.stepvalue.extend(stepvalue)
    return p


@pytest.mark.parametrize("case", [c["name"] for c in json.loads(fixture_path("solvers/cases.json").read_text())])
def test_fixture_rates(case):
    param = read_solver(fixture_path(f"solvers/{case}/solver.prototxt"))
    logged = np.load(fixture_path(f"solvers/{case}/trajectory.npz"))["lr"]
    step, rates = 0, []
    for it in range(5):
        rate, step = learning_rate(param, it, step)
        rates.append(f"{rate:.6g}")
    assert rates == [f"{float(r):.6g}" for r in logged]


def f32(x):
    return float(np.float32(x))


def test_step_and_current_step():
    p = solver_param(lr_policy="step", base_lr=0.01, gamma=0.7, stepsize=2)
    assert learning_rate(p, 4) == (f32(f32(0.01) * f32(0.7) ** 2), 2)
    assert learning_rate(p, 5, 2) == (f32(f32(0.01) * f32(0.7) ** 2), 2)
    assert learning_rate(p, 6)[1] == 3


def test_exp_inv_poly_sigmoid_by_hand():
    base, gamma, power = f32(0.1), f32(0.99), f32(0.75)
    p = solver_param(lr_policy="exp", base_lr=0.1, gamma=0.99)
    assert learning_rate(p, 10)[0] == f32(base * gamma ** 10)
    p = solver_param(lr_policy="inv", base_lr=0.1, gamma=0.0001, power=0.75)
    assert learning_rate(p, 1000)[0] == pytest.approx(base * (1 + f32(0.0001) * 1000) ** -power, rel=1e-7)
    p = solver_param(lr_policy="poly", base_lr=0.1, power=2.0, max_iter=100)
    assert learning_rate(p, 25)[0] == f32(base * 0.75 ** 2)
    p = solver_param(lr_policy="sigmoid", base_lr=0.1, gamma=0.5, stepsize=10)
    assert learning_rate(p, 12)[0] == pytest.approx(base / (1 + math.exp(-0.5 * 2)), rel=1e-7)
    assert learning_rate(p, 10)[0] == f32(base / 2)


@pytest.mark.parametrize("fields, it, caffe_rate", [
    # LeNet's solver: powf((float)(1 + gamma*it), -power), then a float product with base_lr
    (dict(lr_policy="inv", base_lr=0.01, gamma=0.0001, power=0.75), 21, 0.009984278120100498),
    (dict(lr_policy="inv", base_lr=0.01, gamma=0.0001, power=0.75), 38, 0.00997159443795681),
    # powf((float)(1 - it/max_iter), power), a float product
    (dict(lr_policy="poly", base_lr=0.01, power=0.9, max_iter=10000), 1, 0.009999100118875504),
    # expf of the float -gamma*(it - stepsize); 1 + e, 1/(...) and base_lr*(...) each rounded to float
    (dict(lr_policy="sigmoid", base_lr=0.01, gamma=0.05, stepsize=300), 0, 3.0590223687454454e-09),
])
def test_inv_poly_sigmoid_round_as_caffes_float_build(fields, it, caffe_rate):
    # Caffe's float build calls powf/expf (mkl_alternate.hpp includes <math.h>: std::pow(float, float) and
    # std::exp(float) in the global namespace); the rates of Caffe's expressions compiled with GCC 12 / glibc
    # 2.36 (the reference build's); the double pow/exp rounded once gives the neighbouring float
    assert learning_rate(solver_param(**fields), it)[0] == caffe_rate


def test_overflow_and_domain_errors_are_cs_inf_and_nan():
    # sigmoid long before stepsize: expf(1000) overflows to inf in Caffe, so the rate is 0 (math.exp raised)
    p = solver_param(lr_policy="sigmoid", base_lr=0.1, gamma=0.1, stepsize=10000)
    assert learning_rate(p, 0)[0] == 0.0
    # poly past max_iter (pycaffe's step() does not stop there): powf(-0.5, 0.9) is NaN (math.pow raised)
    p = solver_param(lr_policy="poly", base_lr=0.1, power=0.9, max_iter=100)
    assert math.isnan(learning_rate(p, 150)[0])
    # exp with gamma > 1: pow overflows to inf
    p = solver_param(lr_policy="exp", base_lr=0.1, gamma=2.0)
    assert learning_rate(p, 2000)[0] == math.inf


def test_multistep_advances_one_step_per_call():
    p = solver_param(lr_policy="multistep", base_lr=1.0, gamma=0.5, stepvalue=[2, 3, 10])
    step, rates = 0, []
    for it in range(5):
        rate, step = learning_rate(p, it, step)
        rates.append(rate)
    assert rates == [1.0, 1.0, 0.5, 0.25, 0.25] and step == 2
    # Caffe's ``if`` (not ``while``): jumping to iteration 12 from step 0 advances a single step per call
    assert learning_rate(p, 12, 0) == (0.5, 1)
    assert learning_rate(p, 12, 1) == (0.25, 2)


def test_multistep_logs_each_advance_as_caffe(caplog):
    # Caffe's GetLearningRate logs ``MultiStep Status: Iteration <iter>, step = <current_step>`` when it advances
    p = solver_param(lr_policy="multistep", base_lr=1.0, gamma=0.5, stepvalue=[2, 3])
    step = 0
    with caplog.at_level("INFO", logger="caffe_compat.solver"):
        for it in range(5):
            _, step = learning_rate(p, it, step)
    assert [r.getMessage() for r in caplog.records if "MultiStep" in r.getMessage()] == [
        "MultiStep Status: Iteration 2, step = 1", "MultiStep Status: Iteration 3, step = 2"]


def test_fixed():
    assert learning_rate(solver_param(lr_policy="fixed", base_lr=0.05), 123) == (f32(0.05), 0)


@pytest.mark.parametrize("fields, message", [
    (dict(lr_policy="cosine", base_lr=0.1), "unknown lr_policy"),
    (dict(lr_policy="step", base_lr=0.1, gamma=0.1), "stepsize"),
    (dict(lr_policy="exp", base_lr=0.1, gamma=-1.0), "gamma"),
    (dict(lr_policy="poly", base_lr=0.1, power=1.0), "max_iter"),
    # Caffe's CHECK_GE(gamma, 0) and CHECK_GT(stepsize, 0) of sigmoid, CHECK_GE(gamma, 0) of multistep
    (dict(lr_policy="sigmoid", base_lr=0.1, gamma=-0.5, stepsize=10), "gamma"),
    (dict(lr_policy="sigmoid", base_lr=0.1, gamma=0.5), "stepsize"),
    (dict(lr_policy="multistep", base_lr=0.1, gamma=-0.1, stepvalue=[2]), "gamma"),
])
def test_bad_settings_raise(fields, message):
    with pytest.raises(FormatError, match=message):
        learning_rate(solver_param(**fields), 3)

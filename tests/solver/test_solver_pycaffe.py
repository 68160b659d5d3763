"""Old pycaffe solver scripts, unchanged, on ``import caffe_compat as caffe``: the top-level solver names,
and ``solver.net`` / ``solver.test_nets[i]``, pycaffe ``Net`` s (``copy_from``, ``blobs``,
``set_input_arrays``, ``forward``) over the CaffeNets the core trains (``net.torch_net``).  Checked against
the real-Caffe fixtures."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import caffe_compat as caffe
import caffe_compat.pycaffe as pycaffe_module
import caffe_compat.solver as solver_module
from caffe_compat.errors import CaffeCompatError
from caffe_compat.net import CaffeNet
from caffe_compat.solver import AdaDelta, AdaGrad, RMSProp
from tests.solver.caffe_cases import case_dir, load_case
from tests.solver.test_solver_fixtures import assert_close_params, assert_six_digits

SOLVER_NAMES = ["get_solver", "SGDSolver", "NesterovSolver", "AdaGradSolver", "RMSPropSolver", "AdaDeltaSolver",
                "AdamSolver"]


# ------------------------------------------------------------------------------------------ top-level names

@pytest.mark.parametrize("name", SOLVER_NAMES)
def test_top_level_solver_names(name):
    assert getattr(caffe, name) is getattr(pycaffe_module, name)
    assert name in caffe.__all__


def _first_step_of(kind: str, g: np.ndarray, lr: float, momentum: float, delta: float, rms_decay: float):
    """Caffe's first update (zero history) of each rule for the regularised gradient ``g`` (float64)."""
    if kind == "AdaGrad":
        return lr * g / (np.sqrt(g * g) + delta)
    if kind == "RMSProp":
        return lr * g / (np.sqrt((1 - rms_decay) * g * g) + delta)
    return lr * g * np.sqrt(delta / ((1 - momentum) * g * g + delta))  # AdaDelta, momentum = rho


@pytest.mark.parametrize("kind,rule,momentum", [("AdaGrad", AdaGrad, 0.0), ("RMSProp", RMSProp, 0.0),
                                                ("AdaDelta", AdaDelta, 0.95)])
def test_forced_rule_solvers_take_the_first_step_of_their_rule(kind, rule, momentum, tmp_path):
    """``caffe.<Rule>Solver(path)`` runs that rule whatever the file's ``type`` (here "SGD").  The
    gradient comes from Caffe: the fixture's first SGD step is ``w0 - w1 = lr_local · g`` (zero history)."""
    case = "sgd_step_momentum"
    d = case_dir(case)
    text = (d / "solver.prototxt").read_text().replace('net: "net.prototxt"', f'net: "{d / "net.prototxt"}"')
    text = "\n".join(line for line in text.splitlines() if not line.startswith(("momentum:", "snapshot_prefix:")))
    path = tmp_path / "solver.prototxt"
    path.write_text(text + f"\nmomentum: {momentum}\nsnapshot_prefix: \"{tmp_path / 'snap'}\"\n")
    solver = getattr(caffe, f"{kind}Solver")(str(path))
    assert solver.param.type == kind and type(solver.optimizer) is rule
    inputs, reference = load_case(case)
    solver.net.copy_from(d / "init.caffemodel")
    solver.net.blobs["data"].data[...] = inputs["data"][0]
    solver.net.blobs["label"].data[...] = inputs["label"][0]
    solver.step(1)
    p = solver.param
    checked = 0
    for layer, blobs in solver.net.torch_net.params.items():
        for i, blob in enumerate(blobs):
            key = f"param:{layer}:{i}"
            w0, w1 = reference[key][0].astype(np.float64), reference[key][1].astype(np.float64)
            lr = float(p.base_lr) * blob.lr_mult
            g = (w0 - w1) / lr
            well_determined = np.abs(w0 - w1) > 1e-4 * np.abs(w0).max()  # float32 rounding of g < 1e-3
            expected = _first_step_of(kind, g, lr, momentum, float(p.delta), float(p.rms_decay))
            ours = w0 - blob.detach().numpy().astype(np.float64)
            np.testing.assert_allclose(ours[well_determined], expected[well_determined], rtol=2e-3, err_msg=key)
            checked += int(well_determined.sum())
    assert checked > 100


# ------------------------------------------------------------------------------------------ solver classes

KINDS = ["SGD", "Nesterov", "AdaGrad", "RMSProp", "AdaDelta", "Adam"]
LEGACY = {"SGD": "SGD", "Nesterov": "NESTEROV", "AdaGrad": "ADAGRAD", "RMSProp": "RMSPROP", "AdaDelta": "ADADELTA",
          "Adam": "ADAM"}  # the deprecated solver_type enum's names


def _typed_solver_file(tmp_path, type_line: str) -> str:
    """A solver over the sgd_step_momentum net whose rule is set by ``type_line``."""
    path = tmp_path / "solver.prototxt"
    path.write_text(f'net: "{case_dir("sgd_step_momentum") / "net.prototxt"}"\nbase_lr: 0.01\nlr_policy: "fixed"\n'
                    f'snapshot_prefix: "{tmp_path / "snap"}"\n{type_line}\n')
    return str(path)


def _assert_solver_of_class(solver, kind: str) -> None:
    """``solver`` is pycaffe's ``<kind>Solver`` (and a ``caffe.Solver``), of no other solver class, and runs
    the ``kind`` rule."""
    cls = getattr(pycaffe_module, f"{kind}Solver")
    assert type(solver) is cls and type(solver).__name__ == f"{kind}Solver"
    assert isinstance(solver, cls) and isinstance(solver, pycaffe_module.Solver)
    assert isinstance(solver, solver_module.Solver)  # still a core solver
    assert [k for k in KINDS if isinstance(solver, getattr(pycaffe_module, f"{k}Solver"))] == [kind]
    assert solver.param.type == kind and type(solver.optimizer) is solver_module.UPDATE_RULES[kind]


def test_solver_classes_derive_from_the_pycaffe_base():
    """As pycaffe's bindings declare them: six classes, each with the base ``caffe.Solver`` only (a
    NesterovSolver is no SGDSolver); ``PycaffeSolver`` is the base's other name."""
    base = pycaffe_module.Solver
    assert pycaffe_module.PycaffeSolver is base and "Solver" in pycaffe_module.__all__
    assert issubclass(base, solver_module.Solver)
    for kind in KINDS:
        cls = getattr(pycaffe_module, f"{kind}Solver")
        assert isinstance(cls, type) and issubclass(cls, base) and cls.__name__ == f"{kind}Solver"
        assert [k for k in KINDS if issubclass(cls, getattr(pycaffe_module, f"{k}Solver"))] == [kind]


@pytest.mark.parametrize("kind", KINDS)
def test_get_solver_gives_the_class_of_the_file_type(kind, tmp_path):
    """``caffe.get_solver(path)`` is an instance of the class of the file's ``type`` (Caffe's registry makes
    that solver; pycaffe wraps it as its class)."""
    _assert_solver_of_class(pycaffe_module.get_solver(_typed_solver_file(tmp_path, f'type: "{kind}"')), kind)


@pytest.mark.parametrize("kind", KINDS)
def test_get_solver_gives_the_class_of_a_legacy_solver_type(kind, tmp_path):
    """The deprecated ``solver_type`` enum is upgraded to ``type`` first, as Caffe's ``UpgradeSolverType``."""
    path = _typed_solver_file(tmp_path, f"solver_type: {LEGACY[kind]}")
    _assert_solver_of_class(pycaffe_module.get_solver(path), kind)


@pytest.mark.parametrize("kind", KINDS)
def test_rule_solver_class_forces_its_rule_on_an_sgd_file(kind, tmp_path):
    """``caffe.<Rule>Solver(path)`` is a ``<Rule>Solver`` running that rule whatever the file's type."""
    solver = getattr(pycaffe_module, f"{kind}Solver")(_typed_solver_file(tmp_path, 'type: "SGD"'))
    _assert_solver_of_class(solver, kind)


def test_the_base_built_directly_runs_the_file_type(tmp_path):
    """``caffe.Solver(path)`` (pycaffe's cannot be built; here it is the old ``PycaffeSolver(path)``): the rule
    of the file's type, as an instance of the base and of no rule class."""
    solver = pycaffe_module.Solver(_typed_solver_file(tmp_path, 'type: "Adam"'))
    assert type(solver) is pycaffe_module.Solver and solver.param.type == "Adam"
    assert not any(isinstance(solver, getattr(pycaffe_module, f"{k}Solver")) for k in KINDS)


# ------------------------------------------------------------------------------------------ solver.net

def _pycaffe_params(solver) -> dict[str, np.ndarray]:
    """``{k: v[i].data}`` as a pycaffe script reads the weights (numpy arrays, as pycaffe's)."""
    return {f"param:{layer}:{i}": blob.data.copy() for layer, blobs in solver.net.params.items()
            for i, blob in enumerate(blobs)}


def _check_against_caffe(case, trajectory, losses, logged, rates):
    _, reference = load_case(case)
    assert list(trajectory[0]) == [str(n) for n in reference["__param_order__"]]
    for key, value in trajectory[0].items():  # copy_from loaded Caffe's initial weights exactly
        np.testing.assert_array_equal(value, reference[key][0])
    for t in range(1, 6):
        for key, value in trajectory[t].items():
            assert_close_params(value, reference[key][t], f"{case} {key} after {t} iterations")
    np.testing.assert_allclose(losses, reference["loss_blob"], rtol=2e-6, atol=0)
    for t in range(5):
        assert_six_digits(logged[t], float(reference["loss_logged"][t]), f"{case} logged loss {t}")
        assert f"{rates[t]:.6g}" == f"{float(reference['lr'][t]):.6g}"


def test_fixture_trajectory_driven_the_pycaffe_way():
    case = "sgd_step_momentum"
    d = case_dir(case)
    inputs, _ = load_case(case)
    solver = caffe.SGDSolver(str(d / "solver.prototxt"))
    solver.net.copy_from(str(d / "init.caffemodel"))
    trajectory, losses, logged, rates = [_pycaffe_params(solver)], [], [], []
    for t in range(5):
        solver.net.blobs["data"].data[...] = inputs["data"][t]
        solver.net.blobs["label"].data[...] = inputs["label"][t]
        solver.step(1)
        trajectory.append(_pycaffe_params(solver))
        losses.append(float(solver.net.blobs["loss"].data))
        logged.append(solver.smoothed_loss)
        rates.append(solver.last_lr)
    _check_against_caffe(case, trajectory, losses, logged, rates)
    # the blob arrays are the solver's input arrays: both ways of feeding are one
    assert solver.net.blobs["data"].data is solver.inputs["data"]
    np.testing.assert_array_equal(solver.net.blobs["data"].data, inputs["data"][4])
    assert solver.net.blobs["ip1"].data.shape == (4, 5)


def test_memorydata_fixture_driven_through_set_input_arrays():
    case = "sgd_iter_size2"
    d = case_dir(case)
    inputs, _ = load_case(case)
    solver = caffe.SGDSolver(str(d / "solver.prototxt"))
    solver.net.copy_from(str(d / "init.caffemodel"))
    data = np.ascontiguousarray(inputs["data"].reshape(-1, *inputs["data"].shape[-3:]), dtype=np.float32)
    labels = np.ascontiguousarray(inputs["label"].reshape(-1), dtype=np.float32)
    solver.net.set_input_arrays(data, labels)
    trajectory, losses, logged, rates = [_pycaffe_params(solver)], [], [], []
    for t in range(5):
        solver.step(1)
        trajectory.append(_pycaffe_params(solver))
        losses.append(float(solver.net.blobs["loss"].data))
        logged.append(solver.smoothed_loss)
        rates.append(solver.last_lr)
        # after a step the blobs hold the last forward's values: the step's second sub-batch
        np.testing.assert_array_equal(solver.net.blobs["data"].data, data[4 * (2 * t + 1):4 * (2 * t + 2)])
    _check_against_caffe(case, trajectory, losses, logged, rates)


def test_test_net_the_pycaffe_way(tmp_path):
    """``solver.test_nets[0]``: fed through its blobs, read after ``solver.test`` and after its own
    ``forward()``.  The net has no phase-dependent layer, so its loss on batch 0 with the initial weights is
    Caffe's first training loss."""
    case = "sgd_step_momentum"
    d = case_dir(case)
    inputs, reference = load_case(case)
    path = tmp_path / "solver.prototxt"
    path.write_text(f'net: "{d / "net.prototxt"}"\ntest_iter: 1\ntest_interval: 1000\nbase_lr: 0.01\n'
                    f'lr_policy: "fixed"\nsnapshot_prefix: "{tmp_path / "snap"}"\n')
    solver = caffe.SGDSolver(str(path))
    solver.net.copy_from(d / "init.caffemodel")
    test_net = solver.test_nets[0]
    assert isinstance(test_net.torch_net, CaffeNet) and test_net.torch_net.phase == "test"
    test_net.blobs["data"].data[...] = inputs["data"][0]
    test_net.blobs["label"].data[...] = inputs["label"][0]
    assert test_net.blobs["data"].data is solver.test_inputs[0]["data"]
    scores = solver.test(0)  # Caffe's Test: the TEST net takes the TRAIN net's weights
    np.testing.assert_allclose(float(scores["loss"]), reference["loss_blob"][0], rtol=2e-6)
    assert float(test_net.blobs["loss"].data) == float(scores["loss"])
    out = test_net.forward()  # pycaffe's forward(): reads the input blobs
    assert float(out["loss"]) == float(scores["loss"])
    test_net.blobs["data"].data[...] = inputs["data"][1]
    test_net.blobs["label"].data[...] = inputs["label"][1]
    test_net.forward()  # the blobs follow the new feed
    assert float(test_net.blobs["loss"].data) != float(scores["loss"])
    np.testing.assert_array_equal(test_net.blobs["data"].data, inputs["data"][1])


def test_solver_net_is_a_pycaffe_net_over_the_trained_caffenet():
    """As in pycaffe, ``solver.net`` is a ``caffe.Net`` (numpy params, ``layers[i]``); the CaffeNet the core
    trains is its ``torch_net``, whose parameters are the very tensors the numpy views show."""
    case = "sgd_step_momentum"
    solver = caffe.SGDSolver(str(case_dir(case) / "solver.prototxt"))
    net, core = solver.net, solver.net.torch_net
    assert isinstance(net, caffe.Net) and isinstance(core, CaffeNet) and core.phase == "train"
    assert net.phase == caffe.TRAIN and solver.test_nets == []  # this solver file has no test net
    assert isinstance(core.params["conv1"][0], torch.nn.Parameter)  # CaffeNet's params: torch tensors
    assert np.shares_memory(net.params["conv1"][0].data, core.params["conv1"][0].detach().numpy())
    assert isinstance(core.layers, torch.nn.ModuleDict) and core.layer("ip1") is core.layers["ip1"]
    assert [layer.type for layer in net.layers] == [s.type for s in core.steps] and net.layers[2].name == "conv1"
    assert net.inputs == core.input_names == ["data", "label"] and net.outputs == ["loss"]
    assert list(net.blobs) == list(net.blob_shapes)
    assert net.top_names["conv1"] == ["conv1"] and net.bottom_names["loss"] == ["ip1", "label"]


def test_solver_net_blobs_can_be_turned_off():
    case = "sgd_step_momentum"
    inputs, reference = load_case(case)
    solver = caffe.SGDSolver(str(case_dir(case) / "solver.prototxt"))
    solver.net.copy_from(case_dir(case) / "init.caffemodel")
    solver.net.keep_blobs = False  # no activation kept between iterations
    solver.feed(data=inputs["data"][0], label=inputs["label"][0])
    solver.step(1)
    assert solver.net._last_blobs == {}
    assert float(solver.net.blobs["loss"].data) == 0.0  # nothing recorded: a fresh (zero) blob
    solver.net.keep_blobs = True
    solver.feed(data=inputs["data"][1], label=inputs["label"][1])
    solver.step(1)
    assert float(solver.net.blobs["loss"].data) == pytest.approx(float(reference["loss_blob"][1]), rel=2e-6)


def test_solver_net_blob_diffs_errors_and_reshape():
    solver = caffe.SGDSolver(str(case_dir("sgd_step_momentum") / "solver.prototxt"))
    blobs = solver.net.blobs
    assert blobs["ip1"].diff.shape == (4, 5) and not blobs["ip1"].diff.any()  # Caffe's diffs exist from the start
    with pytest.raises(CaffeCompatError, match="MemoryData"):
        solver.net.set_input_arrays(np.zeros((4, 3, 10, 10), np.float32), np.zeros(4, np.float32))
    blobs["data"].reshape(2, 3, 10, 10)
    blobs["label"].reshape(2)
    assert solver.inputs["data"].shape == (2, 3, 10, 10) and blobs["data"].num == 2
    assert blobs["ip1"].shape == (2, 5)  # pycaffe's reshape of an input re-infers every shape at once
    solver.step(1)  # the next step runs on the new batch size
    assert solver.net.blobs["ip1"].data.shape == (2, 5) and solver.net.blobs["ip1"].diff.any()


# ------------------------------------------------------------------------------------------ core vs facade

def test_core_solver_trains_plain_caffenets_and_keeps_no_blobs():
    """The core Solver builds plain CaffeNets, owns its input arrays and keeps no blob past a step; the
    blob views are the pycaffe facade's (its nets are SolverNets reading the solver's arrays)."""
    case = "sgd_step_momentum"
    inputs, reference = load_case(case)
    path = str(case_dir(case) / "solver.prototxt")
    core = solver_module.Solver(path, weights=str(case_dir(case) / "init.caffemodel"))
    assert type(core.net) is CaffeNet and not hasattr(core.net, "blobs") and core.observers == []
    assert set(core.inputs) == {"data", "label"} and core.inputs["data"].dtype == np.float32
    core.feed(data=inputs["data"][0], label=inputs["label"][0])
    core.step(1)
    np.testing.assert_allclose(core.last_loss, reference["loss_blob"][0], rtol=2e-6)
    assert not hasattr(core.net, "_last_blobs")
    facade = caffe.SGDSolver(path)
    assert isinstance(facade, solver_module.Solver) and isinstance(facade.net, pycaffe_module.SolverNet)
    assert facade.net.input_arrays is facade.inputs
    facade.inputs = {"data": inputs["data"][1], "label": inputs["label"][1]}  # a new dict: the view follows
    assert facade.net.input_arrays is facade.inputs and facade.net.blobs["data"].data is facade.inputs["data"]


def test_compiled_forward_still_fills_the_blob_views():
    """``forward_fn = torch.compile(solver.net)`` runs none of the view's Python: the solver's forward watcher
    records the blobs (counting backend: the compiled forward is the one that ran)."""
    case = "sgd_step_momentum"
    inputs, reference = load_case(case)
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    solver = caffe.SGDSolver(str(case_dir(case) / "solver.prototxt"))
    solver.net.copy_from(case_dir(case) / "init.caffemodel")
    solver.forward_fn = torch.compile(solver.net, backend=counting_backend)
    for t in range(2):
        solver.net.blobs["data"].data[...] = inputs["data"][t]
        solver.net.blobs["label"].data[...] = inputs["label"][t]
        solver.step(1)
        assert float(solver.net.blobs["loss"].data) == float(solver.outputs["loss"])
        np.testing.assert_allclose(float(solver.net.blobs["loss"].data), reference["loss_blob"][t], rtol=2e-6)
    assert graphs and solver.net.blobs["ip1"].data.shape == (4, 5)


def test_the_core_never_imports_the_facade():
    """The facade sits on the core: importing the nets and the solvers loads no ``caffe_compat.pycaffe``."""
    import subprocess
    import sys

    code = ("import sys, caffe_compat.net, caffe_compat.solver, caffe_compat.solver.train; "
            "print([m for m in sys.modules if m.startswith('caffe_compat.pycaffe')])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_the_opencl_branch_spellings_get_solver_from_file_and_solver_parameter(tmp_path):
    """Caffe's OpenCL-branch pycaffe (its own test_solver.py calls caffe.get_solver_from_file) exports
    get_solver_from_file(path) and the SolverParameter/NetParameter/NetState messages at the top level; its
    get_solver takes a SolverParameter: the class of the message's type, as from a file."""
    from google.protobuf import text_format

    from caffe_compat.proto import caffe_pb2

    assert pycaffe_module.SolverParameter is caffe_pb2.SolverParameter and caffe.NetState is caffe_pb2.NetState
    assert pycaffe_module.NetParameter is caffe_pb2.NetParameter
    assert caffe.get_solver_from_file is pycaffe_module.get_solver_from_file
    path = _typed_solver_file(tmp_path, 'type: "Adam"')
    _assert_solver_of_class(pycaffe_module.get_solver_from_file(path), "Adam")
    param = text_format.Parse(open(path).read(), pycaffe_module.SolverParameter())
    param.type = "RMSProp"
    _assert_solver_of_class(pycaffe_module.get_solver(param), "RMSProp")

"""Solver behaviour beyond the 5-iteration fixtures: divergence, atomic snapshots, TEST nets, solve(),
paths relative to the solver file, pycaffe aliases and errors."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch

import caffe_compat.io.atomic as atomic
from caffe_compat.errors import FormatError, ShapeMismatchError, TrainingDiverged, WeightsMismatchWarning, WriteError
from caffe_compat.io import read_net, read_solver, read_solverstate, blob_to_array
from caffe_compat.net import CaffeNet
from caffe_compat.proto import caffe_pb2
from caffe_compat.pycaffe import AdamSolver, SGDSolver, get_solver
from caffe_compat.solver import SGD, Solver
from tests.solver.caffe_cases import case_dir, feed, load_case, make_solver, param_arrays

CASE = "sgd_step_momentum"


def test_divergence_stops_with_the_iteration_and_keeps_the_last_good_state(tmp_path):
    solver = make_solver(CASE, snapshot_prefix=str(tmp_path / "div"))
    solver.param.base_lr, solver.param.lr_policy, solver.param.snapshot = 1e12, "fixed", 1
    before = None
    with pytest.raises(TrainingDiverged, match="at iteration 2"):
        for t in range(10):
            feed(solver, CASE, t)
            before = param_arrays(solver)
            solver.step(1)
    assert solver.iter == 2
    for key, value in param_arrays(solver).items():  # the diverging update was not applied
        np.testing.assert_array_equal(value, before[key])
        assert np.isfinite(value).all()
    assert sorted(os.listdir(tmp_path)) == ["div_iter_1.caffemodel", "div_iter_1.solverstate",
                                            "div_iter_2.caffemodel", "div_iter_2.solverstate"]
    saved = {f"param:{l.name}:{i}": blob_to_array(b) for l in read_net(tmp_path / "div_iter_2.caffemodel").layer
             for i, b in enumerate(l.blobs)}
    for key, value in saved.items():
        np.testing.assert_array_equal(value, before[key])


def test_nan_input_diverges_at_that_iteration():
    """MAX pooling drops the NaN as Caffe's does (the loss stays finite), but conv1's weight diff takes
    0 · NaN from it: the diff check stops the iteration before its update."""
    solver = make_solver(CASE)
    feed(solver, CASE, 0)
    solver.step(1)
    solver.inputs["data"][0, 0, 0, 0] = np.nan
    before = param_arrays(solver)
    with pytest.raises(TrainingDiverged, match="diff of layer 'conv1' blob 0 holds NaN or inf at iteration 1"):
        solver.step(1)
    assert np.isfinite(solver.last_loss)
    for key, value in param_arrays(solver).items():
        np.testing.assert_array_equal(value, before[key])


def _fail_fsync(fd):
    raise OSError("simulated crash: disk full")


def test_snapshot_is_atomic(tmp_path, monkeypatch):
    solver = make_solver(CASE, snapshot_prefix=str(tmp_path / "snap"))
    for t in range(2):
        feed(solver, CASE, t)
        solver.step(1)
    model_path, state_path = solver.snapshot()
    good_model, good_state = open(model_path, "rb").read(), open(state_path, "rb").read()
    feed(solver, CASE, 2)
    solver.step(1)
    # a crash while writing the next snapshot: nothing under the new names, the previous pair intact
    monkeypatch.setattr(atomic.os, "fsync", _fail_fsync)
    with pytest.raises(OSError, match="simulated crash"):
        solver.snapshot()
    assert sorted(os.listdir(tmp_path)) == ["snap_iter_2.caffemodel", "snap_iter_2.solverstate"]
    # a crash while overwriting the same names (a resumed run snapshotting again at iteration 2)
    solver.iter = 2
    with pytest.raises(OSError, match="simulated crash"):
        solver.snapshot()
    assert open(model_path, "rb").read() == good_model and open(state_path, "rb").read() == good_state
    assert sorted(os.listdir(tmp_path)) == ["snap_iter_2.caffemodel", "snap_iter_2.solverstate"]
    monkeypatch.undo()
    resumed = make_solver(CASE)
    resumed.restore(state_path)  # the surviving snapshot is readable and complete
    state = read_solverstate(state_path)
    assert resumed.iter == state.iter == 2 and resumed.current_step == state.current_step == 0  # lr at iter 1: 1 // 2
    assert len(state.history) == 4


def _solver_file(tmp_path, extra: str) -> str:
    shutil.copy(case_dir(CASE) / "net.prototxt", tmp_path / "net.prototxt")
    path = tmp_path / "solver.prototxt"
    path.write_text('net: "net.prototxt"\nbase_lr: 0.01\nlr_policy: "fixed"\nmomentum: 0.9\nrandom_seed: 3\n'
                    'solver_mode: CPU\n' + extra)
    return str(path)


def test_solve_tests_and_snapshots_with_paths_relative_to_the_solver(tmp_path, monkeypatch):
    path = _solver_file(tmp_path, 'test_iter: 2\ntest_interval: 2\nmax_iter: 3\nsnapshot_prefix: "out/run"\n'
                                  'test_initialization: false\n')
    work = tmp_path / "elsewhere"
    work.mkdir()
    monkeypatch.chdir(work)  # Caffe's cwd: the net is not here, the solver's folder has it
    solver = Solver(path, weights=case_dir(CASE) / "init.caffemodel")
    assert len(solver.test_nets) == 1 and solver.test_nets[0].phase == "test"
    inputs, _ = load_case(CASE)
    solver.test_inputs[0]["data"][...] = inputs["data"][4]
    solver.test_inputs[0]["label"][...] = inputs["label"][4]
    solver.feed(data=inputs["data"][0], label=inputs["label"][0])
    solver.solve()
    assert solver.iter == 3
    # snapshot_prefix is relative to the working directory, as in Caffe
    assert sorted(os.listdir(work / "out")) == ["run_iter_3.caffemodel", "run_iter_3.solverstate"]
    # the test at iteration 2 ran with the weights after 2 updates; check the final test by hand
    scores = solver.test_all()[0]
    reference = CaffeNet(str(tmp_path / "net.prototxt"), phase="test", weights=str(work / "out/run_iter_3.caffemodel"))
    with torch.no_grad():
        loss = reference(data=torch.tensor(inputs["data"][4]), label=torch.tensor(inputs["label"][4]))["loss"]
    assert float(scores["loss"]) == pytest.approx(float(loss), rel=1e-6)


def test_test_compute_loss_logs_the_mean_test_objective(tmp_path, caplog):
    """Caffe's Solver::Test with ``test_compute_loss``: each forward's loss (Σ loss_weight · loss) summed in
    float, divided by test_iter and logged as ``Test loss: <mean>`` before the ``Test net output`` lines."""
    path = _solver_file(tmp_path, "test_iter: 2\ntest_interval: 100\ntest_compute_loss: true\n")
    solver = Solver(path, weights=case_dir(CASE) / "init.caffemodel")
    inputs, _ = load_case(CASE)
    solver.test_data_sources[0] = iter([{"data": inputs["data"][t], "label": inputs["label"][t]} for t in (3, 4)])
    reference = CaffeNet(str(tmp_path / "net.prototxt"), phase="test", weights=str(case_dir(CASE) / "init.caffemodel"))
    with torch.no_grad():
        losses = [np.float32(float(reference(data=torch.tensor(inputs["data"][t]),
                                             label=torch.tensor(inputs["label"][t]))["loss"])) for t in (3, 4)]
    assert abs(losses[0] - losses[1]) > 1e-3
    with caplog.at_level("INFO", logger="caffe_compat.solver"):
        solver.test(0)
    lines = [r.getMessage() for r in caplog.records]
    assert [line for line in lines if line.startswith("Test loss")] == [
        f"Test loss: {float(np.float32(losses[0] + losses[1]) / np.float32(2)):.6g}"]
    assert lines.index(next(line for line in lines if line.startswith("Test loss"))) < lines.index(
        next(line for line in lines if "Test net output #0" in line))


def test_snapshot_prefix_is_checked_when_the_solver_is_built(tmp_path, monkeypatch):
    """Caffe's Solver::Init runs CheckSnapshotWritePermissions: with ``snapshot > 0`` it creates and removes
    ``<prefix>_iter_0.tempfile`` and aborts at once when it cannot, instead of after ``snapshot`` iterations."""
    (tmp_path / "a_file").write_text("x")
    bad = _solver_file(tmp_path, f'snapshot: 1000\nsnapshot_prefix: "{tmp_path / "a_file" / "snap"}"\n')
    with pytest.raises(WriteError, match="Cannot write to snapshot prefix .*a_file is not a folder"):
        Solver(bad)
    good = _solver_file(tmp_path, f'snapshot: 1000\nsnapshot_prefix: "{tmp_path / "snap"}"\n')
    before = sorted(os.listdir(tmp_path))
    Solver(good)
    assert sorted(os.listdir(tmp_path)) == before  # the probe file was removed
    Solver(_solver_file(tmp_path, f'snapshot: 0\nsnapshot_prefix: "{tmp_path / "a_file" / "snap"}"\n'))  # no snapshots
    param = read_solver(_solver_file(tmp_path, "snapshot: 1000\n"))
    param.net = str(tmp_path / "net.prototxt")
    with pytest.raises(FormatError, match="snapshot is specified but snapshot_prefix is not"):
        Solver(param)
    param.snapshot_prefix = ""  # set, though empty: Caffe's CHECK passes, the probe is ./_iter_0.tempfile
    monkeypatch.chdir(tmp_path)
    Solver(param)
    assert sorted(os.listdir(tmp_path)) == before


@pytest.mark.parametrize("average", [0, -3])
def test_average_loss_below_one_is_refused_as_caffes_check(tmp_path, average):
    """Solver::Init: CHECK_GE(average_loss, 1) (ours smoothed over one iteration instead)."""
    with pytest.raises(FormatError, match=f"average_loss must be >= 1.*got {average}"):
        Solver(_solver_file(tmp_path, f"average_loss: {average}\n"))


def test_test_scores_are_summed_and_divided_in_float_as_caffe(tmp_path):
    """Solver::Test keeps ``vector<Dtype> test_score``: the first iteration's outputs, then ``+=`` each
    iteration's in float, then ``/ test_iter`` in float (ours summed in double: another float here)."""
    path = _solver_file(tmp_path, "test_iter: 30\ntest_interval: 100\n")
    solver = Solver(path, weights=case_dir(CASE) / "init.caffemodel")
    inputs, _ = load_case(CASE)
    rng = np.random.default_rng(0)
    batches = [{"data": rng.standard_normal((4, 3, 10, 10)).astype(np.float32) * 50, "label": inputs["label"][t % 5]}
               for t in range(30)]
    solver.test_data_sources[0] = iter(batches)
    reference = CaffeNet(str(tmp_path / "net.prototxt"), phase="test", weights=str(case_dir(CASE) / "init.caffemodel"))
    with torch.no_grad():
        losses = [np.float32(float(reference(**{k: torch.tensor(v) for k, v in b.items()})["loss"])) for b in batches]
    total = losses[0]
    for loss in losses[1:]:
        total = np.float32(total + loss)
    score = solver.test(0)["loss"]
    assert score.dtype == np.float32 and float(score) == float(np.float32(total / np.float32(30))) == 31.23920440673828
    assert float(np.float32(sum(map(float, losses)) / 30)) == 31.239206314086914  # the double sum's mean


def test_setup_and_resume_log_caffes_lines(tmp_path, caplog):
    """Solver::Init/InitTrainNet/InitTestNets, UpgradeSnapshotPrefixProperty, Solve and Restore log lines."""
    path = _solver_file(tmp_path, "test_iter: 1\ntest_iter: 1\ntest_interval: 100\nmax_iter: 1\n")
    with caplog.at_level("INFO", logger="caffe_compat.solver"):
        solver = Solver(path, weights=case_dir(CASE) / "init.caffemodel")
    lines = [r.getMessage() for r in caplog.records]
    prefix = str(tmp_path / "solver")
    assert [line for line in lines if "snapshot_prefix" in line or "Creating" in line or "scaffolding" in line] == [
        f"snapshot_prefix was not specified and is set to {prefix}",
        "Creating training net from net file: net.prototxt",
        "Creating test net (#0) specified by net file: net.prototxt",
        "Creating test net (#1) specified by net file: net.prototxt",
        "Solver scaffolding done."]
    _, state = solver.snapshot()
    caplog.clear()
    with caplog.at_level("INFO", logger="caffe_compat.solver"):
        solver.solve(resume_file=state)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[:4] == [f"Solving {solver.net.name}", "Learning Rate Policy: fixed",
                         f"Restoring previous solver status from {state}", "SGDSolver: restoring history"]


def test_snapshot_prefix_probes_of_several_ranks_do_not_collide(tmp_path, monkeypatch):
    """Every data-parallel rank builds its Solver and probes the same <prefix>_iter_0.tempfile; one rank's
    removal may find it already removed by another's: that is no error."""
    import caffe_compat.solver.snapshots as snapshots

    real_remove = os.remove

    def removed_by_another_rank_first(path):
        real_remove(path)
        raise FileNotFoundError(2, "No such file or directory", str(path))

    monkeypatch.setattr(snapshots.os, "remove", removed_by_another_rank_first)
    Solver(_solver_file(tmp_path, f'snapshot: 1000\nsnapshot_prefix: "{tmp_path / "snap"}"\n'))
    assert not (tmp_path / "snap_iter_0.tempfile").exists()
    monkeypatch.undo()
    monkeypatch.setenv("RANK", "1")  # only the root (rank 0, which writes the snapshots) checks, as in Caffe
    (tmp_path / "a_file").write_text("x")
    Solver(_solver_file(tmp_path, f'snapshot: 1000\nsnapshot_prefix: "{tmp_path / "a_file" / "snap"}"\n'))


def test_hdf5_snapshots_are_refused(tmp_path):
    solver = Solver(_solver_file(tmp_path, "snapshot_format: HDF5\nmax_iter: 1\n"))
    with pytest.raises(FormatError, match="HDF5"):
        solver.snapshot()
    with pytest.raises(FormatError, match="HDF5"):
        solver.solve()


def test_pycaffe_aliases_and_feed_errors(tmp_path):
    path = str(case_dir("adam") / "solver.prototxt")
    assert type(get_solver(path).optimizer).__name__ == "Adam"
    assert isinstance(SGDSolver(path).optimizer, SGD)  # pycaffe's SGDSolver ignores the file's type
    assert type(AdamSolver(str(case_dir(CASE) / "solver.prototxt")).optimizer).__name__ == "Adam"
    with pytest.raises(FormatError, match="cannot feed"):
        get_solver(path).feed(conv1=np.zeros(3))


def test_missing_net_file_is_a_clear_error(tmp_path, monkeypatch):
    """The message names the solver file, the field and each folder searched once."""
    (tmp_path / "solver.prototxt").write_text('net: "nowhere.prototxt"\nbase_lr: 0.1\nlr_policy: "fixed"\n')
    with pytest.raises(FormatError, match="nowhere.prototxt") as info:
        Solver(str(tmp_path / "solver.prototxt"))
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'solver.prototxt'}: ") and "'net' field" in message
    assert message.count(str(tmp_path.resolve())) == 2 and " and " in message  # solver path + CWD, then its folder
    # solver in the working directory: one folder searched, named once; the relative solver path is named
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FormatError) as info:
        Solver("solver.prototxt")
    message = str(info.value)
    assert message == (f"solver.prototxt: the net file of its 'net' field, 'nowhere.prototxt', was not found "
                       f"(looked in {tmp_path.resolve()})")
    (tmp_path / "solver.prototxt").write_text('train_net: "gone/train.prototxt"\nbase_lr: 0.1\nlr_policy: "fixed"\n')
    with pytest.raises(FormatError, match="'train_net' field, 'gone/train.prototxt'"):
        Solver("solver.prototxt")


def test_net_setup_errors_name_the_net_file_or_the_solver(tmp_path, monkeypatch):
    """A train or test net's setup error (which names the layer) names the file the net came from, or the
    solver file holding it in net_param, as load_net does (caffe-compat train named only the layer)."""
    bad = ('layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 } } }\n'
           'layer { name: "fc" type: "InnerProduct" bottom: "data" top: "y" inner_product_param { num_output: 0 } }')
    monkeypatch.chdir(tmp_path)
    (tmp_path / "net.prototxt").write_text(bad)
    for field in ("net", "train_net"):
        (tmp_path / "solver.prototxt").write_text(f'{field}: "net.prototxt"\nbase_lr: 0.1\nlr_policy: "fixed"\n')
        with pytest.raises(FormatError, match=r"^net.prototxt: layer 'fc'"):
            Solver("solver.prototxt")
    (tmp_path / "solver.prototxt").write_text(f'net_param {{ {bad} }}\nbase_lr: 0.1\nlr_policy: "fixed"\n')
    with pytest.raises(FormatError, match=r"^solver.prototxt: layer 'fc'"):
        Solver("solver.prototxt")
    good = bad.replace("num_output: 0", "num_output: 2")
    (tmp_path / "test.prototxt").write_text(bad)
    (tmp_path / "solver.prototxt").write_text(f'net_param {{ {good} }}\ntest_net: "test.prototxt"\ntest_iter: 1\n'
                                              f'test_interval: 1\nbase_lr: 0.1\nlr_policy: "fixed"\n')
    with pytest.raises(FormatError, match=r"^test.prototxt: layer 'fc'"):
        Solver("solver.prototxt")


def test_data_source_feeds_each_sub_batch():
    """iter_size 2 fed by an iterator equals the MemoryData fixture run (same sub-batches, same order)."""
    inputs, reference = load_case("sgd_iter_size2")
    solver = make_solver(CASE)
    solver.param.iter_size = 2
    solver.optimizer.iter_size = 2
    solver.net.load_caffemodel(str(case_dir("sgd_iter_size2") / "init.caffemodel"))
    solver.data_source = ({"data": inputs["data"][t, k], "label": inputs["label"][t, k]}
                          for t in range(5) for k in range(2))
    for t in range(5):
        solver.step(1)
        for key, value in param_arrays(solver).items():
            np.testing.assert_allclose(value, reference[key][t + 1], rtol=1e-5, atol=4e-6 * np.abs(value).max())


def test_smoothed_loss_is_updated_in_float_as_caffe():
    """Caffe's UpdateSmoothedLoss keeps ``Dtype smoothed_loss_`` and rounds every operation to float:
    ``(s·(n-1) + loss) / n`` while filling, then ``s += (loss - oldest) / average``.  Rounded once from double
    (as ours did) the value drifts off by an ULP or more after a few iterations."""
    f = np.float32
    losses = np.random.default_rng(0).uniform(0.1, 5, 100).astype(np.float32)
    expected, held, s = [], [], f(0)
    for i, loss in enumerate(losses):
        if len(held) < 3:
            held.append(loss)
            s = f(f(f(s * f(len(held) - 1)) + loss) / f(len(held)))
        else:
            s = f(s + f(f(loss - held[i % 3]) / f(3)))
            held[i % 3] = loss
        expected.append(float(s))
    solver = make_solver(CASE)
    solver.param.average_loss = 3
    solver._losses, solver.smoothed_loss, got = [], 0.0, []
    for i, loss in enumerate(losses):
        solver.iter = i
        solver._update_smoothed_loss(float(loss), 0)
        got.append(solver.smoothed_loss)
    assert got == expected
    assert got[15] == 1.6335316896438599  # rounded once from double: 1.6335318088531494, the next float up


@pytest.mark.parametrize("average", [1, 3, 7])
def test_displayed_loss_is_the_mean_of_the_last_average_loss_iterations(average):
    """Caffe's UpdateSmoothedLoss: a running mean while fewer than ``average_loss`` losses are held,
    then a ring buffer; the displayed loss is the mean of the last ``average_loss`` losses of the
    current ``Step(n)`` call (up to float32 rounding).  Quirk: ``Step`` clears the buffer, so a pycaffe
    loop of ``solver.step(1)`` always displays the last loss whatever ``average_loss`` says."""
    from caffe_compat.io import read_solver

    param = read_solver(case_dir(CASE) / "solver.prototxt")
    param.net = str(case_dir(CASE) / "net.prototxt")
    param.average_loss = average

    def fresh():
        solver = Solver(param, weights=str(case_dir(CASE) / "init.caffemodel"), device="cpu")
        feed(solver, CASE, 0)  # the same batch every iteration: one Step(n) call cannot be fed in between
        return solver

    one_by_one, losses = fresh(), []
    for _ in range(9):
        one_by_one.step(1)
        losses.append(float(one_by_one.outputs["loss"]))
        assert one_by_one.smoothed_loss == pytest.approx(losses[-1], rel=1e-7)  # the Step-clears quirk
    assert len(set(np.round(losses, 6))) == 9  # the weights move, so the window matters
    for n in (2, 9):
        solver = fresh()
        solver.step(n)
        window = losses[:n][-average:]
        # float32 running updates: absolute rounding of the order of eps x the largest loss seen
        tolerance = 1e-6 * max(losses[:n])
        assert solver.smoothed_loss == pytest.approx(sum(window) / len(window), rel=2e-6, abs=tolerance), (n, average)
    assert abs(sum(losses[-3:]) / 3 - losses[-1]) > 1e-3  # the mean of a window is not just the last loss


_STATE_NET = """name: "states" {state}
layer {{ name: "data" type: "Input" top: "data" input_param {{ shape {{ dim: 1 dim: 2 }} }} }}
layer {{ name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param {{ num_output: 1 }} }}
layer {{ name: "in_train" type: "Power" bottom: "ip" top: "t" include {{ phase: TRAIN }} }}
layer {{ name: "in_test" type: "Power" bottom: "ip" top: "s" include {{ phase: TEST }} }}
layer {{ name: "staged" type: "Power" bottom: "ip" top: "g" include {{ stage: "extra" }} }}
"""


@pytest.mark.parametrize("net_state, solver_states, train_layers, test_layers", [
    ("", "", ["in_train"], ["in_test"]),
    ("state { phase: TEST }", "", ["in_test"], ["in_test"]),
    ("state { phase: TRAIN stage: 'extra' }", "", ["in_train", "staged"], ["in_train", "staged"]),
    ("", "train_state { phase: TEST } test_state { phase: TRAIN stage: 'extra' }", ["in_test"],
     ["in_train", "staged"]),
    ("state { phase: TEST }", "train_state { phase: TRAIN }", ["in_train"], ["in_test"]),
])
def test_solver_net_states_merge_like_caffe(tmp_path, net_state, solver_states, train_layers, test_layers):
    """Caffe's Solver::InitTrainNet / InitTestNets (solver.cpp) start from phase TRAIN / TEST, MergeFrom the net's
    own state, then MergeFrom train_state / test_state(i): a phase set in either wins (a net file saying
    state { phase: TEST } trains in the TEST phase), stages accumulate.  Ours forced TRAIN for the train net
    and TEST for the test nets whatever the states said."""
    (tmp_path / "net.prototxt").write_text(_STATE_NET.format(state=net_state))
    (tmp_path / "solver.prototxt").write_text(f'net: "net.prototxt" test_iter: 1 test_interval: 10 base_lr: 0.1 '
                                              f'lr_policy: "fixed" max_iter: 1 solver_mode: CPU {solver_states}')
    solver = Solver(str(tmp_path / "solver.prototxt"))
    extra = {"in_train", "in_test", "staged"}
    assert [n for n in solver.net.layer_names if n in extra] == train_layers
    assert [n for n in solver.test_nets[0].layer_names if n in extra] == test_layers
    phases = tuple("test" if "in_test" in layers else "train" for layers in (train_layers, test_layers))
    assert (solver.net.phase, solver.test_nets[0].phase) == phases


def _ip_blobs(model: caffe_pb2.NetParameter, name: str, value: float) -> None:
    layer = model.layer.add(name=name, type="InnerProduct")
    layer.blobs.add(data=[value, value]).shape.dim.extend([1, 2])
    layer.blobs.add(data=[-value]).shape.dim.append(1)


def test_solver_weights_are_split_trimmed_and_loaded_into_the_test_nets(tmp_path):
    """Caffe's Solver loads each `weights` entry through LoadNetWeights (solver.cpp), which splits it at ','
    and trims each name (boost::trim), into the TRAIN net (InitTrainNet) and into every TEST net
    (InitTestNets), so a TEST-only layer takes its stored blobs too.  Ours took a solver `weights` entry as one
    file name, kept the blank in 'a, b' (' b': not found), and left the TEST-only layers at their fillers."""
    (tmp_path / "net.prototxt").write_text(
        'layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 2 } } }\n'
        'layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 1 } }\n'
        'layer { name: "probe" type: "InnerProduct" bottom: "data" top: "probe" include { phase: TEST }\n'
        '        inner_product_param { num_output: 1 } }\n')
    first, second = caffe_pb2.NetParameter(), caffe_pb2.NetParameter()
    _ip_blobs(first, "ip", 2.0)
    _ip_blobs(second, "probe", 3.0)
    (tmp_path / "a.caffemodel").write_bytes(first.SerializeToString())
    (tmp_path / "b.caffemodel").write_bytes(second.SerializeToString())
    solver_text = ('net: "net.prototxt" test_iter: 1 test_interval: 10 base_lr: 0.1 lr_policy: "fixed" max_iter: 1 '
                   'solver_mode: CPU ')
    (tmp_path / "solver.prototxt").write_text(solver_text + 'weights: "a.caffemodel, b.caffemodel"')
    cwd = os.getcwd()
    os.chdir(tmp_path)  # Caffe opens the weights relative to the working directory
    try:
        with pytest.warns(WeightsMismatchWarning, match="ignoring source layers the net lacks: 'probe'"):
            solvers = (Solver("solver.prototxt"), Solver(str(tmp_path / "solver.prototxt"),
                                                          weights=" a.caffemodel ,b.caffemodel", solver_weights=False))
        for solver in solvers:  # the TRAIN net lacks the TEST-only 'probe': reported for it alone
            assert solver.net.params["ip"][0].tolist() == [[2.0, 2.0]]
            test_net = solver.test_nets[0]
            assert test_net.params["probe"][0].tolist() == [[3.0, 3.0]]
            assert test_net.params["probe"][1].tolist() == [-3.0]
            assert test_net.params["ip"][1].tolist() == [-2.0]
        (tmp_path / "solver.prototxt").write_text(solver_text + 'weights: "a.caffemodel,"')
        with pytest.raises(FormatError, match="an empty caffemodel name"):
            Solver("solver.prototxt")
    finally:
        os.chdir(cwd)


def test_test_nets_share_the_train_layers_as_share_trained_layers_with(tmp_path):
    """Solver::Test calls test_net->ShareTrainedLayersWith(net_) (solver.cpp, net.cpp): every TRAIN layer, blob-less
    ones included, goes to the first TEST layer of its name, blob counts CHECKed.  So the TEST-only 'probe' named
    like a TRAIN ReLU fails Caffe's CHECK ('Incompatible number of blobs'); ours shared only layers with blobs,
    by name, and tested on."""
    (tmp_path / "net.prototxt").write_text(
        'layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 2 } } }\n'
        'layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 1 } }\n'
        'layer { name: "probe" type: "ReLU" bottom: "ip" top: "r" include { phase: TRAIN } }\n'
        'layer { name: "probe" type: "InnerProduct" bottom: "ip" top: "p" include { phase: TEST }\n'
        '        inner_product_param { num_output: 1 } }\n')
    (tmp_path / "solver.prototxt").write_text('net: "net.prototxt" test_iter: 1 test_interval: 1 base_lr: 0.1 '
                                              'lr_policy: "fixed" max_iter: 1 solver_mode: CPU')
    solver = Solver(str(tmp_path / "solver.prototxt"))
    with pytest.raises(ShapeMismatchError, match="layer 'probe' has 2 blobs, the source net's has 0"):
        solver.test_all()

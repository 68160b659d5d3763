"""The NetState of the solver's nets, as Caffe's ``Solver::InitTrainNet`` / ``InitTestNets``: start from
``phase: TRAIN`` (TEST for a test net), ``MergeFrom`` the net's own ``state``, then ``MergeFrom``
``train_state`` / ``test_state[i]``.  Protobuf's MergeFrom: a field set later wins, stages append, so a
``phase`` written in the net's ``state`` or in ``test_state`` decides the phase the net is built in.

Net: one Input and an InnerProduct, then a Power layer per phase (``only_train`` / ``only_test``) and one
included from level 2 with stage "b" (``deep_b``); which of them the built net holds shows its state.
"""

from __future__ import annotations

import pytest

from caffe_compat.solver import Solver

NET = """name: "s"
{state}
layer {{ name: "data" type: "Input" top: "data" input_param {{ shape {{ dim: 1 dim: 1 }} }} }}
layer {{ name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param {{ num_output: 1 }} }}
layer {{ name: "only_train" type: "Power" bottom: "data" top: "t" include {{ phase: TRAIN }} }}
layer {{ name: "only_test" type: "Power" bottom: "data" top: "e" include {{ phase: TEST }} }}
layer {{ name: "deep_b" type: "Power" bottom: "data" top: "d" include {{ min_level: 2 stage: "b" }} }}
"""


def _solver(tmp_path, net_state: str = "", solver_extra: str = "") -> Solver:
    (tmp_path / "net.prototxt").write_text(NET.format(state=net_state))
    (tmp_path / "solver.prototxt").write_text(
        'net: "net.prototxt"\ntest_iter: 1\ntest_interval: 10\nbase_lr: 0.1\nlr_policy: "fixed"\n'
        f'solver_mode: CPU\n{solver_extra}')
    return Solver(str(tmp_path / "solver.prototxt"))


def _built(net) -> tuple[str, int, list[str], list[str]]:
    names = [step.name for step in net.steps if step.type == "Power"]
    return net.phase, int(net.state.level), list(net.state.stage), names


@pytest.mark.parametrize("net_state, solver_extra, train, test", [
    ("", "",
     ("train", 0, [], ["only_train"]), ("test", 0, [], ["only_test"])),
    # the net's own phase overrides the solver's default for both nets (test_state not given)
    ("state { phase: TRAIN }", "",
     ("train", 0, [], ["only_train"]), ("train", 0, [], ["only_train"])),
    ("state { phase: TEST }", "",
     ("test", 0, [], ["only_test"]), ("test", 0, [], ["only_test"])),
    # test_state's phase wins over both
    ("state { phase: TEST }", "test_state { phase: TRAIN }",
     ("test", 0, [], ["only_test"]), ("train", 0, [], ["only_train"])),
    # level: the later set value wins; stages: the net's, then train_state's / test_state's
    ('state { level: 1 stage: "a" }', 'train_state { level: 2 stage: "b" }\ntest_state { stage: "b" }',
     ("train", 2, ["a", "b"], ["only_train", "deep_b"]), ("test", 1, ["a", "b"], ["only_test"])),
], ids=["none", "net TRAIN", "net TEST", "test_state TRAIN", "level and stages"])
def test_solver_net_states_merge_as_caffe(tmp_path, net_state, solver_extra, train, test):
    solver = _solver(tmp_path, net_state, solver_extra)
    assert _built(solver.net) == train
    assert _built(solver.test_nets[0]) == test

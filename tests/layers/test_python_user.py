"""User Python layers (``caffe.Layer`` subclasses) inside a CaffeNet: resolution without imports named by a
model file, pycaffe's semantics, our own user-code versions of the two published layers against the native
ports, training through ``caffe-compat train --python-path``."""

from __future__ import annotations

import csv
import importlib
import logging
import sys

import numpy as np
import pytest
import torch

from caffe_compat.cli import main
from caffe_compat.errors import UnknownLayerError
from caffe_compat.layers import python_user
from caffe_compat.layers.python_user import (allow_python_imports, disallow_python_imports, register_python_layer,
                                             unregister_python_layer)
from caffe_compat.net import CaffeNet
from caffe_compat.solver import Solver
from tests.conftest import fixture_path

USER_DIR = fixture_path("python_layers/user_layers.py").parent
DATA_DIR = fixture_path("data/cases.json").parent
USER_MODULES = ("_params", "user_layers", "user_distribution_loss", "user_label_shuffling")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(autouse=True)
def _clean_state():
    """Each test starts with no opt-in, no registration and none of the fixture modules imported."""
    def forget():
        disallow_python_imports()
        python_user._REGISTERED.clear()
        for name in USER_MODULES:
            sys.modules.pop(name, None)

    forget()
    yield
    forget()


def _import_user(name: str, monkeypatch):
    """The program itself imports a module (as a user's script would)."""
    monkeypatch.syspath_prepend(str(USER_DIR))
    return importlib.import_module(name)


def _python(name, module, layer, bottoms, tops, param_str="", extra=""):
    b = "".join(f' bottom: "{x}"' for x in bottoms)
    t = "".join(f' top: "{x}"' for x in tops)
    return (f'layer {{ name: "{name}" type: "Python"{b}{t} {extra} python_param {{ module: "{module}" '
            f'layer: "{layer}" param_str: "{param_str}" }} }}\n')


def _inputs(*specs):
    return "".join(f'layer {{ name: "{n}" type: "Input" top: "{n}" input_param {{ shape {{ '
                   + " ".join(f"dim: {d}" for d in shape) + " } } }\n" for n, shape in specs)


# ------------------------------------------------------------------------------------------ resolution

def test_unregistered_layer_is_refused_naming_the_layer_and_both_ways(monkeypatch):
    net = _inputs(("x", (2, 3))) + _python("my_loss", "user_layers", "EuclideanLoss", ["x", "x"], ["loss"])
    calls = []
    monkeypatch.setattr(importlib, "import_module", lambda *a, **k: calls.append(a))
    with pytest.raises(UnknownLayerError) as info:
        CaffeNet(net)
    message = str(info.value)
    for part in ("layer 'my_loss'", "user_layers.EuclideanLoss", "register_python_layer('user_layers', "
                 "'EuclideanLoss', cls)", "--python-path DIR", "never imports"):
        assert part in message
    assert calls == [] and "user_layers" not in sys.modules


@pytest.mark.parametrize("module,layer", [("os", "system"), ("subprocess", "Popen"), ("builtins", "eval"),
                                          ("shutil", "rmtree"), ("evil_module_not_loaded", "Anything")])
def test_a_model_file_naming_dangerous_code_never_imports_or_calls_it(monkeypatch, module, layer):
    net = _inputs(("x", (1,))) + _python("boom", module, layer, ["x"], ["y"], "rm -rf /")
    monkeypatch.setattr(importlib, "import_module",
                        lambda *a, **k: pytest.fail(f"import_module{a} called without the opt-in"))
    monkeypatch.setattr(importlib.machinery.PathFinder, "find_spec",
                        classmethod(lambda *a, **k: pytest.fail("module search without the opt-in")))
    with pytest.raises(UnknownLayerError, match=rf"layer 'boom'.*'{module}.{layer}'"):
        CaffeNet(net)  # os.system is loaded but is no caffe.Layer class; Popen is a class but no caffe.Layer


def test_module_already_imported_by_the_program_is_found_without_any_flag(monkeypatch):
    _import_user("user_layers", monkeypatch)
    monkeypatch.setattr(importlib, "import_module", lambda *a, **k: pytest.fail("no import needed"))
    net = CaffeNet(_inputs(("a", (4, 3)), ("b", (4, 3))) + _python("loss", "user_layers", "EuclideanLoss",
                                                                  ["a", "b"], ["loss"], extra="loss_weight: 1"))
    a, b = torch.arange(12.0).reshape(4, 3), torch.ones(4, 3)
    assert float(net(a=a, b=b)["loss"].detach()) == pytest.approx(float(((a - b) ** 2).sum() / 8))


def test_registered_class_runs_and_a_native_port_cannot_be_replaced(monkeypatch):
    module = _import_user("user_layers", monkeypatch)
    register_python_layer("anything.at_all", "Euclid", module.EuclideanLoss)
    net = CaffeNet(_inputs(("a", (2, 2)), ("b", (2, 2))) + _python("l", "anything.at_all", "Euclid", ["a", "b"],
                                                                  ["l"]))
    assert float(net(a=torch.ones(2, 2), b=torch.zeros(2, 2))["l"].detach()) == pytest.approx(1.0)
    unregister_python_layer("anything.at_all", "Euclid")
    with pytest.raises(Exception, match="native port"):
        register_python_layer("distribution_loss_layer", "DistributionLossLayer", module.EuclideanLoss)


def test_opt_in_imports_from_the_folder_and_logs_it(monkeypatch, caplog):
    imported = []
    real = importlib.import_module
    monkeypatch.setattr(importlib, "import_module", lambda name, *a: imported.append(name) or real(name, *a))
    with caplog.at_level(logging.INFO, logger="caffe_compat.layers.python_user"):
        allow_python_imports([USER_DIR])
        net = CaffeNet(_inputs(("a", (2, 2)), ("b", (2, 2))) + _python("l", "user_layers", "EuclideanLoss",
                                                                      ["a", "b"], ["l"]))
    assert imported == ["user_layers"]
    assert any(r.levelno == logging.WARNING and str(USER_DIR) in r.getMessage() for r in caplog.records)
    assert any("importing Python layer module 'user_layers'" in r.getMessage() for r in caplog.records)
    assert float(net(a=torch.ones(2, 2), b=torch.ones(2, 2))["l"].detach()) == 0.0
    with pytest.raises(UnknownLayerError, match="not found in the --python-path folders"):
        CaffeNet(_inputs(("a", (1,))) + _python("l", "no_such_module", "L", ["a"], ["l"]))


# ------------------------------------------------------------------------------------------ semantics

def test_learnable_blob_setup_reshape_phase_and_one_sgd_step(monkeypatch, tmp_path):
    _import_user("user_layers", monkeypatch)
    net_text = ('layer { name: "data" type: "DummyData" top: "x" top: "t" dummy_data_param { '
                'shape { dim: 2 dim: 3 dim: 1 dim: 2 } shape { dim: 2 dim: 3 dim: 1 dim: 2 } '
                'data_filler { type: "constant" value: 2 } data_filler { type: "constant" value: 1 } } }\n'
                + _python("scale", "user_layers", "ChannelScale", ["x"], ["y"], "init: 0.5",
                          "param { lr_mult: 2 decay_mult: 0 }")
                + _python("loss", "user_layers", "EuclideanLoss", ["y", "t"], ["loss"], extra="loss_weight: 3"))
    (tmp_path / "net.prototxt").write_text(net_text)
    (tmp_path / "solver.prototxt").write_text('net: "net.prototxt" base_lr: 0.01 lr_policy: "fixed" momentum: 0 '
                                              'weight_decay: 0.5 max_iter: 1 solver_mode: CPU')
    solver = Solver(str(tmp_path / "solver.prototxt"))
    layer = solver.net.layer("scale")
    w = solver.net.params["scale"][0]
    assert isinstance(w, torch.nn.Parameter) and w.lr_mult == 2.0 and w.decay_mult == 0.0
    torch.testing.assert_close(w.detach(), torch.full((3,), 0.5))
    assert layer.user.calls == {"setup": 1, "reshape": 1, "forward": 0, "backward": 0}
    solver.step(1)
    # y = 0.5*2 = 1 = t: loss 0, no gradient; so move w first and check the closed form
    with torch.no_grad():
        w.fill_(1.0)
    solver.step(1)
    # y = 2, t = 1: dloss/dy = 3 * (y - t) / N = 3/2 per element; dloss/dw_c = sum over (n, h, w), 4 terms,
    # of 3/2 * x = 3/2 * 2, so 12; lr_mult 2, decay_mult 0 (weight_decay 0.5 unused): w = 1 - 0.01 * 2 * 12
    torch.testing.assert_close(w.detach(), torch.full((3,), 1.0 - 0.01 * 2 * 12.0))
    assert layer.user.calls["forward"] == 2 and layer.user.calls["backward"] == 2
    assert layer.user.calls["reshape"] == 3 and layer.user.seen_phase == 0  # TRAIN
    solver.net.eval()
    solver.net()
    assert layer.user.seen_phase == 1


def test_gradients_through_the_user_layer_match_autograd_and_propagate_down(monkeypatch):
    _import_user("user_layers", monkeypatch)
    net = CaffeNet(_inputs(("x", (2, 3, 2, 2)), ("t", (2, 3, 2, 2)))
                   + _python("scale", "user_layers", "ChannelScale", ["x"], ["y"], "init: 1.5")
                   + _python("loss", "user_layers", "EuclideanLoss", ["y", "t"], ["loss"],
                             extra="loss_weight: 2 propagate_down: true propagate_down: false"))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 2, 2, generator=g, requires_grad=True)
    t = torch.randn(2, 3, 2, 2, generator=g, requires_grad=True)
    blobs = net(x=x, t=t)
    diffs = net.backward(blobs)
    ref_x = x.detach().clone().requires_grad_()
    w = torch.full((3,), 1.5, requires_grad=True)
    loss = 2 * ((ref_x * w[None, :, None, None] - t.detach()) ** 2).sum() / 2 / 2
    loss.backward()
    assert float(blobs["loss"].detach()) == pytest.approx(float(loss.detach()) / 2, rel=1e-6)
    torch.testing.assert_close(diffs["x"], ref_x.grad)
    torch.testing.assert_close(net.params["scale"][0].grad, w.grad)
    assert float(diffs["t"].abs().sum()) == 0.0  # propagate_down: false


@pytest.mark.parametrize("device", DEVICES)
def test_user_distribution_loss_equals_the_native_port(monkeypatch, device):
    allow_python_imports([USER_DIR])
    rng = np.random.RandomState(3)
    count = 60
    cos = np.clip(rng.randn(count) * 0.5, -1.2, 1.2).astype(np.float32)
    cos[:3] = [1.0, -1.0, 0.3]
    labels = rng.choice([1, -1, 0], size=count, p=[0.4, 0.5, 0.1]).astype(np.float32)
    for kind, extra in (("simple", ""), ("linear", r" \n margin: 0.3"), ("exp", r" \n margin: 0.1 \n alpha: 3")):
        param_str = rf"grid_delta: 0.1 \n loss: {kind}{extra}"
        results = []
        for module in ("user_distribution_loss", "distribution_loss_layer"):
            net = CaffeNet(_inputs(("cos", (count, 1, 1, 1)), ("label", (count, 1, 1, 1)))
                           + _python("loss", module, "DistributionLossLayer", ["cos", "label"], ["loss"], param_str,
                                     "loss_weight: 1.5")).to(device)
            x = torch.from_numpy(cos).reshape(count, 1, 1, 1).to(device).requires_grad_()
            blobs = net(cos=x, label=torch.from_numpy(labels).reshape(count, 1, 1, 1).to(device))
            diffs = net.backward(blobs)
            assert blobs["loss"].device.type == device and diffs["cos"].device.type == device
            results.append((blobs["loss"].detach().cpu().numpy(), diffs["cos"].cpu().numpy()))
        (user_loss, user_grad), (native_loss, native_grad) = results
        np.testing.assert_allclose(user_loss, native_loss, rtol=1e-6)
        np.testing.assert_allclose(user_grad, native_grad, rtol=1e-5, atol=1e-7)
        assert np.count_nonzero(native_grad) > count // 2 and float(native_loss[0]) > 0


def test_user_label_shuffling_equals_the_native_port(monkeypatch):
    monkeypatch.chdir(DATA_DIR)
    allow_python_imports([USER_DIR])
    param_str = (r"source: lmdb_raw \n batch_size: 5 \n scales: [0.5, 2.] \n subtract: [1, 3] \n "
                 r"max_number_object_per_label: 2 \n seed: 11")
    nets = [CaffeNet(_python("data", module, "LabelShufflingLayer", [], ["data", "label"], param_str))
            for module in ("user_label_shuffling", "label_shuffling_layer")]
    assert nets[0].blob_shapes == nets[1].blob_shapes == {"data": (5, 3, 16, 20), "label": (5, 1, 1, 1)}
    for _ in range(6):  # past a full pass over the labels: the reshuffles agree too
        user, native = nets[0](), nets[1]()
        assert torch.equal(user["data"], native["data"]) and torch.equal(user["label"], native["label"])
    assert len(set(native["label"].reshape(-1).tolist())) > 1


# ------------------------------------------------------------------------------------------ the CLI

def _training_files(tmp_path):
    (tmp_path / "net.prototxt").write_text(
        'layer { name: "data" type: "DummyData" top: "x" top: "t" dummy_data_param { '
        'shape { dim: 4 dim: 3 } shape { dim: 4 dim: 2 } '
        'data_filler { type: "uniform" min: -1 max: 1 } data_filler { type: "constant" value: 0.5 } } }\n'
        'layer { name: "ip" type: "InnerProduct" bottom: "x" top: "ip" inner_product_param { num_output: 2 '
        'weight_filler { type: "gaussian" std: 0.5 } } }\n'
        + _python("my_loss", "user_layers", "EuclideanLoss", ["ip", "t"], ["loss"], extra="loss_weight: 1"))
    (tmp_path / "solver.prototxt").write_text('net: "net.prototxt" base_lr: 0.2 lr_policy: "fixed" momentum: 0.5 '
                                              'max_iter: 8 display: 1 solver_mode: CPU snapshot_after_train: false')
    return str(tmp_path / "solver.prototxt")


def test_cli_trains_a_user_loss_with_python_path_and_refuses_it_without(tmp_path, monkeypatch, capsys):
    solver = _training_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["train", solver, "--iters", "1"]) == 2
    err = capsys.readouterr().err
    assert "layer 'my_loss'" in err and "user_layers.EuclideanLoss" in err and "--python-path" in err
    assert "Traceback" not in err and "user_layers" not in sys.modules
    log = tmp_path / "log.csv"
    assert main(["train", solver, "--python-path", str(USER_DIR), "--python-path", str(tmp_path),
                 "--log", str(log), "--seed", "1"]) == 0
    assert "trained 8 iterations" in capsys.readouterr().out
    with open(log) as f:
        losses = [float(row["loss"]) for row in csv.DictReader(f)]
    assert len(losses) == 8 and losses[-1] < 0.5 * losses[0]


def test_a_failing_user_layer_is_a_typed_runtime_error(tmp_path):
    """pycaffe raises RuntimeError when a Python layer's setup fails; ours is also a CaffeCompatError naming
    the layer and the method."""
    import caffe_compat
    from caffe_compat.errors import CaffeCompatError, PythonLayerError
    from caffe_compat.net import CaffeNet

    class Failing(caffe_compat.Layer):
        def setup(self, bottom, top):
            raise ValueError("no good")

    caffe_compat.register_python_layer("failing_mod", "Failing", Failing)
    text = ('layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 2 } } }\n'
            'layer { name: "bad" type: "Python" bottom: "x" top: "y" python_param { module: "failing_mod" '
            'layer: "Failing" } }\n')
    with pytest.raises(PythonLayerError, match=r"layer 'bad' .*Failing.setup raised ValueError: no good") as info:
        CaffeNet(text)
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, CaffeCompatError)

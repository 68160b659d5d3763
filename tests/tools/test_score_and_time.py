"""caffe-compat test (caffe test) and time (caffe time) on real-Caffe fixture nets.

``test``: the printed means must be the reference blobs: the Euclidean-loss fixture (inputs and Caffe's
loss from its npz, loss_weight 0.5: Caffe's `` (* 0.5 = ... loss)``), the layer zoo (25 outputs of a net
with weights, inputs from its blobs.npz) and the Data-layer fixture over two different batches (LMDB
records 0-3, then 4, 5, 0, 1: the means are the means of Caffe's two batches).
``time``: every layer (Split layers too) has a forward and a backward line, the numbers parse and the
totals are consistent.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from caffe_compat.cli import main
from caffe_compat.io.glog import g6
from caffe_compat.tools.netsetup import build_net
from tests.conftest import fixture_path

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
LINE = re.compile(r"^(\S+) = (\S+)$")


def _means(out: str) -> dict[str, list[float]]:
    means: dict[str, list[float]] = {}
    for line in out.splitlines():
        match = LINE.match(line)
        if match:
            means.setdefault(match.group(1), []).append(float(match.group(2)))
    return means


def test_loss_net_prints_caffes_mean_and_weighted_loss(capsys):
    npz = fixture_path("losses/euclidean_lw0.5.npz")
    ref = np.load(npz)
    loss, weight = float(ref["loss"]), float(ref["loss_weight"])
    assert main(["test", "-model", str(fixture_path("losses/euclidean_lw0.5.prototxt")), "-iterations", "3",
                 "--input", f"pred={npz}", "--input", f"target={npz}"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "Running for 3 iterations."
    assert [line for line in lines if line.startswith("Batch")] == [f"Batch {i}, loss = {g6(loss)}" for i in range(3)]
    assert lines[-2:] == [f"Loss: {g6(weight * loss)}", f"loss = {g6(loss)} (* {g6(weight)} = {g6(weight * loss)} loss)"]
    assert lines[-1] == "loss = 14.299 (* 0.5 = 7.14948 loss)"


@pytest.mark.parametrize("device", DEVICES)
def test_layer_zoo_means_equal_the_reference_outputs(tmp_path, capsys, device):
    zoo = fixture_path("layer_zoo")
    ref = np.load(zoo / "blobs.npz")
    args = ["test", "-model", str(zoo / "deploy.prototxt"), "-weights", str(zoo / "weights.caffemodel"),
            "-iterations", "2", "--input", f"data={zoo / 'blobs.npz'}", "--device", device,
            "--json", str(tmp_path / "score.json")]
    assert main(args) == 0
    out = capsys.readouterr().out
    means = _means(out)
    outputs = build_net(zoo / "deploy.prototxt").output_names
    assert sorted(means) == sorted(outputs) and len(outputs) == 25
    for name in outputs:
        expected = ref[name].reshape(-1).astype(np.float64)
        np.testing.assert_allclose(means[name], expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max(), err_msg=name)
    batches = [line for line in out.splitlines() if line.startswith("Batch ")]
    assert len(batches) == 2 * sum(ref[name].size for name in outputs)
    report = json.loads((tmp_path / "score.json").read_text())
    assert report["iterations"] == 2 and len(report["outputs"]) == sum(ref[n].size for n in outputs)


def test_data_layer_net_averages_caffes_two_batches(monkeypatch, capsys):
    folder = fixture_path("data")
    monkeypatch.chdir(folder)  # the prototxt names lmdb_raw relative to its folder, as Caffe runs it
    ref = np.load("raw_no_transform.npz")
    assert main(["test", "--model", "raw_no_transform.prototxt", "--iterations", "2"]) == 0  # no learnable blobs
    out = capsys.readouterr().out
    for i in range(2):
        labels = [float(m.group(1)) for m in re.finditer(rf"^Batch {i}, label = (\S+)$", out, re.MULTILINE)]
        assert labels == ref[f"label_iter{i}"].tolist()
    means = _means(out)
    expected_label = (ref["label_iter0"] + ref["label_iter1"]).astype(np.float32) / np.float32(2)
    assert means["label"] == [float(g6(v)) for v in expected_label]
    expected_data = ((ref["data_iter0"] + ref["data_iter1"]) / np.float32(2)).reshape(-1)
    np.testing.assert_allclose(means["data"], expected_data, rtol=1e-5)


def test_test_refuses_a_net_with_weights_missing_and_bad_inputs(capsys):
    zoo = fixture_path("layer_zoo")
    assert main(["test", "-model", str(zoo / "deploy.prototxt")]) == 2
    assert main(["test", "-model", str(zoo / "deploy.prototxt"), "-weights", str(zoo / "weights.caffemodel"),
                 "--input", f"nope={zoo / 'blobs.npz'}:data"]) == 2
    assert main(["test", "-model", str(zoo / "deploy.prototxt"), "-weights", str(zoo / "weights.caffemodel"),
                 "--input", f"data={zoo / 'blobs.npz'}:conv_g"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and "need model weights" in err[0] and "not a blob the net can be fed" in err[1]
    assert "has shape" in err[2]


@pytest.mark.parametrize("device", DEVICES)
def test_time_lists_every_layer_with_consistent_totals(tmp_path, capsys, device):
    zoo = fixture_path("layer_zoo")
    args = ["time", "-model", str(zoo / "deploy.prototxt"), "-iterations", "2", "-phase", "TEST",
            "--json", str(tmp_path / "time.json")]
    if device == "cuda":
        args += ["-gpu", "0"]
    assert main(args) == 0
    out = capsys.readouterr().out
    steps = build_net(zoo / "deploy.prototxt").steps
    forward = dict(re.findall(r"^\s*(\S+)\tforward: (\S+) ms\.$", out, re.MULTILINE))
    backward = dict(re.findall(r"^\s*(\S+)\tbackward: (\S+) ms\.$", out, re.MULTILINE))
    assert list(forward) == list(backward) == [s.name for s in steps]  # every layer, Split layers included
    assert any("_split" in s.name for s in steps)
    totals = {k: float(v) for k, v in re.findall(r"^(Average [\w-]+(?: pass)?|Total Time): (\S+) ms\.$", out,
                                                 re.MULTILINE)}
    fwd, bwd = totals["Average Forward pass"], totals["Average Backward pass"]
    fb, total = totals["Average Forward-Backward"], totals["Total Time"]
    assert sum(map(float, forward.values())) <= fwd * 1.001 and sum(map(float, backward.values())) <= bwd * 1.001
    assert fwd + bwd <= fb * 1.001 and fb == pytest.approx(total / 2, rel=1e-3)
    assert float(backward[steps[0].name]) == 0.0  # the Input layer has nothing to back-propagate
    assert float(backward["conv_g"]) > 0.0
    assert len(re.findall(r"^Iteration: \d forward-backward time: \S+ ms\.$", out, re.MULTILINE)) == 2
    report = json.loads((tmp_path / "time.json").read_text())
    assert [layer["name"] for layer in report["layers"]] == [s.name for s in steps]
    assert report["device"].startswith(device)


def test_time_flags_in_caffe_spelling_with_equals(capsys):
    model = fixture_path("losses/euclidean_lw0.5.prototxt")
    assert main(["time", f"-model={model}", "-iterations=1", "-phase=TRAIN"]) == 0
    out = capsys.readouterr().out
    assert "Initial loss: 0" in out and re.search(r"^loss_layer\tbackward: \S+ ms\.$", out, re.MULTILINE)
    assert main(["time", f"-model={model}", "-gpu", "x"]) == 2


def test_time_phase_is_exactly_TRAIN_or_TEST_or_empty(capsys):
    """Caffe's get_phase_from_flags: ``-phase ""`` is the default (TRAIN for time), ``TRAIN``/``TEST`` as
    spelt, anything else (``train``) ``LOG(FATAL) << "phase must be \"TRAIN\" or \"TEST\""``."""
    model = fixture_path("losses/euclidean_lw0.5.prototxt")
    assert main(["time", f"-model={model}", "-iterations=1", "-phase="]) == 0
    assert re.search(r"^loss_layer\tbackward: \S+ ms\.$", capsys.readouterr().out, re.MULTILINE)
    for spelling in ("train", "Test"):
        with pytest.raises(SystemExit):
            main(["time", f"-model={model}", "-iterations=1", f"-phase={spelling}"])
        assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["test", "time"])
def test_iterations_below_1_exit_2_before_any_output(capsys, command):
    model = fixture_path("losses/euclidean_lw0.5.prototxt")
    assert main([command, "-model", str(model), "-iterations", "0"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"caffe-compat {command}: error: -iterations must be >= 1, got 0\n"


@pytest.mark.parametrize("command", ["test", "time"])
def test_gpu_without_cuda_says_to_leave_out_gpu(capsys, monkeypatch, command):
    """Caffe's CPU mode is the absence of -gpu: the advice names that, not a '-gpu cpu' Caffe never took."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model = fixture_path("losses/euclidean_lw0.5.prototxt")
    assert main([command, "-model", str(model), "-gpu", "0", "-iterations", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "-gpu 0: CUDA is not available" in err and err.endswith("leave out -gpu to run on the CPU")
    assert "-gpu cpu" not in err


@pytest.mark.parametrize("command", ["test", "time"])
def test_device_lines_are_caffes(capsys, monkeypatch, command):
    """caffe test / caffe time log 'Use CPU.' or 'Use GPU with device ID N'; caffe test then logs 'GPU device
    name: <name>'.  The GPU case is checked with the net on the CPU and the chosen device reported as cuda:1."""
    from caffe_compat.tools import netsetup

    model = str(fixture_path("losses/euclidean_lw0.5.prototxt"))
    assert main([command, "-model", model, "-iterations", "1"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "Use CPU."
    real_build = netsetup.build_net
    monkeypatch.setattr(netsetup, "resolve_device", lambda gpu, device: torch.device("cuda:1"))
    monkeypatch.setattr(netsetup, "build_net", lambda *a, **k: real_build(*a, **{**k, "device": torch.device("cpu")}))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: f"Fake GPU #{index}")
    assert main([command, "-model", model, "-iterations", "1", "-gpu", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    if command == "test":
        assert lines[:3] == ["Use GPU with device ID 1", "GPU device name: Fake GPU #1", "Running for 1 iterations."]
    else:
        assert lines[:2] == ["Use GPU with device ID 1", "Performing Forward"]


def test_test_and_extract_features_read_hdf5_weights_as_caffe(tmp_path, capsys):
    """Caffe's CopyTrainedLayersFrom reads an HDF5 weights file (H5Fis_hdf5; snapshot_format: HDF5 writes
    ``_iter_N.caffemodel.h5``) as HDF5: caffe test and extract_features score and extract with it as with the
    caffemodel."""
    pytest.importorskip("h5py")
    import caffe_compat.pycaffe as caffe

    zoo = fixture_path("layer_zoo")
    h5 = tmp_path / "weights.caffemodel.h5"
    caffe.Net(str(zoo / "deploy.prototxt"), str(zoo / "weights.caffemodel"), caffe.TEST).save_hdf5(str(h5))
    common = ["test", "-model", str(zoo / "deploy.prototxt"), "-iterations", "1",
              "--input", f"data={zoo / 'blobs.npz'}"]
    assert main([*common, "-weights", str(zoo / "weights.caffemodel")]) == 0
    expected = capsys.readouterr().out
    assert main([*common, "-weights", str(h5)]) == 0
    assert capsys.readouterr().out == expected
    features = []
    for weights, out in ((zoo / "weights.caffemodel", "a.npy"), (h5, "b.npy")):
        assert main(["extract_features", str(weights), str(zoo / "deploy.prototxt"), "bn", str(tmp_path / out), "1",
                     "npy", "--input", f"data={zoo / 'blobs.npz'}", "--no-progress"]) == 0
        features.append(np.load(tmp_path / out))
    np.testing.assert_array_equal(features[0], features[1])

"""Weights whose layer names do not match the net: one WeightsMismatchWarning naming the caffemodel's
layers the net lacks (ignored, as Caffe's "Ignoring source layer X") and the net's layers with blobs that
the caffemodel does not cover (left at their fillers); ``strict=True`` / ``--strict`` make it a
FormatError (exit 2 from the command line)."""

from __future__ import annotations

import shutil
import warnings

import numpy as np
import pytest

from caffe_compat import load_net
from caffe_compat.cli import main
from caffe_compat.errors import FormatError, WeightsMismatchWarning
from caffe_compat.io import read_net
from caffe_compat.net import CaffeNet
from tests.conftest import fixture_path

NET = "nets/vgg_cnn_m_1024_small"


@pytest.fixture
def renamed(tmp_path):
    """The fixture's deploy prototxt with conv2 renamed conv2_new, and its caffemodel."""
    text = fixture_path(f"{NET}/deploy.prototxt").read_text()
    assert text.count('name: "conv2"') == 1
    prototxt = tmp_path / "deploy.prototxt"
    prototxt.write_text(text.replace('name: "conv2"', 'name: "conv2_new"'))
    return prototxt, fixture_path(f"{NET}/weights.caffemodel")


def _mismatch_warnings(record):
    return [w for w in record if issubclass(w.category, WeightsMismatchWarning)]


def test_matching_weights_give_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error", WeightsMismatchWarning)
        load_net(str(fixture_path(f"{NET}/deploy.prototxt")), str(fixture_path(f"{NET}/weights.caffemodel")))


def test_renamed_layer_gives_one_warning_naming_both_sides(renamed):
    prototxt, weights = renamed
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        net = load_net(str(prototxt), str(weights))
    found = _mismatch_warnings(record)
    assert len(found) == 1 and issubclass(WeightsMismatchWarning, UserWarning)
    text = str(found[0].message)
    assert str(weights) in text
    assert "ignoring source layers the net lacks: 'conv2'" in text
    assert "left at their fillers (not in the weights): 'conv2_new'" in text
    assert "conv1" not in text and "fc6" not in text
    stored = dict((layer.name, layer) for layer in read_net(str(weights)).layer)
    np.testing.assert_array_equal(net.params["conv1"][0].detach().numpy().ravel(), np.asarray(stored["conv1"].blobs[0].data))


def test_load_caffemodel_warns_too_and_copies(renamed):
    prototxt, weights = renamed
    net = CaffeNet(str(prototxt))
    with pytest.warns(WeightsMismatchWarning, match=r"'conv2'.*'conv2_new'"):
        net.load_caffemodel(str(weights))
    with pytest.warns(WeightsMismatchWarning, match=r"<weights>: .*'conv2'.*'conv2_new'"):
        net.load_caffemodel(read_net(str(weights)))  # a NetParameter: no file name to give


def test_strict_raises_format_error_naming_the_file_and_layers(renamed):
    prototxt, weights = renamed
    for load in (lambda: load_net(str(prototxt), str(weights), strict=True),
                 lambda: CaffeNet(str(prototxt)).load_caffemodel(str(weights), strict=True)):
        with warnings.catch_warnings():
            warnings.simplefilter("error", WeightsMismatchWarning)
            with pytest.raises(FormatError) as info:
                load()
        assert str(info.value).startswith(f"{weights}: weights do not match net ")
        assert "'conv2'" in str(info.value) and "'conv2_new'" in str(info.value)


def test_several_caffemodels_are_reported_together(renamed, tmp_path):
    """A layer one caffemodel lacks and another covers is not left at its fillers."""
    prototxt, weights = renamed
    stored = read_net(str(weights))
    renamed_layer = next(layer for layer in stored.layer if layer.name == "conv2")
    renamed_layer.name = "conv2_new"
    only_conv2 = type(stored)()
    only_conv2.layer.add().CopyFrom(renamed_layer)
    extra = tmp_path / "conv2_new.caffemodel"
    extra.write_bytes(only_conv2.SerializeToString())
    net = CaffeNet(str(prototxt))
    with pytest.warns(WeightsMismatchWarning) as record:
        net.load_caffemodels([str(weights), str(extra)])
    text = str(record[0].message)
    assert f"'conv2' ({weights})" in text and "fillers" not in text
    with warnings.catch_warnings():
        warnings.simplefilter("error", WeightsMismatchWarning)
        with pytest.raises(FormatError, match="'conv2'"):
            CaffeNet(str(prototxt)).load_caffemodels([str(weights), str(extra)], strict=True)


def test_source_layers_without_blobs_are_not_reported(tmp_path):
    stored = read_net(str(fixture_path(f"{NET}/weights.caffemodel")))
    stored.layer.add(name="loss", type="SoftmaxWithLoss")  # a train net's layer without blobs
    path = tmp_path / "with_loss.caffemodel"
    path.write_bytes(stored.SerializeToString())
    with warnings.catch_warnings():
        warnings.simplefilter("error", WeightsMismatchWarning)
        load_net(str(fixture_path(f"{NET}/deploy.prototxt")), str(path), strict=True)


def _cli(capsys, *argv):
    status = main([str(a) for a in argv])
    return status, capsys.readouterr().err


def test_inspect_strict_exits_2(renamed, capsys):
    prototxt, weights = renamed
    status, err = _cli(capsys, "inspect", prototxt, "--weights", weights, "--strict")
    assert status == 2
    assert "error:" in err and "'conv2'" in err and "'conv2_new'" in err and str(weights) in err
    status, _ = _cli(capsys, "inspect", fixture_path(f"{NET}/deploy.prototxt"), "--weights", weights, "--strict")
    assert status == 0


def test_convert_strict_exits_2_and_warns_without_it(renamed, tmp_path, capsys):
    prototxt, weights = renamed
    out = tmp_path / "model.pt"
    status, err = _cli(capsys, "convert", prototxt, weights, "-o", out, "--strict")
    assert status == 2 and "'conv2'" in err and "'conv2_new'" in err and not out.exists()
    status, err = _cli(capsys, "convert", prototxt, weights, "-o", out, "--allow-missing")
    assert status == 0 and out.exists()
    assert "caffe-compat convert: warning: " in err and "'conv2'" in err and "'conv2_new'" in err


def test_export_strict_exits_2(renamed, tmp_path, capsys):
    pytest.importorskip("onnx")
    prototxt, weights = renamed
    out = tmp_path / "m.onnx"
    status, err = _cli(capsys, "export", prototxt, "--weights", weights, "-o", out, "--output", "fc7",
                       "--preprocessing", '{"resize": 32}', "--strict")
    assert status == 2 and "'conv2'" in err and "'conv2_new'" in err and not out.exists()


def test_train_strict_exits_2(tmp_path, capsys):
    case = fixture_path("solvers/sgd_step_momentum")
    text = (case / "net.prototxt").read_text()
    (tmp_path / "net.prototxt").write_text(text.replace('name: "ip1"', 'name: "ip1_new"'))
    shutil.copy(case / "solver.prototxt", tmp_path / "solver.prototxt")
    weights = case / "init.caffemodel"
    status, err = _cli(capsys, "train", tmp_path / "solver.prototxt", "--weights", weights, "--strict")
    assert status == 2
    assert f"{weights}: weights do not match net" in err and "'ip1'" in err and "'ip1_new'" in err


def test_the_warning_points_at_the_users_line_whichever_entry_point(renamed):
    """``stacklevel`` is the first frame outside caffe_compat: this file, for the constructor, load_net,
    load_caffemodel and pycaffe's Net alike (a fixed count pointed load_net's warning into net.py)."""
    from caffe_compat.pycaffe import Net

    prototxt, weights = renamed
    calls = {"CaffeNet": lambda: CaffeNet(str(prototxt), weights=str(weights)),
             "load_net": lambda: load_net(str(prototxt), str(weights)),
             "load_caffemodel": lambda: CaffeNet(str(prototxt)).load_caffemodel(str(weights)),
             "pycaffe Net": lambda: Net(str(prototxt), str(weights), 1)}
    for name, call in calls.items():
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            call()
        found = _mismatch_warnings(record)
        assert len(found) == 1, name
        assert found[0].filename == __file__, (name, found[0].filename)

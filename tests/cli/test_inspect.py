"""``caffe-compat inspect`` on real models: exit codes, the table, the weights check."""

from __future__ import annotations

import json
import subprocess
import sys

from caffe_compat.cli import main
from tests.conftest import AUTHORS, fixture_path


def test_open_nsfw_inspects_cleanly(nsfw_dir, capsys):
    status = main(["inspect", str(nsfw_dir / "deploy.prototxt"), "--weights",
                   str(nsfw_dir / "resnet_50_1by2_nsfw.caffemodel")])
    out = capsys.readouterr().out
    assert status == 0
    assert "5,944,567 parameters" in out and "fc_nsfw" in out
    assert "prob" in out.splitlines()[-4] or "1x2" in out


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

"""``caffe-compat export`` and ``caffe-compat evaluate``: exit codes, messages, files written (or not)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest

from caffe_compat.cli import main
from caffe_compat.data import make_toy_data
from caffe_compat.export import read_metadata
from tests.conftest import REPO, fixture_path
from tests.export.helpers import TINY_PREPROCESSING, write_tiny_net

VGG = "nets/vgg_cnn_m_1024_small"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    prototxt, weights = write_tiny_net(root)
    return root, prototxt, weights


def test_export_with_verify_exit_0(tmp_path, capsys):
    out = tmp_path / "vgg.onnx"
    status = main(["export", str(fixture_path(f"{VGG}/deploy.prototxt")), "--weights",
                   str(fixture_path(f"{VGG}/weights.caffemodel")), "-o", str(out), "--output", "fc7", "--normalize",
                   "--verify"])
    text = capsys.readouterr().out
    assert status == 0, text
    assert "onnx.checker: passed" in text and "verification passed" in text and f"wrote {out}" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["vgg.onnx"]  # the verification temp file is gone
    blobs = np.load(fixture_path(f"{VGG}/blobs.npz"))
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"data": blobs["data"]})[0]
    caffe = blobs["fc7"] / np.linalg.norm(blobs["fc7"], axis=1, keepdims=True)
    assert np.abs(got - caffe).max() < 1e-6


def test_export_without_output_cuts_at_the_nets_only_output(tmp_path, capsys):
    """The VehicleID net (VGG_CNN_M_1024) has no fc_embedding: its one output, fc7 (rewritten in place by
    relu7 and drop7), is the default; the model equals real Caffe's fc7."""
    out = tmp_path / "vgg.onnx"
    status = main(["export", str(fixture_path(f"{VGG}/deploy.prototxt")), "--weights",
                   str(fixture_path(f"{VGG}/weights.caffemodel")), "-o", str(out)])
    assert status == 0 and f"wrote {out}: blob 'fc7'" in capsys.readouterr().out
    assert read_metadata(out)["output_blob"] == "fc7"
    blobs = np.load(fixture_path(f"{VGG}/blobs.npz"))
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"data": blobs["data"]})[0]
    assert np.abs(got - blobs["fc7"]).max() <= 1e-5 * np.abs(blobs["fc7"]).max()


def test_export_unknown_blob_exit_2_lists_blobs_and_writes_nothing(tmp_path, capsys):
    status = main(["export", str(fixture_path(f"{VGG}/deploy.prototxt")), "--weights",
                   str(fixture_path(f"{VGG}/weights.caffemodel")), "-o", str(tmp_path / "x.onnx"), "--output", "fc8",
                   "--verify"])
    err = capsys.readouterr().err
    assert status == 2
    assert "caffe-compat export: error:" in err and "no blob named 'fc8'" in err and "fc7" in err and "pool5" in err
    assert list(tmp_path.iterdir()) == []


def test_export_verify_failure_exit_1_writes_nothing(tiny, tmp_path, capsys):
    _, prototxt, weights = tiny
    status = main(["export", str(prototxt), "--weights", str(weights), "-o", str(tmp_path / "x.onnx"), "--fp16",
                   "--verify", "--tolerance", "1e-9"])
    text = capsys.readouterr().out
    assert status == 1 and "verification FAILED" in text
    assert list(tmp_path.iterdir()) == []


def test_export_checkpoint_fixed_batch_preprocessing_file(tiny, tmp_path, capsys):
    from caffe_compat.checkpoint import save_checkpoint
    from caffe_compat.net import load_net

    _, prototxt, weights = tiny
    save_checkpoint(load_net(str(prototxt), str(weights)), tmp_path / "model.pt")
    (tmp_path / "prep.json").write_text(json.dumps(TINY_PREPROCESSING))
    out = tmp_path / "tiny.onnx"
    status = main(["export", str(prototxt), "--checkpoint", str(tmp_path / "model.pt"), "-o", str(out), "--batch", "4",
                   "--preprocessing", str(tmp_path / "prep.json"), "--opset", "14"])
    assert status == 0, capsys.readouterr()
    meta = read_metadata(out)
    assert meta["batch"] == 4 and meta["crop_size"] == 24 and meta["opset"] == 14


def test_export_preprocessing_file_encodings(tiny, tmp_path, capsys):
    """A .JSON name and a UTF-8 byte-order mark are a preprocessing file like any; a file that is not UTF-8
    is one line, exit 2 (it was a UnicodeDecodeError traceback)."""
    _, prototxt, weights = tiny
    (tmp_path / "PREP.JSON").write_bytes(b"\xef\xbb\xbf" + json.dumps(TINY_PREPROCESSING).encode())
    out = tmp_path / "tiny.onnx"
    args = ["export", str(prototxt), "--weights", str(weights), "-o", str(out), "--preprocessing"]
    assert main([*args, str(tmp_path / "PREP.JSON")]) == 0, capsys.readouterr()
    assert read_metadata(out)["crop_size"] == 24
    (tmp_path / "latin1.json").write_bytes(b'{"crop_size": 24, "note": "caf\xe9"}')
    out.unlink()
    capsys.readouterr()
    assert main([*args, str(tmp_path / "latin1.json")]) == 2
    assert "latin1.json: the preprocessing file is not UTF-8 text" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("args, message", [
    (["--batch", "zero"], "batch must be 'dynamic' or a positive int"),
    (["--opset", "7"], "opset must be in 11..20"),
    (["--preprocessing", "{not json"], "--preprocessing: not valid JSON"),
])
def test_export_bad_arguments_exit_2(tiny, tmp_path, capsys, args, message):
    _, prototxt, weights = tiny
    status = main(["export", str(prototxt), "--weights", str(weights), "-o", str(tmp_path / "x.onnx"), *args])
    assert status == 2 and message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_evaluate_prints_table_and_writes_json_and_plot(tiny, tmp_path, capsys):
    root, prototxt, weights = tiny
    model = tmp_path / "tiny.onnx"
    assert main(["export", str(prototxt), "--weights", str(weights), "-o", str(model), "--preprocessing",
                 json.dumps(TINY_PREPROCESSING)]) == 0
    cub = make_toy_data("cub", root / "cub", size=32)
    status = main(["evaluate", str(model), "--dataset", "cub200", "--data-root", str(cub), "--provider", "cpu",
                   "--batch-size", "32", "--json", str(tmp_path / "out.json"), "--plot", str(tmp_path / "curve.png"),
                   "--no-progress"])
    text = capsys.readouterr().out
    assert status == 0, text
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["provider"] == "CPUExecutionProvider" and result["num_images"] == 120
    assert "features: ONNX Runtime CPUExecutionProvider" in text
    row = [line for line in text.splitlines() if line.startswith("| tiny |")][0]
    assert f"{100 * result['recall_at_k']['1']:.1f}" in row and f"{100 * result['nmi']:.1f}" in row
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp files left


@pytest.mark.parametrize("name", ["curve.pdf", "curve.svg", "curve.jpg"])
def test_evaluate_plot_named_as_another_format_is_refused(tmp_path, capsys, name):
    """The plot is a PNG: a .pdf/.svg/.jpg name got PNG bytes; refused (exit 2) before anything runs."""
    status = main(["evaluate", str(tmp_path / "missing.onnx"), "--dataset", "cub200", "--data-root", str(tmp_path),
                   "--plot", str(tmp_path / name), "--json", str(tmp_path / "out.json")])
    assert status == 2
    assert f"--plot {tmp_path / name}: the plot is a PNG image; name it .png" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_evaluate_vehicleid_cmc_plot(tiny, tmp_path, capsys):
    root, prototxt, weights = tiny
    model = tmp_path / "tiny.onnx"
    assert main(["export", str(prototxt), "--weights", str(weights), "-o", str(model), "--preprocessing",
                 json.dumps(TINY_PREPROCESSING)]) == 0
    vehicles = make_toy_data("vehicleid", root / "vehicleid", size=32, num_classes=26, images_per_class=3)
    status = main(["evaluate", str(model), "--dataset", "vehicleid", "--data-root", str(vehicles), "--no-progress",
                   "--split", "small", "--plot", str(tmp_path / "cmc.png")])
    text = capsys.readouterr().out
    assert status == 0 and "Small Top 1" in text and " ± " in text
    assert (tmp_path / "cmc.png").stat().st_size > 1000


def test_evaluate_missing_data_root_exit_2_writes_nothing(tiny, tmp_path):
    root, prototxt, weights = tiny
    model = tmp_path / "tiny.onnx"
    assert main(["export", str(prototxt), "--weights", str(weights), "-o", str(model)]) == 0
    command = [sys.executable, "-m", "caffe_compat.cli", "evaluate", str(model), "--dataset", "sop", "--data-root",
               str(tmp_path / "nowhere"), "--json", str(tmp_path / "out.json")]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 2
    assert "caffe-compat evaluate: error:" in done.stderr and "nowhere does not exist" in done.stderr
    assert "Traceback" not in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.onnx"]

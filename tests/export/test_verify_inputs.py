"""``caffe-compat export --verify-input PATH``: fixture arrays and images compared besides the random batch.

The fixture case feeds the VGG_CNN_M_1024 fixture net the input blob real Caffe was run on (its
``blobs.npz``); ONNX Runtime must equal the PyTorch ports on it within the float32 tolerance (1e-4 max rel;
measured here ~7e-7).  Images are preprocessed from the model's metadata, as ``caffe-compat evaluate`` does.
Every bad input exits 2 with one line naming the file and what was expected, and leaves no ONNX file.
"""

from __future__ import annotations

import json
import subprocess
import sys

import cv2
import numpy as np
import onnxruntime as ort
import pytest

from caffe_compat.cli import main
from caffe_compat.errors import CaffeCompatError
from caffe_compat.export import export_onnx, read_metadata, verify_onnx
from caffe_compat.export.verify import FP32_TOLERANCE, load_verify_input
from tests.conftest import REPO, fixture_path
from tests.export.helpers import TINY_PREPROCESSING, write_tiny_net

VGG = "nets/vgg_cnn_m_1024_small"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify_inputs")
    prototxt, weights = write_tiny_net(root)
    return prototxt, weights


def _image(path, height=40, width=36, seed=0):
    """A random colour image written by OpenCV; returns the BGR array written."""
    image = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype(np.uint8)
    assert cv2.imwrite(str(path), image)
    return image


def _table(text) -> dict:
    """``{input: (batch, max_abs, max_rel)}`` from the verification table ``export`` prints."""
    rows = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[1].isdigit():
            rows[parts[0]] = (int(parts[1]), float(parts[2]), float(parts[3]))
    return rows


def _inputs_only(directory, *keep):
    """Nothing but the given inputs in ``directory``: no ONNX file, no hidden temporary file."""
    return sorted(p.name for p in directory.iterdir()) == sorted(keep)


def test_cli_fixture_npz_and_image_compared_with_random(tmp_path, capsys):
    blobs = np.load(fixture_path(f"{VGG}/blobs.npz"))
    np.savez(tmp_path / "fixture.npz", data=blobs["data"])  # the input blob Caffe computed the fixture with
    _image(tmp_path / "photo.jpg", 256, 300)
    out = tmp_path / "vgg.onnx"
    prep = {"resize": 256, "crop_size": 224, "mean_value": [104, 117, 123]}
    status = main(["export", str(fixture_path(f"{VGG}/deploy.prototxt")), "--weights",
                   str(fixture_path(f"{VGG}/weights.caffemodel")), "-o", str(out), "--output", "fc7",
                   "--preprocessing", json.dumps(prep), "--verify",
                   "--verify-input", str(tmp_path / "fixture.npz"), "--verify-input", str(tmp_path / "photo.jpg")])
    text = capsys.readouterr().out
    assert status == 0, text
    rows = _table(text)
    assert list(rows) == ["random", str(tmp_path / "fixture.npz"), str(tmp_path / "photo.jpg")], text
    assert rows["random"][0] == 2 and rows[str(tmp_path / "fixture.npz")][0] == 2
    assert rows[str(tmp_path / "photo.jpg")][0] == 1
    for batch, max_abs, max_rel in rows.values():
        assert 0 < max_rel <= FP32_TOLERANCE and max_abs > 0, text
    assert "verification passed" in text and f"wrote {out}" in text
    assert _inputs_only(tmp_path, "fixture.npz", "photo.jpg", "vgg.onnx")
    # the file written is the verified one: Caffe's fc7 on the fixture input
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"data": blobs["data"]})[0]
    assert np.abs(got - blobs["fc7"]).max() <= 1e-5 * np.abs(blobs["fc7"]).max()


def test_library_fixture_blobs_npz_by_input_blob_name(tmp_path):
    """A fixture's whole ``blobs.npz`` works: the array named after the input blob is used."""
    prototxt, weights = str(fixture_path(f"{VGG}/deploy.prototxt")), str(fixture_path(f"{VGG}/weights.caffemodel"))
    path = export_onnx(prototxt, weights=weights, output_blob="fc7", path=tmp_path / "vgg.onnx",
                       preprocessing={"resize": 224})
    blobs_npz = fixture_path(f"{VGG}/blobs.npz")
    np.testing.assert_array_equal(load_verify_input(blobs_npz, read_metadata(path)), np.load(blobs_npz)["data"])
    report = verify_onnx(path, prototxt=prototxt, weights=weights, inputs={"fixture": str(blobs_npz)}, random=True)
    assert list(report["cases"]) == ["random", "fixture"]
    assert report["passed"] and report["cases"]["fixture"]["max_rel"] <= FP32_TOLERANCE, report
    # without random=True, given inputs replace the random batch (the earlier behaviour)
    assert list(verify_onnx(path, prototxt=prototxt, weights=weights, inputs={"f": str(blobs_npz)})["cases"]) == ["f"]


def test_image_preprocessed_from_the_model_metadata(tiny, tmp_path):
    prototxt, weights = tiny
    path = export_onnx(str(prototxt), weights=str(weights), output_blob="fc_embedding", path=tmp_path / "t.onnx",
                       preprocessing=TINY_PREPROCESSING)
    image = _image(tmp_path / "x.png")  # png: lossless, so the expected blob is exact
    batch = load_verify_input(tmp_path / "x.png", read_metadata(path))
    # resize 28x28 (cv2 INTER_LINEAR), centre crop 24 at offset 2, BGR mean, scale 1/64
    resized = cv2.resize(image, (28, 28)).astype(np.float32)
    expected = (resized[2:26, 2:26] - np.float32([104, 117, 123])).transpose(2, 0, 1) * np.float32(1 / 64)
    assert batch.shape == (1, 3, 24, 24) and batch.dtype == np.float32
    np.testing.assert_allclose(batch[0], expected, rtol=0, atol=1e-6)


def test_image_zero_padded_to_a_fixed_batch_and_implies_verify(tiny, tmp_path, capsys):
    prototxt, weights = tiny
    _image(tmp_path / "x.png")
    status = main(["export", str(prototxt), "--weights", str(weights), "-o", str(tmp_path / "t.onnx"), "--batch", "3",
                   "--preprocessing", json.dumps(TINY_PREPROCESSING), "--verify-input", str(tmp_path / "x.png"),
                   "--verify-input", str(tmp_path / "x.png")])  # no --verify: --verify-input implies it
    text = capsys.readouterr().out
    assert status == 0, text
    assert "onnx.checker: passed" in text
    rows = _table(text)
    assert list(rows) == ["random", str(tmp_path / "x.png"), f"{tmp_path / 'x.png'}#2"]
    assert [r[0] for r in rows.values()] == [3, 3, 3]


def test_failure_above_tolerance_names_the_inputs_exit_1_writes_nothing(tiny, tmp_path, capsys):
    prototxt, weights = tiny
    np.save(tmp_path / "x.npy", (np.random.RandomState(1).randn(2, 3, 24, 24) * 50).astype(np.float32))
    status = main(["export", str(prototxt), "--weights", str(weights), "-o", str(tmp_path / "t.onnx"), "--fp16",
                   "--verify-input", str(tmp_path / "x.npy"), "--tolerance", "1e-9"])
    text = capsys.readouterr().out
    assert status == 1
    assert f"verification FAILED on random, {tmp_path / 'x.npy'}" in text and "not written" in text
    assert _inputs_only(tmp_path, "x.npy")


def _bad_input(tmp_path, kind):
    """(path, extra export args, expected message fragments) of one bad ``--verify-input``."""
    if kind == "missing":
        return tmp_path / "nowhere.npz", [], ["nowhere.npz: verification input not found", ".npy/.npz"]
    if kind == "directory":
        (tmp_path / "adir").mkdir()
        return tmp_path / "adir", [], ["adir: verification input is not a file"]
    if kind == "shape":
        np.save(tmp_path / "x.npy", np.zeros((2, 3, 32, 32), np.float32))
        return tmp_path / "x.npy", [], ["x.npy: shape (2, 3, 32, 32); expected", "(N, 3, 24, 24)"]
    if kind == "ndim":
        np.save(tmp_path / "x.npy", np.zeros((3, 24, 24), np.float32))
        return tmp_path / "x.npy", [], ["x.npy: shape (3, 24, 24); expected", "(N, 3, 24, 24)"]
    if kind == "npz_names":
        np.savez(tmp_path / "x.npz", a=np.zeros((1, 3, 24, 24)), b=np.zeros((1, 3, 24, 24)))
        return tmp_path / "x.npz", [], ["x.npz: holds 2 arrays ['a', 'b'] and none is named 'data'"]
    if kind == "npz_shape":
        np.savez(tmp_path / "x.npz", data=np.zeros((2, 1, 24, 24)))
        return tmp_path / "x.npz", [], ["x.npz['data']: shape (2, 1, 24, 24); expected", "(N, 3, 24, 24)"]
    if kind == "fixed_batch":
        np.save(tmp_path / "x.npy", np.zeros((2, 3, 24, 24), np.float32))
        return tmp_path / "x.npy", ["--batch", "4"], ["x.npy: batch 2; expected", "(4, 3, 24, 24)", "fixed"]
    if kind == "not_npy":
        (tmp_path / "x.npy").write_text("not an array")
        return tmp_path / "x.npy", [], ["x.npy: not a readable .npy file", "(N, 3, 24, 24)"]
    if kind == "nan":
        np.save(tmp_path / "x.npy", np.full((1, 3, 24, 24), np.nan, np.float32))
        return tmp_path / "x.npy", [], ["x.npy: contains NaN or infinite values"]
    if kind == "not_image":
        (tmp_path / "x.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
        return tmp_path / "x.jpg", [], ["x.jpg: could not open or find the image", "image file OpenCV can decode"]
    if kind == "image_size":  # no resize / crop stored: the image keeps its 40x36 size, the net takes 24x24
        _image(tmp_path / "x.png")
        prep = {"mean_value": [104, 117, 123]}
        return tmp_path / "x.png", ["--preprocessing", json.dumps(prep)], ["x.png: preprocessing gives shape "
                                                                          "(3, 40, 36), the model takes (3, 24, 24)"]
    raise AssertionError(kind)


BAD = ["missing", "directory", "shape", "ndim", "npz_names", "npz_shape", "fixed_batch", "not_npy", "nan", "not_image",
       "image_size"]


@pytest.mark.parametrize("kind", BAD)
def test_bad_verify_input_exit_2_one_line_nothing_written(tiny, tmp_path, capsys, kind):
    prototxt, weights = tiny
    work = tmp_path / "work"
    work.mkdir()
    bad, extra, fragments = _bad_input(work, kind)
    before = sorted(p.name for p in work.iterdir())
    status = main(["export", str(prototxt), "--weights", str(weights), "-o", str(work / "t.onnx"), *extra,
                   "--verify", "--verify-input", str(bad)])
    err = capsys.readouterr().err
    assert status == 2
    errors = [line for line in err.splitlines() if line.startswith("caffe-compat export: error:")]
    assert len(errors) == 1, err
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    assert sorted(p.name for p in work.iterdir()) == before  # no ONNX file, no temporary file


def test_bad_verify_input_subprocess_no_traceback_and_old_file_kept(tiny, tmp_path):
    prototxt, weights = tiny
    np.save(tmp_path / "x.npy", np.zeros((2, 3, 32, 32), np.float32))
    target = tmp_path / "t.onnx"
    target.write_bytes(b"previous model")
    command = [sys.executable, "-m", "caffe_compat.cli", "export", str(prototxt), "--weights", str(weights), "-o",
               str(target), "--verify-input", str(tmp_path / "x.npy")]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(f"caffe-compat export: error: {tmp_path / 'x.npy'}: shape")
    assert target.read_bytes() == b"previous model"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.onnx", "x.npy"]


def test_library_bad_path_raises_caffe_compat_error(tiny, tmp_path):
    prototxt, weights = tiny
    path = export_onnx(str(prototxt), weights=str(weights), output_blob="fc_embedding", path=tmp_path / "t.onnx",
                       preprocessing=TINY_PREPROCESSING)
    with pytest.raises(CaffeCompatError, match="nothing.npy: verification input not found"):
        verify_onnx(path, prototxt=str(prototxt), weights=str(weights), inputs={"x": str(tmp_path / "nothing.npy")})

"""Image paths whose bytes are not UTF-8 (a Latin-1 file name): OpenCV's ``cv2.imread`` binding cannot take
them and the process died of a segmentation fault (exit -11, a temporary file left behind); they are read and
decoded with ``cv2.imdecode`` instead (:func:`caffe_compat.io.image_header.imread`)."""

from __future__ import annotations

import os

import cv2
import numpy as np
import pytest

from caffe_compat.io.image_header import imread
from tests.cli.test_cli_errors import REPO, run_cli
from tests.conftest import fixture_path

NET = fixture_path("nets/googlenet_small/deploy.prototxt")
WEIGHTS = fixture_path("nets/googlenet_small/weights.caffemodel")
LATIN = b"caf\xe9"

pytestmark = pytest.mark.skipif(os.name == "nt", reason="POSIX file names are bytes")


def test_imread_decodes_a_latin1_named_image(tmp_path):
    image = np.arange(4 * 5 * 3, dtype=np.uint8).reshape(4, 5, 3)
    path = os.fsencode(tmp_path) + b"/" + LATIN + b".png"
    with open(path, "wb") as handle:
        handle.write(cv2.imencode(".png", image)[1].tobytes())
    assert np.array_equal(imread(os.fsdecode(path), cv2.IMREAD_COLOR), image)
    assert imread(os.fsdecode(path) + "x", cv2.IMREAD_COLOR) is None  # missing: None, as cv2.imread


def test_export_verify_input_with_a_latin1_name_exits_2(tmp_path):
    path = os.fsencode(tmp_path) + b"/" + LATIN + b".txt"
    with open(path, "wb") as handle:
        handle.write(b"not an image\n")
    done = run_cli("export", NET, "--weights", WEIGHTS, "-o", tmp_path / "e.onnx", "--verify-input", os.fsdecode(path))
    assert "Traceback" not in done.stderr
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "could not open or find the image (OpenCV could not decode it)" in done.stderr
    assert sorted(os.listdir(os.fsencode(tmp_path))) == [LATIN + b".txt"]  # no temporary model left


def test_make_toy_data_into_a_latin1_folder_writes_its_images(tmp_path):
    """``cv2.imwrite`` on such a path died of a segmentation fault too (exit -11): the toy sets encode in memory
    and write the bytes (the same encoder and defaults, so the same files)."""
    import subprocess
    import sys

    out = os.fsencode(tmp_path) + b"/" + LATIN
    done = subprocess.run([sys.executable, "-m", "caffe_compat.cli", "make-toy-data", "cub", out, "--size", "16"],
                          capture_output=True, timeout=120, cwd=REPO)  # bytes: stdout names the folder
    assert b"Traceback" not in done.stderr and done.returncode == 0, (done.returncode, done.stderr)
    images = [os.path.join(top, name) for top, _, names in os.walk(out) for name in names if name.endswith(b".jpg")]
    assert images and imread(os.fsdecode(images[0]), cv2.IMREAD_COLOR).shape == (16, 16, 3)

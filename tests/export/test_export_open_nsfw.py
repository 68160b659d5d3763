"""Yahoo's open_nsfw (ResNet-50 1by2 with BatchNorm + Scale, a published caffemodel) through ONNX Runtime.

There is no real-Caffe blob for this net, so the ONNX output is compared with the PyTorch ports (float32
tolerance) and with OpenCV's independent Caffe importer (``cv2.dnn``), on two real photos and on noise.
Its pooling: MAX 3x3 stride 2 with Caffe's ceil rounding after conv_1, global-size AVE 7x7 at the end.
"""

from __future__ import annotations

import cv2
import numpy as np
import onnxruntime as ort
import pytest

from caffe_compat.export import export_onnx, read_metadata, verify_onnx
from tests.export.helpers import assert_caffe_pooling_form
from tests.test_open_nsfw import INPUTS

PREPROCESSING = {"channel_order": "BGR", "resize": 256, "crop_size": 224, "mean_value": [104, 117, 123], "scale": 1.0}


@pytest.fixture(scope="module")
def nsfw(nsfw_dir, tmp_path_factory):
    prototxt, weights = str(nsfw_dir / "deploy.prototxt"), str(nsfw_dir / "resnet_50_1by2_nsfw.caffemodel")
    path = export_onnx(prototxt, weights=weights, output_blob="prob",
                       path=tmp_path_factory.mktemp("nsfw") / "nsfw.onnx", preprocessing=PREPROCESSING)
    return path, prototxt, weights


def test_open_nsfw_onnx_matches_pytorch_and_opencv(nsfw):
    path, prototxt, weights = nsfw
    cases = {kind: make() for kind, make in INPUTS.items()}
    report = verify_onnx(path, prototxt=prototxt, weights=weights, inputs=cases)
    assert report["passed"] and report["max_abs"] < 1e-5, report
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    reference = cv2.dnn.readNetFromCaffe(prototxt, weights)
    for kind, x in cases.items():
        prob = session.run(None, {"data": x})[0]
        reference.setInput(x)
        assert prob.shape == (2, 2)
        assert np.abs(prob - reference.forward()).max() < 1e-5, kind
    assert read_metadata(path)["crop_size"] == 224


def test_open_nsfw_pooling_form(nsfw):
    path, prototxt, _ = nsfw
    assert assert_caffe_pooling_form(path, prototxt) == 2

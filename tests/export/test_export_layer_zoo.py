"""Every layer-zoo output (and every pooling blob) exported alone and run by ONNX Runtime, against the
blobs real Caffe computed; layers that cannot be exported fail with an error naming layer and type.

The pooling blobs cover Caffe's quirks: MAX with pads and a clipped last row (``pool_max_clip``), AVE
with pads (``pool_ave_pad``) and with a window clipped at the padded edge (``pool_ave_clip``), ceil-rounded
partial windows without pads (``pool_ave_ceil``, ``pool_max_ceil``) and global pooling.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from caffe_compat.errors import FormatError
from caffe_compat.export import export_onnx, verify_onnx
from tests.conftest import fixture_path
from tests.export.helpers import assert_caffe_pooling_form

ZOO = "layer_zoo"
INFO = json.loads(fixture_path(f"{ZOO}/info.json").read_text())
POOLING = ["pool_max_clip", "pool_ave_pad", "pool_ave_clip", "pool_ave_ceil", "pool_max_ceil", "gpool_max", "gpool_ave"]
NO_BATCH_AXIS = ["red_mean"]  # Reduction over all axes: a scalar, no (N, D) embedding
BLOBS = sorted((set(INFO["outputs"]) | set(POOLING)) - set(NO_BATCH_AXIS))


def _run(path, feed):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: feed})[0]


@pytest.fixture(scope="module")
def caffe_blobs():
    return np.load(fixture_path(f"{ZOO}/blobs.npz"))


@pytest.mark.parametrize("blob", BLOBS)
def test_layer_zoo_blob_through_onnx_runtime_matches_caffe(blob, caffe_blobs, tmp_path):
    prototxt, weights = str(fixture_path(f"{ZOO}/deploy.prototxt")), str(fixture_path(f"{ZOO}/weights.caffemodel"))
    path = export_onnx(prototxt, weights=weights, output_blob=blob, path=tmp_path / "zoo.onnx",
                       batch=int(caffe_blobs["data"].shape[0]))
    data = caffe_blobs["data"]
    report = verify_onnx(path, prototxt=prototxt, weights=weights, inputs={"caffe_fixture": data})
    assert report["passed"] and report["max_rel"] < 1e-5, report
    caffe = caffe_blobs[blob].reshape(len(data), -1)
    got = _run(path, data)
    assert got.shape == caffe.shape
    assert np.abs(got - caffe).max() <= 2e-6 * max(1.0, np.abs(caffe).max()), np.abs(got - caffe).max()
    pooled = assert_caffe_pooling_form(path, prototxt)  # no window an ONNX runtime could read otherwise
    assert pooled >= (1 if blob in POOLING else 0)


def test_blob_without_batch_axis_is_refused(tmp_path):
    with pytest.raises(FormatError, match=r"blob 'red_mean' has shape \(\).*batch axis"):
        export_onnx(str(fixture_path(f"{ZOO}/deploy.prototxt")), output_blob="red_mean", path=tmp_path / "x.onnx")
    assert list(tmp_path.iterdir()) == []


def _inferred_output_dims(model) -> list:
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    dims = inferred.graph.output[0].type.tensor_type.shape.dim
    return [d.dim_value if d.HasField("dim_value") else None for d in dims]


def test_onnx_ceil_mode_pooling_declares_a_shape_caffe_does_not_produce(caffe_blobs):
    """Why the explicit form: ONNX's own ceil_mode AveragePool (pads 1, count_include_pad) follows the ONNX
    shape rule, which lacks Caffe's "drop a last window that starts in the padding": shape inference
    declares 8 x 7 where Caffe gives 7 x 6.  (ONNX Runtime 1.31's CPU kernel happens to compute 7 x 6 and
    only warns that it contradicts the model; other runtimes and versions follow the declared shape.)"""
    node = onnx.helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=[2, 2], strides=[2, 2], pads=[1, 1, 1, 1],
                                 ceil_mode=1, count_include_pad=1)
    x = caffe_blobs["data"]
    graph = onnx.helper.make_graph([node], "naive", [onnx.helper.make_tensor_value_info("x", 1, list(x.shape))],
                                   [onnx.helper.make_tensor_value_info("y", 1, None)])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)], ir_version=8)
    assert _inferred_output_dims(model) == [2, 6, 8, 7]
    assert caffe_blobs["pool_ave_clip"].shape == (2, 6, 7, 6)


@pytest.mark.parametrize("blob", POOLING)
def test_exported_pooling_declares_caffes_shape(blob, caffe_blobs, tmp_path):
    path = export_onnx(str(fixture_path(f"{ZOO}/deploy.prototxt")), output_blob=blob, path=tmp_path / "p.onnx", batch=2)
    assert _inferred_output_dims(onnx.load(str(path))) == [2, int(np.prod(caffe_blobs[blob].shape[1:]))]


@pytest.mark.parametrize("blob", ["argmax_flat_top3_val", "argmax_axis1_top2"])
def test_unexportable_layer_is_named_with_its_type(blob, tmp_path):
    d = "layer_zoo_nondiff"
    with pytest.raises(FormatError, match=rf"layer '{blob}' \(type ArgMax\) cannot be exported to ONNX opset 17"):
        export_onnx(str(fixture_path(f"{d}/deploy.prototxt")), weights=str(fixture_path(f"{d}/weights.caffemodel")),
                    output_blob=blob, path=tmp_path / "argmax.onnx")
    assert list(tmp_path.iterdir()) == []


def test_threshold_of_the_nondiff_zoo_exports(tmp_path):
    d = "layer_zoo_nondiff"
    blobs = np.load(fixture_path(f"{d}/blobs.npz"))
    path = export_onnx(str(fixture_path(f"{d}/deploy.prototxt")), weights=str(fixture_path(f"{d}/weights.caffemodel")),
                       output_blob="threshold", path=tmp_path / "threshold.onnx", preprocessing=None)
    np.testing.assert_array_equal(_run(path, blobs["data"]), blobs["threshold"].reshape(2, -1))

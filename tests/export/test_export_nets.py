"""Export + verify of the authors' embedding nets (GoogLeNet /4 and VGG_CNN_M_1024 /8 fixtures).

ONNX Runtime is compared with the PyTorch ports (float32 tolerance) and with the blob real Caffe
computed (``blobs.npz``: ``fc_embedding`` for GoogLeNet, post-relu7/drop7 ``fc7`` for VGG).  Measured on
this machine: GoogLeNet ORT vs PyTorch max abs 1.2e-6 (max rel 4.5e-7), VGG 4.2e-6 (7.3e-7).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from caffe_compat.errors import CaffeCompatError, FormatError
from caffe_compat.export import export_onnx, read_metadata, verify_onnx
from caffe_compat.export.onnx_export import build_embedder
from tests.export.helpers import assert_caffe_pooling_form, fixture_net_paths, run_onnx

NETS = {"googlenet_small": "fc_embedding", "vgg_cnn_m_1024_small": "fc7"}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = {}
    for name, blob in NETS.items():
        prototxt, weights, blobs = fixture_net_paths(name)
        path = export_onnx(prototxt, weights=weights, output_blob=blob,
                           path=tmp_path_factory.mktemp(name) / "embedder.onnx")
        out[name] = (path, prototxt, weights, blobs)
    return out


@pytest.mark.parametrize("name", sorted(NETS))
def test_verify_and_match_caffe(exported, name):
    path, prototxt, weights, blobs = exported[name]
    report = verify_onnx(path, prototxt=prototxt, weights=weights, inputs={"caffe_fixture": blobs["data"]})
    assert report["checker"] == "passed" and report["provider"] == "CPUExecutionProvider"
    assert report["passed"] and report["max_rel"] < 1e-5, report
    caffe = blobs[NETS[name]].reshape(len(blobs["data"]), -1)
    ours = run_onnx(path, blobs["data"])
    scale = np.abs(caffe).max()
    # Caffe's README: whole-net outputs agree to 1e-5 x scale even between its own BLAS thread counts
    assert np.abs(ours - caffe).max() <= 1e-5 * scale, (np.abs(ours - caffe).max(), scale)


@pytest.mark.parametrize("name", sorted(NETS))
def test_pooling_exports_without_ceil_mode_or_implicit_pads(exported, name):
    path, prototxt, _, _ = exported[name]
    assert assert_caffe_pooling_form(path, prototxt) == {"googlenet_small": 14, "vgg_cnn_m_1024_small": 3}[name]


def test_dynamic_batch_runs_batch_1_and_3(exported):
    path, prototxt, weights, _ = exported["googlenet_small"]
    model = onnx.load(str(path))
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    x = (np.random.RandomState(5).randn(3, 3, 224, 224) * 50).astype(np.float32)
    reference = build_embedder(prototxt, weights, output_blob="fc_embedding")
    with torch.no_grad():
        expected = reference(torch.from_numpy(x)).numpy()
    for batch in (1, 3):
        got = run_onnx(path, x[:batch])
        assert got.shape == (batch, 128)
        np.testing.assert_allclose(got, expected[:batch], rtol=0, atol=1e-5 * np.abs(expected).max())


def test_fixed_batch_refuses_another_size(tmp_path):
    prototxt, weights, blobs = fixture_net_paths("vgg_cnn_m_1024_small")
    path = export_onnx(prototxt, weights=weights, output_blob="fc7", path=tmp_path / "fixed.onnx", batch=2)
    assert read_metadata(path)["batch"] == 2
    assert onnx.load(str(path)).graph.input[0].type.tensor_type.shape.dim[0].dim_value == 2
    assert run_onnx(path, blobs["data"]).shape == (2, 128)
    with pytest.raises(Exception, match="(?i)dimension|shape"):
        run_onnx(path, blobs["data"][:1])
    with pytest.raises(CaffeCompatError, match="batch"):
        verify_onnx(path, prototxt=prototxt, weights=weights, inputs={"one": blobs["data"][:1]})


def test_normalize_gives_unit_rows_in_the_direction_of_the_embedding(exported, tmp_path):
    _, prototxt, weights, blobs = exported["googlenet_small"]
    path = export_onnx(prototxt, weights=weights, path=tmp_path / "unit.onnx", normalize=True)
    raw = blobs["fc_embedding"]
    got = run_onnx(path, blobs["data"])
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    np.testing.assert_allclose(got, raw / np.linalg.norm(raw, axis=1, keepdims=True), atol=1e-6)
    assert read_metadata(path)["normalize"] is True
    assert verify_onnx(path, prototxt=prototxt, weights=weights)["passed"]


def test_fp16_within_its_stated_tolerance(exported, tmp_path):
    _, prototxt, weights, blobs = exported["googlenet_small"]
    path = export_onnx(prototxt, weights=weights, path=tmp_path / "half.onnx", fp16=True)
    model = onnx.load(str(path))
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT  # I/O stays float32
    conv_weights = [i for i in model.graph.initializer if len(i.dims) == 4]
    assert conv_weights and all(i.data_type == onnx.TensorProto.FLOAT16 for i in conv_weights)
    report = verify_onnx(path, prototxt=prototxt, weights=weights, inputs={"caffe_fixture": blobs["data"]})
    assert report["fp16"] and report["tolerance"] == 1e-2
    # float16 loses precision (measured max rel ~7e-4) but stays within the stated 1e-2 of the output scale
    assert report["passed"] and 1e-5 < report["max_rel"] < 1e-2, report
    caffe = blobs["fc_embedding"]
    assert np.abs(run_onnx(path, blobs["data"]) - caffe).max() <= 1e-2 * np.abs(caffe).max()


def test_verify_flags_a_model_that_does_not_match(exported, tmp_path):
    path, prototxt, _, _ = exported["googlenet_small"]
    report = verify_onnx(path, prototxt=prototxt)  # filler weights instead of the trained ones
    assert not report["passed"] and report["max_rel"] > 0.1


def test_unknown_output_blob_lists_the_blobs_and_writes_nothing(tmp_path):
    prototxt, weights, _ = fixture_net_paths("vgg_cnn_m_1024_small")
    target = tmp_path / "never.onnx"
    with pytest.raises(FormatError, match=r"no blob named 'fc_embeding'.*fc6.*fc7"):
        export_onnx(prototxt, weights=weights, output_blob="fc_embeding", path=target)
    assert list(tmp_path.iterdir()) == []


def _test_phase_net(text, tmp_path):
    from caffe_compat.export.source import TestPhaseNet

    path = tmp_path / "net.prototxt"
    path.write_text('name: "n" layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 '
                    'dim: 4 dim: 4 } } }\n' + text)
    return TestPhaseNet(str(path))


IP = 'layer {{ name: "{0}" type: "InnerProduct" bottom: "{1}" top: "{0}" inner_product_param {{ num_output: 2 }} }}\n'
RELU = 'layer {{ name: "relu_{0}" type: "ReLU" bottom: "{0}" top: "{0}" }}\n'


@pytest.mark.parametrize("text, expected", [
    (IP.format("feat", "data") + RELU.format("feat"), "feat"),  # rewritten in place: still the output
    (IP.format("fc_embedding", "data") + IP.format("prob", "fc_embedding"), "fc_embedding"),  # embedding first
    (IP.format("a", "data") + IP.format("b", "a") + IP.format("c", "a"), None),  # two outputs: ask
])
def test_the_default_output_is_fc_embedding_else_the_nets_only_output(tmp_path, text, expected):
    net = _test_phase_net(text, tmp_path)
    if expected is not None:
        assert net.default_output() == expected
        return
    assert net.outputs() == ["b", "c"]
    with pytest.raises(FormatError, match=r"no blob named 'fc_embedding' and its outputs are 'b', 'c'; name the "
                                          r"blob to cut at \(export --output BLOB\)"):
        net.default_output()


def test_a_net_that_reads_data_layers_needs_its_output_named(tmp_path):
    """A training prototxt's outputs are its losses and labels: without fc_embedding nothing is guessed."""
    from caffe_compat.export.source import TestPhaseNet

    path = tmp_path / "train.prototxt"
    path.write_text('layer { name: "data" type: "ImageData" top: "data" top: "label" image_data_param { source: '
                    '"list.txt" batch_size: 2 } transform_param { crop_size: 4 } }\n' + IP.format("feat", "data"))
    with pytest.raises(FormatError, match=r"no blob named 'fc_embedding' and its TEST-phase net reads data layers "
                                          r"\('data'\)"):
        TestPhaseNet(str(path)).default_output()


def test_checkpoint_gives_the_same_model_as_the_caffemodel(exported, tmp_path):
    from caffe_compat.checkpoint import save_checkpoint
    from caffe_compat.net import load_net

    path, prototxt, weights, blobs = exported["vgg_cnn_m_1024_small"]
    save_checkpoint(load_net(prototxt, weights), tmp_path / "model.pt")
    from_checkpoint = export_onnx(prototxt, checkpoint=tmp_path / "model.pt", output_blob="fc7",
                                  path=tmp_path / "ckpt.onnx")
    np.testing.assert_array_equal(run_onnx(from_checkpoint, blobs["data"]), run_onnx(path, blobs["data"]))
    assert read_metadata(from_checkpoint)["source"]["checkpoint"] == str(tmp_path / "model.pt")
    with pytest.raises(CaffeCompatError, match="either"):
        export_onnx(prototxt, weights=weights, checkpoint=tmp_path / "model.pt", path=tmp_path / "x.onnx")


def test_lrn_and_max_pooling_export_without_pads_slices_or_pow(exported):
    """GoogLeNet's LRN layers as band convolutions with square roots, its MAX pooling as plain MaxPool nodes
    (their ceil-mode windows unambiguous): nothing that keeps ONNX Runtime out of its blocked layout."""
    from collections import Counter

    path, prototxt, *_ = exported["googlenet_small"]
    ops = Counter(node.op_type for node in onnx.load(str(path)).graph.node)
    assert ops["Pad"] == ops["Slice"] == ops["Pow"] == 0, ops
    assert ops["Sqrt"] == 2 * 2 and ops["MaxPool"] == 13 and ops["AveragePool"] == 1, ops
    assert ops["Conv"] == 57 + 2, ops   # the net's 57 convolutions and one band per LRN

"""``export_onnx(..., compile=True)`` / ``caffe-compat export --compile``: the graph captured by
``torch.export`` (one graph) and the dynamo exporter instead of the TorchScript tracer.

On the GoogLeNet /4 and VGG_CNN_M_1024 /8 fixtures the compiled model's ONNX Runtime outputs equal the
traced model's and PyTorch's within the verification tolerance, its metadata is the traced model's (same
opset), a dynamic batch runs at 1 and 3; the options (normalize, fuse, fp16, fixed batch, opset) hold;
the refusals (no onnxscript, opset < 18, a cut that is not one graph) are one line, exit 2, nothing written.
"""

from __future__ import annotations

import sys

import numpy as np
import onnx
import pytest
import torch

import caffe_compat
from caffe_compat.cli import main
from caffe_compat.errors import CaffeCompatError, FormatError
from caffe_compat.export import export_onnx, read_metadata, verify_onnx
from caffe_compat.export.onnx_export import build_embedder, whole_graph_blocker
from caffe_compat.export.verify import FP16_TOLERANCE, FP32_TOLERANCE
from caffe_compat.layers.python_user import unregister_python_layer
from tests.export.helpers import TINY_PREPROCESSING, assert_caffe_pooling_form, fixture_net_paths, pool_nodes, run_onnx, write_tiny_net

NETS = {"googlenet_small": "fc_embedding", "vgg_cnn_m_1024_small": "fc7"}
#: the fixture nets have no preprocessing of their own: the assumed one is what the tests compare
pytestmark = pytest.mark.filterwarnings("ignore::caffe_compat.export.notices.PreprocessingAssumedWarning")
NEEDS = "export --compile needs onnxscript (torch.onnx's dynamo exporter); pip install 'caffe-compat[compile]'"


def _needs_onnxscript():
    pytest.importorskip("onnxscript", reason=NEEDS)


def _rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Per net: the compiled export and the traced one at the same opset (18)."""
    _needs_onnxscript()
    out = {}
    for name, blob in NETS.items():
        prototxt, weights, blobs = fixture_net_paths(name)
        root = tmp_path_factory.mktemp(name)
        compiled = export_onnx(prototxt, weights=weights, output_blob=blob, path=root / "compiled.onnx", compile=True)
        traced = export_onnx(prototxt, weights=weights, output_blob=blob, path=root / "traced.onnx", opset=18)
        out[name] = (compiled, traced, prototxt, weights, blobs)
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    prototxt, weights = write_tiny_net(root)
    return prototxt, weights


# ------------------------------------------------------------------------------------------ the fixture nets

@pytest.mark.parametrize("name", sorted(NETS))
def test_compiled_equals_traced_and_pytorch_within_the_verify_tolerance(exported, name):
    compiled, traced, prototxt, weights, blobs = exported[name]
    x = blobs["data"]
    reference = build_embedder(prototxt, weights, output_blob=NETS[name])
    with torch.no_grad():
        expected = reference(torch.from_numpy(x)).numpy()
    got, before = run_onnx(compiled, x), run_onnx(traced, x)
    assert got.shape == before.shape == expected.shape
    assert _rel(got, expected) <= FP32_TOLERANCE and _rel(got, before) <= FP32_TOLERANCE
    report = verify_onnx(compiled, prototxt=prototxt, weights=weights, inputs={"caffe_fixture": x}, random=True)
    assert report["checker"] == "passed" and report["passed"] and report["tolerance"] == FP32_TOLERANCE, report
    caffe = blobs[NETS[name]].reshape(len(x), -1)
    assert np.abs(got - caffe).max() <= 1e-5 * np.abs(caffe).max()  # as the traced export (test_export_nets)


@pytest.mark.parametrize("name", sorted(NETS))
def test_compiled_metadata_is_the_traced_export_s(exported, name):
    compiled, traced, *_ = exported[name]
    props = {p.key: p.value for p in onnx.load(str(compiled)).metadata_props}
    assert props == {p.key: p.value for p in onnx.load(str(traced)).metadata_props}
    assert read_metadata(compiled) == read_metadata(traced)
    assert read_metadata(compiled)["opset"] == 18
    model = onnx.load(str(compiled))
    assert [(o.domain, o.version) for o in model.opset_import if o.domain in ("", "ai.onnx")] == [("", 18)]
    assert "torch.export" in model.doc_string and "torch.export" not in onnx.load(str(traced)).doc_string


@pytest.mark.parametrize("name", sorted(NETS))
def test_compiled_pooling_has_the_traced_export_s_windows(exported, name):
    compiled, traced, *_ = exported[name]
    assert assert_caffe_pooling_form(compiled) == {"googlenet_small": 14, "vgg_cnn_m_1024_small": 3}[name]

    def windows(path):
        keys = ("op_type", "kernel_shape", "strides", "pads", "ceil_mode")
        return [tuple(str(a.get(k)) for k in keys) for a in pool_nodes(path)]

    assert windows(compiled) == windows(traced)


def test_compiled_dynamic_batch_runs_batch_1_and_3(exported):
    compiled, _, prototxt, weights, _ = exported["googlenet_small"]
    graph = onnx.load(str(compiled)).graph
    assert graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    assert graph.output[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    x = (np.random.RandomState(5).randn(3, 3, 224, 224) * 50).astype(np.float32)
    reference = build_embedder(prototxt, weights, output_blob="fc_embedding")
    with torch.no_grad():
        expected = reference(torch.from_numpy(x)).numpy()
    for batch in (1, 3):
        got = run_onnx(compiled, x[:batch])
        assert got.shape == (batch, 128)
        assert _rel(got, expected[:batch]) <= FP32_TOLERANCE


# ------------------------------------------------------------------------------------------ the options

def test_compiled_options_normalize_fuse_fixed_batch_opset(tiny, tmp_path):
    _needs_onnxscript()
    prototxt, weights = tiny
    path = export_onnx(prototxt, weights=weights, path=tmp_path / "t.onnx", normalize=True, fuse=True, batch=3,
                       opset=20, preprocessing=dict(TINY_PREPROCESSING), compile=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.onnx"]  # written in place, no temp file left
    model = onnx.load(str(path))
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_value == 3
    meta = read_metadata(path)
    assert (meta["batch"], meta["opset"], meta["normalize"], meta["fuse"], meta["crop_size"]) == (3, 20, True, True, 24)
    x = (np.random.RandomState(1).randn(3, 3, 24, 24) * 50).astype(np.float32)
    np.testing.assert_allclose(np.linalg.norm(run_onnx(path, x), axis=1), 1.0, atol=1e-6)
    report = verify_onnx(path, prototxt=prototxt, weights=weights, inputs={"x": x})
    assert report["passed"], report
    with pytest.raises(Exception, match="(?i)dimension|shape"):
        run_onnx(path, x[:1])


def test_compiled_fp16_within_its_tolerance(tiny, tmp_path):
    _needs_onnxscript()
    prototxt, weights = tiny
    path = export_onnx(prototxt, weights=weights, path=tmp_path / "h.onnx", fp16=True, compile=True)
    model = onnx.load(str(path))
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert model.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    conv_weights = [i for i in model.graph.initializer if len(i.dims) == 4]
    assert conv_weights and all(i.data_type == onnx.TensorProto.FLOAT16 for i in conv_weights)
    report = verify_onnx(path, prototxt=prototxt, weights=weights)
    assert report["passed"] and report["tolerance"] == FP16_TOLERANCE, report


def test_compile_refuses_an_opset_below_18(tiny, tmp_path):
    _needs_onnxscript()
    prototxt, weights = tiny
    with pytest.raises(CaffeCompatError, match="needs opset 18..20"):
        export_onnx(prototxt, weights=weights, path=tmp_path / "x.onnx", opset=17, compile=True)
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------ not one graph

class Twice(caffe_compat.Layer):
    """A user Python layer: top = 2 * bottom, in NumPy."""

    def setup(self, bottom, top):
        pass

    def reshape(self, bottom, top):
        top[0].reshape(*bottom[0].data.shape)

    def forward(self, bottom, top):
        top[0].data[...] = 2 * bottom[0].data

    def backward(self, top, propagate_down, bottom):
        bottom[0].diff[...] = 2 * top[0].diff


PYTHON_NET = """
name: "python_in_the_cut"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 3 dim: 8 dim: 8 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 4 kernel_size: 3 weight_filler { type: "xavier" } } }
layer { name: "twice" type: "Python" bottom: "conv1" top: "twice"
  python_param { module: "cc_export_compile_test" layer: "Twice" } }
layer { name: "fc_embedding" type: "InnerProduct" bottom: "twice" top: "fc_embedding"
  inner_product_param { num_output: 5 weight_filler { type: "xavier" } } }
layer { name: "pyloss" type: "Python" bottom: "fc_embedding" top: "pyloss"
  python_param { module: "cc_export_compile_test" layer: "Twice" } }
"""


@pytest.fixture
def python_net(tmp_path):
    caffe_compat.register_python_layer("cc_export_compile_test", "Twice", Twice)
    prototxt = tmp_path / "python.prototxt"
    prototxt.write_text(PYTHON_NET)
    yield prototxt
    unregister_python_layer("cc_export_compile_test", "Twice")


def test_whole_graph_blocker_names_the_python_layer_of_the_cut_only(python_net):
    assert whole_graph_blocker(build_embedder(python_net, output_blob="fc_embedding")).name == "twice"
    assert whole_graph_blocker(build_embedder(python_net, output_blob="conv1")) is None  # the Python layers are outside


def test_compile_refuses_a_cut_that_is_not_one_graph(python_net, tmp_path):
    _needs_onnxscript()
    target = tmp_path / "out" / "x.onnx"
    target.parent.mkdir()
    with pytest.raises(FormatError, match=r"layer 'twice' \(type Python\).*not one graph"):
        export_onnx(python_net, path=target, compile=True)
    assert list(target.parent.iterdir()) == []


# ------------------------------------------------------------------------------------------ the command line

def test_cli_compile_verify_exit_0(tiny, tmp_path, capsys):
    _needs_onnxscript()
    prototxt, weights = tiny
    out = tmp_path / "t.onnx"
    status = main(["export", str(prototxt), "--weights", str(weights), "-o", str(out), "--compile", "--normalize",
                   "--verify"])
    text = capsys.readouterr().out
    assert status == 0, text
    assert "verification passed" in text and f"wrote {out}" in text and "opset 18" in text and "torch.export" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.onnx"]  # the verification temp file is gone
    assert read_metadata(out)["opset"] == 18


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("caffe-compat export: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_cli_compile_without_onnxscript_exit_2_one_line(tiny, tmp_path, capsys, monkeypatch):
    prototxt, weights = tiny
    monkeypatch.setitem(sys.modules, "onnxscript", None)  # `import onnxscript` raises ImportError
    status = main(["export", str(prototxt), "--weights", str(weights), "-o", str(tmp_path / "x.onnx"), "--compile",
                   "--verify"])
    line = _one_line_error(capsys)
    assert status == 2
    assert "onnxscript" in line and "pip install 'caffe-compat[compile]'" in line
    assert list(tmp_path.iterdir()) == []


def test_cli_compile_python_layer_exit_2_one_line(python_net, tmp_path, capsys):
    _needs_onnxscript()
    target = tmp_path / "out" / "x.onnx"
    target.parent.mkdir()
    from caffe_compat.net import load_net

    weights = tmp_path / "python.caffemodel"
    load_net(str(python_net)).save_caffemodel(weights)
    status = main(["export", str(python_net), "--weights", str(weights), "-o", str(target), "--compile", "--verify"])
    line = _one_line_error(capsys)
    assert status == 2 and "layer 'twice' (type Python)" in line and "without --compile" in line
    assert list(target.parent.iterdir()) == []


def test_cli_compile_opset_17_exit_2_one_line(tiny, tmp_path, capsys):
    _needs_onnxscript()
    prototxt, weights = tiny
    status = main(["export", str(prototxt), "--weights", str(weights), "-o", str(tmp_path / "x.onnx"), "--compile",
                   "--opset", "17"])
    assert status == 2 and "--compile needs opset 18..20" in _one_line_error(capsys)
    assert list(tmp_path.iterdir()) == []

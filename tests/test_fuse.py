"""Fused inference (:mod:`caffe_compat.fuse`) against the unfused net it comes from.

Two checks per net (the fixture nets and open_nsfw, skipped when ``.cache/nsfw`` is absent):

* per fused step, fed the **unfused** net's bottoms: ``|fused − unfused| ≤ 2·γ_(K+8)·(|W'|⋆|x| + B + |r|)``
  elementwise (:func:`caffe_compat.fuse_ops.step_error_bound`: float32 rounding of the folded weights and a
  different summation order of the K-term dot products, u = 2⁻²⁴);
* the whole net: ``max|fused − unfused| / max|unfused|`` over every blob both return ≤ ``FusedNet.tolerance()``
  (that one-step bound for the largest K).

Plus the semantics: folded blobs raise :class:`FoldedBlobError`, ``keep`` keeps them, the source net is left
bit-identical, eval mode is required, ``load_net(fuse=True)``, and ``export_onnx(fuse=True)`` verified
with ONNX Runtime against the unfused net.  Speed is measured by ``benchmarks/bench_forward.py``, not here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from caffe_compat.errors import CaffeCompatError
from caffe_compat.fuse import FoldedBlobError, FusedBlobs, fuse_for_inference
from caffe_compat.fuse_ops import FusedConvolution, FusedInnerProduct, step_error_bound
from caffe_compat.net import load_net
from tests.conftest import fixture_path

REPO = Path(__file__).resolve().parents[1]
NSFW = REPO / ".cache" / "nsfw"
NETS = {
    "googlenet_small": ("nets/googlenet_small/deploy.prototxt", "nets/googlenet_small/weights.caffemodel"),
    "vgg_cnn_m_1024_small": ("nets/vgg_cnn_m_1024_small/deploy.prototxt",
                             "nets/vgg_cnn_m_1024_small/weights.caffemodel"),
    "layer_zoo": ("layer_zoo/deploy.prototxt", "layer_zoo/weights.caffemodel"),
}


def _net(name):
    if name == "open_nsfw":
        weights = NSFW / "resnet_50_1by2_nsfw.caffemodel"
        if not weights.is_file():
            pytest.skip(f"open_nsfw not in {NSFW}: fetch it with `python -m caffe_compat.cli models fetch open_nsfw "
                        f"--cache .cache`")
        return load_net(str(NSFW / "deploy.prototxt"), str(weights)).eval()
    prototxt, weights = NETS[name]
    return load_net(str(fixture_path(prototxt)), str(fixture_path(weights))).eval()


def _inputs(net, batch=None):
    rng = np.random.RandomState(0)
    out = {}
    for name in net.feedable_names:
        shape = list(net.blob_shapes[name])
        if batch is not None:
            shape[0] = batch
        out[name] = torch.from_numpy((rng.randn(*shape) * 50).astype(np.float32))
    return out


def _unfused_values(net, inputs):
    """Every value of the unfused run, keyed like the fused steps (final values by blob name)."""
    with torch.no_grad():
        return net(**inputs)


@pytest.mark.parametrize("name", [*NETS, "open_nsfw"])
def test_fused_net_within_the_rounding_bound(name):
    net = _net(name)
    inputs = _inputs(net)
    fused = net.fuse_for_inference()
    reference = _unfused_values(net, inputs)
    out = fused(**inputs)
    assert isinstance(out, FusedBlobs) and set(out) <= set(reference)
    assert set(reference) - set(out) == set(fused.folded_blobs)
    tolerance = fused.tolerance()
    checked = 0
    with torch.inference_mode():
        for step in fused.steps:  # every fused step, fed the unfused bottoms
            module = fused.layers[step.module_key] if step.module_key else None
            if not isinstance(module, (FusedConvolution, FusedInnerProduct)):
                continue
            if any(b not in reference for b in step.bottoms) or step.tops[0] not in reference:
                continue  # an intermediate version of an in-place blob: not in the unfused Blobs
            bottoms = [reference[b] for b in step.bottoms]
            x, other = bottoms[0], (bottoms[1] if len(bottoms) > 1 else None)
            got = module(x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x, other)
            bound = step_error_bound(module, x, other)
            error = (got.double() - reference[step.tops[0]].double()).abs()
            assert bool((error <= bound).all()), (step.name, float((error - bound).max()))
            checked += 1
    worst = 0.0
    for blob, value in out.items():
        if value.is_floating_point():
            ref = reference[blob]
            scale = float(ref.abs().max())
            worst = max(worst, float((value - ref).abs().max()) / scale if scale else float((value - ref).abs().max()))
    print(f"{name}: {checked} fused steps checked, whole-net max rel {worst:.2e} (tolerance {tolerance:.2e})")
    assert worst <= max(tolerance, 1e-6), worst


def test_source_net_unchanged_and_faithful():
    net = _net("googlenet_small")
    inputs = _inputs(net)
    before = {k: v.clone() for k, v in _unfused_values(net, inputs).items()}
    fused = net.fuse_for_inference()
    fused(**inputs)
    after = _unfused_values(net, inputs)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not net.training


NET_TEXT = """
name: "chains"
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 2 dim: 3 dim: 9 dim: 9 } } }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 4 kernel_size: 3 pad: 1 weight_filler { type: "gaussian" std: 0.3 }
                      bias_filler { type: "gaussian" std: 0.5 } } }
layer { name: "bn1" type: "BatchNorm" bottom: "conv1" top: "bn1" batch_norm_param { eps: 0.001 } }
layer { name: "sc1" type: "Scale" bottom: "bn1" top: "sc1" scale_param { bias_term: true } }
layer { name: "relu1" type: "ReLU" bottom: "sc1" top: "sc1" relu_param { negative_slope: 0.2 } }
layer { name: "conv2" type: "Convolution" bottom: "sc1" top: "conv2"
  convolution_param { num_output: 4 kernel_size: 1 bias_term: false weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "bias2" type: "Bias" bottom: "conv2" top: "conv2" }
layer { name: "sum" type: "Eltwise" bottom: "conv2" bottom: "sc1" top: "sum" }
layer { name: "relu2" type: "ReLU" bottom: "sum" top: "sum" }
layer { name: "ip" type: "InnerProduct" bottom: "sum" top: "ip"
  inner_product_param { num_output: 5 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "bn3" type: "BatchNorm" bottom: "ip" top: "ip" }
layer { name: "relu3" type: "ReLU" bottom: "ip" top: "ip" }
"""


def _chains():
    net = load_net(NET_TEXT, seed=3)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in ("bn1", "bn3"):
            bn = net.layer(layer)
            bn.mean.copy_(torch.randn(bn.mean.shape, generator=gen) * 3)
            bn.variance.copy_(torch.rand(bn.variance.shape, generator=gen) * 5 + 0.1)
            bn.scale_factor.fill_(7.5)  # Caffe's moving-average factor: statistics are blob / 7.5
        sc = net.layer("sc1")
        sc.scale.copy_(torch.randn(sc.scale.shape, generator=gen))
        sc.bias.copy_(torch.randn(sc.bias.shape, generator=gen))
        net.layer("bias2").bias.copy_(torch.randn(4, generator=gen))
    return net.eval()


def test_out_of_place_chains_shortcut_and_inner_product():
    net = _chains()
    fused = fuse_for_inference(net)
    kinds = [s.type for s in fused.steps]
    assert "Convolution+BatchNorm+Scale+ReLU" in kinds
    assert "Convolution+Bias+Eltwise+ReLU" in kinds
    assert "InnerProduct+BatchNorm+ReLU" in kinds
    assert set(fused.folded_blobs) == {"conv1", "bn1", "conv2"}
    inputs = _inputs(net)
    ref = _unfused_values(net, inputs)
    out = fused(**inputs)
    for blob in ("sc1", "sum", "ip"):
        assert torch.allclose(out[blob], ref[blob], rtol=0, atol=fused.tolerance() * float(ref[blob].abs().max()))
    with pytest.raises(FoldedBlobError, match="blob 'bn1' is not computed in fused inference.*keep=") as info:
        out["bn1"]
    assert isinstance(info.value, KeyError) and isinstance(info.value, CaffeCompatError)
    with pytest.raises(KeyError):
        out["no_such_blob"]


def test_keep_stops_the_chain_and_contiguous_layout():
    net = _chains()
    fused = fuse_for_inference(net, keep=("bn1",), memory_format=torch.contiguous_format)
    assert set(fused.folded_blobs) == {"conv1", "conv2"}
    inputs = _inputs(net)
    out, ref = fused(**inputs), _unfused_values(net, inputs)
    assert torch.allclose(out["bn1"], ref["bn1"], rtol=0, atol=1e-5 * float(ref["bn1"].abs().max()))
    assert out["sum"].is_contiguous()
    with pytest.raises(CaffeCompatError, match="unknown blobs"):
        fuse_for_inference(net, keep=("nope",))


def test_zero_moving_average_factor_and_batch_sizes():
    net = _chains()
    with torch.no_grad():
        net.layer("bn1").scale_factor.zero_()  # Caffe: mean 0, variance 0 -> x / sqrt(eps)
    fused = net.fuse_for_inference()
    for batch in (1, 3):
        inputs = _inputs(net, batch)
        out, ref = fused(**inputs), _unfused_values(net, inputs)
        scale = float(ref["ip"].abs().max())
        assert float((out["ip"] - ref["ip"]).abs().max()) <= fused.tolerance() * scale


def test_needs_eval_mode_and_load_net_fuse():
    net = load_net(NET_TEXT).train()
    with pytest.raises(CaffeCompatError, match="eval mode"):
        net.fuse_for_inference()
    fused = load_net(NET_TEXT, fuse=True)
    assert type(fused).__name__ == "FusedNet" and fused.folded_blobs
    with torch.inference_mode():  # built from inference tensors (no version counters) it still runs
        made_inside = load_net(NET_TEXT, fuse=True)
    x = torch.randn(2, 3, 9, 9)
    assert torch.equal(made_inside(data=x)["ip"], fused(data=x)["ip"])


def test_export_fuse_verified_against_unfused(tmp_path):
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from caffe_compat.export import export_onnx, read_metadata, verify_onnx

    prototxt, weights = (str(fixture_path(p)) for p in NETS["googlenet_small"])
    path = export_onnx(prototxt, weights=weights, path=tmp_path / "g.onnx", fuse=True,
                       preprocessing={"resize": 224})
    meta = read_metadata(path)
    assert meta["fuse"] is True and meta["fuse_tolerance"] > 0
    report = verify_onnx(path)
    assert report["passed"] and report["tolerance"] == max(1e-4, meta["fuse_tolerance"]), report
    ops = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert "Conv" in ops and "Relu" in ops


def test_export_fuse_open_nsfw(tmp_path):
    pytest.importorskip("onnxruntime")
    from caffe_compat.export import export_onnx, verify_onnx

    weights = NSFW / "resnet_50_1by2_nsfw.caffemodel"
    if not weights.is_file():
        pytest.skip(f"open_nsfw not in {NSFW}")
    path = export_onnx(str(NSFW / "deploy.prototxt"), weights=str(weights), output_blob="fc_nsfw",
                       path=tmp_path / "n.onnx", fuse=True, preprocessing={"resize": 224})
    report = verify_onnx(path)
    assert report["passed"], report
    import onnx

    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert "BatchNormalization" not in ops and ops.count("Mul") == 0


def test_cli_export_fuse_verify(tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    import onnx

    from caffe_compat.cli import main

    net = _chains()
    prototxt, weights = tmp_path / "chains.prototxt", tmp_path / "chains.caffemodel"
    prototxt.write_text(NET_TEXT)
    net.save_caffemodel(str(weights))
    target = tmp_path / "chains.onnx"
    status = main(["export", str(prototxt), "--weights", str(weights), "-o", str(target), "--output", "ip",
                   "--fuse", "--verify", "--preprocessing", '{"resize": 9}'])
    out = capsys.readouterr().out
    assert status == 0 and "verification passed" in out and "fused" in out, out
    ops = [n.op_type for n in onnx.load(str(target)).graph.node]
    assert ops.count("Conv") == 2 and "Div" not in ops and "Sub" not in ops, ops


OVERHANG = """name: 'overhang'
layer { name: 'data' type: 'Input' top: 'data' input_param { shape { dim: 2 dim: 3 dim: 2 dim: 2 } } }
layer { name: 'conv' type: 'Convolution' bottom: 'data' top: 'conv'
  convolution_param { num_output: 4 kernel_size: 3 stride: 2 weight_filler { type: 'gaussian' std: 0.5 }
                      bias_filler { type: 'constant' value: 0.1 } } }
layer { name: 'relu' type: 'ReLU' bottom: 'conv' top: 'conv' }
"""


def test_a_kernel_overhanging_by_less_than_a_stride_fuses_to_caffes_output():
    # Caffe's C++ division: a 2x2 input, kernel 3, stride 2 gives one output, the overhang read as zeros;
    # the fused convolution appends the same zeros (with and without oneDNN's pointwise path)
    net = load_net(OVERHANG, seed=2).eval()
    fused = net.fuse_for_inference()
    assert [s.type for s in fused.steps if "Convolution" in s.type] == ["Convolution+ReLU"]
    inputs = _inputs(net)
    ref = _unfused_values(net, inputs)
    assert tuple(ref["conv"].shape) == (2, 4, 1, 1) and float(ref["conv"].abs().max()) > 0
    for grad in (False, True):  # autograd on: the plain F.conv2d path
        with torch.set_grad_enabled(grad):
            out = fused(**{k: v.requires_grad_(grad) for k, v in inputs.items()})
        torch.testing.assert_close(out["conv"].detach(), ref["conv"], rtol=0,
                                   atol=fused.tolerance() * float(ref["conv"].abs().max()))


def test_dilation_zero_fuses_to_the_unfused_output():
    # Caffe accepts dilation 0 (kernel extent 1: each kernel row reads one input row); the fused convolution
    # gets the same folded kernel as the port (torch's conv2d refuses a dilation of 0)
    text = OVERHANG.replace("kernel_size: 3 stride: 2", "kernel_size: 3 stride: 2 dilation: 0 dilation: 1")
    assert text != OVERHANG
    net = load_net(text, seed=2).eval()
    fused = net.fuse_for_inference()
    assert [s.type for s in fused.steps if "Convolution" in s.type] == ["Convolution+ReLU"]
    inputs = _inputs(net)
    ref = _unfused_values(net, inputs)
    out = fused(**inputs)
    torch.testing.assert_close(out["conv"], ref["conv"], rtol=0,
                               atol=fused.tolerance() * float(ref["conv"].abs().max()))

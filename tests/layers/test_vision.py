"""Vision layers (Convolution, Deconvolution, Pooling, InnerProduct) against real Caffe and closed forms.

Per layer, the layer_zoo fixture gives the bottom blob, the top blob, the top diff Caffe back-propagated
and the bottom/param diffs Caffe computed from it, so each port is checked on its own, forward and
backward, with Caffe's non-default parameters (group, dilation, _h/_w forms, clipped/ceil pooling,
transpose InnerProduct on axis 2).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from google.protobuf import text_format

from caffe_compat.errors import FormatError, ShapeMismatchError
from caffe_compat.layers import layer_class
from caffe_compat.layers.pooling import ave_pool_divisor
from caffe_compat.net import CaffeNet
from caffe_compat.proto import caffe_pb2
from tests.conftest import fixture_path

ZOO = "layer_zoo"
VISION_LAYERS = ["conv_g", "deconv", "conv_1x1_s", "pool_max_clip", "pool_ave_pad", "pool_ave_clip", "pool_ave_ceil",
                 "pool_max_ceil", "gpool_max", "gpool_ave", "ip_axis2_t", "ip1", "ip_s"]


@pytest.fixture(scope="module")
def zoo():
    net = CaffeNet(str(fixture_path(f"{ZOO}/deploy.prototxt")), weights=str(fixture_path(f"{ZOO}/weights.caffemodel")))
    return net, np.load(fixture_path(f"{ZOO}/blobs.npz")), np.load(fixture_path(f"{ZOO}/grads.npz"))


def _layer(text: str, bottom_shapes):
    param = text_format.Parse(text, caffe_pb2.LayerParameter())
    return layer_class(param)(param, bottom_shapes, "test")


def _rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


@pytest.mark.parametrize("name", VISION_LAYERS)
def test_layer_zoo_vision_layer_forward_backward(zoo, name):
    net, blobs, grads = zoo
    step = next(s for s in net.steps if s.name == name)
    module = net.layers[step.module_key]
    bottoms = [torch.tensor(blobs[b], requires_grad=True) for b in step.bottoms]
    (top,) = module(*bottoms)
    top_name = step.tops[0]
    overwritten = any(s.tops == (top_name,) and s.bottoms == (top_name,) for s in net.steps if s.name != name)
    if not overwritten:  # conv_g is rewritten in place by a leaky ReLU: its final value is checked net-wide
        assert top.shape == blobs[top_name].shape
        assert _rel(top.detach().numpy(), blobs[top_name]) < 1e-5
    top_diff = torch.from_numpy(grads[f"diff:{top_name}"])
    params = module.caffe_blobs()
    result = torch.autograd.grad(top, bottoms + params, top_diff)
    for b, g in zip(step.bottoms, result[:len(bottoms)]):
        assert _rel(g.numpy(), grads[f"diff:{b}"]) < 1e-4, b
    for i, g in enumerate(result[len(bottoms):]):
        assert _rel(g.numpy(), grads[f"param_diff:{name}:{i}"]) < 1e-4, i


def test_pooling_output_sizes_follow_caffe_rounding(zoo):
    net, blobs, _ = zoo
    # data 13x11: MAX k(2,3) s2 p1 -> 8 rows by ceil, clipped to 7 because (8-1)*2 >= 13+1
    assert net.blob_shapes["pool_max_clip"] == (2, 6, 7, 6)
    assert net.blob_shapes["pool_ave_ceil"] == blobs["pool_ave_ceil"].shape == (2, 4, 4, 6)
    floor = _layer('name: "p" type: "Pooling" pooling_param { pool: MAX kernel_size: 3 stride: 3 round_mode: FLOOR }',
                   [(1, 1, 11, 17)])
    assert floor.output_shapes() == [(1, 1, 3, 5)]
    assert floor(torch.randn(1, 1, 11, 17))[0].shape == (1, 1, 3, 5)


def test_ave_pooling_divisor_counts_padding_but_not_overhang():
    # H=4, k=3, s=2, p=1: windows [-1,2), [1,4), [3,6) -> clipped to [-1, 5): sizes 3, 3, 2
    assert ave_pool_divisor(4, 3, 3, 2, 1) == [3, 3, 2]
    layer = _layer('name: "p" type: "Pooling" pooling_param { pool: AVE kernel_h: 3 kernel_w: 1 stride_h: 2 '
                   'stride_w: 1 pad_h: 1 pad_w: 0 }', [(1, 1, 4, 1)])
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]).reshape(1, 1, 4, 1)
    assert layer(x)[0].flatten().tolist() == pytest.approx([(0 + 1 + 2) / 3, (2 + 3 + 4) / 3, 4 / 2])
    # no pad, k=3, s=2 on 4 values: ceil gives 2 windows, the partial one divides by its 2 in-range values
    nopad = _layer('name: "p" type: "Pooling" pooling_param { pool: AVE kernel_h: 3 kernel_w: 1 stride_h: 2 '
                   'stride_w: 1 }', [(1, 1, 4, 1)])
    assert nopad(x)[0].flatten().tolist() == pytest.approx([2.0, 3.5])


def test_max_pooling_never_selects_padding_and_mask_top():
    layer = _layer('name: "p" type: "Pooling" top: "p" top: "mask" pooling_param { pool: MAX kernel_size: 3 '
                   'stride: 2 pad: 1 }', [(1, 1, 4, 4)])
    x = -torch.arange(1.0, 17.0).reshape(1, 1, 4, 4)  # all negative: zero padding would win
    top, mask = layer(x)
    assert top.flatten().tolist() == [-1.0, -2.0, -4.0, -5.0, -6.0, -8.0, -13.0, -14.0, -16.0]
    assert mask.flatten().tolist() == [0.0, 1.0, 3.0, 4.0, 5.0, 7.0, 12.0, 13.0, 15.0]


def test_global_pooling_and_bad_parameters():
    ave = _layer('name: "g" type: "Pooling" pooling_param { pool: AVE global_pooling: true }', [(2, 3, 5, 7)])
    x = torch.randn(2, 3, 5, 7, dtype=torch.float64)
    torch.testing.assert_close(ave(x)[0], x.mean(dim=(2, 3), keepdim=True))
    # STOCHASTIC: PoolingLayer::LayerSetUp accepts it (without padding: "Padding implemented only for average and
    # max pooling"), its CPU Forward is NOT_IMPLEMENTED: the layer builds (a net loads), a forward raises
    stochastic = _layer('name: "s" type: "Pooling" pooling_param { pool: STOCHASTIC kernel_size: 2 stride: 2 }',
                        [(1, 1, 4, 4)])
    assert stochastic.output_shapes() == [(1, 1, 2, 2)]
    with pytest.raises(FormatError, match="STOCHASTIC pooling cannot run"):
        stochastic(torch.zeros(1, 1, 4, 4))
    with pytest.raises(FormatError, match="padding implemented only for average and max"):
        _layer('name: "s" type: "Pooling" pooling_param { pool: STOCHASTIC kernel_size: 2 pad: 1 }', [(1, 1, 4, 4)])
    with pytest.raises(FormatError, match="global_pooling"):
        _layer('name: "g" type: "Pooling" pooling_param { pool: MAX global_pooling: true stride: 2 }', [(1, 1, 4, 4)])
    with pytest.raises(FormatError, match="axis 1"):
        _layer('name: "c" type: "Convolution" convolution_param { num_output: 2 kernel_size: 1 axis: 2 }',
               [(1, 2, 3, 3)])
    with pytest.raises(FormatError, match="group"):
        _layer('name: "c" type: "Convolution" convolution_param { num_output: 3 kernel_size: 1 group: 2 }',
               [(1, 4, 3, 3)])


@pytest.mark.parametrize("fields", [
    "kernel_size: 3 pad_h: 1",                       # pad_h without pad_w
    "kernel_size: 3 pad_w: 1",                       # pad_w without pad_h
    "kernel_size: 3 pad: 1 pad_h: 1 pad_w: 1",       # pad with pad_h/pad_w
    "kernel_size: 3 stride_h: 2",                    # stride_h without stride_w
    "kernel_size: 3 stride: 2 stride_h: 2 stride_w: 1",
    "kernel_size: 3 kernel_h: 3 kernel_w: 2",        # kernel_size with kernel_h/kernel_w
    "global_pooling: true kernel_w: 2",
    "global_pooling: true stride_h: 1",              # stride_w unset: Caffe's stride check fails first
])
def test_pooling_refuses_the_field_combinations_caffe_checks(fields):
    # PoolingLayer::LayerSetUp: "pad is pad OR pad_h and pad_w are required", the same for stride, and
    # "Filter size is kernel_size OR kernel_h and kernel_w; not both"; with global pooling no kernel field.
    with pytest.raises(FormatError):
        _layer(f'name: "p" type: "Pooling" pooling_param {{ pool: MAX {fields} }}', [(1, 1, 6, 6)])


def test_pooling_kernel_size_with_one_stray_kernel_h_uses_kernel_size():
    # Caffe's kernel CHECK is !has_kernel_size != !(has_kernel_h && has_kernel_w): kernel_size with only
    # kernel_h passes, and kernel_size is the kernel.
    layer = _layer('name: "p" type: "Pooling" pooling_param { pool: MAX kernel_size: 3 kernel_h: 2 stride: 3 }',
                   [(1, 1, 6, 6)])
    assert layer.kernel == (3, 3) and layer.output_shapes() == [(1, 1, 2, 2)]


@pytest.mark.parametrize("fields", ["kernel_size: 3 kernel_h: 3 kernel_w: 3", "kernel_size: 3 stride: 1 stride_h: 1",
                                    "kernel_size: 3 pad: 1 pad_w: 1"])
def test_convolution_refuses_a_field_in_both_forms(fields):
    # BaseConvolutionLayer::LayerSetUp: "Either kernel_size or kernel_h/w should be specified; not both" (and
    # the same for stride and pad).
    with pytest.raises(FormatError, match="not both"):
        _layer(f'name: "c" type: "Convolution" convolution_param {{ num_output: 2 {fields} }}', [(1, 2, 6, 6)])
    with pytest.raises(FormatError, match="not both"):
        _layer(f'name: "d" type: "Deconvolution" convolution_param {{ num_output: 2 {fields} }}', [(1, 2, 6, 6)])


@pytest.mark.parametrize("text, shape", [
    ('pool: MAX kernel_size: 3 stride: 2 pad: 1', (2, 2, 7, 6)),
    ('pool: AVE kernel_h: 3 kernel_w: 2 stride_h: 2 stride_w: 3 pad_h: 1 pad_w: 1', (2, 2, 7, 8)),
    ('pool: AVE kernel_size: 3 stride: 3', (1, 2, 8, 7)),
])
def test_pooling_gradcheck(text, shape):
    layer = _layer(f'name: "p" type: "Pooling" pooling_param {{ {text} }}', [shape]).double()
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: layer(t)[0], (x,))


def test_convolution_and_deconvolution_are_adjoint_and_gradcheck():
    conv = _layer('name: "c" type: "Convolution" convolution_param { num_output: 4 group: 2 kernel_h: 3 kernel_w: 2 '
                  'stride_h: 2 stride_w: 1 pad_h: 1 pad_w: 0 dilation: 2 bias_term: false }', [(1, 4, 7, 5)]).double()
    # Caffe's Deconvolution weight is C_in x (C_out/group) x kh x kw: the same blob as the conv it transposes
    deconv = _layer('name: "d" type: "Deconvolution" convolution_param { num_output: 4 group: 2 kernel_h: 3 '
                    'kernel_w: 2 stride_h: 2 stride_w: 1 pad_h: 1 pad_w: 0 dilation: 2 bias_term: false }',
                    [conv.output_shapes()[0]]).double()
    assert conv.output_shapes() == [(1, 4, 3, 3)] and deconv.output_shapes() == [(1, 4, 7, 5)]
    assert tuple(conv.weight.shape) == (4, 2, 3, 2) and tuple(deconv.weight.shape) == (4, 2, 3, 2)
    with torch.no_grad():
        deconv.weight.copy_(torch.randn(4, 2, 3, 2, dtype=torch.float64))
        conv.weight.copy_(deconv.weight)
    x = torch.randn(1, 4, 7, 5, dtype=torch.float64, requires_grad=True)
    y = torch.randn(1, 4, 3, 3, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close((conv(x)[0] * y).sum(), (x * deconv(y)[0]).sum())
    assert torch.autograd.gradcheck(lambda t: conv(t)[0], (x,))
    assert torch.autograd.gradcheck(lambda t: deconv(t)[0], (y,))


def test_convolution_output_size_divides_as_cpp_ints():
    # ConvolutionLayer::compute_output_shape: (in + 2p - extent) / stride + 1 in C++ ints.  A 2x2 input, kernel 3,
    # stride 2: (2 - 3) / 2 + 1 = 0 + 1 = 1 (floor division would give 0: no output); im2col reads the
    # overhanging row and column as zeros, so the one output sees the 2x2 input under W[..., :2, :2].
    conv = _layer('name: "c" type: "Convolution" convolution_param { num_output: 3 kernel_size: 3 stride: 2 }',
                  [(2, 2, 2, 2)]).double()
    assert conv.output_shapes() == [(2, 3, 1, 1)]
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=g, dtype=torch.float64))
        conv.bias.copy_(torch.randn(3, generator=g, dtype=torch.float64))
    x = torch.randn(2, 2, 2, 2, generator=g, dtype=torch.float64, requires_grad=True)
    (y,) = conv(x)
    expected = torch.einsum("ocij,ncij->no", conv.weight[:, :, :2, :2], x) + conv.bias
    torch.testing.assert_close(y.reshape(2, 3), expected, rtol=1e-12, atol=1e-12)
    (gx,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(gx, conv.weight[:, :, :2, :2].sum(0).expand(2, 2, 2, 2), rtol=1e-12, atol=1e-12)
    # one stride or more of overhang is no output in Caffe either
    with pytest.raises(ShapeMismatchError):
        _layer('name: "c" type: "Convolution" convolution_param { num_output: 3 kernel_size: 3 stride: 1 }',
               [(1, 2, 1, 1)])


def test_inner_product_axis_and_transpose_closed_form():
    ip = _layer('name: "ip" type: "InnerProduct" inner_product_param { num_output: 3 axis: 2 transpose: true }',
                [(2, 4, 5, 2)]).double()
    assert tuple(ip.weight.shape) == (10, 3) and ip.output_shapes() == [(2, 4, 3)]
    with torch.no_grad():
        ip.weight.copy_(torch.randn(10, 3, dtype=torch.float64))
        ip.bias.copy_(torch.randn(3, dtype=torch.float64))
    x = torch.randn(2, 4, 5, 2, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(ip(x)[0], x.reshape(2, 4, 10) @ ip.weight + ip.bias)
    assert torch.autograd.gradcheck(lambda t: ip(t)[0], (x,))
    with pytest.raises(ShapeMismatchError, match="expect 10"):
        ip(torch.randn(2, 4, 3, 3, dtype=torch.float64))


def test_fillers_follow_the_prototxt():
    conv = _layer('name: "c" type: "Convolution" convolution_param { num_output: 8 kernel_size: 3 '
                  'weight_filler { type: "gaussian" std: 0.5 } bias_filler { type: "constant" value: 0.2 } }',
                  [(1, 16, 9, 9)])
    conv.fill(torch.Generator().manual_seed(3))
    assert torch.all(conv.bias == 0.2)
    assert 0.45 < float(conv.weight.detach().std()) < 0.55
    ip = _layer('name: "ip" type: "InnerProduct" inner_product_param { num_output: 4 }', [(2, 5)])
    ip.fill(torch.Generator().manual_seed(3))  # no filler given: Caffe's constant 0
    assert torch.count_nonzero(ip.weight) == 0 and torch.count_nonzero(ip.bias) == 0


def _caffe_pool_reference(x: np.ndarray, method: str, kernel, stride, pad, out) -> np.ndarray:
    """Caffe's PoolingLayer::Forward_cpu loops, written out (MAX over the clipped window; AVE summed over
    the clipped window and divided by the window clipped to [-pad, size + pad))."""
    n, c, height, width = x.shape
    top = np.zeros((n, c, *out), dtype=np.float64)
    for ph in range(out[0]):
        for pw in range(out[1]):
            h0, w0 = ph * stride[0] - pad[0], pw * stride[1] - pad[1]
            h1, w1 = min(h0 + kernel[0], height + pad[0]), min(w0 + kernel[1], width + pad[1])
            divisor = (h1 - h0) * (w1 - w0)
            h0, w0, h1, w1 = max(h0, 0), max(w0, 0), min(h1, height), min(w1, width)
            window = x[:, :, h0:h1, w0:w1].astype(np.float64)
            if window.size == 0:  # a window wholly past the end: Caffe's initial -FLT_MAX, or 0 / 0
                top[:, :, ph, pw] = np.finfo(np.float32).min if method == "MAX" else np.nan
            elif method == "MAX":
                top[:, :, ph, pw] = window.max(axis=(2, 3))
            else:
                top[:, :, ph, pw] = window.sum(axis=(2, 3)) / divisor
    return top


@pytest.mark.parametrize("method", ["MAX", "AVE"])
@pytest.mark.parametrize("size, kernel, stride, pad, rounding, fast", [
    ((112, 112), 3, 2, 0, "CEIL", True),    # GoogLeNet pool1
    ((28, 28), 3, 1, 1, "CEIL", True),      # inception pool branch
    ((13, 11), (2, 3), 2, 1, "CEIL", True),  # clipped by Caffe's pad rule
    ((9, 10), 3, 2, 1, "CEIL", True),
    ((11, 17), 3, 3, 0, "FLOOR", True),
    ((7, 8), 3, 2, 2, "CEIL", False),       # pad > kernel / 2: PyTorch refuses it
    ((9, 9), 2, 3, 0, "CEIL", False),       # window past the end without padding: sizes differ
])
def test_pooling_fast_and_explicit_paths_equal_caffe_loops(method, size, kernel, stride, pad, rounding, fast):
    """Eager mode takes PyTorch's padded/ceil pooling when its output size is Caffe's and the explicit
    pad + pool (+ divisor map) form otherwise and under ONNX export; both equal Caffe's loops."""
    kh, kw = (kernel, kernel) if isinstance(kernel, int) else kernel
    text = (f'name: "p" type: "Pooling" pooling_param {{ pool: {method} kernel_h: {kh} kernel_w: {kw} '
            f'stride: {stride} pad: {pad} round_mode: {rounding} }}')
    shape = (2, 3, *size)
    layer = _layer(text, [shape])
    x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(size)))
    k, s, p, out = layer.geometry_for(*size)
    assert layer._torch_matches(*size, k, s, p, out) is fast
    (eager,) = layer(x)
    (explicit,) = layer._explicit_pool(x, k, s, p, out)
    reference = _caffe_pool_reference(x.numpy(), method, k, s, p, out)
    if method == "MAX":
        assert np.array_equal(eager.numpy(), reference.astype(np.float32))
        assert np.array_equal(explicit.numpy(), reference.astype(np.float32))
    else:
        np.testing.assert_allclose(eager.numpy(), reference, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(explicit.numpy(), reference, rtol=1e-6, atol=1e-6)
    if method == "MAX":
        masked = _layer(text.replace('type: "Pooling"', 'type: "Pooling" top: "p" top: "mask"'), [shape])
        top, mask = masked(x)
        flat = x.reshape(2, 3, -1)
        empty = mask < 0
        assert torch.equal(empty, torch.from_numpy(reference == np.finfo(np.float32).min))
        picked = torch.gather(flat, 2, mask.long().clamp(min=0).reshape(2, 3, -1)).reshape(top.shape)
        assert torch.equal(picked[~empty], top[~empty])


def _caffe_conv_loops(x, w, stride, pad, dilation, transposed=False):
    """Caffe's (de)convolution as its im2col/col2im loops do it: input element ``o·s − p + k·d`` meets kernel
    offset ``k`` (one image, group 1; no bias)."""
    c_in, h, wd = x.shape
    k_h, k_w = w.shape[2:]
    if transposed:  # col2im: input position i writes output element i·s − p + k·d
        oh = stride[0] * (h - 1) + dilation[0] * (k_h - 1) + 1 - 2 * pad[0]
        ow = stride[1] * (wd - 1) + dilation[1] * (k_w - 1) + 1 - 2 * pad[1]
        y = np.zeros((w.shape[1], oh, ow))
        for c, i, j, kh, kw in np.ndindex(c_in, h, wd, k_h, k_w):
            r, q = i * stride[0] - pad[0] + kh * dilation[0], j * stride[1] - pad[1] + kw * dilation[1]
            if 0 <= r < oh and 0 <= q < ow:
                y[:, r, q] += x[c, i, j] * w[c, :, kh, kw]
        return y
    oh = (h + 2 * pad[0] - (dilation[0] * (k_h - 1) + 1)) // stride[0] + 1
    ow = (wd + 2 * pad[1] - (dilation[1] * (k_w - 1) + 1)) // stride[1] + 1
    y = np.zeros((w.shape[0], oh, ow))
    for i, j, c, kh, kw in np.ndindex(oh, ow, c_in, k_h, k_w):
        r, q = i * stride[0] - pad[0] + kh * dilation[0], j * stride[1] - pad[1] + kw * dilation[1]
        if 0 <= r < h and 0 <= q < wd:
            y[:, i, j] += w[:, c, kh, kw] * x[c, r, q]
    return y


@pytest.mark.parametrize("kind", ["Convolution", "Deconvolution"])
@pytest.mark.parametrize("dilation", [(0, 0), (0, 2), (2, 0)])
def test_dilation_zero_is_caffes_kernel_extent_one(kind, dilation):
    """base_conv_layer.cpp checks kernel and stride > 0 but never dilation (a uint32): with dilation 0 every
    kernel offset on that axis reads (col2im: writes) one element, the extent ``0·(k − 1) + 1`` is 1."""
    spec = " ".join(f"dilation: {d}" for d in dilation)
    layer = _layer(f'name: "c" type: "{kind}" convolution_param {{ num_output: 2 kernel_size: 3 stride: 2 pad: 1 '
                   f'{spec} bias_term: false }}', [(1, 3, 5, 6)]).double()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=g, dtype=torch.float64))
    x = torch.randn(1, 3, 5, 6, generator=g, dtype=torch.float64, requires_grad=True)
    (y,) = layer(x)
    expected = _caffe_conv_loops(x.detach()[0].numpy(), layer.weight.detach().numpy(), (2, 2), (1, 1), dilation,
                                 transposed=kind == "Deconvolution")
    assert layer.output_shapes() == [(1, 2) + expected.shape[1:]] == [tuple(y.shape)]
    np.testing.assert_allclose(y.detach()[0].numpy(), expected, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda t: layer(t)[0], (x,))


def test_inner_product_of_an_empty_batch_is_an_empty_top():
    # InnerProductLayer: M_ = count(0, axis) = 0, a gemm with M = 0: an empty (0, N) top and no weight gradient
    # (we raised a reshape RuntimeError: x.reshape(0, -1) is ambiguous)
    layer = _layer('name: "ip" type: "InnerProduct" inner_product_param { num_output: 2 }', [(0, 3)])
    x = torch.zeros(0, 3, requires_grad=True)
    (y,) = layer(x)
    assert tuple(y.shape) == (0, 2) == layer.output_shapes()[0]
    (gw,) = torch.autograd.grad(y.sum(), layer.weight)
    assert torch.equal(gw, torch.zeros(2, 3))


def test_a_net_with_stochastic_pooling_loads_and_its_forward_raises():
    # Caffe builds the net (Net::Init runs LayerSetUp and Reshape only); Forward_cpu aborts with NOT_IMPLEMENTED
    net = CaffeNet('layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 1 dim: 2 dim: 4 '
                   'dim: 4 } } }\nlayer { name: "conv" type: "Convolution" bottom: "data" top: "conv" '
                   'convolution_param { num_output: 3 kernel_size: 1 } }\nlayer { name: "pool" type: "Pooling" '
                   'bottom: "conv" top: "pool" pooling_param { pool: STOCHASTIC kernel_size: 2 stride: 2 } }')
    assert net.blob_shapes["pool"] == (1, 3, 2, 2)
    with pytest.raises(FormatError, match="STOCHASTIC pooling cannot run"):
        net(data=torch.zeros(1, 2, 4, 4))


@pytest.mark.parametrize("pool, tops", [("MAX", 1), ("MAX", 2), ("AVE", 1)])
def test_pooling_with_no_channel_gives_caffes_empty_top(pool, tops):
    # PoolingLayer::Reshape: top (N, 0, H', W'); Forward_cpu's channel loops run zero times (no CHECK on C).
    # We raised torch's RuntimeError (max_pool2d/avg_pool2d refuse C = 0).
    top = ' top: "mask"' if tops == 2 else ""
    port = _layer(f'type: "Pooling" top: "y"{top} pooling_param {{ pool: {pool} kernel_size: 3 stride: 2 }}',
                  [(2, 0, 5, 5)])
    x = torch.zeros(2, 0, 5, 5, requires_grad=True)
    outs = port(x)
    assert [tuple(o.shape) for o in outs] == [(2, 0, 2, 2)] * tops == [tuple(s) for s in port.output_shapes()]
    (gx,) = torch.autograd.grad(outs[0].sum(), x, allow_unused=True)
    assert gx is None or gx.shape == x.shape


@pytest.mark.parametrize("spec, shape, top", [
    ("kernel_size: 3 stride: 2", (2, 3, 1, 1), (2, 3, 0, 0)),  # CEIL: ceil((1 - 3) / 2) + 1 = 0
    ("kernel_size: 3 stride: 2 pool: AVE", (2, 3, 1, 5), (2, 3, 0, 2)),
    ("kernel_size: 1", (2, 3, 0, 4), (2, 3, 0, 4)),  # an empty input plane
])
def test_pooling_with_a_pooled_size_of_0_gives_caffes_empty_top(spec, shape, top):
    # PoolingLayer::Reshape: top (N, C, 0, W') (Blob::Reshape CHECKs only dims >= 0); Forward_cpu's window loops run
    # zero times and Backward_cpu zeroes the bottom diff.  We refused it (FormatError in a net, torch's RuntimeError
    # standalone); a negative pooled size stays refused (Caffe's CHECK).
    text = f'type: "Pooling" top: "y" pooling_param {{ {spec} }}'
    net = CaffeNet(text_format.Parse(f'layer {{ name: "in" type: "Input" top: "x" input_param {{ shape {{ '
                                     f'{" ".join(f"dim: {d}" for d in shape)} }} }} }} '
                                     f'layer {{ name: "p" bottom: "x" {text} }}', caffe_pb2.NetParameter()))
    assert tuple(net.blob_shapes["y"]) == top
    port = _layer(text, [shape])
    x = torch.randn(shape, requires_grad=True)
    (y,) = port(x)
    assert tuple(y.shape) == top
    y.sum().backward()
    assert x.grad.shape == x.shape and not x.grad.any()


@pytest.mark.parametrize("kind", ["Convolution", "Deconvolution"])
def test_convolution_with_no_channel_is_a_format_error(kind):
    # BaseConvolutionLayer::LayerSetUp fills the weight (num_output x 0 x k x k, Deconvolution 0 x num_output x k x k)
    # and filler.hpp's fillers CHECK(count).  Standalone we built it: Convolution gave a (2, 0, 4, 4) top against its
    # (2, 2, 4, 4) shape rule, Deconvolution raised torch's RuntimeError.
    with pytest.raises(FormatError, match="no channel"):
        _layer(f'type: "{kind}" convolution_param {{ num_output: 2 kernel_size: 1 }}', [(2, 0, 4, 4)])


EMPTY_OUTPUT = [  # (type, geometry, bottom, Caffe's top): compute_output_shape gives a 0 that Blob::Reshape accepts
    ("Convolution", "kernel_size: 1", (2, 3, 0, 4), (2, 2, 0, 4)),
    ("Convolution", "kernel_size: 3 stride: 2", (2, 3, 1, 1), (2, 2, 0, 0)),  # trunc((1 - 3) / 2) + 1 = 0
    ("Convolution", "kernel_size: 3", (2, 3, 2, 5), (2, 2, 0, 3)),  # (2 - 3) / 1 + 1 = 0
    ("Convolution", "kernel_size: 4 stride: 2", (2, 3, 1, 5), (2, 2, 0, 1)),  # trunc(-3 / 2) + 1 = 0, not floor's -1
    ("Deconvolution", "kernel_size: 1", (2, 3, 4, 0), (2, 2, 4, 0)),  # 1·(0 - 1) + 1 = 0
    ("Deconvolution", "kernel_size: 2 pad: 1", (2, 3, 1, 3), (2, 2, 0, 2)),  # 1·(1 - 1) + 2 - 2 = 0
]


def _conv_net(kind, spec, shape):
    from caffe_compat.net import load_net
    dims = " ".join(f"dim: {d}" for d in shape)
    return load_net(f'''layer {{ name: "in" type: "Input" top: "x" input_param {{ shape {{ {dims} }} }} }}
        layer {{ name: "conv" type: "{kind}" bottom: "x" top: "y"
                 convolution_param {{ num_output: 2 {spec} weight_filler {{ type: "constant" value: 1 }}
                                      bias_filler {{ type: "constant" value: 0.5 }} }} }}''', phase="train")


@pytest.mark.parametrize("kind, spec, fed, top", EMPTY_OUTPUT)
def test_convolution_with_an_output_size_of_zero_gives_caffes_empty_top(kind, spec, fed, top):
    # BaseConvolutionLayer::Reshape shapes the top with compute_output_shape's sizes and Blob::Reshape only
    # CHECK_GE(dim, 0): a 0 is an empty top and the net builds (a deploy net declared small and reshaped before
    # its first forward needs that).  Caffe's forward would then CHECK-fail on the never-allocated empty top
    # (SyncedMemory of 0 bytes); ours runs it, computing nothing.  We refused it with a ShapeMismatchError
    # ("gives an empty output"), at setup and at run time.
    net = _conv_net(kind, spec, fed)
    assert tuple(net.blob_shapes["y"]) == top
    net.force_backward = True
    blobs = net.forward(x=torch.ones(fed))
    assert tuple(blobs["y"].shape) == top
    net.backward(blobs, {"y": torch.ones(top)})
    conv = net.layers[next(s.module_key for s in net.steps if s.name == "conv")]
    assert not conv.weight.grad.any() and not conv.bias.grad.any()  # nothing accumulated (no output position)
    # a net set up for (2, 3, 8, 8) and fed the plane at run time (no shape rule re-run) gives the same top
    port = _layer(f'type: "{kind}" convolution_param {{ num_output: 2 {spec} }}', [(2, 3, 8, 8)])
    x = torch.ones(fed, requires_grad=True)
    (y,) = port(x)
    assert tuple(y.shape) == top
    y.sum().backward()
    assert x.grad.shape == x.shape and not x.grad.any()
    assert tuple(port(torch.zeros(2, 3, 5, 5))[0].shape[:2]) == (2, 2)


@pytest.mark.parametrize("kind, spec, fed, top", [
    ("Convolution", "kernel_size: 1 pad: 1", (2, 3, 0, 4), (2, 2, 2, 6)),  # (0 + 2 - 1) / 1 + 1 = 2
    ("Deconvolution", "kernel_size: 3", (2, 3, 4, 0), (2, 2, 6, 2)),  # 1·(0 - 1) + 3 = 2
])
def test_convolution_of_an_empty_plane_with_outputs_gives_the_bias(kind, spec, fed, top):
    # an empty input plane whose geometry still gives outputs: Convolution's im2col reads only padding zeros,
    # Deconvolution's col2im zeroes the top and adds nothing, so every output is the bias (forward_cpu_bias) and
    # the bias's gradient sums the top's (backward_cpu_bias), the weight's stays 0.  We raised torch's RuntimeError.
    net = _conv_net(kind, spec, fed)
    net.force_backward = True
    blobs = net.forward(x=torch.zeros(fed))
    assert tuple(blobs["y"].shape) == top and bool((blobs["y"] == 0.5).all())
    net.backward(blobs, {"y": torch.ones(top)})
    conv = net.layers[next(s.module_key for s in net.steps if s.name == "conv")]
    assert not conv.weight.grad.any()
    assert conv.bias.grad.tolist() == [top[0] * top[2] * top[3]] * 2


@pytest.mark.parametrize("kind, spec, fed", [
    ("Convolution", "kernel_size: 5", (2, 3, 1, 1)),  # (1 - 5) / 1 + 1 = -3
    ("Convolution", "kernel_size: 4 stride: 2", (2, 3, 0, 5)),  # trunc((0 - 4) / 2) + 1 = -1
    ("Deconvolution", "kernel_size: 1 pad: 1", (2, 3, 1, 1)),  # 1·0 + 1 - 2 = -1
])
def test_convolution_with_a_negative_output_size_is_a_shape_mismatch_error(kind, spec, fed):
    # Blob::Reshape CHECK_GE(dim, 0) on the top: Caffe aborts; we refuse at setup and at run time, naming the layer
    port = _layer(f'type: "{kind}" name: "c" convolution_param {{ num_output: 2 {spec} }}', [(2, 3, 8, 8)])
    with pytest.raises(ShapeMismatchError, match="layer 'c'.*negative output size"):
        port(torch.zeros(fed))
    with pytest.raises(ShapeMismatchError, match="layer 'conv'.*negative output size"):
        _conv_net(kind, spec, fed)

"""Whole published Caffe architectures, at small width, against OpenCV's independent Caffe importer.

The per-layer references from real Caffe are in ``tests/fixtures/layer_zoo``; this module checks the
*composition* of layers as the classic published nets compose them (in-place chains, automatic Splits,
grouped and depthwise convolutions, BatchNorm + Scale with a stored moving-average factor, Eltwise
shortcuts, FCN's Deconvolution + Crop skips, ceil-rounded pooling), on nets this library was never
loaded with.  Each prototxt below is written from the architecture's published structure (layer types,
order, parameters such as LRN's ``local_size 5 alpha 1e-4 beta 0.75``, fire modules, bottlenecks), with
fewer channels and a small input chosen so that Caffe's ceil rounding of the pooled size changes it.

Per net: our ``CaffeNet`` is built, its blobs filled from a seeded ``torch.Generator`` (BatchNorm
statistics set from the batch's own per-channel statistics, perturbed, and stored multiplied by a
moving-average factor that is 1 for some layers and ~1000 for others, as a trained caffemodel stores
them), written as a caffemodel with ``CaffeNet.save_caffemodel`` (``Net::ToProto``'s V2 format), then
loaded by ``caffe_compat.net.load_net`` and by ``cv2.dnn.readNetFromCaffe``.  Compared in float32: the
final output (OpenCV's default fused net and its unfused net) and every intermediate blob OpenCV returns
with fusion off, each against the output of the *last* layer that wrote it (our blobs hold the
post-in-place value, as pycaffe's).

Tolerance (derived, not tuned): a float32 sum of n terms has a relative error of at most ~n*u
(u = 2^-24, Higham's gamma_n); two independent implementations differ by at most twice that, i.e.
eps32 * n with eps32 = 2^-23.  Errors of earlier layers reach a blob with gain ~1 relative to its
magnitude (He-scaled weights, BatchNorm statistics taken from the data: activations stay O(1) relative
to their inputs), so a blob may differ, relative to its largest magnitude, by at most
``eps32 * N_b`` where N_b adds the terms per output element of every layer the blob depends on
(:func:`terms_per_output`: Convolution C_in/group*kh*kw + 1, InnerProduct K + 1, AVE pooling kh*kw + 1,
LRN local_size + 4, Softmax C + 4, transcendental ops 4, data movement 0, ...).

Measured on OpenCV 4.14 (and 4.5.4, CI's oldest), every blob of every net is within 1.5e-6 relative
(at most 7 % of its bound); a deliberate error in our net (one weight of 144 moved by 0.01, LRN beta
0.75 -> 0.7, Eltwise coeffs swapped, the BatchNorm factor ignored, Crop offsets swapped, Power shift
1 -> 1.001, ...) exceeds the bound 30x to 10^6x.  On a failure the message also gives, per failing blob,
both sides' error against our own float64 forward: a rounding problem shows in our float32 error, a
difference of semantics as ours small and OpenCV's large (then Caffe's source decides who is right).

No Caffe-semantics deviation of OpenCV was hit in these nets (it agrees with Caffe on ceil pooling,
including the dropped window that would start in the padding and AVE's divisor counting padding; LRN;
grouped Deconvolution; per-axis Crop offsets; BatchNorm's stored factor; channel-shared PReLU).  Two
OpenCV behaviours are worked around (see :func:`_opencv` and :func:`compare_with_opencv`):

* OpenCV >= 4.7 runs 3x3 stride-1 convolutions with Winograd F(6x6,3x3) by default: a different
  rounding, not a different result, but its error (measured 3.5e-6 relative on fcn's conv1_1 against a
  float64 forward, where a direct sum has 1.9e-7) is outside the direct-summation bound above.  Caffe
  sums directly (im2col + GEMM), so the test turns Winograd off (``enableWinograd(False)``).
* ``forwardAndRetrieve`` keeps only output 0 of a requested layer out of OpenCV's memory reuse: with the
  later layers requested too, Slice's second top came back overwritten by the TanH that reads it.  A
  layer with several tops is therefore run up to itself alone.
"""

from __future__ import annotations

import math
import time

import cv2
import numpy as np
import pytest
import torch

from caffe_compat.net import CaffeNet, load_net

EPS32 = float(np.finfo(np.float32).eps)


# --------------------------------------------------------------------------------------------------
# prototxt builders (plain text; one helper per recurring published motif)
# --------------------------------------------------------------------------------------------------

def _input(name: str, *dims: int) -> str:
    shape = " ".join(f"dim: {d}" for d in dims)
    return f'layer {{ name: "{name}" type: "Input" top: "{name}" input_param {{ shape {{ {shape} }} }} }}\n'


def _conv(name, bottom, num_output, kernel, stride=1, pad=0, group=1, bias=True, top=None, kind="Convolution"):
    fields = [f"num_output: {num_output}", f"kernel_size: {kernel}"]
    fields += [f"stride: {stride}"] if stride != 1 else []
    fields += [f"pad: {pad}"] if pad else []
    fields += [f"group: {group}"] if group != 1 else []
    fields += ["bias_term: false"] if not bias else []
    return (f'layer {{ name: "{name}" type: "{kind}" bottom: "{bottom}" top: "{top or name}" '
            f'convolution_param {{ {" ".join(fields)} }} }}\n')


def _act(name, blob, kind="ReLU", params=""):
    return f'layer {{ name: "{name}" type: "{kind}" bottom: "{blob}" top: "{blob}" {params}}}\n'


def _pool(name, bottom, pool, kernel=None, stride=1, pad=0, global_pooling=False):
    fields = [f"pool: {pool}"]
    fields += ["global_pooling: true"] if global_pooling else [f"kernel_size: {kernel}", f"stride: {stride}"]
    fields += [f"pad: {pad}"] if pad else []
    return (f'layer {{ name: "{name}" type: "Pooling" bottom: "{bottom}" top: "{name}" '
            f'pooling_param {{ {" ".join(fields)} }} }}\n')


def _ip(name, bottom, num_output):
    return (f'layer {{ name: "{name}" type: "InnerProduct" bottom: "{bottom}" top: "{name}" '
            f'inner_product_param {{ num_output: {num_output} }} }}\n')


def _softmax(name, bottom):
    return f'layer {{ name: "{name}" type: "Softmax" bottom: "{bottom}" top: "{name}" }}\n'


def _bn_scale(bn, scale, blob):
    """BatchNorm (global statistics, as deploy prototxts write it) + Scale with bias, in place."""
    return (f'layer {{ name: "{bn}" type: "BatchNorm" bottom: "{blob}" top: "{blob}" '
            f'batch_norm_param {{ use_global_stats: true }} }}\n'
            f'layer {{ name: "{scale}" type: "Scale" bottom: "{blob}" top: "{blob}" '
            f'scale_param {{ bias_term: true }} }}\n')


def _eltwise(name, bottoms, operation="SUM", coeffs=()):
    text = " ".join(f'bottom: "{b}"' for b in bottoms)
    params = " ".join([f"operation: {operation}"] + [f"coeff: {c}" for c in coeffs])
    return f'layer {{ name: "{name}" type: "Eltwise" {text} top: "{name}" eltwise_param {{ {params} }} }}\n'


def _concat(name, bottoms, axis=1):
    text = " ".join(f'bottom: "{b}"' for b in bottoms)
    return f'layer {{ name: "{name}" type: "Concat" {text} top: "{name}" concat_param {{ axis: {axis} }} }}\n'


# --- CaffeNet (BVLC reference CaffeNet = AlexNet with pool before norm) ---------------------------
# 52x52 input: conv1 (7x7 stride 3) gives 16x16; pool1 (3x3 stride 2) then gives ceil(13/2)+1 = 8 (floor:
# 7), pool2 on 8x8 gives ceil(5/2)+1 = 4 (floor: 3), pool5 on 4x4 gives ceil(1/2)+1 = 2 (floor: 1).
CAFFENET = ('name: "CaffeNetSmall"\n' + _input("data", 2, 3, 52, 52)
            + _conv("conv1", "data", 16, 7, stride=3) + _act("relu1", "conv1")
            + _pool("pool1", "conv1", "MAX", 3, 2)
            + 'layer { name: "norm1" type: "LRN" bottom: "pool1" top: "norm1" '
              'lrn_param { local_size: 5 alpha: 0.0001 beta: 0.75 } }\n'
            + _conv("conv2", "norm1", 24, 5, pad=2, group=2) + _act("relu2", "conv2")
            + _pool("pool2", "conv2", "MAX", 3, 2)
            + 'layer { name: "norm2" type: "LRN" bottom: "pool2" top: "norm2" '
              'lrn_param { local_size: 5 alpha: 0.0001 beta: 0.75 } }\n'
            + _conv("conv3", "norm2", 32, 3, pad=1) + _act("relu3", "conv3")
            + _conv("conv4", "conv3", 32, 3, pad=1, group=2) + _act("relu4", "conv4")
            + _conv("conv5", "conv4", 24, 3, pad=1, group=2) + _act("relu5", "conv5")
            + _pool("pool5", "conv5", "MAX", 3, 2)
            + _ip("fc6", "pool5", 64) + _act("relu6", "fc6")
            + _act("drop6", "fc6", "Dropout", "dropout_param { dropout_ratio: 0.5 } ")
            + _ip("fc7", "fc6", 64) + _act("relu7", "fc7")
            + _act("drop7", "fc7", "Dropout", "dropout_param { dropout_ratio: 0.5 } ")
            + _ip("fc8", "fc7", 10) + _softmax("prob", "fc8"))


# --- SqueezeNet v1.1 ---------------------------------------------------------------------------------
def _fire(name, bottom, squeeze, expand):
    s, e1, e3 = f"{name}/squeeze1x1", f"{name}/expand1x1", f"{name}/expand3x3"
    return (_conv(s, bottom, squeeze, 1) + _act(f"{name}/relu_squeeze1x1", s)
            + _conv(e1, s, expand, 1) + _act(f"{name}/relu_expand1x1", e1)
            + _conv(e3, s, expand, 3, pad=1) + _act(f"{name}/relu_expand3x3", e3)
            + _concat(f"{name}/concat", [e1, e3]))


# 41x41 input: conv1 (3x3 stride 2) 20x20; pool1 ceil(17/2)+1 = 10 (floor 9); pool3 on 10 gives
# ceil(7/2)+1 = 5 (floor 4); pool5 on 5 gives 2.
SQUEEZENET = ('name: "SqueezeNet1_1Small"\n' + _input("data", 2, 3, 41, 41)
              + _conv("conv1", "data", 16, 3, stride=2) + _act("relu_conv1", "conv1")
              + _pool("pool1", "conv1", "MAX", 3, 2)
              + _fire("fire2", "pool1", 8, 16) + _fire("fire3", "fire2/concat", 8, 16)
              + _pool("pool3", "fire3/concat", "MAX", 3, 2)
              + _fire("fire4", "pool3", 8, 24) + _fire("fire5", "fire4/concat", 8, 24)
              + _pool("pool5", "fire5/concat", "MAX", 3, 2)
              + _fire("fire6", "pool5", 12, 32)
              + _act("drop9", "fire6/concat", "Dropout", "dropout_param { dropout_ratio: 0.5 } ")
              + _conv("conv10", "fire6/concat", 10, 1) + _act("relu_conv10", "conv10")
              + _pool("pool10", "conv10", "AVE", global_pooling=True) + _softmax("prob", "pool10"))


# --- MobileNet v1 (depthwise separable blocks, conv without bias + BatchNorm + Scale + ReLU) -------------
def _mobile_block(name, bottom, channels, out, stride):
    dw, sep = f"{name}/dw", f"{name}/sep"
    return (_conv(dw, bottom, channels, 3, stride=stride, pad=1, group=channels, bias=False)
            + _bn_scale(f"{dw}/bn", f"{dw}/scale", dw) + _act(f"relu{name[4:]}/dw", dw)
            + _conv(sep, dw, out, 1, bias=False)
            + _bn_scale(f"{sep}/bn", f"{sep}/scale", sep) + _act(f"relu{name[4:]}/sep", sep))


MOBILENET = ('name: "MobileNetV1Small"\n' + _input("data", 2, 3, 32, 32)
             + _conv("conv1", "data", 8, 3, stride=2, pad=1, bias=False)
             + _bn_scale("conv1/bn", "conv1/scale", "conv1") + _act("relu1", "conv1")
             + _mobile_block("conv2_1", "conv1", 8, 16, 1) + _mobile_block("conv2_2", "conv2_1/sep", 16, 32, 2)
             + _mobile_block("conv3_1", "conv2_2/sep", 32, 32, 1) + _mobile_block("conv3_2", "conv3_1/sep", 32, 64, 2)
             + _pool("pool6", "conv3_2/sep", "AVE", global_pooling=True)
             + _conv("fc7", "pool6", 10, 1) + _softmax("prob", "fc7"))


# --- ResNet (bottleneck blocks of ResNet-50's deploy prototxt, names included) ---------------------------
def _branch(res, branch, bottom, num_output, kernel, stride=1, pad=0, relu=True):
    name = f"res{res}_branch{branch}"
    return (_conv(name, bottom, num_output, kernel, stride=stride, pad=pad, bias=False)
            + _bn_scale(f"bn{res}_branch{branch}", f"scale{res}_branch{branch}", name)
            + (_act(f"res{res}_branch{branch}_relu", name) if relu else ""))


def _bottleneck(res, bottom, inner, out, stride=1, project=False, operation="SUM", coeffs=()):
    shortcut = f"res{res}_branch1" if project else bottom
    return ((_branch(res, "1", bottom, out, 1, stride=stride, relu=False) if project else "")
            + _branch(res, "2a", bottom, inner, 1, stride=stride)
            + _branch(res, "2b", f"res{res}_branch2a", inner, 3, pad=1)
            + _branch(res, "2c", f"res{res}_branch2b", out, 1, relu=False)
            + _eltwise(f"res{res}", [shortcut, f"res{res}_branch2c"], operation, coeffs)
            + _act(f"res{res}_relu", f"res{res}"))


# 32x32 input: conv1 (7x7 stride 2 pad 3) 16x16; pool1 (3x3 stride 2) ceil(13/2)+1 = 8 (floor 7); res3a's
# stride-2 1x1 convolutions give 4x4.
RESNET = ('name: "ResNetSmall"\n' + _input("data", 2, 3, 32, 32)
          + _conv("conv1", "data", 16, 7, stride=2, pad=3, bias=False)
          + _bn_scale("bn_conv1", "scale_conv1", "conv1") + _act("conv1_relu", "conv1")
          + _pool("pool1", "conv1", "MAX", 3, 2)
          + _bottleneck("2a", "pool1", 8, 32, project=True)
          + _bottleneck("2b", "res2a", 8, 32, coeffs=(1.0, 0.5))
          + _bottleneck("3a", "res2b", 16, 64, stride=2, project=True)
          + _bottleneck("3b", "res3a", 16, 64, operation="MAX")
          + _pool("pool5", "res3b", "AVE", 4, 1)
          + _ip("fc10", "pool5", 10) + _softmax("prob", "fc10"))


# --- FCN (FCN-16s pattern: pad-100-style first conv, score maps, grouped bilinear-style Deconvolution,
# Crop of the skip score map with an offset, Eltwise SUM fuse, final upsampling cropped to the input) ----
# 24x24 input: conv1_1 pad 20 -> 62; pool1 31; conv2_1 29; pool2 ceil(27/2)+1 = 15 (floor 14); conv3 13;
# upscore2 (k4 s2) (13-1)*2+4 = 28; score_pool1 31 cropped at offset 2 to 28; upscore (k4 s2) 58 cropped at
# offsets 17 (H) and 15 (W) to the 24x24 input.
FCN = ('name: "FCN16sSmall"\n' + _input("data", 2, 3, 24, 24)
       + _conv("conv1_1", "data", 8, 3, pad=20) + _act("relu1_1", "conv1_1")
       + _conv("conv1_2", "conv1_1", 8, 3, pad=1) + _act("relu1_2", "conv1_2")
       + _pool("pool1", "conv1_2", "MAX", 2, 2)
       + _conv("conv2_1", "pool1", 16, 3) + _act("relu2_1", "conv2_1")
       + _pool("pool2", "conv2_1", "MAX", 2, 2)
       + _conv("fc3", "pool2", 16, 3) + _act("relu3", "fc3")
       + _act("drop3", "fc3", "Dropout", "dropout_param { dropout_ratio: 0.5 } ")
       + _conv("score_fr", "fc3", 5, 1)
       + _conv("upscore2", "score_fr", 5, 4, stride=2, group=5, bias=False, kind="Deconvolution")
       + _conv("score_pool1", "pool1", 5, 1)
       + 'layer { name: "score_pool1c" type: "Crop" bottom: "score_pool1" bottom: "upscore2" '
         'top: "score_pool1c" crop_param { axis: 2 offset: 2 } }\n'
       + _eltwise("fuse_pool1", ["upscore2", "score_pool1c"])
       + _conv("upscore16", "fuse_pool1", 5, 4, stride=2, group=5, bias=False, kind="Deconvolution")
       + 'layer { name: "score" type: "Crop" bottom: "upscore16" bottom: "data" top: "score" '
         'crop_param { axis: 2 offset: 17 offset: 15 } }\n')


# --- activations and blob plumbing: PReLU (PReLU-net), Slice, Sigmoid/TanH gating (LSTM-style PROD),
# Power, Concat on axis 1, Reshape with dims 0 and -1, Flatten, channel-shared PReLU, leaky ReLU; and the two
# pooling corners of Caffe's ceil rounding with padding: pool1 (MAX 2x2 stride 2 pad 1 on 9x9) gives
# ceil(9/2)+1 = 6, and Caffe drops the last window because it would start in the padding ((6-1)*2 >= 9+1): 5;
# pool2 (AVE 4x4 stride 2 pad 1 on 5x5) gives ceil(3/2)+1 = 3; its last window covers 2 rows, 1 padding row
# and 1 row beyond the padding: Caffe divides by the window clipped to height + pad (3 rows, padding counted).
MISC = ('name: "PluggedSmall"\n' + _input("data", 2, 4, 9, 9)
        + _conv("conv1", "data", 8, 3, pad=1) + _act("prelu1", "conv1", "PReLU")
        + _pool("pool1", "conv1", "MAX", 2, 2, pad=1)
        + 'layer { name: "slice1" type: "Slice" bottom: "pool1" top: "gate_in" top: "cell_in" '
          'slice_param { axis: 1 slice_point: 4 } }\n'
        + 'layer { name: "gate" type: "Sigmoid" bottom: "gate_in" top: "gate" }\n'
        + 'layer { name: "cell" type: "TanH" bottom: "cell_in" top: "cell" }\n'
        + _eltwise("gated", ["gate", "cell"], "PROD")
        + 'layer { name: "power" type: "Power" bottom: "gate" top: "power" '
          'power_param { power: 2 scale: 0.5 shift: 1 } }\n'
        + _concat("concat", ["gated", "power", "cell"])
        + _pool("pool2", "concat", "AVE", 4, 2, pad=1)
        + 'layer { name: "reshape" type: "Reshape" bottom: "pool2" top: "reshape" '
          'reshape_param { shape { dim: 0 dim: -1 dim: 9 } } }\n'
        + 'layer { name: "flatten" type: "Flatten" bottom: "reshape" top: "flatten" }\n'
        + _ip("ip1", "flatten", 32)
        + _act("prelu2", "ip1", "PReLU", "prelu_param { channel_shared: true } ")
        + _ip("ip2", "ip1", 16) + _act("leaky", "ip2", "ReLU", "relu_param { negative_slope: 0.1 } ")
        + _ip("ip3", "ip2", 10) + _softmax("prob", "ip3"))


# net -> (prototxt, input scale (pixel scale for CaffeNet so that LRN's alpha 1e-4 acts), shapes that
# show Caffe's ceil rounding (and Crop/Deconvolution sizes) are what the test runs)
NETS = {
    "caffenet": (CAFFENET, 50.0, {"pool1": (2, 16, 8, 8), "pool2": (2, 24, 4, 4), "pool5": (2, 24, 2, 2)}),
    "squeezenet1_1": (SQUEEZENET, 1.0, {"pool1": (2, 16, 10, 10), "pool3": (2, 32, 5, 5), "pool10": (2, 10, 1, 1)}),
    "mobilenet_v1": (MOBILENET, 1.0, {"conv2_2/dw": (2, 16, 8, 8), "pool6": (2, 64, 1, 1)}),
    "resnet": (RESNET, 1.0, {"pool1": (2, 16, 8, 8), "res3a": (2, 64, 4, 4)}),
    "fcn": (FCN, 1.0, {"pool2": (2, 16, 15, 15), "upscore2": (2, 5, 28, 28), "upscore16": (2, 5, 58, 58),
                       "score": (2, 5, 24, 24)}),
    "misc": (MISC, 1.0, {"pool1": (2, 8, 5, 5), "pool2": (2, 12, 3, 3), "reshape": (2, 12, 9),
                         "flatten": (2, 108)}),
}


# --------------------------------------------------------------------------------------------------
# weights
# --------------------------------------------------------------------------------------------------

def _normal(gen, shape, std):
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float64).mul_(std).float()


def _uniform(gen, shape, low, high):
    return (torch.rand(tuple(shape), generator=gen, dtype=torch.float64) * (high - low) + low).float()


#: BatchNorm's stored moving-average factor, cycled over the net's BatchNorm layers: 1 (statistics stored
#: as they are) and 999.982 (what lambda = 0.999 leaves after ~10^4 iterations: statistics stored x1000).
BN_FACTORS = (1.0, 999.982)


def fill_weights(net: CaffeNet, x: torch.Tensor, seed: int) -> None:
    """Deterministic He-scaled weights, small biases, Scale gamma in [0.5, 1.5], PReLU slopes in
    [0.05, 0.5]; BatchNorm statistics from the batch itself (perturbed), stored times a factor."""
    gen = torch.Generator().manual_seed(seed)
    batch_norms = []
    with torch.no_grad():
        for step in net.steps:
            if step.module_key is None:
                continue
            layer, blobs = net.layers[step.module_key], net.layers[step.module_key].caffe_blobs()
            if step.type in ("Convolution", "InnerProduct", "Deconvolution"):
                w = blobs[0]
                if step.type == "Deconvolution":  # each output sums C_in/group * (k/stride)^2 terms
                    p = layer.param.convolution_param
                    stride = p.stride[0] if len(p.stride) else 1
                    fan = w.shape[0] // max(p.group, 1) * w[0, 0].numel() / stride ** 2
                else:
                    fan = w[0].numel()
                w.copy_(_normal(gen, w.shape, math.sqrt(2.0 / fan)))
                for b in blobs[1:]:
                    b.copy_(_uniform(gen, b.shape, -0.2, 0.2))
            elif step.type == "Scale":
                blobs[0].copy_(_uniform(gen, blobs[0].shape, 0.5, 1.5))
                for b in blobs[1:]:
                    b.copy_(_uniform(gen, b.shape, -0.2, 0.2))
            elif step.type == "PReLU":
                blobs[0].copy_(_uniform(gen, blobs[0].shape, 0.05, 0.5))
            elif step.type == "BatchNorm":
                batch_norms.append(layer)
            else:
                assert not blobs, f"no filling rule for {step.type} ({step.name})"

    def statistics_from_input(layer, args):  # a forward pre-hook: set the stored statistics from x
        x64 = args[0].detach().double()
        dims = [d for d in range(x64.dim()) if d != 1]
        mean, var = x64.mean(dims), x64.var(dims)
        factor = BN_FACTORS[batch_norms.index(layer) % len(BN_FACTORS)]
        noise = torch.randn(mean.shape, generator=gen, dtype=torch.float64)
        layer.mean.copy_((mean + 0.1 * var.sqrt() * noise) * factor)
        layer.variance.copy_(var * _uniform(gen, var.shape, 0.7, 1.4).double() * factor)
        layer.scale_factor.fill_(factor)

    hooks = [layer.register_forward_pre_hook(statistics_from_input) for layer in batch_norms]
    try:
        with torch.enable_grad():  # with autograd the in-place layers run through __call__, so the hooks fire
            net.forward(data=x.clone().requires_grad_())
    finally:
        for hook in hooks:
            hook.remove()


# --------------------------------------------------------------------------------------------------
# tolerance: terms per output element of each layer type
# --------------------------------------------------------------------------------------------------

def terms_per_output(layer, bottom_shapes) -> int:
    """How many rounded operations one output element of the layer accumulates (Higham's n in gamma_n):
    reductions count their terms, elementwise arithmetic 1-4, transcendental functions 4 (libm/SIMD
    exp/tanh/pow are accurate to a few ulp), pure data movement 0."""
    kind = layer.type
    if kind in ("Convolution", "Deconvolution"):
        p = layer.convolution_param
        group, kernel = max(p.group, 1), p.kernel_size[0]
        stride = p.stride[0] if len(p.stride) else 1
        per_pos = kernel * kernel if kind == "Convolution" else math.ceil(kernel / stride) ** 2
        channels = bottom_shapes[0][1]
        return channels // group * per_pos + 1
    if kind == "InnerProduct":
        return int(np.prod(bottom_shapes[0][1:])) + 1
    if kind == "Pooling":
        p = layer.pooling_param
        if p.pool == p.MAX:
            return 0
        window = int(np.prod(bottom_shapes[0][2:])) if p.global_pooling else p.kernel_size ** 2
        return window + 1
    if kind == "LRN":
        return layer.lrn_param.local_size + 4
    if kind == "Softmax":
        return bottom_shapes[0][1] + 4
    if kind == "BatchNorm":
        return 4
    if kind == "Scale":
        return 2
    if kind == "Eltwise":
        return 2 * len(bottom_shapes)
    if kind in ("Sigmoid", "TanH", "Power"):
        return 4
    if kind in ("ReLU", "PReLU"):
        return 1
    if kind in ("Input", "Split", "Concat", "Slice", "Flatten", "Reshape", "Crop", "Dropout"):
        return 0
    raise AssertionError(f"no rounding count for layer type {kind}")


def cumulative_terms(net: CaffeNet) -> dict[str, int]:
    """Blob -> N_b: the terms of every layer the blob's value depends on (its ancestors and itself)."""
    params = {layer.name: layer for layer in net.net_param.layer}
    ancestors: dict[str, frozenset] = {}  # blob -> the layers behind its current value
    for step in net.steps:
        behind = frozenset().union(*(ancestors[b] for b in step.bottoms)) | {step.name}
        for top in step.tops:
            ancestors[top] = behind
    shapes = net.blob_shapes
    cost = {}
    for step in net.steps:
        layer = params.get(step.name)
        cost[step.name] = 0 if layer is None else terms_per_output(layer, [shapes[b] for b in step.bottoms])
    return {blob: sum(cost[name] for name in layers) for blob, layers in ancestors.items()}


# --------------------------------------------------------------------------------------------------
# the comparison
# --------------------------------------------------------------------------------------------------

FUSED = "<OpenCV's fused net> "  # prefix of the final blob compared with OpenCV's default (fused) net


def _opencv(prototxt: str, caffemodel: str, fused: bool):
    net = cv2.dnn.readNetFromCaffe(prototxt, caffemodel)
    net.setPreferableBackend(cv2.dnn.DNN_BACKEND_OPENCV)
    net.setPreferableTarget(cv2.dnn.DNN_TARGET_CPU)
    net.enableFusion(fused)
    if hasattr(net, "enableWinograd"):  # OpenCV >= 4.7: Winograd F(6x6,3x3) for 3x3 convolutions (see above)
        net.enableWinograd(False)
    return net


def _relative(mine: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.abs(mine - theirs).max() / max(np.abs(theirs).max(), 1e-30))


def compare_with_opencv(name: str, tmp_path, seed: int = 0) -> dict:
    text, input_scale, shapes = NETS[name]
    prototxt, caffemodel = tmp_path / f"{name}.prototxt", tmp_path / f"{name}.caffemodel"
    prototxt.write_text(text)
    builder = CaffeNet(str(prototxt))
    gen = torch.Generator().manual_seed(seed + 1000)
    x = _normal(gen, builder.blob_shapes["data"], input_scale)
    fill_weights(builder, x, seed)
    builder.save_caffemodel(caffemodel)

    net = load_net(str(prototxt), str(caffemodel), strict=True)
    with torch.no_grad():
        ours = {blob: value.numpy().copy() for blob, value in net.forward(data=x.clone()).items()}
    for blob, shape in shapes.items():  # the sizes Caffe's rounding gives (and the test is about)
        assert ours[blob].shape == shape, (blob, ours[blob].shape, shape)

    last_writer = {}
    for step in net.steps:
        if step.module_key is not None and step.type != "Input":
            for k, top in enumerate(step.tops):
                last_writer[top] = (step.name, k)
    layers = list(dict.fromkeys(layer for layer, _ in last_writer.values()))
    multi_top = [layer for layer in layers if sum(1 for writer, _ in last_writer.values() if writer == layer) > 1]
    plain = _opencv(str(prototxt), str(caffemodel), fused=False)
    plain.setInput(x.numpy())
    outputs = dict(zip(layers, plain.forwardAndRetrieve(layers)))
    for layer in multi_top:  # OpenCV keeps only output 0 of a requested layer: a later layer may reuse the
        plain.setInput(x.numpy())  # memory of the others in place (Slice's 2nd top read back as TanH's
        outputs[layer] = plain.forwardAndRetrieve([layer])[0]  # output), so each is run up to itself alone
    budget = cumulative_terms(net)

    rel, bound, theirs = {}, {}, {}
    for blob, (layer, k) in last_writer.items():
        theirs[blob], mine = outputs[layer][k], ours[blob]
        assert theirs[blob].shape == mine.shape, (name, blob, theirs[blob].shape, mine.shape)
        rel[blob], bound[blob] = _relative(mine, theirs[blob]), EPS32 * budget[blob]

    (final,) = net.output_names
    fused = _opencv(str(prototxt), str(caffemodel), fused=True)
    fused.setInput(x.numpy())
    theirs[FUSED + final] = fused.forward().reshape(ours[final].shape)
    rel[FUSED + final], bound[FUSED + final] = _relative(ours[final], theirs[FUSED + final]), bound[final]
    return {"rel": rel, "bound": bound, "ours": ours, "theirs": theirs, "final": final, "net": net, "x": x}


def who_is_off(result: dict, blobs) -> dict:
    """For a failure message: per blob, (ours, OpenCV's) max error relative to our own float64 forward (ours
    small, OpenCV's large: the two differ in semantics, not rounding)."""
    net, x = result["net"].double(), result["x"].double()
    with torch.no_grad():
        exact = {blob: value.numpy() for blob, value in net.forward(data=x).items()}
    return {blob: (f"ours {_relative(result['ours'][blob.removeprefix(FUSED)], exact[blob.removeprefix(FUSED)]):.1e}",
                   f"OpenCV {_relative(result['theirs'][blob], exact[blob.removeprefix(FUSED)]):.1e}")
            for blob in blobs}


#: Checks that a net exercises what it is here for: (blob before, blob after, least max relative change).
#: CaffeNet's input is at pixel scale so that LRN's alpha 1e-4 changes its input (x / (1 + 2e-5 sum x^2)^0.75).
EXERCISED = {"caffenet": [("pool1", "norm1", 0.1), ("pool2", "norm2", 0.1)]}


@pytest.mark.parametrize("name", sorted(NETS))
def test_architecture_matches_opencv(name, tmp_path):
    start = time.perf_counter()
    result = compare_with_opencv(name, tmp_path)
    rel, bound = result["rel"], result["bound"]
    worst = max(rel, key=lambda blob: rel[blob] / bound[blob])
    ours, theirs = result["ours"], result["theirs"]
    largest = max(float(np.abs(ours[blob.removeprefix(FUSED)] - theirs[blob]).max()) for blob in rel)
    print(f"\n{name} vs OpenCV {cv2.__version__}: {len(rel)} blobs, worst {worst} max-rel {rel[worst]:.2e} "
          f"(bound {bound[worst]:.2e}); final {result['final']} max-rel {rel[result['final']]:.2e}; "
          f"max abs {largest:.2e}; {time.perf_counter() - start:.2f}s")
    failing = {blob: (f"{rel[blob]:.2e} > bound {bound[blob]:.2e}") for blob in rel if not rel[blob] <= bound[blob]}
    assert not failing, (failing, "against our float64 forward:", who_is_off(result, failing))
    for before, after, change in EXERCISED.get(name, ()):
        assert _relative(ours[after], ours[before]) > change, (before, after)

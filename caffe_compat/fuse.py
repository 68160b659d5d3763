"""Fused inference: a built :class:`~caffe_compat.net.CaffeNet` folded into fewer, faster steps.

``fuse_for_inference(net)`` (also ``net.fuse_for_inference()`` and ``load_net(..., fuse=True)``) returns a
new :class:`FusedNet`; the net it comes from is left as it was (the unfused net stays the default and
stays bit-faithful to Caffe).  What it folds (arithmetic in :mod:`caffe_compat.fuse_ops`):

* into a **Convolution** (not Deconvolution; one bottom, one top) or an **InnerProduct**: the chain of
  layers that follows it on its output, in prototxt order: any number of **BatchNorm** (global statistics,
  i.e. Caffe's TEST behaviour: the net in eval mode or ``use_global_stats: true``; Caffe's moving-average
  factor blob 2 and the layer's eps are applied), **Scale** (one bottom, one γ per channel on axis 1, with
  or without its bias) and **Bias** (one bottom, per channel on axis 1) layers, then, for a convolution,
  optionally a two-bottom **Eltwise** SUM with unit coefficients (the convolution's output plus a
  shortcut), then optionally a **ReLU** (any negative_slope);
* in-place chains (``conv → bn → scale → relu`` all on one blob, as in ResNets) and out-of-place ones alike.

A link joins the chain only when nothing else reads the value it consumes: the value must have exactly
one reader (Caffe's automatic Split layers make a second reader visible), and a link that would drop a blob
named in ``keep`` (an out-of-place one) is not taken; in-place links keep the blob anyway.  Automatic Splits and Dropout (the identity in eval mode) cost nothing: their tops are the
bottom's tensor.  Every other layer runs its own port, unchanged.

Blobs: ``fused(**inputs)`` returns :class:`FusedBlobs`, the blobs in the net's order with each blob's final
value (post in-place, as ``net.blobs``), **except the blobs folded away**: a blob written by a folded step
and then only read by the next step of the chain under another name (e.g. ``conv1`` in ``conv1 → bn1 →
relu1`` written out of place).  Asking for one raises :class:`FoldedBlobError` naming the fused step; pass
``keep=("conv1",)`` to keep it (the chain then stops there), or use the unfused net.  In-place chains lose
nothing (the blob's final value is the fused step's output).

Layout: ``memory_format="auto"`` runs the net ``channels_last`` end to end on CPU (the fed 4-D inputs are
converted once; convolutions, pooling, LRN, Concat, Eltwise keep that layout) and in the contiguous layout
elsewhere.  The returned 4-D blobs may therefore be ``channels_last`` tensors (same values and shapes;
``.contiguous()`` gives NCHW memory).  A port outside a list of layout-agnostic layers gets contiguous
bottoms.

Conditions and limits: the net must be in eval mode (``CaffeCompatError`` otherwise; batch statistics
cannot be folded); the fused net is inference-only (its forward runs under ``torch.inference_mode()``;
no backward, no loss); it is a snapshot: the folded weights are copies, while unfused layers are shared
with the source net, so re-fuse after changing weights.

Other layers on CPU in ``channels_last``: Pooling runs one sample at a time into one output (the
port's own values), LRN ACROSS_CHANNELS on ~1 MB blocks of (pixel, channel) rows with ``s^−0.75`` as
``rsqrt(s)·sqrt(rsqrt(s))`` (a few ulp from ``pow``; :class:`~caffe_compat.fuse_ops.FusedLRN`).

Error against the unfused net (float32): each fused step differs from the unfused chain fed the same
bottom by at most ``2·γ_(K+8)·(|W'|⋆|x| + B + |r|)`` elementwise (:func:`~caffe_compat.fuse_ops.step_error_bound`,
``K`` the dot-product length, ``u = 2⁻²⁴``), which the tests check step by step on the fixture nets and
open_nsfw; the whole net's ``max|fused − unfused| / max|unfused|`` is checked against
:meth:`FusedNet.tolerance` (that bound for the largest K).  Measured (tests/test_fuse.py, random inputs
at pixel scale, AMD EPYC, PyTorch 2.13): GoogLeNet small 1.8e-6 (tolerance 5.3e-5), VGG_CNN_M_1024 small
1.2e-6 (2.8e-4), layer zoo 4.2e-7 (3.1e-6), open_nsfw 3.3e-6 (2.8e-4); the unfused nets against OpenCV
are at the same level (~1e-6).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

from caffe_compat.errors import CaffeCompatError
from caffe_compat.layers.layout import to_channels_last, to_contiguous
from caffe_compat.fuse_ops import (UNIT_ROUNDOFF, AffineFold, FusedConvolution, FusedInnerProduct, FusedLRN,
                                   FusedPooling)

__all__ = ["FoldedBlobError", "FusedBlobs", "FusedNet", "FusedStep", "fuse_for_inference"]

#: Ports that compute the same values whatever the memory layout of their 4-D bottoms (and keep it).
LAYOUT_AGNOSTIC = {"Pooling", "Concat", "Eltwise", "ReLU", "LRN", "InnerProduct", "Dropout", "BatchNorm",
                   "Scale", "Bias", "Sigmoid", "TanH", "PReLU", "Power", "AbsVal", "ELU", "Convolution",
                   "Input", "Softmax", "Flatten"}


class FoldedBlobError(CaffeCompatError, KeyError):
    """A blob that fused inference folded away was asked for."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else super().__str__()


class FusedBlobs(OrderedDict):
    """Blob name -> tensor after a fused forward; ``folded`` maps each folded-away blob to the step that
    absorbed it, and indexing one raises :class:`FoldedBlobError`."""

    folded: dict = {}

    def __missing__(self, name):
        if name in self.folded:
            raise FoldedBlobError(f"blob '{name}' is not computed in fused inference: it was folded into step "
                                  f"'{self.folded[name]}'; fuse with keep=('{name}',) or run the unfused net")
        raise KeyError(name)


@dataclass(frozen=True)
class FusedStep:
    """One step of the fused net (``CaffeNet.steps``' shape, so :class:`~caffe_compat.export.Embedder` runs
    it): ``layers`` the Caffe layers it computes; bottoms/tops are value names (an in-place layer's
    earlier values are named ``blob@k``, the final value of each blob by its own name)."""

    name: str
    type: str
    bottoms: tuple[str, ...]
    tops: tuple[str, ...]
    module_key: str | None  # None: the tops are the first bottom (Split, Dropout in eval)
    layers: tuple[str, ...]


# ---------------------------------------------------------------------------- planning


def _values(net):
    """Version every blob: per step the value ids it reads and writes; each value's name and readers."""
    current, names, readers, reads, writes = {}, [], [], [], []
    for step in net.steps:
        reads.append([current[b] for b in step.bottoms])
        for vid in reads[-1]:
            readers[vid].append(len(reads) - 1)
        out = []
        for top in step.tops:
            names.append(top)
            readers.append([])
            current[top] = len(names) - 1
            out.append(len(names) - 1)
        writes.append(out)
    return names, readers, reads, writes, current


def _port(net, step):
    return None if step.module_key is None else net.layers[step.module_key]


def _chain_link(net, step, port, channels, stage):
    """How ``step`` extends a chain at ``stage`` (0 affine, 1 after the shortcut, 2 closed): the kind or None."""
    from caffe_compat.layers.activations import ReLU
    from caffe_compat.layers.common import Eltwise
    from caffe_compat.layers.normalization import Bias, BatchNorm, Scale

    if port is None or len(step.tops) != 1:
        return None
    if stage == 0 and len(step.bottoms) == 1:
        if type(port) is BatchNorm and port.use_global_stats and port.channels == channels:
            return "bn"
        if type(port) is Scale and port.scale is not None and port.axis == 1 and tuple(port.scale.shape) == (channels,):
            return "scale"
        if type(port) is Bias and port.bias is not None and port.axis == 1 and tuple(port.bias.shape) == (channels,):
            return "bias"
    if stage <= 1 and type(port) is ReLU and len(step.bottoms) == 1:
        return "relu"
    if stage == 0 and channels is not None and type(port) is Eltwise and len(step.bottoms) == 2 \
            and port.operation == 1 and all(c == 1.0 for c in port.coeffs):  # SUM
        return "sum"
    return None


def _plan(net, keep):
    """Groups of step indices (a chain is folded into its first step's layer), and the folded blob names."""
    from caffe_compat.layers.vision import Convolution, InnerProduct

    names, readers, reads, writes, final = _values(net)
    groups, taken, folded = [], set(), {}
    for i, step in enumerate(net.steps):
        if i in taken:
            continue
        port = _port(net, step)
        head = ((type(port) is Convolution and len(step.bottoms) == 1) or
                (type(port) is InnerProduct and port.axis == 1)) and len(step.tops) == 1
        if not head:
            groups.append(((i,), None, (), None))
            continue
        conv = type(port) is Convolution
        members, kinds, value, stage, fold = [i], [], writes[i][0], 0, AffineFold(port.num_output)
        slope = None
        while len(readers[value]) == 1:
            j = readers[value][0]
            nxt = net.steps[j]
            if j in taken or (names[value] in keep and nxt.tops[0] != names[value]):
                break  # an Eltwise another chain has absorbed, or a kept blob the link would drop
            kind = _chain_link(net, nxt, _port(net, nxt), port.num_output, stage)
            if kind == "sum" and not conv:
                kind = None
            if kind in ("bn", "scale", "bias"):
                trial = AffineFold(port.num_output)
                trial.a, trial.c, trial.m = fold.a.clone(), fold.c.clone(), fold.m.clone()
                _fold_into(trial, kind, _port(net, nxt))
                if not trial.finite():
                    break
                fold = trial
            if kind is None:
                break
            if kind == "relu":
                slope = _port(net, nxt).negative_slope
            members.append(j)
            kinds.append(kind)
            value = writes[j][0]
            stage = {"bn": 0, "scale": 0, "bias": 0, "sum": 1, "relu": 2}[kind]
            if stage == 2:
                break
        taken.update(members)
        for m in members[:-1]:
            vid = writes[m][0]
            if final[names[vid]] == vid:  # this value was the blob's last: the blob is folded away
                folded[names[vid]] = net.steps[i].name
        groups.append((tuple(members), fold, tuple(kinds), slope))
    # A chain runs where its last layer ran (an Eltwise's shortcut may be computed after the convolution);
    # nothing in between reads the chain's values (each has its one reader inside the chain).
    groups.sort(key=lambda g: g[0][-1])
    return groups, folded, (names, reads, writes, final)


def _fold_into(fold, kind, port):
    if kind == "bn":
        fold.batch_norm(port.mean, port.variance, port.scale_factor, port.eps)
    elif kind == "scale":
        fold.scale(port.scale, port.bias)
    else:
        fold.bias(port.bias)


# ---------------------------------------------------------------------------- the fused net


class FusedNet(nn.Module):
    """The fused inference net (see the module docstring).  ``forward(**inputs)`` -> :class:`FusedBlobs`."""

    def __init__(self, net, keep=(), memory_format="auto"):
        super().__init__()
        if net.training:
            raise CaffeCompatError(f"net '{net.name}': fuse_for_inference needs the net in eval mode (call "
                                   f"net.eval() first): batch statistics cannot be folded")
        self.name = net.name
        device = net._device()
        if memory_format == "auto":
            memory_format = torch.channels_last if device.type == "cpu" else torch.contiguous_format
        self.memory_format = memory_format
        keep = set(keep)
        unknown = keep - set(net.blob_shapes)
        if unknown:
            raise CaffeCompatError(f"net '{net.name}': keep names unknown blobs {sorted(unknown)}")
        groups, self.folded_blobs, (names, reads, writes, final) = _plan(net, keep)
        self.layers = nn.ModuleDict()
        self.steps: list[FusedStep] = []
        self._program = []
        value_name = {vid: (name if final[name] == vid else f"{name}@{vid}") for vid, name in enumerate(names)}
        self.blob_shapes = OrderedDict((n, s) for n, s in net.blob_shapes.items() if n not in self.folded_blobs)
        self._final = OrderedDict((n, value_name[final[n]]) for n in self.blob_shapes)
        self._feedable = list(net.feedable_names)
        self.output_names = [n for n in net.output_names if n not in self.folded_blobs]
        for members, fold, kinds, slope in groups:
            self._add_step(net, members, fold, kinds, slope, reads, writes, value_name)

    def _add_step(self, net, members, fold, kinds, slope, reads, writes, value_name):
        from caffe_compat.layers.activations import Dropout
        from caffe_compat.layers.normalization import LRN
        from caffe_compat.layers.pooling import Pooling

        first = net.steps[members[0]]
        port = _port(net, first)
        ins = [value_name[v] for v in reads[members[0]]]
        if "sum" in kinds:
            sum_step = members[1 + kinds.index("sum")]
            ins += [value_name[v] for v in reads[sum_step] if v != writes[members[kinds.index("sum")]][0]]
        outs = [value_name[v] for v in writes[members[-1]]]
        layer_names = tuple(net.steps[m].name for m in members)
        alias = first.module_key is None or (type(port) is Dropout and not port.training)
        key = None
        if not alias:
            key = first.module_key
            if len(members) > 1 or first.type == "Convolution":
                module = self._fused_module(port, fold, kinds, slope)
            elif type(port) is LRN and not port.within_channel:
                module = FusedLRN(port)
            elif type(port) is Pooling and port.num_tops == 1:
                module = FusedPooling(port)
            else:
                module = port
            self.layers[key] = module
        kind = first.type if len(members) == 1 else "+".join([first.type] + [net.steps[m].type for m in members[1:]])
        self.steps.append(FusedStep(first.name, kind, tuple(ins), tuple(outs), key, layer_names))
        contiguous = key is not None and first.type not in LAYOUT_AGNOSTIC
        self._program.append((self.layers[key] if key else None, tuple(ins), tuple(outs), contiguous,
                              not first.bottoms))

    @staticmethod
    def _fused_module(port, fold, kinds, slope):
        from functools import partial

        from caffe_compat.layers.geometry import fold_zero_dilation, may_overhang
        from caffe_compat.layers.vision import Convolution, pad_overhang

        activation = None if slope is None else float(slope)
        if type(port) is Convolution:
            kernel_weight, dilation = fold_zero_dilation(port.weight, port.dilation)
            weight, bias, magnitude = fold.apply(kernel_weight, port.bias, 0)
            geometry = dict(kernel=tuple(port.kernel), stride=tuple(port.stride), pad=tuple(port.pad),
                            dilation=tuple(port.dilation))
            overhangs = may_overhang(port.kernel, port.pad, port.dilation)
            pad_input = partial(pad_overhang, **geometry) if overhangs else None
            return FusedConvolution(weight, bias, port.stride, port.pad, dilation, port.group, activation,
                                    residual="sum" in kinds, bias_magnitude=magnitude, pad_input=pad_input)
        weight, bias, magnitude = fold.apply(port.weight, port.bias, 1 if port.transpose else 0)
        return FusedInnerProduct(weight, bias, port.axis, port.transpose, activation, bias_magnitude=magnitude)

    def forward(self, **inputs) -> FusedBlobs:
        return self.run(inputs)

    def run(self, inputs: dict | None = None) -> FusedBlobs:
        """Run the fused steps on ``inputs`` (tops of bottomless layers, by blob name)."""
        inputs = dict(inputs or {})
        unknown = [n for n in inputs if n not in self._feedable]
        if unknown:
            raise CaffeCompatError(f"net '{self.name}': cannot feed {unknown}; feedable blobs are {self._feedable}")
        values = {}
        fmt = self.memory_format
        with torch.inference_mode():
            for name, value in inputs.items():
                if not torch.is_tensor(value):
                    value = torch.as_tensor(value, dtype=torch.float32, device=self._device())
                if value.dim() == 4 and fmt is torch.channels_last:
                    value = to_channels_last(value)
                elif value.dim() == 4 and fmt is not torch.contiguous_format:
                    value = value.contiguous(memory_format=fmt)
                values[name] = value
            for module, ins, outs, contiguous, source in self._program:
                if source and all(t in values for t in outs):
                    continue
                if module is None:
                    for top in outs:
                        values[top] = values[ins[0]]
                    continue
                bottoms = [values[b] for b in ins]
                if contiguous:
                    bottoms = [to_contiguous(b) if b.dim() == 4 else b.contiguous() for b in bottoms]
                result = module(*bottoms)
                if torch.is_tensor(result):
                    values[outs[0]] = result
                else:
                    for top, out in zip(outs, result):
                        values[top] = out
        blobs = FusedBlobs((name, values[v]) for name, v in self._final.items() if v in values)
        blobs.folded = self.folded_blobs
        return blobs

    def _device(self):
        for tensor in self.buffers():
            return tensor.device
        for tensor in self.parameters():
            return tensor.device
        return torch.device("cpu")

    @property
    def feedable_names(self) -> list[str]:
        return list(self._feedable)

    @property
    def input_names(self) -> list[str]:
        return [t for s in self.steps if s.type == "Input" for t in s.tops]

    def tolerance(self) -> float:
        """``2·γ_(K+8)`` for the largest dot-product length K of a fused step (``u = 2⁻²⁴``): the bound
        :func:`~caffe_compat.fuse_ops.step_error_bound` puts on one step, relative to its magnitudes.  Used as
        the tolerance on ``max|fused − unfused| / max|unfused|`` of a whole net (tests, ``export --fuse``
        verification); 0 when nothing was fused."""
        lengths = [m.weight[0].numel() if isinstance(m, FusedConvolution) else m.weight.numel() // m.bias.numel()
                   for m in self.layers.values() if isinstance(m, (FusedConvolution, FusedInnerProduct))]
        if not lengths:
            return 0.0
        n = max(lengths) + 8
        return 2 * n * UNIT_ROUNDOFF / (1 - n * UNIT_ROUNDOFF)

    def extra_repr(self) -> str:
        return (f"name={self.name!r}, steps={len(self.steps)}, folded_blobs={len(self.folded_blobs)}, "
                f"memory_format={self.memory_format}")


def fuse_for_inference(net, keep=(), memory_format="auto") -> FusedNet:
    """The :class:`FusedNet` of ``net`` (eval mode); ``keep``: blob names never folded away;
    ``memory_format``: ``"auto"`` (channels_last on CPU), ``torch.channels_last`` or
    ``torch.contiguous_format``."""
    return FusedNet(net, keep=keep, memory_format=memory_format)

"""Run one layer of a real-Caffe ``layer_zoo`` fixture on its recorded bottoms.

The fixture holds every blob after the forward pass and every diff after one backward pass of the
whole net.  To test a layer alone we need the blob *names* Caffe gave its bottoms: a blob consumed by
several layers is fed through an auto-inserted Split whose tops are named
``<blob>_<producer layer>_<top index>_split_<k>`` (k = consumer order), and those split tops carry each
consumer's own diff.  :class:`Zoo` replays Caffe's split insertion to resolve those names.

A top's diff in ``grads.npz`` is dL/d(top) (for a split source, the sum of its consumers' diffs) unless
an in-place layer later rewrote the blob; tests of in-place chains handle that case themselves.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch
from google.protobuf import text_format

from caffe_compat.layers import layer_class
from caffe_compat.proto import caffe_pb2
from tests.conftest import fixture_path


class Zoo:
    def __init__(self, name: str):
        self.net = text_format.Parse(fixture_path(f"{name}/deploy.prototxt").read_text(), caffe_pb2.NetParameter())
        self.blobs = dict(np.load(fixture_path(f"{name}/blobs.npz")))
        self.grads = dict(np.load(fixture_path(f"{name}/grads.npz")))
        self.params = dict(np.load(fixture_path(f"{name}/params.npz")))
        self.layers = {layer.name: layer for layer in self.net.layer}
        self._bottom_keys = self._resolve_splits()

    def _resolve_splits(self) -> dict[str, list[str]]:
        producer: dict[str, tuple[str, int]] = {}
        consumers: dict[tuple[str, str, int], list[tuple[str, int]]] = defaultdict(list)
        for layer in self.net.layer:
            for j, bottom in enumerate(layer.bottom):
                src = producer[bottom]
                consumers[(bottom, *src)].append((layer.name, j))
            for i, top in enumerate(layer.top):
                producer[top] = (layer.name, i)
        keys = {layer.name: list(layer.bottom) for layer in self.net.layer}
        for (blob, src_layer, src_top), users in consumers.items():
            if len(users) > 1:
                for k, (user, j) in enumerate(users):
                    keys[user][j] = f"{blob}_{src_layer}_{src_top}_split_{k}"
        return keys

    def param(self, layer: str):
        return self.layers[layer]

    def bottom_keys(self, layer: str) -> list[str]:
        return self._bottom_keys[layer]

    def bottoms(self, layer: str, requires_grad: bool = True) -> list[torch.Tensor]:
        return [torch.tensor(self.blobs[k], requires_grad=requires_grad) for k in self.bottom_keys(layer)]

    def build(self, layer: str, phase: str = "test", bottom_shapes=None):
        """The registered port for ``layer``, built for the fixture's bottom shapes, with the fixture's
        parameter blobs copied into its ``caffe_blobs()``."""
        param = self.layers[layer]
        shapes = bottom_shapes or [self.blobs[k].shape for k in self.bottom_keys(layer)]
        port = layer_class(param)(param, shapes, phase)
        blobs = port.caffe_blobs()
        for i, blob in enumerate(blobs):
            stored = self.params[f"{layer}:{i}"]
            assert tuple(blob.shape) == stored.shape, (layer, i, tuple(blob.shape), stored.shape)
            with torch.no_grad():
                blob.copy_(torch.from_numpy(stored))
        assert f"{layer}:{len(blobs)}" not in self.params, f"{layer} has more blobs in the fixture than the port"
        return port


def worst_error(actual, expected) -> tuple[float, float]:
    """(max |a - e|, that divided by max |e| (or 1 when the reference is all zeros))."""
    a = np.asarray(actual.detach().cpu() if isinstance(actual, torch.Tensor) else actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, (a.shape, e.shape)
    if a.size == 0:
        return 0.0, 0.0
    diff = float(np.max(np.abs(a - e)))
    scale = float(np.max(np.abs(e)))
    return diff, diff / (scale if scale > 0 else 1.0)


def assert_matches(actual, expected, rtol: float = 1e-5, atol_scale: float = 1e-6, what: str = "") -> float:
    """Element-wise ``|a - e| <= rtol·|e| + atol_scale·max|e|`` (the README's float32 tolerance, the
    absolute part scaled to the blob's magnitude); returns the worst error relative to max|e|."""
    a = np.asarray(actual.detach().cpu() if isinstance(actual, torch.Tensor) else actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, f"{what}: shape {a.shape} vs reference {e.shape}"
    scale = float(np.max(np.abs(e))) if e.size else 0.0
    bound = rtol * np.abs(e) + atol_scale * max(scale, 1e-30)
    excess = np.abs(a - e) - bound
    worst = int(np.argmax(excess)) if e.size else 0
    assert e.size == 0 or excess.flat[worst] <= 0, (
        f"{what}: mismatch at flat index {worst}: got {a.flat[worst]!r}, Caffe {e.flat[worst]!r} "
        f"(max |diff| {np.max(np.abs(a - e)):.3g}, max |ref| {scale:.3g})")
    return worst_error(a, e)[1]


def run_and_compare(zoo: Zoo, layer: str, rtol: float = 1e-5, atol_scale: float = 1e-6,
                    compare_backward: bool = True) -> dict[str, float]:
    """Forward the layer on its recorded bottoms, compare every top with the fixture, then backprop the
    recorded top diffs and compare bottom diffs and parameter diffs.  Returns the worst relative errors."""
    port = zoo.build(layer)
    bottoms = zoo.bottoms(layer)
    tops = port(*bottoms)
    param = zoo.param(layer)
    errors = {}
    assert len(tops) == len(param.top)
    for name, top in zip(param.top, tops):
        assert tuple(top.shape) == zoo.blobs[name].shape, (name, tuple(top.shape), zoo.blobs[name].shape)
        errors[f"top {name}"] = assert_matches(top, zoo.blobs[name], rtol, atol_scale, f"{layer} top {name}")
    assert [tuple(t.shape) for t in tops] == [tuple(s) for s in port.output_shapes()]
    if not compare_backward:
        return errors
    pairs = [(t, torch.from_numpy(zoo.grads[f"diff:{n}"])) for n, t in zip(param.top, tops) if t.requires_grad]
    blobs = list(port.caffe_blobs())
    learnable = [b for b in blobs if b.requires_grad]
    grads = torch.autograd.grad([t for t, _ in pairs], bottoms + learnable, [g for _, g in pairs],
                                allow_unused=True)
    for key, bottom, grad in zip(zoo.bottom_keys(layer), bottoms, grads):
        got = torch.zeros_like(bottom) if grad is None else grad
        errors[f"d {key}"] = assert_matches(got, zoo.grads[f"diff:{key}"], rtol, atol_scale, f"{layer} diff {key}")
    learn_grads = iter(grads[len(bottoms):])
    for i, blob in enumerate(blobs):
        ref = zoo.grads[f"param_diff:{layer}:{i}"]
        got = next(learn_grads) if blob.requires_grad else torch.zeros_like(blob)
        errors[f"param {i}"] = assert_matches(got, ref, rtol, atol_scale, f"{layer} param diff {i}")
    return errors


def make_layer(text: str, bottom_shapes, phase: str = "test"):
    """Build the registered port of a LayerParameter given in prototxt text, e.g.
    ``make_layer('type: "Reshape" bottom: "a" top: "b" reshape_param { shape { dim: -1 } }', [(2, 3)])``."""
    param = text_format.Parse(text, caffe_pb2.LayerParameter())
    if not param.name:
        param.name = param.type.lower()
    return layer_class(param)(param, [tuple(s) for s in bottom_shapes], phase)

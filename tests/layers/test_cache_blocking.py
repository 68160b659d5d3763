"""Pooling and LRN without autograd run in blocks of whole samples (``caffe_compat.layers.cache_blocking``):
any block size gives the whole-batch values, and small samples are grouped instead of one call each."""

from __future__ import annotations

import pytest
import torch
from google.protobuf import text_format

from caffe_compat.layers import cache_blocking
from caffe_compat.net import CaffeNet
from caffe_compat.proto import caffe_pb2

NET = """
layer { name: "data" type: "Input" top: "data" input_param { shape { dim: 7 dim: 5 dim: 11 dim: 9 } } }
layer { name: "max" type: "Pooling" bottom: "data" top: "max" pooling_param { pool: MAX kernel_size: 3 stride: 2 } }
layer { name: "ave" type: "Pooling" bottom: "data" top: "ave" pooling_param { pool: AVE kernel_size: 3 stride: 2 pad: 1 } }
layer { name: "lrn" type: "LRN" bottom: "data" top: "lrn" lrn_param { local_size: 5 alpha: 0.1 beta: 0.75 } }
layer { name: "lrn_w" type: "LRN" bottom: "data" top: "lrn_w"
        lrn_param { local_size: 3 alpha: 0.1 beta: 0.75 norm_region: WITHIN_CHANNEL } }
"""


def _forward(x):
    net = CaffeNet(text_format.Parse(NET, caffe_pb2.NetParameter()))
    with torch.no_grad():
        return {name: value.clone() for name, value in net(data=x).items()}


@pytest.mark.parametrize("samples_per_block", [1, 2, 3, 6])
def test_any_block_size_gives_the_whole_batch_values(samples_per_block, monkeypatch):
    x = torch.randn(7, 5, 11, 9, generator=torch.Generator().manual_seed(3)) * 4
    x[2, 1, 3, 4] = x[2, 1, 3, 5]  # a tie inside a MAX window
    original = cache_blocking.in_blocks
    monkeypatch.setattr(cache_blocking, "BLOCK_BYTES", 2**30)  # one block: the whole-batch call
    whole = _forward(x)
    sample_bytes = 5 * 11 * 9 * 4
    monkeypatch.setattr(cache_blocking, "BLOCK_BYTES", samples_per_block * sample_bytes)
    blocks = []
    for module in ("caffe_compat.layers.pooling", "caffe_compat.layers.normalization"):
        monkeypatch.setattr(f"{module}.in_blocks", lambda fn, bottom: blocks.append(
            -(-bottom.shape[0] // samples_per_block)) or original(fn, bottom))
    blocked = _forward(x)
    assert blocks and all(count == -(-7 // samples_per_block) for count in blocks)
    for name in ("max", "ave"):
        assert torch.equal(blocked[name], whole[name]), name
    for name in ("lrn", "lrn_w"):  # pow may round its last bit differently where a block ends inside a SIMD vector
        difference = (blocked[name] - whole[name]).abs()
        assert bool((difference <= 2 ** -23 * whole[name].abs()).all()), name  # <= 1 ulp (float32 epsilon)


def test_small_samples_share_a_block_and_large_ones_do_not():
    seen = []

    def fn(part):
        seen.append(part.shape[0])
        return part * 2

    small = torch.ones(64, 64, 8, 8)            # 16 KiB a sample: 64 of them in one 1 MiB block
    assert torch.equal(cache_blocking.in_blocks(fn, small), small * 2) and seen == [64]
    seen.clear()
    large = torch.ones(5, 832, 14, 14)          # 637 KiB a sample: one block each
    assert torch.equal(cache_blocking.in_blocks(fn, large), large * 2) and seen == [1] * 5
    seen.clear()
    mid = torch.ones(10, 16, 32, 32)            # 64 KiB: blocks of 16 cover the batch in one call
    cache_blocking.in_blocks(fn, mid)
    assert seen == [10]


def _bottom_grads(x, dy, top, samples_per_block, monkeypatch):
    """The bottom diff of ``top`` computed as one block, then in blocks of ``samples_per_block`` samples."""
    grads = []
    for block_bytes in (2**30, samples_per_block * x[0].numel() * 4):
        monkeypatch.setattr(cache_blocking, "BLOCK_BYTES", block_bytes)
        net = CaffeNet(text_format.Parse(NET, caffe_pb2.NetParameter()))
        bottom = x.clone().requires_grad_()
        net(data=bottom)[top].backward(dy)
        grads.append(bottom.grad)
    return grads


@pytest.mark.parametrize("samples_per_block", [1, 3])
def test_max_pooling_backward_in_blocks_routes_every_diff_as_the_whole_batch(samples_per_block, monkeypatch):
    # ties (a constant plane, repeated values) and NaN: the routing is Caffe's first-in-scan-order rule either way
    x = torch.randn(7, 5, 11, 9, generator=torch.Generator().manual_seed(4)).round()
    x[1, 2] = 1.0
    x[4, 0, 2, 2] = float("nan")
    dy = torch.randn(7, 5, 5, 4, generator=torch.Generator().manual_seed(5))
    grads = _bottom_grads(x, dy, "max", samples_per_block, monkeypatch)
    assert torch.equal(grads[0], grads[1])
    # every top diff lands on exactly one bottom element (overlapping windows may add theirs on one)
    assert float(grads[0].double().sum()) == pytest.approx(float(dy.double().sum()), rel=1e-6)
    assert int((grads[0] != 0).sum()) <= dy.numel()


def test_lrn_backward_in_blocks_equals_the_whole_batch(monkeypatch):
    x = torch.randn(7, 5, 11, 9, generator=torch.Generator().manual_seed(6)) * 3
    dy = torch.randn(7, 5, 11, 9, generator=torch.Generator().manual_seed(8))
    grads = _bottom_grads(x, dy, "lrn", 2, monkeypatch)
    # the same ops on each block; only pow's last bit may differ where a block ends inside a SIMD vector
    # (as in the forward test above: seen with AVX-512, not with AVX2).  dx = dy·p − c·x·Σ_window dy·x·p/s
    # with p = s^-β: a 1-ulp change of p moves each term by <= 2 ulps (its products' roundings), so the
    # two results differ by <= 4ε of the terms' magnitude M = |dy·p| + c·|x|·Σ_window |dy·x·p/s|
    xd, dyd = x.double(), dy.double()

    def window_sum(t):  # over the 5 channels centred on each channel, zero-padded
        padded = torch.nn.functional.pad(t, (0, 0, 0, 0, 2, 2))
        return sum(padded[:, i:i + t.shape[1]] for i in range(5))

    scale = 1.0 + 0.1 / 5 * window_sum(xd * xd)  # the net's lrn: k 1, alpha 0.1, beta 0.75, local_size 5
    p = scale.pow(-0.75)
    magnitude = (dyd * p).abs() + 2 * 0.1 * 0.75 / 5 * xd.abs() * window_sum((dyd * xd * p / scale).abs())
    assert bool(((grads[0].double() - grads[1].double()).abs() <= 4 * 2.0 ** -23 * magnitude).all())
    assert not torch.equal(grads[0], torch.zeros_like(grads[0]))

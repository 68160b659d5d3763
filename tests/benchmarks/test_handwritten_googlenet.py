"""``bench_train.py``'s hand-written peer is the authors' net: with our CaffeNet's weights it computes the same
embeddings, loss and weight gradients (float64, dropout off), and its optimizer carries the prototxt's
learning-rate and decay multipliers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.benchmarks.test_benchmark_scripts import BENCHMARKS

#: float64: the two nets sum the same products in other orders (oneDNN's and PyTorch's blockings, the
#: concatenations); a reordered sum of n terms moves by ≤ n·u of its absolute sum, n ≤ 832·5·5 = 20,800
#: (inception_5b's 5x5 over its reduce's 48 channels is smaller; 832 input channels of a 1x1 bound the rest),
#: u = 2^-53: 2.3e-12 per layer, ~25 layers deep and the 7x7 average: 1e-9 of the largest entry.
RTOL64 = 1e-9


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_train
    import handwritten_googlenet

    return bench_train, handwritten_googlenet


def _both(bench, batch=4):
    from caffe_compat.solver import Solver

    bench_train, peer_module = bench
    solver = Solver(bench_train.authors_solver(batch), device="cpu")
    net = solver.net.to(torch.float64).eval()
    peer = peer_module.HandWrittenGoogLeNet().to(torch.float64).eval()
    peer_module.copy_caffe_weights(peer, net)
    inputs = {k: torch.from_numpy(v).double() for k, v in bench_train.batch_inputs(batch).items()}
    inputs["label"] = torch.tensor([0.0, 0.0, 1.0, 1.0])  # two positive pairs, negatives for each
    return net, peer, inputs


def test_same_embeddings_loss_and_gradients(bench):
    net, peer, inputs = _both(bench)
    blobs = net.forward(**inputs)
    ours_loss = blobs["loss"]
    ours_loss.backward()
    peer_embedding = peer.embed(inputs["data"])
    peer_loss = peer.loss(peer_embedding, inputs["label"])
    peer_loss.backward()
    ours = blobs["fc_embedding"].detach()
    assert float((peer_embedding.detach() - ours).abs().max()) <= RTOL64 * float(ours.abs().max())
    ours_value, peer_value = float(ours_loss.detach()), float(peer_loss.detach())
    assert ours_value > 0 and abs(peer_value - ours_value) <= RTOL64 * ours_value
    for key, conv in list(peer.convs.items()) + [("fc_embedding", peer.fc_embedding)]:
        weight, bias = net.params[key.replace(":", "/")]
        for theirs, mine in ((conv.weight.grad, weight.grad), (conv.bias.grad, bias.grad)):
            scale = float(mine.abs().max())
            assert scale > 0, key
            np.testing.assert_allclose(theirs.numpy(), mine.numpy(), rtol=0, atol=RTOL64 * scale, err_msg=key)


def test_embedding_difference_is_measured_with_dropout_off(bench):
    net, peer, inputs = _both(bench)
    _, peer_module = bench
    net.train(), peer.train()
    difference = peer_module.max_embedding_difference(peer, net, inputs["data"], inputs["label"])
    assert difference <= RTOL64 and net.training and peer.training  # dropout off for the check, modes restored
    with torch.no_grad():  # the nets do drop in training: the same weights, other embeddings
        assert not torch.equal(peer.embed(inputs["data"]), net.forward(**inputs)["fc_embedding"])


def test_optimizer_groups_carry_the_prototxt_multipliers(bench):
    _, peer_module = bench
    peer = peer_module.HandWrittenGoogLeNet()
    groups = peer_module.sgd(peer, 1e-5, 0.9, 2e-4).param_groups
    assert [(g["lr"], g["weight_decay"], len(g["params"])) for g in groups] == [
        (1e-5, 2e-4, 57), (2e-5, 0.0, 57), (1e-4, 2e-4, 1), (2e-4, 0.0, 1)]
    assert all(g["momentum"] == 0.9 for g in groups)
    assert sum(len(g["params"]) for g in groups) == len(list(peer.parameters()))

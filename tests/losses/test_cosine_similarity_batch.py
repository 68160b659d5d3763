"""CosineSimilarityBatch against the real-Caffe fixtures (fixtures/fappy) and the C++ Backward formula."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from caffe_compat.losses.cosine_similarity_batch import CosineSimilarityBatch, cosine_similarity_batch
from caffe_compat.losses.loss_errors import LossInputError
from tests.conftest import fixture_path

CASES = json.loads(fixture_path("fappy/cases.json").read_text())
WITH_OUTPUTS = [c["name"] for c in CASES if "loss" in c and c.get("D") is not None]


def load(name):
    return np.load(fixture_path(f"fappy/{name}.npz"))


@pytest.mark.parametrize("name", WITH_OUTPUTS)
def test_cosine_and_pair_label_match_caffe(name):
    z = load(name)
    cosine, pair_label = cosine_similarity_batch(torch.from_numpy(z["feat"]), torch.from_numpy(z["label"]))
    assert cosine.shape == z["cosine"].shape and cosine.dtype == torch.float32
    if name.startswith("edge_bin_boundaries"):     # exact dyadic cosines: must agree bit for bit
        np.testing.assert_array_equal(cosine.numpy(), z["cosine"])
    np.testing.assert_allclose(cosine.numpy(), z["cosine"], rtol=0, atol=1e-6)   # sgemm vs our matmul
    np.testing.assert_array_equal(pair_label.numpy(), z["pair_label"])
    assert pair_label[0].item() == 0.0


@pytest.mark.parametrize("name", WITH_OUTPUTS)
def test_feature_diff_from_caffe_cosine_diff(name):
    """Backprop Caffe's own cosine diff: isolates our backward from FAPPY.  Float64 transcriptions of
    the C++ agree with Caffe to 1.5e-8 (README); float32 autograd stays within 1e-5 relative, or 2e-7 of the largest value."""
    z = load(name)
    feat = torch.from_numpy(z["feat"]).requires_grad_()
    cosine, _ = cosine_similarity_batch(feat, torch.from_numpy(z["label"]))
    (grad,) = torch.autograd.grad(cosine, feat, torch.from_numpy(z["cosine_diff"]))
    want = z["feat_diff"]
    np.testing.assert_array_equal(np.isnan(grad.numpy()), np.isnan(want))
    scale = np.nanmax(np.abs(want)) if not np.isnan(want).all() else 0.0
    np.testing.assert_allclose(grad.numpy(), want, rtol=1e-5, atol=2e-7 * scale + 1e-11, equal_nan=True)


def cpp_backward(x, g):
    """``dx_i = Σ_{j≠i} g_ij (x_j − xy_ij/xy_ii · x_i) / sqrt(xy_ii xy_jj)`` with g symmetric."""
    xy = x @ x.t()
    d = torch.diagonal(xy)
    w = g / torch.sqrt(d[:, None] * d[None, :])
    w.fill_diagonal_(0)
    return w @ x - (w * xy / d[:, None]).sum(1, keepdim=True) * x


def test_autograd_equals_cpp_backward_formula_float64():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    cosine, _ = cosine_similarity_batch(x, torch.zeros(9))
    g = torch.randn(cosine.shape, dtype=torch.float64, generator=gen)
    (grad,) = torch.autograd.grad(cosine, x, g)
    iu, ju = torch.triu_indices(9, 9, 1)
    gm = torch.zeros(9, 9, dtype=torch.float64)
    gm[iu, ju] = g.reshape(-1)
    gm[ju, iu] = g.reshape(-1)
    torch.testing.assert_close(grad, cpp_backward(x.detach(), gm), rtol=1e-12, atol=1e-14)
    assert torch.autograd.gradcheck(lambda t: cosine_similarity_batch(t, torch.zeros(9))[0], (x,))


def test_pair_order_and_formula():
    x = torch.tensor([[3.0, 0.0], [0.0, 2.0], [1.0, 1.0], [-2.0, 0.0]])
    cosine, _ = cosine_similarity_batch(x, torch.zeros(4))
    s = 1 / np.sqrt(2)
    want = [0.0, s, -1.0, s, 0.0, -s]       # (0,1) (0,2) (0,3) (1,2) (1,3) (2,3)
    np.testing.assert_allclose(cosine.reshape(-1).numpy(), want, rtol=1e-6, atol=1e-7)


def test_pair_label_off_by_one_and_corrected():
    labels = torch.tensor([5.0, 5.0, 7.0, 7.0])          # pairs: + - - - - +
    _, faithful = cosine_similarity_batch(torch.randn(4, 3), labels)
    _, fixed = cosine_similarity_batch(torch.randn(4, 3), labels, faithful=False)
    assert faithful.reshape(-1).tolist() == [0, 1, -1, -1, -1, -1]      # last pair's label dropped
    assert fixed.reshape(-1).tolist() == [1, -1, -1, -1, -1, 1]


def test_label_values_are_cast_to_int_like_the_cpp():
    labels = torch.tensor([1.0, 1.0, 2.0])               # pairs: + - -
    _, faithful = cosine_similarity_batch(torch.randn(3, 2), labels, pos_label=2.7, neg_label=-0.5)
    _, fixed = cosine_similarity_batch(torch.randn(3, 2), labels, pos_label=2.7, neg_label=-0.5, faithful=False)
    assert faithful.reshape(-1).tolist() == [0.0, 2.0, 0.0]
    np.testing.assert_allclose(fixed.reshape(-1).numpy(), [2.7, -0.5, -0.5])


def test_zero_row_gives_nan_like_caffe():
    x = torch.tensor([[1.0, 2.0], [0.0, 0.0], [2.0, -1.0]])
    cosine, _ = cosine_similarity_batch(x, torch.zeros(3))
    c = cosine.reshape(-1)
    assert torch.isnan(c[0]) and torch.isnan(c[2]) and c[1].item() == 0.0


def test_shapes():
    cosine, pair_label = cosine_similarity_batch(torch.randn(6, 4, 1, 1), torch.zeros(6, 1, 1, 1))
    assert cosine.shape == pair_label.shape == (15, 1, 1, 1)
    cosine, pair_label = cosine_similarity_batch(torch.randn(1, 4), torch.zeros(1))
    assert cosine.shape == pair_label.shape == (0, 1, 1, 1)
    with pytest.raises(LossInputError, match="labels"):
        cosine_similarity_batch(torch.randn(6, 4), torch.zeros(5))
    with pytest.raises(LossInputError, match="features"):
        cosine_similarity_batch(torch.randn(6, 4, 2, 1), torch.zeros(6))


@pytest.mark.parametrize("name", WITH_OUTPUTS)
def test_module_equals_function_and_caffe_fixture(name):
    z = load(name)
    feat, label = torch.from_numpy(z["feat"]), torch.from_numpy(z["label"])
    cosine, pair_label = CosineSimilarityBatch()(feat, label)
    m = feat.shape[0] * (feat.shape[0] - 1) // 2
    assert cosine.shape == pair_label.shape == (m,)
    want_cosine, want_label = cosine_similarity_batch(feat, label)
    torch.testing.assert_close(cosine, want_cosine.reshape(-1), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(pair_label, want_label.reshape(-1), rtol=0, atol=0)
    np.testing.assert_array_equal(pair_label.numpy(), z["pair_label"].reshape(-1))
    np.testing.assert_allclose(cosine.numpy(), z["cosine"].reshape(-1), rtol=0, atol=1e-6)


def test_module_defaults_options_and_gradient():
    from caffe_compat import losses
    from caffe_compat.proto import caffe_pb2

    assert losses.CosineSimilarityBatch is CosineSimilarityBatch
    module = CosineSimilarityBatch()
    proto = caffe_pb2.CosineSimilarityBatchParameter()
    assert isinstance(module, torch.nn.Module) and not list(module.parameters())
    assert (module.pos_label, module.neg_label, module.faithful) == (proto.pos_label, proto.neg_label, True)
    x = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(4), requires_grad=True)
    labels = torch.tensor([1.0, 1.0, 2.0, 2.0, 1.0])
    for kw in ({}, {"pos_label": 2.7, "neg_label": -0.5}, {"pos_label": 2.7, "neg_label": -0.5, "faithful": False}):
        cosine, pair_label = CosineSimilarityBatch(**kw)(x, labels)
        want_cosine, want_label = cosine_similarity_batch(x, labels, **kw)
        torch.testing.assert_close(cosine, want_cosine.reshape(-1), rtol=0, atol=0)
        torch.testing.assert_close(pair_label, want_label.reshape(-1), rtol=0, atol=0)
        assert not pair_label.requires_grad
    (grad,) = torch.autograd.grad(CosineSimilarityBatch()(x, labels)[0].sum(), x)
    (want,) = torch.autograd.grad(cosine_similarity_batch(x, labels)[0].sum(), x)
    torch.testing.assert_close(grad, want, rtol=0, atol=0)


@pytest.mark.parametrize("delta", [1e-4, 1e-5])
def test_fappy_diff_with_subnormals_reaches_the_features_as_autograds_bits_without_them(delta, monkeypatch):
    """The authors' two layers (CosineSimilarityBatch, then FAPPYLoss) at small Δ: the layer diff holds float32
    subnormals; the cosine chain runs on it lifted (no subnormal inside, no x86 stall) and the features'
    gradient is plain autograd's, bit for bit."""
    import importlib

    from caffe_compat.losses.fappy import fappy_caffe
    from caffe_compat.losses.pairwise import cosine_matrix, upper_pairs

    tiny = torch.finfo(torch.float32).tiny
    gen = torch.Generator().manual_seed(0)
    labels = torch.arange(128) // 10
    x = (torch.randn(13, 16, generator=gen)[labels] + 1.5 * torch.randn(128, 16, generator=gen)) @ \
        torch.randn(16, 512, generator=gen)
    seen = []

    def recording(rows):
        sim = cosine_matrix(rows)
        sim.register_hook(seen.append)
        return sim

    module = importlib.import_module("caffe_compat.losses.cosine_similarity_batch")  # (the package exports the function)
    monkeypatch.setattr(module, "cosine_matrix", recording)
    ours = x.clone().requires_grad_()
    cosine, _ = cosine_similarity_batch(ours, labels)
    cosine.retain_grad()
    fappy_caffe(cosine, labels, delta).backward()
    layer_diff = cosine.grad
    assert bool(((layer_diff.abs() < tiny) & (layer_diff != 0)).any())       # the case at hand
    assert not bool(((seen[0].abs() < tiny) & (seen[0] != 0)).any())         # the chain never sees them
    iu, ju = upper_pairs(128)
    plain = x.clone().requires_grad_()
    cosine_matrix(plain)[iu, ju].reshape(-1, 1, 1, 1).backward(layer_diff)
    assert torch.equal(ours.grad, plain.grad)

"""FAPPY loss against the real-Caffe fixtures (fixtures/fappy), a loop-by-loop float64 transcription
of the C++ layer's semantics, closed-form hand cases, and gradcheck."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from caffe_compat.errors import CaffeCompatError
from caffe_compat.losses.fappy import (FAPPYLoss, caffe_levels, fappy_caffe, fappy_caffe_forward_backward,
                                       fappy_paper, paper_levels)
from caffe_compat.losses.loss_errors import LossInputError
from caffe_compat.losses.pairwise import cosine_matrix
from tests.conftest import fixture_path

CASES = json.loads(fixture_path("fappy/cases.json").read_text())
RAN = [c["name"] for c in CASES if "loss" in c]             # Caffe produced outputs
CRASHED = [c["name"] for c in CASES if "loss" not in c]     # Caffe segfaulted: inputs only
WITH_FEATURES = [c["name"] for c in CASES if "loss" in c and c.get("D") is not None]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

LOSS_RTOL = 2e-5          # README section 3
DIFF_ATOL = 1e-7          # observed worst 6e-8 (float32 Caffe vs our float64 accumulation)
DIFF_RTOL = 1e-5


def load(name):
    return np.load(fixture_path(f"fappy/{name}.npz"))


def test_fixture_partition():
    assert len(RAN) == 18 and sorted(CRASHED) == ["edge_negative_pair_cos_exactly_1", "edge_zero_feature_row"]


# ------------------------------------------------------------------------ fixtures: Caffe's cosines

@pytest.mark.parametrize("name", RAN)
def test_loss_and_cosine_diff_match_caffe(name):
    z = load(name)
    cos, lab, lw = torch.from_numpy(z["cosine"]), torch.from_numpy(z["label"]), float(z["loss_weight"])
    loss, diff = fappy_caffe_forward_backward(cos, lab, float(z["delta"]))
    assert loss.dtype == torch.float32 and loss.shape == () and diff.shape == cos.shape
    ref = float(z["loss"])
    if math.isnan(ref):
        assert math.isnan(float(loss))
    else:
        assert float(loss) == pytest.approx(ref, rel=LOSS_RTOL, abs=1e-12)
    got, want = diff.numpy() * lw, z["cosine_diff"]
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=DIFF_RTOL, atol=DIFF_ATOL, equal_nan=True)


@pytest.mark.parametrize("name", RAN)
def test_autograd_gradient_is_the_layer_diff_times_loss_weight(name):
    z = load(name)
    cos = torch.from_numpy(z["cosine"]).requires_grad_()
    lab, lw, delta = torch.from_numpy(z["label"]), float(z["loss_weight"]), float(z["delta"])
    loss = fappy_caffe(cos, lab, delta)
    (loss * lw).backward()
    _, diff = fappy_caffe_forward_backward(cos.detach(), lab, delta)
    torch.testing.assert_close(cos.grad, diff * lw, rtol=0, atol=0, equal_nan=True)
    np.testing.assert_allclose(cos.grad.numpy(), z["cosine_diff"], rtol=DIFF_RTOL, atol=DIFF_ATOL, equal_nan=True)


def test_loss_weight_halves_diffs_not_loss():
    a, b = load("b16_d8_delta0.1"), load("b16_d8_delta0.1_loss_weight0.5")
    assert float(b["loss_weight"]) == 0.5 and float(a["loss"]) == float(b["loss"])
    cos = torch.from_numpy(b["cosine"]).requires_grad_()
    loss = fappy_caffe(cos, torch.from_numpy(b["label"]), 0.1)
    (0.5 * loss).backward()
    assert loss.item() == pytest.approx(float(b["loss"]), rel=LOSS_RTOL)
    np.testing.assert_allclose(cos.grad.numpy(), b["cosine_diff"], rtol=DIFF_RTOL, atol=DIFF_ATOL)
    np.testing.assert_allclose(cos.grad.numpy() * 2, a["cosine_diff"], rtol=DIFF_RTOL, atol=DIFF_ATOL)


def test_single_label_is_nan_exactly_where_caffe_is():
    z = load("edge_single_label")
    loss, diff = fappy_caffe_forward_backward(torch.from_numpy(z["cosine"]), torch.from_numpy(z["label"]), 0.1)
    assert math.isnan(float(loss))
    np.testing.assert_array_equal(np.isnan(diff.numpy()), np.isnan(z["cosine_diff"]))


# ------------------------------------------------------------------ fixtures: from the features

@pytest.mark.parametrize("name", WITH_FEATURES)
def test_end_to_end_from_features(name):
    """CosineSimilarityBatch + FAPPYLoss from the raw features.  Our float32 cosines differ from
    OpenBLAS sgemm's by an ulp or so; in the B=128 cases a handful of them (4 at delta 1e-4) land in the
    neighbouring finest bin, which moves those diffs by ~1e-3 of the largest feature diff (the loss is
    continuous in the cosines, so it still matches to LOSS_RTOL)."""
    z = load(name)
    feat = torch.from_numpy(z["feat"]).requires_grad_()
    lab, lw = torch.from_numpy(z["label"]), float(z["loss_weight"])
    loss = FAPPYLoss(float(z["delta"]), mode="caffe")(feat, lab)
    (loss * lw).backward()
    loss, ref = loss.item(), float(z["loss"])
    if math.isnan(ref):
        assert math.isnan(loss)
        assert np.isnan(z["feat_diff"]).all() and torch.isnan(feat.grad).all()
        return
    assert loss == pytest.approx(ref, rel=LOSS_RTOL, abs=1e-12)
    want = z["feat_diff"]
    scale = np.abs(want).max()
    rel_to_max = 2e-3 if z["feat"].shape[0] >= 128 else 1e-5
    assert np.abs(feat.grad.numpy() - want).max() <= rel_to_max * scale + 2e-8


# --------------------------------------------------------------- the cases where Caffe crashed

@pytest.mark.parametrize("name", CRASHED)
@pytest.mark.parametrize("mode", ["caffe", "paper"])
def test_caffe_segfault_cases_raise_a_clear_error(name, mode):
    z = load(name)
    with pytest.raises(LossInputError, match="out of bounds") as info:
        FAPPYLoss(float(z["delta"]), mode=mode)(torch.from_numpy(z["feat"]), torch.from_numpy(z["label"]))
    assert isinstance(info.value, CaffeCompatError)


def test_negative_pair_at_cosine_one_is_rejected_but_positive_is_fine():
    lab = torch.tensor([0.0, 0.0, 1.0])      # pairs (0,1)+ (0,2)- (1,2)-
    with pytest.raises(LossInputError, match=r"negative pair \(0, 2\)"):
        fappy_caffe(torch.tensor([0.2, 1.0, 0.1]), lab, 0.1)
    with pytest.raises(LossInputError, match="negative pair"):
        fappy_caffe(torch.tensor([0.2, -1.0000001, 0.1]), lab, 0.1)
    loss, diff = fappy_caffe_forward_backward(torch.tensor([1.0, 0.5, 0.1]), lab, 0.1)  # positive at 1: skipped
    assert float(loss) == 0.0 and not diff.any()


@pytest.mark.parametrize("mode", ["caffe", "paper"])
def test_out_of_bounds_check_follows_the_rows_the_layer_reads(mode):
    """labels [0,1,1,0]: positive pairs (0,3) and (1,2); cosines in Caffe's pair order
    (01, 02, 03, 12, 13, 23).  At delta 0.1 (finest d = 0.125) a pair is used iff 1 - s >= 0.125, and a
    used pair reads the histograms of its two rows, i.e. the cosines of those rows to all their
    negatives.  A negative pair at cosine 1.0 is a segfault in Caffe exactly when one of its rows is read."""
    lab = torch.tensor([0.0, 1.0, 1.0, 0.0])
    loss_fn = fappy_caffe if mode == "caffe" else fappy_paper
    # (1,2) used (rows 1, 2 read), (0,3) not: (0,2) at 1.0 is read through row 2
    with pytest.raises(LossInputError, match=r"negative pair \(0, 2\) \(cosine index 1\)"):
        loss_fn(torch.tensor([0.1, 1.0, 0.99, 0.3, 0.2, 0.4]), lab, 0.1)
    # (0,3) used (rows 0, 3 read), (1,2) not: (1,3) at 1.0 is read through row 3
    with pytest.raises(LossInputError, match=r"negative pair \(1, 3\) \(cosine index 4\)"):
        loss_fn(torch.tensor([0.1, 0.2, 0.3, 0.99, 1.0, 0.4]), lab, 0.1)
    # neither positive pair used: nothing is read, the loss is 0 as in Caffe
    assert float(loss_fn(torch.tensor([0.1, 1.0, 0.99, 0.99, 1.0, 0.4]), lab, 0.1)) == 0.0


def test_unread_nan_cosine_is_harmless_as_in_caffe():
    # all labels distinct: no positive pair, the layer never reads a cosine -> loss 0, like Caffe
    loss, diff = fappy_caffe_forward_backward(torch.tensor([float("nan"), 0.2, 0.3]), torch.tensor([0.0, 1, 2]), 0.1)
    assert float(loss) == 0.0 and not diff.any()


def test_bad_shapes_and_delta_raise():
    with pytest.raises(LossInputError, match="B\\(B-1\\)/2"):
        fappy_caffe(torch.zeros(5), torch.zeros(4), 0.1)
    with pytest.raises(LossInputError, match="delta"):
        fappy_caffe(torch.zeros(6), torch.zeros(4), 0.0)
    with pytest.raises(LossInputError, match="delta"):
        FAPPYLoss(delta=-1.0)
    with pytest.raises(LossInputError, match="mode"):
        FAPPYLoss(mode="average")
    with pytest.raises(LossInputError, match="minimum"):
        caffe_levels(1e-12)


# ------------------------------------------------------------------------------------ levels

def test_levels():
    assert caffe_levels(0.1) == [2.0, 1.0, 0.5, 0.25, 0.125]
    assert caffe_levels(0.125) == [2.0, 1.0, 0.5, 0.25, 0.125]
    assert caffe_levels(2.0) == [2.0] and caffe_levels(2.5) == []
    assert caffe_levels(1e-4)[-1] == 2.0 ** -13 and len(caffe_levels(1e-4)) == 15
    assert paper_levels(2.5) == [2.0]          # repeat ... until: one level always runs
    assert paper_levels(0.1) == caffe_levels(0.1)


# ------------------------------------------------------------- an independent loop transcription

def loop_reference(cos, labels, delta):
    """The C++ layer's arithmetic written as loops in float64 (histograms as arrays, the diff of
    the negatives through the left/right bin lists, as the layer does it)."""
    b = len(labels)
    idx = {}
    k = 0
    for i in range(b):
        for j in range(i + 1, b):
            idx[i, j] = idx[j, i] = k
            k += 1
    loss, diff = 0.0, np.zeros(len(cos))
    for d in caffe_levels(delta):
        count = 0
        for i in range(b):
            for j in range(i + 1, b):
                if labels[i] != labels[j]:
                    continue
                s = cos[idx[i, j]]
                if 1.0 - s < d:
                    continue
                count += 1
                t = math.floor((s + 1.0) / d)
                left = d * t - 1.0
                size = 1 + math.ceil(2.0 / d)
                negs = [q for q in range(b) if labels[q] != labels[i]]
                n = len(negs)
                hist = {i: np.zeros(size), j: np.zeros(size)}
                bins = {}
                for r in (i, j):
                    for q in negs:
                        x = cos[idx[r, q]]
                        u = math.floor((x + 1.0) / d)
                        lu = d * u - 1.0
                        hist[r][u] += (d + lu - x) / d
                        hist[r][u + 1] += (x - lu) / d
                        bins[r, q] = u
                    hist[r] /= n
                lh, rh = (d + left - s) / d, (s - left) / d
                for r in (i, j):
                    loss += lh * hist[r][t:].sum() + rh * hist[r][t + 1:].sum()
                    diff[idx[i, j]] -= hist[r][t] / d
                    for cur in range(t, size):
                        g = lh + (rh if cur != t else 0.0)
                        for q in negs:
                            if bins[r, q] == cur:
                                diff[idx[r, q]] -= g / d / n
                            if bins[r, q] + 1 == cur:
                                diff[idx[r, q]] += g / d / n
        if count:
            loss /= count
            diff /= count
        loss /= 2
        diff /= 2
    return loss, diff


def random_case(seed):
    rng = np.random.default_rng(seed)
    b = int(rng.integers(2, 13))
    labels = rng.integers(0, int(rng.integers(1, 5)) + 1, size=b).astype(np.float64)
    m = b * (b - 1) // 2
    if seed % 2:   # dyadic grid: every cosine on a bin edge of every level, some positives at exactly 1
        cos = rng.integers(-16, 16, size=m) / 16.0
    else:
        cos = rng.uniform(-1.0, 1.0, size=m)
    k = 0
    for i in range(b):
        for j in range(i + 1, b):
            if labels[i] == labels[j] and rng.random() < 0.2:
                cos[k] = 1.0
            k += 1
    delta = float(rng.choice([2.0, 1.0, 0.3, 0.1, 0.05]))
    return cos, labels, delta


@pytest.mark.parametrize("seed", range(24))
def test_vectorised_equals_loop_transcription(seed):
    cos, labels, delta = random_case(seed)
    want_loss, want_diff = loop_reference(cos, labels, delta)
    loss, diff = fappy_caffe_forward_backward(torch.from_numpy(cos), torch.from_numpy(labels), delta)
    assert float(loss) == pytest.approx(want_loss, rel=1e-12, abs=1e-12)
    np.testing.assert_allclose(diff.numpy(), want_diff, rtol=1e-10, atol=1e-10)


def test_single_label_agrees_with_loop_transcription_on_nan():
    cos, labels = np.array([0.1, 0.2, 0.95]), np.zeros(3)
    with np.errstate(divide="ignore", invalid="ignore"):
        want_loss, want_diff = loop_reference(cos, labels, 0.1)
    loss, diff = fappy_caffe_forward_backward(torch.from_numpy(cos), torch.from_numpy(labels), 0.1)
    assert math.isnan(float(loss)) and math.isnan(want_loss)
    np.testing.assert_array_equal(torch.isnan(diff).numpy(), np.isnan(want_diff))
    assert torch.isnan(diff[:2]).all() and diff[2] == 0     # the pair at 0.95 is skipped at every level


# ----------------------------------------------------------------------------------- gradients

def away_from_edges(cos, levels, margin=1e-3):
    for d in levels:
        x = (cos + 1.0) / d
        frac = x - np.floor(x)
        if np.any(frac < margin / d) or np.any(frac > 1 - margin / d) or np.any(np.abs(1.0 - cos - d) < margin):
            return False
    return True


def smooth_cosines(m, levels, seed):
    rng = np.random.default_rng(seed)
    while True:
        cos = rng.uniform(-0.95, 0.95, size=m)
        if away_from_edges(cos, levels):
            return torch.tensor(cos, dtype=torch.float64, requires_grad=True)


GRAD_LABELS = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2, 3], dtype=torch.float64)


@pytest.mark.parametrize("delta", [0.3, 0.05])
def test_caffe_diff_is_the_true_gradient_away_from_edges(delta):
    cos = smooth_cosines(45, caffe_levels(delta), seed=7)
    assert torch.autograd.gradcheck(lambda c: fappy_caffe(c, GRAD_LABELS, delta), (cos,), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("delta", [0.3, 0.05])
def test_paper_gradcheck(delta):
    cos = smooth_cosines(45, paper_levels(delta), seed=8)
    assert torch.autograd.gradcheck(lambda c: fappy_paper(c, GRAD_LABELS, delta), (cos,), eps=1e-6, atol=1e-8)


def smooth_embeddings(levels):
    """Embeddings whose 45 cosines all stay 1e-4 away from every bin edge and from 1 - s = d."""
    iu, ju = torch.triu_indices(10, 10, 1)
    for seed in range(1000):
        x = torch.randn(10, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        c = torch.nn.functional.normalize(x, dim=1)
        if away_from_edges((c @ c.t())[iu, ju].numpy(), levels, margin=1e-4):
            return x.requires_grad_()
    raise AssertionError("no smooth draw")


@pytest.mark.parametrize("mode", ["caffe", "paper"])
def test_gradcheck_through_embeddings(mode):
    x = smooth_embeddings(caffe_levels(0.05))
    loss_fn = FAPPYLoss(0.05, mode=mode)
    assert torch.autograd.gradcheck(lambda e: loss_fn(e, GRAD_LABELS), (x,), eps=1e-6, atol=1e-8)


# ----------------------------------------------------------------------- closed-form hand cases

def test_hand_case_where_paper_and_caffe_differ():
    """labels [0,0,1,1]; cosines (01, 02, 03, 12, 13, 23) = (.3, .6, -.7, -.2, .1, .9); Δmin = 0.5.

    Levels 2 and 1 skip both positive pairs (1 − s < d); at d = 0.5 pair 23 is skipped (0.1 < 0.5) and
    pair 01 is in bin t = 2 = [0, .5]: lh = .4, rh = .6.  Negatives (|N| = 2): row 0: .6 → bins 3/4
    (.8/.2), −.7 → bins 0/1 (.4/.6); row 1: −.2 → bins 1/2 (.4/.6), .1 → bins 2/3 (.8/.2).
    h0 + h1 = [.2, .5, .7, .5, .1]; P = .4·(.7+.5+.1) + .6·(.5+.1) = .88.
    Paper: L = ((0/2)/2 + .88/2)/2 = .22 (C = 2 positive pairs).  Caffe: (0 + .88)/1/2 = .44 (one pair
    used at this level).  dP/ds01 = −.7/.5; ds12 (bin t−1): lh/(d|N|) = .4; ds13 (bin t): rh/(d|N|) = .6;
    .6 (bin t+1) and −.7 (bin 0): 0.  Paper gradient ×1/4, Caffe ×1/2."""
    lab = torch.tensor([0.0, 0.0, 1.0, 1.0])
    raw = torch.tensor([-1.4, 0.0, 0.0, 0.4, 0.6, 0.0], dtype=torch.float64)
    cos = torch.tensor([0.3, 0.6, -0.7, -0.2, 0.1, 0.9], dtype=torch.float64, requires_grad=True)
    paper = fappy_paper(cos, lab, 0.5)
    (g_paper,) = torch.autograd.grad(paper, cos)
    caffe = fappy_caffe(cos, lab, 0.5)
    (g_caffe,) = torch.autograd.grad(caffe, cos)
    assert paper.item() == pytest.approx(0.22, abs=1e-14)
    assert caffe.item() == pytest.approx(0.44, abs=1e-14)
    torch.testing.assert_close(g_paper, raw / 4, rtol=0, atol=1e-14)
    torch.testing.assert_close(g_caffe, raw / 2, rtol=0, atol=1e-14)
    l32, d32 = fappy_caffe_forward_backward(cos.detach().float(), lab, 0.5)
    assert float(l32) == pytest.approx(0.44, rel=1e-6)
    torch.testing.assert_close(d32, (raw / 2).float(), rtol=1e-6, atol=1e-6)


def test_hand_case_two_levels_single_pair_modes_agree():
    """labels [0,0,1], cosines (.3, .6, −.2), Δmin = .25: d = .5 gives P = .4·1.6 + .6·1.0 = 1.24
    (row 0: .6 → bins 3/4 .8/.2; row 1: −.2 → bins 1/2 .4/.6), d = .25 (t = 5, lh .8, rh .2) gives
    .8·1 + .2·1 = 1; L = ((1.24)/2 + 1)/2 = .81 in both modes (one pair, never skipped below d = 1)."""
    cos, lab = torch.tensor([0.3, 0.6, -0.2], dtype=torch.float64), torch.tensor([0.0, 0.0, 1.0])
    assert float(fappy_paper(cos, lab, 0.25)) == pytest.approx(0.81, abs=1e-14)
    assert float(fappy_caffe(cos, lab, 0.25)) == pytest.approx(0.81, abs=1e-14)


def test_hand_case_delta_above_two():
    """Δmin = 2.5: Caffe runs no level (0); the paper's repeat-until runs d = 2, where only s = −1 is used:
    t = 0, lh = 1, rh = 0, and each row's histogram sums to 1 above bin 0, so P = 2 and L = (2/1)/2 = 1."""
    cos, lab = torch.tensor([-1.0, 0.2, -0.6], dtype=torch.float64), torch.tensor([0.0, 0.0, 1.0])
    assert float(fappy_paper(cos, lab, 2.5)) == 1.0
    assert float(fappy_caffe(cos, lab, 2.5)) == 0.0


def test_no_positive_pairs_is_zero_in_both_modes():
    x = torch.randn(5, 3, requires_grad=True)
    for mode in ("caffe", "paper"):
        loss = FAPPYLoss(0.01, mode=mode)(x, torch.arange(5.0))
        loss.backward()
        assert loss.item() == 0.0 and not x.grad.any()


# --------------------------------------------------------------------------------- module / device

def test_module_matches_functional_on_fixture_cosines():
    z = load("b32_d64_delta0.01")
    feat, lab = torch.from_numpy(z["feat"]), torch.from_numpy(z["label"])
    module = FAPPYLoss(0.01)
    assert "mode='caffe'" in repr(module)
    iu, ju = torch.triu_indices(32, 32, 1)
    c = (feat @ feat.t()) / torch.sqrt(torch.diagonal(feat @ feat.t())[:, None] * torch.diagonal(feat @ feat.t()))
    assert float(module(feat, lab)) == float(fappy_caffe(c[iu, ju], lab, 0.01))


def test_module_gradient_is_the_chain_rule_through_the_cosines():
    """FAPPYLoss(mode="caffe") back-propagates through CosineSimilarityBatch's formula in one matmul;
    it must equal autograd through the cosine matrix and the functional layer (float64, fixture data
    with its bin-edge cases, single-label NaN case included)."""
    for name in ("b32_d64_delta0.01", "b16_d8_delta0.1", "edge_single_label"):
        z = load(name)
        feat, lab, delta = torch.from_numpy(z["feat"]).double(), torch.from_numpy(z["label"]), float(z["delta"])
        x1, x2 = feat.clone().requires_grad_(), feat.clone().requires_grad_()
        FAPPYLoss(delta)(x1, lab).backward()
        iu, ju = torch.triu_indices(len(lab), len(lab), 1)
        fappy_caffe(cosine_matrix(x2)[iu, ju], lab, delta).backward()
        torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-12, atol=1e-15, equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
def test_device_follows_inputs(device):
    z = load("b128_d512_delta0.0001")
    cos = torch.from_numpy(z["cosine"]).to(device).requires_grad_()
    lab = torch.from_numpy(z["label"]).to(device)
    loss = fappy_caffe(cos, lab, 1e-4)
    loss.backward()
    assert loss.device.type == device and cos.grad.device.type == device
    assert loss.item() == pytest.approx(float(z["loss"]), rel=LOSS_RTOL)
    np.testing.assert_allclose(cos.grad.cpu().numpy(), z["cosine_diff"], rtol=DIFF_RTOL, atol=DIFF_ATOL)
    paper = fappy_paper(cos.detach(), lab, 1e-4)
    assert paper.device.type == device and 0.0 < float(paper) < 1.0


def test_module_rejects_bad_batches():
    with pytest.raises(LossInputError, match="embeddings must be"):
        FAPPYLoss()(torch.randn(4), torch.zeros(4))
    with pytest.raises(LossInputError, match="labels"):
        FAPPYLoss()(torch.randn(4, 3), torch.zeros(5))


@pytest.mark.parametrize("delta", [0.3, 0.01, 1e-3])
def test_bin_counts_from_the_table_equal_the_binary_searches(monkeypatch, delta):
    """The per-row table of finest bins and the batched searchsorted are two ways to count a row's
    negatives below a bin; loss and diff must agree bit for bit, cosines on bin edges and at ±1
    included, in both modes."""
    import caffe_compat.losses.fappy_rows as fappy_rows

    gen = torch.Generator().manual_seed(7)
    lab = torch.randint(0, 5, (24,), generator=gen).double()
    m = 24 * 23 // 2
    edges = torch.tensor([-1.0, 1.0, 0.0, 0.5, -0.25, 1.0 - 2 ** -7, -1.0 + 2 ** -10], dtype=torch.float64)
    cos = torch.rand(m, generator=gen, dtype=torch.float64) * 2 - 1
    cos[torch.randperm(m, generator=gen)[:40]] = edges[torch.randint(0, len(edges), (40,), generator=gen)]
    same = (lab[:, None] == lab[None, :])[tuple(torch.triu_indices(24, 24, 1))]
    cos[~same] = cos[~same].clamp(max=0.999)  # a negative pair at 1.0 is Caffe's out-of-bounds read
    results = {}
    for columns in (0, 10 ** 9):
        monkeypatch.setattr(fappy_rows, "_TABLE_COLUMNS_PER_ROW", columns)
        c = cos.clone().requires_grad_()
        fappy_paper(c, lab, delta).backward()
        results[columns] = (fappy_caffe_forward_backward(cos, lab, delta), c.grad)
    (loss_a, diff_a), grad_a = results[0]
    (loss_b, diff_b), grad_b = results[10 ** 9]
    assert float(loss_a) == float(loss_b) and torch.equal(diff_a, diff_b) and torch.equal(grad_a, grad_b)
    assert diff_a.abs().sum() > 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["b32_d64_delta0.01", "b16_d8_delta0.1", "edge_single_label", "b128_d512_delta0.0001"])
def test_fixed_shape_layer_equals_the_layer(name, device, monkeypatch):
    """The graph-capturable form (B − 1 slots per row, every level, no host synchronisation) gives the
    layer's loss and diff; on CUDA the FAPPYLoss module replays it as a CUDA graph and must give the
    kernel-by-kernel numbers, gradient included."""
    import caffe_compat.losses.fappy as fappy_module

    z = load(name)
    feat, lab, delta = torch.from_numpy(z["feat"]).double().to(device), torch.from_numpy(z["label"]).to(device), float(z["delta"])
    sim, levels = cosine_matrix(feat), caffe_levels(delta)
    loss_static, h_static, unreadable = fappy_module._caffe_static(sim, lab, levels)
    loss, h = fappy_module._caffe(fappy_module._from_matrix(sim), lab, levels)
    assert not bool(unreadable)
    # float64 throughout; on CUDA scatter_add's atomics add in any order, so allow a few ulps of the scale
    torch.testing.assert_close(loss_static, loss, rtol=1e-12, atol=0, equal_nan=True)
    scale = float(torch.nan_to_num(h.abs(), nan=0.0).max())
    torch.testing.assert_close(h_static, h, rtol=1e-12, atol=1e-13 * scale, equal_nan=True)
    if device == "cuda":
        results = []
        for graphs in (True, False):
            monkeypatch.setattr(fappy_module, "USE_CUDA_GRAPHS", graphs)
            x = feat.float().clone().requires_grad_()
            value = FAPPYLoss(delta)(x, lab)
            value.backward()
            results.append((value.detach(), x.grad))
        grad_scale = float(torch.nan_to_num(results[1][1].abs(), nan=0.0).max())
        torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-6, atol=0, equal_nan=True)
        torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-5, atol=1e-6 * grad_scale, equal_nan=True)
        assert fappy_module._GRAPHS  # the graph path really ran


@pytest.mark.parametrize("device", DEVICES)
def test_out_of_bounds_input_is_named_on_every_path(device):
    """A zero feature row gives NaN cosines, which Caffe reads out of bounds: the module raises the
    layer's error naming the pair, whether it ran kernel by kernel or as a CUDA graph."""
    z = load("b16_d8_delta0.1")
    feat, lab = torch.from_numpy(z["feat"]).float().to(device), torch.from_numpy(z["label"]).to(device)
    feat[3] = 0.0
    with pytest.raises(LossInputError, match=r"pair \(\d+, \d+\).*out of bounds"):
        FAPPYLoss(0.1)(feat, lab)

"""VehicleID protocol: one random gallery image per vehicle, CMC of the rest, mean/std over repeats."""

import numpy as np
import pytest
import torch

from caffe_compat.errors import CaffeCompatError
from caffe_compat.evaluate import vehicleid_cmc, vehicleid_cmc_curve
from caffe_compat.evaluate.vehicleid import gallery_cmc, gallery_split


def on_circle(degrees):
    a = np.deg2rad(np.asarray(degrees, dtype=np.float64))
    return np.stack([np.cos(a), np.sin(a)], axis=1)


# vehicle 10: images at 0 and 1 deg; vehicle 20: at 3 and 100 deg; vehicle 30: one image at 50 deg
X = on_circle([0, 1, 3, 100, 50])
IDS = [10, 10, 20, 20, 30]


def test_gallery_cmc_by_hand():
    # gallery (0, 100, 50): query 1deg (A) ranks 0deg first; query 3deg (B) sees 0, 50, then 100 -> rank 2
    np.testing.assert_allclose(gallery_cmc(X, IDS, [0, 3, 4]), [0.5, 0.5, 1.0], rtol=0, atol=1e-15)
    # gallery (1, 3, 50): query 0deg -> rank 0; query 100deg sees 50, then 3 -> rank 1
    np.testing.assert_allclose(gallery_cmc(X, IDS, [1, 2, 4]), [0.5, 1.0, 1.0], rtol=0, atol=1e-15)
    np.testing.assert_allclose(gallery_cmc(X, IDS, [0, 2, 4]), [0.5, 1.0, 1.0], rtol=0, atol=1e-15)
    np.testing.assert_allclose(gallery_cmc(X, IDS, [1, 3, 4]), [0.5, 0.5, 1.0], rtol=0, atol=1e-15)
    with pytest.raises(CaffeCompatError, match="no image in the gallery"):
        gallery_cmc(X, IDS, [0, 1, 4])


def test_gallery_split_draws_one_image_per_vehicle():
    codes = torch.tensor([0, 0, 1, 1, 2, 1, 0, 3])
    seen = set()
    generator = torch.Generator().manual_seed(0)
    for _ in range(30):
        gallery, queries = gallery_split(codes, generator)
        assert sorted(codes[gallery].tolist()) == [0, 1, 2, 3]
        assert codes[gallery].tolist() == [0, 1, 2, 3]  # gallery ordered by vehicle
        assert sorted(gallery.tolist() + queries.tolist()) == list(range(8))
        seen.add(tuple(gallery.tolist()))
    assert len(seen) == 9  # 3 choices for vehicle 0 times 3 for vehicle 1: all drawn in 30 tries


def test_protocol_mean_and_std_over_repeats():
    repeats, seed = 10, 0
    generator = torch.Generator().manual_seed(seed)
    b_near = [2 in gallery_split(torch.tensor([0, 0, 1, 1, 2]), generator)[0].tolist() for _ in range(repeats)]
    assert 0 < sum(b_near) < repeats  # this seed draws both outcomes
    top2 = np.where(b_near, 1.0, 0.5)
    result = vehicleid_cmc(X, IDS, repeats=repeats, seed=seed, ranks=(1, 2, 3, 9))
    assert result[1] == (0.5, 0.0)
    assert result[2][0] == pytest.approx(top2.mean(), abs=1e-15)
    assert result[2][1] == pytest.approx(top2.std(), abs=1e-15)
    assert result[3] == (1.0, 0.0) and result[9] == (1.0, 0.0)
    np.testing.assert_allclose(vehicleid_cmc_curve(X, IDS, repeats, seed), [0.5, top2.mean(), 1.0], atol=1e-15)


def test_perfect_features_and_seed_reproducibility():
    rng = np.random.default_rng(0)
    ids = np.repeat(np.arange(30), rng.integers(1, 6, 30))
    x = np.eye(32)[ids] + 0.01 * rng.normal(size=(len(ids), 32))
    assert vehicleid_cmc(x, ids)[1] == (1.0, 0.0)
    noisy = np.eye(32)[ids] + 0.4 * rng.normal(size=(len(ids), 32))
    assert vehicleid_cmc(noisy, ids, seed=3) == vehicleid_cmc(noisy, ids, seed=3)
    assert vehicleid_cmc(noisy, ids, seed=3, budget_bytes=1) == vehicleid_cmc(noisy, ids, seed=3)
    curve = vehicleid_cmc_curve(noisy, ids)
    assert curve.shape == (30,) and np.all(np.diff(curve) >= 0) and curve[-1] == 1.0


def test_no_query_is_an_error():
    with pytest.raises(CaffeCompatError, match="single image"):
        vehicleid_cmc(np.eye(3), [1, 2, 3])
    with pytest.raises(CaffeCompatError, match="repeats"):
        vehicleid_cmc(X, IDS, repeats=0)

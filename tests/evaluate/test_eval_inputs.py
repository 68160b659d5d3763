"""Feature validation and normalisation (``as_features``): the finiteness check read from the row norms."""

import numpy as np
import pytest
import torch

from caffe_compat.evaluate.inputs import EvaluationInputError, as_features


def test_normalised_rows_are_f_normalize_bit_for_bit():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 37)).astype(np.float32) * rng.lognormal(0, 8, size=(300, 1)).astype(np.float32)
    x[5] = 0.0           # a zero row stays zero (eps clamp)
    x[7] = 3e30          # finite entries whose squared sum overflows: norm inf, each entry divided by it
    x[9, :3] = -2e-40    # subnormals
    expected = torch.nn.functional.normalize(torch.from_numpy(x), dim=1, eps=1e-12)
    got = as_features(x)
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
    assert torch.equal(as_features(x, normalize=False), torch.from_numpy(x))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("row", [0, 150, 299])
def test_any_non_finite_entry_is_refused(bad, row):
    x = np.random.default_rng(1).normal(size=(300, 16)).astype(np.float32)
    x[row, 11] = bad
    for normalize in (True, False):
        with pytest.raises(EvaluationInputError, match="features: contains NaN or Inf"):
            as_features(x, normalize=normalize)
    x[row] = 1e30        # the row's norm overflows too: the element-wise check still tells the two apart
    x[row, 3] = bad
    with pytest.raises(EvaluationInputError, match="NaN or Inf"):
        as_features(torch.from_numpy(x))


def test_overflowing_norm_alone_is_accepted():
    x = np.full((4, 8), 1e30, dtype=np.float32)
    assert torch.isinf(torch.from_numpy(x).norm(2, 1)).all()  # the case the element-wise check decides
    assert torch.equal(as_features(x, normalize=False), torch.from_numpy(x))

"""quant.quantile: numpy-compatible linear interpolation, any size, along a dimension."""
import numpy as np
import pytest
import torch

from quant.quantile import quantile

LEVELS = [0.999, 0.9999, 0.99999, 1 - 0.999, 1 - 0.9999, 1 - 0.99999, 0.0, 1.0, 0.37]


@pytest.mark.parametrize("n", [1, 2, 3, 192, 1001])
def test_matches_numpy_on_small_tensors(n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    got = quantile(x, LEVELS)
    want = np.array([np.quantile(x.numpy(), q) for q in LEVELS])
    np.testing.assert_array_equal(got.numpy(), want)


def test_ties_and_dim():
    x = torch.tensor([[3.0, 1.0, 1.0, 1.0, 2.0], [5.0, 5.0, 5.0, 0.0, -1.0]])
    got = quantile(x, [0.9, 0.1, 0.5], dim=1)
    want = np.stack([np.quantile(x.numpy(), q, axis=1) for q in [0.9, 0.1, 0.5]])
    np.testing.assert_array_equal(got.numpy(), want)
    got0 = quantile(x, [0.75], dim=0)
    np.testing.assert_array_equal(got0.numpy()[0], np.quantile(x.numpy(), 0.75, axis=0))


def test_above_2_pow_24_elements_matches_numpy():
    # torch.quantile refuses such inputs on some torch versions; RepQ-ViT fell back to numpy here.
    x = torch.randn(2 ** 24 + 1001, generator=torch.Generator().manual_seed(0))
    x[:50] = 40.0  # a few outliers in the tail, like a ViT-B fc2 input
    levels = [0.999, 0.9999, 0.99999, 1 - 0.999, 1 - 0.9999, 1 - 0.99999]
    got = quantile(x, levels).numpy()
    xn = x.numpy()
    want = np.quantile(xn, levels)  # one partition pass; float64 weights, hence rtol
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)


def test_rejects_bad_levels():
    with pytest.raises(ValueError):
        quantile(torch.randn(5), [1.5])

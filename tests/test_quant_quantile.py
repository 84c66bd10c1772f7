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


def test_a_level_exactly_halfway_interpolates_from_the_upper_value_as_numpy_does():
    # pos = 0.25 * 2 = 0.5: numpy's _lerp takes b - (b - a) * 0.5 there; a + (b - a) * 0.5 differs in the last bit
    x = torch.tensor([-0.00013210486, 0.012573021, 1.0125730])
    got = quantile(x, [0.25])
    assert got.item() == np.quantile(x.numpy(), 0.25)
    a, b = x[0], x[1]
    assert got.item() == (b - (b - a) * 0.5).item() != (a + (b - a) * 0.5).item()


def test_reduced_dimension_leaves_the_others_in_order():
    x = torch.randn(5, 3, 4, generator=torch.Generator().manual_seed(1))
    for dim in (0, 1, -1):
        got = quantile(x, [0.2, 0.9], dim=dim)
        want = np.stack([np.quantile(x.numpy(), q, axis=dim) for q in (0.2, 0.9)])
        assert got.shape == want.shape
        np.testing.assert_array_equal(got.numpy(), want)


def test_an_empty_tensor_is_a_value_error():
    with pytest.raises(ValueError, match="empty"):
        quantile(torch.zeros(0), [0.5])
    with pytest.raises(ValueError, match="empty"):
        quantile(torch.zeros(3, 0), [0.5], dim=1)

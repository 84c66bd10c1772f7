"""quant.quantile: torch.quantile's result bit for bit (level, rank, weight and lerp), any size, along a dimension."""
import math

import numpy as np
import pytest
import torch

from quant.quantile import quantile

REPQ = [0.999, 0.9999, 0.99999]
LEVELS = REPQ + [1 - p for p in REPQ] + [0.0, 1.0, 0.5, 0.37]


def torch_reference(x, levels, dim=None):
    """One torch.quantile call per level, as RepQ-ViT's quantizers call it (a Python float q)."""
    return torch.stack([torch.quantile(x, q, dim=dim) for q in levels])


def assert_bitwise(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want), (got - want).abs().max().item()


@pytest.mark.parametrize("n", [1, 2, 3, 7, 192, 1001, 4097, 98304, 100003])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_torch_quantile_bit_for_bit(n, dtype):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n), dtype=dtype)
    x[: max(1, n // 500)] *= 30  # a few outliers in the tail, like a post-GELU activation
    assert_bitwise(quantile(x, LEVELS), torch_reference(x, LEVELS))


def test_the_tail_levels_follow_torch_not_numpy():
    # 32 images x 3 x 32 x 32: torch rounds 0.99999 to float32 (0.9999899864) and takes the rank from that;
    # numpy's linear method keeps the float64 level and interpolates in two rounded steps.
    x = torch.randn(32 * 3 * 32 * 32, generator=torch.Generator().manual_seed(0))
    got = quantile(x, REPQ)
    for k, p in enumerate(REPQ):
        assert got[k].item() == torch.quantile(x, p).item()
    assert got[2].item() != np.float32(np.quantile(x.numpy(), 0.99999))


def test_closed_form_of_the_arithmetic():
    # Spelled out on a sorted copy: float32 level, float64 rank, float32 weight, torch.lerp (fused where the
    # device has an FMA, so it is not a + (b - a) * w rounded twice).
    x = torch.randn(98304, generator=torch.Generator().manual_seed(3))
    s = torch.sort(x).values
    for q in REPQ + [1 - p for p in REPQ]:
        rank = float(np.float32(q)) * (x.numel() - 1)
        i, j = math.floor(rank), math.ceil(rank)
        w = torch.tensor([rank - i], dtype=torch.float32)
        want = torch.lerp(s[i:i + 1], s[j:j + 1], w)
        assert quantile(x, [q]).item() == want.item()


@pytest.mark.parametrize("dim", [0, 1, 2, -1, -2])
def test_reduced_dimension_matches_torch_and_keeps_the_others_in_order(dim):
    x = torch.randn(37, 5, 211, generator=torch.Generator().manual_seed(1))
    assert_bitwise(quantile(x, LEVELS, dim=dim), torch_reference(x, LEVELS, dim=dim))


def test_ties_and_dim():
    x = torch.tensor([[3.0, 1.0, 1.0, 1.0, 2.0], [5.0, 5.0, 5.0, 0.0, -1.0]])
    for dim in (0, 1):
        assert_bitwise(quantile(x, [0.9, 0.1, 0.5, 0.75], dim=dim), torch_reference(x, [0.9, 0.1, 0.5, 0.75], dim))


def test_a_tensor_of_levels_as_aphq_passes_them_gives_the_same():
    # APHQ-ViT calls torch.quantile(x, torch.tensor([l, r]), dim=-1) and (1 - pct) in float32; the Python levels
    # equal to those float32 values give the same quantiles.
    rows = torch.randn(6, 3000, generator=torch.Generator().manual_seed(2))
    pct = torch.tensor([0.9, 1.0])
    want = torch.cat([torch.quantile(rows, pct, dim=-1), torch.quantile(rows, 1 - pct, dim=-1)])
    levels = [float(v) for v in torch.cat([pct, 1 - pct])]
    assert_bitwise(quantile(rows, levels, dim=1), want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_are_computed_as_their_float32_copy(dtype):
    # torch.quantile refuses these dtypes; the float32 copy holds the same values exactly.
    x = torch.randn(5000, generator=torch.Generator().manual_seed(4)).to(dtype)
    got = quantile(x, LEVELS)
    assert got.dtype == dtype
    assert_bitwise(got, torch_reference(x.float(), LEVELS).to(dtype))


def test_a_row_holding_nan_gives_nan_as_torch():
    x = torch.randn(3, 400, generator=torch.Generator().manual_seed(5))
    x[1, 17] = float("nan")
    got, want = quantile(x, LEVELS, dim=1), torch_reference(x, LEVELS, dim=1)
    assert torch.isnan(got[:, 1]).all() and torch.isnan(want[:, 1]).all()
    assert_bitwise(got[:, [0, 2]], want[:, [0, 2]])


def test_just_below_2_pow_24_elements_matches_torch():
    x = torch.randn(2 ** 24 - 1, generator=torch.Generator().manual_seed(6))
    x[:50] = 40.0  # a few outliers in the tail, like a ViT-B fc2 input
    levels = REPQ + [1 - p for p in REPQ]
    assert_bitwise(quantile(x, levels), torch_reference(x, levels))


def test_above_2_pow_24_elements_matches_torch():
    # Older torch refused this size (RepQ-ViT then fell back to np.percentile); the torch here computes it
    # with the same arithmetic, and so does quantile.
    x = torch.randn(2 ** 24 + 1, generator=torch.Generator().manual_seed(0))
    x[:50] = 40.0
    levels = REPQ + [1 - p for p in REPQ]
    assert_bitwise(quantile(x, levels), torch_reference(x, levels))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_matches_torch_quantile_on_the_gpu():
    for n in (1001, 98304, 3 * 197 * 3072):
        x = torch.randn(n, generator=torch.Generator().manual_seed(n)).cuda()
        assert_bitwise(quantile(x, LEVELS), torch_reference(x, LEVELS))
        rows = x[: n - n % 7].reshape(7, -1)
        assert_bitwise(quantile(rows, LEVELS, dim=1), torch_reference(rows, LEVELS, dim=1))


def test_rejects_bad_levels():
    with pytest.raises(ValueError):
        quantile(torch.randn(5), [1.5])


def test_an_empty_tensor_is_a_value_error():
    with pytest.raises(ValueError, match="empty"):
        quantile(torch.zeros(0), [0.5])
    with pytest.raises(ValueError, match="empty"):
        quantile(torch.zeros(3, 0), [0.5], dim=1)


def bits(t):
    """The tensor's bit patterns, so that NaNs (and their signs) compare as torch.equal cannot compare them."""
    return t.view({torch.float32: torch.int32, torch.float64: torch.int64}[t.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_row_holding_a_negative_nan_gives_torch_quantiles_nan_bit_for_bit(dtype):
    # -NaN is what x86 arithmetic makes of 0/0 or inf - inf: torch.quantile returns the row's own NaN, not +NaN
    x = torch.randn(4, 300, generator=torch.Generator().manual_seed(7), dtype=dtype)
    x[1, 40] = -float("nan")
    x[2, [3, 250]] = -float("nan")
    x[3, 299] = float("nan")
    got, want = quantile(x, LEVELS, dim=1), torch_reference(x, LEVELS, dim=1)
    assert got.shape == want.shape and torch.equal(bits(got), bits(want)), (bits(got)[:, 1], bits(want)[:, 1])
    assert (bits(got[:, 1:3]) < 0).all()  # the sign bit of the -NaN kept


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool])
def test_a_tensor_of_no_floating_dtype_is_refused_as_torch_quantile_refuses_it(dtype):
    x = torch.tensor([1, 0, 1, 1]).to(dtype)
    with pytest.raises(RuntimeError):
        torch.quantile(x, 0.5)
    with pytest.raises(RuntimeError, match=f"quantile\\(\\) input tensor must be a floating dtype, not {dtype}"):
        quantile(x, [0.5])


@pytest.mark.parametrize("dim", [None, 0, -1])
def test_a_0d_tensor_is_one_element_along_its_dimension_as_torch_takes_it(dim):
    x = torch.tensor(2.5)
    assert_bitwise(quantile(x, LEVELS, dim=dim), torch_reference(x, LEVELS, dim=dim))


@pytest.mark.parametrize("dim", [1, -2])
def test_a_0d_tensor_refuses_another_dimension_as_torch_does(dim):
    with pytest.raises(IndexError) as theirs:
        torch.quantile(torch.tensor(2.5), 0.5, dim=dim)
    with pytest.raises(IndexError) as ours:
        quantile(torch.tensor(2.5), [0.5], dim=dim)
    assert str(ours.value) == str(theirs.value)


def test_a_zero_quantile_has_torch_quantiles_value_whatever_the_sign_of_the_zeros():
    # -0.0 and +0.0 tie: which stands at a rank depends on how ties are ordered, so only the value is promised
    x = torch.tensor([[-0.0, 0.0, 1.0], [0.0, -0.0, -1.0], [-0.0, -0.0, 0.0]])
    got, want = quantile(x, LEVELS, dim=1), torch_reference(x, LEVELS, dim=1)
    assert torch.equal(got, want)  # -0.0 == 0.0

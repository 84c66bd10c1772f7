"""quant.quantile: torch.quantile's result bit for bit (level, rank, weight and lerp), any size, along a dimension.

The running torch's torch.quantile is the reference wherever it computes (torch 2.11 refuses above 2^24 elements);
beyond, a closed form on a sorted copy with the running torch's rank rule (float32 ranks on torch 2.11, float64 on
2.14), which these tests find from torch.quantile themselves."""
import math

import numpy as np
import pytest
import torch

from quant.quantile import quantile, rank_plan, ranks_in_float64

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


def closed_form(s, q, float64_ranks):
    """The q quantile of a float32 sorted 1-d tensor s, spelled out with numpy's scalars: float32 level, rank
    `q * (n - 1)` in float64 or float32 (torch 2.11's float32 tensor times its integer last index, the index cast
    to float32 first), float32 weight, torch.lerp (fused where the device has an FMA, so it is not a + (b - a) * w
    rounded twice); ranks past the last element (float32 ranks above 2^24) taken as the last."""
    n = s.numel()
    if float64_ranks:
        rank = float(np.float32(q)) * (n - 1)
    else:
        rank = float(np.float32(q) * np.float32(n - 1))
    i, j = min(math.floor(rank), n - 1), min(math.ceil(rank), n - 1)
    w = torch.tensor([rank - i if j > i else 0.0], dtype=torch.float32)
    return torch.lerp(s[i:i + 1], s[j:j + 1], w)[0]


def torch_ranks_in_float64():
    """The running torch.quantile's rank rule for float32 inputs, from the closed forms (not quant.quantile's probe):
    the reviewer's case, 0.99999 of 98,304 normal values, where the two rules differ by 1.7e-4."""
    x = torch.randn(98304, generator=torch.Generator().manual_seed(98304))
    s = torch.sort(x).values
    got = torch.quantile(x, 0.99999)
    matches = [rule for rule in (True, False) if torch.equal(closed_form(s, 0.99999, rule), got)]
    assert len(matches) == 1, (torch.__version__, got.item())
    return matches[0]


def test_the_probe_finds_the_running_torchs_rank_rule():
    assert ranks_in_float64() is torch_ranks_in_float64()


def test_closed_form_of_the_arithmetic():
    # torch.quantile equals the closed form of exactly one rank rule, the probe's, at every tail level where the two
    # differ, and quantile equals torch.quantile there
    x = torch.randn(98304, generator=torch.Generator().manual_seed(3))
    s = torch.sort(x).values
    rule = torch_ranks_in_float64()
    for q in REPQ + [1 - p for p in REPQ]:
        want = torch.quantile(x, q)
        assert torch.equal(closed_form(s, q, rule), want), q
        assert quantile(x, [q])[0].item() == want.item()
    assert any(not torch.equal(closed_form(s, q, True), closed_form(s, q, False)) for q in REPQ)


@pytest.mark.parametrize("float64_ranks", [True, False])
@pytest.mark.parametrize("n", [1, 2, 1001, 98304, 1815552, 2 ** 24 + 1, 2 ** 24 + 4, 3 * 2 ** 24 + 5])
def test_both_rank_rules_against_numpy_on_any_torch(n, float64_ranks):
    # Whichever rule the running torch follows, the other is checked here too: numpy's float32 / float64 scalars,
    # and above 2^24 float32 ranks that round past the last element (n - 1 = 2^24 + 3 rounds up to 2^24 + 4)
    for q in LEVELS:
        if float64_ranks:
            rank = float(np.float32(q)) * (n - 1)
        else:
            rank = float(np.float32(q) * np.float32(n - 1))
        i, j = min(math.floor(rank), n - 1), min(math.ceil(rank), n - 1)
        ((pi, pj, pw),) = rank_plan([q], n, torch.float32, float64_ranks)
        assert (pi, pj) == (i, j), (q, rank)
        assert np.float32(pw) == (np.float32(rank - i) if j > i else 0.0), q  # the weight as the dtype takes it


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


@pytest.mark.parametrize("n", [2 ** 24 + 1, 2 ** 24 + 4])
def test_above_2_pow_24_elements_matches_torch_or_its_rule(n):
    # torch 2.11 refuses this size (RepQ-ViT then falls back to np.percentile), torch 2.14 computes it with its float64
    # ranks; quantile follows the running torch's rule at any size: torch.quantile where it computes, else the closed
    # form of its rule (float32 ranks, n - 1 = 2^24 + 3 rounding past the last element)
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    x[:50] = 40.0
    levels = REPQ + [1 - p for p in REPQ] + [1.0]
    got = quantile(x, levels)
    try:
        want = torch_reference(x, levels)
    except RuntimeError as e:
        assert "too large" in str(e)
        s = torch.sort(x).values
        want = torch.stack([closed_form(s, q, torch_ranks_in_float64()) for q in levels])
    assert_bitwise(got, want)


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


def test_the_rank_rule_probe_creates_no_tensor_on_the_default_device():
    """The probe (ranks_in_float64, cached) runs at a process's first quantile: a tensor of it made without a device
    landed on the default one ('meta' here, 'cuda' in a user's process), and the first quantile failed there or
    passed depending on which test had probed first."""
    ranks_in_float64.cache_clear()
    try:
        with torch.device("meta"):
            got = quantile(torch.arange(11, dtype=torch.float32, device="cpu"), [0.5])
    finally:
        ranks_in_float64.cache_clear()
    assert got.device.type == "cpu" and got.item() == 5.0

"""Scripts create their tensors on the device of the data they belong to, checked with the meta-default trick of
tests/device_utils.py (a tensor made on the default device becomes a meta tensor and the run fails, where a CUDA
run would have mixed a CPU tensor with GPU data). Results are checked against naive references, not only their
device."""
import pytest
import torch

from models.gpt import build_gpt

pytestmark = pytest.mark.usefixtures("one_thread")


def naive_int8_probability_attention(attn, x: torch.Tensor) -> torch.Tensor:
    """SplitAttention with prob_bits set, one query at a time: a softmax over the keys up to the query's position,
    probabilities rounded to k / 127, then the output projection."""
    b, t, c = x.shape
    heads = attn.num_heads
    d = c // heads
    q, k, v = (getattr(attn, n)(x).view(b, t, heads, d) for n in ("q_proj", "k_proj", "v_proj"))
    y = torch.zeros(b, t, heads, d, dtype=x.dtype)
    for i in range(t):
        scores = torch.einsum("bhd,bjhd->bhj", q[:, i], k[:, :i + 1]) / d ** 0.5
        p = (scores.softmax(-1) * 127).round() / 127
        y[:, i] = torch.einsum("bhj,bjhd->bhd", p, v[:, :i + 1])
    return attn.proj(y.reshape(b, t, c))


def test_crosscheck_int8_probability_attention_masks_on_the_scores_device():
    """scripts/crosscheck_lm_quant.py SplitAttention (adaptation 4, int8 probabilities): the causal mask was made
    on the default device."""
    import crosscheck_lm_quant as xc

    torch.manual_seed(0)
    model = xc.split_qkv(build_gpt("gpt2_nano", vocab_size=64).eval()).double()
    for block in model.blocks:
        block.attn.prob_bits = 8
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    x = torch.randn(2, 16, model.blocks[0].attn.q_proj.in_features, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = naive_int8_probability_attention(model.blocks[0].attn, x)
        with torch.device("meta"):
            attended = model.blocks[0].attn(x)
            logits = model(tokens)
    assert attended.device.type == "cpu" and torch.allclose(attended, expected, atol=1e-10)
    assert logits.device.type == "cpu" and logits.shape == (2, 16, 64) and torch.isfinite(logits).all()


def test_plot_points_draws_its_sample_on_the_cpu():
    """scripts/mechanism.py plot_points (the `surrogate` figure): the seeded sample of the points was drawn on
    the default device. The points are the largest tenth by magnitude plus that sample, each a (surrogate,
    real) pair of the same position, and the same points under any default device."""
    from mechanism import plot_points

    g = torch.Generator().manual_seed(0)
    real, sur = torch.randn(40, 25, generator=g), torch.randn(40, 25, generator=g)
    limit = 100
    expected = plot_points(real, sur, limit, seed=3)
    with torch.device("meta"):
        s, r = plot_points(real, sur, limit, seed=3)
    assert s.device.type == r.device.type == "cpu" and len(s) == len(r) == limit
    assert torch.equal(s, expected[0]) and torch.equal(r, expected[1])
    pairs = {(float(a), float(b)) for a, b in zip(sur.flatten(), real.flatten())}
    assert all((float(a), float(b)) in pairs for a, b in zip(s, r))
    magnitude = torch.maximum(real.abs(), sur.abs()).flatten()
    largest = {float(m) for m in magnitude.sort(descending=True).values[:limit // 10]}
    assert largest <= {float(m) for m in torch.maximum(r.abs(), s.abs())}


def test_split_qkv_makes_its_projections_on_the_fused_weights_device_and_dtype():
    """scripts/crosscheck_lm_quant.py split_qkv: the q / k / v Linears were made on the default device in float32,
    so a model split on a GPU or in bf16 got CPU fp32 projections beside its own weights. Each projection holds
    its third of the fused qkv's rows, bit for bit, in the fused weight's dtype."""
    import crosscheck_lm_quant as xc

    torch.manual_seed(0)
    model = build_gpt("gpt2_nano", vocab_size=64).eval().to(torch.bfloat16)
    with torch.device("meta"):
        split = xc.split_qkv(model)
    fused, attn = model.blocks[0].attn.qkv, split.blocks[0].attn
    c = fused.in_features
    for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
        lin = getattr(attn, name)
        assert lin.weight.device.type == "cpu" and lin.weight.dtype == torch.bfloat16
        assert torch.equal(lin.weight, fused.weight[i * c:(i + 1) * c])
        assert torch.equal(lin.bias, fused.bias[i * c:(i + 1) * c])

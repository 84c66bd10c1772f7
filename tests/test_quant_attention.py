"""The explicit-matmul attention equals timm's (fused SDPA for ViT, Swin windows with shift masks; in training mode
its attention dropout too)."""
import pytest
import torch
from timm.models.vision_transformer import Attention

from quant.attention import ATTENTION_TYPES, QuantAttention, QuantWindowAttention, convert_attention
from quant.convert import quantize_model
from quant.modes import quant_state
from quant.spec import ATTENTION, AttentionRule, QuantizerSpec, QuantSpec
from quant_models import images, tiny_swin, tiny_vit

A8 = QuantizerSpec(8)
ATTN_ONLY = QuantSpec(linears=(), attentions=(AttentionRule(ATTENTION, q=A8, k=A8, attn=A8, v=A8),),
                      strict=False)


def test_vit_attention_module_matches_fused_sdpa():
    attn = tiny_vit().blocks[0].attn
    assert attn.fused_attn  # timm's default path: F.scaled_dot_product_attention
    x = torch.randn(4, 17, 48)
    ours = convert_attention(attn, {})
    assert isinstance(ours, QuantAttention) and ours.qkv is attn.qkv
    with torch.no_grad():
        torch.testing.assert_close(ours(x), attn(x), rtol=0, atol=1e-5)
        mask = torch.rand(17, 17) > 0.3
        mask.fill_diagonal_(True)
        torch.testing.assert_close(ours(x, attn_mask=mask), attn(x, attn_mask=mask), rtol=0, atol=1e-5)
        bias = torch.randn(17, 17)
        torch.testing.assert_close(ours(x, attn_mask=bias), attn(x, attn_mask=bias), rtol=0, atol=1e-5)


def test_swin_window_attention_module_matches_with_shift_mask():
    block = tiny_swin().layers[0].blocks[1]
    assert any(block.shift_size) and block.attn_mask is not None
    x = torch.randn(2 * block.attn_mask.shape[0], 16, 32)
    ours = convert_attention(block.attn, {})
    assert isinstance(ours, QuantWindowAttention)
    with torch.no_grad():
        torch.testing.assert_close(ours(x, mask=block.attn_mask), block.attn(x, mask=block.attn_mask),
                                   rtol=0, atol=1e-5)
        torch.testing.assert_close(ours(x), block.attn(x), rtol=0, atol=1e-5)


def test_window_attention_reads_the_mask_as_query_by_key():
    """mask[w, i, j] is added to query i's score of key j in every window w of the batch (the windows cycle
    within each image), as timm's WindowAttention reads it. Swin's shift masks are symmetric, so this mask is
    not: a mask read transposed, or applied to the wrong windows, shows."""
    from timm.models.swin_transformer import WindowAttention

    torch.manual_seed(0)
    src = WindowAttention(48, num_heads=3, window_size=3).eval()
    g = torch.Generator().manual_seed(1)
    mask = torch.where(torch.rand(2, 9, 9, generator=g) > 0.5, -100.0, 0.0)
    mask[:, torch.arange(9), torch.arange(9)] = 0.0  # every query keeps a key
    assert not torch.equal(mask, mask.transpose(-1, -2)) and not torch.equal(mask[0], mask[1])
    x = torch.randn(2 * 2, 9, 48, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(convert_attention(src, {})(x, mask=mask), src(x, mask=mask), rtol=0, atol=1e-5)


@pytest.mark.parametrize("build", [tiny_vit, tiny_swin])
def test_converted_model_with_quantization_disabled_matches_timm(build):
    model = build()
    qmodel = quantize_model(model, ATTN_ONLY)
    x = images(4)
    with torch.no_grad(), quant_state(qmodel, weights=False, activations=False):
        torch.testing.assert_close(qmodel(x), model(x), rtol=0, atol=1e-5)
    assert all(type(m).__name__.startswith("Quant") for n, m in qmodel.named_modules() if n.endswith(".attn"))


def test_state_dict_keys_of_attention_are_kept():
    model = tiny_swin()
    qmodel = quantize_model(model, ATTN_ONLY)
    keys = set(qmodel.state_dict())
    assert set(model.state_dict()) <= keys  # relative_position_bias_table, qkv, proj ... keep their names
    # only quantizer state is added: the index buffer stays out of checkpoints, as timm keeps it
    assert all(".q_quant." in k or ".k_quant." in k or ".attn_quant." in k or ".v_quant." in k
               for k in keys - set(model.state_dict()))


def test_unlisted_attention_subclass_is_refused(monkeypatch):
    class SinkAttention(Attention):  # e.g. a softmax1 variant in models/
        def forward(self, x, attn_mask=None):
            return super().forward(x, attn_mask)

    src = SinkAttention(48, num_heads=3, qkv_bias=True)
    with pytest.raises(TypeError, match="ATTENTION_TYPES"):
        convert_attention(src, {})

    class QuantSoftmax1(QuantAttention):  # a variant plugs in its own softmax
        def attention_probs(self, scores):
            e = torch.exp(scores - scores.amax(dim=-1, keepdim=True).clamp(min=0))
            return e / (e.sum(dim=-1, keepdim=True)
                        + torch.exp(-scores.amax(dim=-1, keepdim=True).clamp(min=0)))

    monkeypatch.setitem(ATTENTION_TYPES, SinkAttention, QuantSoftmax1)
    ours = convert_attention(src, {})
    x = torch.randn(2, 5, 48)
    with torch.no_grad():
        assert isinstance(ours, QuantSoftmax1)
        assert not torch.allclose(ours(x), src(x))  # the variant's softmax is used


def _operands_by_hand(attn, x):
    """q, k, v [B, H, N, D] and the softmax probabilities of a timm Attention, from its qkv weights: q | k | v
    along the output features, heads contiguous within each."""
    B, N, C = x.shape
    H = attn.num_heads
    qkv = x @ attn.qkv.weight.T + attn.qkv.bias
    q, k, v = (qkv[..., i * C:(i + 1) * C].reshape(B, N, H, C // H).transpose(1, 2) for i in range(3))
    probs = torch.softmax(q @ k.transpose(-1, -2) / (C // H) ** 0.5, dim=-1)
    return {"q": q, "k": k, "attn": probs, "v": v}


def test_each_matmul_quantizer_sees_its_own_operand():
    """q_quant / k_quant take q and k of q·kᵀ (before the softmax scale), attn_quant the softmax output,
    v_quant v."""
    attn = quantize_model(tiny_vit(), ATTN_ONLY).blocks[0].attn
    x = torch.randn(2, 17, 48, generator=torch.Generator().manual_seed(0))
    seen = {}
    for op in ("q", "k", "attn", "v"):
        getattr(attn, f"{op}_quant").register_forward_pre_hook(lambda _m, args, op=op: seen.__setitem__(op, args[0]))
    with torch.no_grad(), quant_state(attn, activations=False):
        attn(x)
        want = _operands_by_hand(attn, x)
    for op in want:
        torch.testing.assert_close(seen[op], want[op], rtol=0, atol=1e-5, msg=op)


def test_per_head_and_per_token_operand_ranges():
    """"head" on a [B, H, N, D] operand: one range per head (min/max over B, N, D); "token" (dynamic): one
    max-abs per (b, n) over all heads and channels. References: min/max per head, a loop over (b, n)."""
    from quant.calibrate import calibrate
    from quant.quantizers import DynamicQuantizer
    from quant.ranges import RangeSearch

    per_head = QuantizerSpec(8, granularity="head", search=RangeSearch("minmax"))
    per_token = QuantizerSpec(8, kind=DynamicQuantizer, symmetric=True, granularity="token")
    spec = QuantSpec(linears=(), attentions=(AttentionRule(ATTENTION, q=per_head, k=per_token, attn=None, v=None),),
                     strict=False)
    attn = quantize_model(tiny_vit(), spec).blocks[0].attn
    x = torch.randn(2, 17, 48, generator=torch.Generator().manual_seed(0))
    calibrate(attn, x)
    want = _operands_by_hand(attn, x)
    q, k = want["q"].detach(), want["k"].detach()
    lo, hi = q.amin(dim=(0, 2, 3)), q.amax(dim=(0, 2, 3))
    torch.testing.assert_close(attn.q_quant.scale, (hi - lo) / 255)
    expected = torch.empty_like(k)
    for b in range(k.shape[0]):
        for n in range(k.shape[2]):
            step = k[b, :, n, :].abs().max() / 127
            expected[b, :, n, :] = torch.round(k[b, :, n, :] / step) * step
    with torch.no_grad():
        torch.testing.assert_close(attn.k_quant(k), expected, rtol=0, atol=1e-6)


def _attention_token_by_token(attn, x, allowed, bias=None, sink_one=False):
    """A timm Attention's output computed one query token at a time in float64: its keys are the `allowed[i]` ones
    (bias[i, j] added to their scores), softmax by explicit exp / sum (+1 in the denominator: softmax1's sink)."""
    x = x.double()
    B, N, C = x.shape
    H, D = attn.num_heads, C // attn.num_heads
    qkv = x @ attn.qkv.weight.double().T + attn.qkv.bias.double()
    out = torch.zeros(B, N, C, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            q, k, v = (qkv[b, :, i * C + h * D:i * C + (h + 1) * D] for i in range(3))
            for i in range(N):
                keys = [j for j in range(N) if allowed[i][j]]
                scores = torch.stack([q[i] @ k[j] / D ** 0.5 + (0.0 if bias is None else float(bias[i, j]))
                                      for j in keys])
                e = torch.exp(scores)
                p = e / (e.sum() + (1.0 if sink_one else 0.0))
                out[b, i, h * D:(h + 1) * D] = sum(p_j * v[j] for p_j, j in zip(p, keys))
    return out @ attn.proj.weight.double().T + attn.proj.bias.double()


@pytest.mark.parametrize("variant", ["softmax", "softmax1"])
def test_is_causal_wins_over_an_attn_mask_given_with_it(variant):
    """token_mask: with both `attn_mask` and `is_causal` (timm's non-fused path: is_causal takes precedence, as
    SDPA allows only one of them), query i attends keys 0..i whatever the mask says; each mask alone is applied
    as given (bool: True where attention is allowed; float: added to the scores). The converted attention (matmul
    quantizers off) and the float softmax1 variant against a token-by-token loop."""
    from models.attention_sinks import Softmax1Attention

    torch.manual_seed(0)
    src = Attention(48, num_heads=3, qkv_bias=True) if variant == "softmax" else \
        Softmax1Attention(48, num_heads=3, qkv_bias=True)
    src.eval()
    modules = [convert_attention(src, {})] + ([src] if variant == "softmax1" else [])
    N = 7
    x = torch.randn(2, N, 48, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(2)
    mask = torch.rand(N, N, generator=g) > 0.4
    mask.fill_diagonal_(True)
    mask[0, 1:] = True  # row 0 sees later tokens: a mask that wins over is_causal shows
    bias = torch.randn(N, N, generator=g)
    causal = [[j <= i for j in range(N)] for i in range(N)]
    every = [[True] * N for _ in range(N)]
    sink_one = variant == "softmax1"
    cases = [(dict(attn_mask=mask, is_causal=True), causal, None),
             (dict(attn_mask=bias, is_causal=True), causal, None),
             (dict(is_causal=True), causal, None),
             (dict(attn_mask=mask), mask.tolist(), None),
             (dict(attn_mask=bias), every, bias)]
    for module in modules:
        with torch.no_grad():
            for kwargs, allowed, add in cases:
                want = _attention_token_by_token(src, x, allowed, add, sink_one)
                torch.testing.assert_close(module(x, **kwargs).double(), want, rtol=0, atol=1e-5,
                                           msg=f"{type(module).__name__} {sorted(kwargs)}")


def test_timm_attention_options_are_kept_qk_norm_scale_norm_gate_and_head_dim():
    """timm's Attention options that change the function: q/k norms, the norm of the attention output
    (scale_norm), the sigmoid gate on it and a head width other than dim / heads. The converted module (matmul
    quantizers off) against timm's own fused forward, with non-trivial norm affines."""
    from torch import nn

    from quant_models import perturb_norms

    torch.manual_seed(0)
    src = perturb_norms(Attention(48, num_heads=3, attn_head_dim=20, qkv_bias=True, qk_norm=True, scale_norm=True,
                                  gated=True, norm_layer=nn.LayerNorm).eval())
    x = torch.randn(2, 9, 48, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(convert_attention(src, {})(x), src(x), rtol=0, atol=1e-5)


def test_gpt2_causal_attention_matches_a_token_by_token_loop_and_drops_nothing_in_eval_mode():
    """models.gpt's CausalSelfAttention (SDPA's default scale 1/sqrt(head dim), attention dropout only while
    training) converted with its matmul quantizers off, against the token-by-token loop: eval mode with a large
    attention-dropout probability must still be deterministic and exact."""
    from models.gpt import CausalSelfAttention

    torch.manual_seed(0)
    src = CausalSelfAttention(48, 3, bias=True, attn_drop=0.5, proj_drop=0.0).eval()
    ours = convert_attention(src, {})
    N = 7
    x = torch.randn(2, N, 48, generator=torch.Generator().manual_seed(1))
    want = _attention_token_by_token(src, x, [[j <= i for j in range(N)] for i in range(N)])
    with torch.no_grad():
        torch.testing.assert_close(ours(x).double(), want, rtol=0, atol=1e-5)


def test_conversion_keeps_the_source_modules_training_mode():
    """An eval-mode source converts to an eval-mode module: its attention dropout (shared with the source) stays off
    and the output is timm's own eval output; a training-mode source converts to a training module."""
    torch.manual_seed(0)
    src = Attention(48, num_heads=3, qkv_bias=True, attn_drop=0.5).eval()
    x = torch.randn(2, 9, 48, generator=torch.Generator().manual_seed(1))
    ours = convert_attention(src, {})
    assert not ours.training and not src.attn_drop.training
    with torch.no_grad():
        torch.testing.assert_close(ours(x), src(x), rtol=0, atol=1e-5)
    assert convert_attention(Attention(48, num_heads=3).train(), {}).training


@pytest.mark.parametrize("kind", ["vit", "swin"])
def test_a_training_mode_conversion_drops_attention_probabilities_as_timm_does(kind):
    """Training with the converted attention (GPLQ's stage 1 trains the quantized student) keeps the source's
    attention dropout: in training mode, under the same seed, the converted module (matmul quantizers off) gives
    timm's own explicit-path output, whose nn.Dropout acts on the softmax probabilities (`fused_attn` off: the
    dropout of timm's own code, not of the SDPA kernel); with p = 0.5 that differs from the eval-mode output."""
    from timm.models.swin_transformer import WindowAttention

    torch.manual_seed(0)
    if kind == "vit":
        src, n = Attention(48, num_heads=3, qkv_bias=True, attn_drop=0.5), 9
    else:
        src, n = WindowAttention(48, num_heads=3, window_size=3, attn_drop=0.5), 9
    src.fused_attn = False
    src.train()
    x = torch.randn(2, n, 48, generator=torch.Generator().manual_seed(1))
    ours = convert_attention(src, {})
    assert ours.training
    torch.manual_seed(7)
    want = src(x)
    torch.manual_seed(7)
    got = ours(x)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    with torch.no_grad():
        assert (got - ours.eval()(x)).abs().max() > 0.1  # the training output really was dropped


def test_per_channel_post_softmax_operand_has_one_range_per_key():
    """"channel" on the post-softmax `attn` operand [B, H, N, N]: its last dim is the keys (N of them), not head_dim,
    so the quantizer is sized by the data (17 tokens here, head_dim 16). Reference: min/max per key column over
    (B, H, queries), fake-quantized by hand."""
    from quant.calibrate import calibrate
    from quant.ranges import RangeSearch

    per_key = QuantizerSpec(8, granularity="channel", search=RangeSearch("minmax"))
    spec = QuantSpec(linears=(), attentions=(AttentionRule(ATTENTION, q=None, k=None, attn=per_key, v=None),),
                     strict=False)
    attn = quantize_model(tiny_vit(), spec).blocks[0].attn
    assert attn.head_dim == 16
    x = torch.randn(2, 17, 48, generator=torch.Generator().manual_seed(0))
    calibrate(attn, x)
    probs = _operands_by_hand(attn, x)["attn"].detach()
    lo, hi = probs.amin(dim=(0, 1, 2)), probs.amax(dim=(0, 1, 2))
    scale = (hi - lo) / 255
    torch.testing.assert_close(attn.attn_quant.scale.flatten(), scale)
    zero = torch.round(-lo / scale)
    expected = (torch.clamp(torch.round(probs / scale) + zero, 0, 255) - zero) * scale
    with torch.no_grad():
        torch.testing.assert_close(attn.attn_quant(probs), expected, rtol=0, atol=1e-6)

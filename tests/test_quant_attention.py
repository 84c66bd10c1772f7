"""The explicit-matmul attention equals timm's (fused SDPA for ViT, Swin windows with shift masks)."""
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

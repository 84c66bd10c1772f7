"""quant/scope.py's rows (the scope table of quant/README.md) against hand lists of a tiny timm ViT's layers:
which are quantized, at what bits, and which stay float. The README test compares the table with the code that
generates it; these compare the code with the model's layers as written out here."""
from quant import PIPELINES
from quant.scope import scope_rows
from quant_models import images, tiny_vit

BLOCK_LINEARS = "`blocks.*.attn.qkv`, `blocks.*.attn.proj`, `blocks.*.mlp.fc1`, `blocks.*.mlp.fc2`"


def test_repq_quantizes_the_stem_every_block_linear_the_attention_matmuls_and_the_head():
    model = tiny_vit(depth=2)
    qmodel, _ = PIPELINES["repq"](model, images(4), "w4a4")
    per_channel, per_tensor = "4b asym per-channel (percentile_mse)", "4b asym per-tensor (percentile_mse)"
    assert scope_rows(model, qmodel) == [
        ("`patch_embed.proj`", per_channel, "8b asym per-tensor (percentile_mse)"),  # the stem's input at 8 bits
        ("`blocks.*.attn` matmuls q·kᵀ and softmax·v", "(no weights)",
         f"q, k, v: {per_tensor}; softmax output: 4b log-sqrt2"),
        (f"{BLOCK_LINEARS}, `head`", per_channel, per_tensor),
        ("`cls_token`, `pos_embed`, `blocks.*.norm1`, `blocks.*.norm2`, `norm`", "float", "float")]


def test_rtn_keeps_the_stem_head_and_matmuls_float_and_folds_two_digit_block_indices():
    model = tiny_vit(depth=11)  # blocks.10: a two-digit index is folded into '*' like blocks.0
    qmodel, _ = PIPELINES["rtn"](model, None, "w4a16")
    assert scope_rows(model, qmodel) == [
        (BLOCK_LINEARS, "4b asym per-channel (GPTQ grid, round to nearest)", "float"),
        ("`cls_token`, `pos_embed`, `patch_embed.proj`, `blocks.*.norm1`, `blocks.*.norm2`, `norm`, `head`, "
         "attention matmuls", "float", "float")]

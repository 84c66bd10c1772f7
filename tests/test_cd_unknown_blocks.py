"""A Transformer block under names no layout has, beside blocks that one has, is refused by find_pairs,
ColinearityDecay, find_blocks and TWEO (cd/unknown_blocks.py), not left out while the known blocks are paired:
cd/README.md says no pair is dropped silently, and the paper applies CD to all Transformer blocks. Half a block on its
own (a norm with only an attention or only an MLP: CrossViT's fusion blocks), which no Layout describes and which the
structure cannot tell from a head, is named in one warning instead.

The expected pair names are written out by hand from the models' module names."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cd import LAYOUTS, TWEO, ColinearityDecay, Layout, UnsupportedModelError, find_pairs
from cd.pairs import find_blocks

timm_vit = pytest.importorskip("timm.models.vision_transformer")
D = 32


class _OwnNames(nn.Module):
    """A pre-norm block of timm's attention and MLP under names of its own (ln_a, mix, ln_b, ffn)."""

    def __init__(self) -> None:
        super().__init__()
        self.ln_a, self.mix = nn.LayerNorm(D), timm_vit.Attention(D, 2)
        self.ln_b, self.ffn = nn.LayerNorm(D), timm_vit.Mlp(D, 2 * D)

    def forward(self, x):
        x = x + self.mix(self.ln_a(x))
        return x + self.ffn(self.ln_b(x))


class _SeparateQKV(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, 2, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.o_proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, D))


class _FusedOut(nn.Module):
    """cd/README.md's attention of one's own: a fused `qkv_proj` and an output layer `out`."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (y.view(b, t, 2, -1).transpose(1, 2) for y in self.qkv_proj(x).split(D, dim=-1))
        return self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, D))


class _Block(nn.Module):
    """A pre-norm block whose attention is `attention`, and whose MLP is a Sequential under names of its own."""

    def __init__(self, attention: nn.Module) -> None:
        super().__init__()
        self.pre, self.attention, self.post = nn.LayerNorm(D), attention, nn.LayerNorm(D)
        self.ff = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x):
        h = self.pre(x)
        x = x + (self.attention(h, h, h, need_weights=False)[0] if isinstance(self.attention, nn.MultiheadAttention)
                 else self.attention(h))
        return x + self.ff(self.post(x))


class _Mixed(nn.Module):
    """A timm Block (known names) followed by `other`."""

    def __init__(self, other: nn.Module) -> None:
        super().__init__()
        self.blocks = nn.Sequential(timm_vit.Block(D, 2), other)

    def forward(self, x):
        return self.blocks(x)


def _x() -> torch.Tensor:
    return torch.randn(2, 5, D)


TIMM_BLOCK_0 = ["blocks.0.attn.qkv.weight", "blocks.0.attn.proj.weight", "blocks.0.mlp.fc1.weight",
                "blocks.0.mlp.fc2.weight"]


OWN_NORM_MLP = r"norm pre \(LayerNorm\), MLP ff \(Sequential\)"  # _Block's


def _calls(model: nn.Module, layouts=LAYOUTS):
    return {"find_pairs": lambda: find_pairs(model, example_input=_x(), layouts=layouts),
            "ColinearityDecay": lambda: ColinearityDecay(model, example_input=_x(), layouts=layouts),
            "find_blocks": lambda: find_blocks(model, layouts),
            "TWEO": lambda: TWEO(model, layouts=layouts)}


@pytest.mark.parametrize("other, parts", [
    (_OwnNames(), r"attention mix \(Attention\), norm ln_a \(LayerNorm\), MLP ffn \(Mlp\)"),
    (_Block(_SeparateQKV()), r"attention attention \(_SeparateQKV\), " + OWN_NORM_MLP),
    (_Block(_FusedOut()), r"attention attention \(_FusedOut\), " + OWN_NORM_MLP),
    (_Block(nn.MultiheadAttention(D, 2, batch_first=True)), r"attention attention \(MultiheadAttention\), "
     + OWN_NORM_MLP),
], ids=["timm-parts-own-names", "q_proj-k_proj-v_proj-o_proj", "qkv_proj-out", "MultiheadAttention"])
def test_a_block_of_unknown_names_beside_a_known_one_is_refused_by_cd_and_tweo(other, parts):
    model = _Mixed(other)
    for call in _calls(model).values():
        with pytest.raises(UnsupportedModelError, match=rf"block 'blocks.1' \({type(other).__name__}\) is not "
                                                        rf"supported by CD: its parts \({parts}\).*"
                                                        r"norm1, attn.qkv.*layouts=\[cd.Layout\(\.\.\.\), "
                                                        r"\*cd.LAYOUTS\]"):
            call()


def test_every_unknown_block_is_counted_and_the_first_named():
    model = _Mixed(nn.Sequential(_OwnNames(), _OwnNames()))
    with pytest.raises(UnsupportedModelError, match=r"'blocks.1.0' \(_OwnNames\).*\(and 1 more: blocks.1.1\)"):
        find_pairs(model, example_input=_x())


def test_the_layout_the_refusal_asks_for_pairs_every_block():
    model = _Mixed(_OwnNames())
    mine = Layout("mine", norm1="ln_a", norm2="ln_b", qkv="mix.qkv", proj="mix.proj", fc1="ffn.fc1", fc2="ffn.fc2")
    pairs = find_pairs(model, example_input=_x(), layouts=[mine, *LAYOUTS])
    assert [p.name for p in pairs] == TIMM_BLOCK_0 + ["blocks.1.mix.qkv.weight", "blocks.1.mix.proj.weight",
                                                      "blocks.1.ffn.fc1.weight", "blocks.1.ffn.fc2.weight"]
    assert [name for name, _ in find_blocks(model, [mine, *LAYOUTS])] == ["blocks.0", "blocks.1"]
    assert [name for name, _ in TWEO(model, layouts=[mine, *LAYOUTS]).blocks] == ["blocks.0", "blocks.1"]


def test_a_built_in_block_the_layouts_given_leave_out_is_still_left_out_as_asked():
    """cd/README.md: with layouts= given, a block under built-in names that they leave out is not paired."""
    model = _Mixed(_OwnNames())
    mine = Layout("mine", norm1="ln_a", norm2="ln_b", qkv="mix.qkv", proj="mix.proj", fc1="ffn.fc1", fc2="ffn.fc2")
    assert [p.name for p in find_pairs(model, example_input=_x(), layouts=[mine])] == [
        "blocks.1.mix.qkv.weight", "blocks.1.mix.proj.weight", "blocks.1.ffn.fc1.weight", "blocks.1.ffn.fc2.weight"]


def test_a_block_that_neither_the_layouts_given_nor_the_built_in_ones_name_is_refused():
    model = _Mixed(nn.Sequential(_OwnNames(), _Block(_FusedOut())))
    mine = Layout("mine", norm1="ln_a", norm2="ln_b", qkv="mix.qkv", proj="mix.proj", fc1="ffn.fc1", fc2="ffn.fc2")
    for call in _calls(model, [mine]).values():
        with pytest.raises(UnsupportedModelError, match=r"'blocks.1.1' \(_Block\).*layouts given \(layouts=\): "
                                                        r"'mine' \(children ln_a, mix, ln_b, ffn\)\. Add a cd.Layout"):
            call()


class _Merge(nn.Module):
    """Patch merging (norm, reduction): found whatever the names of the blocks around it."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.reduction = nn.LayerNorm(D), nn.Linear(D, D // 2, bias=False)

    def forward(self, x):
        return self.reduction(self.norm(x))


def test_blocks_of_unknown_names_beside_patch_merging_alone_are_refused():
    """Only the merging layer's pair would be found: the blocks would be left out."""
    model = nn.Sequential(_OwnNames(), _Merge())
    with pytest.raises(UnsupportedModelError, match=r"block '0' \(_OwnNames\)"):
        find_pairs(model, example_input=_x())


def test_a_container_of_known_blocks_with_a_norm_and_a_head_is_not_taken_for_a_block():
    """The model itself holds an attention-like pooling, a norm and an MLP head beside its known blocks: only its
    direct children are read, and it holds known blocks, so it is a container, not a block."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(timm_vit.Block(D, 2), timm_vit.Block(D, 2))
            self.pool, self.norm = _FusedOut(), nn.LayerNorm(D)
            self.head = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, 3))

        def forward(self, x):
            return self.head(self.norm(self.pool(self.blocks(x))))

    pairs = find_pairs(Model(), example_input=_x())
    assert [p.name for p in pairs] == TIMM_BLOCK_0 + [n.replace("blocks.0", "blocks.1") for n in TIMM_BLOCK_0]


class _NamedFused(nn.Module):
    """A fused-qkv attention whose two layers carry the names given: a block is told by the layers' shapes (D -> 3D,
    D -> D), not by their names."""

    def __init__(self, qkv: str, out: str) -> None:
        super().__init__()
        self.names = qkv, out
        setattr(self, qkv, nn.Linear(D, 3 * D))
        setattr(self, out, nn.Linear(D, D))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (y.view(b, t, 2, -1).transpose(1, 2) for y in getattr(self, self.names[0])(x).split(D, dim=-1))
        return getattr(self, self.names[1])(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, D))


class _GroupedOwnNames(nn.Module):
    """Separate q (D -> D), k and v (D -> D/2, grouped-query) and an output layer, under names no library uses."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = nn.Linear(D, D), nn.Linear(D, D // 2), nn.Linear(D, D // 2), nn.Linear(D, D)

    def forward(self, x):
        bs, t, _ = x.shape
        q = self.a(x).view(bs, t, 2, -1).transpose(1, 2)
        k, v = (p(x).view(bs, t, 1, -1).transpose(1, 2).expand(-1, 2, -1, -1) for p in (self.b, self.c))
        return self.d(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(bs, t, D))


@pytest.mark.parametrize("qkv, out", [("in_proj", "out_proj"), ("query_key_value", "dense"), ("c_attn", "proj_out"),
                                      ("Wqkv", "out_proj"), ("mix_in", "mix_out")])
def test_a_block_is_told_by_its_layers_shapes_whatever_their_names(qkv, out):
    """Was: a block whose attention layers had names outside a list (in_proj, query_key_value, proj_out) was left out
    without a word while the timm block beside it was paired."""
    model = _Mixed(_Block(_NamedFused(qkv, out)))
    refusal = r"block 'blocks.1' \(_Block\) is not supported by CD: its parts \(attention attention \(_NamedFused\), "
    for call in _calls(model).values():
        with pytest.raises(UnsupportedModelError, match=refusal + OWN_NORM_MLP):
            call()


class _ConvAttention(nn.Module):
    """qkv and proj as 1x1 Conv1d layers over (B, C, T)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Conv1d(D, 3 * D, 1), nn.Conv1d(D, D, 1)

    def forward(self, x):
        q, k, v = self.qkv(x.transpose(1, 2)).transpose(1, 2).chunk(3, dim=-1)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2)).transpose(1, 2)


class _ConvMlp(nn.Module):
    """An MLP of two 1x1 Conv2d layers over (B, C, T, 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(D, 2 * D, 1), nn.Conv2d(2 * D, D, 1)

    def forward(self, x):
        return self.c2(F.gelu(self.c1(x.transpose(1, 2)[..., None])))[..., 0].transpose(1, 2)


@pytest.mark.parametrize("attention, mlp, parts", [
    (_ConvAttention, None, r"attention attention \(_ConvAttention\), " + OWN_NORM_MLP),
    (_SeparateQKV, _ConvMlp, r"attention attention \(_SeparateQKV\), norm pre \(LayerNorm\), MLP ff \(_ConvMlp\)"),
    (_ConvAttention, _ConvMlp, r"attention attention \(_ConvAttention\), norm pre \(LayerNorm\), MLP ff "
                               r"\(_ConvMlp\)"),
], ids=["conv-qkv-proj", "conv-mlp", "conv-both"])
def test_a_block_of_1x1_convolutions_is_told_by_their_shapes(attention, mlp, parts):
    """Was: a block whose qkv/proj or MLP layers were 1x1 Conv1d/Conv2d (weights (out, in, 1...)) was left out
    without a word: only 2-D weights were read as matrices."""
    block = _Block(attention())
    if mlp is not None:
        block.ff = mlp()
    model = _Mixed(block)
    for call in _calls(model).values():
        with pytest.raises(UnsupportedModelError, match=rf"block 'blocks.1' \(_Block\) is not supported by CD: its "
                                                        rf"parts \({parts}\)"):
            call()


def test_a_grouped_query_attention_under_names_of_its_own_is_told_by_its_shapes():
    with pytest.raises(UnsupportedModelError, match=r"'blocks.1' \(_Block\).*attention attention \(_GroupedOwnNames\)"):
        find_pairs(_Mixed(_Block(_GroupedOwnNames())), example_input=_x())


class _LucidAttention(nn.Module):
    """vit-pytorch's Attention: the norm before qkv is its own child `norm`, the output layer a Sequential."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.to_qkv = nn.LayerNorm(D), nn.Linear(D, 3 * D, bias=False)
        self.to_out = nn.Sequential(nn.Linear(D, D), nn.Dropout(0.0))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (y.view(b, t, 2, -1).transpose(1, 2) for y in self.to_qkv(self.norm(x)).chunk(3, dim=-1))
        return self.to_out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, D))


class _LucidDecoder(nn.Module):
    """vit-pytorch's Transformer: blocks are ModuleList([attention, feed-forward]); no norm is a block's child."""

    def __init__(self, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleList([_LucidAttention(), nn.Sequential(
            nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))]) for _ in range(depth))
        self.norm = nn.LayerNorm(D)

    def forward(self, x):
        for attn, ff in self.layers:
            x = x + attn(x)
            x = x + ff(x)
        return self.norm(x)


def test_blocks_whose_norms_sit_inside_their_attention_and_mlp_are_refused():
    """Was: a vit-pytorch-style decoder beside a timm block had its pairs dropped silently."""

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc, self.dec = timm_vit.Block(D, 2), _LucidDecoder(2)

        def forward(self, x):
            return self.dec(self.enc(x))

    for call in _calls(Model()).values():
        with pytest.raises(UnsupportedModelError, match=r"block 'dec.layers.0' \(ModuleList\) is not supported by CD: "
                                                        r"its parts \(attention 0 \(_LucidAttention\), norm 0.norm "
                                                        r"\(LayerNorm\), MLP 1 \(Sequential\)\).*\(and 1 more: "
                                                        r"dec.layers.1\)"):
            call()


def test_heads_pooling_and_patch_embeddings_beside_known_blocks_are_not_taken_for_blocks():
    """An attention-pooling head (timm's AttentionPoolLatent: latent query, fused kv, norm, MLP), a norm-MLP classifier
    head and a patch embedding with a norm, in modules of their own beside the blocks: no [Q; K; V] of the stream, so
    no block; the pairs are the timm blocks' alone."""
    from timm.layers import AttentionPoolLatent, NormMlpClassifierHead

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Sequential(nn.Linear(D, D), nn.LayerNorm(D))
            self.blocks = nn.Sequential(timm_vit.Block(D, 2), timm_vit.Block(D, 2))
            self.heads = nn.ModuleDict({"pool": AttentionPoolLatent(D, num_heads=2, mlp_ratio=2.0),
                                        "cls": NormMlpClassifierHead(D, 3, hidden_size=2 * D)})

        def forward(self, x):
            x = self.blocks(self.embed(x))
            return self.heads["pool"](x) + self.heads["cls"](x.transpose(1, 2)[..., None]).mean(-1, keepdim=True)

    pairs = find_pairs(Model(), example_input=_x())
    assert [p.name for p in pairs] == TIMM_BLOCK_0 + [n.replace("blocks.0", "blocks.1") for n in TIMM_BLOCK_0]


def _timm(name: str) -> nn.Module:
    timm = pytest.importorskip("timm")
    return timm.create_model(name, img_size=32, patch_size=8, embed_dim=D, depth=1, num_heads=2, num_classes=3)


def test_a_fused_parallel_block_beside_known_blocks_is_refused_without_asking_for_a_layout():
    """timm's ParallelScalingBlock: one in_proj (D -> 3D + H) feeds both the attention and the MLP; no layout can
    pair it, so the refusal says so instead of asking for one."""
    model = _Mixed(_timm("vit_base_patch16_xp_224").blocks[0])
    with pytest.raises(UnsupportedModelError, match=r"block 'blocks.1' \(ParallelScalingBlock\).*in_proj "
                                                    r"\(32 -> 3x32 \+ 128\).*no cd.Layout can pair it") as refused:
        find_pairs(model, example_input=_x())
    assert "layouts=[cd.Layout" not in str(refused.value)


@pytest.mark.parametrize("ff", [2 * D, 4 * D, 2048], ids=["ff-2D", "ff-4D-read-as-3D+D", "ff-2048"])
def test_a_decoder_layer_beside_known_blocks_is_refused_as_self_and_cross_attention_with_an_mlp(ff):
    """nn.TransformerDecoderLayer: its two MultiheadAttentions' out_proj are theirs, not the layer's own matrices,
    so they are not read with linear1 / linear2 as one attention by shape (ff=2048: the layer was silently left
    out), and a layer holding attentions is not a fused parallel block (ff=4D: linear1, 4D = 3D + D wide, was read
    as ParallelScalingBlock's in_proj and the refusal said no cd.Layout could pair it)."""
    model = _Mixed(nn.TransformerDecoderLayer(D, 2, ff, batch_first=True, norm_first=True))
    for call in (lambda: find_pairs(model, verify=False), lambda: find_blocks(model), lambda: TWEO(model)):
        with pytest.raises(UnsupportedModelError, match=r"block 'blocks.1' \(TransformerDecoderLayer\).*its parts "
                                                        r"\(attention self_attn \(MultiheadAttention\) \(and 1 more\)"
                                                        r", norm norm1 \(LayerNorm\), MLP layers linear1, linear2\)"
                                                        r".*It holds 2 attentions") as refused:
            call()
        assert "no cd.Layout can pair" not in str(refused.value)


def test_a_model_without_pairs_is_told_what_its_blocks_are_and_the_route_of_each_caller():
    """The "no matrix pair" message names the first module that is a block by its structure, says when it is a
    parallel block (one layout per branch) or a fused one (no layout), and gives both routes: layouts= for the API,
    cd.LAYOUTS in cd/layouts.py for train.py and `python -m cd`, which take no layouts=."""
    with pytest.raises(UnsupportedModelError, match=r"no matrix pair found in VisionTransformer\..* 'blocks.0' "
                                                    r"\(ParallelThingsBlock\).*it holds 2 attentions.*one cd.Layout "
                                                    r"per attention.*layouts=\[cd.Layout\(\.\.\.\), \*cd.LAYOUTS\].*"
                                                    r"train.py.*LAYOUTS in cd/layouts.py"):
        find_pairs(_timm("vit_small_patch16_18x2_224"), verify=False)
    with pytest.raises(UnsupportedModelError, match=r"'blocks.0' \(ParallelScalingBlock\).*no cd.Layout can pair "
                                                    r"it.*train this model without CD") as fused:
        find_pairs(_timm("vit_base_patch16_xp_224"), verify=False)
    assert "layouts=[cd.Layout" not in str(fused.value)


@pytest.mark.parametrize("width, heads, rel_pos", [(128, 2, "mlp"), (128, 2, "mlp_swin"), (192, 6, "mlp")])
def test_a_relative_position_mlp_inside_an_attention_is_no_unpaired_mlp_of_its_block(width, heads, rel_pos):
    """timm's RelPosMlp (2 -> hidden -> heads) sits in attn.rel_pos; at a block width equal to its hidden width
    (128) it was taken for an MLP of the block that no pair reads, and the ViT was refused. A part of an attention
    is no part of the block: each block gets its 4 pairs, on timm's own layers."""
    timm = pytest.importorskip("timm")
    model = timm.create_model("vit_relpos_small_patch16_224", embed_dim=width, num_heads=heads, depth=2,
                              rel_pos_type=rel_pos, img_size=64, num_classes=3)
    pairs = find_pairs(model, example_input=torch.randn(1, 3, 64, 64))
    assert [p.name for p in pairs] == [f"blocks.{i}.{n}" for i in range(2)
                                       for n in ("attn.qkv.weight", "attn.proj.weight", "mlp.fc1.weight",
                                                 "mlp.fc2.weight")]


class _CrossAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.proj = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(self.q(x) @ self.k(memory).transpose(-1, -2) / D ** 0.5, -1)
        return self.proj(weights @ self.v(memory))


class _DecoderBlock(nn.Module):
    """A pre-norm block under timm's names plus a cross-attention (norm_x, xattn) whose k and v read `memory`."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm_x, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = timm_vit.Attention(D, 2)
        self.xattn = _CrossAttention()
        self.mlp = timm_vit.Mlp(D, 2 * D)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        x = x + self.xattn(self.norm_x(x), memory)
        return x + self.mlp(self.norm2(x))


def test_a_cross_attention_left_unpaired_is_refused_without_promising_a_layout_pairs_it():
    """The refusal of a block whose cross-attention no pair reads said "give one cd.Layout per attention", but a
    layout for it is refused too (its k and v read the memory, not its norm): the refusal says CD pairs an attention
    with the norm feeding its q, k and v, and that a cross-attention is not supported."""
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc, self.blocks = nn.Linear(D, D), nn.ModuleList([_DecoderBlock(), _DecoderBlock()])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            memory = self.enc(x)
            for block in self.blocks:
                x = block(x, memory)
            return x

    model, x = Model(), torch.randn(1, 5, D)
    with pytest.raises(UnsupportedModelError, match=r"block 'blocks.0' \(_DecoderBlock\).*reads its attention xattn "
                                                    r"\(_CrossAttention\).*only with the norm that feeds its q, k and "
                                                    r"v.*cross-attention\) is not supported"):
        find_pairs(model, example_input=x)
    cross = Layout("cross", norm1="norm_x", q_k_v=("xattn.q", "xattn.k", "xattn.v"), proj="xattn.proj",
                   norm2="norm2", fc1="mlp.fc1", fc2="mlp.fc2")
    with pytest.raises(UnsupportedModelError, match=r"input of blocks.0.xattn.k.weight is not the output of the norm"):
        find_pairs(model, example_input=x, layouts=[*LAYOUTS, cross])  # why the refusal promises no layout


def _bert_vit_configs(transformers, **bert):
    small = dict(hidden_size=D, num_attention_heads=2, intermediate_size=2 * D, num_hidden_layers=2)
    return (transformers.ViTConfig(image_size=16, patch_size=8, **small),
            transformers.BertConfig(vocab_size=50, **small, **bert))


def test_a_bert_text_tower_beside_a_vit_is_refused_not_left_out():
    """transformers' BERT holds its attention's q, k, v in attention.self and its output layer in attention.output
    (beside that output's norm): no module held all four, so no BertLayer was taken for a block, and CD paired the
    ViT tower of a VisionTextDualEncoderModel while silently leaving the BERT tower out. BERT's layers are
    post-norm, so refusing them is right; the block named is the first BertLayer in model order, whose name is
    read off the model."""
    transformers = pytest.importorskip("transformers")
    vit, bert = _bert_vit_configs(transformers)
    model = transformers.VisionTextDualEncoderModel(
        transformers.VisionTextDualEncoderConfig.from_vision_text_configs(vit, bert, projection_dim=16))
    first = next(n for n, m in model.named_modules() if type(m).__name__ == "BertLayer")
    assert first == "text_model.encoder.layer.0"
    for call in (lambda: find_pairs(model, verify=False), lambda: ColinearityDecay(model, verify=False),
                 lambda: find_blocks(model), lambda: TWEO(model)):
        with pytest.raises(UnsupportedModelError, match=rf"block '{first}' \(BertLayer\).*attention attention "
                                                        r"\(BertAttention\).*\(and 1 more: "
                                                        r"text_model.encoder.layer.1\)"):
            call()


def test_a_bert_decoder_with_cross_attention_beside_a_vit_encoder_is_refused():
    """VisionEncoderDecoderModel of a ViT and a BERT decoder: each BertLayer holds a self- and a cross-attention,
    both split across attention.self and attention.output; the decoder was left out while the ViT was paired."""
    transformers = pytest.importorskip("transformers")
    vit, bert = _bert_vit_configs(transformers, is_decoder=True, add_cross_attention=True)
    model = transformers.VisionEncoderDecoderModel(
        transformers.VisionEncoderDecoderConfig.from_encoder_decoder_configs(vit, bert))
    with pytest.raises(UnsupportedModelError, match=r"block 'decoder.bert.encoder.layer.0' \(BertLayer\).*attention "
                                                    r"attention \(BertAttention\) \(and 1 more\).*It holds 2 "
                                                    r"attentions"):
        find_pairs(model, verify=False)


def test_a_model_of_split_attentions_alone_is_told_which_module_is_its_block():
    """Data2VecVision (pre-norm, BEiT's names, q/k/v and output split as in BERT): "no matrix pair found" named no
    block, as it does for OPT, CLIP or T5; it names the first layer and its parts."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Data2VecVisionConfig(image_size=16, patch_size=8, hidden_size=D, num_attention_heads=2,
                                               intermediate_size=2 * D, num_hidden_layers=2)
    with pytest.raises(UnsupportedModelError, match=r"no matrix pair found in Data2VecVisionModel\..*Its module "
                                                    r"'encoder.layer.0' \(Data2VecVisionLayer\) holds a Transformer "
                                                    r"block's parts \(attention attention "
                                                    r"\(Data2VecVisionAttention\), norm layernorm_before"):
        find_pairs(transformers.Data2VecVisionModel(config), verify=False)


class _TorchEncoder(nn.Module):
    """Two torch nn.TransformerEncoderLayer blocks (names no built-in layout has), post-norm by default."""

    def __init__(self, norm_first: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.TransformerEncoderLayer(D, 2, 2 * D, batch_first=True, norm_first=norm_first)
                                     for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


_TORCH_LAYOUT = Layout("torch", norm1="norm1", qkv="self_attn.in_proj_weight", proj="self_attn.out_proj",
                       norm2="norm2", fc1="linear1", fc2="linear2")
_BERT_LAYOUT = Layout("bert", norm1="attention.output.LayerNorm", norm2="output.LayerNorm",
                      q_k_v=("attention.self.query", "attention.self.key", "attention.self.value"),
                      proj="attention.output.dense", fc1="intermediate.dense", fc2="output.dense")
_D2V_LAYOUT = Layout("data2vec", norm1="layernorm_before", norm2="layernorm_after",
                     q_k_v=("attention.attention.query", "attention.attention.key", "attention.attention.value"),
                     proj="attention.output.dense", fc1="intermediate.dense", fc2="output.dense")


class _Stack(nn.Module):
    """Two blocks made by `make`, one after the other."""

    def __init__(self, make) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([make(), make()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class _Body(nn.Module):
    """The attention, the MLP's norm and the MLP of `_NestedPreNorm`: its parent holds the attention's norm."""

    def __init__(self) -> None:
        super().__init__()
        self.attn, self.norm2 = timm_vit.Attention(D, 2), nn.LayerNorm(D)
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)


class _NestedPreNorm(nn.Module):
    """A pre-norm block, x + attn(norm1(x)) then x + fc2(gelu(fc1(norm2(x)))), whose norm1 sits beside the module
    holding its other parts (body): that module is the innermost one holding a block's parts."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.body = nn.LayerNorm(D), _Body()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        body = self.body
        x = x + body.attn(self.norm1(x))
        return x + body.fc2(F.gelu(body.fc1(body.norm2(x))))


class _NestedPreNormBeside(_NestedPreNorm):
    """`_NestedPreNorm` with a parameter of 2 or more dimensions beside norm1 that is no layer's matrix: a LayerScale
    kept as (1, 1, D) on the attention's output (`ls`), or a learned position parameter added first (`pos`)."""

    def __init__(self, extra: str) -> None:
        super().__init__()
        self.extra = extra
        self.beside = nn.Parameter(torch.ones(1, 1, D) if extra == "ls" else torch.zeros(1, 5, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        body = self.body
        x = x + self.beside if self.extra == "pos" else x
        attended = body.attn(self.norm1(x))
        x = x + (self.beside * attended if self.extra == "ls" else attended)
        return x + body.fc2(F.gelu(body.fc1(body.norm2(x))))


class _UnscaledPreNorm(nn.Module):
    """A pre-norm block whose attention reads a norm without an affine scale: nn.LayerNorm(D,
    elementwise_affine=False), or F.layer_norm in its forward (`functional`)."""

    def __init__(self, functional: bool) -> None:
        super().__init__()
        self.ln_a = (lambda x: F.layer_norm(x, (D,))) if functional else nn.LayerNorm(D, elementwise_affine=False)
        self.mix, self.ln_f = timm_vit.Attention(D, 2), nn.LayerNorm(D)
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(self.ln_a(x))
        return x + self.down(F.gelu(self.up(self.ln_f(x))))


class _ScaledAttention(nn.Module):
    """An attention (fused qkv, proj) that normalizes inside it: its score scale computed as a tensor,
    torch.sqrt(torch.tensor(head_dim)) as transformers' DeBERTa writes it ('sqrt'), or q and k normalized by
    F.normalize (cosine attention, 'normalize')."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.qkv, self.proj = how, nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, 2, D // 2).permute(2, 0, 3, 1, 4)
        if self.how == "sqrt":
            scores = q @ k.transpose(-2, -1) / torch.sqrt(torch.tensor(q.size(-1), dtype=torch.float))
        else:
            scores = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1) * 10
        return self.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, D))


class _PostNorm(nn.Module):
    """A post-norm block, norm1(x + attn(x)) then norm2(x + fc2(gelu(fc1(x)))), whose attention normalizes inside
    it: `_ScaledAttention`, or timm's attention with QK-norm ('qk-norm': LayerNorms q_norm and k_norm, with scales)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.attn = (timm_vit.Attention(D, 2, qk_norm=True, norm_layer=nn.LayerNorm) if how == "qk-norm"
                     else _ScaledAttention(how))
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm1(x + self.attn(x))
        return self.norm2(x + self.fc2(F.gelu(self.fc1(x))))


_POST_LAYOUT = Layout("post", norm1="norm1", norm2="norm2", qkv="attn.qkv", proj="attn.proj", fc1="fc1", fc2="fc2")


_NESTED_LAYOUT = Layout("nested", norm1="norm1", norm2="body.norm2", qkv="body.attn.qkv", proj="body.attn.proj",
                        fc1="body.fc1", fc2="body.fc2")


def _bert_mlm():
    transformers = pytest.importorskip("transformers")
    return transformers.BertForMaskedLM(transformers.BertConfig(hidden_size=D, num_hidden_layers=2,
                                                                num_attention_heads=2, intermediate_size=2 * D,
                                                                vocab_size=100)), None


def _data2vec():
    transformers = pytest.importorskip("transformers")
    return transformers.Data2VecVisionModel(transformers.Data2VecVisionConfig(
        image_size=16, patch_size=8, hidden_size=D, num_attention_heads=2, intermediate_size=2 * D,
        num_hidden_layers=2)), None


@pytest.mark.parametrize("make, layout, post_norm", [
    (_bert_mlm, _BERT_LAYOUT, ("'bert.encoder.layer.0' (BertLayer)", "attention.output.LayerNorm")),
    (lambda: (_TorchEncoder(False), torch.randn(1, 5, D)), _TORCH_LAYOUT,
     ("'blocks.0' (TransformerEncoderLayer)", "norm1")),
    (lambda: (_TorchEncoder(True), torch.randn(1, 5, D)), _TORCH_LAYOUT, None),
    (_data2vec, _D2V_LAYOUT, None),
    (lambda: (_Stack(_NestedPreNorm), torch.randn(1, 5, D)), _NESTED_LAYOUT, None),
    *[(lambda extra=extra: (_Stack(lambda: _NestedPreNormBeside(extra)), torch.randn(1, 5, D)), _NESTED_LAYOUT, None)
      for extra in ("ls", "pos")],
    *[(lambda how=how: (_Stack(lambda: _PostNorm(how)), torch.randn(1, 5, D)), _POST_LAYOUT,
       ("'blocks.0' (_PostNorm)", "norm1")) for how in ("sqrt", "normalize", "qk-norm")],
], ids=["bert-post-norm", "torch-post-norm", "torch-pre-norm", "data2vec-pre-norm", "nested-pre-norm",
        "nested-pre-norm-layer-scale", "nested-pre-norm-position", "sqrt-scale-post-norm", "cosine-post-norm",
        "qk-norm-post-norm"])
def test_no_pair_found_says_a_post_norm_block_is_one_no_layout_pairs(make, layout, post_norm):
    """"No matrix pair found" advised a cd.Layout for a post-norm block (BERT's layers, nn.TransformerEncoderLayer's
    default), and one written for it is refused when its pairs are checked (the reference: `verify_pairs`' forward);
    it now says the block is post-norm, which no layout pairs. A pre-norm block under names of its own keeps the
    advice, which a layout written for it follows (it pairs): one whose attention's norm its parent holds beside the
    module of its other parts too (that norm is the block's), also beside a LayerScale or a position parameter,
    which are no layer's matrix. A post-norm block whose attention normalizes inside it
    (a score scale by torch.sqrt, QK-norm) was told pre-norm, its proj reading that op's output: the norms of the
    block are told by what the attention's input matrices read, and the norm named is one reading its output."""
    model, example = make()
    for call in (lambda: find_pairs(model, example_input=example),
                 lambda: ColinearityDecay(model, example_input=example)):
        with pytest.raises(UnsupportedModelError, match=r"^no matrix pair found in ") as refusal:
            call()
        message = str(refusal.value)
        if post_norm is None:
            assert "post-norm" not in message and "layouts=[cd.Layout(...), *cd.LAYOUTS]" in message
        else:
            block, norm = post_norm
            assert f"Its module {block} holds" in message
            assert (f"it is a post-norm block: its attention reads no norm of the block, and its norm {norm} reads "
                    "the attention's output") in message
            assert "no cd.Layout can pair it" in message and "layouts=[cd.Layout" not in message
    if post_norm is None:
        assert find_pairs(model, example_input=example, layouts=[layout, *LAYOUTS])
    else:
        with pytest.raises(UnsupportedModelError, match=r"is not the output of the norm .*post-norm blocks, where the "
                                                        r"norm follows the layer, are refused"):
            find_pairs(model, example_input=example, layouts=[layout, *LAYOUTS])


@pytest.mark.parametrize("functional", [False, True], ids=["unscaled-module", "functional"])
def test_no_pair_found_tells_no_post_norm_of_a_block_whose_attention_reads_an_unscaled_norm(functional):
    """A pre-norm block (x + attn(norm(x)), by its forward) whose attention's norm has no affine scale was said
    post-norm "as in BERT": its attention read no norm with a weight. A norm without one is a norm of the block, so
    the message says no post-norm; it keeps the generic advice."""
    model = _Stack(lambda: _UnscaledPreNorm(functional))
    with pytest.raises(UnsupportedModelError, match=r"^no matrix pair found in ") as refusal:
        find_pairs(model, example_input=torch.randn(1, 5, D))
    message = str(refusal.value)
    assert "Its module 'blocks.0' (_UnscaledPreNorm) holds" in message
    assert "post-norm" not in message and "no cd.Layout can pair it" not in message
    assert "layouts=[cd.Layout(...), *cd.LAYOUTS]" in message


class _AttentionHalf(nn.Module):
    """The attention half of a pre-norm block on its own (x + attn(norm1(x)), CrossViT's fusion blocks' form)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(D), timm_vit.Attention(D, 2, qkv_bias=True)

    def forward(self, x):
        return x + self.attn(self.norm1(x))


class _MlpHalf(nn.Module):
    """The MLP half on its own (x + mlp(norm2(x))): a metaformer's MLP block."""

    def __init__(self) -> None:
        super().__init__()
        self.norm2, self.mlp = nn.LayerNorm(D), timm_vit.Mlp(D, 2 * D)

    def forward(self, x):
        return x + self.mlp(self.norm2(x))


class _MhaHalf(nn.Module):
    """An nn.MultiheadAttention after a norm, residual."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.attn = nn.LayerNorm(D), nn.MultiheadAttention(D, 2, batch_first=True)

    def forward(self, x):
        y = self.norm(x)
        return x + self.attn(y, y, y, need_weights=False)[0]


class _ScaledHalf(_AttentionHalf):
    """The attention half with a LayerScale kept as a (1, 1, D) Parameter: a scale, not another layer's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((1, 1, D), 0.1))

    def forward(self, x):
        return x + self.gamma * self.attn(self.norm1(x))


class _TwoAttentions(nn.Module):
    """Self- and cross-attention halves (norm1 -> attn, norm2 -> attn2) and no MLP: a decoder layer without FFN."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(D), timm_vit.Attention(D, 2)
        self.norm2, self.attn2 = nn.LayerNorm(D), timm_vit.Attention(D, 2)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.attn2(self.norm2(x))


class _OwnLayersFfn(nn.Module):
    """A residual FFN whose norm and two layers are its own children."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class _LucidFeedForward(nn.Module):
    """vit-pytorch's FeedForward (net = Sequential(LayerNorm, Linear, GELU, Dropout, Linear, Dropout)), with the
    residual around it (vit-pytorch's Transformer adds it)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.GELU(), nn.Dropout(0.0),
                                 nn.Linear(2 * D, D), nn.Dropout(0.0))

    def forward(self, x):
        return x + self.net(x)


LEFT_OUT = r"CD and TWEO leave out {n} modules? of {root}: "
WHY = (r"\. Each is a norm with only an attention or only an MLP beside the blocks CD pairs: a residual half block or "
       r"a head \(its structure does not tell which\); CD and TWEO leave it out, as a cd.Layout cannot describe half "
       r"a block")


def _half_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "leave out" in str(w.message)]


@pytest.mark.parametrize("half, left_out", [
    (_AttentionHalf, r"blocks.1 \(_AttentionHalf: an attention attn \(Attention\) after a norm norm1 \(LayerNorm\) "
                     r"and no MLP\)"),
    (_MlpHalf, r"blocks.1 \(_MlpHalf: an MLP mlp \(Mlp\) after a norm norm2 \(LayerNorm\) and no attention\)"),
    (_MhaHalf, r"blocks.1 \(_MhaHalf: an attention attn \(MultiheadAttention\) after a norm norm \(LayerNorm\) and no "
               r"MLP\)"),
    (_ScaledHalf, r"blocks.1 \(_ScaledHalf: an attention attn \(Attention\) after a norm norm1 \(LayerNorm\) and "
                  r"no MLP\)"),
    (_TwoAttentions, r"blocks.1 \(_TwoAttentions: attentions attn \(Attention\), attn2 \(Attention\) after a norm "
                     r"norm1 \(LayerNorm\) and no MLP\)"),
    (_OwnLayersFfn, r"blocks.1 \(_OwnLayersFfn: an MLP of layers fc1, fc2 after a norm norm \(LayerNorm\) and no "
                    r"attention\)"),
    (_LucidFeedForward, r"blocks.1.net \(Sequential: an MLP of layers 1, 4 after a norm 0 \(LayerNorm\) and no "
                        r"attention\)"),
], ids=["attention-only", "mlp-only", "multihead-attention", "layer-scale-1x1xD", "two-attentions", "own-layers-ffn",
        "vit-pytorch-feedforward"])
def test_half_a_block_on_its_own_beside_a_known_block_is_named_in_one_warning_by_cd_and_tweo(half, left_out):
    """A norm with only an attention or only an MLP beside paired blocks: a residual half block or a head, which
    the structure cannot tell apart, so CD and TWEO are not refused (a head beside the blocks would refuse the model
    with no way out) but name it in a warning. Was: refused (attention-only, mlp-only, multihead-attention), or left
    out without a word (the others: a (1, 1, D) scale counted as a layer's weight, two attentions in one module,
    an MLP's layers the module's own children). The pairs and TWEO's blocks are blocks.0's alone, written out by
    hand."""
    for name in ("find_pairs", "ColinearityDecay", "find_blocks", "TWEO"):
        model = _Mixed(half())  # a model of its own per call: the warning is given once per model
        with pytest.warns(UserWarning, match=LEFT_OUT.format(n=1, root="_Mixed") + left_out + WHY) as record:
            out = _calls(model)[name]()
        assert len(_half_warnings(record)) == 1
        if name == "find_pairs":
            assert [p.name for p in out] == TIMM_BLOCK_0
        if name == "TWEO":
            assert [n for n, _ in out.blocks] == ["blocks.0"]


class _ProjectionHead(nn.Module):
    """timm Blocks and a projection head norm -> Mlp(D, 4D, D) with no residual (a CLIP-style head)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(timm_vit.Block(D, 2), timm_vit.Block(D, 2))
        self.head = nn.Sequential(nn.LayerNorm(D), timm_vit.Mlp(D, 4 * D, D))

    def forward(self, x):
        return self.head(self.blocks(x)).mean(1)


def test_a_projection_head_beside_known_blocks_trains_with_cd_and_tweo_and_one_warning_naming_it():
    """Was: the whole model refused by find_pairs, ColinearityDecay and TWEO, with layouts= or without, though the
    head is no residual sub-block (its structure cannot tell). Its pairs are the blocks' (8, by hand), as before the
    refusal, and one model used by CD, its metrics and TWEO is warned about once."""
    block_pairs = TIMM_BLOCK_0 + [n.replace("blocks.0", "blocks.1") for n in TIMM_BLOCK_0]
    left_out = LEFT_OUT.format(n=1, root="_ProjectionHead") + (r"head \(Sequential: an MLP 1 \(Mlp\) after a norm 0 "
                                                               r"\(LayerNorm\) and no attention\)") + WHY
    for layouts in (LAYOUTS, [LAYOUTS[0]]):
        with pytest.warns(UserWarning, match=left_out):
            assert [p.name for p in find_pairs(_ProjectionHead(), example_input=_x(), layouts=layouts)] == block_pairs
    model = _ProjectionHead()
    with pytest.warns(UserWarning, match=left_out) as record:
        decay = ColinearityDecay(model, example_input=_x())
        decay.metrics()
        tweo = TWEO(model)
        find_pairs(model, example_input=_x())
    assert len(_half_warnings(record)) == 1
    assert [p.name for p in decay.pairs] == block_pairs
    assert [n for n, _ in tweo.blocks] == ["blocks.0", "blocks.1"]


def test_crossvits_fusion_blocks_are_named_in_one_warning_and_the_rest_trains_with_cd_and_tweo():
    """timm's CrossViT: its fusion CrossAttentionBlocks (norm1 -> attn.wq/wk/wv, attn.proj; no MLP) sit beside the
    timm Blocks of its branches; `python -m cd --model crossvit_tiny_240` printed 60 pairs, none of them theirs,
    without a word. Three stages, one Block per branch: 24 pairs (3 x 2 x 4), and the six fusion blocks named. One
    CD update (the task gradient set to zero) writes paired matrices alone, none of the fusion blocks'; TWEO's term
    is taken over the branches' Blocks."""
    timm = pytest.importorskip("timm")
    model = timm.create_model("crossvit_tiny_240", img_size=[32, 48], patch_size=[8, 16], embed_dim=[16, 32],
                              depth=[[1, 1, 0]] * 3, num_heads=[2, 2], mlp_ratio=[2, 2, 1], num_classes=3)
    fusions = [f"blocks.{i}.fusion.{j}" for i in range(3) for j in range(2)]
    listed = "; ".join(rf"{n} \(CrossAttentionBlock: an attention attn \(CrossAttention\) after a norm norm1 "
                       r"\(LayerNorm\) and no MLP\)" for n in fusions)
    with pytest.warns(UserWarning, match=LEFT_OUT.format(n=6, root="CrossVit") + listed + WHY) as record:
        decay = ColinearityDecay(model, lam=1.0)
        tweo = TWEO(model)
    assert len(_half_warnings(record)) == 1
    assert len(decay.pairs) == 24 and not any(".fusion." in p.name for p in decay.pairs)
    assert [n for n, _ in tweo.blocks] == [f"blocks.{i}.blocks.{b}.0" for i in range(3) for b in range(2)]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    decay.attach(optimizer)
    model.train()
    task = model(torch.randn(2, 3, 48, 48)).square().mean()
    (task + tweo.aux_loss(task)).backward()
    assert all(model.get_parameter(f"{n}.attn.wq.weight").grad is not None for n in fusions)  # they train by the loss
    optimizer.zero_grad(set_to_none=False)  # the update left is CD's own
    optimizer.step()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and {p.name for p in decay.pairs} >= changed
    assert not any(".fusion." in n for n in changed)


def test_convolutional_blocks_and_heads_beside_known_blocks_are_no_half_blocks():
    """A norm beside an MLP's two matrices is no half block where something else of the module has a weight (a
    ConvNeXt block's and an MBConv's depthwise convolution, a head's classifier) or the norm comes between them (a
    timm Mlp with a norm_layer); nor is an attention whose q/k norms are its own children (one head: their width is
    D), nor an attention-pooling head with a latent query (timm's AttentionPoolLatent, SigLIP's MAP head: its own q,
    kv and output layers are no [Q; K; V] of the stream). No warning; the pairs are the timm blocks' alone."""
    timm = pytest.importorskip("timm")
    from timm.layers import AttentionPoolLatent
    from timm.models.convnext import ConvNeXtBlock
    from timm.models.maxxvit import MbConvBlock

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(timm_vit.Block(D, 2), timm_vit.Block(D, 2))
            self.conv = nn.Sequential(ConvNeXtBlock(D, conv_mlp=False), MbConvBlock(D, D))
            self.attn = timm_vit.Attention(D, 1, qk_norm=True, norm_layer=nn.LayerNorm)
            self.pool = AttentionPoolLatent(D, num_heads=2, mlp_ratio=2.0)
            self.mlp = timm_vit.Mlp(D, 2 * D, norm_layer=nn.LayerNorm)
            self.head = nn.Sequential(nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, 3))

        def forward(self, x):
            b, t, d = x.shape
            x = self.blocks(x)
            y = self.conv(x.transpose(1, 2).reshape(b, d, 1, t)).reshape(b, d, t).transpose(1, 2)
            return self.head(self.pool(self.mlp(self.attn(x + y))))

    assert timm  # the import above skips this test without timm
    model = Model()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        pairs = find_pairs(model, example_input=_x())
        tweo = TWEO(model)
    assert _half_warnings(record) == []
    assert [p.name for p in pairs] == TIMM_BLOCK_0 + [n.replace("blocks.0", "blocks.1") for n in TIMM_BLOCK_0]
    assert [name for name, _ in tweo.blocks] == ["blocks.0", "blocks.1"]


@pytest.mark.parametrize("build", ["vit_tiny_patch16_224", "vit_base_patch16_siglip_224",
                                   "swin_tiny_patch4_window7_224", "eva02_tiny_patch14_224", "gpt"])
def test_the_repositorys_models_get_no_half_block_warning(build):
    """The models the repository trains (timm's ViT, SigLIP with its MAP head, Swin, EVA-02 with its gated MLP
    paired, models/gpt.py) hold no half block beside their blocks: no warning."""
    timm = pytest.importorskip("timm")
    if build == "gpt":
        from models.gpt import GPT
        model, kwargs = GPT(vocab_size=64, context=16, depth=2, num_heads=2, embed_dim=D), {}
    elif build.startswith("swin"):
        model = timm.create_model(build, img_size=32, patch_size=2, window_size=4, embed_dim=D, depths=(2, 2),
                                  num_heads=(2, 4), num_classes=3)
        kwargs = {}
    else:
        model = timm.create_model(build, img_size=32, patch_size=8, embed_dim=D, depth=2, num_heads=2, num_classes=3)
        kwargs = {"gated_mlp": True} if build.startswith("eva02") else {}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert find_pairs(model, verify=False, **kwargs)
        TWEO(model)
    assert _half_warnings(record) == []

"""find_pairs on the tiny model of each family in cd/families.py against the pair list written out by hand (paper
Sec. 3.2; cd/README.md, "The pairs" and "Gated MLPs"): names, roles, kinds, V rows, storage and the shapes of W1 and
W2 as the layers apply them, in model order, for timm's ViT / DeiT / CaiT / Swin / SwiGLU and packed-GLU MLPs,
transformers' GPT-2 / ViT / Llama, nanoGPT and MMDetection's Swin."""
from __future__ import annotations

import pytest
import torch

from cd import find_pairs
from cd.families import build_family

D = 32  # the tiny families' width (cd/families.py: embed_dim, n_embd, hidden_size, embed_dims)


def _row(name, role, kind, up, w1_shape, w2_shape, rows=None, transposed=False):
    return (name, role, kind, up, rows, transposed, w1_shape, w2_shape)


def _plain(b, d, h, norm1="norm1", qkv="attn.qkv", proj="attn.proj", norm2="norm2", fc1="mlp.fc1", fc2="mlp.fc2",
           transposed=False):
    """The four pairs of a pre-norm block of width d and MLP width h with a fused [Q; K; V] (rows 2d:3d are V)."""
    return [_row(f"{b}.{qkv}.weight", "qkv", "composable", f"{b}.{norm1}.weight", (d, d), (3 * d, d),
                 transposed=transposed),
            _row(f"{b}.{proj}.weight", "proj", "functional", f"{b}.{qkv}.weight", (d, d), (d, d), (2 * d, 3 * d),
                 transposed),
            _row(f"{b}.{fc1}.weight", "fc1", "composable", f"{b}.{norm2}.weight", (d, d), (h, d),
                 transposed=transposed),
            _row(f"{b}.{fc2}.weight", "fc2", "functional", f"{b}.{fc1}.weight", (h, d), (d, h), None, transposed)]


def _separate_qkv(b, d, norm1, attn, o):
    """q, k, v each after norm1 (role qkv), then the output layer after v (role proj)."""
    out = [_row(f"{b}.{attn.format(x)}.weight", "qkv", "composable", f"{b}.{norm1}.weight", (d, d), (d, d))
           for x in "qkv"]
    return out + [_row(f"{b}.{o}.weight", "proj", "functional", f"{b}.{attn.format('v')}.weight", (d, d), (d, d))]


def _merge(name, d_in):
    """A patch merging: norm over the 4 * d_in concatenated channels, then reduction to 2 * d_in."""
    return [_row(f"{name}.reduction.weight", "reduction", "composable", f"{name}.norm.weight", (4 * d_in, 4 * d_in),
                 (2 * d_in, 4 * d_in))]


def _timm_swin():
    # timm places the merging at the start of stage 1
    return (_plain("layers.0.blocks.0", D, 4 * D) + _plain("layers.0.blocks.1", D, 4 * D)
            + _merge("layers.1.downsample", D)
            + _plain("layers.1.blocks.0", 2 * D, 8 * D) + _plain("layers.1.blocks.1", 2 * D, 8 * D))


def _mmdet_swin():
    # MMDetection places it at the end of stage 0
    kw = dict(qkv="attn.w_msa.qkv", proj="attn.w_msa.proj", fc1="ffn.layers.0.0", fc2="ffn.layers.1")
    return (_plain("stages.0.blocks.0", D, 4 * D, **kw) + _plain("stages.0.blocks.1", D, 4 * D, **kw)
            + _merge("stages.0.downsample", D)
            + _plain("stages.1.blocks.0", 2 * D, 8 * D, **kw) + _plain("stages.1.blocks.1", 2 * D, 8 * D, **kw))


def _cait():
    # depth 1 patch block (talking-heads attention, fused qkv), then timm's 2 class-attention blocks (q, k, v)
    out = _plain("blocks.0", D, 4 * D)
    for i in range(2):
        b = f"blocks_token_only.{i}"
        out += _separate_qkv(b, D, "norm1", "attn.{}", "attn.proj")
        out += _plain(b, D, 4 * D)[2:]
    return out


def _eva02(b):
    # GluMlp packs [W_gate; W_up] in fc1 (170 = 2 x 85 rows); gate_last=False: act(x1) * x2, so W_up is rows 85:170
    return _plain(b, D, 0)[:2] + [
        _row(f"{b}.mlp.fc1.weight", "fc1", "composable", f"{b}.norm2.weight", (D, D), (170, D)),
        _row(f"{b}.mlp.fc2.weight", "fc2", "functional", f"{b}.mlp.fc1.weight", (85, D), (D, 85), (85, 170))]


def _swiglu(b, h, norm2="norm2", gate="mlp.fc1_g", up="mlp.fc1_x", down="mlp.fc2"):
    """A gated MLP: W_gate and W_up each after norm2 (role fc1), W_down after W_up (role fc2)."""
    return [_row(f"{b}.{gate}.weight", "fc1", "composable", f"{b}.{norm2}.weight", (D, D), (h, D)),
            _row(f"{b}.{up}.weight", "fc1", "composable", f"{b}.{norm2}.weight", (D, D), (h, D)),
            _row(f"{b}.{down}.weight", "fc2", "functional", f"{b}.{up}.weight", (h, D), (D, h))]


def _hf_vit(b):
    return _separate_qkv(b, D, "layernorm_before", "attention.{}_proj", "attention.o_proj") + \
        _plain(b, D, 64, norm2="layernorm_after")[2:]


def _llama(b):
    return _separate_qkv(b, D, "input_layernorm", "self_attn.{}_proj", "self_attn.o_proj") + \
        _swiglu(b, 64, "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


_GPT2 = dict(norm1="ln_1", qkv="attn.c_attn", proj="attn.c_proj", norm2="ln_2", fc1="mlp.c_fc", fc2="mlp.c_proj")

WANT = {  # family -> (gated_mlp, the pairs in model order)
    "vit": (False, _plain("blocks.0", D, 4 * D) + _plain("blocks.1", D, 4 * D)),
    "deit (distilled)": (False, _plain("blocks.0", D, 4 * D) + _plain("blocks.1", D, 4 * D)),
    "swin": (False, _timm_swin()),
    "cait": (False, _cait()),
    "eva02": (True, _eva02("blocks.0") + _eva02("blocks.1")),
    "SwiGLU ViT (aimv2)": (True, [r for i in range(2)
                                  for r in _plain(f"blocks.{i}", D, 0)[:2] + _swiglu(f"blocks.{i}", 88)]),
    "GPT-2 (transformers)": (False, [r for i in range(2) for r in _plain(f"transformer.h.{i}", D, 4 * D, **_GPT2,
                                                                          transposed=True)]),
    "GPT-2, nanoGPT-style (nn.Linear c_attn)": (False, [r for i in range(2)
                                                        for r in _plain(f"transformer.h.{i}", D, 4 * D, **_GPT2)]),
    "ViT (transformers)": (False, _hf_vit("vit.layers.0") + _hf_vit("vit.layers.1")),
    "Llama, multi-head attention (transformers)": (True, _llama("model.layers.0") + _llama("model.layers.1")),
    "Swin (MMDetection)": (False, _mmdet_swin()),
}


def _build(family: str):
    if family in ("GPT-2 (transformers)", "ViT (transformers)") or family.startswith("Llama"):
        pytest.importorskip("transformers")
    if family == "Swin (MMDetection)":
        pytest.importorskip("mmdet")
    torch.manual_seed(0)
    return build_family(family)


@pytest.mark.parametrize("family", list(WANT))
def test_each_family_has_the_pairs_written_out_by_hand(family):
    gated, want = WANT[family]
    model = _build(family)
    pairs = find_pairs(model, gated_mlp=gated)
    got = [(p.name, p.role, p.kind, p.upstream_name, p.upstream_rows, p.transposed, p.w1_shape, p.w2_shape)
           for p in pairs]
    assert got == want
    params = dict(model.named_parameters())
    for p in pairs:  # the model's own tensors, and W1, W2 as the layer applies them: (out, in), Conv1D transposed
        assert p.downstream is params[p.name] and p.upstream is params[p.upstream_name]
        stored = params[p.name].t() if p.transposed else params[p.name]
        assert torch.equal(p.w2(), stored) and p.w2().data_ptr() == params[p.name].data_ptr()
        if not p.diagonal:
            up = params[p.upstream_name].t() if p.transposed else params[p.upstream_name]
            assert torch.equal(p.w1(), up[slice(*p.upstream_rows)] if p.upstream_rows else up)


@pytest.mark.parametrize("family,t", [("GPT-2 (transformers)", "^T"), ("GPT-2, nanoGPT-style (nn.Linear c_attn)", "")])
def test_w1_labels_mark_a_matrix_stored_in_out(family, t):
    """`python -m cd`'s W1 column: a norm scale as diag(...), V's rows of the fused c_attn, and `^T` after the name
    of a Conv1D weight (stored (in, out)) only; written out by hand for one block of width 32."""
    pairs = find_pairs(_build(family), verify=False)  # the labels only: the pairs' forward checks run above
    b = "transformer.h.0"
    assert [p.upstream_label for p in pairs[:4]] == [f"diag({b}.ln_1.weight)", f"{b}.attn.c_attn.weight{t}[64:96]",
                                                     f"diag({b}.ln_2.weight)", f"{b}.mlp.c_fc.weight{t}"]

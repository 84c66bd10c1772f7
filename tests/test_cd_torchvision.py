"""CD on torchvision's ViT (nn.MultiheadAttention: the fused qkv is the attention's own `in_proj_weight`) and Swin
(the children of timm's block, an MLP of Sequential indices): the pairs by name, one update against the float64
reference written out by hand and against timm's ViT holding the same weights, the V-row check through
F.multi_head_attention_forward, and the attentions CD refuses."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from cd import ColinearityDecay, find_pairs
from cd.families import build_family
from cd.pairs import find_blocks
from cd.values import check_channel_order
from cd.verify import UnsupportedModelError, example_input
from cd_integration_refs import RefPair, max_diff, reference_cd_
from cd_models import randomize_norms

torchvision = pytest.importorskip("torchvision")
DIM = 32  # the tiny families' width (cd/families.py)
IMAGE = torch.zeros(1, 3, 32, 32)


def _vit_pairs(layers: int = 2) -> list[RefPair]:
    """torchvision's EncoderBlock: in_proj_weight after ln_1, out_proj after its V rows, mlp.0 after ln_2, mlp.3
    after mlp.0."""
    out = []
    for i in range(layers):
        b = f"encoder.layers.encoder_layer_{i}"
        out += [RefPair(f"{b}.self_attention.in_proj_weight", f"{b}.ln_1.weight", True),
                RefPair(f"{b}.self_attention.out_proj.weight", f"{b}.self_attention.in_proj_weight", False,
                        (2 * DIM, 3 * DIM)),
                RefPair(f"{b}.mlp.0.weight", f"{b}.ln_2.weight", True),
                RefPair(f"{b}.mlp.3.weight", f"{b}.mlp.0.weight", False)]
    return out


def _swin_pairs() -> list[RefPair]:
    """torchvision's Swin (features.1: stage of width 32, features.2: patch merging, features.3: width 64)."""
    out = []
    for stage, dim in ((1, DIM), (3, 2 * DIM)):
        for j in range(2):
            b = f"features.{stage}.{j}"
            out += [RefPair(f"{b}.attn.qkv.weight", f"{b}.norm1.weight", True),
                    RefPair(f"{b}.attn.proj.weight", f"{b}.attn.qkv.weight", False, (2 * dim, 3 * dim)),
                    RefPair(f"{b}.mlp.0.weight", f"{b}.norm2.weight", True),
                    RefPair(f"{b}.mlp.3.weight", f"{b}.mlp.0.weight", False)]
        if stage == 1:
            out.append(RefPair("features.2.reduction.weight", "features.2.norm.weight", True))
    return out


@pytest.mark.parametrize("family,want", [("ViT (torchvision)", _vit_pairs()), ("Swin (torchvision)", _swin_pairs())])
def test_pairs_by_role_and_name(family, want):
    pairs = find_pairs(build_family(family))
    got = [(p.name, p.upstream_name, p.diagonal, p.upstream_rows) for p in pairs]
    assert got == [(r.w2, r.w1, r.diag, r.rows) for r in want]
    roles = [p.role for p in pairs]
    assert roles.count("qkv") == roles.count("proj") == roles.count("fc1") == roles.count("fc2") == len(want) // 4


@pytest.mark.parametrize("family,pairs", [("ViT (torchvision)", _vit_pairs()), ("Swin (torchvision)", _swin_pairs())])
def test_one_update_matches_the_float64_reference(family, pairs):
    torch.manual_seed(0)
    model = randomize_norms(build_family(family))
    want = copy.deepcopy(model).double()
    before = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    decay = ColinearityDecay(model, lam=0.5, matmul_precision="fp32")
    decay.apply(lr=0.1)
    reference_cd_(want, pairs, 0.5, {p.w2: 0.1 for p in pairs})
    got = {n: p.double() for n, p in model.named_parameters()}
    assert max_diff(got, dict(want.named_parameters())) < 1e-6  # fp32 update against float64
    assert max_diff(got, before) > 1e-3  # the update is large enough for a wrong pair to show


def test_one_update_equals_timm_vit_holding_the_same_weights():
    """timm's qkv.weight is torchvision's in_proj_weight ([Q; K; V] rows both): the same matrices get the same
    update."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    tv = randomize_norms(build_family("ViT (torchvision)")).double()
    tm = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=DIM,
                           depth=2, num_heads=2, mlp_ratio=2.0, num_classes=3).double().eval()
    names = {"ln_1": "norm1", "self_attention.in_proj_weight": "attn.qkv.weight",
             "self_attention.in_proj_bias": "attn.qkv.bias", "self_attention.out_proj": "attn.proj",
             "ln_2": "norm2", "mlp.0": "mlp.fc1", "mlp.3": "mlp.fc2"}
    timm_params = dict(tm.named_parameters())
    pairs_of = {}  # torchvision name -> timm name of every block parameter
    with torch.no_grad():
        for name, p in tv.named_parameters():
            if not name.startswith("encoder.layers."):
                continue
            block, rest = name[len("encoder.layers.encoder_layer_"):].split(".", 1)
            mapped = next(rest.replace(k, v, 1) for k, v in names.items() if rest.startswith(k))
            pairs_of[name] = f"blocks.{block}.{mapped}"
            timm_params[pairs_of[name]].copy_(p)
    before = {n: p.detach().clone() for n, p in tv.named_parameters()}
    ColinearityDecay(tv, lam=0.5, matmul_precision="fp32", example_input=IMAGE.double()).apply(lr=0.1)
    ColinearityDecay(tm, lam=0.5, matmul_precision="fp32").apply(lr=0.1)
    tv_params = dict(tv.named_parameters())
    w2s = [n for n in pairs_of if n.endswith(("in_proj_weight", "out_proj.weight", "mlp.0.weight", "mlp.3.weight"))]
    assert len(w2s) == 8 and all(not torch.allclose(tv_params[n], before[n], rtol=0, atol=1e-4) for n in w2s)
    for name, timm_name in pairs_of.items():
        assert torch.allclose(tv_params[name], timm_params[timm_name], rtol=0, atol=1e-12), name


def _vit_with(**mha) -> nn.Module:
    """The tiny torchvision ViT whose first block's attention is nn.MultiheadAttention(32, 2, **mha)."""
    torch.manual_seed(0)
    model = build_family("ViT (torchvision)")
    model.encoder.layers[0].self_attention = nn.MultiheadAttention(DIM, 2, **{"batch_first": True, **mha}).eval()
    return model


@pytest.mark.parametrize("mha", [{}, {"add_bias_kv": True}, {"add_zero_attn": True}, {"batch_first": False}])
def test_v_row_check_follows_multihead_attention(mha):
    """Under the check's torch function mode nn.MultiheadAttention leaves its native fast path and the mode sees
    F.multi_head_attention_forward whole: the claimed V rows pass, rows that are not V (K's) are refused. A learned
    bias_v enters with V (zeroed as timm's sink values are), add_zero_attn's zero value row keeps proj's input zero."""
    model = _vit_with(**mha)
    pairs = find_pairs(model, example_input=torch.randn(2, 3, 32, 32))
    assert [p.upstream_rows for p in pairs if p.role == "proj"] == [(2 * DIM, 3 * DIM)] * 2
    wrong = [dataclasses.replace(p, upstream_rows=(DIM, 2 * DIM)) if p.role == "proj" else p for p in pairs]
    with pytest.raises(UnsupportedModelError, match=r"rows 32:64 of encoder\.layers\.encoder_layer_0\."
                                                    r"self_attention\.in_proj_weight's output set to zero, the input "
                                                    r"of .* is not zero"):
        check_channel_order(model, wrong, {}, torch.randn(2, 3, 32, 32))


class _FastPathOnly(nn.MultiheadAttention):
    """Runs torch's native fused attention whatever the mode: a forward the check cannot look into."""

    def forward(self, query, key, value, **kwargs):
        out = torch._native_multi_head_attention(query, key, value, self.embed_dim, self.num_heads,
                                                 self.in_proj_weight, self.in_proj_bias, self.out_proj.weight,
                                                 self.out_proj.bias, need_weights=False)
        return out[0], None


def test_native_fast_path_is_refused_not_passed():
    """A forward through torch._native_multi_head_attention (the fast path, one op) hides which rows are V: the
    check says so rather than passing unchecked."""
    model = _vit_with()
    pairs = find_pairs(model, example_input=IMAGE)
    fast = _FastPathOnly(DIM, 2, batch_first=True).eval()
    fast.load_state_dict(model.encoder.layers[0].self_attention.state_dict())
    model.encoder.layers[0].self_attention = fast
    pairs = [dataclasses.replace(p, downstream=fast.out_proj.weight if p.role == "proj" else p.downstream,
                                 upstream=fast.in_proj_weight if p.role == "proj" else p.upstream)
             if p.block.endswith("_0") else p for p in pairs]
    with pytest.raises(UnsupportedModelError, match="in a way CD does not follow"):
        check_channel_order(model, pairs, {}, IMAGE)


def test_kdim_other_than_embed_dim_is_refused():
    with pytest.raises(UnsupportedModelError, match=r"block 'encoder\.layers\.encoder_layer_0' \(EncoderBlock\).*"
                                                    r"kdim or vdim other than embed_dim"):
        find_pairs(_vit_with(kdim=16, vdim=16), example_input=IMAGE)


@pytest.mark.parametrize("family,blocks", [
    ("ViT (torchvision)", ["encoder.layers.encoder_layer_0", "encoder.layers.encoder_layer_1"]),
    ("Swin (torchvision)", ["features.1.0", "features.1.1", "features.3.0", "features.3.1"])])
def test_blocks_whose_output_is_the_residual_stream(family, blocks):
    """TWEO's A_l (cd.pairs.find_blocks): each block's output is one tensor of the stream's width."""
    model = build_family(family)
    found = find_blocks(model)
    assert [name for name, _ in found] == blocks
    outputs = []
    hooks = [m.register_forward_hook(lambda m, i, o: outputs.append((i[0].shape, o))) for _, m in found]
    with torch.no_grad():
        model(IMAGE)
    for h in hooks:
        h.remove()
    assert all(isinstance(o, torch.Tensor) and o.shape == shape for shape, o in outputs) and len(outputs) == len(blocks)


def test_vit_input_size_is_read_off_the_model():
    """torchvision's VisionTransformer takes images of exactly `image_size` (its forward refuses any other) with its
    patchify conv's input channels: find_pairs needs no example_input. Was: refused, "pass example_input="."""
    model = torchvision.models.VisionTransformer(image_size=24, patch_size=8, num_layers=2, num_heads=2,
                                                 hidden_dim=DIM, mlp_dim=2 * DIM, num_classes=3)
    model.conv_proj = nn.Conv2d(1, DIM, kernel_size=8, stride=8)  # one input channel: read, not assumed
    x = example_input(model)
    assert (x.shape, x.dtype, x.device.type) == ((1, 1, 24, 24), torch.float32, "meta")
    with torch.no_grad():
        assert model(torch.zeros(x.shape)).shape == (1, 3)  # the size it names is one the model takes
    assert [p.name for p in find_pairs(model)] == [p.w2 for p in _vit_pairs()]


class _TimmNamedBlock(nn.Module):
    """A block of one's own under timm's names whose attention is an nn.MultiheadAttention (its fused qkv is its
    own `in_proj_weight`, its output layer `out_proj`)."""

    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, 2, batch_first=True)
        self.mlp = nn.Module()
        self.mlp.fc1, self.mlp.fc2 = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp.fc2(torch.nn.functional.gelu(self.mlp.fc1(self.norm2(x))))


def test_a_timm_named_block_with_multihead_attention_is_paired():
    """nn.MultiheadAttention as a timm-named block's `attn`: attn.in_proj_weight with norm1, attn.out_proj with its
    V rows, and the update is the float64 reference's. Was: refused, "found no attn.proj"."""
    torch.manual_seed(0)
    model = randomize_norms(nn.Sequential(_TimmNamedBlock(), _TimmNamedBlock()))
    want = []
    for b in ("0", "1"):
        want += [RefPair(f"{b}.attn.in_proj_weight", f"{b}.norm1.weight", True),
                 RefPair(f"{b}.attn.out_proj.weight", f"{b}.attn.in_proj_weight", False, (2 * DIM, 3 * DIM)),
                 RefPair(f"{b}.mlp.fc1.weight", f"{b}.norm2.weight", True),
                 RefPair(f"{b}.mlp.fc2.weight", f"{b}.mlp.fc1.weight", False)]
    example = torch.randn(2, 5, DIM)
    pairs = find_pairs(model, example_input=example)
    assert [(p.name, p.upstream_name, p.diagonal, p.upstream_rows) for p in pairs] == \
        [(r.w2, r.w1, r.diag, r.rows) for r in want]
    reference = copy.deepcopy(model).double()
    ColinearityDecay(model, lam=0.5, matmul_precision="fp32", example_input=example).apply(lr=0.1)
    reference_cd_(reference, want, 0.5, {r.w2: 0.1 for r in want})
    assert max_diff({n: p.double() for n, p in model.named_parameters()}, dict(reference.named_parameters())) < 1e-6


def test_vit_with_a_conv_stem_gets_its_input_size_from_the_stems_first_conv():
    """torchvision's conv_stem_configs make `conv_proj` an nn.Sequential of convolutions: the input's channels are
    its first convolution's. Was: refused, "pass example_input="."""
    from torchvision.models.vision_transformer import ConvStemConfig

    model = torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2,
                                                 hidden_dim=DIM, mlp_dim=2 * DIM, num_classes=3,
                                                 conv_stem_configs=[ConvStemConfig(8, 3, 2)] * 3)  # 2**3 = patch
    model.conv_proj[0][0] = nn.Conv2d(1, 8, kernel_size=3, stride=2, padding=1, bias=False)  # read, not assumed
    x = example_input(model)
    assert (x.shape, x.dtype, x.device.type) == ((1, 1, 32, 32), torch.float32, "meta")
    with torch.no_grad():
        assert model(torch.zeros(x.shape)).shape == (1, 3)  # the size it names is one the model takes
    assert len(find_pairs(model)) == 8


def test_kdim_of_a_multihead_attention_below_the_attention_child_is_refused_as_such():
    """An nn.MultiheadAttention with kdim != embed_dim inside the attention child (MMDetection's names, attn.w_msa)
    is refused for its kdim, as one that is the child itself is. Was: "found no attn.w_msa.in_proj_weight"."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
            self.attn = nn.Module()
            self.attn.w_msa = nn.MultiheadAttention(DIM, 2, kdim=8, vdim=8, batch_first=True)
            self.ffn = nn.Module()
            self.ffn.layers = nn.Sequential(nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU()), nn.Linear(2 * DIM, DIM))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.norm1(x)
            x = x + self.attn.w_msa(h, h[..., :8], h[..., :8], need_weights=False)[0]
            return x + self.ffn.layers(self.norm2(x))

    with pytest.raises(UnsupportedModelError, match=r"block '0' .*MultiheadAttention has kdim or vdim other than"):
        find_pairs(nn.Sequential(Block()), example_input=torch.randn(2, 5, DIM))

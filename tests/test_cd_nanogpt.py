"""CD on a nanoGPT-shaped GPT: transformers' GPT-2 names (ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc,
mlp.c_proj) on `nn.Linear` layers stored (out, in), where transformers' `Conv1D` stores (in, out).

The model below is written here to nanoGPT's shape (causal scaled-dot-product attention on
q, k, v = c_attn(x).split(D, dim=2), a 4x GELU MLP, token embedding tied to the LM head); the same block under
timm's names is the second reference of the update. Was: every such block refused ("attn.c_attn is not 3x
attn.c_proj's input width"), its storage taken from the layout's names.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cd import ColinearityDecay, find_pairs
from cd.verify import UnsupportedModelError
from cd_models import randomize_norms

D, HEADS, LAYERS, VOCAB, T = 32, 2, 2, 50, 8
NANOGPT = dict(norm1="ln_1", attn="attn", qkv="c_attn", proj="c_proj", norm2="ln_2", mlp="mlp", fc1="c_fc",
               fc2="c_proj")
TIMM = dict(norm1="norm1", attn="attn", qkv="qkv", proj="proj", norm2="norm2", mlp="mlp", fc1="fc1", fc2="fc2")


class _Attention(nn.Module):
    def __init__(self, names: dict, bias: bool, order: str = "qkv", qkv: nn.Module = None):
        super().__init__()
        self.n, self.order = names, order
        setattr(self, names["qkv"], qkv if qkv is not None else nn.Linear(D, 3 * D, bias=bias))
        setattr(self, names["proj"], nn.Linear(D, D, bias=bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        parts = dict(zip(self.order, getattr(self, self.n["qkv"])(x).split(D, dim=2)))
        q, k, v = (parts[c].view(b, t, HEADS, D // HEADS).transpose(1, 2) for c in "qkv")
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return getattr(self, self.n["proj"])(y.transpose(1, 2).reshape(b, t, D))


class _Mlp(nn.Module):
    def __init__(self, names: dict, bias: bool):
        super().__init__()
        self.n = names
        setattr(self, names["fc1"], nn.Linear(D, 4 * D, bias=bias))
        setattr(self, names["fc2"], nn.Linear(4 * D, D, bias=bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.n["fc2"])(F.gelu(getattr(self, self.n["fc1"])(x)))


class _Block(nn.Module):
    def __init__(self, names: dict, bias: bool, **attn):
        super().__init__()
        self.n = names
        setattr(self, names["norm1"], nn.LayerNorm(D, bias=bias))
        setattr(self, names["attn"], _Attention(names, bias, **attn))
        setattr(self, names["norm2"], nn.LayerNorm(D, bias=bias))
        setattr(self, names["mlp"], _Mlp(names, bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + getattr(self, self.n["attn"])(getattr(self, self.n["norm1"])(x))
        return x + getattr(self, self.n["mlp"])(getattr(self, self.n["norm2"])(x))


class TinyGPT(nn.Module):
    """nanoGPT's GPT, tiny: transformer.{wte, wpe, h.N, ln_f} and lm_head tied to wte."""

    def __init__(self, names: dict = NANOGPT, bias: bool = True, seed: int = 0, **attn):
        super().__init__()
        torch.manual_seed(seed)
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(VOCAB, D), wpe=nn.Embedding(16, D),
            h=nn.ModuleList(_Block(names, bias, **attn) for _ in range(LAYERS)), ln_f=nn.LayerNorm(D, bias=bias)))
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        randomize_norms(self, seed)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.transformer.wte(ids) + self.transformer.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("bias", [True, False])
def test_a_nanogpt_block_gets_the_four_pairs_checked_by_its_forward(bias):
    """4 pairs per block, nn.Linear storage (not transposed), V rows [2D:3D] of c_attn; find_pairs' meta check
    and V-row check run on the real model (verify=True)."""
    pairs = find_pairs(TinyGPT(bias=bias), example_input=_ids())
    want = []
    for i in range(LAYERS):
        b = f"transformer.h.{i}"
        want += [(f"{b}.attn.c_attn.weight", "qkv", "composable", f"{b}.ln_1.weight", None),
                 (f"{b}.attn.c_proj.weight", "proj", "functional", f"{b}.attn.c_attn.weight", (2 * D, 3 * D)),
                 (f"{b}.mlp.c_fc.weight", "fc1", "composable", f"{b}.ln_2.weight", None),
                 (f"{b}.mlp.c_proj.weight", "fc2", "functional", f"{b}.mlp.c_fc.weight", None)]
    assert [(p.name, p.role, p.kind, p.upstream_name, p.upstream_rows) for p in pairs] == want
    assert not any(p.transposed for p in pairs)
    assert [p.w2_shape for p in pairs[:4]] == [(3 * D, D), (D, D), (4 * D, D), (D, 4 * D)]


def test_the_v_row_check_runs_on_a_nanogpt_block():
    """The same model reading c_attn's thirds as (v, k, q): rows [2D:3D] are not V, and the V-row check says so
    (so the check that passes above is not skipped)."""
    with pytest.raises(UnsupportedModelError,
                       match=r"transformer\.h\.0.*rows 64:96 of .*c_attn.* is not zero.*laid out otherwise"):
        find_pairs(TinyGPT(order="vkq"), example_input=_ids())


def _paper_update(model: nn.Module, step: float) -> dict[str, torch.Tensor]:
    """W2 - step * W2 @ W1n @ W1n^T, W1n = W1 / (||W1||_F / sqrt(rows W1)) (paper Sec. 3.3, Eq. (12); App. A.2),
    float64, on the (out, in) matrices nn.Linear stores, all from the weights before the update."""
    w = {n: p.detach().double() for n, p in model.named_parameters()}
    out = {}
    for i in range(LAYERS):
        b = f"transformer.h.{i}"
        ups = {"attn.c_attn": torch.diag(w[f"{b}.ln_1.weight"]), "attn.c_proj": w[f"{b}.attn.c_attn.weight"][2 * D:],
               "mlp.c_fc": torch.diag(w[f"{b}.ln_2.weight"]), "mlp.c_proj": w[f"{b}.mlp.c_fc.weight"]}
        for layer, w1 in ups.items():
            w1n = w1 / (torch.linalg.matrix_norm(w1) / math.sqrt(w1.shape[0]))
            w2 = w[f"{b}.{layer}.weight"]
            out[f"{b}.{layer}.weight"] = w2 - step * w2 @ w1n @ w1n.T
    return out


@pytest.mark.parametrize("bias", [True, False])
def test_one_update_is_the_paper_update_and_the_timm_named_one(bias):
    model = TinyGPT(bias=bias)
    timm_named = TinyGPT(TIMM, bias=bias)
    timm_named.load_state_dict({k.replace("ln_1", "norm1").replace("ln_2", "norm2").replace("c_attn", "qkv")
                                .replace("attn.c_proj", "attn.proj").replace("c_fc", "fc1")
                                .replace("mlp.c_proj", "mlp.fc2"): v for k, v in model.state_dict().items()})
    want = _paper_update(model, 0.1 * 0.5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ColinearityDecay(model, lam=0.5, matmul_precision="fp32", example_input=_ids()).apply(lr=0.1)
    ColinearityDecay(timm_named, lam=0.5, matmul_precision="fp32", example_input=_ids()).apply(lr=0.1)
    got = dict(model.named_parameters())
    for name, value in want.items():
        assert (got[name].double() - value).abs().max() < 1e-6, name
    for name, p in got.items():  # only the four W2 of each block move
        assert name in want or torch.equal(p, before[name]), name
    for (name, p), (timm_name, q) in zip(model.named_parameters(), timm_named.named_parameters()):
        assert torch.equal(p, q), (name, timm_name)


def test_a_conv1d_qkv_feeding_a_linear_proj_is_read_with_each_layers_storage():
    """c_attn stored (in, out) (transformers' Conv1D, holding the nn.Linear's weight transposed: the same map)
    and c_proj (out, in) (nn.Linear): each matrix of the proj pair is read with its own storage, and the update
    is the paper's on the (out, in) matrices the layers apply, those of the all-nn.Linear model. Was: refused,
    one storage flag reading both."""
    conv1d = pytest.importorskip("transformers.pytorch_utils").Conv1D
    model = TinyGPT()
    want = _paper_update(model, 0.1 * 0.5)
    for block in model.transformer.h:
        linear, block.attn.c_attn = block.attn.c_attn, conv1d(3 * D, D)
        with torch.no_grad():
            block.attn.c_attn.weight.copy_(linear.weight.t())
            block.attn.c_attn.bias.copy_(linear.bias)
    proj = next(p for p in find_pairs(model, example_input=_ids()) if p.role == "proj")
    assert (proj.transposed, proj.upstream_transposed) == (False, True)
    ColinearityDecay(model, lam=0.5, matmul_precision="fp32", example_input=_ids()).apply(lr=0.1)
    got = {n: p.detach().double() for n, p in model.named_parameters()}
    for name, value in want.items():
        as_applied = got[name].t() if name.endswith("c_attn.weight") else got[name]
        assert (as_applied - value).abs().max() < 1e-6, name


class _Adapter(nn.Module):
    """A layer class of one's own taking over a layer: holds the layer's weight (out, in) itself, as nn.Linear
    does; neither nn.Linear nor Conv1D, so its storage is not told by its type. (Adapters' low-rank terms beside
    the weight are refused: tests/test_cd_adapters.py.)"""

    def __init__(self, layer: nn.Linear):
        super().__init__()
        self.weight, self.bias = layer.weight, layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def _assert_read_as_out_in(model: nn.Module) -> None:
    """4 pairs per block, none transposed, and one update equal to the paper's on the (out, in) matrices."""
    want = _paper_update(model, 0.1 * 0.5)
    pairs = find_pairs(model, example_input=_ids())
    assert len(pairs) == 4 * LAYERS and not any(p.transposed for p in pairs)
    ColinearityDecay(model, lam=0.5, matmul_precision="fp32", example_input=_ids()).apply(lr=0.1)
    got = dict(model.named_parameters())
    for name, value in want.items():
        assert (got[name].double() - value).abs().max() < 1e-6, name


@pytest.mark.parametrize("wrapped", [("attn.c_proj",), ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")])
def test_a_wrapped_layer_is_read_as_it_stores_its_weight(wrapped):
    """A layer whose type does not tell its storage is read by its shape against the block's width (c_attn
    (3D, D) reads D), and a square one (c_proj, D x D) as the layer it pairs with: the update is the paper's on
    the (out, in) matrices. Was: such a layer taken as (in, out), the GPT-2 layout's storage when GPT-2 meant
    transformers' Conv1D, and the block refused ("attn.c_proj (in, out) as transformers' Conv1D")."""
    model = TinyGPT()
    for block in model.transformer.h:
        for path in wrapped:
            parent, _, name = path.rpartition(".")
            setattr(block.get_submodule(parent), name, _Adapter(block.get_submodule(path)))
    _assert_read_as_out_in(model)


def test_a_wrapped_square_mlp_is_read_as_the_blocks_other_wrapped_layers():
    """An MLP of hidden width D (c_fc and mlp.c_proj square: their shape cannot tell their storage), each layer in
    the same wrapper as c_attn, whose (3D, D) shape tells (out, in): the MLP's layers are read as that wrapper
    stores, and the update is the paper's on the (out, in) matrices. Was: taken as the GPT-2 layout's (in, out),
    so fc1's and fc2's updates were computed on the transposed matrices, silently."""
    model = TinyGPT()
    for block in model.transformer.h:
        block.mlp.c_fc, block.mlp.c_proj = nn.Linear(D, D), nn.Linear(D, D)
        for path in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            parent, _, name = path.rpartition(".")
            setattr(block.get_submodule(parent), name, _Adapter(block.get_submodule(path)))
    _assert_read_as_out_in(model)

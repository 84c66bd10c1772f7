"""TWEO on blocks beyond timm's: GPT-2 as nanoGPT and transformers name it, and blocks returning tuples.

Each penalty is checked against App. A.3 written out here, on block outputs the test captures itself:

    L_TWEO = (1/L) sum_l mean( (|A_l| / (tau + eps))^p ),   aux = lam * L_TWEO

Was: `TWEO(model)` raised "no pre-norm Transformer block" for every GPT-2 (find_blocks listed layouts by library
and left GPT-2 out, because transformers 4.x layers return tuples).
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from cd import TWEO
from cd.family_nanogpt import NanoGPTShaped

LAM, P, TAU, EPS = 0.01, 4.0, 3.0, 1e-6


def _app_a3(outs: list[torch.Tensor]) -> float:
    """lam * (1/L) sum_l mean((|A_l| / (tau + eps))^p), in float64."""
    return LAM * sum(float(((a.detach().double().abs() / (TAU + EPS)) ** P).mean()) for a in outs) / len(outs)


def test_nanogpt_shaped_penalty_is_app_a3_of_its_block_outputs():
    torch.manual_seed(0)
    model = NanoGPTShaped(depth=3).double()
    for block in model.transformer.h:  # outputs of a few units, so that the p-th power is not vanishingly small
        nn.init.normal_(block.mlp.c_proj.weight, std=0.5)
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():  # the blocks' outputs by a manual forward (TWEO captures no no-grad forward)
        x = model.transformer.wte(ids) + model.transformer.wpe(torch.arange(8))
        outs = []
        for block in model.transformer.h:
            x = block(x)
            outs.append(x)
    with TWEO(model, lam=LAM, p=P, tau=TAU, eps=EPS) as tweo:
        assert [n for n, _ in tweo.blocks] == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]
        model(ids)
        aux = tweo.aux_loss(torch.tensor(1.0))
    want = _app_a3(outs)
    assert want > 1e-3
    assert math.isclose(float(aux.detach()), want, rel_tol=1e-9)
    aux.backward()  # the term reaches the weights that make the block outputs
    assert model.transformer.h[0].mlp.c_proj.weight.grad.abs().sum() > 0


def test_transformers_gpt2_penalty_is_app_a3_of_its_block_outputs():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=16, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg).double().train()
    for block in model.transformer.h:  # GPT-2's init (std 0.02) leaves outputs far below tau
        nn.init.normal_(block.mlp.c_fc.weight, std=0.5)
        nn.init.normal_(block.mlp.c_proj.weight, std=0.5)
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():  # the stream after block l is hidden_states[l + 1], except the last (after ln_f there)
        hidden = model(ids, output_hidden_states=True).hidden_states
    outs = []
    last = model.transformer.h[-1].register_forward_hook(lambda m, a, o: outs.append(o))
    with torch.no_grad():
        model(ids)
    last.remove()
    outs = [*hidden[1:-1], outs[0]]
    with TWEO(model, lam=LAM, p=P, tau=TAU, eps=EPS) as tweo:
        assert [n for n, _ in tweo.blocks] == ["transformer.h.0", "transformer.h.1"]
        model(ids)
        aux = tweo.aux_loss(torch.tensor(1.0))
    want = _app_a3(outs)
    assert want > 1e-3
    assert math.isclose(float(aux.detach()), want, rel_tol=1e-9)


class _Block(nn.Module):
    """A pre-norm block under timm's names whose forward returns `shape(x, stream)`."""

    def __init__(self, shape, dim: int = 8):
        super().__init__()
        self.shape = shape
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.Module()
        self.attn.qkv, self.attn.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Module()
        self.mlp.fc1, self.mlp.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor):
        # not attention: a residual update through every layer is enough for what TWEO reads
        x = x + self.attn.proj(self.attn.qkv(self.norm1(x))[..., 16:])
        stream = x + self.mlp.fc2(torch.relu(self.mlp.fc1(self.norm2(x))))
        return self.shape(x, stream)


class _Stack(nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.blocks = nn.ModuleList(_Block(shape) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            out = block(x)
            x = out if isinstance(out, torch.Tensor) else out[0]
        return x


def _assert_penalty_of_first_elements(model: nn.Module) -> None:
    """TWEO's term on a two-block stack equals App. A.3 on each block's first output element, computed by calling
    the blocks one by one (no TWEO hooks then)."""
    x = torch.randn(2, 5, 8, dtype=torch.float64) * 3
    with torch.no_grad():
        outs = [model.blocks[0](x)[0]]
        outs.append(model.blocks[1](outs[0])[0])
    with TWEO(model, lam=LAM, p=P, tau=TAU, eps=EPS) as tweo:
        model(x)
        aux = tweo.aux_loss(torch.tensor(1.0))
    assert math.isclose(float(aux.detach()), _app_a3(outs), rel_tol=1e-9)


def test_tuple_output_gives_its_first_element_when_that_is_the_stream():
    torch.manual_seed(0)
    model = _Stack(lambda x, stream: (stream, None, stream.sum())).double()  # (hidden_states, present, ...)
    _assert_penalty_of_first_elements(model)


@pytest.mark.parametrize("shape, returned", [
    (lambda x, stream: {"hidden": stream}, "returned dict"),
    (lambda x, stream: (stream[:, :1], stream),  # a class token first: not the stream's shape
     r"returned a tuple whose first element is a tensor of shape \(2, 1, 8\)"),
    (lambda x, stream: ("cache", stream), "returned a tuple whose first element is str"),
    (lambda x, stream: (), "returned tuple"),
])
def test_block_output_that_is_not_the_stream_is_refused_by_name(shape, returned):
    model = _Stack(shape)
    with TWEO(model), pytest.raises(TypeError, match=rf"TWEO: block 'blocks.0' \(_Block\) {returned}"):
        model(torch.randn(2, 5, 8))


class _KeywordStack(nn.Module):
    """Blocks called with the stream as a keyword (`block(x=...)`), returning `(stream, None)` as a 4.x layer."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_Block(lambda x, stream: (stream, None)) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x=x)[0]
        return x


def test_tuple_output_of_a_block_given_the_stream_by_keyword_is_the_stream():
    """The block's input is its forward's first parameter, passed by position or by keyword (a layer called as
    `layer(hidden_states=h, ...)`). Was: a TypeError naming 'its first positional input NoneType'."""
    torch.manual_seed(0)
    model = _KeywordStack().double()
    _assert_penalty_of_first_elements(model)


def test_tuple_output_whose_first_element_differs_from_a_keyword_stream_is_refused():
    model = _KeywordStack()
    model.blocks[0].shape = lambda x, stream: (stream[:, :1], stream)
    with TWEO(model), pytest.raises(TypeError, match=r"first element is a tensor of shape \(2, 1, 8\), the block's "
                                                     r"first input 'x' a tensor of shape \(2, 5, 8\)"):
        model(torch.randn(2, 5, 8))


def test_a_keyword_stream_is_found_through_a_wrapper_that_replaced_the_blocks_forward():
    """A wrapper of `block.forward` taking `*args, **kwargs` (accelerate's hooks, MMEngine's activation
    checkpointing) hides the parameter names; the class's forward still names the stream."""
    torch.manual_seed(0)
    model = _KeywordStack().double()
    for block in model.blocks:
        inner = block.forward
        block.forward = lambda *args, _inner=inner, **kwargs: _inner(*args, **kwargs)
    _assert_penalty_of_first_elements(model)


class _OwnNamesBlock(nn.Module):
    """A pre-norm block whose layers no built-in layout names (ln_a, mix, ln_f, ffn)."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.ln_a, self.ln_f = nn.LayerNorm(d), nn.LayerNorm(d)
        self.mix = nn.MultiheadAttention(d, 2, batch_first=True)
        self.ffn = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        h = self.ln_a(x)
        x = x + self.mix(h, h, h, need_weights=False)[0]
        return x + self.ffn(self.ln_f(x))


def test_a_model_whose_blocks_no_layout_names_is_refused_naming_the_module_that_is_one():
    """Was: "TWEO: no pre-norm Transformer block (...) in Sequential", the same words as for a model without blocks
    (a ConvNeXt), naming no module, where find_pairs names the module that is a block by its structure."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Sequential(_OwnNamesBlock(), _OwnNamesBlock()))
    with pytest.raises(ValueError, match=r"TWEO: no pre-norm Transformer block .* in Sequential; its module '1\.0' "
                                         r"\(_OwnNamesBlock\) holds a Transformer block's parts \(attention mix "
                                         r"\(MultiheadAttention\), norm ln_a \(LayerNorm\), MLP ffn \(Sequential\)\)"):
        TWEO(model)
    with pytest.raises(ValueError, match=r"in Sequential$"):  # no block-shaped module: nothing to name
        TWEO(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)))

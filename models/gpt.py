"""GPT-2 (the nanoGPT recipe's model) with the module names of a timm ViT block.

The network is GPT-2 as nanoGPT trains it (the paper's App. "GPT-2 Language Modeling"): learned token and
position embeddings, pre-norm blocks `x + attn(ln_1(x))`, `x + mlp(ln_2(x))` with a fused qkv projection,
causal softmax attention and a 4x GELU MLP, a final LayerNorm and an LM head tied to the token embedding.
Initialization follows GPT-2 / nanoGPT: N(0, 0.02) everywhere, N(0, 0.02 / sqrt(2 * layers)) for the two
projections that write into the residual stream.

The modules carry the names of timm's ViT block (`blocks.N.norm1`, `attn.qkv`, `attn.proj`, `norm2`,
`mlp.fc1`, `mlp.fc2`, `norm`, `head`) so that everything that inspects a Transformer here (CD's pair
discovery, TWEO, the activation probes, quantization) sees the same block layout as in the ViTs, and the
CD pairs of the paper's GPT-2 runs (ln_1 -> c_attn, V -> attn.c_proj, ln_2 -> c_fc, c_fc -> mlp.c_proj)
are the ViT ones. Weights in nanoGPT's layout (`transformer.h.N.attn.c_attn.weight`, nn.Linear) and in
transformers' GPT2LMHeadModel layout (the same names, Conv1D weights stored in x out) load through
`checkpoint_filter_fn`, which `models.load_pretrained` applies.
"""
from __future__ import annotations

import math
import re
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

# The GPT-2 sizes of the paper (Table 8) and small ones for CPU studies and tests. `vocab_size` is set by
# the data (a config's model.num_classes): 50304 (GPT-2's 50257 padded to a multiple of 64, as nanoGPT
# does) for GPT-2 token files.
GPT_SIZES: dict[str, dict] = {
    "gpt2": dict(depth=12, num_heads=12, embed_dim=768, context=1024),  # GPT-2 Small, 124M
    "gpt2_medium": dict(depth=24, num_heads=16, embed_dim=1024, context=1024),  # GPT-2 Medium, 350M
    "gpt2_mini": dict(depth=6, num_heads=6, embed_dim=192, context=256),  # CPU studies
    "gpt2_micro": dict(depth=4, num_heads=4, embed_dim=128, context=128),  # CPU studies, minutes
    "gpt2_nano": dict(depth=2, num_heads=2, embed_dim=32, context=32),  # tests, seconds
}


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused qkv projection; rows of `qkv.weight` are [Q; K; V]."""

    def __init__(self, dim: int, num_heads: int, bias: bool, attn_drop: float, proj_drop: float):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"embed_dim={dim} is not a multiple of num_heads={num_heads}")
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=bias)
        self.proj = nn.Linear(dim, dim, bias=bias)
        self.attn_drop = attn_drop
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.num_heads, c // self.num_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop if self.training else 0.0,
                                           is_causal=True)
        return self.proj_drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))


class Mlp(nn.Module):
    """fc2(GELU(fc1(x))), hidden width 4x. `gelu`: "exact" (erf, nanoGPT's nn.GELU) or "tanh" (the approximation
    GPT-2 was trained with: transformers' gelu_new)."""

    def __init__(self, dim: int, bias: bool, drop: float, gelu: str = "exact"):
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim, bias=bias)
        self.act = nn.GELU(approximate={"exact": "none", "tanh": "tanh"}[gelu])
        self.fc2 = nn.Linear(4 * dim, dim, bias=bias)
        self.drop = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.act(self.fc1(x))))


class Block(nn.Module):
    """Pre-norm GPT-2 block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, dim: int, num_heads: int, bias: bool, drop: float, gelu: str = "exact"):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, bias=bias)
        self.attn = CausalSelfAttention(dim, num_heads, bias, drop, drop)
        self.norm2 = nn.LayerNorm(dim, bias=bias)
        self.mlp = Mlp(dim, bias, drop, gelu)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """GPT-2 language model: token ids (B, T) -> next-token logits (B, T, vocab_size).

    Args:
        vocab_size: number of token ids. context: the longest sequence (position embeddings).
        depth, num_heads, embed_dim: the Transformer's size. bias: biases in Linear and LayerNorm
            (GPT-2: True). drop: dropout after embeddings, attention and projections (nanoGPT: 0).
        gelu: "exact" (nanoGPT's erf GELU, the default) or "tanh" (GPT-2's own approximation, which
            transformers' GPT-2 weights were trained with: `model.kwargs.gelu=tanh` reproduces their outputs).
    """

    # the setting that sizes each of these parameters' first dimension: what models.load_pretrained names
    # when a file's differs (GPT-2's 50,257 ids against the recipe's 50,304, another context)
    size_settings = {"wte.weight": "model.num_classes", "head.weight": "model.num_classes",
                     "wpe.weight": "model.kwargs.context"}

    def __init__(self, vocab_size: int, context: int, depth: int, num_heads: int, embed_dim: int,
                 bias: bool = True, drop: float = 0.0, gelu: str = "exact"):
        super().__init__()
        if gelu not in ("exact", "tanh"):
            raise ValueError(f"gelu={gelu!r}: give exact or tanh")
        # model.kwargs come from YAML as given: a float (4.0) fails in the first forward, a string bias ("false")
        # is truthy, a size below 1 is a torch error here or (depth) a model with no block at all
        sizes = dict(context=context, depth=depth, num_heads=num_heads, embed_dim=embed_dim)
        bad = [f"{k}={v!r}" for k, v in sizes.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1]
        if bad:
            raise ValueError(f"{', '.join(bad)}: give whole numbers >= 1")
        if not isinstance(bias, bool):
            raise ValueError(f"bias={bias!r}: give true or false")
        self.vocab_size, self.context = vocab_size, context
        self.wte = nn.Embedding(vocab_size, embed_dim)
        self.wpe = nn.Embedding(context, embed_dim)
        self.drop = nn.Dropout(drop)
        self.blocks = nn.ModuleList(Block(embed_dim, num_heads, bias, drop, gelu) for _ in range(depth))
        self.norm = nn.LayerNorm(embed_dim, bias=bias)
        self.head = nn.Linear(embed_dim, vocab_size, bias=False)
        self.head.weight = self.wte.weight  # tied, as in GPT-2
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith(("attn.proj.weight", "mlp.fc2.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * depth))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def example_input(self) -> torch.Tensor:
        """A (1, context) batch of token ids on the meta device: what CD's forward check runs on."""
        return torch.zeros(1, self.context, dtype=torch.long, device="meta")

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.context:
            raise ValueError(f"a sequence of {t} tokens is longer than the model's context of {self.context}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_gpt(name: str, vocab_size: int, drop: float = 0.0, **overrides) -> GPT:
    """A GPT of a named size (`GPT_SIZES`), with constructor overrides (depth=..., context=...)."""
    return GPT(vocab_size=vocab_size, drop=drop, **{**GPT_SIZES[name], **overrides})


# nanoGPT / transformers names -> ours (the same tensors); transformers' Conv1D keeps weights (in, out).
_RENAMES = [(r"^(?:transformer\.)?h\.(\d+)\.ln_1\.", r"blocks.\1.norm1."),
            (r"^(?:transformer\.)?h\.(\d+)\.ln_2\.", r"blocks.\1.norm2."),
            (r"^(?:transformer\.)?h\.(\d+)\.attn\.c_attn\.", r"blocks.\1.attn.qkv."),
            (r"^(?:transformer\.)?h\.(\d+)\.attn\.c_proj\.", r"blocks.\1.attn.proj."),
            (r"^(?:transformer\.)?h\.(\d+)\.mlp\.c_fc\.", r"blocks.\1.mlp.fc1."),
            (r"^(?:transformer\.)?h\.(\d+)\.mlp\.c_proj\.", r"blocks.\1.mlp.fc2."),
            (r"^(?:transformer\.)?ln_f\.", "norm."),
            (r"^(?:transformer\.)?wte\.", "wte."),
            (r"^(?:transformer\.)?wpe\.", "wpe."),
            (r"^lm_head\.", "head.")]
_CONV1D = re.compile(r"\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$")
_SKIP = re.compile(r"\.attn\.(bias|masked_bias)$")  # causal-mask buffers of older checkpoints


def checkpoint_filter_fn(state_dict: dict, model: GPT) -> dict:
    """Map a nanoGPT or transformers GPT-2 state dict onto `GPT`'s names (ours keep theirs), with both names of
    the tied token embedding / LM head.

    transformers' GPT2LMHeadModel stores its four projections as Conv1D, weight (in, out): they are
    transposed to nn.Linear's (out, in). Which layout a file has is read off the qkv weight's shape
    (nanoGPT: (3C, C); transformers: (C, 3C)), so no flag is needed. nanoGPT's `_orig_mod.` prefixes
    (torch.compile) are stripped by the caller.
    """
    foreign = any(k.startswith(("transformer.", "h.", "lm_head.")) for k in state_dict)
    out = _renamed(state_dict) if foreign else dict(state_dict)
    # tied: files may store only one of the two, whichever name the writer kept (nanoGPT: both; safetensors'
    # save_model: head.weight alone); without either, the missing keys are named. A file without a position
    # embedding is no GPT's: its head.weight (a ViT's classifier) is not taken for a token embedding
    if "wte.weight" in out:
        out.setdefault("head.weight", out["wte.weight"])
    elif "head.weight" in out and "wpe.weight" in out:
        out["wte.weight"] = out["head.weight"]
    return out


def _renamed(state_dict: dict) -> dict:
    """A nanoGPT or transformers GPT-2 state dict under our names, Conv1D weights transposed."""
    conv1d = conv1d_layout(state_dict)
    out = {}
    for key, value in state_dict.items():
        if _SKIP.search(key):
            continue
        if conv1d and _CONV1D.search(key):
            value = value.t().contiguous()
        for pattern, repl in _RENAMES:
            key, hits = re.subn(pattern, repl, key)
            if hits:
                break
        out[key] = value
    return out


def conv1d_layout(state_dict: dict) -> bool:
    """Whether `state_dict` is in transformers' GPT-2 layout: Conv1D weights stored (in, out), read off the qkv
    weight's shape (nanoGPT's nn.Linear: (3C, C); transformers': (C, 3C))."""
    qkv = next((v for k, v in state_dict.items() if k.endswith("attn.c_attn.weight")), None)
    return qkv is not None and qkv.dim() == 2 and qkv.shape[1] == 3 * qkv.shape[0]


def _same(value):
    return value


def _gelu(model: GPT) -> str:
    """The GELU of `model`'s MLPs as model.kwargs.gelu names it."""
    return "tanh" if model.blocks[0].mlp.act.approximate == "tanh" else "exact"


# the four settings nanoGPT's model_args and transformers' GPT2Config both record, under names of their own
# (rules as in NANOGPT_ARGS)
_DEPTH = ("model.kwargs.depth", _same, lambda m: len(m.blocks))
_HEADS = ("model.kwargs.num_heads", _same, lambda m: m.blocks[0].attn.num_heads)
_WIDTH = ("model.kwargs.embed_dim", _same, lambda m: m.wte.embedding_dim)
_CONTEXT = ("model.kwargs.context", _same, lambda m: m.context)

# nanoGPT's ckpt.pt records the GPTConfig it was built with (`model_args`): each one, the setting of ours that
# builds the same, the recorded value as that setting takes it, and its value in a built GPT. n_head above all:
# heads split the same weights another way
NANOGPT_ARGS = {"n_layer": _DEPTH, "n_head": _HEADS, "n_embd": _WIDTH, "block_size": _CONTEXT,
                "vocab_size": ("model.num_classes", _same, lambda m: m.vocab_size),
                "bias": ("model.kwargs.bias", _same, lambda m: m.norm.bias is not None)}

# transformers' activation_function names of the two GELUs (ACT2FN): gelu_new, gelu_pytorch_tanh and gelu_fast
# are all GPT-2's tanh approximation, gelu and gelu_python the exact erf one
TRANSFORMERS_GELU = {"gelu": "exact", "gelu_python": "exact", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh",
                     "gelu_fast": "tanh"}

# transformers' GPT2Config, as save_pretrained writes it to config.json beside the weights: the fields that decide
# what the weights compute, each with GPT2Config's default (what transformers reads for a field left out), then as
# NANOGPT_ARGS. A field of no setting (None; the file's value as the setting takes it None: an activation of
# neither GELU) is one that models/gpt.py always builds as its default: another value is no GPT it builds.
# resid/embd/attn_pdrop are training settings, and n_inner, vocab_size and tie_word_embeddings show in the shapes
GPT2_CONFIG = {"n_layer": (12, *_DEPTH), "n_head": (12, *_HEADS), "n_embd": (768, *_WIDTH),
               "n_positions": (1024, *_CONTEXT),
               "activation_function": ("gelu_new", "model.kwargs.gelu", TRANSFORMERS_GELU.get, _gelu),
               "layer_norm_epsilon": (1e-5, None, _same, lambda m: m.norm.eps),
               "scale_attn_weights": (True, None, _same, lambda m: True),
               "scale_attn_by_inverse_layer_idx": (False, None, _same, lambda m: False)}


def check_recorded_settings(entries: dict, model: GPT, state_dict: Optional[dict] = None) -> str:
    """What is wrong ('' for nothing) when the file's other entries (`entries`, models.pretrained.file_entries:
    nanoGPT's `model_args`, transformers' GPT-2 config.json beside the file) record another architecture than
    `model`: a file of n_head=4 has the shapes of a 2-head model of the same width and would load into it without a
    word, as another function; so would one of another GELU. nanoGPT's dropout is a training setting: not compared.
    Weights in transformers' layout (`state_dict`, the file's tensors: `conv1d_layout`) with no GPT-2 config.json
    beside them are transformers' GPT-2, which reads them with GPT2Config's defaults: their GELU is gelu_new (tanh),
    that of every released GPT-2; the other defaults are not compared (the sizes show in the shapes, and the head
    count of GPT-2 Medium and larger is not the default's). models.load_pretrained calls this, as it calls
    `checkpoint_filter_fn`."""
    nanogpt, config = entries.get("model_args"), entries.get("config.json")
    if isinstance(nanogpt, dict):
        recorded = {arg: (nanogpt[arg], *rule) for arg, rule in NANOGPT_ARGS.items() if arg in nanogpt}
        if problem := _differences("nanoGPT model_args record", recorded, model):
            return problem
    if isinstance(config, dict) and config.get("model_type") == "gpt2":
        recorded = {field: (config.get(field, default), *rule) for field, (default, *rule) in GPT2_CONFIG.items()}
        return _differences("config.json beside it (transformers' GPT-2) records", recorded, model)
    if state_dict is not None and conv1d_layout(state_dict):
        default, *rule = GPT2_CONFIG["activation_function"]
        return _differences("weights are in transformers' GPT-2 layout (Conv1D) with no GPT-2 config.json beside "
                            "them, which transformers reads with GPT2Config's", {"activation_function":
                                                                               (default, *rule)}, model)
    return ""


def _differences(source: str, recorded: dict, model: GPT) -> str:
    """The line naming every field of `recorded` ({field: (value, setting, as the setting takes it, built)}) whose
    value `model` was not built with, and the settings that build it ('' for none); a value no setting builds is
    named alone, as no setting fixes it."""
    fixes, found, has = [], [], []
    for field, (value, setting, ours, built) in recorded.items():
        wanted, have = ours(value), built(model)
        if wanted == have:
            continue
        if setting is None or wanted is None:
            return (f"its {source} {field}={value}, which no setting of models/gpt.py builds (its GPT has "
                    f"{have}): give weights of a GPT-2 it builds")
        found.append(f"{field}={value}")
        has.append(str(have))
        fixes.append(f"{setting}={str(wanted).lower() if isinstance(wanted, bool) else wanted}")
    if not fixes:
        return ""
    return (f"its {source} {' and '.join(found)}, the model has {' and '.join(has)}: set {' '.join(fixes)} "
            f"to load it as it was trained")

"""Layouts (`cd.Layout`) for blocks of other forms: several layouts in one block (the branches of a parallel block,
the experts of an MoE MLP), paths that start at an index (vit-pytorch's ModuleList([attention, feed-forward])), the
pre-norm kept inside the attention as `norm`, one norm before both the attention and the MLP (GPT-J's parallel
block), and a `transposed=True` that no layer reads.

The references are independent of cd/: the expected pairs are written out from the models' module names and compared
by identity, and the update is paper Eq. (12) with App. A.2's normalization, in float64."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cd import LAYOUTS, ColinearityDecay, Layout, UnsupportedModelError, find_pairs
from cd.pairs import find_blocks

D = 32


def _x() -> torch.Tensor:
    return torch.randn(2, 5, D, generator=torch.Generator().manual_seed(1))


def _scales(model: nn.Module) -> nn.Module:
    """Norm scales other than ones, so that diag(g) is not the identity."""
    torch.manual_seed(0)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1 + 0.5 * torch.randn(m.weight.shape))
    return model


def _named(model: nn.Module, items) -> list[tuple]:
    """Each parameter of `items` (tuples) by its name in `model`: compared by identity, shown by name."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [tuple(names.get(id(x), x) for x in item) for item in items]


def _eq12(w2: torch.Tensor, w1: torch.Tensor, step: float) -> torch.Tensor:
    """W2 - step * W2 W1n W1n^T, W1n = W1 / (||W1||_F / sqrt(rows W1)) (Eq. (12), App. A.2), float64."""
    w1n = w1 / (torch.linalg.matrix_norm(w1) / math.sqrt(w1.shape[0]))
    return w2 - step * w2 @ w1n @ w1n.T


def _check_one_update(model: nn.Module, layouts: list, want_w1: dict[str, object], example: torch.Tensor) -> None:
    """One ColinearityDecay.apply writes every W2 named in `want_w1` (name -> W1 as a matrix, or a norm's name for
    diag(norm.weight)) by Eq. (12), once, and nothing else."""
    lr, lam = 0.5, 0.1
    decay = ColinearityDecay(model, lam=lam, example_input=example, layouts=layouts)
    assert len(decay.pairs) == len(want_w1)
    before = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    want = {}
    for name, w1 in want_w1.items():
        w1 = torch.diag(before[w1]) if isinstance(w1, str) else w1.detach().double()
        want[name] = _eq12(before[name], w1, lr * lam)
    decay.apply(lr=lr)
    for name, p in model.named_parameters():
        got = p.detach().double()
        if name in want:
            torch.testing.assert_close(got - before[name], want[name] - before[name], rtol=1e-4, atol=1e-6, msg=name)
        else:
            assert torch.equal(got, before[name]), name


# -- several layouts in one block ------------------------------------------------------------------------------


def _branch(i: int) -> Layout:
    return Layout(f"branch {i}", norm1=f"attns.{i}.norm", norm2=f"ffns.{i}.norm", qkv=f"attns.{i}.attn.qkv",
                  proj=f"attns.{i}.attn.proj", fc1=f"ffns.{i}.mlp.fc1", fc2=f"ffns.{i}.mlp.fc2")


def _parallel() -> nn.Module:
    timm = pytest.importorskip("timm")
    return _scales(timm.create_model("vit_small_patch16_18x2_224", img_size=32, patch_size=8, embed_dim=D, depth=2,
                                     num_heads=2, num_classes=3))


def test_every_branch_of_a_parallel_block_is_paired_when_each_has_a_layout():
    """Was: of two layouts that fit timm's ParallelThingsBlock, only the first was used: branch 1 was never paired."""
    model = _parallel()
    want = []
    for b in model.blocks:
        for i in (0, 1):
            a, f = b.attns[i], b.ffns[i]
            want += [(a.attn.qkv.weight, a.norm.weight, None), (a.attn.proj.weight, a.attn.qkv.weight, (2 * D, 3 * D)),
                     (f.mlp.fc1.weight, f.norm.weight, None), (f.mlp.fc2.weight, f.mlp.fc1.weight, None)]
    pairs = find_pairs(model, torch.randn(1, 3, 32, 32), layouts=[_branch(0), _branch(1)])
    assert _named(model, [(p.downstream, p.upstream, p.upstream_rows) for p in pairs]) == _named(model, want)
    assert [name for name, _ in find_blocks(model, [_branch(0), _branch(1)])] == ["blocks.0", "blocks.1"]


def _branch1_attention_copied_from_branch0() -> Layout:
    """Branch 1's layout with its attention paths copied from branch 0's (a typo), its norms and MLP right."""
    return Layout("branch 1", norm1="attns.1.norm", norm2="ffns.1.norm", qkv="attns.0.attn.qkv",
                  proj="attns.0.attn.proj", fc1="ffns.1.mlp.fc1", fc2="ffns.1.mlp.fc2")


@pytest.mark.parametrize("layouts, part", [
    (lambda: [_branch(0)], r"attention attns.1.attn \(Attention\)"),
    (lambda: [_branch(0), _branch1_attention_copied_from_branch0()], r"attention attns.1.attn \(Attention\)"),
], ids=["branch-0-only", "branch-1-paths-copied"])
def test_a_parallel_block_whose_layouts_leave_a_branch_unpaired_is_refused(layouts, part):
    """Was: layouts=[branch 0] paired branch 0 alone, and a branch-1 layout conflicting with branch 0's (its qkv and
    proj copied from branch 0) was skipped whole, its MLP (ffns.1) left unpaired too: 8 pairs of 16, silently. Every
    attention and MLP of a matched block must be read by one of its pairs (the paper applies CD to each)."""
    model = _parallel()
    with pytest.raises(UnsupportedModelError, match=rf"block 'blocks.0' \(ParallelThingsBlock\).*reads its {part}"):
        find_pairs(model, torch.randn(1, 3, 32, 32), layouts=layouts())


def test_a_block_whose_layout_leaves_its_mlp_unpaired_is_refused():
    """A layout whose MLP paths name branch 0's MLP (paired already by branch 0's layout) leaves ffns.1 unread."""
    lay = Layout("branch 1", norm1="attns.1.norm", norm2="ffns.0.norm", qkv="attns.1.attn.qkv",
                 proj="attns.1.attn.proj", fc1="ffns.0.mlp.fc1", fc2="ffns.0.mlp.fc2")
    with pytest.raises(UnsupportedModelError, match=r"block 'blocks.0' \(ParallelThingsBlock\).*reads its MLP "
                                                    r"ffns.1.mlp \(Mlp\)"):
        find_pairs(_parallel(), torch.randn(1, 3, 32, 32), layouts=[_branch(0), lay])


def test_one_update_of_a_parallel_block_writes_each_branch_by_eq12_once():
    model = _parallel()
    want = {}
    for k in range(2):
        for i in range(2):
            a, f = f"blocks.{k}.attns.{i}", f"blocks.{k}.ffns.{i}"
            qkv = model.get_parameter(f"{a}.attn.qkv.weight")
            want.update({f"{a}.attn.qkv.weight": f"{a}.norm.weight", f"{a}.attn.proj.weight": qkv[2 * D:],
                         f"{f}.mlp.fc1.weight": f"{f}.norm.weight",
                         f"{f}.mlp.fc2.weight": model.get_parameter(f"{f}.mlp.fc1.weight")})
    _check_one_update(model, [_branch(0), _branch(1)], want, torch.randn(1, 3, 32, 32))


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (y.view(b, t, 2, -1).transpose(1, 2) for y in self.qkv(x).split(D, dim=-1))
        return self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, D))


class _MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(D, 2)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
                                     for _ in range(2))

    def forward(self, x):
        w = self.router(x).softmax(-1)
        return sum(w[..., i:i + 1] * e(x) for i, e in enumerate(self.experts))


class _MoEBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.moe = nn.LayerNorm(D), _Attention(), nn.LayerNorm(D), _MoE()

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))


def _expert(i: int) -> Layout:
    return Layout(f"expert {i}", norm1="ln1", norm2="ln2", qkv="attn.qkv", proj="attn.out",
                  fc1=f"moe.experts.{i}.0", fc2=f"moe.experts.{i}.2")


def test_each_expert_of_an_moe_block_is_paired_and_the_shared_attention_once():
    model = _scales(nn.Sequential(_MoEBlock(), _MoEBlock()))
    pairs = find_pairs(model, _x(), layouts=[_expert(0), _expert(1)])
    want = []
    for b in model:
        want += [(b.attn.qkv.weight, b.ln1.weight), (b.attn.out.weight, b.attn.qkv.weight)]
        want += [(w, u) for e in b.moe.experts for w, u in ((e[0].weight, b.ln2.weight), (e[2].weight, e[0].weight))]
    assert _named(model, [(p.downstream, p.upstream) for p in pairs]) == _named(model, want)


# -- index paths, and the pre-norm named `norm` inside the attention -------------------------------------------


class _LucidAttention(nn.Module):
    """vit-pytorch's Attention: the pre-norm is its own child (`norm_name`), the output layer a Sequential."""

    def __init__(self, norm_name: str) -> None:
        super().__init__()
        self.norm_name = norm_name
        setattr(self, norm_name, nn.LayerNorm(D))
        self.to_qkv, self.to_out = nn.Linear(D, 3 * D, bias=False), nn.Sequential(nn.Linear(D, D), nn.Dropout(0.0))

    def forward(self, x):
        b, t, _ = x.shape
        h = getattr(self, self.norm_name)(x)
        q, k, v = (y.view(b, t, 2, -1).transpose(1, 2) for y in self.to_qkv(h).chunk(3, dim=-1))
        return self.to_out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, D))


class _Lucid(nn.Module):
    """vit-pytorch's Transformer: `layers` is a ModuleList of ModuleList([attention, feed-forward])."""

    def __init__(self, depth: int, norm_name: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleList([_LucidAttention(norm_name), nn.Sequential(
            nn.LayerNorm(D), nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))]) for _ in range(depth))
        self.norm = nn.LayerNorm(D)

    def forward(self, x):
        for attn, ff in self.layers:
            x = x + attn(x)
            x = x + ff(x)
        return self.norm(x)


@pytest.mark.parametrize("norm_name", ["ln", "norm"])
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_a_layout_of_index_paths_pairs_every_block_of_a_module_list(depth, norm_name):
    """Was: with two or more blocks, the ModuleList `layers` (children '0', '1') was taken for the block and the
    paths '0.to_qkv', ... were blamed; and the attention's pre-norm named `norm` was taken for timm's
    scale_attn_norm (a norm between V and proj)."""
    model = _scales(_Lucid(depth, norm_name))
    lay = Layout("vit-pytorch", norm1=f"0.{norm_name}", qkv="0.to_qkv", proj="0.to_out.0", norm2="1.0", fc1="1.1",
                 fc2="1.3")
    pairs = find_pairs(model, _x(), layouts=[lay])
    want = []
    for attn, ff in model.layers:
        want += [(attn.to_qkv.weight, getattr(attn, norm_name).weight), (attn.to_out[0].weight, attn.to_qkv.weight),
                 (ff[1].weight, ff[0].weight), (ff[3].weight, ff[1].weight)]
    assert _named(model, [(p.downstream, p.upstream) for p in pairs]) == _named(model, want)
    assert [name for name, _ in find_blocks(model, [lay])] == [f"layers.{i}" for i in range(depth)]


def test_a_norm_between_v_and_proj_is_still_refused():
    """timm's scale_attn_norm: the attention's `norm` is applied to its output, not the layout's norm1."""
    timm_vit = pytest.importorskip("timm.models.vision_transformer")
    block = timm_vit.Block(D, 2, scale_attn_norm=True)
    with pytest.raises(ValueError, match=r"has a norm before attn.proj \(timm scale_attn_norm"):
        find_pairs(nn.Sequential(block), _x())


# -- one norm before both the attention and the MLP -------------------------------------------------------------


class _SharedNorm(nn.Module):
    """GPT-J's parallel block: x + attn(ln(x)) + mlp(ln(x))."""

    def __init__(self) -> None:
        super().__init__()
        self.ln, self.attn = nn.LayerNorm(D), _Attention()
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x):
        h = self.ln(x)
        return x + self.attn(h) + self.mlp(h)


SHARED = Layout("gpt-j", norm1="ln", norm2="ln", qkv="attn.qkv", proj="attn.out", fc1="mlp.0", fc2="mlp.2")


def test_a_parallel_block_with_one_norm_pairs_its_scale_with_qkv_and_fc1():
    """Was: Layout(norm1="ln", norm2="ln") was refused as 'each layer has its own'."""
    model = _scales(nn.Sequential(_SharedNorm(), _SharedNorm()))
    pairs = find_pairs(model, _x(), layouts=[SHARED])
    want = []
    for b in model:
        want += [(b.attn.qkv.weight, b.ln.weight), (b.attn.out.weight, b.attn.qkv.weight),
                 (b.mlp[0].weight, b.ln.weight), (b.mlp[2].weight, b.mlp[0].weight)]
    assert _named(model, [(p.downstream, p.upstream) for p in pairs]) == _named(model, want)


def test_one_update_of_a_shared_norm_block_is_eq12_for_each_pair():
    model = _scales(nn.Sequential(_SharedNorm(), _SharedNorm()))
    want = {}
    for i, b in enumerate(model):
        want.update({f"{i}.attn.qkv.weight": f"{i}.ln.weight", f"{i}.attn.out.weight": b.attn.qkv.weight[2 * D:],
                     f"{i}.mlp.0.weight": f"{i}.ln.weight", f"{i}.mlp.2.weight": b.mlp[0].weight})
    _check_one_update(model, [SHARED], want, _x())


def test_two_layers_under_one_path_are_still_refused():
    with pytest.raises(ValueError, match=r"fields 'proj' and 'fc1' name the same path"):
        Layout("x", norm1="ln", norm2="ln", qkv="attn.qkv", proj="attn.out", fc1="attn.out", fc2="mlp.2")


# -- transposed= -----------------------------------------------------------------------------------------------


def test_a_transposed_that_no_layer_reads_is_refused_naming_the_field():
    """Was: transposed=True on a layout of nn.Linear layers (which store (out, in)) was silently ignored."""
    model = _scales(nn.Sequential(_SharedNorm()))
    lay = Layout("mine", norm1="ln", norm2="ln", qkv="attn.qkv", proj="attn.out", fc1="mlp.0", fc2="mlp.2",
                 transposed=True)
    with pytest.raises(ValueError, match=r"cd.Layout\(library='mine'\): field 'transposed' is True, but every layer "
                                         r"of its blocks tells its storage.*drop transposed=True"):
        find_pairs(model, _x(), layouts=[lay])


@pytest.mark.parametrize("name", ["timm", "GPT-2 (transformers, nanoGPT)"])
def test_a_layout_of_ones_own_under_a_built_in_name_is_refused_naming_the_fix(name):
    """Was: the built-in layouts are told apart by their names, so a layout of one's own called 'timm' had its unread
    transposed=True taken for the built-in guess and silently ignored (the same layout called 'mine' is refused)."""
    import timm

    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2,
                              num_classes=3)
    lay = Layout(name, norm1="norm1", norm2="norm2", qkv="attn.qkv", proj="attn.proj", fc1="mlp.fc1", fc2="mlp.fc2",
                 transposed=True)
    with pytest.raises(ValueError, match=r"is not the built-in layout of that name but has its name.*give yours a "
                                         r"name of its own"):
        find_pairs(model, layouts=[lay])
    assert len(find_pairs(model, layouts=[LAYOUTS[0], {**vars(LAYOUTS[1])}])) == 4  # the built-in ones, copied


def test_the_built_in_gpt2_layouts_transposed_is_no_statement_on_nanogpts_linear_layers():
    from cd.family_nanogpt import NanoGPTShaped

    assert LAYOUTS[1].transposed
    pairs = find_pairs(NanoGPTShaped())
    assert pairs and not any(p.transposed or p.upstream_transposed for p in pairs)

"""CD on a Transformer with names of its own, given as `cd.Layout` (`layouts=`).

The model below names its block's layers `ln_attn`, `attention.qkv_proj`, `attention.out`, `ln_ffn`, `ffn.up`,
`ffn.down`, none of them a built-in layout's. The references are independent of cd/: the pairs are the parameters
the model's own forward uses (compared by identity), and the update is paper Eq. (12) with App. A.2's
normalization, written here in float64.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cd
from cd import LAYOUTS, TWEO, ColinearityDecay, Layout, UnsupportedModelError, find_pairs
from cd.integrations import check_cd_arguments
from cd.pairs import find_blocks

D, HEADS, T, IN = 16, 2, 5, 6
MINE = Layout("my model", norm1="ln_attn", norm2="ln_ffn", qkv="attention.qkv_proj", proj="attention.out",
              fc1="ffn.up", fc2="ffn.down")


class Attention(nn.Module):
    """Self-attention whose fused projection holds its rows in `order` ('qkv': [Q; K; V])."""

    def __init__(self, order: str = "qkv"):
        super().__init__()
        self.order = order
        self.qkv_proj = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        parts = dict(zip(self.order, self.qkv_proj(x).split(D, dim=-1)))
        q, k, v = (parts[c].view(b, t, HEADS, D // HEADS).transpose(1, 2) for c in "qkv")
        y = F.scaled_dot_product_attention(q, k, v)
        return self.out(y.transpose(1, 2).reshape(b, t, D))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class MyBlock(nn.Module):
    def __init__(self, order: str = "qkv"):
        super().__init__()
        self.ln_attn, self.attention = nn.LayerNorm(D), Attention(order)
        self.ln_ffn, self.ffn = nn.LayerNorm(D), FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln_attn(x))
        return x + self.ffn(self.ln_ffn(x))


class MyModel(nn.Module):
    def __init__(self, depth: int = 2, order: str = "qkv"):
        super().__init__()
        self.embed = nn.Linear(IN, D)
        self.layers = nn.ModuleList(MyBlock(order) for _ in range(depth))
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x.mean(1))


def _model(**kw) -> MyModel:
    torch.manual_seed(0)
    model = MyModel(**kw)
    with torch.no_grad():  # norm scales other than ones, so that diag(g) is not the identity
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1 + 0.5 * torch.randn(D))
    return model


def _x() -> torch.Tensor:
    return torch.randn(2, T, IN, generator=torch.Generator().manual_seed(1))


def test_own_names_give_four_pairs_per_block_with_the_right_parameters():
    model = _model()
    pairs = find_pairs(model, _x(), layouts=[MINE])
    want = []
    for i, blk in enumerate(model.layers):
        want += [("qkv", "composable", blk.ln_attn.weight, blk.attention.qkv_proj.weight, None),
                 ("proj", "functional", blk.attention.qkv_proj.weight, blk.attention.out.weight, (2 * D, 3 * D)),
                 ("fc1", "composable", blk.ln_ffn.weight, blk.ffn.up.weight, None),
                 ("fc2", "functional", blk.ffn.up.weight, blk.ffn.down.weight, None)]
    assert len(pairs) == 4 * len(model.layers)
    for p, (role, kind, w1, w2, rows) in zip(pairs, want):
        assert (p.role, p.kind, p.upstream_rows, p.transposed) == (role, kind, rows, False)
        assert p.upstream is w1 and p.downstream is w2
    assert [p.block for p in pairs[::4]] == ["layers.0", "layers.1"]
    assert pairs[1].name == "layers.0.attention.out.weight"


def _eq12(w2: torch.Tensor, w1: torch.Tensor, step: float) -> torch.Tensor:
    """W2 - step * W2 W1n W1n^T, W1n = W1 / (||W1||_F / sqrt(rows W1)) (Eq. (12), App. A.2), float64."""
    w1n = w1 / (torch.linalg.matrix_norm(w1) / math.sqrt(w1.shape[0]))
    return w2 - step * w2 @ w1n @ w1n.T


def test_one_update_is_eq12_by_hand():
    model = _model()
    lr, lam = 0.5, 0.1
    decay = ColinearityDecay(model, lam=lam, example_input=_x(), layouts=[MINE])
    before = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    want = {}
    for i in range(len(model.layers)):
        b = lambda name: before[f"layers.{i}.{name}"]  # noqa: E731
        want[f"layers.{i}.attention.qkv_proj.weight"] = _eq12(b("attention.qkv_proj.weight"),
                                                              torch.diag(b("ln_attn.weight")), lr * lam)
        want[f"layers.{i}.attention.out.weight"] = _eq12(b("attention.out.weight"),
                                                         b("attention.qkv_proj.weight")[2 * D:], lr * lam)
        want[f"layers.{i}.ffn.up.weight"] = _eq12(b("ffn.up.weight"), torch.diag(b("ln_ffn.weight")), lr * lam)
        want[f"layers.{i}.ffn.down.weight"] = _eq12(b("ffn.down.weight"), b("ffn.up.weight"), lr * lam)
    decay.apply(lr=lr)
    for name, p in model.named_parameters():
        got = p.detach().double()
        if name in want:  # the update itself (new - old) to relative precision, not only the weights
            delta, want_delta = got - before[name], want[name] - before[name]
            assert want_delta.abs().max() > 1e-3, name
            torch.testing.assert_close(delta, want_delta, rtol=1e-4, atol=1e-6, msg=name)
        else:  # W1s, norms, biases, embedding and head: untouched
            assert torch.equal(got, before[name]), name


@pytest.mark.parametrize("fields, field", [
    (dict(norm1=""), "'norm1'"),
    (dict(proj="attention..out"), "'proj'"),
    (dict(fc2=None), "'fc2'"),
    (dict(qkv=None), "'qkv'"),
    (dict(qkv=None, q_k_v=("a.q", "a.k")), "'q_k_v'"),
    # q, k, v as a config file's mapping: its keys are no paths; a number is not three of them
    (dict(qkv=None, q_k_v={"q": "attention.q", "k": "attention.k", "v": "attention.v"}), "'q_k_v'"),
    (dict(q_k_v=5), "'q_k_v'"),
    (dict(fc1=None), "'fc1'"),
    # the optional paths are checked as the required ones when given
    (dict(fc1=""), "'fc1'"),
    (dict(qkv="attention. qkv_proj"), "'qkv'"),
    (dict(fc1=None, gate="ffn.gate", up=5), "'up'"),
    (dict(gate="ffn.gate"), "'gate' and 'up'"),
    (dict(fc1="attention.out"), "'proj' and 'fc1'"),
    (dict(library=""), "'library'"),
    (dict(transposed="no"), "'transposed'"),
    (dict(transposed=1), "'transposed'"),  # 1 == True, but not a bool
    (dict(proj="attention.out\n"), "'proj'"),  # white space around a name (a YAML block's newline)
    (dict(fc2="ffn.do wn"), "'fc2'"),
    (dict(qkv=None, q_k_v=("attention.q", "attention.k", "attention.q")), r"'q_k_v\[0\]' and 'q_k_v\[2\]'"),
])
def test_a_bad_layout_is_refused_naming_the_field(fields, field):
    good = dict(library="mine", norm1="ln_attn", norm2="ln_ffn", qkv="attention.qkv_proj", proj="attention.out",
                fc1="ffn.up", fc2="ffn.down")
    with pytest.raises(ValueError, match=f"cd.Layout.*{field}"):
        Layout(**{**good, **fields})


@pytest.mark.parametrize("layouts, error, match", [
    (MINE, TypeError, "sequence of cd.Layout"),  # one Layout, not in a list
    ("ln_attn", TypeError, "sequence of cd.Layout"),
    ([], ValueError, "layouts is empty"),
    ([MINE, "timm"], TypeError, r"layouts\[1\]"),
    ([{"library": "x", "norm1": "a", "norm2": "b", "proj": "c.p", "fc2": "d.f", "qkv_proj": "c.q"}], ValueError,
     r"unknown \['qkv_proj'\]"),
    ([{"library": "x", "norm1": "a", "norm2": "b", "proj": "c.p", "qkv": "c.q", "fc1": "d.e"}], ValueError,
     r"missing \['fc2'\]"),
    ({"library": "x", "norm1": "a", "norm2": "b", "proj": "c.p", "fc2": "d.f", "qkv": "c.q", "fc1": "d.e"},
     TypeError, "sequence of cd.Layout"),  # one layout's mapping, not in a list
])
def test_a_bad_layouts_argument_is_refused_before_any_work(layouts, error, match):
    model = _model()
    for call in (lambda: find_pairs(model, _x(), layouts=layouts), lambda: find_blocks(model, layouts),
                 lambda: ColinearityDecay(model, example_input=_x(), layouts=layouts),
                 lambda: TWEO(model, layouts=layouts), lambda: check_cd_arguments({"layouts": layouts})):
        with pytest.raises(error, match=match):
            call()


def test_a_layout_matching_no_block_names_the_layouts_tried():
    other = Layout("other lib", norm1="pre", norm2="post", qkv="mix.qkv", proj="mix.o", fc1="mlp.a", fc2="mlp.b")
    with pytest.raises(UnsupportedModelError, match=r"no matrix pair found in MyModel with the layouts given.*"
                                                    r"'other lib' \(children pre, mix, post, mlp\)"):
        find_pairs(_model(), _x(), layouts=[other])
    # the built-in layouts are not tried when layouts are given: a timm-named block is not found under `MINE` alone
    timm = pytest.importorskip("timm")
    vit = timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=8, embed_dim=D, depth=1, num_heads=2)
    with pytest.raises(UnsupportedModelError, match=r"'my model' \(children ln_attn, attention, ln_ffn, ffn\)"):
        find_pairs(vit, layouts=[MINE])
    assert len(find_pairs(vit, layouts=[MINE, *LAYOUTS])) == 4
    with pytest.raises(ValueError, match=r"TWEO: no pre-norm Transformer block \(of the layouts given: 'other lib' "
                                         r"\(children pre, mix, post, mlp\)\)"):
        TWEO(_model(), layouts=[other])


def test_without_layouts_a_model_of_its_own_names_is_told_about_the_argument():
    with pytest.raises(UnsupportedModelError, match=r"no matrix pair found in MyModel\. .*layouts=\[cd\.Layout"):
        find_pairs(_model(), _x())
    with pytest.raises(ValueError, match=r"TWEO: no pre-norm Transformer block .*layouts=\[cd\.Layout"):
        TWEO(_model())


def test_v_rows_out_of_order_are_refused_by_the_v_row_check():
    model = _model(order="vqk")  # the fused projection's rows are [V; Q; K]: rows 2D:3D are K, not V
    with pytest.raises(UnsupportedModelError, match=r"block 'layers.0' \(MyBlock\).*is not zero.*laid out otherwise"):
        find_pairs(model, _x(), layouts=[MINE])
    assert len(find_pairs(model, layouts=[MINE], verify=False)) == 8  # the structure alone cannot tell


def test_the_meta_forward_check_runs_on_a_given_layout():
    # a layout that swaps the norms: ln_ffn does not feed qkv_proj, which the meta forward tells
    swapped = Layout("swapped", norm1="ln_ffn", norm2="ln_attn", qkv="attention.qkv_proj", proj="attention.out",
                     fc1="ffn.up", fc2="ffn.down")
    with pytest.raises(UnsupportedModelError, match="layers.0"):
        find_pairs(_model(), _x(), layouts=[swapped])


def test_tweo_hooks_the_blocks_of_a_given_layout():
    model = _model()
    tweo = TWEO(model, lam=1.0, layouts=[MINE])
    assert [(n, b) for n, b in tweo.blocks] == [(f"layers.{i}", blk) for i, blk in enumerate(model.layers)]
    outs = []
    hooks = [blk.register_forward_hook(lambda m, a, o: outs.append(o.detach().double())) for blk in model.layers]
    loss = model(_x()).sum()
    for h in hooks:
        h.remove()
    want = sum(((a.abs() / (3.0 + 1e-6)) ** 4).mean() for a in outs) / len(outs)  # App. A.3, p=4, tau=3
    torch.testing.assert_close(tweo.aux_loss(loss).double(), want, rtol=1e-5, atol=0)
    tweo.remove()


def test_builtin_layouts_are_the_default():
    timm = pytest.importorskip("timm")
    vit = timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=8, embed_dim=D, depth=2, num_heads=2)
    default, given = find_pairs(vit), find_pairs(vit, layouts=LAYOUTS)
    assert [(p.name, p.role, p.upstream_name) for p in default] == [(p.name, p.role, p.upstream_name) for p in given]
    assert [p.name for p in default[:4]] == [f"blocks.0.{n}.weight" for n in ("attn.qkv", "attn.proj", "mlp.fc1",
                                                                               "mlp.fc2")]
    assert cd.LAYOUTS is LAYOUTS and LAYOUTS[0].library == "timm"


def test_integrations_take_layouts_from_a_config_file_as_mappings():
    as_config = dict(library="my model", norm1="ln_attn", norm2="ln_ffn", qkv="attention.qkv_proj",
                     proj="attention.out", fc1="ffn.up", fc2="ffn.down")
    kwargs = check_cd_arguments({"lam": 0.01, "layouts": [as_config]})
    assert kwargs["layouts"] == (MINE,)
    decay = ColinearityDecay(_model(), example_input=_x(), **kwargs)
    assert len(decay.pairs) == 8


def test_a_path_of_a_given_layout_missing_in_the_block_is_named():
    typo = Layout("typo", norm1="ln_attn", norm2="ln_ffn", qkv="attention.qkv", proj="attention.out", fc1="ffn.up",
                  fc2="ffn.down")
    with pytest.raises(UnsupportedModelError, match=r"'layers.0' \(MyBlock\).*found no attention.qkv .*layout 'typo' "
                                                    r"given as layouts="):
        find_pairs(_model(), _x(), layouts=[typo])


def test_the_readme_example_runs_as_written(capsys):
    text = (Path(__file__).resolve().parents[1] / "cd" / "README.md").read_text()
    section = text[text.index("### Blocks with names of your own"):]
    code = section[section.index("```python\n") + len("```python\n"):]
    scope: dict = {}
    exec(compile(code[:code.index("```")], "cd/README.md", "exec"), scope)
    assert len(scope["pairs"]) == 8 and scope["decay"].num_updates == 1
    assert "0.attention.out.weight" in capsys.readouterr().out


def test_the_tweo_hook_checks_its_layouts_when_it_is_made():
    pytest.importorskip("mmengine")
    from cd.integrations.mmengine import TweoHook
    as_config = dict(library="my model", norm1="ln_attn", norm2="ln_ffn", qkv="attention.qkv_proj",
                     proj="attention.out", fc1="ffn.up", fc2="ffn.down")
    assert TweoHook(layouts=[as_config]).kwargs["layouts"] == (MINE,)
    with pytest.raises(ValueError, match=r"cd.Layout.*'fc1'"):
        TweoHook(layouts=[{**as_config, "fc1": None}])


def test_a_no_pair_message_never_asks_for_built_in_layouts_already_given():
    # the built-in layouts as a list (a copy, or read from a config) are the default, and say so
    with pytest.raises(UnsupportedModelError, match=r"no matrix pair found in MyModel\. .*layouts=\[cd\.Layout"):
        find_pairs(_model(), _x(), layouts=list(LAYOUTS))
    with pytest.raises(ValueError, match=r"TWEO: no pre-norm Transformer block .*layouts=\[cd\.Layout"):
        TWEO(_model(), layouts=list(LAYOUTS))
    other = Layout("other lib", norm1="pre", norm2="post", qkv="mix.qkv", proj="mix.o", fc1="mlp.a", fc2="mlp.b")
    with pytest.raises(UnsupportedModelError, match="'other lib'") as given_with_built_ins:
        find_pairs(_model(), _x(), layouts=[other, *LAYOUTS])
    assert "add the built-in layouts" not in str(given_with_built_ins.value)
    with pytest.raises(UnsupportedModelError, match="add the built-in layouts"):
        find_pairs(_model(), _x(), layouts=[other])


def test_a_config_files_list_of_q_k_v_paths_makes_the_same_layout_as_a_tuple():
    # YAML and JSON give a list: the Layout made from it equals (and hashes as) the one written with a tuple, and its
    # q, k, v paths take part in the check that no two layers share a path
    fields = dict(library="sep", norm1="n1", norm2="n2", proj="a.o", fc1="m.u", fc2="m.d")
    as_config = {**fields, "q_k_v": ["a.q", "a.k", "a.v"]}
    layout = check_cd_arguments({"layouts": [as_config]})["layouts"][0]
    want = Layout(**fields, q_k_v=("a.q", "a.k", "a.v"))
    assert layout == want and hash(layout) == hash(want)
    with pytest.raises(ValueError, match=r"'proj' and 'q_k_v\[2\]'"):
        check_cd_arguments({"layouts": [{**as_config, "q_k_v": ["a.q", "a.k", "a.o"]}]})


class TimmNamedSwappedNorms(nn.Module):
    """A block with timm's children whose `norm2` is the norm before the attention and `norm1` the one before the
    MLP: under timm's layout its qkv would pair with the wrong norm."""

    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn, self.mlp = nn.Module(), nn.Module()
        self.attn.qkv, self.attn.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.mlp.fc1, self.mlp.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (u.view(b, t, HEADS, D // HEADS).transpose(1, 2) for u in self.attn.qkv(self.norm2(x)).split(D, -1))
        x = x + self.attn.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, D))
        return x + self.mlp.fc2(F.gelu(self.mlp.fc1(self.norm1(x))))


def test_the_layouts_are_tried_in_the_order_given():
    # the block has timm's children, so both `swapped` and the built-in timm layout fit it: the first in the list
    # is used. The reference is the block's own forward: norm2 feeds qkv, norm1 feeds fc1.
    swapped = Layout("swapped norms", norm1="norm2", norm2="norm1", qkv="attn.qkv", proj="attn.proj",
                     fc1="mlp.fc1", fc2="mlp.fc2")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, D), TimmNamedSwappedNorms())
    blk = model[1]
    pairs = find_pairs(model, _x(), layouts=[swapped, *LAYOUTS])
    assert [(p.role, p.upstream) for p in pairs if p.kind == "composable"] == [("qkv", blk.norm2.weight),
                                                                               ("fc1", blk.norm1.weight)]
    with pytest.raises(UnsupportedModelError, match=r"block '1' \(TimmNamedSwappedNorms\)"):
        find_pairs(model, _x(), layouts=[*LAYOUTS, swapped])  # timm's layout first: norm1 does not feed qkv


def test_a_missing_layer_of_a_builtin_layout_is_not_blamed_on_layouts_given():
    # a timm-named block with an nn.MultiheadAttention (read as timm's layout with the attention's own qkv and
    # out_proj) whose MLP lacks fc2: the message names timm's layout, not one given as layouts=, which there is not
    block = nn.Module()
    block.norm1, block.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
    block.attn = nn.MultiheadAttention(D, HEADS, batch_first=True)
    block.mlp = nn.Module()
    block.mlp.fc1, block.mlp.out = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
    with pytest.raises(UnsupportedModelError, match=r"found no mlp\.fc2 .*the timm block layout") as refusal:
        find_pairs(nn.Sequential(block), verify=False)
    assert "given as layouts=" not in str(refusal.value)


class InOut(nn.Module):
    """A layer of no known type holding its weight (in, out) and computing x @ W + b, as transformers' Conv1D
    does but without its `nf`: neither its type nor, when square, its shape tells its storage."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) / math.sqrt(n_in))
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.bias


class InOutBlock(nn.Module):
    """Separate q, k, v, an output layer and a width-D MLP, all square InOut layers."""

    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn, self.mlp = nn.Module(), nn.Module()
        self.attn.q, self.attn.k, self.attn.v, self.attn.o = (InOut(D, D) for _ in range(4))
        self.mlp.a, self.mlp.b = InOut(D, D), InOut(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.ln1(x)
        q, k, v = (m(h).view(b, t, HEADS, D // HEADS).transpose(1, 2)
                   for m in (self.attn.q, self.attn.k, self.attn.v))
        x = x + self.attn.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, D))
        return x + self.mlp.b(F.gelu(self.mlp.a(self.ln2(x))))


IN_OUT = Layout("in-out layers", norm1="ln1", norm2="ln2", q_k_v=("attn.q", "attn.k", "attn.v"),
                proj="attn.o", fc1="mlp.a", fc2="mlp.b", transposed=True)


def test_a_layouts_transposed_storage_is_used_where_no_layer_tells_its_own():
    # Every layer is square and of a type cd does not know, so only the layout's `transposed=True` tells the
    # storage, for the composable pairs and for the functional ones (proj, fc2) alike. The reference is each
    # layer's own forward: the (out, in) matrix it applies is layer(I) - layer(0) transposed, which is the
    # stored weight transposed.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, D), InOutBlock())
    blk = model[1]

    def applied(layer: InOut) -> torch.Tensor:
        with torch.no_grad():
            return (layer(torch.eye(D)) - layer(torch.zeros(D))).T

    pairs = find_pairs(model, _x(), layouts=[IN_OUT])
    a = blk.attn
    want = [("qkv", blk.ln1.weight, a.q), ("qkv", blk.ln1.weight, a.k), ("qkv", blk.ln1.weight, a.v),
            ("proj", a.v, a.o), ("fc1", blk.ln2.weight, blk.mlp.a), ("fc2", blk.mlp.a, blk.mlp.b)]
    assert [(p.role, p.transposed) for p in pairs] == [(role, True) for role, _, _ in want]
    for p, (role, up, down) in zip(pairs, want):
        assert p.downstream is down.weight
        torch.testing.assert_close(p.w2(), applied(down), rtol=0, atol=1e-6, msg=role)
        if isinstance(up, InOut):  # functional: W1 as its layer applies it too
            assert p.upstream is up.weight
            torch.testing.assert_close(p.w1(), applied(up), rtol=0, atol=1e-6, msg=role)
        else:
            assert p.w1() is up


class SquareOutBlock(nn.Module):
    """nn.Linear qkv and MLP, with a square output projection stored (in, out) and applied as `o @ W`: an InOut
    layer (`attn.out`) or a matrix Parameter the attention holds itself (`attn.wo`)."""

    def __init__(self, proj: str):
        super().__init__()
        self.ln1, self.ln2, self.attn = nn.LayerNorm(D), nn.LayerNorm(D), nn.Module()
        self.attn.qkv, self.up, self.down = nn.Linear(D, 3 * D), nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        if proj == "out":
            self.attn.out = InOut(D, D)
        else:
            self.attn.wo = nn.Parameter(torch.randn(D, D) / math.sqrt(D))
        with torch.no_grad():  # norm scales other than ones
            self.ln1.weight.copy_(1 + 0.5 * torch.randn(D))

    def project(self, o: torch.Tensor) -> torch.Tensor:
        return self.attn.out(o) if hasattr(self.attn, "out") else o @ self.attn.wo

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (y.view(b, t, HEADS, -1).transpose(1, 2) for y in self.attn.qkv(self.ln1(x)).split(D, -1))
        x = x + self.project(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, D))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


def _square_out(proj: str, transposed: bool) -> tuple[nn.Module, Layout]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, D), SquareOutBlock(proj)).double()
    return model, Layout("square out", norm1="ln1", norm2="ln2", qkv="attn.qkv", proj=f"attn.{proj}", fc1="up",
                         fc2="down", transposed=transposed)


@pytest.mark.parametrize("proj", ["out", "wo"])
def test_a_square_in_out_proj_beside_a_linear_qkv_gets_eq12_with_the_layouts_transposed(proj):
    # The proj's own type and shape do not tell its storage; its partner's (nn.Linear qkv, (out, in)) is not its
    # storage: the layout's transposed=True is. Reference: W2 is the matrix the block applies (probed through its
    # own forward), W1 the V rows of qkv, Eq. (12) with App. A.2's normalization in float64.
    model, layout = _square_out(proj, transposed=True)
    blk = model[1]

    def applied() -> torch.Tensor:
        with torch.no_grad():
            eye = torch.eye(D, dtype=torch.float64)
            return (blk.project(eye) - blk.project(torch.zeros_like(eye))).T

    x = _x().double()
    pair = next(p for p in find_pairs(model, x, layouts=[layout]) if p.role == "proj")
    assert (pair.transposed, pair.upstream_transposed) == (True, False)
    w2, v = applied(), blk.attn.qkv.weight.detach()[2 * D:].clone()
    v_n = v / (torch.linalg.matrix_norm(v) / math.sqrt(D))
    lr, lam = 0.1, 0.5
    want = w2 - lr * lam * w2 @ v_n @ v_n.T
    ColinearityDecay(model, lam=lam, example_input=x, layouts=[layout]).apply(lr)
    torch.testing.assert_close(applied(), want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("proj", ["out", "wo"])
def test_a_square_in_out_proj_read_as_out_in_is_refused_with_the_fix(proj):
    # Without transposed=True the proj is read (out, in): CD would decay the transpose of the matrix the block
    # applies, so the meta check, which sees the forward multiply it as x @ W, refuses it.
    model, layout = _square_out(proj, transposed=False)
    name = "1.attn.out.weight" if proj == "out" else "1.attn.wo"
    with pytest.raises(UnsupportedModelError, match=rf"block '1'.*the proj pair: the forward multiplies "
                                                    rf"{re.escape(name)} as x @ W.*transposed=True"):
        ColinearityDecay(model, lam=0.5, example_input=_x().double(), layouts=[layout])

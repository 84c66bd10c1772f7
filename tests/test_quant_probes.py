"""Activation probes: module / block maxima equal a direct computation; hooks are removed;
files are written."""
import csv
import io

import pytest
import torch
from timm.layers import DropPath

from engine.act_max_files import csv_bytes, plot_bytes
from engine.act_max import ActivationProbe
from quant_models import images, tiny_swin, tiny_vit


def direct_vit_maxima(model, x):
    """Independent computation: run the ViT blocks by hand and collect every module output."""
    modules, blocks = [], []
    h = model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(x))))
    for blk in model.blocks:
        n1 = blk.norm1(h)
        attn = blk.attn(n1)  # = attn.proj output (proj_drop is identity in eval)
        h = h + blk.ls1(attn)
        n2 = blk.norm2(h)
        fc1 = blk.mlp.fc1(n2)
        act = blk.mlp.act(fc1)
        fc2 = blk.mlp.fc2(act)
        h = h + blk.ls2(fc2)
        modules += [n1, blk.attn.qkv(n1), attn, n2, fc1, act, fc2]
        blocks.append(h)
    return max(t.abs().max().item() for t in modules), max(t.abs().max().item() for t in blocks)


def test_vit_maxima_match_direct_computation_over_batches():
    model = tiny_vit()
    batches = [images(4, seed=1), images(4, seed=2) * 3]
    with torch.no_grad():
        want = [direct_vit_maxima(model, x) for x in batches]
        with ActivationProbe(model) as probe:
            for x in batches:
                model(x)
    got = probe.result()
    assert got.module == pytest.approx(max(w[0] for w in want), rel=1e-6)
    assert got.block == pytest.approx(max(w[1] for w in want), rel=1e-6)
    types = {r["type"] for r in got.per_layer}
    assert types == {"block", "norm1", "attn", "attn.qkv", "attn.proj",
                     "norm2", "mlp", "mlp.fc1", "mlp.act", "mlp.fc2"}
    assert got.metrics() == {"act/max_module": got.module, "act/max_block": got.block}


def test_hooks_removed_and_model_untouched():
    model = tiny_vit()
    x = images(2)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        ref = model(x)
        with ActivationProbe(model) as probe:
            assert sum(len(m._forward_hooks) for m in model.modules()) == len(probe.targets)
            out = model(x)
    assert torch.equal(out, ref)
    assert all(len(m._forward_hooks) == 0 for m in model.modules())
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_swin_blocks_and_reduce_fn():
    model = tiny_swin()
    seen = []

    def fake_all_reduce_max(t):
        seen.append(t.shape)
        return torch.maximum(t, torch.full_like(t, 0.5))  # as if another rank saw 0.5 everywhere

    with torch.no_grad(), ActivationProbe(model, extra_modules=("layers.*.downsample.reduction",)) as probe:
        model(images(2))
    result = probe.result(reduce_fn=fake_all_reduce_max)
    # the maxima, the seen flags and the flags of an input not finite, in one collective
    assert seen == [(3, len(probe.targets))]
    blocks = [r for r in result.per_layer if r["kind"] == "block"]
    assert [r["name"] for r in blocks] == ["layers.0.blocks.0", "layers.0.blocks.1", "layers.1.blocks.0",
                                          "layers.1.blocks.1"]
    assert any(r["name"] == "layers.1.downsample.reduction" for r in result.per_layer)
    assert all(r["max"] >= 0.5 for r in result.per_layer)
    rows = list(csv.DictReader(io.StringIO(csv_bytes(result.per_layer).decode())))
    assert len(rows) == len(result.per_layer) and rows[0]["type"] == "block"
    assert plot_bytes(result.per_layer, "png", title="swin").startswith(b"\x89PNG")


def test_probe_without_data_and_wrapped_model():
    model = tiny_vit()
    probe = ActivationProbe(model)
    assert (probe.result().module, probe.result().per_layer) == (0.0, [])  # no output measured: no record
    with pytest.raises(ValueError, match="unwrapped"):
        ActivationProbe(torch.nn.Sequential(model))


def test_stop_signals_are_held_while_the_plot_imports_matplotlib():
    """A Ctrl-C inside matplotlib's C-extension initialisation can abort Python; the plot imports it with
    SIGINT / SIGTERM blocked (a fresh process, so that matplotlib is really imported there)."""
    import subprocess
    import sys
    from pathlib import Path

    script = """
import importlib.abc, signal, sys
masks = []
class Spy(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "matplotlib.figure":
            masks.append(signal.pthread_sigmask(signal.SIG_BLOCK, []))
        return None
sys.meta_path.insert(0, Spy())
from engine.act_max_files import plot_bytes
plot_bytes([{"name": "b", "kind": "block", "block": 0, "type": "block", "max": 2.0}])
assert masks and {signal.SIGINT, signal.SIGTERM} <= masks[0], masks
assert not signal.pthread_sigmask(signal.SIG_BLOCK, []) & {signal.SIGINT, signal.SIGTERM}
print("ok")
"""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "ok", done.stderr[-2000:]


def test_only_engine_figures_imports_matplotlib():
    """Every plot starts its figure with engine.figures.new_figure, so every one gets the signal hold of the
    test above (a plot that imported matplotlib itself would not)."""
    import ast
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    listed = subprocess.run(["git", "ls-files", "-z", "*.py"], cwd=root, check=True, capture_output=True).stdout
    importers = []
    for name in filter(None, listed.decode().split("\0")):  # the repository's files, not venvs or data
        if name.startswith("tests/"):
            continue
        text = (root / name).read_text()
        if "matplotlib" not in text:  # cannot import it (parsing all 3.8 MB of sources took seconds)
            continue
        for node in ast.walk(ast.parse(text)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "matplotlib" or n.startswith("matplotlib.") for n in names):
                importers.append(name)
    assert sorted(set(importers)) == ["engine/figures.py"], importers


def test_kurtosis_metrics_skip_outputs_without_a_kurtosis():
    """A constant output has no kurtosis (NaN); the largest kurtosis reported is the largest of the others,
    wherever the NaN sits in the list."""
    from engine.act_max import ActMaxResult

    nan = float("nan")
    records = [{"kind": "module", "kurtosis": nan, "max": 1.0}, {"kind": "module", "kurtosis": 4.0, "max": 1.0},
               {"kind": "block", "kurtosis": 3.5, "max": 2.0}, {"kind": "block", "kurtosis": nan, "max": 2.0}]
    metrics = ActMaxResult(module=1.0, block=2.0, per_layer=records).metrics()
    assert metrics == {"act/max_module": 1.0, "act/max_block": 2.0, "act/kurtosis_module": 4.0,
                       "act/kurtosis_block": 3.5}


class OneBlockNet(torch.nn.Module):
    """A model whose only block is `block` (the probe finds blocks under `blocks`)."""

    def __init__(self, block):
        super().__init__()
        self.blocks = torch.nn.ModuleList([block])

    def forward(self, x):
        return self.blocks[0](x)


class Split(torch.nn.Module):
    """A module returning a tuple of two tensors (an attention returning its weights too)."""

    def forward(self, x):
        return x * 3, -x * 5


class SplitBlock(torch.nn.Module):
    """A block holding a tuple-output module: its output is the sum of the two."""

    def __init__(self):
        super().__init__()
        self.split = Split()

    def forward(self, x):
        a, b = self.split(x)
        return a + b


def test_module_maxima_cover_every_tensor_of_a_tuple_output():
    """A module inside a block that returns a tuple (an attention returning its weights too): each tensor
    of it counts toward the module maximum."""
    model = OneBlockNet(SplitBlock())
    with torch.no_grad(), ActivationProbe(model) as probe:
        model(torch.tensor([[1.0, -2.0]]))
    got = probe.result()
    assert (got.module, got.block) == (10.0, 4.0)  # max(|3x|, |-5x|) = 10; |3x - 5x| = |-2x| <= 4


def test_moments_of_a_tuple_output_cover_every_tensor_of_it():
    """With moments (as train.py and evaluate.py probe), the kurtosis of a tuple-output module is that of all its
    tensors' elements together: summing the first tensor's moments alone passed the maxima test above. The
    reference: the float64 central moments of cat(3x, -5x)."""
    model = OneBlockNet(SplitBlock())
    x = torch.tensor([[1.0, -2.0, 0.5, 4.0]])
    with torch.no_grad(), ActivationProbe(model, moments=True) as probe:
        model(x)
    record = {r["name"]: r for r in probe.result().per_layer}["blocks.0.split"]
    both = torch.cat([3 * x, -5 * x]).double().flatten()
    centred = both - both.mean()
    want = ((centred ** 4).mean() / (centred ** 2).mean() ** 2).item()
    assert record["max"] == 20.0  # |-5 * 4|
    assert record["kurtosis"] == pytest.approx(want, rel=1e-12)
    first_only = 3 * x.double().flatten() - 3 * x.double().mean()
    assert abs(want - ((first_only ** 4).mean() / (first_only ** 2).mean() ** 2).item()) > 0.5  # tells them apart


RECORDS = [  # as ActivationProbe.result().per_layer lays them out; block -1: a module outside the blocks
    {"name": "blocks.1", "kind": "block", "block": 1, "type": "block", "max": 8.0, "kurtosis": 3.5},
    {"name": "blocks.0.mlp.fc2", "kind": "module", "block": 0, "type": "mlp.fc2", "max": 2.0, "kurtosis": 1.0},
    {"name": "blocks.0", "kind": "block", "block": 0, "type": "block", "max": 4.0, "kurtosis": 2.5},
    {"name": "head", "kind": "module", "block": -1, "type": "head", "max": 9.0, "kurtosis": 0.5},
]


def test_max_by_type_groups_by_module_type_in_block_order_without_outside_modules():
    from engine.act_max_files import max_by_type
    assert max_by_type(RECORDS) == {"block": [(0, 4.0), (1, 8.0)], "mlp.fc2": [(0, 2.0)]}


def test_csv_holds_every_record_and_the_kurtosis_column_when_measured():
    assert csv_bytes(RECORDS).decode().splitlines() == [
        "name,kind,block,type,max,kurtosis", "blocks.1,block,1,block,8.0,3.5",
        "blocks.0.mlp.fc2,module,0,mlp.fc2,2.0,1.0",
        "blocks.0,block,0,block,4.0,2.5", "head,module,-1,head,9.0,0.5"]
    plain = [{k: v for k, v in r.items() if k != "kurtosis"} for r in RECORDS[:1]]
    assert csv_bytes(plain).decode().splitlines() == [
        "name,kind,block,type,max", "blocks.1,block,1,block,8.0"]


def test_a_figure_is_its_size_in_inches_on_the_agg_canvas(tmp_path):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from PIL import Image

    from engine.figures import new_figure
    fig = new_figure(7, 4)
    assert tuple(fig.get_size_inches()) == (7.0, 4.0) and isinstance(fig.canvas, FigureCanvasAgg)
    fig.savefig(tmp_path / "f.png", dpi=10)
    assert Image.open(tmp_path / "f.png").size == (70, 40)
    # without a dpi, savefig draws at matplotlib's figure.dpi setting (100 unless a matplotlibrc says otherwise)
    import matplotlib
    fig.savefig(tmp_path / "d.png")
    dpi = matplotlib.rcParams["figure.dpi"]
    assert Image.open(tmp_path / "d.png").size == (round(7 * dpi), round(4 * dpi))
    new_figure(2.5, 1.5).savefig(tmp_path / "h.png", dpi=10)  # fractional inches (mechanism.py: 8 x 3.4)
    assert Image.open(tmp_path / "h.png").size == (25, 15)
    assert Image.open(io.BytesIO(plot_bytes(RECORDS))).size == tuple(int(v * fig.dpi) for v in (7, 4))


def test_kurtosis_across_ranks_is_of_the_moment_sums_every_rank_saw():
    """evaluate.py passes sum_fn (a distributed SUM all-reduce): the kurtosis of an output is then that of the values
    all ranks saw together. Two probes stand for two ranks; the reference is the kurtosis of the concatenated
    outputs computed directly (float64, central moments)."""
    model = tiny_vit(depth=1)
    batches = [images(2, seed=1), images(2, seed=2) * 3]
    seen = []
    hook = model.blocks[0].register_forward_hook(lambda m, i, o: seen.append(o.double().flatten()))
    probes = [ActivationProbe(model, moments=True) for _ in batches]
    with torch.no_grad():
        for probe, x in zip(probes, batches):
            with probe:
                model(x)
    hook.remove()
    other = probes[1].moment_sums().clone()
    got = probes[0].result(sum_fn=lambda sums: sums + other)
    x = torch.cat(seen)
    centred = x - x.mean()
    expected = ((centred ** 4).mean() / (centred ** 2).mean() ** 2).item()
    assert {r["name"]: r["kurtosis"] for r in got.per_layer}["blocks.0"] == pytest.approx(expected, rel=1e-9)


def test_integer_outputs_and_pass_through_extra_modules_are_not_counted():
    """An integer tensor a module returns (indices, e.g. a routing choice) is no activation: a block whose module
    returns x and the argmax index 7 has the maxima of x alone. A pass-through module named in extra_modules adds
    no target (its output repeats a tensor counted elsewhere, or the input)."""
    class Route(torch.nn.Module):
        def forward(self, x):
            return x * 2, torch.tensor([7])

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.route = Route()

        def forward(self, x):
            return self.route(x)[0] - x

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block()])
            self.drop = torch.nn.Dropout(0.0)

        def forward(self, x):
            return self.drop(self.blocks[0](x) * 100)

    model = Net().eval()
    with torch.no_grad(), ActivationProbe(model, extra_modules=("drop",)) as probe:
        model(torch.tensor([[1.0, -2.0]]))
    got = probe.result()
    assert (got.module, got.block) == (4.0, 2.0)  # |2x| <= 4; |2x - x| <= 2; 7 and |100 x| are not counted
    assert "drop" not in probe.names()


def test_outputs_declared_as_repeats_and_drop_paths_are_not_counted():
    """A module declaring `repeats_its_input` (quant's quantizers) adds no target and none of its output, even
    when that output is the largest (here ten times its input); a ViT with stochastic depth has the targets and
    maxima of one without (DropPath only repeats the branch output, counted as attn / mlp)."""
    class Echo(torch.nn.Module):
        repeats_its_input = True

        def forward(self, x):
            return x * 10

    class Triple(torch.nn.Module):
        def forward(self, x):
            return x * 3

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.echo, self.triple = Echo(), Triple()

        def forward(self, x):
            return self.triple(self.echo(x) / 10) - x

    model = OneBlockNet(Block())
    with torch.no_grad(), ActivationProbe(model) as probe:
        model(torch.tensor([[1.0, -2.0]]))
    got = probe.result()
    assert (got.module, got.block) == (6.0, 4.0)  # |3x| <= 6 (|10x| = 20 not counted); |3x - x| <= 4
    assert probe.names() == ["blocks.0", "blocks.0.triple"]
    plain, stochastic = tiny_vit(), tiny_vit(drop_path_rate=0.1)
    assert any(isinstance(m, DropPath) for m in stochastic.modules())
    x = images(2)
    with torch.no_grad():
        want = direct_vit_maxima(stochastic, x)
        with ActivationProbe(stochastic) as probe:
            stochastic(x)
    assert probe.names() == ActivationProbe(plain).names()
    assert (probe.result().module, probe.result().block) == pytest.approx(want, rel=1e-6)


def test_each_record_names_the_index_of_its_block_in_model_order():
    """The `block` of a record (the CSV column, the plot's x axis) is the position of its block among all blocks:
    N for a ViT's blocks.N and everything inside it; Swin's blocks counted across stages; -1 outside blocks."""
    vit = tiny_vit(depth=3)
    with torch.no_grad(), ActivationProbe(vit) as probe:  # a record is of an output measured
        vit(images(1))
    assert probe.result().per_layer
    for record in probe.result().per_layer:
        assert record["block"] == int(record["name"].split(".")[1]), record
    model = tiny_swin()
    with torch.no_grad(), ActivationProbe(model, extra_modules=("layers.*.downsample.reduction",)) as probe:
        model(images(1))
    swin = probe.result().per_layer
    assert any(r["block"] == -1 for r in swin)
    order = {"layers.0.blocks.0": 0, "layers.0.blocks.1": 1, "layers.1.blocks.0": 2, "layers.1.blocks.1": 3}
    for record in swin:
        block = ".".join(record["name"].split(".")[:4])
        assert record["block"] == order.get(block, -1), record


def test_reset_forgets_the_maxima_and_moments_seen_before():
    """After reset() the probe reports the batches seen since, as a fresh probe would (the reference: the
    maximum and the central-moment kurtosis of the block output computed directly, float64)."""
    model = tiny_vit(depth=1)
    seen = []
    hook = model.blocks[0].register_forward_hook(lambda m, i, o: seen.append(o.double()))
    with torch.no_grad(), ActivationProbe(model, moments=True) as probe:
        model(images(2, seed=1) * 50)
        probe.reset()
        model(images(2, seed=2))
    hook.remove()
    out = seen[-1]
    centred = out - out.mean()
    got = {r["name"]: r for r in probe.result().per_layer}["blocks.0"]
    assert got["max"] == pytest.approx(out.abs().max().item(), rel=1e-6)
    assert got["kurtosis"] == pytest.approx(((centred ** 4).mean() / (centred ** 2).mean() ** 2).item(), rel=1e-9)


def test_a_constant_output_has_no_kurtosis_whatever_the_rounding_of_its_raw_moments():
    """A constant has no kurtosis (NaN), as the docstring says: also where the raw moments' rounding leaves a
    variance of a few ulps above or below zero (a constant 1/3 gave 2.7e16, 1.1 gave -4.5e15)."""
    from engine.act_max import kurtosis_from_sums

    rows = []
    for c in (0.0, 0.1, 0.3, 1 / 3, 0.7, 1.1, 5.1, -2.0, 1e-3, 123.456):
        x = torch.full((7,), c, dtype=torch.float64)
        rows.append([7.0, x.sum(), x.square().sum(), x.pow(3).sum(), x.square().square().sum()])
    assert kurtosis_from_sums(torch.tensor(rows, dtype=torch.float64)).isnan().all()
    # a mean of 1,000 std is still resolved (relative error ~2e-4 from the raw moments' rounding)
    x = 1000 + torch.randn(65536, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    sums = torch.stack([x.new_full((), 65536.0), x.sum(), x.square().sum(), x.pow(3).sum(), x.pow(4).sum()])
    centred = x - x.mean()
    want = ((centred ** 4).mean() / (centred ** 2).mean() ** 2).item()
    assert kurtosis_from_sums(sums[None]).item() == pytest.approx(want, rel=1e-3)


def test_max_by_type_reads_records_as_a_csv_gives_them_back_and_the_plot_is_log_scaled(monkeypatch):
    """Records read back from a CSV hold text: the maxima keep their fractions. The plot's y axis is logarithmic
    (maxima span decades)."""
    import engine.act_max_files
    from engine.act_max_files import max_by_type

    rows = list(csv.DictReader(io.StringIO(csv_bytes([{**r, "max": r["max"] + 0.25} for r in RECORDS]).decode())))
    assert max_by_type(rows) == {"block": [(0, 4.25), (1, 8.25)], "mlp.fc2": [(0, 2.25)]}
    figures = []
    new_figure = engine.act_max_files.new_figure
    monkeypatch.setattr(engine.act_max_files, "new_figure", lambda *a: figures.append(new_figure(*a)) or figures[-1])
    assert plot_bytes(RECORDS).startswith(b"\x89PNG")
    assert [ax.get_yscale() for ax in figures[0].axes] == ["log"]

"""engine/act_max.py check_extra_modules: a quant.act_max_extra_modules pattern must name modules the probe measures.

A pattern that named only pass-through modules (timm Swin's `head.drop`, a Dropout, and `layers.0.downsample`, an
Identity where the first stage does not merge patches) was accepted: `ActivationProbe` skips them, so it measured
nothing, yet evaluate.py recorded the pattern under max_act.extra_modules and its table's note said modules outside
the blocks were counted. It is refused now, with one error naming the pattern. The reference for what passes
through is the tests' own: the types of the modules each pattern names, read off the model, and forward hooks that
see whether a module returned its input unchanged.
"""
import re

import pytest
import torch
from timm.layers import DropPath
from torch import nn

from configs import ConfigError
from engine.act_max import ActivationProbe, check_extra_modules
from models.modules import fqn_matches
from quant_models import images, tiny_swin


def passes_its_input_through(model: nn.Module, pattern: str) -> bool:
    """Whether every module `pattern` names returns its input unchanged in an eval forward (the tests' reference)."""
    same = []
    handles = [sub.register_forward_hook(lambda m, inputs, out: same.append(torch.equal(inputs[0], out)))
               for name, sub in model.named_modules() if fqn_matches(name, [pattern])]
    with torch.no_grad():
        model(images(2))
    for handle in handles:
        handle.remove()
    return bool(same) and all(same)


def probed_records(model: nn.Module, patterns: list) -> list:
    """`ActivationProbe(...).result().per_layer` of `model` with quant.act_max_extra_modules=`patterns`, as evaluate.py
    makes them: the patterns checked first (check_extra_modules), then one forward of two images under no_grad."""
    check_extra_modules(model, patterns)
    with ActivationProbe(model, extra_modules=patterns) as probe, torch.no_grad():
        model(images(2))
    return probe.result().per_layer


@pytest.mark.parametrize("pattern", ["head.drop", "layers.0.downsample", "head.flatten"])
def test_a_pattern_of_pass_through_modules_only_is_refused(pattern):
    model = tiny_swin()
    # the premise, read off timm's model: the pattern names modules that repeat their input
    assert passes_its_input_through(model, pattern)
    with pytest.raises(ConfigError, match=rf"quant.act_max_extra_modules: '{pattern}' names only pass-through "
                                          r"modules of SwinTransformer \(" + pattern + r": (Dropout|Identity)\)"):
        check_extra_modules(model, ["layers.1.downsample.reduction", pattern])


@pytest.mark.parametrize("pattern", ["layers.1.downsample", "layers.1.downsample.*", "head.*", "layers.*.downsample"])
def test_a_pattern_that_names_a_computing_module_is_accepted_and_measured(pattern):
    """Accepted where one module it names computes something (head.* also names head.drop and head.flatten): the
    probe then holds a record outside the blocks for it."""
    model = tiny_swin()
    assert not passes_its_input_through(model, pattern)
    records = probed_records(model, [pattern])
    assert [r for r in records if r["block"] == -1 and fqn_matches(r["name"], [pattern])]


def test_a_pattern_that_names_no_module_is_still_refused():
    with pytest.raises(ConfigError, match=r"'layers.2.downsample' names no module of SwinTransformer"):
        check_extra_modules(tiny_swin(), ["layers.2.downsample"])


def test_the_plot_draws_the_modules_outside_the_blocks_and_so_the_module_maximum(monkeypatch):
    """The per-layer plot (engine/act_max_files.py) drew the records of block index -1 (the modules
    quant.act_max_extra_modules adds) nowhere, while the module maximum evaluate.py reports (‡) counts them: with
    patch_embed.proj's output the largest, the plot's highest module point was below the maximum reported. Its
    series now hold each outside module's maximum at the 'outside' column, and the lines drawn reach the maximum.
    The reference: forward hooks that take the modules' outputs' |max| directly."""
    import engine.act_max_files
    from engine.act_max_files import OUTSIDE_X, plot_series

    torch.manual_seed(0)
    model = tiny_swin().eval()
    with torch.no_grad():
        model.patch_embed.proj.weight.mul_(1000.0)  # its output the largest of all (a LayerNorm follows it)
    extra = ["patch_embed.proj", "layers.1.downsample.reduction"]
    direct = {}
    handles = [model.get_submodule(name).register_forward_hook(
        lambda m, inputs, out, name=name: direct.__setitem__(name, out.abs().max().item())) for name in extra]
    records = probed_records(model, extra)
    for handle in handles:
        handle.remove()
    in_blocks = max(r["max"] for r in records if r["block"] >= 0)
    assert direct["patch_embed.proj"] > 10 * in_blocks  # the premise: the maximum is outside the blocks

    series = {label: points for label, points, _ in plot_series(records)}
    assert series["patch_embed.proj (outside the blocks)"] == [(OUTSIDE_X, pytest.approx(direct["patch_embed.proj"]))]
    assert series["layers.N.downsample.reduction (outside the blocks)"] == [
        (OUTSIDE_X, pytest.approx(direct["layers.1.downsample.reduction"]))]

    figures = []
    new_figure = engine.act_max_files.new_figure
    monkeypatch.setattr(engine.act_max_files, "new_figure", lambda *a: figures.append(new_figure(*a)) or figures[-1])
    engine.act_max_files.plot_bytes(records)
    (ax,) = figures[0].axes
    drawn = max(max(line.get_ydata()) for line in ax.get_lines() if line.get_label() != "block")
    assert drawn == pytest.approx(direct["patch_embed.proj"])
    assert "outside" in [tick.get_text() for tick in ax.get_xticklabels()]


@pytest.mark.parametrize("pattern", ["layers.*.blocks.*.mlp.fc1", "layers.0.blocks.1.attn.*"])
def test_a_pattern_of_modules_inside_the_blocks_only_is_refused(pattern):
    """Their outputs are counted in the module maximum already: the pattern was accepted, each module recorded a
    second time as one outside the blocks (block -1, drawn in the plot's "outside" column), and the result's ‡ note
    said the module maximum also counted modules outside the blocks. The reference: the tests' own names of what lies
    under a block (layers.N.blocks.M.)."""
    model = tiny_swin()
    matched = [name for name, _ in model.named_modules() if fqn_matches(name, [pattern])]
    assert matched and all(".blocks." in name and name.split(".blocks.")[1].count(".") >= 1 for name in matched)
    with pytest.raises(ConfigError, match=rf"quant.act_max_extra_modules: '{re.escape(pattern)}' names only modules "
                                          r"inside the Transformer blocks of SwinTransformer \(.*\), whose outputs "
                                          r"the module maximum counts already"):
        check_extra_modules(model, ["layers.1.downsample.reduction", pattern])


def test_modules_inside_the_blocks_that_a_wider_pattern_names_are_recorded_once():
    """`**.norm*` names the final norm and every block's norm1 / norm2 (and the patch merging's norms): accepted, with
    one record per module; those inside a block keep their block, the others are outside it (block -1)."""
    model = tiny_swin()
    records = probed_records(model, ["**.norm*"])
    names = [r["name"] for r in records]
    assert len(names) == len(set(names))
    outside = {r["name"] for r in records if r["block"] == -1}
    want = {name for name, sub in model.named_modules() if fqn_matches(name, ["**.norm*"]) and ".blocks." not in name
            and not isinstance(sub, nn.Identity)}
    assert outside == want and "norm" in outside


class _Unit(nn.Module):
    def __init__(self, b: nn.Module) -> None:
        super().__init__()
        self.b = b


class _Families(nn.Module):
    """Module names of the families the probe meets, outside the blocks: Swin stages (`layers.N.blocks.M`,
    `layers.N.downsample.reduction`), GPT-2's `transformer.h.N.mlp`, MMDetection's `backbone.stages.N.downsample.norm`,
    a ModuleList of ModuleLists (`a.0.1.b`), and Sequentials of unlike members (`stem`, `pre`)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Unit(nn.Linear(4, 4)) for _ in range(2)])  # the Transformer blocks (ViT)
        self.a = nn.ModuleList([nn.ModuleList([_Unit(nn.Linear(4, 4)) for _ in range(2)]) for _ in range(2)])
        self.transformer = nn.Module()
        self.transformer.h = nn.ModuleList([nn.Module() for _ in range(3)])
        for h in self.transformer.h:
            h.mlp = nn.Linear(4, 4)
        self.layers, self.backbone = self._stages(), nn.Module()
        self.backbone.stages = self._stages()
        self.stem = nn.Sequential(_Unit(nn.Linear(4, 4)), _Unit(nn.LayerNorm(4)))
        self.pre = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))

    @staticmethod
    def _stages() -> nn.ModuleList:
        stages = nn.ModuleList([nn.Module() for _ in range(2)])
        for stage in stages:
            stage.downsample = nn.Module()
            stage.downsample.norm, stage.downsample.reduction = nn.LayerNorm(4), nn.Linear(4, 4)
        return stages


def test_modules_outside_the_blocks_are_grouped_by_their_stage_index_only():
    """The type of a module outside the blocks replaced `.<digits>.` in its name by `.N.` with a regular expression:
    the matches do not overlap, so `a.0.1.b` was `a.N.1.b` (a.0.1.b and a.0.0.b, the same module of two units, drawn
    as two types), and an index into a Sequential of unlike members was replaced too (`stem.0.b`, a Linear, and
    `stem.1.b`, a LayerNorm, one type). The reference: the types written out by hand for each family (`blocks.*` names
    the model's blocks: the probe needs some)."""
    model = _Families()
    patterns = ["a.*.*.b", "transformer.h.*.mlp", "layers.*.downsample.*", "backbone.stages.*.downsample.norm",
                "stem.*.b", "pre.*"]
    with ActivationProbe(model, extra_modules=patterns) as probe:
        pass
    types = {name: typ for name, kind, block, typ, _ in probe.targets if block == -1}
    want = {**{f"a.{i}.{j}.b": "a.N.N.b" for i in range(2) for j in range(2)},
            **{f"transformer.h.{i}.mlp": "transformer.h.N.mlp" for i in range(3)},
            **{f"layers.{i}.downsample.{m}": f"layers.N.downsample.{m}"
               for i in range(2) for m in ("norm", "reduction")},
            **{f"backbone.stages.{i}.downsample.norm": "backbone.stages.N.downsample.norm" for i in range(2)},
            "stem.0.b": "stem.0.b", "stem.1.b": "stem.1.b", "pre.0": "pre.0", "pre.1": "pre.1"}
    assert types == want
    with ActivationProbe(model, extra_modules=["**"]) as probe:  # it names the model itself too: its name is ""
        pass
    assert {name: typ for name, _, block, typ, _ in probe.targets if block == -1}[""] == ""


@pytest.mark.parametrize("pattern", ["layers.*.blocks.*", "layers.0.blocks.1"])
def test_a_pattern_of_the_blocks_themselves_is_refused(pattern):
    """A block's output is the block maximum's: a pattern naming blocks was accepted (a block's name does not lie
    under the block), and each block was recorded a second time as a module outside the blocks (block -1, drawn in
    the plot's "outside" column), its output then counted in the module maximum too. The reference for what is a
    block: the tests' own names of Swin's blocks (layers.N.blocks.M)."""
    model = tiny_swin()
    matched = [name for name, _ in model.named_modules() if fqn_matches(name, [pattern])]
    assert matched and all(re.fullmatch(r"layers\.\d+\.blocks\.\d+", name) for name in matched)
    with pytest.raises(ConfigError, match=rf"quant.act_max_extra_modules: '{re.escape(pattern)}' names only "
                                          r"Transformer blocks \(and modules inside them\) of SwinTransformer "
                                          r"\(.*\), whose outputs the block and module maxima count already"):
        check_extra_modules(model, [pattern])


def test_blocks_that_a_wider_pattern_names_are_recorded_once_as_blocks():
    """`**` names every module, the blocks among them: accepted, the blocks recorded once each, as blocks (kind
    "block", their index), and the modules outside the blocks at block -1. The reference: the tests' own names of
    Swin's blocks (layers.N.blocks.M) and of the pass-through types."""
    model = tiny_swin()
    records = probed_records(model, ["**"])
    names = [r["name"] for r in records]
    assert len(names) == len(set(names))
    blocks = [name for name, _ in model.named_modules() if re.fullmatch(r"layers\.\d+\.blocks\.\d+", name)]
    assert sorted(r["name"] for r in records if r["kind"] == "block") == sorted(blocks)
    outside = {r["name"] for r in records if r["block"] == -1}
    want = {name for name, sub in model.named_modules()
            if not re.search(r"\.blocks\.\d+", name) and not isinstance(sub, (nn.Identity, nn.Dropout, DropPath))}
    assert outside == want and "layers.0.blocks" in outside

"""docs/extending.md stays true: its example pipeline runs as written and quantizes what it says (checked against
per-tensor min/max rounding computed here by hand on the float model's weights and on the inputs its layers see),
and every pipeline of the registry is listed in the places the guide names (config schema, table column)."""
import __future__
import ast
import dataclasses
import os
import re

import pytest
import torch

import configs.quant
from configs import Config, load_config
from configs.quant import FirstLastOptions
from configs.schema import QuantConfig
from data import calibration_images
from engine.result_table import PAPER_NAMES
from models import build_model
from quant import PIPELINES, evaluate_quantized
from quant.layers import QuantConv2d, QuantLinear
from tests.conftest import DEBUG_CONFIG, ROOT

GUIDE = os.path.join(ROOT, "docs", "extending.md")


def guide_text() -> str:
    with open(GUIDE) as f:
        return f.read()


def example_blocks() -> tuple[str, str]:
    """The guide's two example blocks: the options dataclass for configs/quant.py, then the pipeline module."""
    section = guide_text().split("### A minimal pipeline", 1)[1].split("\n### ", 1)[0]
    blocks = re.findall(r"^```python\n(.*?)^```", section, re.S | re.M)
    assert len(blocks) == 2, "the section shows the options (configs/quant.py), then the pipeline module"
    return blocks[0], blocks[1]


def example_namespace() -> dict:
    """The names the guide's example defines, after pasting it where the guide says: the options block runs as
    the end of configs/quant.py (that module's names and `from __future__ import annotations`, not the module
    itself, so the test leaves it as it is), the pipeline block as a module of its own that imports the options
    from configs.quant, which for that import alone holds the class the first block defined."""
    options_block, pipeline_block = example_blocks()
    in_configs = dict(vars(configs.quant))
    future = __future__.annotations.compiler_flag
    exec(compile(options_block, GUIDE, "exec", flags=future, dont_inherit=True), in_configs)
    options = in_configs["MinMaxOptions"]
    namespace = {"__name__": "extending_example"}
    # raising=False: a fork that followed the guide has the class in configs/quant.py already
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(configs.quant, "MinMaxOptions", options, raising=False)
        exec(compile(pipeline_block, GUIDE, "exec"), namespace)
    return namespace


def imports(code: str) -> set[tuple[str, str]]:
    """(module, name) for every name a code block imports absolutely: `import a.b` gives ("a.b", ""), `from a.b
    import C` gives ("a.b", "C")."""
    found = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            found.update((a.name, "") for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.update((node.module, a.name) for a in node.names)
    return found


def min_max_reference(x: torch.Tensor, bits: int, symmetric: bool) -> torch.Tensor:
    """x rounded to the nearest of 2^bits levels spanning its own [min, max] (symmetric: [-max|x|, max|x|] on the
    signed codes, zero point 0), written out from the definition of uniform quantization."""
    x = x.detach().double()
    if symmetric:
        scale = x.abs().max() / (2 ** (bits - 1) - 1)
        return (torch.round(x / scale).clamp(-2 ** (bits - 1), 2 ** (bits - 1) - 1) * scale).float()
    lo, hi = x.min(), x.max()
    scale = (hi - lo) / (2 ** bits - 1)
    zero = torch.round(-lo / scale)
    return ((torch.round(x / scale) + zero).clamp(0, 2 ** bits - 1) - zero).mul(scale).float()


@pytest.fixture(scope="module")
def debug_model_and_batch():
    """The debug config's float model (eval mode) and 8 calibration images of its synthetic training split."""
    cfg = load_config([DEBUG_CONFIG], [])
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    calib = calibration_images(cfg.data, 32, cfg.model.num_classes, 8, cfg.quant.calib_seed)
    return model, calib


@pytest.mark.parametrize("symmetric", [False, True])
def test_the_guides_example_pipeline_rounds_every_weight_and_input_on_its_own_min_max(
        symmetric, debug_model_and_batch, monkeypatch):
    fp, calib = debug_model_and_batch
    example = example_namespace()
    pipeline = example["MinMaxPipeline"]()
    monkeypatch.setitem(PIPELINES, pipeline.name, pipeline)  # the guide's registry step
    before = {k: v.clone() for k, v in fp.state_dict().items()}
    scored = {}

    def eval_fn(model):
        scored["model"] = model
        with torch.no_grad():
            return {"logit_change": (model(calib) - fp(calib)).abs().max().item()}

    entry = evaluate_quantized("minmax", fp, calib, "w4a8", eval_fn, {"symmetric": symmetric})
    qmodel = scored["model"]
    assert entry["report"]["bits"] == "w4a8" and entry["report"]["calibration_images"] == 8
    assert entry["report"]["options"]["symmetric"] is symmetric
    assert entry["logit_change"] > 0 and {"seconds", "quantize_seconds", "eval_seconds"} <= set(entry)
    assert all(torch.equal(before[k], v) for k, v in fp.state_dict().items())  # the float model is untouched

    layers = {n: m for n, m in qmodel.named_modules() if isinstance(m, (QuantLinear, QuantConv2d))}
    # stem, 2 blocks x (qkv, proj, fc1, fc2), head: every Linear / Conv2d of the two-block ViT
    assert len(layers) == 10 and sum(isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)) for m in fp.modules()) == 10
    float_weights = dict(fp.named_parameters())
    inputs = {}
    hooks = [m.input_quantizer.register_forward_pre_hook(lambda mod, args, n=n: inputs.setdefault(n, args[0]))
             for n, m in layers.items()]
    with torch.no_grad():
        qmodel(calib)  # the quantizers are frozen: each sees again the input it was calibrated on
    for hook in hooks:
        hook.remove()
    for name, layer in layers.items():
        assert layer.weight_quantizer.bits == 4 and layer.input_quantizer.bits == 8, name
        want = min_max_reference(float_weights[f"{name}.weight"], 4, symmetric)
        torch.testing.assert_close(layer.quantized_weight(), want, rtol=0, atol=1e-6, msg=name)
        seen = inputs[name]
        torch.testing.assert_close(layer.input_quantizer(seen), min_max_reference(seen, 8, symmetric),
                                   rtol=0, atol=1e-5, msg=name)


def test_the_guides_example_options_carry_the_stem_and_head_bits():
    """pipeline_report and standard_layout read `resolved(bits)`: the guide's options derive from FirstLastOptions."""
    options = example_namespace()["MinMaxOptions"]
    assert issubclass(options, FirstLastOptions) and dataclasses.is_dataclass(options)


def test_the_guides_example_keeps_its_options_in_configs_and_the_pipeline_imports_them():
    """Steps 1 and 2 of the guide's list, as its example shows them: the options block is a part of configs/quant.py,
    so it imports no other package of the project (tests/test_layering.py) and no torch (scripts/sweep.py reads
    configs without it), and the pipeline module takes the class from configs.quant instead of defining its own."""
    options_block, pipeline_block = example_blocks()
    packages = {module.split(".")[0] for module, _ in imports(options_block)}
    assert not packages & {"cd", "models", "data", "quant", "engine", "torch"}, packages
    assert re.search(r"^class MinMaxOptions\(FirstLastOptions\):", options_block, re.M)
    assert ("configs.quant", "MinMaxOptions") in imports(pipeline_block)
    defined = [node.name for node in ast.parse(pipeline_block).body if isinstance(node, ast.ClassDef)]
    assert defined == ["MinMaxPipeline"], defined
    options = example_namespace()["MinMaxPipeline"].Options
    assert options.__name__ == "MinMaxOptions" and options.__module__ == "configs.quant"


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_every_pipeline_is_listed_where_the_guide_says(name):
    """Items 3 to 5 of the guide's list: a QuantConfig section of the pipeline's own options under its name (else
    evaluate.py has no options for it and quant.first_last does not reach it), the registry key, a table column."""
    pipeline = PIPELINES[name]
    assert pipeline.name == name
    sections = {f.name for f in dataclasses.fields(QuantConfig)}
    assert name in sections, f"configs/schema.py QuantConfig has no section {name}"
    assert type(getattr(Config().quant, name)) is pipeline.Options
    assert name in PAPER_NAMES, f"engine/result_table.py PAPER_NAMES has no column for {name}"


def test_the_guides_list_names_the_places_the_test_checks():
    text = guide_text().split("### Where a pipeline is listed", 1)[1].split("\n### ", 1)[0]
    for place in ("`configs/schema.py`", "`QuantConfig`", "`quant/registry.py`", "`PIPELINES`",
                  "`engine/result_table.py`", "`PAPER_NAMES`", "`configs/quant.py`"):
        assert place in text, place


@pytest.mark.parametrize("guide_followed", [False, True])
def test_a_pipeline_registered_without_its_config_section_is_named_with_the_fix(guide_followed, monkeypatch):
    """The guide's step 3 forgotten: pipeline_options had returned None and the layout failed later with
    "'NoneType' object has no attribute 'symmetric'". The pipeline is the guide's example under a name no config
    section has, so that the test holds in a fork that followed the guide too, whose QuantConfig has a `minmax`
    section (guide_followed: this config is given one); that section is then what `minmax` gets."""
    from quant import plan

    example = example_namespace()

    class UnlistedPipeline(example["MinMaxPipeline"]):
        name = "minmax_unlisted"

    cfg = Config()
    if guide_followed:
        cfg.quant.minmax = example["MinMaxOptions"](symmetric=True)  # step 3, on this config alone
        monkeypatch.setitem(PIPELINES, "minmax", example["MinMaxPipeline"]())  # step 4
        assert plan.pipeline_options(cfg, "minmax") == example["MinMaxOptions"](symmetric=True)
    assert not hasattr(cfg.quant, UnlistedPipeline.name), "the refused pipeline needs a name no config section has"
    monkeypatch.setitem(PIPELINES, UnlistedPipeline.name, UnlistedPipeline())
    with pytest.raises(TypeError, match=r"^the minmax_unlisted pipeline .* has no options section in the config "
                                        r"schema: add `minmax_unlisted: MinMaxOptions = field\(default_factory="
                                        r"MinMaxOptions\)` to QuantConfig in configs/schema.py"):
        plan.pipeline_options(cfg, UnlistedPipeline.name)
    assert plan.pipeline_options(cfg, "repq") == cfg.quant.repq  # a listed one: its section


def test_a_task_without_default_pipelines_asks_for_them_by_name(monkeypatch):
    """A task added without its DEFAULT_PIPELINES entry (the guide's task step 5) ended an evaluation without
    --quant in a KeyError; now one error naming the pipelines that take the task, as the setting (train.py and
    scripts/sweep.py check the plan too, and have no --quant) and as evaluate.py's flag."""
    from configs import ConfigError
    from quant import plan

    monkeypatch.delitem(plan.DEFAULT_PIPELINES, "classification")
    takes = [name for name in PIPELINES if "classification" in PIPELINES[name].tasks]
    assert {"percentile", "repq", "aphq", "gplq"} <= set(takes)
    with pytest.raises(ConfigError, match=r"^quant.pipelines: the classification task has no default pipelines "
                                          r"\(quant/plan.py DEFAULT_PIPELINES\); name the pipelines to run, e.g. "
                                          rf"quant.pipelines=\[{','.join(takes)}\] \(evaluate.py: --quant "
                                          rf"{' '.join(takes)}\)$"):
        plan.evaluation_pipelines(Config())
    # the setting the message names is one train.py takes, and it needs no default
    assert load_config([], [f"quant.pipelines=[{','.join(takes)}]"]).quant.pipelines == takes
    assert plan.evaluation_pipelines(load_config([], [f"quant.pipelines=[{','.join(takes)}]"])) == takes

"""Every accepted setting is applied or refused with one error line: a setting that only acts at a run's
start is refused on resume; the precision that runs is logged (and fp16 on a CPU warned about); degenerate
APHQ grids are refused before any work, and tables mark results of non-default settings."""
import json
import os
import re

import pytest

import train
from configs import Config, ConfigError, load_config
from configs.loader import IgnoredOverrideError
from configs.quant import APHQOptions
from engine.checkpoint import CheckpointError
from engine import result_table
from engine.quant_settings import quant_settings
from quant import PIPELINES, parse_bits
from tests.conftest import DEBUG_CONFIG, DEMO_CONFIG, ROOT


@pytest.mark.parametrize("finished", [False, True])
def test_new_pretrained_weights_on_a_resumable_or_finished_run_are_refused(debug_config, finished):
    cfg = debug_config(*(() if finished else ("train.max_steps=2",)), name="p")
    train.main(cfg)
    # (model.pretrained_strict alone is refused earlier: it is read only with model.pretrained)
    for override in ("model.pretrained=/no/such/weights.pth", "train.archive_existing=true"):
        key = override.split("=")[0]
        with pytest.raises(CheckpointError, match=rf"continues a run, and only a run's start reads {key}: "):
            train.main(debug_config(override, name="p"))
    assert train.main(debug_config(name="p")).state.step == 8  # the same command goes on


@pytest.mark.parametrize("amp, line", [("fp16", "precision: fp16 autocast with a GradScaler on cpu (train.amp=fp16)"),
                                       ("none", "precision: fp32 (no autocast) on cpu (train.amp=none)")])
def test_the_precision_that_runs_is_logged_and_fp16_on_a_cpu_is_warned_about(debug_config, caplog, amp, line):
    with caplog.at_level("INFO"):
        train.main(debug_config(f"train.amp={amp}", "train.max_steps=1"))
    assert line in caplog.text
    assert ("fp16 autocast runs several times slower than fp32" in caplog.text) == (amp == "fp16")



@pytest.mark.parametrize("amp, dtype", [("fp16", "float16"), ("bf16", "bfloat16")])
def test_the_autocast_is_of_the_device_of_the_run(amp, dtype):
    """A CUDA run's autocast is torch's CUDA autocast (read from the object torch builds; on a machine without
    CUDA torch only warns that it would be disabled, so this runs on a CPU too)."""
    import warnings

    import torch

    from engine.precision import autocast
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "CUDA is not available ... Disabling autocast."
        context = autocast(amp, torch.device("cuda"))
    assert (context.device, str(context.fast_dtype)) == ("cuda", f"torch.{dtype}")

def test_fp16_on_a_gpu_is_described_without_the_cpu_warning(caplog):
    """The slow-fp16 warning is for CPUs: a GPU recipe's fp16 on a GPU gets the precision line only (a string
    about a cuda device; nothing runs on it)."""
    import torch

    from engine.precision import describe_precision
    with caplog.at_level("WARNING"):
        line = describe_precision("fp16", torch.device("cuda"))
    assert line == "precision: fp16 autocast with a GradScaler on cuda (train.amp=fp16)"
    assert "slower" not in caplog.text


@pytest.mark.parametrize("amp, dtype, scaler", [("none", "float32", False), ("fp16", "float16", True),
                                                ("bf16", "bfloat16", False)])
def test_each_precision_setting_runs_its_own_autocast_dtype_and_only_fp16_has_a_grad_scaler(amp, dtype, scaler):
    """What train.amp runs, read from torch itself: the dtype of a matmul under the context, and the scaler."""
    import torch

    from engine.precision import autocast, grad_scaler

    cpu = torch.device("cpu")
    with autocast(amp, cpu):
        product = torch.ones(2, 2) @ torch.ones(2, 2)
    assert str(product.dtype) == f"torch.{dtype}"
    assert isinstance(grad_scaler(amp, cpu), torch.amp.GradScaler) == scaler
    if scaler:  # one that scales on this device: a scaler made for CUDA disables itself on a CPU-only machine
        assert grad_scaler(amp, cpu).scale(torch.ones(())).item() == 2.0 ** 16  # torch's initial scale


def test_a_degenerate_aphq_grid_is_refused_where_it_would_be_degenerate():
    aphq = PIPELINES["aphq"]
    aphq.check(parse_bits("w3a3"), APHQOptions(eq_n=16))  # 8 zero points x 2 ranges: a real search
    with pytest.raises(ValueError, match="eq_n=16 leaves the 4-bit grids at w4a4 fewer than 2 ranges"):
        aphq.check(parse_bits("w4a4"), APHQOptions(eq_n=16))  # 16 zero points x 1 range


@pytest.mark.parametrize("ok, refused, message", [
    (dict(calib_images=32, recon_images=32), dict(calib_images=33, recon_images=32), "calib_images=33 exceeds"),
    (dict(batch_size=32, recon_images=32, calib_images=8), dict(batch_size=33, recon_images=32, calib_images=8),
     "batch_size=33 exceeds"),
    (dict(eq_n=32), dict(eq_n=31), "eq_n=31 leaves"),
    (dict(matmul_steps=2), dict(matmul_steps=1), "matmul_steps=1"),
    (dict(act_pct=(0.9, 0.9)), dict(act_pct=(0.9, 0.89)), "act_pct=[0.9, 0.89]"),
    (dict(matmul_pct=(0.51, 1.0)), dict(matmul_pct=(0.5, 1.0)), "matmul_pct=[0.5, 1.0]"),
])
def test_aphq_option_limits_are_exact(ok, refused, message):
    # each limit at its edge: the last accepted value runs, the first refused one is named
    # (validate: what the entry points call; the calibration-prefix limit is a classifier's, checked there)
    aphq = PIPELINES["aphq"]
    aphq.validate(parse_bits("w4a4"), APHQOptions(**ok))
    with pytest.raises(ValueError, match=re.escape(message)):
        aphq.validate(parse_bits("w4a4"), APHQOptions(**refused))


def settings(pipeline, **changes):
    plain = json.loads(json.dumps(quant_settings(Config(), pipeline), default=str))
    plain["options"].update(changes)
    return plain


def result(method, quant):
    return {"model": "m", "method": method, "fp": {"top1": 90.0}, "max_act": {"module": 1.0, "block": 2.0},
            "data": {"dataset": "folder", "root": "/datasets/pets"}, "checkpoint": method, "quant": quant}


def test_tables_mark_results_of_non_default_settings(tmp_path):
    results = [result("Baseline", {"aphq": {"w4a4": {"top1": 36.0, "settings": settings("aphq", eq_n=16)}}}),
               result("CD", {"aphq": {"w4a4": {"top1": 80.0, "settings": settings("aphq")}}})]
    table = result_table.markdown_table(results).splitlines()
    assert table[2].endswith("| 36.000* |") and table[3].endswith("| 80.000 |")
    assert table[-1] == "\\* m Baseline APHQ W4A4: not the default settings: quant.aphq.eq_n=16"
    import paper_table

    finetune = paper_table.finetune_table(results)
    assert "90.00 / 36.00 / -54.00*" in finetune and "\\* Pets Baseline: not the default settings" in finetune


def test_finetune_layout_marks_the_average_that_takes_in_an_entry_of_non_default_settings():
    """Table 3's Average of a method over its data sets takes in each entry: one entry quantized with other settings
    (quant.aphq.eq_n=16) makes it no average of default-protocol numbers, so it is marked * as that entry is (as the
    Average that takes in a † or a § entry is); a method whose entries are all of the defaults stays unmarked."""
    import paper_table

    def entry(root, method, top1, **changes):
        return dict(result(method, {"aphq": {"w4a4": {"top1": top1, "settings": settings("aphq", **changes)}}}),
                    data={"dataset": "folder", "root": f"/datasets/{root}"}, checkpoint=f"{root}/{method}")
    results = [entry("pets", "Baseline", 36.0, eq_n=16), entry("flowers102", "Baseline", 80.0),
               entry("pets", "CD", 70.0), entry("flowers102", "CD", 80.0)]
    lines = paper_table.finetune_table(results).splitlines()
    assert lines[5] == "| Pets | 90.00 / 36.00 / -54.00* | 90.00 / 70.00 / -20.00 |"
    assert lines[6] == "| Average | 90.00 / 58.00 / -32.00* | 90.00 / 75.00 / -15.00 |"  # (36 + 80) / 2, (70 + 80) / 2


@pytest.mark.parametrize("recipe, override", [("", "optim.momentum=0.5"),  # adamw: no momentum
                                              ("optim: {name: sgd}", "optim.betas=[0.8,0.9]"),
                                              ("data: {auto_augment: rand-m9-mstd0.5-inc1}",
                                               "data.color_jitter=0.4")])  # off under RandAugment
def test_an_override_the_run_would_not_read_is_refused(tmp_path, recipe, override):
    layer = tmp_path / "layer.yaml"
    layer.write_text(recipe + "\n")
    with pytest.raises(IgnoredOverrideError, match=rf"{override.split('=')[0]}=.* would be ignored"):
        load_config([DEMO_CONFIG, str(layer)], [override])
    # with the deciding key set as well, the override says what it means
    assert load_config([DEMO_CONFIG], ["optim.name=sgd", "optim.momentum=0.5", "data.auto_augment=",
                                       "data.color_jitter=0.4"])


def test_a_file_value_the_run_would_not_read_is_refused_naming_the_file(tmp_path):
    """A YAML layer of another task's recipe (image mixup and crops under a language model's data set) set
    keys the run never reads: refused like the same override, naming the file (it trained without a word)."""
    images = tmp_path / "images.yaml"
    images.write_text("data: {mixup: 0.3}\n")
    lm = os.path.join(ROOT, "configs", "lm", "kjv_nano.yaml")
    with pytest.raises(IgnoredOverrideError, match=rf"^{images}: data.mixup=0.3 would be ignored: data.mixup is "
                                                   rf"read only when data.dataset is folder or digits or synthetic, "
                                                   rf"and it is kjv; drop it from {images}, or layer it over a recipe "
                                                   rf"whose data.dataset is folder or digits or synthetic$"):
        load_config([lm, str(images)])
    # the LM recipe layered over the image settings replaces the data set on purpose: they are moot
    assert load_config([str(images), lm]).data.dataset == "kjv"
    # naming the deciding key again at the value it had makes nothing read
    with pytest.raises(IgnoredOverrideError, match=rf"^{images}: data.mixup=0.3 would be ignored: .*; drop it from "
                                                   rf"{images}, or layer it over a recipe whose data.dataset is "
                                                   rf"folder or digits or synthetic$"):
        load_config([lm, str(images)], ["data.dataset=kjv"])
    # an override replacing the file's value is checked as an override; a value the run already has is no change
    with pytest.raises(IgnoredOverrideError, match=r"^data.mixup=0.5 would be ignored"):
        load_config([lm, str(images)], ["data.mixup=0.5"])
    unchanged = tmp_path / "unchanged.yaml"
    unchanged.write_text(f"data: {{mixup: {Config().data.mixup}}}\n")
    assert load_config([lm, str(unchanged)]).data.dataset == "kjv"
    # a file (or override) that switches a section off says what it means: a sweep's baseline over cd.yaml
    cd = os.path.join(ROOT, "configs", "method", "cd.yaml")
    off = tmp_path / "off.yaml"
    off.write_text("cd: {enabled: false}\n")
    assert load_config([DEMO_CONFIG, cd, str(off)]).cd.enabled is False
    assert load_config([DEMO_CONFIG, cd], ["cd.enabled=false"]).cd.enabled is False
    lam = tmp_path / "lam.yaml"
    lam.write_text("cd: {lam: 0.05}\n")
    with pytest.raises(IgnoredOverrideError, match=rf"^{lam}: cd.lam=0.05 would be ignored: cd.lam is read only "
                                                   rf"when cd.enabled is true, and it is false"):
        load_config([DEMO_CONFIG, str(lam)])


def test_a_runs_own_config_yaml_loads_as_a_recipe(tmp_path):
    """config.yaml of a run (every key, sections switched off included) reproduces the run with --config."""
    from configs import config_to_dict
    from engine.run_dir import save_config_history  # what train.py writes config.yaml with
    cd = os.path.join(ROOT, "configs", "method", "cd.yaml")
    for i, (paths, overrides) in enumerate((([DEMO_CONFIG, cd], ["cd.enabled=false"]),
                                            ([os.path.join(ROOT, "configs", "lm", "kjv_nano.yaml")], []))):
        cfg = load_config(paths, overrides)
        (tmp_path / str(i)).mkdir()
        save_config_history(str(tmp_path / str(i)), config_to_dict(cfg), 0)
        assert load_config([str(tmp_path / str(i) / "config.yaml")]) == cfg


def test_a_preset_file_on_a_checkpoints_config_is_checked_too(tmp_path):
    """evaluate.py / mechanism.py layer --config files over a checkpoint's config: a data-root preset on a
    language model (which reads its embedded text) would be ignored."""
    from configs import config_from_dict, config_to_dict, layer_config
    saved = config_to_dict(load_config([os.path.join(ROOT, "configs", "lm", "kjv_nano.yaml")]))
    preset = tmp_path / "preset.yaml"
    preset.write_text("data: {root: /datasets/imagenet}\n")
    with pytest.raises(IgnoredOverrideError, match=rf"^{preset}: data.root=/datasets/imagenet would be ignored"):
        layer_config(config_from_dict(saved), [str(preset)], [])
    assert layer_config(config_from_dict(saved), [], ["quant.calib_images=8"]).quant.calib_images == 8


@pytest.mark.parametrize("override", ["data.hflip=1.0", "data.mean=[0.2,0.2,0.2]", "data.auto_augment=rand-m9"])
def test_image_transform_settings_are_refused_for_synthetic_data_which_has_no_transform(override):
    with pytest.raises(IgnoredOverrideError, match=r"read only when data.dataset is folder or digits, and it "
                                                   r"is synthetic"):
        load_config([DEBUG_CONFIG], [override])
    assert load_config([DEBUG_CONFIG], ["data.mixup=0.5", "data.label_smoothing=0.1"])  # the loop reads these


@pytest.mark.parametrize("override, decider", [("sched.warmup_steps=100", "sched.steps"),
                                               ("model.pretrained_strict=true", "model.pretrained")])
def test_settings_read_only_beside_another_key_are_refused_without_it(override, decider):
    with pytest.raises(IgnoredOverrideError, match=rf"read only when {decider} is set"):
        load_config([DEBUG_CONFIG], [override])


def test_layer_decay_on_a_model_without_layer_grouping_is_refused(tmp_path):
    """A GPT has no timm group_matcher: timm would put every parameter in one layer (only a warning) and
    train without layer-wise decay; vision models with one still get it."""
    with pytest.raises(ConfigError, match=r"^optim.layer_decay=0.8 would have no effect: GPT has no layer "):
        train.main(load_config([os.path.join(ROOT, "configs/lm/kjv_nano.yaml")],
                               ["optim.layer_decay=0.8", f"out_dir={tmp_path / 'lm'}"]))
    from engine.optim import build_optimizer
    from models import build_model
    cfg = load_config([DEBUG_CONFIG], ["optim.layer_decay=0.8"])
    optimizer = build_optimizer(build_model(cfg.model), cfg.optim, 1e-3, 0.05)
    assert len({g["lr_scale"] for g in optimizer.param_groups}) > 1


def test_an_optimizer_name_in_another_case_is_refused_not_built_without_the_recipes_betas(tmp_path):
    """timm builds AdamW for optim.name=AdamW, but the betas of the recipe (0.9, 0.95) were passed only
    for the lower-case name: the run trained with (0.9, 0.999)."""
    cfg = load_config([os.path.join(ROOT, "configs/lm/kjv_nano.yaml")],
                      ["optim.name=AdamW", "train.max_steps=1", f"out_dir={tmp_path / 'lm'}"])
    with pytest.raises(ConfigError, match=r"^optim.name=AdamW: optimizer names are timm's, in lower case; "
                                          r"use optim.name=adamw$"):
        train.main(cfg)


@pytest.mark.parametrize("name", ["nadamw", "radam", "lion"])
def test_a_recipes_betas_beside_an_optimizer_that_does_not_read_them_are_refused(tmp_path, name):
    """kjv_nano's betas (0.9, 0.95) reach timm for adamw / adam / lamb only: with another Adam-like optimizer
    the run trained with that optimizer's own betas, without a word."""
    from engine.optim import build_optimizer
    from models import build_model
    cfg = load_config([os.path.join(ROOT, "configs/lm/kjv_nano.yaml")], [f"optim.name={name}"])
    model = build_model(cfg.model)
    with pytest.raises(ValueError, match=rf"optim.betas=\[0.9, 0.95\] / optim.eps=1e-08 are read for adamw, adam, "
                                         rf"lamb only, and optim.name={name} would train with its own"):
        build_optimizer(model, cfg.optim, lr=1e-3, weight_decay=0.1)
    plain = load_config([DEBUG_CONFIG], [f"optim.name={name}"])  # the default betas: its own are used
    build_optimizer(build_model(plain.model), plain.optim, lr=1e-3, weight_decay=0.1)


def test_an_eps_beside_an_optimizer_that_does_not_read_it_is_refused_with_the_default_betas():
    """optim.eps alone (betas left at their default) is as unread by sgd as the betas are: refused, not
    trained with sgd's own settings (the config loader refuses the override; this is the check for configs
    built in code or read from older runs)."""
    import torch

    from configs.schema import OptimConfig
    from engine.optim import build_optimizer
    with pytest.raises(ValueError, match=r"optim.betas=\[0.9, 0.999\] / optim.eps=1e-06 are read for adamw, adam, "
                                         r"lamb only, and optim.name=sgd would train with its own"):
        build_optimizer(torch.nn.Linear(2, 2), OptimConfig(name="sgd", eps=1e-6), lr=1e-3, weight_decay=0.0)


@pytest.mark.parametrize("name", ["fusedadamw", "bnbadamw8bit"])
def test_an_optimizer_that_needs_cuda_or_a_missing_package_is_refused_with_one_line(name):
    """timm's APEX / bitsandbytes optimizers assert CUDA (and import their package): an AssertionError
    traceback from train.py before."""
    from engine.optim import build_optimizer
    from models import build_model
    cfg = load_config([DEBUG_CONFIG], [f"optim.name={name}"])
    with pytest.raises(ValueError, match=rf"^optim.name={name} cannot be built here \(.+\); use another "
                                         rf"optimizer, e.g. optim.name=adamw$"):
        build_optimizer(build_model(cfg.model), cfg.optim, 1e-3, 0.05)

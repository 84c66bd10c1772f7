"""Values the schema accepted but the run could not use: every config value is checked against what the
code that reads it needs, at start-up, with one error line naming the key; a start-up error leaves no
folder that refuses the corrected command."""
import os

import pytest

import train
from configs import ConfigError, load_config
from tests.conftest import DEBUG_CONFIG, DEMO_CONFIG, run_entry


@pytest.mark.parametrize("override, message", [
    ("data.mean=[0.5,0.5]", r"'data.mean' must be 3 finite numbers"),              # a DataLoader traceback
    ("data.mean=[0.5,.nan,0.5]", r"'data.mean' must be 3 finite numbers"),
    ("data.std=[0.5,0,0.5]", r"'data.std' must be 3 finite numbers, each > 0"),   # division by zero
    ("data.std=[0.5,0.5,0.5,0.5]", r"'data.std' must be 3 finite numbers"),
    ("train.seed=18446744073709551616", r"'train.seed' must be >= -9223372036854775808 and <= "
                                        r"9223372036854775807"),                   # torch: overflow
    ("quant.aphq.data_seed=36893488147419103232", r"'quant.aphq.data_seed' must be >= "),
    ("data.scale=[1.0,0.08]", r"'data.scale' must be 2 finite numbers, each > 0 and <= 1, the smaller first"),
    ("data.scale=[0.08]", r"'data.scale' must be 2 finite numbers"),
    ("data.ratio=[0,1]", r"'data.ratio' must be 2 finite numbers, each > 0"),     # math domain error
    ("data.interpolation=bicubc", r"'data.interpolation' must be one of 'bicubic'"),  # a KeyError in timm
    ("data.interpolation=random", r"'data.interpolation' must be one of"),      # timm's eval transform: KeyError
    ("data.remode=zeros", r"'data.remode' must be one of 'pixel', 'rand', 'const'"),
    ("data.mixup_mode=pairs", r"'data.mixup_mode' must be one of 'batch', 'pair', 'elem'"),
    ("optim.betas=[0.9]", r"'optim.betas' must be 2 finite numbers, each >= 0 and < 1"),  # IndexError
    ("optim.betas=[0.9,1.0]", r"'optim.betas' must be 2 finite numbers"),
    ("optim.eps=0", r"'optim.eps' must be > 0"),                                  # a NaN loss
    ("tweo.eps=-1", r"'tweo.eps' must be >= 0"),
    ("quant.main_rank_wait_hours=3e6", r"'quant.main_rank_wait_hours' must be > 0 and <= 1e\+06"),  # gloo: overflow
    ("sched.name=plateau", r"'sched.name' must be one of 'cosine'"),             # never gets its metric
    ("sched.warmup_epochs=2", r"sched.warmup_epochs=2 is not shorter than sched.epochs=2: the run would "
                              r"train at warmup learning rates throughout"),
    ("sched.warmup_epochs=0.5", r"sched.warmup_epochs=0.5 is a fraction of an epoch, but the lr is set once per "
                                r"epoch \(sched.per_step=false\): the warmup would be 1 whole epoch\(s\) that never "
                                r"reach the peak lr; set sched.per_step=true"),
    ("model.kwargs.in_chans=1", r"model.kwargs.in_chans=1: the data pipeline gives 3-channel RGB images"),
    # the end of each range that the consumer cannot take: a val split of all or none of the text, an upscale
    # below the digits' 8 pixels, all-uniform targets, a penalty exponent below 1, an empty centre crop, a
    # divergence guard that fires at the first value, SGD momentum that never forgets
    ("data.kjv_val_fraction=1", r"'data.kjv_val_fraction' must be > 0 and < 1; got 1.0"),
    ("data.digits_img_size=7", r"'data.digits_img_size' must be >= 8; got 7"),
    ("data.label_smoothing=1", r"'data.label_smoothing' must be >= 0 and < 1; got 1.0"),
    ("tweo.p=0.5", r"'tweo.p' must be >= 1; got 0.5"),
    ("data.crop_pct=0", r"'data.crop_pct' must be > 0 and <= 1; got 0.0"),
    ("train.divergence_factor=1", r"'train.divergence_factor' must be > 1; got 1.0"),
    ("optim.momentum=1", r"'optim.momentum' must be >= 0 and < 1; got 1.0"),
    # int64 seeds: one past either end is refused
    ("train.seed=9223372036854775808", r"'train.seed' must be >= -9223372036854775808 and <= 9223372036854775807"),
    ("train.seed=-9223372036854775809", r"'train.seed' must be >= -9223372036854775808"),
    # a whole float for an int out of range: the range, not 'give sched.epochs=0' (refused in turn)
    ("sched.epochs=0.0", r"^command line: 'sched.epochs' must be a whole number >= 1; got 0.0$"),
    ("sched.epochs=2.5", r"^command line: 'sched.epochs' expects int, got 2.5 \(float\)$"),
])
def test_a_value_its_consumer_cannot_use_is_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config([DEBUG_CONFIG], [override])


def test_a_warmup_as_long_as_the_updates_is_refused():
    """sched.warmup_steps must stay below sched.steps: at warmup_steps == steps the lr never reaches its peak."""
    with pytest.raises(ConfigError, match=r"sched.warmup_steps=10 is not below sched.steps=10: the run would never "
                                          r"leave its warmup"):
        load_config([DEBUG_CONFIG], ["sched.steps=10", "sched.warmup_steps=10"])
    assert load_config([DEBUG_CONFIG], ["sched.steps=10", "sched.warmup_steps=9"]).sched.warmup_steps == 9


def test_warmup_epochs_are_not_checked_where_sched_steps_sets_the_length(tmp_path):
    """With sched.steps the run never reads sched.warmup_epochs: a fraction there (in a file that sets steps
    itself) is no per-epoch warmup that could miss its peak."""
    recipe = tmp_path / "steps.yaml"
    recipe.write_text("sched:\n  steps: 100\n  warmup_steps: 10\n  warmup_epochs: 0.5\n")
    assert load_config([DEBUG_CONFIG, str(recipe)]).sched.steps == 100


def test_values_the_consumers_accept_still_load():
    cfg = load_config([DEBUG_CONFIG], ["data.dataset=digits", "model.num_classes=10", "train.seed=-1",
                                       "data.scale=[1.0,1.0]", "sched.warmup_epochs=1.5", "sched.per_step=true",
                                       "data.interpolation=bilinear", "model.kwargs.in_chans=3",
                                       "quant.main_rank_wait_hours=1e6"])
    for seed in (-2 ** 63, 2 ** 63 - 1):  # the ends of int64, which torch.manual_seed takes
        assert load_config([DEBUG_CONFIG], [f"train.seed={seed}"]).train.seed == seed
    assert cfg.train.seed == -1 and cfg.data.scale == (1.0, 1.0) and cfg.quant.main_rank_wait_hours == 1e6


def test_the_command_line_ends_in_one_error_line_and_makes_no_folder(tmp_path, capsys):
    """train.py's __main__ in this process (run_entry: a process would import torch again); that a real process
    adds nothing to stderr: test_usage_errors.py::test_the_whole_process_writes_one_line_and_exits_2."""
    code, _, err = run_entry("train.py", ["--config", DEBUG_CONFIG, f"out_dir={tmp_path / 'r'}",
                                          "data.std=[0.5,0,0.5]"], capsys)
    assert code == 1 and err.strip().splitlines() == [
        "error: command line: 'data.std' must be 3 finite numbers, each > 0 and <= 1 (the model's input tensors are "
        "on the 0..1 scale: divide values on the 0..255 scale by 255); got (0.5, 0, 0.5)"]
    assert not (tmp_path / "r").exists()


UNIT_SCALE = "the model's input tensors are on the 0..1 scale: divide values on the 0..255 scale by 255"


@pytest.mark.parametrize("key, value", [("mean", "[123.675,116.28,103.53]"), ("std", "[58.395,57.12,57.375]")])
def test_a_mean_or_std_on_the_0_255_scale_is_refused_in_one_line(tmp_path, capsys, key, value):
    """MMDetection's and Caffe's normalization (pixels on the 0..255 scale) given to the 0..1 tensors timm's
    transforms make trained on near-constant inputs; it is refused at load, saying the scale."""
    code, _, err = run_entry("train.py", ["--config", DEBUG_CONFIG, f"out_dir={tmp_path / 'r'}",
                                          "data.dataset=digits", f"data.{key}={value}"], capsys)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith(f"error: command line: 'data.{key}' must be "), lines
    assert f"({UNIT_SCALE})" in lines[0]
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("mean", [0, 1, 0.5, -0.01, 1.01, 123.675])
@pytest.mark.parametrize("std", [1, 0.229, 1e-3, 0, 1.01, 58.395])
def test_mean_and_std_are_refused_exactly_off_the_0_1_scale(mean, std):
    """The reference: a mean in [0, 1] and a std in (0, 1] normalize pixels on the 0..1 scale; anything else is
    refused (a std of 0 divides by zero)."""
    overrides = ["data.dataset=digits", f"data.mean=[0.5,{mean},0.5]", f"data.std=[0.5,0.5,{std}]"]
    if 0 <= mean <= 1 and 0 < std <= 1:
        assert load_config([DEBUG_CONFIG], overrides).data.mean[1] == mean
    else:
        with pytest.raises(ConfigError, match=rf"'data\.{'mean' if not 0 <= mean <= 1 else 'std'}' must be "):
            load_config([DEBUG_CONFIG], overrides)


def test_an_auto_augment_policy_timm_cannot_read_is_a_config_error_and_the_fixed_command_runs(tmp_path):
    common = [f"out_dir={tmp_path / 'r'}", "model.name=vit_nano", "train.max_steps=1",
              "log.tensorboard=false"]
    with pytest.raises(ConfigError, match=r"data.auto_augment='rand-x9' is not a policy timm can read"):
        train.main(load_config([DEMO_CONFIG], common + ["data.auto_augment=rand-x9"]))
    result = train.main(load_config([DEMO_CONFIG], common + ["data.auto_augment=rand-m9-mstd0.5"]))
    assert result.state.step == 1 and os.listdir(tmp_path / "r" / "archive")


def test_every_normalization_timm_records_for_pretrained_weights_loads():
    """The weights' own data.mean / data.std (README: hub weights) stay settable: every pretrained_cfg's."""
    import timm
    from timm.models import get_pretrained_cfg

    pairs = {(tuple(c.mean), tuple(c.std)) for name in timm.list_pretrained()
             if (c := get_pretrained_cfg(name)) is not None and c.mean is not None and len(c.mean) == 3}
    assert len(pairs) > 3  # ImageNet's, Inception's, CLIP's, DPN's, ...
    for mean, std in pairs:
        cfg = load_config([DEBUG_CONFIG], ["data.dataset=digits", f"data.mean={list(mean)}", f"data.std={list(std)}"])
        assert (cfg.data.mean, cfg.data.std) == (mean, std)

"""Config loading: every recipe loads, overrides are strict and typed, precedence is defaults < YAML < CLI."""
import functools
import glob
import os
import re

import pytest
import yaml

from configs import Config, ConfigError, config_from_dict, config_to_dict, load_config
from tests.conftest import DEBUG_CONFIG, DEMO_CONFIG, ROOT

ALL_YAML = sorted(p for p in glob.glob(os.path.join(ROOT, "configs", "**", "*.yaml"), recursive=True)
                  if os.sep + "sweeps" + os.sep not in p)  # sweep files are checked in test_scripts.py


def test_there_are_recipes():
    names = {os.path.relpath(p, ROOT) for p in ALL_YAML}
    for required in ("configs/demo/vit_digits.yaml", "configs/debug/tiny.yaml", "configs/pretrain/vit_b.yaml",
                     "configs/pretrain/swin_t.yaml", "configs/finetune/vit_b_in21k.yaml"):
        assert required in names


@pytest.mark.parametrize("path", ALL_YAML, ids=lambda p: os.path.relpath(p, ROOT))
def test_every_yaml_loads(path):
    cfg = load_config([path])
    assert isinstance(cfg, Config)
    # a recipe round-trips through the plain form stored in checkpoints
    assert config_from_dict(config_to_dict(cfg)) == cfg


def test_precedence_defaults_then_files_in_order_then_overrides(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("optim:\n  lr: 0.1\n  weight_decay: 0.2\ntrain:\n  seed: 3\n")
    b.write_text("optim:\n  lr: 0.3\n")
    cfg = load_config([str(a), str(b)], ["train.seed=7"])
    assert cfg.optim.lr == 0.3  # the later file wins
    assert cfg.optim.weight_decay == 0.2  # kept from the first file
    assert cfg.train.seed == 7  # the command line wins over files
    assert cfg.optim.eps == Config().optim.eps  # untouched keys keep their defaults


def test_scientific_notation_and_yaml_values():
    cfg = load_config(None, ["optim.lr=1e-3", "optim.clip_grad=5", "data.mean=[0.5, 0.5, 0.5]",
                             "optim.layer_decay=null", "train.compile=true"])
    assert cfg.optim.lr == pytest.approx(1e-3) and isinstance(cfg.optim.lr, float)
    assert cfg.optim.clip_grad == 5.0 and isinstance(cfg.optim.clip_grad, float)
    assert cfg.data.mean == (0.5, 0.5, 0.5)
    assert cfg.optim.layer_decay is None and cfg.train.compile is True


def test_unknown_key_names_the_key_and_close_matches():
    with pytest.raises(ConfigError, match=r"unknown config key 'optim.lrr'; did you mean 'optim.lr'\?"):
        load_config(None, ["optim.lrr=1e-3"])
    with pytest.raises(ConfigError, match=r"unknown config key 'trian.seed'; did you mean 'train.seed'"):
        load_config(None, ["trian.seed=1"])
    with pytest.raises(ConfigError, match=r"unknown config key 'model.xyzzy'; valid keys in section 'model': "
                                          r"attn, drop, "):
        load_config(None, ["model.xyzzy=1"])


@pytest.mark.parametrize("typed, meant", [
    ("train.epochs", "sched.epochs"),  # the right name in another section
    ("epochs", "sched.epochs"),  # the section left out
    ("lr", "optim.lr"),
    ("data.epochs", "sched.epochs"),
    ("sched.warmup_epoch", "sched.warmup_epochs"),
    ("train.label_smoothing", "data.label_smoothing"),
    ("quant.aphq.iter", "quant.aphq.iters"),  # nested sections too
    ("cd.lambda", "cd.lam"),
])
def test_did_you_mean_searches_every_section(typed, meant):
    with pytest.raises(ConfigError, match=rf"unknown config key '{typed}'; did you mean '{meant}'"):
        load_config(None, [f"{typed}=1"])


def test_unknown_key_in_a_file_names_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  nmae: vit_micro\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: unknown config key 'model.nmae'.*'model.name'"):
        load_config([str(bad)])


@pytest.mark.parametrize("override, message", [
    ("train.batch_size=1.5", "expects int"),
    ("optim.weight_decay=abc", "expects float"),
    ("train.amp=fp8", "must be one of"),
    ("cd.targets=D", "must be one of"),
    ("train.compile=1", "expects bool"),
    # YAML's true / false / no are bools, which Python counts as 0 and 1: not a batch size, a decay or a name
    ("train.batch_size=true", r"'train.batch_size' expects int, got True \(bool\)"),
    ("optim.weight_decay=false", r"'optim.weight_decay' expects float, got False \(bool\)"),
    ("data.auto_augment=no", r"'data.auto_augment' expects str, got False \(bool\)"),
    ("model.name=123", r"'model.name' expects str, got 123 \(int\)"),
    ("model=vit", "is a section"),
    ("optim.lr.x=1", "has no sub-key"),
    ("no_equals_sign", "key=value"),
    ("optim.lr=-1", r"'optim.lr' must be > 0 and below float32's largest number, 3.40282e\+38; got -1"),
    ("sched.epochs=0", r"'sched.epochs' must be >= 1; got 0"),
    ("train.batch_size=0", r"'train.batch_size' must be >= 1"),
    ("model.drop_path=1.0", r"must be >= 0 and < 1"),
    ("data.reprob=1.5", r"must be >= 0 and <= 1"),
    ("tweo.tau=0", r"'tweo.tau' must be > 0"),
    ("optim.lr=[1", "not valid YAML"),
    # .nan passed every range (comparisons are False): drop_path / hflip / label smoothing turned off, the
    # divergence guard disarmed, or a traceback deep in timm; .inf is no rate either
    ("model.drop_path=.nan", r"'model.drop_path' must be a finite number; got nan"),
    ("data.hflip=.nan", r"'data.hflip' must be a finite number"),
    ("train.divergence_factor=.nan", r"'train.divergence_factor' must be a finite number"),
    ("sched.warmup_epochs=.inf", r"'sched.warmup_epochs' must be a finite number; got inf"),
    ("optim.lr=.inf", r"'optim.lr' must be a finite number"),
])
def test_wrong_values_are_clear_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


@pytest.mark.parametrize("words, fix", [
    (["optim.lr", "1e-3"], "; give optim.lr=1e-3, one word"),  # `optim.lr 1e-3`, as a flag takes its value
    (["train.seed"], "; give train.seed=VALUE, one word"),
    (["sched.epochs", "--print-config"], "; give sched.epochs=VALUE, one word"),
])
def test_a_word_without_an_equals_sign_is_refused_with_what_was_meant(words, fix):
    """The refusal named the word alone: `optim.lr 1e-3`, as a flag takes its value, was left to the user to read as
    what it is (a YAML file without --config: tests/test_cli.py)."""
    with pytest.raises(ConfigError) as refused:
        load_config(None, words)
    assert str(refused.value) == f"override {words[0]!r} is not of the form key=value{fix}"


def test_a_word_without_an_equals_sign_that_names_no_key_or_file_names_no_fix():
    for word in ("optim", "lr", "no_equals_sign", "configs/debug/tiny.yaml"):  # a section; no dotted key; nothing; a
        # file (the entries with --config say so: configs/cli.parse_known)
        with pytest.raises(ConfigError) as refused:
            load_config(None, [word])
        assert str(refused.value) == f"override {word!r} is not of the form key=value"


@pytest.mark.parametrize("key", ["optim.lr", "optim.lr_base", "sched.warmup_lr", "sched.min_lr"])
@pytest.mark.parametrize("value", ["1e39", "3.5e38", "3.4028234663852886e38", "1e38", "1e-3"])
def test_a_learning_rate_beyond_float32_is_refused_as_the_config_loads(key, value):
    """torch steps float32 weights with the lr as a float32 scalar: optim.lr=1e39 passed the config and ended the
    first update past warmup in a traceback from inside torch ("value cannot be converted to type float without
    overflow"). The reference: torch's own float32 limit and that same conversion, made here."""
    import torch

    limit = torch.finfo(torch.float32).max
    try:
        torch.zeros(1).add_(torch.ones(1), alpha=float(value))  # the conversion torch's optimizers make of an lr
        converts = True
    except RuntimeError:
        converts = False
    assert converts is (float(value) <= limit)
    if float(value) < limit:
        assert getattr(getattr(load_config(None, [f"{key}={value}"]), key.split(".")[0]), key.split(".")[1]) \
            == float(value)
        return
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"{key}={value}"])
    assert re.search(rf"'{re.escape(key)}' must be .*below float32's largest number, 3.40282e\+38; got ", str(e.value))
    assert "\n" not in str(e.value)


def test_ranges_let_none_and_boundaries_through():
    cfg = load_config(None,
                      ["optim.lr=null", "train.ckpt_every_steps=0", "data.reprob=1", "optim.lr_base=1e-9"])
    assert cfg.optim.lr is None and cfg.train.ckpt_every_steps == 0 and cfg.data.reprob == 1.0


def test_yaml_syntax_error_names_the_file_and_line(tmp_path):
    bad = tmp_path / "broken.yaml"
    bad.write_text("model:\n  name: [vit_micro\n")
    with pytest.raises(ConfigError, match=r"broken.yaml: not valid YAML: .*\(line 3"):
        load_config([str(bad)])


def test_a_control_character_in_yaml_is_one_line_naming_its_offset(tmp_path):
    """PyYAML's reader error carries a multi-line context dump and no line number."""
    bad = tmp_path / "bell.yaml"
    bad.write_text("optim:\n  lr: 0.1\x07\n")
    with pytest.raises(ConfigError) as caught:
        load_config([str(bad)])
    assert str(caught.value) == f"{bad}: not valid YAML: unacceptable character #x0007 at character 17"


@pytest.mark.parametrize("text, message", [
    ("optim.lr: 0.1\noptim:\n  lr: 0.2\n", r"optim.lr is set twice, under 'optim.lr' and under 'optim'"),
    ("model:\n  kwargs: {depth: 5}\nmodel.kwargs.depth: 4\n",
     r"model.kwargs.depth is set twice, under 'model' and under 'model.kwargs.depth'"),
    ("model.kwargs.depth: 4\nmodel:\n  kwargs: {depth: 5}\n",  # the longer spelling first
     r"model.kwargs.depth is set twice, under 'model.kwargs.depth' and under 'model'"),
])
def test_one_key_spelt_twice_in_one_file_is_an_error(tmp_path, text, message):
    """The YAML check of repeated keys compares keys as written: the later spelling replaced the earlier."""
    path = tmp_path / "twice.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"twice.yaml: {message}; keep one"):
        load_config([str(path)])


@pytest.mark.parametrize("overrides, later, key, earlier", [
    (["optim.lr=1e-3", "optim.lr=5e-2"], "optim.lr=5e-2", "optim.lr", "optim.lr=1e-3"),
    (["optim.lr=1e-3", "optim.lr=1e-3"], "optim.lr=1e-3", "optim.lr", "optim.lr=1e-3"),
    (["train={seed: 2}", "train.seed=5"], "train.seed=5", "train.seed", "train={seed: 2}"),
    (["train.seed=5", "train={seed: 2}"], "train={seed: 2}", "train.seed", "train.seed=5"),
    (["optim={lr: 1e-3}", "optim={weight_decay: 0, lr: 1e-3}"], "optim={weight_decay: 0, lr: 1e-3}", "optim.lr",
     "optim={lr: 1e-3}"),
    (["model.kwargs={depth: 2}", "model.kwargs.depth=3"], "model.kwargs.depth=3", "model.kwargs.depth",
     "model.kwargs={depth: 2}"),
    (["model.kwargs=null", "model.kwargs.depth=2", "model={kwargs: {depth: 3}}"], "model={kwargs: {depth: 3}}",
     "model.kwargs.depth", "model.kwargs.depth=2"),
    (["model.kwargs=null", "model.kwargs=null"], "model.kwargs=null", "model.kwargs", "model.kwargs=null"),
])
def test_one_key_given_twice_in_the_overrides_is_an_error(overrides, later, key, earlier):
    """As a key twice in a file: the later item replaced the earlier one, whichever spelling each had (optim.lr
    came out 5e-2, train.seed 5 or 2 by the order of the items)."""
    with pytest.raises(ConfigError) as caught:
        load_config([DEBUG_CONFIG], overrides)
    assert str(caught.value) == f"override {later!r} sets {key}, which the override {earlier!r} sets already; keep one"


def test_overrides_of_other_keys_or_dict_entries_are_not_given_twice():
    """Distinct keys of one section, distinct entries of a dict field (an entry's name may hold a dot: 'mlp' and
    'mlp.cfg' are two), and a dict emptied by null before its entries are given: each item sets its own."""
    cfg = load_config([DEBUG_CONFIG], ["train={seed: 2}", "train.device=cpu", "model.kwargs={depth: 2}",
                                       "model.kwargs.mlp=1", "model.kwargs.mlp.cfg=2"])
    assert (cfg.train.seed, cfg.train.device) == (2, "cpu")
    assert cfg.model.kwargs == {"depth": 2, "mlp": 1, "mlp.cfg": 2}
    recipe = os.path.join(ROOT, "configs/method/cd_finetune.yaml")  # lam_per_role {fc2: 0.02}
    assert load_config([recipe], ["cd.lam_per_role=null", "cd.lam_per_role.fc1=0.01",
                                  "cd={lam_per_role: {fc2: 0.5}}"]).cd.lam_per_role == {"fc1": 0.01, "fc2": 0.5}
    # emptied after an entry was given: the entry would be dropped
    with pytest.raises(ConfigError, match=r"override 'cd.lam_per_role=null' sets cd.lam_per_role, which the override "
                                          r"'cd.lam_per_role.fc1=0.01' sets already; keep one \(or empty the dict "
                                          r"before giving its entries\)$"):
        load_config([recipe], ["cd.lam_per_role.fc1=0.01", "cd.lam_per_role=null"])


def test_a_config_file_that_is_not_text_is_one_error(tmp_path):
    """A checkpoint given as --config was a UnicodeDecodeError traceback."""
    path = tmp_path / "best.pt"
    path.write_bytes(b"PK\x03\x04\x80\x81\xfe binary")
    with pytest.raises(ConfigError, match=r"best.pt: not a YAML text file \(not UTF-8 text: a checkpoint"):
        load_config([str(path)])


def test_dict_fields_take_dotted_keys():
    cfg = load_config(None, ["cd.enabled=true", "cd.lam_per_role.fc2=0.02", "model.kwargs.depth=4"])
    assert cfg.cd.lam_per_role == {"fc2": 0.02}
    assert cfg.model.kwargs == {"depth": 4}
    # a mapping as the value of a dotted key inside a dict field is one entry, as a number is (it was a KeyError)
    assert load_config(None, ["model.kwargs.mlp.cfg={hidden: 4}"]).model.kwargs == {"mlp.cfg": {"hidden": 4}}
    assert load_config(None, ["model.kwargs.mlp.cfg=4"]).model.kwargs == {"mlp.cfg": 4}
    # null clears a recipe's dict; {} would add nothing to it, and is refused naming null
    recipe = os.path.join(ROOT, "configs/method/cd_finetune.yaml")
    assert load_config([recipe], ["cd.lam_per_role=null"]).cd.lam_per_role == {}
    with pytest.raises(ConfigError, match="changes nothing.*give null to empty it"):
        load_config([recipe], ["cd.lam_per_role={}"])
    assert load_config(None, ["model.kwargs={}"]).model.kwargs == {}  # the default's empty dict: nothing to keep


def test_a_mapping_for_a_dict_field_adds_to_what_earlier_layers_gave(tmp_path):
    """As a section's keys do: a later file (or an override) that gives model.kwargs a mapping changes the entries
    it names and keeps the others, which replacing the dict dropped without a word."""
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text("model: {kwargs: {depth: 5, embed_dim: 64}}\n")
    second.write_text("model:\n  kwargs: {depth: 2, num_heads: 4}\n")
    want = {"depth": 2, "embed_dim": 64, "num_heads": 4}
    assert load_config([str(first), str(second)]).model.kwargs == want
    assert load_config([str(first)], ["model.kwargs={depth: 2, num_heads: 4}"]).model.kwargs == want
    assert load_config([str(first)], ["model.kwargs.depth=2", "model.kwargs.num_heads=4"]).model.kwargs == want
    assert load_config([str(first)], ["model.kwargs=null", "model.kwargs={depth: 2}"]).model.kwargs == {"depth": 2}


def test_missing_config_file_is_an_error():
    with pytest.raises(ConfigError, match="not found"):
        load_config(["configs/nope.yaml"])


RECIPES = {
    # DeiT (facebookresearch/deit main.py defaults): all ViT sizes share the recipe
    "configs/pretrain/vit_b.yaml": {
        "model.name": "vit_base_patch16_224", "model.drop_path": 0.1, "train.batch_size": 1024,
        "optim.lr_base": 5e-4, "optim.lr_base_batch": 512, "optim.weight_decay": 0.05,
        "optim.clip_grad": None, "sched.epochs": 300, "sched.warmup_epochs": 5, "sched.warmup_prefix": False,
        "sched.per_step": False, "sched.warmup_lr": 1e-6, "sched.min_lr": 1e-5, "data.mixup": 0.8,
        "data.cutmix": 1.0, "data.label_smoothing": 0.1, "data.auto_augment": "rand-m9-mstd0.5-inc1",
        "data.reprob": 0.25, "data.repeated_aug": 3, "data.crop_pct": 0.875, "data.interpolation": "bicubic",
        "train.amp": "fp16", "train.ema": False},
    # Swin (microsoft/Swin-Transformer swin_tiny_patch4_window7_224.yaml + config.py)
    "configs/pretrain/swin_t.yaml": {
        "model.name": "swin_tiny_patch4_window7_224", "model.drop_path": 0.2, "optim.clip_grad": 5.0,
        "sched.warmup_epochs": 20, "sched.warmup_prefix": True, "sched.per_step": True,
        "data.repeated_aug": 0, "sched.warmup_lr": 1e-6, "sched.min_lr": 1e-5, "train.batch_size": 1024},
    # the paper's fine-tuning appendix
    "configs/finetune/vit_b_in21k.yaml": {
        "model.name": "vit_base_patch16_224.orig_in21k", "train.batch_size": 64, "optim.lr": 5e-4,
        "optim.weight_decay": 0.05, "optim.layer_decay": 0.9, "model.drop_path": 0.1,
        "data.label_smoothing": 0.1, "sched.epochs": 80, "sched.warmup_epochs": 5,
        "sched.warmup_prefix": True, "data.mixup": 0.0, "data.auto_augment": "rand-m9-mstd0.5-inc1",
        "data.reprob": 0.25, "data.remode": "pixel", "data.hflip": 0.5, "train.eval_batch_size_per_gpu": 256},
    "configs/method/cd.yaml": {"cd.enabled": True, "cd.lam": 0.005, "cd.targets": "A+B", "cd.budget": True},
    "configs/method/cd_finetune.yaml": {"cd.lam": 0.01, "cd.lam_per_role": {"fc2": 0.02}},
    "configs/method/tweo.yaml": {"tweo.enabled": True, "tweo.p": 4.0, "tweo.tau": 3.0},
}


@pytest.mark.parametrize("path", sorted(RECIPES))
def test_recipes_hold_the_published_values(path):
    cfg = load_config([os.path.join(ROOT, path)])
    for key, expected in RECIPES[path].items():
        section, name = key.split(".")
        assert getattr(getattr(cfg, section), name) == expected, key


def test_deit_lr_rule_gives_1e3_at_batch_1024():
    from engine.optim import peak_lr

    assert (peak_lr(load_config([os.path.join(ROOT, "configs/pretrain/vit_b.yaml")]).optim, 1024)
            == pytest.approx(1e-3))


def test_sqrt_lr_rule_and_a_given_lr():
    """optim.lr_scaling=sqrt: lr_base * sqrt(global_batch / lr_base_batch) (5e-4 * sqrt(2048/512) = 1e-3); a
    given optim.lr is the lr whatever the batch."""
    from configs.schema import OptimConfig
    from engine.optim import peak_lr

    assert peak_lr(OptimConfig(lr_base=5e-4, lr_base_batch=512, lr_scaling="sqrt"), 2048) == pytest.approx(1e-3)
    assert peak_lr(OptimConfig(lr_base=5e-4, lr_base_batch=512, lr_scaling="sqrt"), 128) == pytest.approx(2.5e-4)
    assert peak_lr(OptimConfig(lr=3e-4, lr_base=5e-4, lr_base_batch=512), 2048) == 3e-4


def test_the_logged_lr_rule_names_the_lr_that_runs():
    """The run log's lr line: a given optim.lr as given (not lr_base), else the scaled value with its factors
    (5e-4 x 1024/512 = 1e-3; 5e-4 x sqrt(2048/512) = 1e-3)."""
    from configs.schema import OptimConfig
    from engine.optim import lr_rule

    assert lr_rule(OptimConfig(lr=3e-4, lr_base=5e-4, lr_base_batch=512), 2048) == "lr 0.0003 (given)"
    assert lr_rule(OptimConfig(lr_base=5e-4, lr_base_batch=512), 1024) == "lr 0.001 = 0.0005 x linear(1024/512)"
    assert (lr_rule(OptimConfig(lr_base=5e-4, lr_base_batch=512, lr_scaling="sqrt"), 2048)
            == "lr 0.001 = 0.0005 x sqrt(2048/512)")


def test_first_last_preset_sets_stem_and_head_bits_of_every_pipeline():
    from engine.quant_settings import quant_settings
    from quant import plan

    cfg = load_config([], ["quant.first_last=w8a8"])
    for name in ("percentile", "repq", "aphq", "gplq"):
        options = plan.pipeline_options(cfg, name)
        bits = (options.stem_w_bits, options.stem_a_bits, options.head_w_bits, options.head_a_bits)
        assert bits == (8, 8, 8, 8)
    official = plan.pipeline_options(load_config([], []), "aphq")
    assert official.stem_a_bits == 0  # APHQ's own: the image input stays float
    assert quant_settings(cfg, "repq")["options"]["head_w_bits"] == 8  # recorded with the result
    with pytest.raises(ConfigError, match="first_last"):
        load_config([], ["quant.first_last=w4a4"])
    # a pipeline's own stem / head bits beside the preset, which replaces them, are refused (scored at W8A8)
    with pytest.raises(ConfigError, match=r"quant.repq.head_a_bits=4 would be ignored: .* quant.first_last is "
                                          r"official, and it is w8a8"):
        load_config([], ["quant.first_last=w8a8", "quant.repq.head_a_bits=4"])


def test_a_key_twice_in_a_file_names_the_file_the_key_and_the_lines(tmp_path):
    twice = tmp_path / "twice.yaml"
    twice.write_text("optim:\n  lr: 0.1\ntrain:\n  seed: 3\noptim:\n  weight_decay: 0.2\n")
    with pytest.raises(ConfigError, match=r"twice.yaml: .*key 'optim' appears twice \(lines 1 and 5\)"):
        load_config([str(twice)])
    twice.write_text("optim:\n  lr: 0.1\n  weight_decay: 0.2\n  lr: 0.3\n")
    with pytest.raises(ConfigError, match=r"twice.yaml: .*key 'lr' appears twice \(lines 2 and 4\)"):
        load_config([str(twice)])
    with pytest.raises(ConfigError, match=r"key 'fc2' appears twice"):  # a value on the command line too
        load_config(None, ["cd.enabled=true", "cd.lam_per_role={fc2: 0.1, fc2: 0.2}"])
    # YAML merge keys may be overridden key by key, as YAML means them to
    twice.write_text("model:\n  kwargs: &base {depth: 2, embed_dim: 64}\ncd:\n  enabled: true\n  lam_per_role:\n"
                     "    <<: *base\n    depth: 3\n")
    assert load_config([str(twice)]).cd.lam_per_role == {"depth": 3, "embed_dim": 64}


IGNORED = [  # (config, overrides, the key refused): each override is one the config never reads
    ("configs/demo/vit_digits.yaml", ["data.root=/x", "model.name=deit_tiny_patch16_224"], "data.root"),
    ("configs/demo/vit_digits.yaml", ["data.val_split=validation"], "data.val_split"),
    ("configs/debug/tiny.yaml", ["data.digits_img_size=16"], "data.digits_img_size"),
    ("configs/pretrain/vit_b.yaml", ["data.synthetic_train_size=8"], "data.synthetic_train_size"),
    ("configs/demo/vit_digits.yaml", ["optim.lr_base=1e-3"], "optim.lr_base"),  # the demo sets optim.lr
    ("configs/pretrain/vit_b.yaml", ["cd.lam=0.01"], "cd.lam"),  # CD is off: a baseline would run
    ("configs/pretrain/vit_b.yaml", ["cd={lam: 0.01}"], "cd.lam"),
    ("configs/pretrain/vit_b.yaml", ["cd.lam_per_role.fc2=0.02"], "cd.lam_per_role.fc2"),
    ("configs/method/cd.yaml", ["cd.loss_coef=0.01"], "cd.loss_coef"),  # decoupled mode has no loss
    ("configs/method/cd.yaml", ["cd.mode=loss", "cd.matmul_precision=bf16"], "cd.matmul_precision"),  # fp32 loss
    ("configs/method/cd.yaml", ["cd.targets=A", "cd.matmul_precision=bf16"], "cd.matmul_precision"),  # no product
    ("configs/pretrain/vit_b.yaml", ["tweo.lam=0.1"], "tweo.lam"),
    ("configs/pretrain/vit_b.yaml", ["train.ema_decay=0.999"], "train.ema_decay"),
    ("configs/pretrain/vit_b.yaml", ["model.pretrained_strict=true"], "model.pretrained_strict"),  # "" is unset
    ("configs/lm/gpt2.yaml", ["data.kjv_val_fraction=0.2"], "data.kjv_val_fraction"),
    # a deciding override does not excuse a key it makes unread: the LM would train without the mixup asked for
    ("configs/pretrain/vit_b.yaml", ["data.dataset=kjv", "data.mixup=0.5"], "data.mixup"),
    ("configs/pretrain/vit_b.yaml", ["data.dataset=synthetic", "data.hflip=0.2"], "data.hflip"),
    ("configs/lm/gpt2.yaml", ["sched.warmup_epochs=2"], "sched.warmup_epochs"),  # the length is sched.steps
    ("configs/pretrain/vit_b.yaml", ["sched.warmup_steps=100"], "sched.warmup_steps"),
    ("configs/pretrain/vit_b.yaml", ["optim.momentum=0.8"], "optim.momentum"),  # adamw
    ("configs/pretrain/vit_b.yaml", ["optim.name=sgd", "optim.betas=[0.8, 0.9]"], "optim.betas"),
    ("configs/pretrain/vit_b.yaml", ["data.color_jitter=0.4"], "data.color_jitter"),  # timm: off with a policy
    # the demo's data.reprob is 0: timm's train transform has no RandomErasing, whose fill and count these are
    ("configs/demo/vit_digits.yaml", ["data.remode=const"], "data.remode"),
    ("configs/demo/vit_digits.yaml", ["data.recount=3"], "data.recount"),
    ("configs/lm/gpt2.yaml", ["optim.lr_scaling=sqrt"], "optim.lr_scaling"),  # a set optim.lr is the lr
    # quantization options whose step is off: APHQ without MLP reconstruction, GPLQ without PCA loss or QwT
    ("configs/demo/vit_digits.yaml", ["quant.aphq.mlp_iters=5"], "quant.aphq.mlp_iters"),
    ("configs/demo/vit_digits.yaml", ["quant.gplq.pca_weight=0", "quant.gplq.pca_images=64"],
     "quant.gplq.pca_images"),
    # details of a part that is off: no Mixup is built, no switch between mixup and cutmix, no warmup, no
    # divergence guard, no wandb (each was taken, recorded in config.yaml, and changed nothing)
    ("configs/demo/vit_digits.yaml", ["data.mixup_prob=0.5"], "data.mixup_prob"),
    ("configs/demo/vit_digits.yaml", ["data.mixup_mode=elem"], "data.mixup_mode"),
    ("configs/pretrain/vit_b.yaml", ["data.mixup=0", "data.mixup_switch_prob=0.2"], "data.mixup_switch_prob"),
    ("configs/demo/vit_digits.yaml", ["sched.warmup_epochs=0", "sched.warmup_lr=1e-7"], "sched.warmup_lr"),
    ("configs/pretrain/vit_b.yaml", ["train.divergence_factor=null", "train.divergence_windows=5"],
     "train.divergence_windows"),
    ("configs/demo/vit_digits.yaml", ["log.wandb_project=mine"], "log.wandb_project"),
    # replaced by the W8A8 preset (configs/quant.py with_first_last): the 4-bit head asked for was scored at 8
    ("configs/demo/vit_digits.yaml", ["quant.first_last=w8a8", "quant.percentile.head_w_bits=4"],
     "quant.percentile.head_w_bits"),
    # the APH is not computed for a plain-MSE reconstruction without the MLP step
    ("configs/demo/vit_digits.yaml", ["quant.aphq.loss=mse", "quant.aphq.temperature=1"], "quant.aphq.temperature"),
    # quant.aphq.iters=0 is calibration only: nothing of the reconstruction, nor the APH, is read
    ("configs/demo/vit_digits.yaml", ["quant.aphq.iters=0", "quant.aphq.weight_lr=0.01"], "quant.aphq.weight_lr"),
    ("configs/demo/vit_digits.yaml", ["quant.aphq.iters=0", "quant.aphq.loss=mse"], "quant.aphq.loss"),
    ("configs/demo/vit_digits.yaml", ["quant.aphq.iters=0", "quant.aphq.hessian_eps=1e-5"], "quant.aphq.hessian_eps"),
    ("configs/demo/vit_digits.yaml", ["quant.aphq.iters=0", "quant.aphq.log_every=10"], "quant.aphq.log_every"),
]


@pytest.mark.parametrize("path, overrides, key", IGNORED, ids=[i[2] for i in IGNORED])
def test_an_override_the_config_would_ignore_is_refused(path, overrides, key):
    with pytest.raises(ConfigError, match=rf"{re.escape(key)}=.* would be ignored: {re.escape(key)} is read "
                                          r"only when .*; drop it or set .* as well"):
        load_config([os.path.join(ROOT, path)], overrides)


def test_random_erasing_fill_and_count_are_read_where_timm_builds_random_erasing():
    """timm's create_transform adds RandomErasing (mode = data.remode, max_count = data.recount) only at re_prob > 0:
    at data.reprob=0 the two change nothing, and an override of them is refused."""
    from timm.data.random_erasing import RandomErasing

    from configs.cli import field_help
    from configs.schema import DataConfig
    from data.transforms import build_transform

    def erasing(overrides):
        data = load_config([DEMO_CONFIG], overrides).data
        return [t for t in build_transform(data, 32, is_training=True).transforms if isinstance(t, RandomErasing)]

    assert erasing([]) == []  # the demo's reprob 0
    (built,) = erasing(["data.reprob=0.5", "data.remode=const", "data.recount=3"])
    assert (built.probability, built.mode, built.max_count) == (0.5, "const", 3)
    # timm draws each image's count from min_count..max_count, each region 1/count of the area: what the help says
    assert built.min_count == 1
    assert "uniformly from 1 to recount" in field_help(DataConfig, "recount")
    with pytest.raises(ConfigError, match=r"data.recount=3 would be ignored: data.recount is read only when "
                                          r"data.reprob is nonzero, and it is 0.0"):
        load_config([DEMO_CONFIG], ["data.recount=3"])


@pytest.mark.parametrize("path, overrides", [
    ("configs/demo/vit_digits.yaml", ["data.dataset=folder", "data.root=/datasets/x"]),  # read once switched
    ("configs/pretrain/vit_b.yaml", ["data.root=/datasets/x", "data.val_split=validation"]),
    ("configs/pretrain/vit_b.yaml", ["optim.lr_base=1e-3"]),  # no optim.lr: the scaling rule reads it
    ("configs/pretrain/vit_b.yaml", ["cd.enabled=true", "cd.lam=0.01"]),
    ("configs/pretrain/vit_b.yaml", ["cd={enabled: true, lam: 0.01}"]),
    ("configs/method/cd.yaml", ["cd.enabled=false", "cd.lam=0.01"]),  # says itself that CD is off (sweeps)
    ("configs/method/cd.yaml", ["cd.mode=loss", "cd.loss_coef=0.01"]),
    ("configs/pretrain/vit_b.yaml", ["data.mixup_prob=0.5", "data.mixup_switch_prob=0.2"]),  # both on
    ("configs/demo/vit_digits.yaml", ["data.mixup=0.2", "data.mixup_prob=0.5"]),  # mixup switched on with it
    ("configs/pretrain/vit_b.yaml", ["sched.warmup_lr=1e-7"]),  # 5 warmup epochs
    ("configs/lm/gpt2.yaml", ["sched.warmup_lr=0.0"]),  # its sched.warmup_steps
    ("configs/demo/vit_digits.yaml", ["log.wandb=true", "log.wandb_project=mine"]),
    ("configs/demo/vit_digits.yaml", ["quant.repq.head_a_bits=8"]),  # first_last official: each pipeline's own
    ("configs/demo/vit_digits.yaml", ["quant.aphq.loss=mse", "quant.aphq.mlp_reconstruct=true",
                                      "quant.aphq.hessian_probe=rademacher"]),
    ("configs/pretrain/vit_b.yaml", ["cd.gated_mlp=true"]),  # CD off: still picks a baseline's logged pairs
    ("configs/lm/gpt2.yaml", ["data.root=/datasets/tokens", "data.val_windows=20"]),  # token files
    ("configs/lm/kjv_nano.yaml", ["data.val_windows=20", "data.kjv_val_fraction=0.2"]),
    ("configs/pretrain/vit_b.yaml", ["optim.name=momentum", "optim.momentum=0.8"]),
    ("configs/pretrain/vit_b.yaml", ["optim.name=lamb", "optim.betas=[0.8, 0.9]", "optim.eps=1e-6"]),
    ("configs/pretrain/vit_b.yaml", ["data.auto_augment=", "data.color_jitter=0.4"]),
    ("configs/demo/vit_digits.yaml", ["data.reprob=0.5", "data.remode=const", "data.recount=3"]),
    ("configs/pretrain/vit_b.yaml", ["data={remode: rand, recount: 2}"]),  # its reprob 0.25
    ("configs/demo/vit_digits.yaml", ["quant.aphq.mlp_reconstruct=true", "quant.aphq.mlp_iters=5"]),
    # MR trains (and reads the APH) at quant.aphq.iters=0 too, for its own mlp_iters
    ("configs/demo/vit_digits.yaml", ["quant.aphq.iters=0", "quant.aphq.mlp_reconstruct=true",
                                      "quant.aphq.mlp_iters=5", "quant.aphq.temperature=5",
                                      "quant.aphq.log_every=10"]),
    ("configs/demo/vit_digits.yaml", ["quant.gplq.pca_weight=0.5", "quant.gplq.pca_images=64"]),
    ("configs/demo/vit_digits.yaml", ["quant.gplq.pca_images=64", "quant.gplq.stage2_images=64"]),  # defaults on
    ("configs/demo/vit_digits.yaml", ["quant.gplq.matmul_percentile=0.9"]),  # operands quantized by default
])


def test_an_override_the_config_reads_is_taken(path, overrides):
    """Not refused, and each value given is the config's: a mapping (cd={...}) sets its entries."""
    cfg = load_config([os.path.join(ROOT, path)], overrides)
    for item in overrides:
        key, _, raw = item.partition("=")
        want = _as_written(raw)
        for sub, value in want.items() if isinstance(want, dict) else [(None, want)]:
            dotted = key if sub is None else f"{key}.{sub}"
            got = functools.reduce(getattr, dotted.split("."), cfg)
            assert (list(got) if isinstance(got, tuple) else got) == value, (item, dotted, got)


def _as_written(raw: str):
    """An override's value as PyYAML reads it (not configs' own reader), with YAML 1.2's `1e-3` a float (YAML 1.1
    reads it as text) and nothing after '=' the empty string."""
    if not raw.strip():
        return ""
    value = yaml.safe_load(raw)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def test_a_gplq_qwt_setting_over_a_config_without_qwt_is_refused(tmp_path):
    """GPLQ's stage 2 draws images only for QwT's fits: stage2_images over a config whose QwT is off would be
    ignored, and so it would beside an explicit qwt=false (a step's switch, not a whole section's as cd.enabled)."""
    no_qwt = tmp_path / "no_qwt.yaml"
    no_qwt.write_text("quant:\n  gplq:\n    qwt: false\n")
    with pytest.raises(ConfigError, match=r"quant.gplq.stage2_images=64 would be ignored: .* read only when "
                                          r"quant.gplq.qwt is true, and it is false"):
        load_config([str(no_qwt)], ["quant.gplq.stage2_images=64"])
    with pytest.raises(ConfigError, match=r"^quant.gplq.stage2_images=64 would be ignored"):
        load_config([], ["quant.gplq.qwt=false", "quant.gplq.stage2_images=64"])
    assert load_config([str(no_qwt)], ["quant.gplq.qwt=true", "quant.gplq.stage2_images=64"]).quant.gplq.qwt


def test_a_gplq_matmul_percentile_over_a_config_with_float_matmuls_is_refused(tmp_path):
    """GPLQ's matmul_percentile sets the starting range of the q, k, v and softmax quantizers, which
    matmul_operands=false leaves out: over such a config it would be ignored."""
    float_matmuls = tmp_path / "float_matmuls.yaml"
    float_matmuls.write_text("quant:\n  gplq:\n    matmul_operands: false\n")
    with pytest.raises(ConfigError, match=r"quant.gplq.matmul_percentile=0.9 would be ignored: .* read only when "
                                          r"quant.gplq.matmul_operands is true, and it is false"):
        load_config([str(float_matmuls)], ["quant.gplq.matmul_percentile=0.9"])


def test_a_leading_tilde_in_a_path_key_is_the_home_folder(tmp_path, monkeypatch):
    """The shell leaves `out_dir=~/runs/x` as it is (no shell assignment), and the run then wrote to a folder
    named '~' in the working folder; the path keys read ~ as the home folder, other text keeps it."""
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config([os.path.join(ROOT, "configs", "debug", "tiny.yaml")],
                      ["out_dir=~/runs/x", "train.resume=~/c.pt", "data.dataset=folder", "data.root=~/data",
                       "model.pretrained=~/w.pth", "log.wandb=true", "log.wandb_project=~proj"])
    assert (cfg.out_dir, cfg.train.resume, cfg.data.root, cfg.model.pretrained) == (
        f"{tmp_path}/runs/x", f"{tmp_path}/c.pt", f"{tmp_path}/data", f"{tmp_path}/w.pth")
    assert cfg.log.wandb_project == "~proj" and cfg.data.train_split == "train"
    assert load_config([], ["model.pretrained=hub"]).model.pretrained == "hub"  # timm's hub weights, no path


@pytest.mark.parametrize("override, message", [
    ("quant.aphq.weight_pct=[a, b]", r"'quant.aphq.weight_pct\[0\]' expects float, got 'a'"),
    ("quant.aphq.weight_pct=[0.9]", r"'quant.aphq.weight_pct' expects tuple \(float, float\), got \[0.9\]"),
    ("quant.aphq.act_pct=[0.9, 1.0, 1.0]", r"'quant.aphq.act_pct' expects tuple \(float, float\)"),
    ("quant.percentile.act_percentiles=[abc]", r"'quant.percentile.act_percentiles' expects tuple of float or null"),
    ("quant.percentile.weight_percentiles=[0.9, .nan]", r"'quant.percentile.weight_percentiles\[1\]' must be a "
                                                        r"finite number"),
    ("quant.bits=[4]", r"'quant.bits\[0\]' expects str, got 4"),
    ("quant.pipelines=[1]", r"'quant.pipelines' expects list of str or null"),
    ("quant.act_max_extra_modules=[1]", r"'quant.act_max_extra_modules\[0\]' expects str"),
])
def test_the_items_of_a_typed_list_are_checked(override, message):
    """A list field whose items have a type (Tuple[float, float], list[str]) took any items: a TypeError
    ('<' between float and str) or 'not enough values to unpack' once evaluate.py read them."""
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])
    cfg = load_config(None, ["quant.aphq.weight_pct=[0.8, 1]", "quant.percentile.act_percentiles=[1]",
                             "quant.bits=[w4a4]", "quant.pipelines=[repq]"])
    assert cfg.quant.aphq.weight_pct == (0.8, 1.0) and type(cfg.quant.aphq.weight_pct[1]) is float
    assert cfg.quant.percentile.act_percentiles == (1.0,) and type(cfg.quant.percentile.act_percentiles[0]) is float
    assert cfg.quant.bits == ["w4a4"] and cfg.quant.pipelines == ["repq"]


def test_an_empty_or_comment_only_file_layers_as_nothing(tmp_path):
    for text in ("", "# nothing set here yet\n"):
        empty = tmp_path / "empty.yaml"
        empty.write_text(text)
        assert load_config([str(empty)]) == Config()
        assert load_config([DEBUG_CONFIG, str(empty)]) == load_config([DEBUG_CONFIG])


def test_a_file_key_that_an_earlier_layer_makes_unread_is_refused_naming_the_file(tmp_path):
    """A layer of folder-data settings over the digits demo: the demo's data.dataset=digits never reads
    data.root, so the run would train on the digits while the user's file names a data set folder."""
    layer = tmp_path / "imagenet_paths.yaml"
    layer.write_text("data:\n  root: /datasets/imagenet\n")
    with pytest.raises(ConfigError, match=r"imagenet_paths.yaml: data.root=/datasets/imagenet would be ignored: "
                                          r"data.root is read only when data.dataset is folder or tokens, and it is "
                                          r"digits; drop it from .*imagenet_paths.yaml, or layer it over a recipe"):
        load_config([DEMO_CONFIG, str(layer)])
    # a later layer that sets the data set again to the value it had does not make data.root read
    digits = tmp_path / "digits.yaml"
    digits.write_text("data:\n  dataset: digits\n")
    with pytest.raises(ConfigError, match=r"imagenet_paths.yaml: data.root=/datasets/imagenet would be ignored"):
        load_config([DEMO_CONFIG, str(layer), str(digits)])
    # the same file is read where the later layers read it, and a later layer that switches the data set
    # away makes it moot on purpose
    assert load_config([DEMO_CONFIG, str(layer)], ["data.dataset=folder"]).data.root == "/datasets/imagenet"
    assert load_config([os.path.join(ROOT, "configs/pretrain/vit_b.yaml"), str(layer), str(digits)]).data.dataset \
        == "digits"


def test_a_dotted_override_into_a_dict_field_keeps_its_other_entries():
    """cd_finetune.yaml sets lam_per_role {fc2: 0.02}: cd.lam_per_role.fc1=0.01 adds a role, it does not
    replace the recipe's fc2 strength; nor does a mapping value (null first empties the dict)."""
    recipe = os.path.join(ROOT, "configs/method/cd_finetune.yaml")
    assert load_config([recipe], ["cd.lam_per_role.fc1=0.01"]).cd.lam_per_role == {"fc2": 0.02, "fc1": 0.01}
    assert load_config([recipe], ["cd.lam_per_role.fc2=0.5"]).cd.lam_per_role == {"fc2": 0.5}
    assert load_config([recipe], ["cd.lam_per_role={fc1: 0.01}"]).cd.lam_per_role == {"fc2": 0.02, "fc1": 0.01}
    assert load_config([recipe], ["cd.lam_per_role=null", "cd.lam_per_role={fc1: 0.01}"]).cd.lam_per_role == {
        "fc1": 0.01}


def test_stem_and_head_bits_follow_the_main_bits_unless_set_and_zero_is_float():
    """FirstLastOptions (configs/quant.py): None takes the main w / a bits, 0 keeps that operand float, any
    other value is that many bits; at w3a6 a swapped w / a is visible (at w4a4 it is not)."""
    from types import SimpleNamespace

    from configs.quant import (APHQOptions, FirstLastOptions, GPLQOptions, PercentileOptions, RepQOptions,
                               RTNOptions, SmoothQuantOptions)

    bits = SimpleNamespace(w=3, a=6)
    assert FirstLastOptions(stem_w_bits=None, stem_a_bits=5, head_w_bits=0, head_a_bits=None).resolved(bits) == {
        "stem": {"w": 3, "a": 5}, "head": {"w": None, "a": 6}}
    assert FirstLastOptions(stem_w_bits=0, stem_a_bits=None, head_w_bits=7, head_a_bits=0).resolved(bits) == {
        "stem": {"w": None, "a": 6}, "head": {"w": 7, "a": None}}
    # the official codes' defaults: RepQ-ViT's stem input at 8 bits (percentile and GPLQ alike), APHQ's float
    # image input, and float ends for the LM pipelines
    for options in (RepQOptions(), PercentileOptions(), GPLQOptions()):
        assert options.resolved(bits) == {"stem": {"w": 3, "a": 8}, "head": {"w": 3, "a": 6}}, type(options)
    assert APHQOptions().resolved(bits) == {"stem": {"w": 3, "a": None}, "head": {"w": 3, "a": 6}}
    for options in (RTNOptions(), SmoothQuantOptions()):
        assert options.resolved(bits) == {"stem": {"w": None, "a": None}, "head": {"w": None, "a": None}}


def test_a_later_layer_that_switches_a_section_off_explicitly_makes_its_keys_moot(tmp_path):
    """cd.lam in a file over the defaults (CD off) is refused: the run would be a baseline. A later layer that
    says cd.enabled: false itself makes it moot on purpose (a sweep's baseline over a strength file), even
    though CD was off already; one that says nothing about CD does not."""
    lam, off, other = tmp_path / "lam.yaml", tmp_path / "off.yaml", tmp_path / "other.yaml"
    lam.write_text("cd:\n  lam: 0.02\n")
    off.write_text("cd:\n  enabled: false\n")
    other.write_text("train:\n  seed: 3\n")
    for layers in ([lam], [lam, other]):
        with pytest.raises(ConfigError, match=r"lam.yaml: cd.lam=0.02 would be ignored: cd.lam is read only when "
                                              r"cd.enabled is true, and it is false"):
            load_config([str(p) for p in layers])
    cfg = load_config([str(lam), str(off)])
    assert cfg.cd.enabled is False and cfg.cd.lam == 0.02


def test_a_file_that_restates_what_the_config_has_is_not_refused(tmp_path):
    """Only what a file changes must be read: evaluate.py layers a run's own recipe over its checkpoint's
    config, and a value the config already has changes nothing that runs."""
    from configs import layer_config

    same = tmp_path / "same.yaml"
    same.write_text("cd:\n  lam: 0.005\ndata:\n  root: ''\n")  # the defaults; CD off, the digits read no root
    assert load_config([DEMO_CONFIG, str(same)]) == load_config([DEMO_CONFIG])
    demo = load_config([DEMO_CONFIG])
    assert layer_config(config_from_dict(config_to_dict(demo)), [DEMO_CONFIG], []) == demo
    changed = tmp_path / "changed.yaml"
    changed.write_text("cd:\n  lam: 0.01\n")
    with pytest.raises(ConfigError, match=r"changed.yaml: cd.lam=0.01 would be ignored"):
        load_config([DEMO_CONFIG, str(changed)])


# DeiT's main.py defaults (facebookresearch/deit) and the documented defaults (README.md, docs/lm_study.md) that
# no recipe restates: the schema's defaults are that recipe (configs/schema.py)
DOCUMENTED_DEFAULTS = {
    "optim.eps": 1e-8, "optim.betas": (0.9, 0.999), "optim.momentum": 0.9, "optim.lr_base": 5e-4,
    "optim.lr_base_batch": 512, "data.color_jitter": 0.3, "data.mixup_prob": 1.0, "data.mixup_switch_prob": 0.5,
    "data.mixup_mode": "batch", "data.recount": 1, "data.remode": "pixel", "data.hflip": 0.5,
    "data.scale": (0.08, 1.0), "data.ratio": (3 / 4, 4 / 3), "train.ema_decay": 0.99996, "sched.warmup_lr": 1e-6,
    "sched.min_lr": 1e-5, "cd.lam": 0.005, "cd.enabled": False, "tweo.enabled": False, "quant.calib_images": 32,
}


@pytest.mark.parametrize("key", sorted(DOCUMENTED_DEFAULTS))
def test_defaults_are_the_documented_recipe(key):
    from configs.loader import get_key

    assert get_key(load_config(None), key) == DOCUMENTED_DEFAULTS[key], key


def test_an_empty_override_value_is_the_empty_string():
    """`data.auto_augment=` switches the policy off (colour jitter is then read), `model.pretrained=` clears the
    weights of a recipe: the empty value is "", as in the schema's defaults, not null (the recipe's tag in
    model.name, which names hub weights, goes with them: tests/test_model_tag_weights.py)."""
    cfg = load_config([os.path.join(ROOT, "configs/finetune/vit_b_in21k.yaml")],
                      ["data.auto_augment=", "data.color_jitter=0.4", "model.pretrained= ",
                       "model.name=vit_base_patch16_224"])
    assert (cfg.data.auto_augment, cfg.data.color_jitter, cfg.model.pretrained) == ("", 0.4, "")


def test_an_override_value_may_hold_an_equals_sign():
    """Only the first '=' separates key and value: sweep folders are often named after their settings."""
    assert load_config(None, ["out_dir=runs/lr=1e-3,wd=0.05"]).out_dir == "runs/lr=1e-3,wd=0.05"


def test_a_recipe_path_given_from_another_working_folder_names_the_checkouts_file(tmp_path, monkeypatch):
    """A scheduler starts the job in its own folder: `--config configs/debug/tiny.yaml` is not found there; the
    error names the working folder and the checkout's file, and a path the checkout lacks gets no hint."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        load_config(["configs/debug/tiny.yaml"])
    assert str(e.value) == (f"config file not found: configs/debug/tiny.yaml (a relative path starts at the working "
                            f"folder, {tmp_path}); the checkout's file is "
                            f"{os.path.join(ROOT, 'configs', 'debug', 'tiny.yaml')}: give that path")
    with pytest.raises(ConfigError, match=r"^config file not found: configs/debug/none\.yaml$"):
        load_config(["configs/debug/none.yaml"])


@pytest.mark.parametrize("override, read", [
    ("out_dir=/tmp/my #1 run", "/tmp/my"),
    ("quant.bits=[w4a4] # the main setting", "[w4a4]"),
    ("out_dir= # nothing", "null"),
])
def test_an_override_whose_value_yaml_cuts_at_a_comment_is_refused(override, read):
    """`out_dir=/runs/exp #2` was read as out_dir=/runs/exp (YAML drops ' #...' as a comment) and resumed that run's
    folder: refused in one line that names the override, the value it would have been, and the quoting."""
    key = override.partition("=")[0]
    with pytest.raises(ConfigError) as refusal:
        load_config(None, [override])
    message = str(refusal.value)
    assert message.startswith(f"override {override!r}: YAML reads ' #' and what follows as a comment, so the value "
                              f"would be {read}; quote the value to keep the '#' ({key}='")
    assert "\n" not in message


@pytest.mark.parametrize("override, value", [
    ("out_dir='/tmp/my #1 run'", "/tmp/my #1 run"),
    ('out_dir="/tmp/my #1 run"', "/tmp/my #1 run"),
    ("out_dir='it''s #1'", "it's #1"),
    ("out_dir=/tmp/run#1", "/tmp/run#1"),  # a '#' without whitespace before it is no comment
    ("quant.bits=['w4a4 #x']", ["w4a4 #x"]),
])
def test_a_quoted_override_value_keeps_its_hash(override, value):
    cfg = load_config(None, [override])
    assert (cfg.quant.bits if override.startswith("quant.") else cfg.out_dir) == value


@pytest.mark.parametrize("policy, jitter_read", [
    ("", True), ("3a", True), ("rand-m9-mstd0.5-inc1", False), ("augmix-m5-w4-d2", False), ("v0", False)])
def test_color_jitter_is_read_without_a_policy_and_with_deit3s_three_augment(policy, jitter_read):
    """timm's transforms_imagenet_train keeps colour jitter under a policy that holds '3a' (DeiT III's 3-Augment;
    disable_color_jitter = not (force_color_jitter or '3a' in auto_augment)) and drops it under any other."""
    overrides = [f"data.auto_augment={policy}", "data.color_jitter=0"]
    if jitter_read:
        assert load_config([os.path.join(ROOT, "configs/pretrain/vit_b.yaml")], overrides).data.color_jitter == 0
    else:
        with pytest.raises(ConfigError, match=r"data.color_jitter=0 would be ignored: data.color_jitter is read only "
                                              r"when data.auto_augment is \"\" or holds 3a .*; drop it or set "
                                              r"data.auto_augment as well"):
            load_config([os.path.join(ROOT, "configs/pretrain/vit_b.yaml")], overrides)


def test_tweo_tau_and_eps_are_refused_under_the_rescaled_variant():
    """rescale=true divides the penalty by its own detached value: tau and eps scale it by (tau + eps)^-p, which
    cancels (tests/test_tweo.py shows the gradient unchanged); tweo.p still acts."""
    on = ["tweo.enabled=true", "tweo.rescale=true"]
    for key in ("tweo.tau=30", "tweo.eps=0.5"):
        with pytest.raises(ConfigError, match=rf"^{re.escape(key)} would be ignored: tweo\.\w+ is read only when "
                                              r"tweo.rescale is false, and it is true; drop it or set tweo.rescale"):
            load_config(None, [*on, key])
    assert load_config(None, [*on, "tweo.p=3"]).tweo.p == 3.0
    assert load_config(None, ["tweo.enabled=true", "tweo.tau=30", "tweo.eps=0.5"]).tweo.tau == 30.0
    # the recipes: tweo.yaml's tau is the default, so tweo_finetune.yaml over it sets nothing unread
    assert load_config([os.path.join(ROOT, p) for p in ("configs/method/tweo.yaml",
                                                         "configs/method/tweo_finetune.yaml")]).tweo.rescale


@pytest.mark.parametrize("overrides, read", [
    (["cd.mode=loss", "cd.budget=false", "cd.lam=0.5"], False),
    (["cd={mode: loss, budget: false, lam: 0.5}"], False),
    (["cd.mode=loss", "cd.budget=false", "cd.lam=0"], True),  # 0 switches the term off
    (["cd.mode=loss", "cd.budget=false", "cd.lam=0.5", "cd.lam_per_role.fc2=0.02"], True),  # fc2's weight 0.04
    (["cd.mode=loss", "cd.lam=0.5"], True),  # the budget rule takes lam from the weight decay
    (["cd.budget=false", "cd.lam=0.5"], True),  # decoupled: the step is lr * lam
    (["cd.enabled=false", "cd.mode=loss", "cd.budget=false", "cd.lam=0.5"], True),  # a baseline says CD is off
])
def test_cd_lam_is_refused_where_the_loss_form_cancels_it(overrides, read):
    """cd.mode=loss with cd.budget=false: the term loss_coef * P * detach(|L| / P) with P weighted by lam_role / lam
    does not change with lam (tests below: the gradient is the same at 0.005 and 0.5), so a given cd.lam is refused
    naming cd.loss_coef; with cd.lam_per_role, or lam 0, it is read."""
    cd_yaml = os.path.join(ROOT, "configs/method/cd.yaml")
    if read:
        load_config([DEMO_CONFIG, cd_yaml], overrides)
    else:
        with pytest.raises(ConfigError, match=r"^cd.lam=0.5 would be ignored: cd.lam is read only when cd.mode is "
                                              r"decoupled, cd.budget is true .* and here cd.enabled=true, "
                                              r"cd.mode=loss, cd.budget=false, cd.lam_per_role=\{\}, cd.lam=0.5; "
                                              r"drop it: cd.loss_coef scales the loss term$"):
            load_config([DEMO_CONFIG, cd_yaml], overrides)


def test_a_cd_lam_file_layer_over_a_loss_form_without_budget_is_refused_naming_the_file(tmp_path):
    """A layer that sets cd.lam over one that chose the loss form without the budget rule is refused, as other
    keys an earlier layer makes unread; a layer that sets the loss form itself says what it means."""
    form = tmp_path / "loss_form.yaml"
    form.write_text("cd:\n  enabled: true\n  mode: loss\n  budget: false\n")
    lam = tmp_path / "lam.yaml"
    lam.write_text("cd:\n  lam: 0.5\n")
    with pytest.raises(ConfigError, match=r"lam.yaml: cd.lam=0.5 would be ignored: cd.lam is read only when "):
        load_config([DEMO_CONFIG, str(form), str(lam)])
    both = tmp_path / "both.yaml"
    both.write_text("cd:\n  enabled: true\n  mode: loss\n  budget: false\n  lam: 0.5\n")
    assert load_config([DEMO_CONFIG, str(both)]).cd.lam == 0.5


def test_the_loss_form_without_budget_trains_alike_at_any_nonzero_cd_lam():
    """The reason cd.lam is refused there: cd/decay.py's loss term at lam 0.005 and 0.5 has the same gradient
    (float64), with cd.lam_per_role a different one, and at lam 0 none."""
    import torch

    from cd import ColinearityDecay
    from tests.cd_models import tiny_vit

    def grads(lam, lam_per_role=None):
        torch.manual_seed(0)
        model = tiny_vit().double()
        decay = ColinearityDecay(model, lam=lam, lam_per_role=lam_per_role or {}, mode="loss", loss_coef=0.01)
        task = model(torch.randn(2, 3, 32, 32, dtype=torch.float64)).square().mean()
        term = decay.aux_loss(task)
        if not term.requires_grad:
            return None
        params = [p for p in model.parameters()]
        return torch.cat([g.flatten() for g in torch.autograd.grad(term, params, allow_unused=True,
                                                                   materialize_grads=True)])

    small, large = grads(0.005), grads(0.5)
    torch.testing.assert_close(small, large, rtol=1e-12, atol=0)
    assert small.abs().max() > 0
    assert not torch.allclose(grads(0.005, {"fc2": 0.02}), grads(0.5, {"fc2": 0.02}))
    assert grads(0.0) is None


@pytest.mark.parametrize("override, key", [
    ("train.eval_batch_size_per_gpu=9223372036854775808", "train.eval_batch_size_per_gpu"),  # islice: ValueError
    ("data.synthetic_train_size=9223372036854775808", "data.synthetic_train_size"),  # OverflowError
    ("data.synthetic_val_size=99999999999999999999", "data.synthetic_val_size"),
    ("sched.steps=9223372036854775808", "sched.steps"),  # Optional[int]: the range, not "int or null"
    ("train.seed=-9223372036854775809", "train.seed"),
    ("quant.aphq.iters=9223372036854775808", "quant.aphq.iters"),  # a pipeline's options too
])
def test_an_integer_beyond_64_bits_is_refused_at_load(override, key):
    with pytest.raises(ConfigError, match=rf"^command line: '{re.escape(key)}' must be >= -9223372036854775808 and "
                                          r"<= 9223372036854775807 \(a 64-bit integer\); got -?\d+$"):
        load_config([DEBUG_CONFIG], [override])


def test_the_largest_64_bit_integer_loads():
    assert load_config(None, ["train.eval_batch_size_per_gpu=9223372036854775807"]).train.eval_batch_size_per_gpu \
        == 2 ** 63 - 1


@pytest.mark.parametrize("override, message", [
    ("optim.weight_decay=1" + "0" * 400, r"'optim.weight_decay' must be a finite number; got 10{400}$"),
    ("data.mean=[1" + "0" * 400 + ", 0, 0]", r"'data.mean' must be 3 finite numbers"),
])
def test_an_integer_beyond_the_float_range_in_a_float_field_is_refused(override, message):
    """math.isfinite(10**400) raises OverflowError: that was a traceback from the loader."""
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_repeated_aug_is_at_most_64():
    """timm's RepeatAugSampler lists len(train set) x repeats indices per process and epoch: 10**9 repeats asked
    for 512 GB; the schema stops at 64."""
    assert load_config(None, ["data.repeated_aug=64"]).data.repeated_aug == 64
    with pytest.raises(ConfigError, match=r"'data.repeated_aug' must be >= 0 and <= 64; got 1000000000$"):
        load_config(None, ["data.repeated_aug=1000000000"])

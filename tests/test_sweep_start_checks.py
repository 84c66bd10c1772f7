"""A sweep refuses, before its first run trains, what train.py refuses of a run's model and data at its start.

The sweep's up-front check resolved model.name and model.kwargs' keys only: an unknown model.kwargs entry
(model.kwargs.dpeth=3), a model.img_size that is no whole number of patches, a data.auto_augment policy timm cannot
read, a model.num_classes that is not the data's class count (or the embedded text's characters), a
data.digits_val_fraction that leaves a split without an image of some class, a synthetic split of more images than get a
seed of their own and an odd per-process batch under mixup were printed as commands, or run after the earlier runs had
trained, and train.py refused the run at its start. The sweep now builds every run's model on the meta device and makes
train.py's own checks of the model and the data settings. The reference for each refusal is train.py's own, in this
process: the sweep's error line holds train.py's error text."""
import os
import sys

import pytest
import torch

import train
from configs import ConfigError, load_config
from data import DataError
from models import ModelError, build_model
from tests.conftest import DEBUG_CONFIG, DEMO_CONFIG, ROOT, make_folder

import sweep  # noqa: E402  (scripts/, on the path of the tests)

KJV = os.path.join(ROOT, "configs", "lm", "kjv_cpu.yaml")
SWIN_CONFIG = os.path.join(ROOT, "configs", "demo", "swin_digits.yaml")


def sweep_file(tmp_path, config: str, b_items: list[str]) -> str:
    """A sweep of `config` in tmp_path/runs: run 'a' as the config is, run 'b' with `b_items`."""
    spec = tmp_path / "s.yaml"
    spec.write_text(f"configs: [{config}]\nout_root: {tmp_path}/runs\n"
                    f"runs:\n  a: []\n  b: [{', '.join(map(sweep.flow_item, b_items))}]\n")  # quoted where YAML needs
    return str(spec)


def refused(path: str, capsys) -> str:
    """The one error line of `sweep.py path` (printing the commands): nothing printed before it."""
    with pytest.raises(SystemExit) as stop:
        sweep.main([path])
    message = str(stop.value.code)
    assert message.startswith("error: sweep run 'b': ") and "\n" not in message, message
    assert capsys.readouterr().out == ""  # no command printed
    return message


def train_refusal(tmp_path, config: str, items: list[str]) -> str:
    """train.py's own refusal of the run (its main, in this process), which must come before any update."""
    out = tmp_path / "train_run"
    with pytest.raises((ConfigError, ModelError, DataError)) as e:
        train.main(load_config([config], [*items, f"out_dir={out}"]))
    assert not (out / "checkpoint.pt").exists()
    return str(e.value)


@pytest.mark.parametrize("config, items", [
    (DEMO_CONFIG, ["model.kwargs.dpeth=3"]),  # an argument the constructor does not take
    (DEMO_CONFIG, ["model.img_size=30"]),  # patches of 4
    (DEMO_CONFIG, ["data.auto_augment=foo"]),
    (DEMO_CONFIG, ["model.num_classes=5"]),  # the digits' 10
    (DEMO_CONFIG, ["data.digits_val_fraction=0.001"]),  # 2 val images: fewer than one per class
    (DEBUG_CONFIG, ["data.synthetic_val_size=268435457"]),  # 2**28 + 1 images: two would share a seed
    (DEMO_CONFIG, ["data.mixup=0.8", "train.batch_size=63", "train.batch_size_per_gpu=21"]),  # an odd batch
    (KJV, ["model.kwargs.dpeth=3"]),  # GPT-2's own builder
    (KJV, ["model.num_classes=50"]),  # the text's 65 characters
    # CD's pairs and TWEO's blocks, found once the model is built: a model without blocks, a gated MLP
    (DEMO_CONFIG, ["cd.enabled=true", "model.kwargs.depth=0"]),
    (DEMO_CONFIG, ["tweo.enabled=true", "model.kwargs.depth=0"]),
    (DEMO_CONFIG, ["cd.enabled=true", "model.name=eva02_tiny_patch14_224", "model.img_size=28",
                   "model.kwargs.depth=1"]),
    # the modules whose maxima the run's evaluation measures besides its blocks: none, or pass-through ones only
    (DEMO_CONFIG, ["quant.act_max_extra_modules=[bar.*]"]),
    (DEMO_CONFIG, ["quant.act_max_extra_modules=[blocks.*.drop_path1]"]),
    # a plan the model cannot be quantized with: RepQ-ViT's fold on a Swin whose windows are padded (40 pixels)
    (SWIN_CONFIG, ["model.img_size=40", "quant.pipelines=[repq]"]),
    # layer-wise lr decay on a model without timm's layer grouping (GPT): refused once the optimizer was built
    (KJV, ["optim.layer_decay=0.75"]),
], ids=["kwargs", "img_size", "auto_augment", "classes", "digits_val_fraction", "synthetic_size", "mixup",
        "gpt_kwargs", "vocabulary", "cd_no_pairs", "tweo_no_blocks", "cd_gated_mlp", "extra_module_none",
        "extra_module_pass_through", "plan_not_converting", "layer_decay_no_groups"])
def test_a_later_runs_setting_train_py_refuses_at_its_start_is_refused_before_anything(tmp_path, capsys, config,
                                                                                       items):
    message = refused(sweep_file(tmp_path, config, items), capsys)
    assert not (tmp_path / "runs").exists()
    assert train_refusal(tmp_path, config, items) in message


def test_a_folder_data_sets_class_count_is_checked_where_data_root_holds_it(tmp_path, capsys):
    data = tmp_path / "data"
    make_folder(data, {"train": {"a": 2, "b": 2, "c": 2}, "val": {"a": 1, "b": 1, "c": 1}})
    items = ["data.dataset=folder", f"data.root={data}", "model.num_classes=5"]
    message = refused(sweep_file(tmp_path, DEMO_CONFIG, items), capsys)
    assert "has 3 classes but model.num_classes=5" in message
    assert train_refusal(tmp_path, DEMO_CONFIG, items) in message
    # the count that fits passes; a data.root not on this machine is left to the run's start (printed commands may
    # be run elsewhere)
    for root, classes in ((data, 3), (tmp_path / "elsewhere", 5)):
        assert sweep.main([sweep_file(tmp_path, DEMO_CONFIG, ["data.dataset=folder", f"data.root={root}",
                                                              f"model.num_classes={classes}"])]) == 0


def test_the_meta_build_is_the_models_build_and_leaves_the_generator_and_the_default_device(monkeypatch):
    cfg = load_config([DEMO_CONFIG], [])
    torch.manual_seed(3)
    expected = torch.rand(4)  # the generator's next draws, untouched
    torch.manual_seed(3)
    with torch.device("meta"):  # a caller's default device (the tests' meta trick) stays its own
        model = sweep.check_model(cfg.model)
        assert torch.empty(1).device.type == "meta"
    assert torch.empty(1).device.type == "cpu"
    assert torch.equal(torch.rand(4), expected)
    built = build_model(cfg.model)  # train.py's build, on the CPU
    assert {n: p.shape for n, p in model.named_parameters()} == {n: p.shape for n, p in built.named_parameters()}
    assert all(p.device.type == "meta" for p in model.parameters())


def test_a_build_the_meta_device_cannot_make_is_made_on_the_cpu_not_refused(monkeypatch):
    """A constructor with an operation without meta kernels (.item() of a tensor it made) fails only on meta."""
    def meta_shy(cfg):
        torch.zeros(1).item()  # raises on the meta device
        return build_model(cfg)

    monkeypatch.setattr(train, "build_model", meta_shy)  # the build of train.check_model, which the sweep's calls
    cfg = load_config([DEMO_CONFIG], [])
    model = sweep.check_model(cfg.model)
    assert all(p.device.type == "cpu" for p in model.parameters())
    with pytest.raises(ConfigError, match="unexpected keyword argument 'dpeth'"):  # its own refusal still refuses
        sweep.check_model(load_config([DEMO_CONFIG], ["model.kwargs.dpeth=3"]).model)


def test_each_model_and_data_setting_is_checked_once_in_a_sweep(tmp_path, monkeypatch):
    """A sweep of seeds builds its model once (a 36-run sweep: one build, not 36)."""
    builds = []
    check_model = sweep.check_model
    monkeypatch.setattr(sweep, "check_model", lambda cfg: builds.append(cfg) or check_model(cfg))
    spec = tmp_path / "s.yaml"
    spec.write_text(f"configs: [{DEMO_CONFIG}]\nout_root: {tmp_path}/runs\n"
                    "runs:\n" + "".join(f"  s{i}: [train.seed={i}]\n" for i in range(4))
                    + "  small: [model.kwargs.depth=2]\n")
    assert len(sweep.expand(str(spec), [])) == 5
    assert [cfg.kwargs.get("depth") for cfg in builds] == [None, 2]


def test_the_wandb_package_is_looked_for_only_where_the_commands_run(tmp_path, capsys, monkeypatch):
    """Printed commands may run on another machine (as a data.root missing here): log.wandb=true without the
    package here prints them; --run refuses before anything trains, in train.py's own words."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    spec = sweep_file(tmp_path, DEMO_CONFIG, ["log.wandb=true"])
    assert sweep.main([spec]) == 0
    assert "log.wandb=true" in capsys.readouterr().out
    with pytest.raises(ConfigError) as reference:
        train.check_before_start(load_config([DEMO_CONFIG], ["log.wandb=true"]))
    with pytest.raises(SystemExit) as stop:
        sweep.main([spec, "--run"])
    assert str(stop.value.code) == f"error: sweep run 'b': {reference.value}"
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("item, recipe, run", [
    ("quant.act_max_extra_modules=[foo.*]", DEBUG_CONFIG, []),
    ("quant.act_max_extra_modules=[blocks.*.drop_path1]", DEBUG_CONFIG, []),
    ("quant.pipelines=[repq]", SWIN_CONFIG, ["model.img_size=40"]),
], ids=["extra_module_none", "extra_module_pass_through", "plan_not_converting"])
def test_an_evaluate_list_setting_evaluate_py_refuses_is_refused_before_anything(tmp_path, capsys, item, recipe, run):
    """Settings of the sweep's evaluate list reach evaluate.py only, which refused them after the run had trained:
    quant.act_max_extra_modules naming no module (or only pass-through ones), and quant.pipelines=[repq] for a Swin
    whose windows are padded (model.img_size=40: train.py trains the run, its own plan being the task's default,
    which it only warns about). The reference is evaluate.py's own refusal of the run's command on a checkpoint of
    the run's model (1 update). The later run b is never reached."""
    import evaluate

    spec = tmp_path / "s.yaml"
    spec.write_text(f"configs: [{recipe}]\nout_root: {tmp_path}/runs\nevaluate: ['{item}']\n"
                    f"runs:\n  a: [{', '.join(run)}]\n  b: [{', '.join([*run, 'train.seed=1'])}]\n")
    with pytest.raises(SystemExit) as stop:
        sweep.main([str(spec), "--evaluate"])
    message = str(stop.value.code)
    assert message.startswith("error: sweep run 'a': ") and "\n" not in message, message
    assert "the sweep's evaluate list" in message and capsys.readouterr().out == ""
    out = tmp_path / "trained"
    train.main(load_config([recipe], [*run, "train.max_steps=1", "log.tensorboard=false", f"out_dir={out}"]))
    with pytest.raises(ConfigError) as reference:
        evaluate.main(evaluate.parse_args(["--checkpoint", str(out / "best.pt"), "--out", str(out / "e.json"), item]))
    assert str(reference.value) in message

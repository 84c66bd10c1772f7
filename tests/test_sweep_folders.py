"""A sweep refuses, before anything starts, any two runs that would share a run folder (and so one
checkpoint: the second would resume the first, and the summary call both finished), a run folder
that the sweep would not name or --only could not select, and an override of what a run's own config files
set."""
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from configs import ConfigError, load_config
from tests.conftest import ROOT

import sweep


def sweep_file(tmp_path, runs: str, out_root=None, configs=("configs/debug/tiny.yaml",)):
    path = tmp_path / "s.yaml"
    path.write_text(f"configs: [{', '.join(map(str, configs))}]\nout_root: {out_root or tmp_path / 'runs'}\n"
                    f"runs:\n{runs}")
    return str(path)


@pytest.mark.parametrize("runs", [
    "  1.0: [optim.lr=0.001]\n  '1.0': [optim.lr=0.002]\n",     # a float and a string: one name
    "  null: [optim.lr=0.001]\n  None: [optim.lr=0.002]\n",      # None, typed and written
    "  lr1e-3: [optim.lr=0.001]\n  LR1E-3: [optim.lr=0.002]\n",  # one folder where case does not count
])
def test_names_that_resolve_to_one_folder_are_refused(tmp_path, runs):
    with pytest.raises(ConfigError, match=r"runs .* and .* would share the folder"):
        sweep.expand(sweep_file(tmp_path, runs), [])


def test_a_symbolic_link_in_out_root_that_joins_two_runs_is_refused(tmp_path):
    (tmp_path / "runs" / "a").mkdir(parents=True)
    os.symlink(tmp_path / "runs" / "a", tmp_path / "runs" / "b")
    with pytest.raises(ConfigError, match=r"runs 'a' and 'b' would share the folder"):
        sweep.expand(sweep_file(tmp_path, "  a: []\n  b: [optim.lr=0.01]\n"), [])


def test_a_symbolic_link_under_a_relative_out_root_is_found_from_any_folder(tmp_path, monkeypatch):
    """A relative out_root lies under the repository root, where the commands run: the check resolves it
    there, not in the folder the sweep was started from (which missed the link)."""
    root = tmp_path / "repo"
    (root / "runs" / "a").mkdir(parents=True)
    os.symlink(root / "runs" / "a", root / "runs" / "b")
    monkeypatch.setattr(sweep, "ROOT", str(root))
    monkeypatch.chdir(tmp_path)  # not the repository root
    with pytest.raises(ConfigError, match=r"runs 'a' and 'b' would share the folder"):
        sweep.refuse_shared_folders([{"name": n, "overrides": [f"out_dir=runs/{n}"]} for n in "ab"], "s.yaml")


@pytest.mark.parametrize("name", ["'.'", "'..'", "x/y", "''"])
def test_a_name_that_is_not_one_folder_is_refused(tmp_path, name):
    with pytest.raises(ConfigError, match="is not a folder name"):
        sweep.expand(sweep_file(tmp_path, f"  ok: []\n  {name}: []\n"), [])


@pytest.mark.parametrize("where", ["run", "command line"])
def test_an_out_dir_the_sweep_would_replace_is_refused(tmp_path, where):
    runs = "  a: [out_dir=/tmp/mine]\n" if where == "run" else "  a: []\n"
    extra = ["out_dir=/tmp/mine"] if where == "command line" else []
    with pytest.raises(ConfigError, match=r"out_dir=/tmp/mine would be ignored"):
        sweep.expand(sweep_file(tmp_path, runs), extra)


@pytest.mark.parametrize("where", ["sweep configs", "run's own file"])
def test_an_out_dir_a_config_file_sets_is_refused_naming_the_file(tmp_path, where):
    placing = tmp_path / "place.yaml"
    placing.write_text("out_dir: /tmp/mine\n")
    if where == "sweep configs":
        path = sweep_file(tmp_path, "  a: [train.seed=1]\n", configs=("configs/debug/tiny.yaml", placing))
    else:
        path = sweep_file(tmp_path, f"  a: [train.seed=1, {placing}]\n")
    with pytest.raises(ConfigError, match=rf"^sweep run 'a': {re.escape(str(placing))}: out_dir=/tmp/mine would be "
                                          rf"ignored: .*; drop it from {re.escape(str(placing))} and set out_root"):
        sweep.expand(path, [])


def test_a_config_file_that_leaves_out_dir_to_the_default_is_accepted(tmp_path):
    # "" is the schema's default (runs/<the config names>), which the sweep's out_root/<name> replaces by design
    default = tmp_path / "default.yaml"
    default.write_text("out_dir: ''\n")
    runs = sweep.expand(sweep_file(tmp_path, f"  a: [{default}]\n"), [])
    assert sweep.out_dir_of(runs[0]) == str(tmp_path / "runs" / "a")


def test_the_command_refuses_before_any_run_starts(tmp_path):
    path = sweep_file(tmp_path, "  1.0: [train.max_steps=1]\n  '1.0': [train.max_steps=2]\n")
    done = subprocess.run([sys.executable, "scripts/sweep.py", path, "--run"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1 and done.stderr.strip().startswith("error: ") and "share the folder" in done.stderr
    assert not (tmp_path / "runs").exists()


def test_an_unknown_model_in_a_later_run_is_refused_before_the_first_run_trains(tmp_path):
    """The sweep trained run a, then failed at run b's model.name: the name is resolved as train.py resolves it
    (a timm name, a variant, a GPT size) for every run before anything starts, and so are the model.kwargs."""
    path = sweep_file(tmp_path, "  a: []\n  b: [model.name=no_such_model]\n")
    done = subprocess.run([sys.executable, "scripts/sweep.py", path, "--run"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 1 and not done.stdout, done.stdout
    assert done.stderr.startswith("error: sweep run 'b': unknown model 'no_such_model'") and \
        len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stderr.rstrip().endswith(")")  # no "names like it: " with nothing after it
    assert not (tmp_path / "runs").exists()
    with pytest.raises(ConfigError, match=r"sweep run 'b': unknown model .*; names like it: vit_tiny_patch16_224"):
        sweep.expand(sweep_file(tmp_path, "  a: []\n  b: [model.name=vit_tiny_patch16_22]\n"), [])
    with pytest.raises(ConfigError, match=r"sweep run 'b': model.kwargs.depth is null"):
        sweep.expand(sweep_file(tmp_path, "  a: []\n  b: ['model.kwargs={depth: null}']\n"), [])
    assert [r["name"] for r in sweep.expand(sweep_file(tmp_path, "  a: []\n  b: [model.name=vit_tiny_patch16_224]\n"),
                                            [])] == ["a", "b"]  # a timm name, and the config's variant
    # build_model's first refusal: hub weights for a small variant of models/variants.py (it has none)
    with pytest.raises(ConfigError, match=r"sweep run 'b': model.pretrained=hub: model.name=vit_nano is one of"):
        sweep.expand(sweep_file(tmp_path, "  a: []\n  b: [model.name=vit_nano, model.pretrained=hub]\n"), [])


def test_a_model_class_of_ones_own_in_own_models_passes_the_sweeps_check_and_builds(tmp_path, monkeypatch):
    """docs/extending.md: a model class of one's own is an entry of models.factory.OWN_MODELS. The sweep's check of
    every run's model.name refused such a name (it knew timm names, variants and GPT sizes only) although
    build_model built it."""
    import torch.nn as nn

    from configs.schema import ModelConfig
    from models import factory

    class Mine(nn.Module):
        pretrained_cfg = {"input_size": (3, 32, 32)}  # models.factory.input_size's answer for a class without a branch

        def __init__(self, cfg):
            super().__init__()
            self.head = nn.Linear(4, cfg.num_classes)

    with pytest.raises(ConfigError, match=r"sweep run 'b': unknown model 'my_net'"):
        sweep.expand(sweep_file(tmp_path, "  a: []\n  b: [model.name=my_net]\n"), [])
    monkeypatch.setitem(factory.OWN_MODELS, "my_net", Mine)
    runs = sweep.expand(sweep_file(tmp_path, "  a: []\n  b: [model.name=my_net]\n"), [])
    assert [r["name"] for r in runs] == ["a", "b"]
    built = factory.build_model(ModelConfig(name="my_net", num_classes=3))
    assert isinstance(built, Mine) and built.head.out_features == 3


@pytest.mark.parametrize("name", ["lam=0.01", "-x"])
def test_a_name_that_only_cannot_select_is_refused(tmp_path, name):
    """--only reads a word with '=' as an override and one starting with '-' as an option: such a run could
    never be selected."""
    with pytest.raises(ConfigError, match=rf"run name '{name}' is not a folder name that --only can select"):
        sweep.expand(sweep_file(tmp_path, f"  ok: []\n  '{name}': [optim.lr=0.01]\n"), [])


@pytest.mark.parametrize("path, extra, message", [
    # the gpt2_medium runs would train GPT-2 Small under their names
    ("gpt2_table8.yaml", ["model.name=gpt2"], r"sweep run 'gpt2_small_baseline': model.name=gpt2 would replace "
                                              r"what the run sets itself \(model.name in configs/lm/gpt2.yaml\)"),
    # the cd and tweo runs would train baselines under their names
    ("digits_demo.yaml", ["cd.enabled=false", "tweo.enabled=false"],
     r"sweep run 'cd': cd.enabled=false would replace what the run sets itself \(cd.enabled in "
     r"configs/method/cd.yaml\)"),
])
def test_an_override_of_what_a_runs_own_config_file_sets_is_refused(path, extra, message):
    with pytest.raises(ConfigError, match=message):
        sweep.expand(os.path.join(ROOT, "configs", "sweeps", path), extra)


def test_a_key_every_run_sets_alike_stays_an_override_for_the_whole_sweep():
    """gpt2.yaml, listed by every run, and one batch size in every pre-training recipe are common ground."""
    for path in ("gpt2_table8.yaml", "pretrain_main.yaml"):
        # 32 divides gpt2.yaml's global batch of 480 and the pre-training recipes' 1024
        runs = sweep.expand(os.path.join(ROOT, "configs", "sweeps", path),
                            ["data.root=/datasets/x", "train.batch_size_per_gpu=32"])
        assert all("train.batch_size_per_gpu=32" in r["overrides"] for r in runs)


@pytest.mark.slow
def test_a_key_one_runs_preset_sets_is_refused_for_every_run_kept_and_a_key_that_places_work_may_be_set_for_all():
    """finetune.yaml's imagenet preset sets its own batch sizes: train.batch_size_per_gpu=32 for the whole sweep
    would replace its batch (refused, naming the preset), and for a run --only keeps that does not set it too (the
    key tells the sweep's runs apart: refused naming the runs that set it); the eval batch (where work runs, not
    what it computes) may be set for every run."""
    path = os.path.join(ROOT, "configs", "sweeps", "finetune.yaml")
    with pytest.raises(SystemExit, match=r"error: sweep run 'imagenet_baseline': train.batch_size_per_gpu=32 would "
                                         r"replace .* edit the run in .*finetune.yaml or "
                                         r"configs/finetune/datasets/imagenet.yaml$"):
        sweep.main([path, "model.pretrained=/w.safetensors", "train.batch_size_per_gpu=32"])
    with pytest.raises(SystemExit, match=r"error: sweep run 'flowers102_baseline': train.batch_size_per_gpu=32 would "
                                         r"replace what other runs of the sweep set themselves "
                                         r"\(train.batch_size_per_gpu: imagenet_baseline, imagenet_cd, "
                                         r"imagenet_tweo\).* edit the runs in .*finetune.yaml or "
                                         r"configs/finetune/datasets/imagenet.yaml"):
        sweep.main([path, "model.pretrained=/w.safetensors", "--only", "flowers102_baseline",
                    "train.batch_size_per_gpu=32"])
    runs = sweep.expand(path, ["model.pretrained=/w.safetensors", "train={eval_batch_size_per_gpu: 64}"])
    assert all("train={eval_batch_size_per_gpu: 64}" in r["overrides"] for r in runs) and len(runs) == 27


@pytest.mark.parametrize("where", ["run", "configs"])
def test_an_evaluate_entry_replacing_what_a_runs_own_config_file_sets_is_refused(tmp_path, where):
    """evaluate.py takes the sweep's evaluate list last: run b's quant.bits [w3a3] would be evaluated as
    [w4a4]. Over the sweep's common 'configs' the list is the sweep's own choice for every run."""
    layer = tmp_path / "w3a3.yaml"
    layer.write_text("quant:\n  bits: [w3a3]\n")
    spec = tmp_path / "s.yaml"
    spec.write_text(f"configs: [configs/debug/tiny.yaml{', ' + str(layer) if where == 'configs' else ''}]\n"
                    f"out_root: {tmp_path / 'runs'}\nevaluate: ['quant.bits=[w4a4]']\n"
                    f"runs:\n  a: []\n  b: [{layer if where == 'run' else 'optim.lr=0.01'}]\n")
    if where == "configs":
        assert len(sweep.expand(str(spec), [])) == 2
        return
    with pytest.raises(ConfigError, match=r"sweep run 'b': quant.bits in .*w3a3.yaml would be replaced in its "
                                          r"evaluation by the sweep's evaluate list \(quant.bits=\[w4a4\]\)"):
        sweep.expand(str(spec), [])


@pytest.mark.parametrize("given", ["run", "command line", "mapping"])
def test_options_of_a_pipeline_the_evaluation_does_not_run_are_refused_before_training(tmp_path, capsys, given):
    """evaluate.py refuses quant.aphq.* where its pipelines are repq only; the sweep said nothing and trained
    every run first."""
    spec = tmp_path / "s.yaml"
    item = "[quant.aphq.iters=5]" if given == "run" else "[]"
    spec.write_text(f"configs: [configs/debug/tiny.yaml]\nout_root: {tmp_path / 'runs'}\n"
                    f"evaluate: ['quant.pipelines=[repq]']\nruns:\n  a: {item}\n")
    override = "quant={aphq: {iters: 5}}" if given == "mapping" else "quant.aphq.iters=5"
    extra = [override] if given != "run" else []
    with pytest.raises(SystemExit, match=rf"error: sweep run 'a': {re.escape(override)} sets options of aphq, "
                                         r"which its evaluation does not run \(pipelines: repq\)"):
        sweep.main([str(spec), "--evaluate", *extra])
    assert sweep.main([str(spec), *extra]) == 0  # no evaluation: train.py keeps them in the run's config
    spec.write_text(spec.read_text().replace("quant.pipelines=[repq]", "quant.pipelines=[repq,aphq]"))
    assert sweep.main([str(spec), "--evaluate", *extra]) == 0
    assert override in capsys.readouterr().out.splitlines()[-1]  # the evaluate.py command


def test_a_calibration_batch_no_pipeline_of_the_evaluation_reads_is_refused_before_training(tmp_path):
    """evaluate.py refuses quant.calib_images where its pipelines read no calibration batch (RTN; APHQ and GPLQ
    on a classifier); the sweep would train every run first."""
    spec = tmp_path / "s.yaml"
    spec.write_text(f"configs: [configs/debug/tiny.yaml]\nout_root: {tmp_path / 'runs'}\n"
                    f"evaluate: ['quant.pipelines=[gplq]', 'quant.calib_images=8']\nruns:\n  a: []\n")
    with pytest.raises(SystemExit, match=r"error: sweep run 'a': quant.calib_images=8 sets the calibration batch, "
                                         r"which no pipeline of its evaluation reads \(pipelines: gplq\)"):
        sweep.main([str(spec), "--evaluate"])
    assert not (tmp_path / "runs").exists()
    spec.write_text(spec.read_text().replace("quant.pipelines=[gplq]", "quant.pipelines=[gplq,repq]"))
    assert sweep.main([str(spec), "--evaluate"]) == 0


def test_first_last_bit_widths_in_an_evaluation_without_pipelines_are_refused_before_training(tmp_path):
    """quant.first_last is read wherever a pipeline runs: in a sweep whose evaluation runs none, it is refused
    before any run trains, with what it is (not a calibration setting)."""
    spec = tmp_path / "s.yaml"
    spec.write_text(f"configs: [configs/debug/tiny.yaml]\nout_root: {tmp_path / 'runs'}\n"
                    f"evaluate: ['quant.pipelines=[]', 'quant.first_last=w8a8']\nruns:\n  a: []\n")
    with pytest.raises(SystemExit, match=r"error: sweep run 'a': quant.first_last=w8a8 sets a setting only "
                                         r"pipelines read, and its evaluation runs none \(pipelines: none\)"):
        sweep.main([str(spec), "--evaluate"])
    assert not (tmp_path / "runs").exists()


def test_a_runs_own_calibration_setting_is_checked_after_a_run_without_quantization_settings(tmp_path):
    """Run a sets nothing of quant (nothing to check); run b's own quant.calib_images goes to its evaluate.py
    command too, where gplq alone reads no calibration batch: refused before run a trains."""
    spec = sweep_file(tmp_path, "  a: []\n  b: ['quant.pipelines=[gplq]', quant.calib_images=8]\n")
    with pytest.raises(SystemExit, match=r"^error: sweep run 'b': quant.calib_images=8 sets the calibration batch, "
                                         r"which no pipeline of its evaluation reads \(pipelines: gplq\)"):
        sweep.main([spec, "--evaluate"])
    assert not (tmp_path / "runs").exists()
    path = tmp_path / "s.yaml"
    path.write_text(path.read_text().replace("quant.pipelines=[gplq]", "quant.pipelines=[gplq,repq]"))
    assert sweep.main([spec, "--evaluate"]) == 0


def test_a_runs_training_data_settings_stay_out_of_its_evaluation_command(tmp_path):
    """evaluate.py refuses data.mixup, data.label_smoothing and the like where no pass of it reads them (the
    checkpoint's config holds them as the run trained): a sweep that passed a run's training augmentation on to its
    evaluation would fail after every training. A mapping that mixes them with data.root is refused before
    training."""
    spec = tmp_path / "s.yaml"
    spec.write_text(f"configs: [configs/debug/tiny.yaml]\nout_root: {tmp_path / 'runs'}\n"
                    "evaluate: ['quant.pipelines=[repq]']\nruns:\n  a: [data.label_smoothing=0.2]\n")
    given = ["data.mixup=0.2", "data={cutmix: 0.5, mixup_prob: 0.5}", "data.synthetic_val_size=8"]
    (run,) = sweep.expand(str(spec), given)
    train, evaluation = sweep.commands(run, "", True)  # `python train.py ...`, `python evaluate.py ...`
    assert all(item in train for item in ["data.label_smoothing=0.2", *given])
    assert [item for item in evaluation if item.startswith("data")] == ["data.synthetic_val_size=8"]
    with pytest.raises(SystemExit, match=r"error: sweep run 'a': data=\{synthetic_val_size: 8, mixup: 0.2\} sets "
                                         r"data.mixup, which only training reads"):
        sweep.main([str(spec), "--evaluate", "data={synthetic_val_size: 8, mixup: 0.2}"])
    assert not (tmp_path / "runs").exists()


def _evaluate_list_sweep(tmp_path, evaluate_list: str):
    spec = tmp_path / "s.yaml"
    spec.write_text(f"configs: [configs/debug/tiny.yaml]\nout_root: {tmp_path / 'runs'}\n"
                    f"evaluate: {evaluate_list}\nruns:\n  a: [data.dataset=digits, model.num_classes=10]\n")
    return str(spec)


def test_the_evaluate_lists_training_transform_setting_is_left_to_a_pipeline_that_reads_it(tmp_path, capsys):
    """APHQ draws training-transform images: evaluate.py reads data.reprob=0 there (the images it calibrates on),
    so a sweep whose evaluate list gives it beside aphq prints its commands, the setting in the evaluation's."""
    spec = _evaluate_list_sweep(tmp_path, "['quant.pipelines=[aphq]', 'data.reprob=0']")
    assert sweep.main([spec, "--evaluate"]) == 0
    evaluation = [line for line in capsys.readouterr().out.splitlines() if "evaluate.py" in line]
    assert len(evaluation) == 1 and evaluation[0].endswith("data.reprob=0"), evaluation


@pytest.mark.parametrize("evaluate_list, says", [
    ("['data.mixup=0']", r"'data.mixup=0' in the sweep's evaluate list: no pass of evaluate.py reads data.mixup "
                         r".*drop it from 'evaluate'"),
    ("['quant.pipelines=[repq]', 'data.reprob=0']", r"'data.reprob=0' in the sweep's evaluate list: no pipeline of "
                                                   r"its evaluation sees training-transform images .*drop it from "
                                                   r"'evaluate'"),
    # train.*, optim.*, log.*, cd.*: evaluate.py refused them after the training (its autocast is --amp)
    ("['train.amp=bf16']", r"'train.amp=bf16' in the sweep's evaluate list: evaluate.py does not read training "
                           r"settings \(train.amp\).*drop it from 'evaluate'"),
    ("['quant.calib_images=8', 'optim={lr: 0.1}']",
     r"'optim=\{lr: 0.1\}' in the sweep's evaluate list: .*\(optim.lr\)"),
    ("['log.act_max=true']", r"'log.act_max=true' .*\(log.act_max\)"),
    ("['cd.enabled=true']", r"'cd.enabled=true' .*\(cd.enabled\)")])
def test_the_evaluate_lists_unread_training_setting_is_refused_naming_the_list(tmp_path, evaluate_list, says):
    """An item of the sweep's evaluate list goes to evaluate.py alone: the fix is to drop it from that list (a
    training override of the run's would change what the run trains), before any run trains."""
    spec = _evaluate_list_sweep(tmp_path, evaluate_list)
    with pytest.raises(SystemExit, match=r"error: sweep run 'a': " + says):
        sweep.main([spec, "--evaluate"])
    assert not (tmp_path / "runs").exists()


def test_the_evaluate_lists_training_transform_setting_is_checked_against_the_tasks_default_pipelines(tmp_path):
    """No quant setting anywhere: the evaluation runs the classifier's default pipelines (percentile, repq), neither
    of which sees training-transform images, so data.reprob=0 alone in the evaluate list is refused before any run
    trains; with quant.calib_transform=train, percentile's calibration batch is drawn with the training transform
    and reads it."""
    spec = _evaluate_list_sweep(tmp_path, "['data.reprob=0']")
    with pytest.raises(SystemExit, match=r"error: sweep run 'a': 'data.reprob=0' in the sweep's evaluate list: no "
                                         r"pipeline of its evaluation sees training-transform images \(pipelines: "
                                         r"percentile, repq;"):
        sweep.main([spec, "--evaluate"])
    assert not (tmp_path / "runs").exists()
    spec = _evaluate_list_sweep(tmp_path, "['data.reprob=0', 'quant.calib_transform=train']")
    assert sweep.main([spec, "--evaluate"]) == 0


def test_a_run_kept_by_only_is_still_checked_for_overrides_that_replace_its_own_keys():
    """--only narrows the check to the runs kept, it does not switch it off: imagenet_baseline's preset sets
    its own batch, which train.batch_size_per_gpu=32 for the whole sweep would replace."""
    path = os.path.join(ROOT, "configs", "sweeps", "finetune.yaml")
    with pytest.raises(ConfigError, match=r"sweep run 'imagenet_baseline': train.batch_size_per_gpu=32 would "
                                          r"replace what the run sets itself"):
        sweep.expand(path, ["model.pretrained=/w.safetensors", "train.batch_size_per_gpu=32"],
                     only=["imagenet_baseline"])


@pytest.mark.parametrize("where", ["run", "run_keys"])
def test_a_whole_dict_field_given_for_the_sweep_clashes_with_one_entry_a_run_sets(tmp_path, where):
    """cd.lam_per_role={fc2: 0.5} for every run replaces the fc2 entry that a run sets (cd.lam_per_role.fc2=2.0)
    or that run_keys guard: the override names the whole field, the run one entry below it."""
    spec = tmp_path / "s.yaml"
    guard = "run_keys: [cd.lam_per_role.fc2]\n" if where == "run_keys" else ""
    spec.write_text(f"configs: [configs/debug/tiny.yaml, configs/method/cd.yaml]\nout_root: {tmp_path}\n{guard}"
                    f"runs:\n  a: ['cd.lam_per_role.fc2=2.0']\n")
    with pytest.raises(ConfigError, match=r"cd.lam_per_role=\{fc2: 0.5\} would replace"):
        sweep.expand(str(spec), ["cd.lam_per_role={fc2: 0.5}"])


@pytest.mark.parametrize("key, run_value, sweep_value", [
    ("train.device", "cpu", "auto"), ("train.compile", "true", "false"), ("data.num_workers", "1", "0")])
def test_a_key_that_places_work_may_be_set_for_all_over_one_runs_own_file(tmp_path, key, run_value, sweep_value):
    """Where a run computes (its device), whether it is compiled and how many loader workers feed it change no
    number it computes: one value for the whole sweep may replace what one run's own file sets, as the eval
    batch may."""
    section, name = key.split(".")
    layer = tmp_path / "placed.yaml"
    layer.write_text(f"{section}:\n  {name}: {run_value}\n")
    runs = sweep.expand(sweep_file(tmp_path, f"  a: [{layer}]\n  b: []\n"), [f"{key}={sweep_value}"])
    assert [r["overrides"][-2] for r in runs] == [f"{key}={sweep_value}"] * 2


def test_only_prints_the_commands_of_the_runs_it_names_and_no_other(tmp_path, capsys):
    """--only b c: the train.py commands of b and c, in the sweep's order, and none of a or d."""
    path = sweep_file(tmp_path, "".join(f"  {n}: [optim.lr=0.00{i + 1}]\n" for i, n in enumerate("abcd")))
    assert sweep.main([path, "--only", "c", "b"]) == 0
    folders = re.findall(r"out_dir=(\S+)", capsys.readouterr().out)
    assert folders == [str(tmp_path / "runs" / "b"), str(tmp_path / "runs" / "c")]


def test_a_typo_in_the_evaluate_list_is_refused_before_any_run_trains(tmp_path):
    """The evaluate list is checked with each run's config up front: quant.bitz would otherwise be refused by
    evaluate.py only once the first run has trained."""
    spec = tmp_path / "s.yaml"
    spec.write_text(f"configs: [configs/debug/tiny.yaml]\nout_root: {tmp_path}\nevaluate: ['quant.bitz=[w4a4]']\n"
                    "runs:\n  a: []\n")
    with pytest.raises(ConfigError, match=r"sweep run 'a': .*unknown config key 'quant.bitz'"):
        sweep.expand(str(spec), [])


def test_a_misspelt_top_level_key_of_a_sweep_file_is_refused_naming_it(tmp_path):
    """'run_key' for run_keys would guard nothing (data.root=x given for the sweep would train every run on x)."""
    spec = tmp_path / "s.yaml"
    spec.write_text(f"configs: [configs/debug/tiny.yaml]\nout_root: {tmp_path}\nrun_key: [data.root]\n"
                    "runs:\n  a: []\n")
    with pytest.raises(ConfigError, match=r"unknown keys \['run_key'\]"):
        sweep.expand(str(spec), [])


@pytest.mark.parametrize("runs", ["  {}\n", "", "  - a\n"], ids=["empty", "null", "list"])
def test_a_sweep_without_a_mapping_of_runs_is_refused(tmp_path, runs):
    """`runs: {}` would print no command and run nothing, exiting 0 as if the sweep were done."""
    with pytest.raises(ConfigError, match=r"a sweep has 'configs', 'out_root', a non-empty 'runs' mapping"):
        sweep.expand(sweep_file(tmp_path, runs), [])


def test_a_sweep_without_out_root_is_refused_in_one_line(tmp_path, capsys):
    """A missing out_root became runs/sweep, one folder for every sweep file that left it out: run 'baseline' of one
    would resume the 'baseline' of another. Refused, before anything is printed or run (every shipped sweep names
    its own: test_scripts.py expands each)."""
    spec = tmp_path / "mine.yaml"
    spec.write_text("configs: [configs/debug/tiny.yaml]\nruns:\n  a: []\n")
    for run in ([], ["--run"]):
        with pytest.raises(SystemExit) as stop:
            sweep.main([str(spec), *run])
        message = str(stop.value.code)
        assert message.startswith(f"error: {spec}: no 'out_root'") and "\n" not in message
        assert "out_root: runs/sweeps/mine" in message
    assert capsys.readouterr().out == ""


def _printed(capsys) -> list[list[str]]:
    """The commands a sweep printed, as words, after the `cd` into the repository root where they run."""
    cd, *commands = capsys.readouterr().out.splitlines()
    assert shlex.split(cd) == ["cd", ROOT]
    return [shlex.split(line) for line in commands]


@pytest.mark.slow
def test_printed_commands_run_from_any_folder_as_the_sweep_runs_them(tmp_path):
    """The printed commands' paths (train.py, the config files, a relative out_dir) are the repository root's, as
    --run runs them: started elsewhere (`cd /tmp && python /repo/scripts/sweep.py ...`), pasted into a shell there,
    they found no train.py. A stand-in launcher records where each command runs and with what; the commands are run
    by a shell in another folder."""
    record = tmp_path / "record"
    launcher = tmp_path / "launch"
    launcher.write_text(f'#!/bin/sh\necho "$PWD $*" >> {record}\n')
    launcher.chmod(0o755)
    path = sweep_file(tmp_path, "  a: []\n  b: [configs/method/cd.yaml]\n", out_root="runs/sweeps/mine")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    printed = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "sweep.py"), path, "--evaluate",
                              "--launcher", str(launcher)], cwd=elsewhere, capture_output=True, text=True,
                             timeout=300, check=True).stdout
    subprocess.run(["sh", "-e"], input=printed, cwd=elsewhere, check=True, timeout=60, text=True)
    ran = [line.split() for line in record.read_text().splitlines()]
    assert [words[1] for words in ran] == ["train.py", "evaluate.py"] * 2
    for where, script, *args in ran:
        configs = [a for a, before in zip(args, [None, *args]) if before == "--config"]
        assert where == ROOT and all(os.path.isfile(os.path.join(where, f)) for f in [script, *configs])
    assert ran[2][-1] == "out_dir=runs/sweeps/mine/b"  # --run's folder: relative to the repository root


@pytest.mark.parametrize("amp", ["bf16", "fp16", "none"])
def test_eval_amp_reaches_every_evaluate_command_and_no_train_command(tmp_path, capsys, amp):
    """--eval-amp X is evaluate.py's --amp X in every run's evaluation command (a GPU sweep of ViT-B evaluated under
    bf16 autocast); train.py has its own train.amp and gets nothing."""
    path = sweep_file(tmp_path, "  a: []\n  b: [optim.lr=0.002]\n")
    assert sweep.main([path, "--evaluate", "--eval-amp", amp]) == 0
    printed = _printed(capsys)
    evaluations = [cmd for cmd in printed if "evaluate.py" in cmd]
    trainings = [cmd for cmd in printed if "train.py" in cmd]
    assert len(evaluations) == len(trainings) == 2 and len(printed) == 4
    for cmd in evaluations:
        assert cmd.count("--amp") == 1 and cmd[cmd.index("--amp") + 1] == amp, cmd
    assert sweep.main([path, "--evaluate"]) == 0  # the training commands are those of a sweep without it
    assert trainings == [cmd for cmd in _printed(capsys) if "train.py" in cmd]
    assert not any("--amp" in cmd for cmd in trainings)


def test_without_eval_amp_the_evaluate_commands_have_no_amp_flag(tmp_path, capsys):
    """Not given: evaluate.py's default (none, fp32), and the printed commands are those of a sweep without it."""
    path = sweep_file(tmp_path, "  a: []\n")
    assert sweep.main([path, "--evaluate"]) == 0
    (train, evaluation) = _printed(capsys)
    assert evaluation[1:] == ["evaluate.py", "--checkpoint", str(tmp_path / "runs" / "a" / "best.pt"),
                              "--out", str(tmp_path / "runs" / "a" / "eval_best.json")]
    assert "--amp" not in train and train[1] == "train.py"


@pytest.mark.parametrize("amp", ["bf16", "none"])
def test_eval_amp_without_evaluate_is_refused_in_one_line_naming_both_flags(tmp_path, capsys, amp):
    """Without --evaluate there is no evaluate.py command to take it: refused (an explicit none too), not
    dropped, before anything is printed or run."""
    path = sweep_file(tmp_path, "  a: []\n")
    for run in ([], ["--run"]):
        with pytest.raises(SystemExit) as stop:
            sweep.main([path, "--eval-amp", amp, *run])
        assert stop.value.code == 2  # a usage error, as argparse's
        out, message = capsys.readouterr()
        assert out == "" and message.startswith("error: ") and message.count("\n") == 1
        assert "--eval-amp" in message and "--evaluate" in message
    assert not (tmp_path / "runs").exists()


def test_eval_amp_choices_are_evaluate_pys():
    """sweep.py keeps evaluate.py's --amp choices as a literal (importing evaluate.py imports torch): they must
    be its parser's, with its default none, which the sweep leaves out of the command."""
    import evaluate

    (amp,) = [a for a in evaluate.build_parser()._actions if "--amp" in a.option_strings]
    assert tuple(amp.choices) == sweep.EVAL_AMP_CHOICES and amp.default == "none"


def _evaluated_run(tmp_path, recorded: str, older_than_checkpoint: bool = False) -> str:
    """A sweep of one run 'a' whose eval_best.json was written under --amp `recorded` (optionally before its
    best.pt)."""
    folder = tmp_path / "runs" / "a"
    folder.mkdir(parents=True)
    result, checkpoint = folder / "eval_best.json", folder / "best.pt"
    result.write_text(json.dumps({"model": "vit_nano", "eval_amp": recorded, "quant": {}}))
    checkpoint.write_bytes(b"")
    stamp = os.path.getmtime(result)
    os.utime(checkpoint, (stamp + (60 if older_than_checkpoint else -60),) * 2)
    return sweep_file(tmp_path, "  a: []\n")


@pytest.mark.parametrize("recorded, given, says", [
    ("none", ["--eval-amp", "bf16"], "leave --eval-amp out to continue it"),
    ("bf16", [], "give --eval-amp bf16 to continue it"),
    ("bf16", ["--eval-amp", "fp16"], "give --eval-amp bf16 to continue it")])
def test_a_requeued_sweep_under_another_eval_amp_is_refused_before_anything_starts(tmp_path, capsys, recorded,
                                                                                   given, says):
    """evaluate.py refuses a result file written under another --amp, saying to give --out another file, which a
    sweep names itself: the requeued sweep trained (or validated) the run, then ended as 'failed during evaluation'
    with the later runs not started. The sweep refuses it up front, in one line saying what to do."""
    path = _evaluated_run(tmp_path, recorded)
    with pytest.raises(SystemExit) as stop:
        sweep.main([path, "--run", "--evaluate", *given])
    message = str(stop.value.code)
    result = tmp_path / "runs" / "a" / "eval_best.json"
    assert message.startswith(f"error: sweep run 'a': {result} holds its evaluation under --amp {recorded}")
    assert says in message and "move it away" in message and "\n" not in message
    assert not (tmp_path / "runs" / "a" / "checkpoint.pt").exists() and capsys.readouterr().out == ""


def test_a_result_under_the_same_autocast_or_older_than_best_pt_is_not_refused(tmp_path):
    """The same --amp adds to the file; one older than best.pt is moved aside by the sweep (move_stale_result)."""
    path = _evaluated_run(tmp_path, "bf16")
    (run,) = sweep.expand(path, [])
    sweep.refuse_results_of_another_autocast([run], "bf16")
    with pytest.raises(ConfigError, match="under --amp bf16"):
        sweep.refuse_results_of_another_autocast([run], None)
    os.utime(tmp_path / "runs" / "a" / "best.pt", (os.path.getmtime(tmp_path / "runs" / "a" / "eval_best.json")
                                                    + 60,) * 2)
    sweep.refuse_results_of_another_autocast([run], None)


def test_a_command_line_override_of_a_run_key_is_refused_wherever_it_stands(tmp_path):
    """run_keys guards every override of the command line, not only its first one."""
    path = tmp_path / "s.yaml"
    path.write_text(f"configs: [configs/debug/tiny.yaml]\nout_root: {tmp_path / 'runs'}\nrun_keys: [data.root]\n"
                    "runs:\n  a: [data.root=/x]\n")
    with pytest.raises(ConfigError, match=r": data\.root=/y would replace a key that each run sets itself "
                                          r"\(data\.root\)"):
        sweep.expand(str(path), ["optim.lr=0.1", "data.root=/y"])


@pytest.mark.parametrize("given", [[], ["--eval-amp", "none"]])
def test_a_result_evaluated_without_autocast_is_continued_by_a_sweep_without_eval_amp(tmp_path, given):
    """eval_best.json of evaluate.py's default (--amp none) is continued by a sweep that leaves --eval-amp out (or
    gives none): nothing is refused."""
    path = _evaluated_run(tmp_path, "none")
    (run,) = sweep.expand(path, [])
    sweep.refuse_results_of_another_autocast([run], given[1] if given else None)


def test_printed_commands_are_not_refused_for_a_result_of_another_autocast(tmp_path, capsys):
    """Without --run the commands are only printed (perhaps for another machine, with other files): a result file
    here under another --amp refuses nothing, and the evaluate command carries the --amp given."""
    path = _evaluated_run(tmp_path, "none")
    assert sweep.main([path, "--evaluate", "--eval-amp", "bf16"]) == 0
    evaluate_line = capsys.readouterr().out.splitlines()[2]  # after the `cd` and the train.py command
    assert "evaluate.py" in evaluate_line and "--amp bf16" in evaluate_line


def test_a_sweep_without_config_files_checks_its_runs_as_train_py_runs_them(tmp_path):
    """A sweep that names no config file runs `train.py <items>`, which trains its default recipe; the sweep's checks
    read the schema's defaults instead (vit_base_patch16_224, 1000 classes), so its unchanged rerun was refused as
    'written with other settings'. The reference is train.py's own reading of the same command line."""
    import torch

    import train
    from configs import config_to_dict, load_config

    path = tmp_path / "s.yaml"
    path.write_text(f"out_root: {tmp_path}/runs\nruns:\n  a: [sched.epochs=1, sched.warmup_epochs=0]\n")
    (run,) = sweep.expand(str(path), [])
    ran = train.parse_args(run["overrides"])  # what the run's command trains
    assert config_to_dict(load_config([os.path.join(ROOT, c) for c in run["configs"]], run["overrides"])) == \
        config_to_dict(ran)
    folder = tmp_path / "runs" / "a"
    folder.mkdir(parents=True)
    torch.save({"config": config_to_dict(ran)}, folder / "checkpoint.pt")
    sweep.refuse_changed_training_settings([run], str(path), world_size=1)  # the run's own settings: no refusal


@pytest.fixture(scope="module")
def trained_sweep(tmp_path_factory):
    """A sweep of one run 'a' that has trained (tiny.yaml: train.eval_batch_size_per_gpu 16, train.device auto)."""
    import train
    from configs import load_config
    from tests.conftest import DEBUG_CONFIG

    root = tmp_path_factory.mktemp("sweep")
    items = ["sched.epochs=1", "sched.warmup_epochs=0", "log.tensorboard=false"]
    train.main(load_config([DEBUG_CONFIG], [*items, f"out_dir={root / 'runs' / 'a'}"]))
    return sweep_file(root, f"  a: [{', '.join(items)}]\n")


@pytest.mark.parametrize("given", [["train.eval_batch_size_per_gpu=4", "train.device=cpu"],
                                   ["train={eval_batch_size_per_gpu: 4, device: cpu, seed: 3}"]])
def test_the_eval_batch_and_device_given_for_a_sweep_reach_a_trained_runs_evaluation(trained_sweep, given):
    """train.eval_batch_size_per_gpu and train.device, which evaluate.py reads, given to a sweep requeued after a run
    trained (a smaller eval batch after an evaluation ran out of memory): the run's evaluate.py command evaluated its
    best.pt at the values its checkpoint holds (16, auto), as the sweep passed on only data.* and quant.*. The
    reference is evaluate.py's own resolution of the command."""
    import evaluate

    (run,) = sweep.expand(trained_sweep, given)
    command = sweep.commands(run, "", True)[1]
    cfg, _ = evaluate.resolve_config(evaluate.parse_args(command[command.index("evaluate.py") + 1:]))
    assert (cfg.train.eval_batch_size_per_gpu, cfg.train.device) == (4, "cpu")
    assert not any("seed" in item for item in command)  # a training setting: evaluate.py would refuse it


def test_a_run_item_ending_in_yml_is_a_config_file_as_one_ending_in_yaml(tmp_path):
    """A run's config file named .yml (which train.py's --config reads as any YAML file) was taken for an override and
    refused as 'not of the form key=value'."""
    layer = tmp_path / "lr.yml"
    layer.write_text("optim:\n  lr: 0.002\n")
    (run,) = sweep.expand(sweep_file(tmp_path, f"  a: [{layer}]\n"), [])
    assert run["configs"] == ["configs/debug/tiny.yaml", str(layer)]
    assert not any(item.endswith(".yml") for item in run["overrides"])


def test_each_run_trains_in_out_root_slash_its_name_whatever_yaml_reads_in_the_name(tmp_path):
    """The sweep passes out_dir=<out_root>/<name> to train.py, which reads the value as YAML: a name ending in a space
    was read without it ('a ' trained in run 'a''s folder, unseen by the check of shared folders), and names with ' #'
    or ': ' were refused, telling the user to quote an override they never wrote."""
    names = ["a", "a ", "lam #2", "k: v", "[x]"]
    out_root = tmp_path / "runs" / "*x"
    runs = sweep.expand(sweep_file(tmp_path, "".join(f"  {json.dumps(n)}: [train.seed={i}]\n"
                                                     for i, n in enumerate(names)), out_root=json.dumps(str(out_root))),
                        [])
    for name, run in zip(names, runs):
        cfg = load_config([os.path.join(ROOT, c) for c in run["configs"]], run["overrides"])
        assert cfg.out_dir == os.path.join(str(out_root), name)
        assert sweep.out_dir_of(run) == os.path.join(str(out_root), name)

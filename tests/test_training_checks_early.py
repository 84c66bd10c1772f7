"""Settings that training refuses are refused before anything runs: CD's roles and strengths and optim.name by
train.py before its model and data (and by a sweep before its first run trains), and a global batch that no number
of processes splits into per-process batches as the config loads."""
import os
import re
import subprocess
import sys

import pytest

from configs import ConfigError, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import sweep  # noqa: E402

TINY = os.path.join(ROOT, "configs/debug/tiny.yaml")
CD = os.path.join(ROOT, "configs/method/cd.yaml")


@pytest.mark.parametrize("override, key", [
    ("cd.lam_per_role.fc3=0.02", "cd.lam_per_role.fc3"),  # not a role
    ("cd.lam_per_role.fc2=abc", "cd.lam_per_role.fc2"),   # not a number
    ("cd.lam_per_role.proj=-1", "cd.lam_per_role.proj"),  # below 0
])
def test_a_cd_setting_training_refuses_is_refused_naming_its_key(override, key):
    from engine.training_checks import check_training_settings

    cfg = load_config([TINY, CD], [override])
    with pytest.raises(ConfigError) as e:
        check_training_settings(cfg)
    assert str(e.value).startswith(key) and "\n" not in str(e.value)


def test_the_roles_and_strengths_cd_takes_pass():
    from engine.training_checks import check_training_settings

    roles = ("qkv", "proj", "fc1", "fc2", "reduction")  # the paper's roles (cd/README.md)
    check_training_settings(load_config([TINY, CD], [f"cd.lam_per_role.{r}=0.02" for r in roles]))


@pytest.mark.parametrize("name, known", [("adamw", True), ("sgd", True), ("lookahead_adamw", True),
                                         ("sgdd", False), ("adamww", False)])
def test_optim_name_is_resolved_in_timms_registry(name, known):
    from timm.optim import list_optimizers  # the registry train.py's optimizer is built from

    from engine.training_checks import check_training_settings

    assert (name.split("_")[-1] in list_optimizers()) is known  # the reference
    cfg = load_config([TINY], [f"optim.name={name}"])
    if known:
        check_training_settings(cfg)
    else:
        with pytest.raises(ConfigError, match=f"^optim.name={name}: timm has no optimizer"):
            check_training_settings(cfg)


@pytest.mark.parametrize("batch, per_gpu", [(20, 8), (16, 8), (7, 3), (12, 12), (12, 5), (3, 4)])
def test_a_global_batch_must_be_a_multiple_of_the_per_process_batch(batch, per_gpu):
    overrides = [f"train.batch_size={batch}", f"train.batch_size_per_gpu={per_gpu}"]
    if batch % per_gpu == 0:  # one process runs batch / per_gpu accumulation steps
        load_config([TINY], overrides)
        return
    with pytest.raises(ConfigError) as e:
        load_config([TINY], overrides)
    message = str(e.value)
    assert message.startswith(f"train.batch_size={batch} is not a multiple of train.batch_size_per_gpu={per_gpu}")
    suggested = int(message.rpartition("train.batch_size_per_gpu=")[2])
    # the largest per-process batch up to the given one that divides the global batch, found naively
    assert suggested == max(d for d in range(1, per_gpu + 1) if batch % d == 0 and d <= batch)


@pytest.mark.parametrize("weight_decay, lam", [("0.05", "0.06"), ("0.001", "0.005"), ("0.05", "0.005"),
                                               ("0.005", "0.005"), ("0.0", "0.005"), ("0.0", "0.0")])
def test_a_cd_lam_above_the_weight_decay_under_the_budget_rule_is_refused_before_training(weight_decay, lam):
    """cd.budget takes cd.lam from optim.weight_decay (wd -> wd - lam): train.py refused a negative result only once
    the model was built and the data read (a sweep's earlier runs trained first). The reference: the difference of
    the two values as written, in exact decimal arithmetic; the message shows it without float noise (0.05 - 0.06
    is -0.01, not -0.009999999999999995)."""
    from decimal import Decimal

    from engine.training_checks import check_training_settings

    cfg = load_config([TINY, CD], [f"optim.weight_decay={weight_decay}", f"cd.lam={lam}"])
    left = Decimal(weight_decay) - Decimal(lam)
    if left >= 0:
        check_training_settings(cfg)
        return
    with pytest.raises(ConfigError) as e:
        check_training_settings(cfg)
    message = str(e.value)
    assert message.startswith("cd.budget: ") and "\n" not in message
    assert f"weight_decay {weight_decay} - cd.lam {lam} = {left} < 0; lower cd.lam" in message


@pytest.mark.parametrize("item, key", [("cd.lam_per_role.fc3=0.02", "cd.lam_per_role.fc3"),
                                       ("optim.name=sgdd", "optim.name"),
                                       ("cd.lam=0.06", "cd.budget"),  # wd 0.05 - 0.06 < 0
                                       ("train.batch_size=20", "train.batch_size")])
def test_a_sweep_refuses_a_later_runs_setting_before_the_first_run(tmp_path, item, key):
    path = tmp_path / "sweep.yaml"
    path.write_text(f"configs: [configs/debug/tiny.yaml]\nout_root: {tmp_path}/runs\n"
                    f"runs:\n  baseline: []\n  bad: [configs/method/cd.yaml, '{item}']\n")
    with pytest.raises(ConfigError, match=f"^sweep run 'bad': {key}"):
        sweep.expand(str(path), [])


@pytest.mark.slow
def test_train_refuses_a_cd_role_before_claiming_its_folder(tmp_path):
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--config", TINY, "cd.enabled=true",
                           "cd.lam_per_role.fc2=abc", f"out_dir={out}"], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == "error: cd.lam_per_role.fc2 must be a finite number >= 0, got 'abc'"
    assert not out.exists()  # refused before the run's folder, model and data


def schedule_lrs(cfg, updates_per_epoch=2):
    """The lr of every update of cfg's schedule, through timm's scheduler as train.py builds it (the reference for
    where the schedule starts, peaks and ends)."""
    import torch

    from engine.optim import build_optimizer, build_scheduler, peak_lr

    peak = peak_lr(cfg.optim, cfg.train.batch_size)
    opt = build_optimizer(torch.nn.Linear(2, 2), cfg.optim, peak, cfg.optim.weight_decay)
    sched = build_scheduler(opt, cfg.sched, updates_per_epoch)
    lrs = []
    for epoch in range(cfg.sched.epochs):
        sched.step(epoch)
        lrs.append(opt.param_groups[0]["lr"])
    return peak, lrs


@pytest.mark.parametrize("overrides, key", [
    # lr_base 5e-4 at a global batch of 8: peak 7.8e-6, below the absolute min_lr 1e-5 the schedule decays to
    (["optim.lr_base=5e-4", "optim.lr=null", "sched.min_lr=1e-5", "sched.warmup_lr=0"], "sched.min_lr"),
    (["optim.lr=1e-3", "sched.warmup_lr=0.05", "sched.warmup_epochs=1"], "sched.warmup_lr"),
])
def test_a_schedule_end_above_the_peak_is_refused_where_the_schedule_would_climb_to_it(overrides, key):
    from engine.training_checks import check_training_settings

    cfg = load_config([TINY], ["train.batch_size=8", "train.batch_size_per_gpu=8", "sched.epochs=6", *overrides])
    peak, lrs = schedule_lrs(cfg)
    assert max(lrs) > peak  # the reference: timm's schedule goes above the peak somewhere
    with pytest.raises(ConfigError) as e:
        check_training_settings(cfg)
    assert str(e.value).startswith(f"{key}=") and "above the peak learning rate" in str(e.value)


@pytest.mark.parametrize("overrides", [
    ["optim.lr_base=1e38", "optim.lr_base_batch=1"], ["optim.lr_base=3e38", "optim.lr_base_batch=8"],
    ["optim.lr_base=1e38", "optim.lr_base_batch=16"], ["optim.lr_base=1e-3", "optim.lr_base_batch=1"],
    # Adam steps with lr / (1 - beta1) first: 10 x the lr, within float32's range for the lr itself
    ["optim.lr=1e37"], ["optim.lr=3.3e37"], ["optim.lr=3.5e37"], ["optim.lr=1e38"],
    ["optim.lr=1e38", "optim.betas=[0.5,0.999]"], ["optim.lr=2e38", "optim.betas=[0.5,0.999]"],
    ["optim.name=sgd", "optim.lr=3e38"], ["optim.name=lamb", "optim.lr=3e38"]])
def test_a_peak_lr_whose_first_step_overflows_is_refused_before_training(overrides):
    """optim.lr_base within the schema's float32 bound can still scale (x 16/1 at tiny's batch 16) to a peak torch
    cannot step the weights with, and Adam's first step is 10 x the lr (an lr of 3.5e37 ended the first update in
    a traceback from inside torch). The reference: the tiny model's own optimizer, built as train.py builds it,
    stepping once at that peak."""
    import torch

    from engine.optim import build_optimizer, peak_lr
    from engine.training_checks import check_training_settings
    from models import build_model

    cfg = load_config([TINY], [*overrides, "sched.min_lr=0", "sched.warmup_lr=0"])
    peak = peak_lr(cfg.optim, cfg.train.batch_size)
    model = build_model(cfg.model)
    try:
        optimizer = build_optimizer(model, cfg.optim, lr=peak, weight_decay=cfg.optim.weight_decay)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        optimizer.step()
        overflows = False
    except RuntimeError as e:
        assert "overflow" in str(e), e
        overflows = True
    if not overflows:
        check_training_settings(cfg)
        return
    key = "optim.lr" if cfg.optim.lr is not None else "optim.lr_base"
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}=\S+: the first step of optim.name=\w+ at the peak "
                                          rf"learning rate .* overflows float32"):
        check_training_settings(cfg)


def test_the_peak_lr_probe_is_seen_by_no_global_optimizer_hook_and_leaves_the_generator_as_it_was():
    """check_peak_lr steps an optimizer once: a global step hook (a user's, or a test counting the run's updates)
    counted that step as the run's first, and the probe's init drew from the CPU generator before the run seeded."""
    import torch
    import torch.optim.optimizer as optimizer_module

    from engine.training_checks import check_training_settings

    seen = []
    handles = [optimizer_module.register_optimizer_step_pre_hook(lambda *_: seen.append("pre")),
               optimizer_module.register_optimizer_step_post_hook(lambda *_: seen.append("post"))]
    try:
        state = torch.get_rng_state()
        check_training_settings(load_config([TINY], ["optim.lr=1e-3"]))
        assert seen == [] and torch.equal(torch.get_rng_state(), state)
        step = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)  # the hooks are back for the run's own
        step.param_groups[0]["params"][0].grad = torch.ones(1)
        step.step()
        assert seen == ["pre", "post"]
    finally:
        for handle in handles:
            handle.remove()


def test_schedule_ends_at_the_peak_pass():
    from engine.training_checks import check_training_settings

    base = [TINY], ["train.batch_size=8", "train.batch_size_per_gpu=8", "sched.epochs=6", "optim.lr=1e-3"]
    for extra in (["sched.min_lr=1e-3"], ["sched.warmup_lr=1e-3", "sched.warmup_epochs=1"]):
        cfg = load_config(base[0], base[1] + extra)
        peak, lrs = schedule_lrs(cfg)
        assert max(lrs) <= peak * (1 + 1e-12)
        check_training_settings(cfg)


def test_a_run_written_before_the_schedule_check_resumes_and_a_fresh_one_is_refused(tmp_path, capsys, monkeypatch):
    """A checkpoint of batch 8 at the default lr_base (peak 7.8e-6, min_lr 1e-5 above it), as a run started before
    the check existed wrote it, continues as written (the resume check refuses changed settings, so it had no other
    way); a fresh run of the same settings is refused before its out_dir is made."""
    import engine.training_checks as checks
    from tests.conftest import run_entry

    settings = ["--config", TINY, "train.batch_size=8", "train.batch_size_per_gpu=8", "optim.lr=null"]
    monkeypatch.setattr(checks, "check_schedule_ends", lambda cfg: None)  # the code before the check
    code, _, err = run_entry("train.py", [*settings, f"out_dir={tmp_path / 'old'}", "train.max_steps=1"], capsys)
    assert code == 0, err
    monkeypatch.undo()
    code, out, err = run_entry("train.py", [*settings, f"out_dir={tmp_path / 'old'}", "train.max_steps=2"], capsys)
    assert code == 0, err
    assert "sched.min_lr=1e-05 is above the peak learning rate" in out + err \
        and "continues as it was written" in out + err
    code, _, err = run_entry("train.py", [*settings, f"out_dir={tmp_path / 'new'}", "train.max_steps=1"], capsys)
    assert code == 1 and err.strip().startswith("error: sched.min_lr=1e-05 is above the peak") and len(
        err.strip().splitlines()) == 1
    assert not (tmp_path / "new").exists()



@pytest.mark.parametrize("overrides, error", [
    (["model.name=vit_nanoo"], "unknown model 'vit_nanoo'"),
    (["model.kwargs={depthh: 2}"], "rejected its arguments"),
    (["model.name=gpt2_nano", "model.drop_path=0"], "is a language model, data.dataset=synthetic is images"),
    (["model.pretrained=hub"], "vit_nano is one of models/variants.py's small variants, which have no hub weights"),
])
def test_a_model_the_run_cannot_build_is_refused_before_its_out_dir_is_made(tmp_path, overrides, error):
    """A typo in model.name or model.kwargs, hub weights of a model that has none, or a model of another task,
    leaves no train.log that the corrected command would archive: the folder is not made."""
    import train

    with pytest.raises(Exception, match=re.escape(error)):
        train.main(load_config([TINY], [*overrides, f"out_dir={tmp_path / 'run'}"]))
    assert not (tmp_path / "run").exists()

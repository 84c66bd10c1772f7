"""Every offered sched.name decays over the run's length to sched.min_lr, as its help says (configs/schema.py):
poly is timm's min_lr + (peak - min_lr) x (1 - t/T)^power, whose power (timm's decay_rate) was left at timm's
default 0.1, so the lr stayed near the peak to the last update (kjv_nano: 8.15e-4 with peak 1e-3, min_lr 1e-4) and
only jumped to min_lr after it. Checked here against the linear (power 1) closed form at each epoch and update, per
epoch, per update and with sched.steps, with warmups, and through train.py's own loop (its logged train/lr)."""
import json
import os

import pytest
import torch

import train
from configs import load_config
from configs.schema import SchedConfig
from engine.optim import build_scheduler
from tests.conftest import ROOT

NANO = os.path.join(ROOT, "configs", "lm", "kjv_nano.yaml")
PEAK, MIN_LR, WARMUP_LR = 1e-3, 1e-4, 1e-6


def linear_poly(t, *, warmup_t, decay_start, decay_t, peak=PEAK, min_lr=MIN_LR, warmup_lr=WARMUP_LR):
    """The lr at schedule time t: linear warmup from warmup_lr over warmup_t, then a straight line from the peak
    (reached at decay_start) to min_lr at decay_start + decay_t, min_lr after it."""
    if t < warmup_t:
        return warmup_lr + t * (peak - warmup_lr) / warmup_t
    return min_lr + (peak - min_lr) * max(0.0, 1 - (t - decay_start) / decay_t)


def scheduled_lrs(cfg, updates_per_epoch, times, per_update):
    """The lr the scheduler sets at each of `times` (updates or epochs)."""
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=PEAK)
    scheduler = build_scheduler(optimizer, cfg, updates_per_epoch)
    lrs = []
    for t in times:
        scheduler.step_update(t) if per_update else scheduler.step(t)
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


# (config, updates per epoch, per-update?, the closed form's warmup length, decay start and decay length in the
# scheduler's time units, the number of those the run trains)
CASES = {
    "per_epoch": (SchedConfig(name="poly", epochs=10, warmup_epochs=2, min_lr=MIN_LR, warmup_lr=WARMUP_LR),
                  5, False, 2, 0, 10, 10),  # DeiT: the warmup inside the run's length, the line drawn from epoch 0
    "per_epoch_prefix": (SchedConfig(name="poly", epochs=10, warmup_epochs=2, warmup_prefix=True, min_lr=MIN_LR,
                                     warmup_lr=WARMUP_LR), 5, False, 2, 2, 8, 10),
    "per_update": (SchedConfig(name="poly", epochs=6, warmup_epochs=1, per_step=True, min_lr=MIN_LR,
                               warmup_lr=WARMUP_LR), 7, True, 7, 0, 42, 42),
    "per_update_prefix": (SchedConfig(name="poly", epochs=6, warmup_epochs=1, per_step=True, warmup_prefix=True,
                                      min_lr=MIN_LR, warmup_lr=WARMUP_LR), 7, True, 7, 7, 35, 42),
    "steps": (SchedConfig(name="poly", steps=40, warmup_steps=4, min_lr=MIN_LR, warmup_lr=WARMUP_LR),
              7, True, 4, 4, 36, 40),
}


@pytest.mark.parametrize("case", CASES)
def test_poly_is_a_straight_line_to_min_lr_at_every_epoch_and_update(case):
    cfg, per_epoch, per_update, warmup_t, decay_start, decay_t, length = CASES[case]
    times = list(range(length + 1))  # every epoch / update the run trains, and the run's end
    expected = [linear_poly(t, warmup_t=warmup_t, decay_start=decay_start, decay_t=decay_t) for t in times]
    assert scheduled_lrs(cfg, per_epoch, times, per_update) == pytest.approx(expected, rel=1e-12, abs=1e-15)
    # the last epoch / update trains one step of the line above min_lr; the run's end is min_lr itself
    assert expected[-2] == pytest.approx(MIN_LR + (PEAK - MIN_LR) / decay_t) and expected[-1] == MIN_LR


@pytest.mark.parametrize("name", ["cosine", "tanh", "poly"])
@pytest.mark.parametrize("per_update", [False, True], ids=["per_epoch", "per_update"])
def test_every_offered_schedule_trains_its_last_step_near_min_lr(name, per_update):
    """Not only the run's end (where timm sets min_lr for any of them) but the last lr the run trains with lies
    within one linear step, (peak - min_lr) / T, of min_lr: a schedule that came down only after the run ended would
    not be one that "decays over the run's length to min_lr"."""
    cfg = SchedConfig(name=name, epochs=10, warmup_epochs=1, per_step=per_update, min_lr=MIN_LR, warmup_lr=WARMUP_LR)
    length = 10 * 3 if per_update else 10
    lrs = scheduled_lrs(cfg, 3, range(length + 1), per_update)
    assert lrs[-1] == pytest.approx(MIN_LR)
    assert MIN_LR < lrs[-2] <= MIN_LR + (PEAK - MIN_LR) / length * (1 + 1e-9)


def test_train_py_trains_poly_down_to_min_lr(tmp_path):
    """The reviewer's repro through train.py's loop: kjv_nano (12 updates, 2 of warmup from 0, peak 1e-3, min_lr 1e-4)
    with sched.name=poly trained its last update at 8.15e-4; each update's logged train/lr is now the line's."""
    cfg = load_config([NANO], [f"out_dir={tmp_path / 'run'}", "sched.name=poly", "train.eval_every_steps=0",
                               "train.log_every_steps=1", "log.tensorboard=false"])
    assert (cfg.optim.lr, cfg.sched.min_lr, cfg.sched.warmup_lr, cfg.sched.steps, cfg.sched.warmup_steps) == (
        PEAK, MIN_LR, 0.0, 12, 2)
    train.main(cfg)
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        logged = {r["step"]: r["train/lr"] for r in map(json.loads, f) if "train/lr" in r}
    assert sorted(logged) == list(range(1, 13))
    # update u trains at schedule time u - 1 (timm's warmup starts at warmup_lr on update 1)
    expected = {u: linear_poly(u - 1, warmup_t=2, decay_start=2, decay_t=10, warmup_lr=0.0) for u in logged}
    assert logged == pytest.approx(expected, rel=1e-6)
    assert logged[12] == pytest.approx(1.9e-4)  # one tenth of the way from min_lr to the peak


@pytest.mark.slow
def test_a_poly_run_of_another_power_does_not_resume_on_the_new_curve_without_a_word(tmp_path, capsys):
    """A checkpoint of a poly run whose scheduler decayed with create_scheduler_v2's default power (what build_scheduler
    passed before it set the power, recorded in the checkpoint's scheduler state) would continue on another lr curve:
    refused in one error line naming train.allow_changed_config=true, which continues on the new one, warned; a
    re-run with no update left is not refused."""
    from timm.scheduler import create_scheduler_v2
    from tests.conftest import run_entry

    sgd = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    old_power = create_scheduler_v2(sgd, sched="poly", num_epochs=4)[0].power  # without decay_rate, as before
    assert old_power == pytest.approx(0.1)  # create_scheduler_v2's default: the old curve's
    out = tmp_path / "run"
    settings = ["--config", NANO, f"out_dir={out}", "sched.name=poly", "train.eval_every_steps=0",
                "log.tensorboard=false"]
    code, _, err = run_entry("train.py", [*settings, "train.max_steps=2"], capsys)
    assert code == 0, err
    ckpt = out / "checkpoint.pt"
    payload = torch.load(ckpt, map_location="cpu", weights_only=False)
    assert payload["scheduler"]["power"] == 1.0  # what is written now
    payload["scheduler"]["power"] = old_power  # as the earlier code wrote it
    torch.save(payload, ckpt)
    code, _, err = run_entry("train.py", [*settings, "train.max_steps=2"], capsys)
    assert code == 0, err  # nothing left to train: a re-run of the finished command validates on no curve
    code, _, err = run_entry("train.py", [*settings, "train.max_steps=3"], capsys)
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: ") and "power 0.1" in err and "train.allow_changed_config=true" in err
    assert torch.load(ckpt, map_location="cpu", weights_only=False)["state"] == payload["state"]  # nothing trained
    code, out_text, err = run_entry("train.py", [*settings, "train.max_steps=3", "train.allow_changed_config=true"],
                                    capsys)
    assert code == 0, err
    assert "power 0.1" in out_text + err and "new curve" in out_text + err
    with open(out / "metrics.jsonl") as f:
        assert max(json.loads(line)["step"] for line in f) == 3

"""CD and TWEO inside train.py: they train on digits, CD lowers the pair energy, runs once per update,
moves weight decay by the budget rule and is stored in the checkpoint."""
import json
import os

import pytest
import torch

import train
from configs import load_config
from tests.conftest import DEMO_CONFIG

# digits, a two-block ViT, 2 accumulation steps per update, 20 updates, no warmup
FAST = ("model.name=vit_nano", "train.max_steps=20", "sched.epochs=2",
        "sched.warmup_epochs=0", "train.batch_size=64", "train.batch_size_per_gpu=32",
        "train.log_every_steps=5", "log.tensorboard=false")


def run(tmp_path, name, *overrides):
    cfg = load_config([DEMO_CONFIG], [*FAST, f"out_dir={tmp_path / name}", *overrides])
    result = train.main(cfg)
    with open(os.path.join(cfg.out_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    return result, [r for r in records if "train/loss" in r]


@pytest.mark.slow
def test_cd_trains_on_digits_lowers_pair_energy_and_applies_once_per_update(tmp_path):
    _, base = run(tmp_path, "base")
    result, cd = run(tmp_path, "cd", "cd.enabled=true", "cd.lam=1.0", "cd.budget=false")
    assert result.state.step == 20
    assert cd[-1]["cd/updates"] == 20  # 40 micro-batches, 20 optimizer updates, 20 CD updates
    for role in ("qkv", "proj", "fc1", "fc2"):
        # baselines log it too
        assert cd[-1][f"cd/pair_energy/{role}"] < base[-1][f"cd/pair_energy/{role}"], role
        assert cd[-1][f"cd/update_norm/{role}"] > 0
    assert all(torch.isfinite(torch.tensor(r["train/loss"])) for r in cd)


def test_cd_budget_rule_and_checkpointed_state(tmp_path):
    result, _ = run(tmp_path, "budget", "cd.enabled=true")
    ckpt = torch.load(tmp_path / "budget" / "checkpoint.pt", weights_only=True)
    decays = {g["weight_decay"] for g in ckpt["optimizer"]["param_groups"]}
    # demo wd 0.05 - cd.lam 0.005; 1-D params never decay
    assert sorted(decays) == pytest.approx([0.0, 0.045])
    assert ckpt["cd"]["num_updates"] == result.state.step


def test_tweo_trains_on_digits_and_logs_its_penalty(tmp_path):
    result, records = run(tmp_path, "tweo", "tweo.enabled=true", "tweo.schedule=cosine")
    assert result.state.step == 20
    assert records[-1]["tweo/penalty"] > 0 and 0 <= records[-1]["tweo/lam"] < 0.01  # cosine has decayed
    assert all(torch.isfinite(torch.tensor(r["train/loss"])) for r in records)


def log_lines(out_dir) -> list[str]:
    with open(os.path.join(out_dir, "train.log"), encoding="utf-8") as f:
        return f.read().splitlines()


@pytest.mark.parametrize("overrides, settings", [
    (("tweo.lam=0.02", "tweo.p=3", "tweo.tau=2.5", "tweo.eps=0.001", "tweo.schedule=cosine"),
     # the debug recipe's schedule: 64 images / 16 a batch = 4 updates per epoch, 2 epochs
     "lam=0.02, p=3.0, tau=2.5, eps=0.001, schedule='cosine', total_steps=8, form='memory_saving'"),
    (("tweo.rescale=true", "tweo.form=plain"),  # tau and eps cancel in the rescaled term: not said
     "lam=0.01, p=4.0, rescale=True, schedule='constant', form='plain'"),
])
def test_a_tweo_run_logs_the_settings_it_trains_with_once(debug_config, overrides, settings):
    """A TWEO run says in train.log what its TWEO is, as a CD run says its CD: the blocks hooked (vit_nano's two
    pre-norm blocks) and the values given, once."""
    cfg = debug_config("tweo.enabled=true", *overrides, "train.max_steps=1")
    train.main(cfg)
    said = [line for line in log_lines(cfg.out_dir) if "TWEO(" in line]
    assert len(said) == 1 and said[0].endswith(f"train INFO TWEO(blocks=2 [blocks.0 .. blocks.1], {settings})"), said


def test_a_resume_with_changed_cd_settings_says_them_once_and_another_pairing_is_logged(debug_config):
    """A resume with another cd.lam (train.allow_changed_config=true) names it in the run's "resuming with changed
    settings" line alone: ColinearityDecay's own warning of its state's config (a raw Python UserWarning with its
    source line) is not added. A checkpoint whose CD state decayed other matrices under the same settings (another
    release's pairing) is said once, as a line of the run's log."""
    first = debug_config("cd.enabled=true", "train.max_steps=2")
    train.main(first)
    changed = debug_config("cd.enabled=true", "cd.lam=0.01", "train.allow_changed_config=true", "train.max_steps=3")
    train.main(changed)
    lines = log_lines(first.out_dir)
    said = [line for line in lines if "resuming with" in line or "CD config" in line]
    assert len(said) == 1 and said[0].endswith("train WARNING resuming with changed settings: cd.lam: 0.005 -> 0.01")
    assert not any("UserWarning" in line or "py.warnings" in line for line in lines)

    path = os.path.join(first.out_dir, "checkpoint.pt")
    payload = torch.load(path, weights_only=False)
    last = payload["cd"]["config"]["decayed"].pop()  # the run's CD state decays one matrix more than it did then
    torch.save(payload, path)
    start = len(log_lines(first.out_dir))
    train.main(debug_config("cd.enabled=true", "cd.lam=0.01", "train.allow_changed_config=true",
                            "train.max_steps=4"))
    said = [line for line in log_lines(first.out_dir)[start:] if "CD config" in line]
    assert len(said) == 1 and "train WARNING ColinearityDecay: resuming with a different CD config" in said[0], said
    assert said[0].endswith(f"decayed matrices: 7 saved, 8 now (1 only now, e.g. {last})")

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

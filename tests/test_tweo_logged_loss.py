"""train/loss with TWEO and CD's loss form is the minimised total; docs/operations.md's formulas give the task loss
back from the logged values, checked against a baseline's train/loss on the same first update."""
import json
import math
import os

import train

# one update of 2 micro-batches, logged: every run starts from the same weights on the same batches (the same seed),
# so the window's task loss is the baseline's train/loss
ONE_WINDOW = ("train.max_steps=1", "train.log_every_steps=1", "log.tensorboard=false")
CD_LOSS = ("cd.enabled=true", "cd.mode=loss", "cd.loss_coef=0.25")


def first_window(debug_config, name, *overrides):
    cfg = debug_config(*ONE_WINDOW, *overrides, name=name)
    train.main(cfg)
    with open(os.path.join(cfg.out_dir, "metrics.jsonl")) as f:
        return next(r for r in map(json.loads, f) if "train/loss" in r)


# the task loss of the window from each run's record, as docs/operations.md writes it (c = cd.loss_coef)
CASES = {
    "tweo": (("tweo.enabled=true", "tweo.lam=1.0"), lambda r: r["train/loss"] - r["tweo/lam"] * r["tweo/penalty"]),
    "tweo_cd_loss": (("tweo.enabled=true", "tweo.lam=1.0", *CD_LOSS),
                     lambda r: (r["train/loss"] - r["tweo/lam"] * r["tweo/penalty"]) / (1 + 0.25)),
    "rescaled_cd_loss": (("tweo.enabled=true", "tweo.lam=0.5", "tweo.rescale=true", *CD_LOSS),
                         lambda r: r["train/loss"] / (1 + r["tweo/lam"] + 0.25)),
    "cd_loss": (CD_LOSS, lambda r: r["train/loss"] / (1 + 0.25)),
}


def test_the_task_loss_comes_back_from_the_logged_values(debug_config):
    base = first_window(debug_config, "base")["train/loss"]
    for name, (overrides, task_loss) in CASES.items():
        record = first_window(debug_config, name, *overrides)
        assert record["train/loss"] - base > 1e-3, name  # the terms are in it (TWEO's penalty is ~4e-3 here)
        assert math.isclose(task_loss(record), base, rel_tol=1e-6), (name, task_loss(record), base)

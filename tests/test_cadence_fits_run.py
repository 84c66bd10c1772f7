"""train.eval_every_steps / train.ckpt_every_steps longer than the whole run are refused before training, as
train.keep_every_epochs is: they act at the run's updates N, 2N, ..., so a run of fewer updates never acted on
them (8 updates with 100: rc 0, config.yaml recording 100). The largest value that acts, the run's length in
updates, is counted here from the debug config's own numbers (images, batch, epochs), not from train.py."""
import json
import os

import pytest

import train
from configs import ConfigError
from tests.conftest import DEBUG_CONFIG, run_entry

KEYS = ["train.eval_every_steps", "train.ckpt_every_steps"]


def _updates(cfg) -> int:
    """The debug run's length in updates: sched.steps, or sched.epochs x (training images // global batch)."""
    if cfg.sched.steps is not None:
        return cfg.sched.steps
    return cfg.sched.epochs * (cfg.data.synthetic_train_size // cfg.train.batch_size)


def _validated_steps(out_dir: str) -> list[int]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [r["step"] for r in map(json.loads, f) if "val/top1" in r]


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("schedule", [[], ["sched.steps=6", "sched.warmup_steps=1"]], ids=["epochs", "steps"])
def test_a_cadence_longer_than_the_run_is_refused_naming_the_largest_that_acts(debug_config, key, schedule):
    """One more than the run's updates: refused before any update, naming the key, the run's length and the
    largest value that acts; the run's length itself is accepted."""
    updates = _updates(debug_config(*schedule))
    assert updates == (6 if schedule else 8)  # 64 images, global batch 16, 2 epochs (or sched.steps=6)
    cfg = debug_config(*schedule, f"{key}={updates + 1}", name="refused")
    with pytest.raises(ConfigError, match=rf"^{key}={updates + 1}: the run has {updates} updates \(.*\), so it would "
                                          rf"never .* at one; set it to {updates} or fewer \(0: at epoch ends only\)"):
        train.main(cfg)
    assert not os.path.exists(os.path.join(cfg.out_dir, "checkpoint.pt"))
    assert not os.path.exists(os.path.join(cfg.out_dir, "metrics.jsonl"))
    assert train.main(debug_config(*schedule, f"{key}={updates}", name="kept")).state.step == updates


def test_the_reviewers_command_is_refused(debug_config):
    """`train.py --config configs/debug/tiny.yaml train.eval_every_steps=100 train.ckpt_every_steps=100`: 8
    updates, rc 0 before; now the first of the two keys is named, and nothing trains."""
    cfg = debug_config("train.eval_every_steps=100", "train.ckpt_every_steps=100")
    with pytest.raises(ConfigError, match=r"^train.eval_every_steps=100: the run has 8 updates \(sched.epochs=2 x 4 "
                                          r"updates\), so it would never validate at one; set it to 8 or fewer"):
        train.main(cfg)
    assert not os.path.exists(os.path.join(cfg.out_dir, "checkpoint.pt"))


def test_a_resume_may_change_the_cadence_within_the_run_but_not_past_it(debug_config):
    """A resume changes train.eval_every_steps (no train.allow_changed_config: it changes nothing an update
    computes); counted from the run's start, 2 -> 5 at update 3 validates at 5, then at the end (8). A new value
    past the run's 8 updates is refused as a fresh start's is, the checkpoint left as it was."""
    train.main(debug_config("train.eval_every_epochs=2", "train.eval_every_steps=2", "train.max_steps=3", name="r"))
    ckpt = os.path.join(debug_config(name="r").out_dir, "checkpoint.pt")
    before = open(ckpt, "rb").read()
    for key in KEYS:
        with pytest.raises(ConfigError, match=rf"^{key}=9: the run has 8 updates"):
            train.main(debug_config("train.eval_every_epochs=2", f"{key}=9", name="r"))
        assert open(ckpt, "rb").read() == before
    resumed = debug_config("train.eval_every_epochs=2", "train.eval_every_steps=5", name="r")
    assert train.main(resumed).state.step == 8
    assert _validated_steps(resumed.out_dir) == [2, 3, 5, 8]  # 2, 3: before the resume (3: train.max_steps)


@pytest.mark.parametrize("schedule", [[], ["sched.steps=6", "sched.warmup_steps=1"]], ids=["epochs", "steps"])
def test_a_max_steps_beyond_the_run_is_refused_and_the_runs_length_taken(debug_config, schedule):
    """`train.max_steps=1000` over the debug run's 8 updates trained all 8 and said 'finished at update 8' (rc 0,
    config.yaml recording 1000), while a cadence beyond the run is refused: the schedule ends the run first, so
    the stop asked for never acts. One more than the run's updates is refused before any update; the run's length
    itself stops it there."""
    updates = _updates(debug_config(*schedule))
    cfg = debug_config(*schedule, f"train.max_steps={updates + 1}", name="refused")
    with pytest.raises(ConfigError, match=rf"^train.max_steps={updates + 1}: the run has {updates} updates \(.*\), "
                                          rf"so its schedule ends it before it would stop at it; set it to {updates} "
                                          rf"or fewer, or drop it"):
        train.main(cfg)
    assert not os.path.exists(os.path.join(cfg.out_dir, "checkpoint.pt"))
    assert not os.path.exists(os.path.join(cfg.out_dir, "metrics.jsonl"))
    assert train.main(debug_config(*schedule, f"train.max_steps={updates}", name="kept")).state.step == updates


def test_the_reviewers_max_steps_command_is_refused(capsys, tmp_path):
    """`python train.py --config configs/debug/tiny.yaml train.max_steps=1000`: one error line, exit 1."""
    out_dir = tmp_path / "run"
    code, _, err = run_entry("train.py", ["--config", DEBUG_CONFIG, f"out_dir={out_dir}", "train.max_steps=1000"],
                             capsys)
    assert code == 1 and err.splitlines()[-1] == (
        "error: train.max_steps=1000: the run has 8 updates (sched.epochs=2 x 4 updates), so its schedule ends it "
        "before it would stop at it; set it to 8 or fewer, or drop it (null: the whole schedule), or lengthen the run")
    assert not (out_dir / "checkpoint.pt").exists()

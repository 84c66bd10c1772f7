"""Settings a resume may change that come with state or records of their own (docs/operations.md, Resume): quant.*,
recorded in best.pt and checkpoint.pt as the defaults of `evaluate.py --checkpoint`; train.amp=fp16's loss scale
and train.ema's average, turned on or off with train.allow_changed_config=true; CD turned on, whose update norms
fall on the run's log steps."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import evaluate
import train
from engine.checkpoint import CheckpointError
from tests.conftest import DEBUG_CONFIG, ROOT


def load(out_dir, name):
    return torch.load(os.path.join(out_dir, name), weights_only=True)


def test_quant_settings_changed_at_a_resume_become_the_defaults_of_evaluating_best_pt_and_checkpoint_pt(
        debug_config):
    """A finished run re-run with new quant.* writes no checkpoint and no best.pt (nothing improves): both files
    still get the new quant section, and evaluate.py --checkpoint of either resolves it as its defaults. The rest
    of each file (weights, state, the training settings) is as it was; the epoch's snapshot, a record of the run
    as it stood, keeps the quant settings it was written with."""
    first = debug_config("train.keep_every_epochs=1")
    train.main(first)
    names = ("best.pt", "checkpoint.pt")
    before = {name: load(first.out_dir, name) for name in names}
    assert before["best.pt"]["config"]["quant"]["pipelines"] is None  # the task's: percentile and repq, w4a4
    train.main(debug_config("train.keep_every_epochs=1", "quant.pipelines=[percentile]", "quant.bits=[w8a8]"))
    for name in names:
        after = load(first.out_dir, name)
        assert (after["config"]["quant"]["pipelines"], after["config"]["quant"]["bits"]) == (["percentile"], ["w8a8"])
        assert ({k: v for k, v in after["config"].items() if k != "quant"}
                == {k: v for k, v in before[name]["config"].items() if k != "quant"}), name
        assert after["state"] == before[name]["state"] and after.keys() == before[name].keys(), name
        assert all(torch.equal(v, before[name]["model"][k]) for k, v in after["model"].items()), name
        cfg, _ = evaluate.resolve_config(evaluate.parse_args(["--checkpoint", os.path.join(first.out_dir, name)]))
        assert (cfg.quant.pipelines, cfg.quant.bits) == (["percentile"], ["w8a8"]), name
    assert load(first.out_dir, os.path.join("snapshots", "epoch0002.pt"))["config"]["quant"]["pipelines"] is None


def test_fp16_turned_on_at_a_resume_starts_a_fresh_loss_scale_and_turned_off_drops_it(debug_config):
    """train.amp=fp16 from a checkpoint written without it: the GradScaler is a fresh fp16 run's (its initial
    scale, 2**16, then its own growth and back-off); train.amp=bf16 after fp16 leaves the saved scale unread and
    writes none."""
    train.main(debug_config("train.max_steps=3", name="to_fp16"))
    resumed = train.main(debug_config("train.amp=fp16", "train.allow_changed_config=true", name="to_fp16"))
    assert resumed.state.step == 8 and resumed.reason == "finished"
    scaler = load(debug_config(name="to_fp16").out_dir, "checkpoint.pt")["scaler"]
    # a GradScaler halves its scale at each skipped update and doubles it after growth_interval (2000) good ones
    assert scaler["scale"] == 2.0 ** 16 * 0.5 ** resumed.state.skipped_steps

    train.main(debug_config("train.amp=fp16", "train.max_steps=3", name="from_fp16"))
    assert "scaler" in load(debug_config(name="from_fp16").out_dir, "checkpoint.pt")
    resumed = train.main(debug_config("train.amp=bf16", "train.allow_changed_config=true", name="from_fp16"))
    assert resumed.state.step == 8 and "scaler" not in load(debug_config(name="from_fp16").out_dir, "checkpoint.pt")


@pytest.mark.slow
def test_ema_turned_on_at_a_resume_is_refused_in_one_line_naming_train_ema(debug_config):
    """An EMA begun at the resume is not the average a run with train.ema=true holds at that update (and
    evaluate.py --ema would score it as one): refused, naming train.ema and the ways on, before anything in
    out_dir changes. train.ema=false after an EMA run drops the average."""
    cfg = debug_config("train.max_steps=3")
    train.main(cfg)
    files = sorted(os.listdir(cfg.out_dir))
    checkpoint = os.path.join(cfg.out_dir, "checkpoint.pt")
    with pytest.raises(CheckpointError) as refused:
        train.main(debug_config("train.ema=true", "train.allow_changed_config=true"))
    assert str(refused.value) == (
        f"{checkpoint} was written without an EMA of the weights and this run keeps one (train.ema=true): an average "
        f"begun at its update 3 is not the one a run with train.ema=true from the start holds there; resume with "
        f"train.ema=false, or start a new run from its weights (another out_dir, model.pretrained={checkpoint})")
    assert sorted(os.listdir(cfg.out_dir)) == files

    run = subprocess.run([sys.executable, "train.py", "--config", DEBUG_CONFIG, f"out_dir={cfg.out_dir}",
                          "log.tensorboard=false", "train.ema=true", "train.allow_changed_config=true"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode != 0 and run.stderr.strip().splitlines()[-1].startswith(f"error: {checkpoint} was written "
                                                                                  f"without an EMA")

    train.main(debug_config("train.ema=true", "train.max_steps=3", name="ema"))
    resumed = train.main(debug_config("train.ema=false", "train.allow_changed_config=true", name="ema"))
    assert resumed.state.step == 8 and "model_ema" not in load(debug_config(name="ema").out_dir, "checkpoint.pt")


def test_cd_turned_on_at_a_resume_logs_the_update_norm_of_each_log_step(debug_config):
    """CD turned on at a resume at update 4 (train.allow_changed_config=true) computes its update norms at the
    updates that are multiples of train.log_every_steps=3, counted from the run's start: the norm logged at update 6
    is update 6's, and the epoch's end at update 8 holds it. Reference: the same resume logging every update (the
    log cadence changes no weight), whose record of update 6 is that update's norm. A counter started at 0 at the
    resume logged no norm at update 6 and update 7's at update 8."""
    train.main(debug_config("train.max_steps=4", "log.tensorboard=false", name="every3"))
    shutil.copytree(debug_config(name="every3").out_dir, debug_config(name="every1").out_dir)
    logged = {}
    for name, every in (("every3", 3), ("every1", 1)):
        cfg = debug_config("cd.enabled=true", "train.allow_changed_config=true", f"train.log_every_steps={every}",
                           "log.tensorboard=false", name=name)
        train.main(cfg)
        with open(os.path.join(cfg.out_dir, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f]
        logged[name] = {r["step"]: {k: v for k, v in r.items() if k.startswith("cd/update_norm/")} for r in records
                        if any(k.startswith("cd/update_norm/") for k in r)}
    assert sorted(logged["every3"]) == [6, 8], logged["every3"]
    assert logged["every1"][6] and all(logged["every3"][step] == logged["every1"][6] for step in (6, 8)), logged

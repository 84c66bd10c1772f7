"""A run whose validation fails is re-run with the same command: the resumed run makes that validation, once.

configs/debug/tiny.yaml with train.eval_every_steps=3 and train.ckpt_every_steps=2 (4 updates per epoch, 8 in all):
validations at updates 3, 4 (the first epoch's end), 6 and 8, checkpoint.pt written every 2 updates, before the
validation of its update. The error is a full disk at a write the validation makes after its scoring (the record in
metrics.jsonl, best.pt), which escapes the checkpoint that an error inside the scoring writes first
(engine/loop.py progress_kept_on_error), as any error does under torchrun: the run stops with the write of its
update made before the validation as checkpoint.pt. The reference is the same command run without the error."""
import errno
import json
import logging
import os

import pytest
import torch

import train
from engine.best_checkpoint import BestCheckpoint
from engine.checkpoint import load_checkpoint
from engine.metrics import MetricLogger

CADENCES = ("train.eval_every_steps=3", "train.ckpt_every_steps=2")
# measured, not computed: differ between any two runs; epoch/first_in_process says which job began the epoch
TIMINGS = ("per_s", "data_wait", "mem", "seconds", "first_in_process")


def records(out_dir: str) -> list:
    """metrics.jsonl's records, without the measured timings (and the epoch/* records of those alone, which only an
    epoch run in one go logs)."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    kept = [{k: v for k, v in r.items() if not any(t in k for t in TIMINGS)} for r in lines]
    return [r for r in kept if len(r) > 1]


@pytest.mark.parametrize("where, step", [("metrics", 6), ("metrics", 4), ("best", 6)])
def test_a_failed_validation_is_made_once_by_the_resumed_run(where, step, debug_config, monkeypatch, caplog):
    """Before, the write of update 6 (train.ckpt_every_steps) recorded no validation due: the resumed run trained on
    and metrics.jsonl never got update 6's validation (`metrics`, 6). An update that validates is now recorded as
    due from its step on. Update 4 ends an epoch, whose validation the resumed run derived from the epoch's end
    (`metrics`, 4): it must not validate twice. Where the record was logged and best.pt failed (`best`, 6), the
    validation is made again (best.pt) but not logged twice."""
    reference = train.main(debug_config(*CADENCES, name="reference"))
    cfg = debug_config(*CADENCES)
    target = MetricLogger.log if where == "metrics" else BestCheckpoint.offer
    failed = []

    def full_disk(self, *args):  # (logger, step, metrics) or (best, state, metrics): the validation's of `step`
        at = args[0] if where == "metrics" else args[0].step
        if at == step and "val/loss" in args[1] and not failed:
            failed.append(at)
            raise OSError(errno.ENOSPC, "No space left on device")
        return target(self, *args)

    with monkeypatch.context() as patch:
        patch.setattr(MetricLogger if where == "metrics" else BestCheckpoint,
                      "log" if where == "metrics" else "offer", full_disk)
        with pytest.raises(OSError, match="No space left"):
            train.main(cfg)
    assert failed == [step]
    assert load_checkpoint(os.path.join(cfg.out_dir, "checkpoint.pt"))["state"]["step"] == step
    caplog.clear()
    with caplog.at_level(logging.INFO):
        resumed = train.main(debug_config(*CADENCES))  # the same command
    assert resumed.state.step == reference.state.step == 8
    assert caplog.text.count(f"validation at update {step}:") == 1
    assert records(cfg.out_dir) == records(debug_config(name="reference").out_dir)
    kept, ref = (torch.load(os.path.join(d, "best.pt"), weights_only=False, map_location="cpu")
                 for d in (cfg.out_dir, debug_config(name="reference").out_dir))
    assert kept["state"]["best_step"] == ref["state"]["best_step"]

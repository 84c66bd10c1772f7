"""A resume's branch replaces the records after its update in every sink, not in metrics.jsonl alone.

TensorBoard: each SummaryWriter marks its start with a SessionLog.START at its purge step, and TensorBoard's readers
(the Python EventAccumulator and the plugin accumulator that `tensorboard --load_fast=false` serves from) purge the
events at or past that step, except for the first START of a folder, which they take for the run's start. A fresh
run's writer wrote none, so the first resume's START was that first one: both branches stayed. Read back here with
both readers, against the values logged. A finished run's re-run that validates its last update again (to write a
best.pt moved aside) does not log that validation a second time."""
import json
import os
import time

import pytest
import torch
from tensorboard.backend.event_processing import event_accumulator, plugin_event_accumulator
from tensorboard.util import tensor_util

import train
from engine.metrics import MetricLogger


def _log(out_dir: str, steps: range, value: float, resume_step=None) -> None:
    # each writer in a second of its own: an event file is named by its second, then a per-process counter, and the
    # readers take the files in name order, so writers of one second whose counters pass 9 -> 10 (other tests' in
    # this worker) would be read out of order (a train.py process opens one writer)
    second = int(time.time())
    while int(time.time()) == second:
        time.sleep(0.02)
    logger = MetricLogger(out_dir, True, tensorboard=True, resume_step=resume_step)
    for step in steps:
        logger.log(step, {"train/loss": value + step})
    logger.close()


def _scalars(tb_dir: str, tag: str = "train/loss") -> tuple[list, list]:
    """`tag` as (step, value) pairs, by the Python EventAccumulator and by the plugin accumulator."""
    plain = event_accumulator.EventAccumulator(tb_dir, size_guidance={"scalars": 0})
    plain.Reload()
    plugin = plugin_event_accumulator.EventAccumulator(tb_dir, size_guidance={"tensors": 0})
    plugin.Reload()
    return ([(e.step, round(e.value, 4)) for e in plain.Scalars(tag)],
            [(e.step, round(float(tensor_util.make_ndarray(e.tensor_proto)), 4)) for e in plugin.Tensors(tag)])


def test_a_roll_back_leaves_tensorboard_with_the_new_branch_only(tmp_path):
    out = str(tmp_path)
    _log(out, range(1, 9), 100.0)  # a fresh run to update 8
    _log(out, range(5, 9), 200.0, resume_step=4)  # a roll-back to update 4, trained again with other values
    expected = [(step, 100.0 + step) for step in range(1, 5)] + [(step, 200.0 + step) for step in range(5, 9)]
    plain, plugin = _scalars(str(tmp_path / "tb"))
    assert plain == expected
    assert plugin == expected  # was: steps 5-8 twice, the dropped branch's first


def test_a_second_roll_back_purges_too(tmp_path):
    out = str(tmp_path)
    _log(out, range(1, 9), 100.0)
    _log(out, range(7, 9), 200.0, resume_step=6)
    _log(out, range(3, 9), 300.0, resume_step=2)
    expected = [(step, 100.0 + step) for step in range(1, 3)] + [(step, 300.0 + step) for step in range(3, 9)]
    assert _scalars(str(tmp_path / "tb")) == (expected, expected)


def test_a_finished_run_re_run_without_its_best_pt_writes_it_and_logs_its_validation_once(debug_config, tmp_path):
    """The re-run validates the last update again to write best.pt; that update's validation is in the logs
    already (was: a second {"step": 8, "val/top1": ...} record, in TensorBoard too)."""
    cfg = debug_config(name="x")
    train.main(cfg)
    os.rename(os.path.join(cfg.out_dir, "best.pt"), tmp_path / "best_moved.pt")
    train.main(cfg)
    with open(os.path.join(cfg.out_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records if "val/top1" in r] == [4, 8]
    assert [step for step, _ in _scalars(os.path.join(cfg.out_dir, "tb"), "val/top1")[1]] == [4, 8]
    best = torch.load(os.path.join(cfg.out_dir, "best.pt"), map_location="cpu", weights_only=False)
    assert best["state"]["step"] == 8 and best["metrics"]["val/top1"] == records[-1]["val/top1"]


@pytest.mark.slow
def test_a_re_run_with_other_validation_settings_logs_its_new_validation(debug_config, tmp_path):
    """A finished run re-run with another eval transform validates its last update again and writes best.pt from
    that new number; the new number is logged too (was: left out, since the update had a val record, so
    metrics.jsonl kept only the old setting's score while best.pt and the summary held the new one)."""
    cfg = debug_config("data.dataset=digits", "model.num_classes=10", name="x")
    train.main(cfg)
    with open(os.path.join(cfg.out_dir, "metrics.jsonl")) as f:
        before = [json.loads(line) for line in f]
    changed = debug_config("data.dataset=digits", "model.num_classes=10", "data.crop_pct=0.5",
                           "train.allow_changed_config=true", name="x")
    train.main(changed)
    with open(os.path.join(cfg.out_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert records[:len(before)] == before  # the old setting's records are kept
    (new,) = [r for r in records[len(before):] if "val/top1" in r]
    best = torch.load(os.path.join(cfg.out_dir, "best.pt"), map_location="cpu", weights_only=False)
    last = before[-1]["step"]  # the finished run's last update
    assert new["step"] == last and best["state"]["step"] == last and best["metrics"]["val/top1"] == new["val/top1"]

"""A run stopped inside an epoch and resumed with the same command ends as the run never stopped, bit for bit: the
weights, the EMA, the optimizer's state and groups (lr), the schedule, the counters, the training batches (their
order and augmentation) and metrics.jsonl's training records, with CD on and off, 2 accumulation steps per update and
repeated augmentation (timm's RepeatAugSampler)."""
import os

import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

import train
from tests.test_resume_kills import logged_series
from tests.test_train import checkpoint_tensors


def training_batches(run) -> list:
    """The inputs of the model's training forwards while `run()` runs (validation's and the start checks' forwards on
    the meta device left out)."""
    seen = []

    def hook(module, args):
        if isinstance(module, VisionTransformer) and module.training and not args[0].is_meta:
            seen.append(args[0].clone())

    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        run()
    finally:
        handle.remove()
    return seen


@pytest.mark.parametrize("cd", ["cd.enabled=false", "cd.enabled=true"])
def test_a_run_stopped_mid_epoch_with_repeated_augmentation_resumes_bit_for_bit(debug_config, tmp_path, cd):
    # the debug config: 64 synthetic images, 2 micro-batches of 8 per update; mixup/cutmix and drop path draw too
    common = (cd, "data.repeated_aug=2", "train.ema=true", "train.ema_decay=0.9", "train.log_every_steps=1",
              "log.tensorboard=false")
    straight = debug_config(*common, name="straight")
    batches = training_batches(lambda: train.main(straight))
    first = debug_config(*common, "train.max_steps=3", name="split")
    batches_split = training_batches(lambda: train.main(first))
    stopped = torch.load(os.path.join(first.out_dir, "checkpoint.pt"), weights_only=True)["state"]
    assert (stopped["epoch"], stopped["epoch_batches"]) == (0, 6)  # inside epoch 0 of 4 updates
    batches_split += training_batches(lambda: train.main(debug_config(*common, name="split")))
    assert len(batches) == len(batches_split) == 16
    assert all(torch.equal(a, b) for a, b in zip(batches, batches_split))
    a, state_a, sched_a = checkpoint_tensors(os.path.join(straight.out_dir, "checkpoint.pt"))
    b, state_b, sched_b = checkpoint_tensors(os.path.join(first.out_dir, "checkpoint.pt"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    where_best = ("best_value", "best_epoch", "best_step", "best_fingerprint")  # the split run validated at update 3
    assert {k: v for k, v in state_a.items() if k not in where_best} == {
        k: v for k, v in state_b.items() if k not in where_best}
    assert sched_a == sched_b
    groups_a, groups_b = (torch.load(os.path.join(cfg.out_dir, "checkpoint.pt"), weights_only=True)["optimizer"]
                          ["param_groups"] for cfg in (straight, first))
    assert groups_a == groups_b
    series = logged_series(tmp_path / "straight")
    assert [r["step"] for r in series] == list(range(1, 9)) and logged_series(tmp_path / "split") == series

"""Resume keeps only the optimizer groups' counters from the checkpoint (engine/resume.py, restore_optimizer): every
other group entry is a setting of the config now, also one the old config added and the new one leaves out (layer
decay's lr_scale)."""
import copy
import math
import os

import pytest
import torch

import train
from engine.resume import optimizer_param_names, restore_optimizer


def cosine_lr(t, *, base, t_initial, warmup_t, warmup_lr=1e-6, min_lr=1e-5):
    """timm's cosine schedule with warmup inside it (warmup_prefix=False, one cycle), written out."""
    if t < warmup_t:
        return warmup_lr + t * (base - warmup_lr) / warmup_t
    return min_lr + 0.5 * (base - min_lr) * (1 + math.cos(math.pi * t / t_initial))


def test_layer_decay_turned_off_at_a_resume_trains_every_group_at_the_lr_of_a_fresh_run(debug_config):
    """optim.layer_decay=0.5 for 3 updates, then off: the saved groups' lr_scale (0.125 for the stem of the
    two-block debug ViT) used to stay in the new groups and scale their lr. Each group's lr at update 6 is the
    cosine schedule's, written out, and the groups are those of a run without layer decay from the start."""
    common = ("sched.per_step=true", "optim.lr=0.01", "train.max_steps=6")  # 4 updates per epoch, 2 epochs
    train.main(debug_config(*common[:2], "optim.layer_decay=0.5", "train.max_steps=3", name="ld"))
    resumed = debug_config(*common, "train.allow_changed_config=true", name="ld")
    train.main(resumed)
    fresh = debug_config(*common, name="fresh")
    train.main(fresh)
    groups, fresh_groups = (torch.load(os.path.join(cfg.out_dir, "checkpoint.pt"), weights_only=True)
                            ["optimizer"]["param_groups"] for cfg in (resumed, fresh))
    expected = cosine_lr(6, base=0.01, t_initial=2 * 4, warmup_t=4)
    assert [g["lr"] for g in groups] == [pytest.approx(expected, rel=1e-12)] * 2
    assert all("lr_scale" not in g for g in groups)
    assert groups == fresh_groups


@pytest.mark.parametrize("name", ["Lamb", "Adan"])
def test_a_group_step_counter_continues_the_count_and_other_saved_group_entries_stay_behind(name):
    """timm's Lamb and Adan count their updates in the group (its bias correction reads the count): 2 updates, a
    restore into a fresh optimizer and a third update give the weights of 3 uninterrupted updates. A saved lr_scale
    that the fresh group lacks (layer decay turned off) is not carried over."""
    import timm.optim

    def update(model, optimizer):
        loss = sum(((p - 1) ** 2).sum() for p in model.parameters())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    make = getattr(timm.optim, name)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    old = make(model.parameters(), lr=0.01)
    update(model, old)
    update(model, old)
    saved = copy.deepcopy(old.state_dict())
    saved["param_groups"][0]["lr_scale"] = 0.125
    resumed_model = copy.deepcopy(model)
    update(model, old)  # the uninterrupted third update

    new = make(resumed_model.parameters(), lr=0.01)
    assert "step" not in new.param_groups[0]  # made at the first update
    names = optimizer_param_names(resumed_model, new)
    restore_optimizer(new, saved, names, names)
    assert int(new.param_groups[0]["step"]) == 2 and "lr_scale" not in new.param_groups[0]
    update(resumed_model, new)
    for a, b in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b)

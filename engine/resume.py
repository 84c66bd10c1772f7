"""Resuming under the settings of the run now: the checkpoint gives the STATE, the config the SETTINGS.

A checkpoint holds state (weights, optimizer moments and step counts, counters, the position within the
epoch); the config holds settings (lr, weight decay, betas, schedule, the batch layout). A resumed run
takes each from its own source, so a resume with `train.allow_changed_config=true` and a new `optim.lr`,
`optim.weight_decay` or `sched.epochs` trains with exactly what a fresh run of the new config would use
at that update:

* optimizer (`restore_optimizer`): per-parameter state (Adam moments, step counts) is matched by
  parameter NAME; the hyperparameters of every group (lr, initial_lr, weight_decay, betas, eps, momentum,
  lr_scale, fused, ...) are those of the freshly built optimizer. Groups may therefore change (weight
  decay 0 <-> > 0 and layer decay on / off regroup the parameters). Group-level state that some timm
  optimizers keep in the group is carried over, and only that: the step counters (`step`, `*_step`: Lamb's
  and Adan's `step`, made at their first step, and Lookahead's `lookahead_step`, which a fresh Lookahead puts
  into every group as 0), whose saved count wins over the fresh one. Any other saved key is a setting and
  stays behind, also where the fresh group lacks it (layer decay's `lr_scale` after optim.layer_decay is
  turned off). A change of optimizer (`optim.name`) is refused by train.py: adamw's moments are meaningless
  to sgd.
* schedule: not restored at all. timm schedulers are pure functions of their settings and the update /
  epoch number, and the loop sets the lr of the current update at the start of every epoch
  (engine/loop.py), so the fresh scheduler of the new config is the right one.
* epoch position (`epoch_position`, `resume_position`): saved in SAMPLES of the epoch's global stream,
  together with what that stream depends on. The samplers (DistributedSampler, timm's RepeatAugSampler)
  deal one global permutation round-robin to the ranks, so after k batches of b on each of W ranks the
  first k*b*W positions of that permutation are consumed, whatever W was; W' ranks continue with
  k*b*W / W' positions skipped each. A position that does not fall on a whole update of the new layout,
  an epoch with another number of updates (the step counter would no longer match the schedule), or a
  mid-epoch change of what orders the samples (seed, repeated augmentation, the number of training samples) is
  refused with a CheckpointError that names the cause and the fix. The rule that seeds each epoch's shuffle from
  (seed, epoch) is recorded too (`order_rule`, data/samplers.py ORDER_RULE): a checkpoint without it was written
  under the earlier rule, which its run keeps to its end (`continue_sample_order`), so that it resumes exactly.
  Likewise the order of a folder's images that timm's natural-key order ties (`tie_order`, data/folder.py
  ties_in_name_order): a checkpoint without it was written while they kept the directory listing's order, which
  is not recorded; where such a run stopped inside an epoch and tied images take other places now, the log says
  so (`note_moved_ties`).
* validation windows (`same_val_windows`): a language model's `data.val_windows` is compared by the windows it
  scores, not by its number: 0, the text's count and (in a run written before more were refused) a value past it
  all score every window.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from data.folder import DataError
from data.samplers import OLD_ORDER_RULE, ORDER_RULE, ORDER_RULES
from data.text import TOKEN_DATASETS, scored_val_windows, window_count
from models import ModelError, model_input_size

from .checkpoint import CheckpointError

log = logging.getLogger(__name__)

__all__ = ["optimizer_param_names", "restore_optimizer", "is_group_counter", "epoch_position", "epoch_layout",
           "resume_position", "continue_sample_order", "note_moved_ties", "check_schedule_holds", "same_val_windows"]


def optimizer_param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The parameter names of each of the optimizer's groups, in its order (saved next to its state)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def restore_optimizer(optimizer: torch.optim.Optimizer, saved: dict, saved_names: Optional[list],
                      names: list[list[str]]) -> None:
    """Load the per-parameter state of `saved` (an optimizer state_dict) into `optimizer`, keeping the
    hyperparameters of `optimizer`'s own groups.

    Args:
        saved: the checkpoint's `optimizer.state_dict()`.
        saved_names: its groups' parameter names (`optimizer_param_names` at save time); None for a
            checkpoint written before they were saved: then the groups must have the sizes of `optimizer`'s.
        names: `optimizer_param_names` of `optimizer` now.
    """
    fresh = optimizer.state_dict()
    saved_groups = saved["param_groups"]
    if saved_names is None:
        if [len(g["params"]) for g in saved_groups] != [len(n) for n in names]:
            raise CheckpointError(
                f"the checkpoint's optimizer has parameter groups of sizes "
                f"{[len(g['params']) for g in saved_groups]}, this run's {[len(n) for n in names]} (another "
                f"optim.weight_decay / optim.layer_decay?), and it predates the saving of parameter names: "
                f"resume it with the settings it was written with")
        saved_names = names
    # saved index -> name, and the saved group of each name
    index_name, group_of = {}, {}
    for g, (group, group_names) in enumerate(zip(saved_groups, saved_names)):
        for index, name in zip(group["params"], group_names):
            index_name[index] = name
            group_of[name] = g
    by_name = {index_name[i]: s for i, s in saved["state"].items() if i in index_name}
    state, groups = {}, []
    for group, group_names in zip(fresh["param_groups"], names):
        new_group = dict(group)  # the fresh settings, with the fresh indices in "params"
        olds = [saved_groups[group_of[n]] for n in group_names if n in group_of]
        if olds:  # state kept in the group itself (e.g. timm's Lamb 'step'): from the saved group
            # only the counters: any other saved key is a setting of the old config (layer decay's lr_scale,
            # turned off now, would keep scaling this group's lr), which the fresh group gives or leaves out
            new_group.update({k: v for k, v in olds[0].items() if is_group_counter(k, v)})
        for index, name in zip(group["params"], group_names):
            if name in by_name:
                state[index] = by_name[name]
        groups.append(new_group)
    unused = sorted(set(by_name) - {n for g in names for n in g})
    if unused:
        raise CheckpointError(f"the checkpoint's optimizer holds state of parameters this model lacks "
                              f"({', '.join(unused[:4])}): resume it with the model it was written with")
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def is_group_counter(key: str, value) -> bool:
    """Whether a group entry is a step count the optimizer advances (timm's Lamb / Adan `step`, Lookahead's
    `lookahead_step`), state to carry over, not a setting of the config: named `step` or `*_step`, and a number
    (a plain int or a tensor; a bool such as Adafactor's `relative_step` is a setting)."""
    return ((key == "step" or key.endswith("_step")) and not isinstance(value, bool)
            and isinstance(value, (int, torch.Tensor)))


def check_schedule_holds(step: int, total_steps: int, schedule: str, checkpoint: str) -> None:
    """A checkpoint beyond the end of this run's schedule (a resume with a shorter `sched.epochs` / `sched.steps`)
    is refused: nothing would train, and config.yaml would record a schedule shorter than the updates the weights
    have had. The end itself is allowed: a finished run re-run validates again."""
    if step > total_steps:
        raise CheckpointError(
            f"{checkpoint} is at update {step}, beyond the {total_steps} updates of this run's schedule "
            f"({schedule}): resume with a schedule at least that long, or start a new run from its weights "
            f"(another out_dir, model.pretrained={checkpoint})")


def epoch_position(*, epoch_batches: int, batch_size_per_gpu: int, world_size: int, accum_steps: int,
                   updates_per_epoch: int, train_images: int, seed: int, repeated_aug: int,
                   order_rule: str = ORDER_RULE) -> dict:
    """What a checkpoint records about where in the epoch it stands and what that position depends on (`order_rule`:
    the run's rule of data/samplers.py order_seed, the current one unless `continue_sample_order` kept the older)."""
    return {"samples": epoch_batches * batch_size_per_gpu * world_size, "world_size": world_size,
            "batch_size_per_gpu": batch_size_per_gpu, "accum_steps": accum_steps,
            "updates_per_epoch": updates_per_epoch, "train_images": train_images, "seed": seed,
            "repeated_aug": repeated_aug, "order_rule": order_rule, "tie_order": TIE_ORDER}


# the order of a folder's images that timm's natural-key order ties, which checkpoints record (`epoch_position`):
# their names' (data/folder.py ties_in_name_order); a checkpoint that records none was written under the listing's
TIE_ORDER = "name"


def note_moved_ties(saved: Optional[dict], epoch_batches: int, moved: int, checkpoint: str) -> None:
    """Warn where the checkpoint `checkpoint` (`saved`, its epoch_position; None where it has none) records no
    `tie_order`, stopped inside an epoch (`epoch_batches` of it consumed) and `moved` of the training split's images
    take another place now than that run's directory listing may have given them (data/folder.py
    ImageFolderDataset.moved_ties). The rest of that epoch reads their indices as the other images of their tie,
    which share their class folder: some may be seen twice, others not at all. Later epochs read each image once.
    Not refused: the listing's order was never recorded, so no setting restores it, and the difference stays inside
    one epoch and one class."""
    if (isinstance(saved, dict) and "tie_order" in saved) or not epoch_batches or not moved:
        return
    log.warning("%s was written while images whose names sort as one (1.png and 01.png) kept the directory "
                "listing's order, which it does not record, and it stopped inside an epoch: %d of the training "
                "split's images take other places now (their names' order), so the rest of this epoch may read some "
                "of them twice and their tied names not at all (each within its class); later epochs read each once",
                checkpoint, moved)


def epoch_layout(cfg, *, world_size: int, accum_steps: int, updates_per_epoch: int, train_images: int,
                 language: bool) -> dict:
    """What `epoch_position` records of a run of config `cfg` besides the batches consumed: train.py's run
    (`train_images` its training samples, `language` a language model's task) and scripts/sweep.py's check of a
    checkpoint before its run resumes (the sample count the checkpoint recorded) give it alike. A language model's
    windows have no repeated augmentation: 1."""
    return dict(world_size=world_size, batch_size_per_gpu=cfg.train.batch_size_per_gpu, accum_steps=accum_steps,
                updates_per_epoch=updates_per_epoch, train_images=train_images, seed=cfg.train.seed,
                repeated_aug=1 if language else max(cfg.data.repeated_aug, 1))


def _layout(p: dict) -> str:
    return (f"{p['world_size']} process(es) x {p['batch_size_per_gpu']} per process x {p['accum_steps']} "
            f"accumulation step(s), {p['updates_per_epoch']} updates per epoch of {p['train_images']} training samples")


def resume_position(saved: Optional[dict], now: dict, *, epoch_batches: int, step: int,
                    checkpoint: str) -> int:
    """The micro-batches of the current epoch already consumed, in the layout of this run (`now`, an
    `epoch_position` with epoch_batches=0), for a checkpoint written with `saved` (None: an older
    checkpoint, which recorded micro-batches only); raises CheckpointError where no correct mapping exists.
    """
    if saved is None:
        if epoch_batches:
            log.warning("%s predates the saving of the process count: its position within the epoch (%d "
                        "micro-batches per process) is taken as one of %d process(es) x %d per process, "
                        "as now",
                        checkpoint, epoch_batches, now["world_size"], now["batch_size_per_gpu"])
        return epoch_batches
    if step > 0 and saved["updates_per_epoch"] != now["updates_per_epoch"]:
        raise CheckpointError(
            f"{checkpoint} was written with {_layout(saved)}; this run has {_layout(now)}. Its update count "
            f"would no longer match the lr schedule and the epochs: resume with the checkpoint's "
            f"train.batch_size and data, or start a new run from its weights "
            f"(another out_dir, model.pretrained={checkpoint})")
    samples = saved["samples"]
    if samples == 0:
        return 0
    # train_images counts the training samples: images, or a language model's text windows
    labels = {"seed": "seed", "repeated_aug": "repeated_aug", "train_images": "training samples"}
    order = [k for k in labels if saved[k] != now[k]]
    if order:
        changed = ", ".join(f"{labels[k]} {saved[k]} (now {now[k]})" for k in order)
        raise CheckpointError(
            f"{checkpoint} stopped inside an epoch ({samples} of its samples done) whose sample order "
            f"depends on {changed}: resuming would repeat and skip samples. Resume with the "
            f"checkpoint's train.seed / data.repeated_aug / training data")
    per_batch = now["batch_size_per_gpu"] * now["world_size"]
    if samples % (per_batch * now["accum_steps"]):
        raise CheckpointError(
            f"{checkpoint} stopped {samples} samples into an epoch ({_layout(saved)}), not a whole number of "
            f"updates of this run's {_layout(now)}: resume with {saved['world_size']} process(es) and "
            f"train.batch_size_per_gpu={saved['batch_size_per_gpu']}")
    if (saved["world_size"], saved["batch_size_per_gpu"]) != (now["world_size"], now["batch_size_per_gpu"]):
        log.info("position within epoch: %d samples, written by %d process(es) x %d per process, continued "
                 "by %d x %d", samples, saved["world_size"], saved["batch_size_per_gpu"], now["world_size"],
                 now["batch_size_per_gpu"])
    return samples // per_batch


def _shuffled_by_seed(payload: dict) -> tuple[Optional[int], bool]:
    """(train.seed, whether a DistributedSampler ordered its epochs, not repeated augmentation) of the run that wrote
    the checkpoint `payload`: from its epoch_position, or from its config where it predates that."""
    saved = payload.get("epoch_position")
    if isinstance(saved, dict):
        return saved.get("seed"), saved.get("repeated_aug", 1) <= 1
    config = payload.get("config") or {}
    train, data = config.get("train") or {}, config.get("data") or {}
    return (train.get("seed", 0),
            data.get("dataset") in TOKEN_DATASETS or data.get("repeated_aug", 1) <= 1)


def continue_sample_order(payload: dict, sampler, position: dict, checkpoint: str) -> None:
    """Set the rule of data/samplers.py order_seed that the run resumed from `payload` goes on with, in its train
    `sampler` (a SeededSampler) and in `position` (what its checkpoints record: `epoch_position`'s arguments).

    A checkpoint that records no rule was written under OLD_ORDER_RULE. Where that ordered its run (a
    DistributedSampler under a seed other than 0, whose orders the rules tell apart) and this run keeps its seed, the
    rest of the run, and the checkpoints it writes, stay under it, so that it continues exactly as it began; a note
    in the log says so. Otherwise the run takes the current rule: seed 0's orders are the same under both, and a new
    train.seed orders its epochs as a fresh run of that seed would. A rule this version does not know is refused."""
    saved = payload.get("epoch_position")
    rule = saved.get("order_rule") if isinstance(saved, dict) else None
    seed, shuffled = _shuffled_by_seed(payload)
    # the old rule goes on only where it ordered the run (recorded, by a run resumed once already, or not): a run
    # resumed with another train.seed is ordered as a fresh run of that seed, whatever its checkpoint recorded
    if rule in (None, OLD_ORDER_RULE):
        rule = OLD_ORDER_RULE if shuffled and seed == sampler.seed and seed != 0 else ORDER_RULE
    if rule not in ORDER_RULES:
        raise CheckpointError(f"{checkpoint} orders its epochs by the rule {rule!r}, which this version does not "
                              f"know ({', '.join(map(repr, ORDER_RULES))}): resume it with the version that wrote it")
    sampler.order_rule = position["order_rule"] = rule
    if rule == OLD_ORDER_RULE and sampler.shuffles_by_seed():
        log.info("%s continues a run begun before each train.seed had sample orders of its own: this run keeps "
                 "the order it began with (epoch e of seed %d shuffled as torch's DistributedSampler(seed=%d) does, "
                 "as seed %d does epoch e - 1), to its end, so that it continues exactly; a fresh run of this seed "
                 "orders its epochs otherwise", checkpoint, sampler.seed, sampler.seed, sampler.seed + 1)


def same_val_windows(saved: dict, current) -> bool:
    """Whether the data.val_windows of a checkpoint's config (`saved`, a dict) and of the current Config `current`
    score the same windows of the val text: the same value, or two of one scored count (data/text.py
    scored_val_windows). A run written before more windows than the text has were refused recorded e.g. 64 and
    scored the text's 38; resumed with 0 or 38 it scores those 38 again, which is no change of settings nor of the
    validation set best.pt was chosen on (train.py check_resumable, run_training), while 64 itself is refused now.
    The count needs the model's context (a meta build) and the current val text, so it is read only where the values
    differ on a language model's data with the same val split and data.kjv_val_fraction (else the set is another
    whatever its windows, and that key says so); where the model or text cannot be read now the values compare as
    given (the data's own error comes where the run builds it)."""
    recorded, data = saved.get("data", {}), current.data
    then, now = recorded.get("val_windows", 0), data.val_windows
    if then == now:
        return True
    if (data.dataset not in TOKEN_DATASETS or recorded.get("dataset") != data.dataset
            or recorded.get("val_split", data.val_split) != data.val_split
            or recorded.get("kjv_val_fraction", data.kjv_val_fraction) != data.kjv_val_fraction):
        return False
    try:
        available = window_count(data, model_input_size(current.model), "val")
    except (DataError, ModelError, RuntimeError):
        return False
    return scored_val_windows(then, available) == scored_val_windows(now, available)

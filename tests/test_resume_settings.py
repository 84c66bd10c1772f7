"""Resume applies every setting it accepts (engine/resume.py): the optimizer's groups and the lr schedule of
the NEW config, the position within the epoch in samples of any process count, or a clear refusal."""
import json
import math
import os
import typing

import pytest
import torch

import train
from configs import load_config
from configs.schema import SchedConfig
from data import DataError, build_train_loader
from engine.checkpoint import CheckpointError
from engine.optim import build_optimizer, build_scheduler
from engine.resume import epoch_position, optimizer_param_names, restore_optimizer, resume_position
from models import build_model
from dist_utils import as_torchrun_rank, free_port, leave_and_exit, spawn_ranks
from tests.conftest import DEBUG_CONFIG


def read_metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def cosine_lr(t, *, base, t_initial, warmup_t, warmup_lr=1e-6, min_lr=1e-5):
    """timm's cosine schedule with warmup inside it (warmup_prefix=False, one cycle), written out."""
    if t < warmup_t:
        return warmup_lr + t * (base - warmup_lr) / warmup_t
    if t >= t_initial:
        return min_lr
    return min_lr + 0.5 * (base - min_lr) * (1 + math.cos(math.pi * t / t_initial))


@pytest.mark.parametrize("name", typing.get_args(typing.get_type_hints(SchedConfig)["name"]))
def test_every_offered_schedule_decays_over_the_run_to_min_lr(name):
    # step / multistep are not offered: timm decays them at fixed epochs (90, 180, 270) and ignores min_lr
    cfg = load_config([DEBUG_CONFIG], [f"sched.name={name}", "sched.epochs=10", "sched.warmup_epochs=0",
                                       "sched.min_lr=1e-4", "optim.lr=0.01"])
    optimizer = build_optimizer(build_model(cfg.model), cfg.optim, 0.01, 0.0)
    scheduler = build_scheduler(optimizer, cfg.sched, updates_per_epoch=4)
    lrs = []
    for epoch in range(10):
        scheduler.step(epoch)
        lrs.append(optimizer.param_groups[0]["lr"])
    assert lrs[0] == pytest.approx(0.01) and all(a > b for a, b in zip(lrs, lrs[1:]))  # decays every epoch
    scheduler.step(10)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-4)  # and ends at min_lr


def test_a_resume_with_a_new_lr_weight_decay_and_length_trains_with_them(debug_config):
    # debug config: 4 updates per epoch, 1 warmup epoch; per-update schedule; stop inside epoch 0
    train.main(debug_config("sched.per_step=true", "train.max_steps=3", name="r"))
    new = ("sched.per_step=true", "optim.lr=0.01", "optim.weight_decay=0.02", "sched.epochs=4",
           "optim.betas=[0.8,0.9]", "train.allow_changed_config=true")
    cfg = debug_config(*new, "train.max_steps=6", name="r")
    train.main(cfg)
    ckpt = torch.load(os.path.join(cfg.out_dir, "checkpoint.pt"), weights_only=True)
    assert ckpt["state"]["step"] == 6
    groups = ckpt["optimizer"]["param_groups"]
    expected = cosine_lr(6, base=0.01, t_initial=4 * 4, warmup_t=4)  # the new schedule at update 6
    assert sorted(g["weight_decay"] for g in groups) == [0.0, 0.02]  # no decay on 1-D params, as always
    for g in groups:
        assert g["initial_lr"] == 0.01 and tuple(g["betas"]) == (0.8, 0.9)
        assert g["lr"] == pytest.approx(expected, rel=1e-12)
    # the lr logged at update 4 (the first log step after the resume) is the new schedule's at that update (t=3)
    lr4 = [r["train/lr"] for r in read_metrics(cfg.out_dir) if r["step"] == 4 and "train/lr" in r]
    assert lr4 == [pytest.approx(cosine_lr(3, base=0.01, t_initial=16, warmup_t=4), rel=1e-12)]
    # and equals a fresh optimizer + scheduler of the new config stepped to that update
    fresh = build_optimizer(build_model(cfg.model), cfg.optim, 0.01, 0.02)
    build_scheduler(fresh, cfg.sched, updates_per_epoch=4).step_update(6)
    assert [g["lr"] for g in fresh.param_groups] == [g["lr"] for g in groups]


def test_a_finished_run_extended_by_epochs_follows_the_longer_schedule(debug_config):
    # a per-epoch cosine: the old scheduler (2 epochs) was at its end; the new one (3 epochs) is not
    train.main(debug_config("optim.lr=0.01", name="e"))
    cfg = debug_config("optim.lr=0.01", "sched.epochs=3", "train.allow_changed_config=true", name="e")
    assert train.main(cfg).state.step == 12
    logged = {r["step"]: r["train/lr"] for r in read_metrics(cfg.out_dir) if "train/lr" in r}
    epoch2 = cosine_lr(2, base=0.01, t_initial=3, warmup_t=1)  # 0.0025 + 1e-5 / ..., not min_lr
    assert logged[10] == logged[12] == pytest.approx(epoch2, rel=1e-12)
    assert logged[6] == pytest.approx(cosine_lr(1, base=0.01, t_initial=2, warmup_t=1), rel=1e-12)  # before


def test_a_resume_beyond_the_end_of_a_shorter_schedule_is_refused(debug_config):
    """A checkpoint at update 8 (2 epochs of 4) resumed with sched.epochs=1 (4 updates) used to 'finish' at
    epoch 2/1 without training and record the 1-epoch schedule in config.yaml as what ran."""
    first = debug_config(name="s")
    train.main(first)
    saved = open(os.path.join(first.out_dir, "config.yaml")).read()
    with pytest.raises(CheckpointError, match=r"update 8, beyond the 4 updates .*sched.epochs=1"):
        train.main(debug_config("sched.epochs=1", "sched.warmup_epochs=0", "train.allow_changed_config=true",
                                name="s"))
    assert open(os.path.join(first.out_dir, "config.yaml")).read() == saved
    # the end of the schedule itself is no refusal: a finished run re-run (and one extended) goes on as before
    assert train.main(debug_config(name="s")).state.step == 8


def adam_step(model, optimizer):
    loss = sum((p.float() ** 2).sum() for p in model.parameters())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("before, after", [
    (dict(weight_decay=0.05), dict(weight_decay=0.0)),  # 2 groups -> 1
    (dict(weight_decay=0.05), dict(weight_decay=0.05, layer_decay=0.75)),  # 2 groups -> one per layer
])
def test_optimizer_state_follows_each_parameter_into_new_groups(before, after):
    cfg = load_config([DEBUG_CONFIG])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    old_cfg = load_config([DEBUG_CONFIG], [f"optim.layer_decay={before.get('layer_decay') or 'null'}"])
    old = build_optimizer(model, old_cfg.optim, 1e-3, before["weight_decay"])
    adam_step(model, old)
    adam_step(model, old)
    saved, saved_names = old.state_dict(), optimizer_param_names(model, old)
    new_cfg = load_config([DEBUG_CONFIG], [f"optim.layer_decay={after.get('layer_decay') or 'null'}"])
    new = build_optimizer(model, new_cfg.optim, 5e-3, after["weight_decay"])
    assert len(new.param_groups) != len(old.param_groups)  # torch's own load_state_dict would refuse
    settings = [{k: v for k, v in g.items() if k != "params"} for g in new.param_groups]
    restore_optimizer(new, saved, saved_names, optimizer_param_names(model, new))
    assert [{k: v for k, v in g.items() if k != "params"} for g in new.param_groups] == settings
    for p in model.parameters():  # every parameter keeps its own moments and step count
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(new.state[p][key], old.state[p][key]), key


def test_a_group_level_step_counter_is_carried_over():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    names = optimizer_param_names(model, torch.optim.SGD(model.parameters(), lr=1))
    old = torch.optim.SGD(model.parameters(), lr=1.0)
    saved = old.state_dict()
    saved["param_groups"][0]["step"] = 7  # what timm's Lamb keeps in the group
    new = torch.optim.SGD(model.parameters(), lr=0.5)
    restore_optimizer(new, saved, names, names)
    assert new.param_groups[0]["step"] == 7 and new.param_groups[0]["lr"] == 0.5


def test_a_group_counter_that_a_fresh_optimizer_also_holds_is_the_saved_one():
    """timm's Lookahead puts lookahead_step=0 into every group of a fresh optimizer and pulls the weights back at
    every lookahead_k-th update it counts: the saved count wins over that 0 (a restarted count pulls back at other
    updates), while its settings (lookahead_k, lookahead_alpha, lr) and a bool such as Adafactor's relative_step
    stay those of the fresh optimizer."""
    from timm.optim.lookahead import Lookahead

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    names = optimizer_param_names(model, torch.optim.SGD(model.parameters(), lr=1))
    saved = Lookahead(torch.optim.SGD(model.parameters(), lr=1.0), k=5).state_dict()
    saved["param_groups"][0].update(lookahead_step=7, relative_step=False)
    new = Lookahead(torch.optim.SGD(model.parameters(), lr=0.5), k=6)
    new.param_groups[0]["relative_step"] = True
    assert new.param_groups[0]["lookahead_step"] == 0
    restore_optimizer(new, saved, names, names)
    group = new.param_groups[0]
    assert (group["lookahead_step"], group["lookahead_k"], group["lr"], group["relative_step"]) == (7, 6, 0.5, True)


def test_a_resume_on_a_data_set_of_other_classes_is_refused(debug_config, tmp_path):
    from tests.test_data import make_image_folder
    make_image_folder(tmp_path / "a", classes=("cat", "dog"), per_class=4)
    make_image_folder(tmp_path / "b", classes=("car", "ship"), per_class=4)
    folder = ("data.dataset=folder", "model.num_classes=2", "train.batch_size=4", "train.batch_size_per_gpu=4",
              "optim.lr=1e-4")  # lr_base would scale to 3.9e-6 at batch 4, below sched.min_lr
    train.main(debug_config(*folder, f"data.root={tmp_path / 'a'}", "train.max_steps=1", name="c"))
    ckpt = os.path.join(tmp_path, "c", "checkpoint.pt")
    before = os.path.getmtime(ckpt)
    with pytest.raises(CheckpointError, match=r"other classes than data.root=.*\(then vs now: 2 vs 2 classes; "
                                              r"0: cat vs car, 1: dog vs ship\)"):
        train.main(debug_config(*folder, f"data.root={tmp_path / 'b'}", name="c"))
    assert os.path.getmtime(ckpt) == before
    train.main(debug_config(*folder, f"data.root={tmp_path / 'a'}", "train.max_steps=2", name="c"))  # its own data
    import evaluate  # scoring it on the other data set is refused the same way
    with pytest.raises(DataError, match=r"the val split's classes differ .*\(2 vs 2 classes; 0: cat vs car, 1: dog "
                                        r"vs ship\)"):
        evaluate.main(evaluate.parse_args(["--checkpoint", str(tmp_path / "c" / "best.pt"), "--quant",
                                           f"data.root={tmp_path / 'b'}", "--out", str(tmp_path / "e.json")]))


def test_a_resume_on_other_images_of_the_same_classes_is_refused_and_a_moved_copy_goes_on(debug_config, tmp_path):
    """A split folder of the same name and classes but other images (a re-exported subset, another val set) was
    taken as the data the run was trained on: best.pt was then chosen across validations of two sets."""
    import shutil

    from tests.test_data import make_image_folder
    make_image_folder(tmp_path / "a", classes=("cat", "dog"), per_class=4)
    folder = ("data.dataset=folder", "model.num_classes=2", "train.batch_size=4", "train.batch_size_per_gpu=4",
              "optim.lr=1e-4")  # lr_base would scale to 3.9e-6 at batch 4, below sched.min_lr
    train.main(debug_config(*folder, f"data.root={tmp_path / 'a'}", "train.max_steps=1", name="c"))
    ckpt = os.path.join(tmp_path, "c", "checkpoint.pt")
    saved = torch.load(ckpt, weights_only=True)["data_fingerprint"]
    # an independent reference: the names under each split, in timm's (sorted) order
    import hashlib
    names = "\n".join(f"{c}/{i}.png" for c in ("cat", "dog") for i in range(4))
    assert saved == {split: {"images": 8, "names_sha256": hashlib.sha256(names.encode()).hexdigest()}
                     for split in ("train", "val")}
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    os.remove(tmp_path / "b" / "val" / "dog" / "3.png")  # one val image fewer
    before = os.path.getmtime(ckpt)
    with pytest.raises(CheckpointError, match=r"was trained on other images than data.root=.*/b holds in val "
                                              r"\(\{'val': \{'images': 8, .*\}\} then, \{'val': \{'images': 7, "):
        train.main(debug_config(*folder, f"data.root={tmp_path / 'b'}", name="c"))
    os.rename(tmp_path / "b" / "train" / "cat" / "0.png", tmp_path / "b" / "train" / "cat" / "9.png")
    with pytest.raises(CheckpointError, match=r"in train, val \("):  # a renamed image: as many, other names
        train.main(debug_config(*folder, f"data.root={tmp_path / 'b'}", name="c"))
    assert os.path.getmtime(ckpt) == before
    os.rename(tmp_path / "a", tmp_path / "moved")  # the same images elsewhere: the run goes on
    run = train.main(debug_config(*folder, f"data.root={tmp_path / 'moved'}/", "train.max_steps=2", name="c"))
    assert run.state.step == 2


def test_a_result_file_of_other_val_images_under_the_same_root_is_refused_and_an_older_one_takes_their_names(
        debug_config, tmp_path):
    """evaluate.py named a folder data set by its root, split and image count: a val folder exported again at the
    same path with as many other images had its results added to those of the old images."""
    import hashlib
    import evaluate
    from engine.eval_results import ResultsError, evaluation_difference, read_result_files
    from tests.test_data import make_image_folder
    make_image_folder(tmp_path / "a", classes=("cat", "dog"), per_class=4)
    folder = ("data.dataset=folder", "model.num_classes=2", "train.batch_size=4", "train.batch_size_per_gpu=4",
              "optim.lr=1e-4")  # lr_base would scale to 3.9e-6 at batch 4, below sched.min_lr
    train.main(debug_config(*folder, f"data.root={tmp_path / 'a'}", "train.max_steps=1", name="c"))
    out = tmp_path / "e.json"
    score = lambda: evaluate.main(evaluate.parse_args(
        ["--checkpoint", str(tmp_path / "c" / "best.pt"), "--quant", "quant.act_max_csv=false",
         f"data.root={tmp_path / 'a'}", "--out", str(out)]))
    score()
    names = "\n".join(f"{c}/{i}.png" for c in ("cat", "dog") for i in range(4))  # relative to val/, sorted
    first = json.loads(out.read_text())
    assert first["val_names"] == hashlib.sha256(names.encode()).hexdigest() and first["images"] == 8
    os.rename(tmp_path / "a" / "val" / "dog" / "3.png", tmp_path / "a" / "val" / "dog" / "7.png")  # as many images
    before = out.read_bytes()
    with pytest.raises(ResultsError, match=r"holds results of another evaluation \(val_names: '[0-9a-f]{64}' in the "
                                           r"file, '[0-9a-f]{64}' now\); the val split holds other images now than "
                                           r"those its results are of: move the file away to score them into a new "
                                           r"one, or give --out another file$"):
        score()
    assert out.read_bytes() == before
    # a file written before the names were recorded is taken as of the images there now, and records them
    out.write_text(json.dumps({k: v for k, v in first.items() if k != "val_names"}))
    score()
    renamed = "\n".join(sorted(f"{c}/{i}.png" for c in ("cat", "dog") for i in (0, 1, 2, 3 if c == "cat" else 7)))
    assert json.loads(out.read_text())["val_names"] == hashlib.sha256(renamed.encode()).hexdigest()
    # seeds averaged into one row: other names under one root differ; a result without them is not compared
    second = json.loads(out.read_text())
    assert evaluation_difference(first, second).what == "val_names"
    assert evaluation_difference({k: v for k, v in first.items() if k != "val_names"}, second) is None
    # the same weights scored on the old and the new images are two evaluations, not a copied file
    (tmp_path / "old.json").write_text(json.dumps(first))
    assert len(read_result_files([str(tmp_path / "old.json"), str(out)])) == 2
    (tmp_path / "copy.json").write_text(json.dumps(second))
    with pytest.raises(ResultsError, match="hold results of the same weights evaluated alike"):
        read_result_files([str(tmp_path / "copy.json"), str(out)])


def test_optimizer_state_of_parameters_the_model_lacks_is_refused_naming_them():
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    old = torch.optim.AdamW([*a.parameters(), *b.parameters()], lr=0.1)
    adam_step(torch.nn.ModuleDict({"a": a, "b": b}), old)
    new = torch.optim.AdamW(a.parameters(), lr=0.1)
    with pytest.raises(CheckpointError, match=r"holds state of parameters this model lacks \(b.bias, b.weight\): "
                                              r"resume it with the model it was written with"):
        restore_optimizer(new, old.state_dict(), [["a.weight", "a.bias", "b.weight", "b.bias"]],
                          [["a.weight", "a.bias"]])


def test_a_checkpoint_without_parameter_names_restores_by_position_or_refuses_other_group_sizes():
    """Checkpoints written before the names were saved: the same groups take the state in order; other group
    sizes (another weight decay) cannot be matched and are refused."""
    model = torch.nn.Linear(2, 2)
    old = torch.optim.AdamW([{"params": [model.weight]}, {"params": [model.bias], "weight_decay": 0.0}], lr=0.1)
    adam_step(model, old)
    names = [["weight"], ["bias"]]
    same = torch.optim.AdamW([{"params": [model.weight]}, {"params": [model.bias], "weight_decay": 0.0}], lr=0.2)
    restore_optimizer(same, old.state_dict(), None, names)
    for p in model.parameters():
        assert torch.equal(same.state[p]["exp_avg_sq"], old.state[p]["exp_avg_sq"])
    one_group = torch.optim.AdamW(model.parameters(), lr=0.1)
    with pytest.raises(CheckpointError, match=r"groups of sizes \[1, 1\], this run's \[2\] .*predates the saving "
                                              r"of parameter names"):
        restore_optimizer(one_group, old.state_dict(), None, [["weight", "bias"]])


def test_a_position_of_an_older_checkpoint_is_its_micro_batches_as_they_are():
    assert resume_position(None, position(2, 8, 1), epoch_batches=5, step=3, checkpoint="c.pt") == 5


def test_another_optimizer_at_resume_is_refused(debug_config):
    train.main(debug_config("train.max_steps=1", name="o"))
    with pytest.raises(CheckpointError, match=r"optim.name=adamw, which optim.name=sgd cannot use.*"
                                              r"model.pretrained="):
        train.main(debug_config("optim.name=sgd", "train.allow_changed_config=true", name="o"))



def test_a_resume_with_other_model_settings_names_the_settings_that_differ(debug_config):
    """The refusal printed both model sections whole (nine keys each) and left the reader to find the one that
    differs."""
    train.main(debug_config("train.max_steps=1", name="m"))
    with pytest.raises(CheckpointError, match=r"was written for model vit_nano with other settings "
                                              r"\(model.img_size: None -> 16; model.attn: 'softmax' -> 'softmax1'\): "
                                              r"use another out_dir, or use the original model settings$"):
        train.main(debug_config("model.drop_path=0.2", "model.attn=softmax1", "model.img_size=16", name="m"))


def test_a_resume_with_other_drop_rates_is_a_changed_setting_not_another_model(debug_config):
    """Stochastic depth and dropout add no parameter: a run continues with new rates as with any other changed
    setting (train.allow_changed_config=true), which a model of other parameters can never do."""
    train.main(debug_config("train.max_steps=1", name="d"))
    with pytest.raises(CheckpointError, match=r"was written with other settings \(model.drop: 0.0 -> 0.1; "
                                              r"model.drop_path: 0.1 -> 0.2\): .*train.allow_changed_config=true"):
        train.main(debug_config("train.max_steps=2", "model.drop_path=0.2", "model.drop=0.1", name="d"))
    result = train.main(debug_config("train.max_steps=2", "model.drop_path=0.2", "model.drop=0.1",
                                     "train.allow_changed_config=true", name="d"))
    assert result.state.step == 2 and result.reason == "max_steps"


# -- the position within the epoch -------------------------------------------------------------------------

def position(world, per_gpu, accum, upe=4, images=64, seed=0, repeated_aug=0, batches=0):
    return epoch_position(epoch_batches=batches, batch_size_per_gpu=per_gpu, world_size=world,
                          accum_steps=accum, updates_per_epoch=upe, train_images=images, seed=seed,
                          repeated_aug=repeated_aug)


def stream(cfg, world, rank, per_gpu, start=0, epoch=1):
    loader = build_train_loader(cfg.data, img_size=32, batch_size_per_gpu=per_gpu, rank=rank,
                                world_size=world, seed=0, num_classes=4)
    loader.sampler.set_epoch(epoch, start=start)
    return [index for index, _ in loader.sampler]


@pytest.mark.parametrize("repeated_aug", [0, 2], ids=["distributed", "repeated_aug"])
def test_a_position_written_by_two_processes_continues_in_one_without_repeats(repeated_aug):
    cfg = load_config([DEBUG_CONFIG], [f"data.repeated_aug={repeated_aug}"])
    # 2 processes x 8 per process, stopped after 3 updates (3 batches each); 1 process x 8 x 2 accumulation
    done = [i for rank in (0, 1) for i in stream(cfg, 2, rank, 8)[:3 * 8]]
    saved = position(2, 8, 1, repeated_aug=repeated_aug, batches=3)
    batches = resume_position(saved, position(1, 8, 2, repeated_aug=repeated_aug), epoch_batches=3, step=3,
                              checkpoint="c.pt")
    assert batches == 6  # 48 samples = 6 batches of 8 in one process (3 updates of 2)
    rest = stream(cfg, 1, 0, 8, start=batches * 8)
    assert sorted(done + rest) == sorted(stream(cfg, 1, 0, 8))  # the epoch's images, each as often as once
    # and back: 1 process stopped after 2 updates (4 batches of 8) -> 2 processes, 2 batches each done
    batches = resume_position(position(1, 8, 2, repeated_aug=repeated_aug, batches=4),
                              position(2, 8, 1, repeated_aug=repeated_aug), epoch_batches=4, step=2,
                              checkpoint="c.pt")
    done = stream(cfg, 1, 0, 8)[:32]
    rest = [i for rank in (0, 1) for i in stream(cfg, 2, rank, 8, start=batches * 8)]
    assert batches == 2 and sorted(done + rest) == sorted(stream(cfg, 1, 0, 8))


@pytest.mark.parametrize("now, message", [
    (position(4, 8, 1, upe=2), r"4 updates per epoch .* 2 updates per epoch.*schedule"),
    (position(1, 16, 2, upe=4), r"not a whole number of updates.*resume with 2 process\(es\) and "
                                r"train.batch_size_per_gpu=8"),
    (position(1, 8, 2, seed=1), r"sample order depends on seed 0 \(now 1\)"),
    (position(1, 8, 2, images=80), r"training samples 64 \(now 80\).*training data"),
    (position(1, 8, 2, repeated_aug=3), r"repeated_aug 0 \(now 3\)"),
])
def test_a_position_that_cannot_be_mapped_is_refused(now, message):
    saved = position(2, 8, 1, batches=3)  # 48 samples into the epoch
    with pytest.raises(CheckpointError, match=message):
        resume_position(saved, now, epoch_batches=3, step=3, checkpoint="c.pt")


def test_at_an_epoch_boundary_any_layout_with_the_same_updates_continues():
    assert resume_position(position(2, 8, 1), position(1, 4, 4, seed=5), epoch_batches=0, step=4,
                           checkpoint="c.pt") == 0


def _two_process_worker(rank, world, port, overrides):
    as_torchrun_rank(rank, world, port)
    train.main(load_config([DEBUG_CONFIG], overrides))
    leave_and_exit()


# deterministic updates, so that 1 process x 2 accumulation steps = 2 processes (tests/test_train.py)
DETERMINISTIC = ("data.mixup=0", "data.cutmix=0", "model.drop_path=0", "data.label_smoothing=0",
                 "optim.name=sgd", "optim.lr=0.05")


@pytest.mark.slow
@pytest.mark.parametrize("per_gpu", [8, 4])
def test_a_two_process_run_preempted_mid_epoch_resumes_in_one_process(tmp_path, one_thread, per_gpu):
    """2 processes x 8 per process, stopped mid-epoch, then 1 process with the same per-process batch (2
    accumulation steps) or with 4 (4 steps, as a move to more processes may need: train.batch_size_per_gpu is the
    layout of the global batch, not a changed setting); either way the weights of an uninterrupted run."""
    split = str(tmp_path / "split")
    spawn_ranks(_two_process_worker, (2, free_port(), [*DETERMINISTIC, f"out_dir={split}", "train.max_steps=3"]), 2)
    ckpt = torch.load(os.path.join(split, "checkpoint.pt"), weights_only=True)
    assert ckpt["state"]["epoch_batches"] == 3 and ckpt["epoch_position"]["world_size"] == 2
    resumed = train.main(load_config([DEBUG_CONFIG], [*DETERMINISTIC, f"out_dir={split}",
                                                      f"train.batch_size_per_gpu={per_gpu}"]))
    straight = train.main(load_config([DEBUG_CONFIG], [*DETERMINISTIC, f"out_dir={tmp_path / 'one'}"]))
    assert resumed.state.step == straight.state.step == 8
    # epoch 0 ended at update 4 (validated there), not one update late with 16 images seen twice (3: the
    # validation of the stop at train.max_steps)
    assert [r["step"] for r in read_metrics(split) if "val/top1" in r] == [3, 4, 8]
    for key, value in straight.model.state_dict().items():
        assert torch.allclose(resumed.model.state_dict()[key], value, atol=1e-6, rtol=1e-5), key


def test_a_resume_with_another_per_process_batch_of_the_same_global_batch_continues_the_same_run(debug_config):
    """A run stopped mid-epoch at 8 per process x 2 accumulation steps continues at 4 x 4 (the same global batch
    of 16: what a run moved from 2 processes to 4 needs, the batch-split error's own advice) without
    train.allow_changed_config, which it refused as a changed setting; its weights are an uninterrupted run's."""
    overrides = (*DETERMINISTIC, "cd.enabled=false")
    train.main(debug_config(*overrides, "train.max_steps=3", name="moved"))
    resumed = train.main(debug_config(*overrides, "train.batch_size_per_gpu=4", name="moved"))
    straight = train.main(debug_config(*overrides, name="straight"))
    assert resumed.state.step == straight.state.step == 8
    for key, value in straight.model.state_dict().items():
        assert torch.allclose(resumed.model.state_dict()[key], value, atol=1e-6, rtol=1e-5), key
    # another global batch is still a changed setting (another lr, another number of updates)
    with pytest.raises(CheckpointError, match=r"other settings \(train.batch_size: 16 -> 32\)"):
        train.main(debug_config(*overrides, "train.batch_size=32", name="moved"))


def test_warmup_prefix_puts_the_whole_cosine_after_the_warmup_and_steps_round_epochs_up():
    """sched.warmup_prefix (Swin): warmup_epochs of warmup from sched.warmup_lr, then a cosine over the remaining
    epochs that ends at min_lr at sched.epochs (the run's length, warmup included); sched.steps: the epochs that
    hold them, the last one partial."""
    from engine.optim import schedule_length

    cfg = load_config([DEBUG_CONFIG], ["sched.name=cosine", "sched.epochs=10", "sched.warmup_epochs=2",
                                       "sched.warmup_prefix=true", "sched.per_step=false", "sched.min_lr=1e-4",
                                       "sched.warmup_lr=1e-3", "optim.lr=0.01"])
    optimizer = build_optimizer(build_model(cfg.model), cfg.optim, 0.01, 0.0)
    scheduler = build_scheduler(optimizer, cfg.sched, updates_per_epoch=4)
    # the warmup: linear from sched.warmup_lr at epoch 0 to the peak at warmup_epochs (halfway at epoch 1)
    for epoch, want in [(0, 1e-3), (1, 1e-3 + 0.5 * (0.01 - 1e-3)), (2, 0.01),
                        (6, 1e-4 + 0.5 * (0.01 - 1e-4) * (1 + math.cos(math.pi * 4 / 8))), (10, 1e-4)]:
        scheduler.step(epoch)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(want, rel=1e-9), epoch
    assert schedule_length(SchedConfig(steps=10), 4) == (3, 10, True)
    assert schedule_length(SchedConfig(epochs=3, per_step=False), 4) == (3, 12, False)


def test_sgd_takes_the_configured_momentum():
    cfg = load_config([DEBUG_CONFIG], ["optim.name=sgd", "optim.momentum=0.5", "optim.lr=0.01"])
    optimizer = build_optimizer(build_model(cfg.model), cfg.optim, 0.01, 0.0)
    assert {g["momentum"] for g in optimizer.param_groups} == {0.5}


def test_fused_kernels_are_the_default_on_cuda_only_and_optim_fused_decides_when_set():
    from configs.schema import OptimConfig
    from engine.optim import use_fused

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not use_fused(OptimConfig(name="adamw"), cpu) and use_fused(OptimConfig(name="adamw"), cuda)
    assert not use_fused(OptimConfig(name="lamb"), cuda)
    assert use_fused(OptimConfig(name="adamw", fused=True), cpu) and not use_fused(OptimConfig(fused=False), cuda)
    # optim.fused=true for an optimizer torch has no fused kernel of: refused by name, not silently unfused
    with pytest.raises(ValueError, match=r"optim.fused=true: torch has no fused 'lamb'; use one of adamw, "):
        build_optimizer(torch.nn.Linear(2, 2), OptimConfig(name="lamb", fused=True), 1e-3, 0.0)


@pytest.mark.parametrize("layer_decay", [None, 0.75])
def test_weight_decay_skips_biases_norms_and_the_models_no_weight_decay_names(layer_decay):
    """DeiT/timm's rule, written out: a parameter decays unless it is 1-D (biases, norm scales) or named by the
    model's no_weight_decay() (pos_embed, cls_token), with or without layer-wise lr decay."""
    cfg = load_config([DEBUG_CONFIG], [f"optim.layer_decay={'null' if layer_decay is None else layer_decay}"])
    model = build_model(cfg.model)
    optimizer = build_optimizer(model, cfg.optim, 1e-3, 0.05)
    decay_of = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    skip = model.no_weight_decay()
    assert {"pos_embed", "cls_token"} <= skip
    for name, p in model.named_parameters():
        assert decay_of[id(p)] == (0.0 if p.ndim <= 1 or name in skip else 0.05), name



def test_layer_decay_scales_each_layers_lr_by_its_depth_below_the_head():
    """optim.layer_decay d, written out for the two-block debug ViT: the head keeps the lr, blocks.i gets
    d^(depth - i), the stem (patch_embed, cls_token, pos_embed) d^(depth + 1); every parameter's lr_scale is the one
    timm's own param_groups_layer_decay gives it (the final norm shares the last block's), and the scheduler
    multiplies it into each group's lr."""
    from timm.optim import param_groups_layer_decay

    d = 0.5
    cfg = load_config([DEBUG_CONFIG], [f"optim.layer_decay={d}", "sched.warmup_epochs=0"])
    model = build_model(cfg.model)
    optimizer = build_optimizer(model, cfg.optim, 1e-3, 0.05)
    scale_of = {id(p): g["lr_scale"] for g in optimizer.param_groups for p in g["params"]}
    depth = len(model.blocks)
    assert depth == 2
    for name, p in model.named_parameters():
        head, block = name.split(".")[0], name.split(".")[1] if name.startswith("blocks.") else None
        want = {"head": 1.0, "patch_embed": d ** (depth + 1), "cls_token": d ** (depth + 1),
                "pos_embed": d ** (depth + 1), "blocks": d ** (depth - int(block or 0))}.get(head)
        if want is not None:
            assert scale_of[id(p)] == pytest.approx(want, rel=1e-12), name
    params = dict(model.named_parameters())
    timm_groups = param_groups_layer_decay(model, weight_decay=0.05, layer_decay=d,
                                           no_weight_decay_list=model.no_weight_decay())
    timm_scale = {name: g["lr_scale"] for g in timm_groups for name, p in params.items()
                  if any(p is q for q in g["params"])}
    assert {name: scale_of[id(p)] for name, p in params.items()} == pytest.approx(timm_scale, rel=1e-12)
    scheduler = build_scheduler(optimizer, cfg.sched, updates_per_epoch=4)
    scheduler.step_update(3)
    assert len({g["lr"] / g["lr_scale"] for g in optimizer.param_groups}) == 1


@pytest.mark.parametrize("name", ["adamw", "adam", "lamb"])
def test_adam_optimizers_take_the_configured_betas_and_eps(name):
    """optim.betas and optim.eps reach every group of the optimizers that read them (configs.schema
    ADAM_OPTIMIZERS), not timm's defaults (0.9, 0.999) and 1e-8."""
    cfg = load_config([DEBUG_CONFIG], [f"optim.name={name}", "optim.betas=[0.8,0.95]", "optim.eps=1e-6"])
    optimizer = build_optimizer(build_model(cfg.model), cfg.optim, 0.01, 0.05)
    assert {(tuple(g["betas"]), g["eps"]) for g in optimizer.param_groups} == {((0.8, 0.95), 1e-6)}

def test_a_schedule_in_updates_warms_up_then_decays_over_the_remaining_updates():
    """sched.steps (nanoGPT): a linear warmup to the peak lr at update warmup_steps, then the cosine over the
    steps - warmup_steps updates left, reaching min_lr at update `steps`; a warmup as long as the run is
    refused."""
    cfg = load_config([DEBUG_CONFIG], ["sched.name=cosine", "sched.steps=10", "sched.warmup_steps=2",
                                       "sched.min_lr=1e-4", "sched.warmup_lr=0", "optim.lr=0.01"])
    optimizer = build_optimizer(build_model(cfg.model), cfg.optim, 0.01, 0.0)
    scheduler = build_scheduler(optimizer, cfg.sched, updates_per_epoch=4)
    for update, want in [(1, 0.005), (2, 0.01), (6, 1e-4 + 0.5 * (0.01 - 1e-4) * (1 + math.cos(math.pi * 4 / 8))),
                         (10, 1e-4)]:
        scheduler.step_update(update)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(want, rel=1e-9), update
    with pytest.raises(ValueError, match="sched.warmup_steps=4 is not below sched.steps=4"):
        build_scheduler(optimizer, SchedConfig(steps=4, warmup_steps=4), updates_per_epoch=4)


def test_a_checkpoint_before_the_first_update_continues_in_another_layout():
    """Nothing trained yet (step 0): no update count is bound to the schedule, so another batch layout with
    another number of updates per epoch starts the epoch from its beginning instead of being refused."""
    assert resume_position(position(2, 8, 1, upe=4), position(1, 4, 1, upe=16), epoch_batches=0, step=0,
                           checkpoint="c.pt") == 0


def test_after_a_single_update_another_number_of_updates_per_epoch_is_refused():
    """The refusal starts at update 1: the checkpoint's one update (16 samples) is a whole update of the new
    layout too (2 processes x 8), but with 2 updates per epoch instead of 4, update 2 of the run would be the
    first of epoch 1, not the second of epoch 0, and the lr schedule would no longer match."""
    saved, now = position(1, 16, 1, upe=4, batches=1), position(2, 8, 1, upe=2)
    with pytest.raises(CheckpointError, match=r"4 updates per epoch .* 2 updates per epoch.*schedule"):
        resume_position(saved, now, epoch_batches=1, step=1, checkpoint="c.pt")


# -- settings that say when a run validates, and a new train.seed ----------------------------------------------

def model_and_optimizer(out_dir):
    ckpt = torch.load(os.path.join(out_dir, "checkpoint.pt"), weights_only=True)
    flat = {f"model.{k}": v for k, v in ckpt["model"].items()}
    for pid, pstate in ckpt["optimizer"]["state"].items():
        flat.update({f"opt.{pid}.{k}": torch.as_tensor(v) for k, v in pstate.items()})
    return flat


def test_a_resume_with_a_new_eval_every_steps_validates_at_its_multiples_and_trains_the_same_weights(
        debug_config):
    """train.eval_every_steps says when a run validates, not what an update computes: a resume may change it
    without train.allow_changed_config (it was refused as a changed recipe). Validations come at the multiples
    of the new value, counted from the run's start as train.eval_every_epochs counts epochs: 2 -> 5 at update 3
    validates at 5 and 10 (not 8), then at the end (12). The weights and optimizer state are those of a run
    that validated every 5 updates throughout (best.pt, chosen among the validations made, may differ)."""
    # 3 epochs of 4 updates; epoch ends validate only at the last (12)
    common = ("sched.epochs=3", "train.eval_every_epochs=3")
    train.main(debug_config(*common, "train.eval_every_steps=2", "train.max_steps=3", name="split"))
    split = debug_config(*common, "train.eval_every_steps=5", name="split")
    assert train.main(split).state.step == 12
    straight = debug_config(*common, "train.eval_every_steps=5", name="straight")
    train.main(straight)
    validated = [[r["step"] for r in read_metrics(cfg.out_dir) if "val/top1" in r] for cfg in (split, straight)]
    assert validated == [[2, 3, 5, 10, 12], [5, 10, 12]]  # 2 and 3: before the resume (3: train.max_steps)
    a, b = model_and_optimizer(split.out_dir), model_and_optimizer(straight.out_dir)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_new_train_seed_mid_epoch_is_refused_through_train_py(debug_config):
    """The data order within an epoch follows train.seed: a run stopped inside an epoch cannot go on under
    another seed (its next images would repeat some and skip others), even with train.allow_changed_config."""
    first = debug_config("train.max_steps=3", name="m")  # 3 of epoch 0's 4 updates
    train.main(first)
    ckpt = os.path.join(first.out_dir, "checkpoint.pt")
    before = open(ckpt, "rb").read()
    with pytest.raises(CheckpointError, match=r"stopped inside an epoch \(48 of its samples done\) whose sample "
                                              r"order depends on seed 0 \(now 1\).*train.seed"):
        train.main(debug_config("train.seed=1", "train.allow_changed_config=true", name="m"))
    assert open(ckpt, "rb").read() == before


def test_a_new_train_seed_at_an_epoch_boundary_orders_the_next_epoch_as_a_fresh_run_of_that_seed(
        debug_config, monkeypatch):
    """docs/operations.md: with train.allow_changed_config=true a resumed run computes what a fresh run of the
    NEW config would at that update. For train.seed, from the epoch after the checkpoint: the sample order of a
    run of the new seed that was never interrupted, each sample's augmentation seed mix_seed(seed, epoch, 0,
    global position) of the new seed (data/samplers.py), and the main process reseeded from (new seed, rank,
    update)."""
    import engine.loop
    from data.samplers import SeededSampler
    from engine.rng import mix_seed

    samples, reseeds = [], []
    sampler_iter = SeededSampler.__iter__

    def recording_iter(self):
        for index, seed in sampler_iter(self):
            samples.append((self.epoch, index, seed))
            yield index, seed

    def recording_mix_seed(*parts):
        reseeds.append(parts)
        return mix_seed(*parts)

    monkeypatch.setattr(SeededSampler, "__iter__", recording_iter)
    monkeypatch.setattr(engine.loop, "mix_seed", recording_mix_seed)

    def epoch_1():  # what the run drew in epoch 1 (updates 4 to 7), then forget
        drawn = ([s for s in samples if s[0] == 1], [p for p in reseeds if p[2] >= 4])
        samples.clear(), reseeds.clear()
        return drawn

    train.main(debug_config("train.seed=1", name="fresh"))  # 2 epochs of 4 updates, never interrupted
    fresh = epoch_1()
    first = train.main(debug_config("train.max_steps=4", name="r"))  # seed 0, stopped at epoch 0's end
    assert (first.state.step, first.state.epoch, first.state.epoch_batches) == (4, 1, 0)
    samples.clear(), reseeds.clear()
    train.main(debug_config("train.seed=1", "train.allow_changed_config=true", name="r"))
    resumed = epoch_1()
    assert [index for _, index, _ in resumed[0]] == [index for _, index, _ in fresh[0]]
    assert [seed for _, _, seed in resumed[0]] == [mix_seed(1, 1, 0, pos) for pos in range(64)]
    assert resumed[1] == fresh[1] == [(1, 0, step) for step in range(4, 8)]


def test_an_older_checkpoint_without_its_epoch_position_resumes_mid_epoch_with_the_remaining_batches(
        debug_config):
    """A checkpoint written before `epoch_position` was saved records its place in the epoch only as micro-batches
    per process (state.epoch_batches). Resumed in the layout it was written in, the run trains exactly the rest of
    the epoch: its weights and optimizer state equal those of a run that never stopped (re-reading the epoch's
    first batches, or skipping more, would change them)."""
    train.main(debug_config("train.max_steps=3", name="split"))  # 4 updates of 2 micro-batches per epoch
    path = os.path.join(debug_config(name="split").out_dir, "checkpoint.pt")
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["state"]["epoch_batches"] == 6  # stopped inside epoch 0
    del ckpt["epoch_position"]  # the older layout
    torch.save(ckpt, path)
    assert train.main(debug_config(name="split")).state.step == 8
    train.main(debug_config(name="straight"))
    a, b = (model_and_optimizer(debug_config(name=n).out_dir) for n in ("split", "straight"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_resume_with_changed_settings_is_refused_before_the_model_and_the_data_are_built(debug_config, monkeypatch):
    """check_resumable compares configs only: the refusal comes before build_run (on ImageNet a folder scan and
    a model build, and the claim of out_dir's files), not after them."""
    train.main(debug_config("train.max_steps=1", name="early"))
    built = []
    monkeypatch.setattr(train, "build_run", lambda *a, **k: built.append(a) or pytest.fail("build_run was reached"))
    with pytest.raises(CheckpointError, match=r"was written with other settings \(train.seed: 0 -> 1\)"):
        train.main(debug_config("train.seed=1", name="early"))
    assert built == []


def test_the_resume_section_names_every_setting_that_may_change_on_resume():
    """docs/operations.md's Resume section lists what a resume may change without train.allow_changed_config
    (engine/run_dir.ENVIRONMENT_KEYS); train.device, train.compile, train.eval_batch_size_per_gpu, data.pin_memory
    and the divergence guard's settings change without a word, but were missing from the list. Every key but the
    wildcards (log.*: "logging"; quant.*: its own paragraph), the paths (out_dir, data.root) and the settings
    refused when changed (START_ONLY_KEYS, their own sentence) is named in the list's sentence."""
    from engine.run_dir import ENVIRONMENT_KEYS, START_ONLY_KEYS
    from tests.conftest import ROOT

    with open(os.path.join(ROOT, "docs", "operations.md")) as f:
        text = f.read()
    start = text.index("Settings that change what the\n  run computes must be the same")
    listed = text[start:text.index("(`ENVIRONMENT_KEYS` in `engine/run_dir.py`)", start)]
    named = [key for key in ENVIRONMENT_KEYS
             if "*" not in key and key not in START_ONLY_KEYS and key not in ("out_dir", "data.root")]
    assert [key for key in named if f"`{key}" not in listed] == []

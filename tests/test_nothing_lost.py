"""Nothing lost, nothing silently wrong: run folders, checkpoint writes, metrics, data mismatches,
divergence, and the one-line errors of train.py and evaluate.py."""
import errno
import json
import os
import sys

import pytest
import torch

import evaluate
import train
from configs import ConfigError, config_to_dict, load_config
from data import DataError, build_eval_loader, build_loaders
from engine.checkpoint import CheckpointError, restore_training, save_atomic
from engine.divergence import DivergenceError, DivergenceGuard
from engine.eval_results import ResultsError
from engine.loop import NonFiniteLossError, TrainLoop, TrainState, evaluate as evaluate_loader
from engine.run_dir import RunDirError, lock_folder, save_config_history
from models import ModelError
from tests.conftest import DEBUG_CONFIG, make_folder, run_entry


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def read_metrics(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


# -- run folders ---------------------------------------------------------------------------------------

def test_fresh_start_never_overwrites_an_earlier_runs_results(debug_config):
    cfg = debug_config("train.max_steps=4", name="run")
    train.main(cfg)
    best, metrics = read_bytes(os.path.join(cfg.out_dir, "best.pt")), read_metrics(cfg.out_dir)
    os.remove(os.path.join(cfg.out_dir, "checkpoint.pt"))  # e.g. deleted after a "cannot read" error
    with pytest.raises(RunDirError, match=r"earlier run \(.*best.pt.*metrics.jsonl.*archive_existing=true"):
        train.main(debug_config("train.max_steps=4", name="run"))
    assert read_bytes(os.path.join(cfg.out_dir, "best.pt")) == best and read_metrics(cfg.out_dir) == metrics
    train.main(debug_config("train.max_steps=4", "train.archive_existing=true", name="run"))
    archived = os.listdir(os.path.join(cfg.out_dir, "archive"))
    assert len(archived) == 1
    old = os.path.join(cfg.out_dir, "archive", archived[0])
    assert read_bytes(os.path.join(old, "best.pt")) == best
    assert [r["step"] for r in read_metrics(cfg.out_dir) if "train/loss" in r] == [2, 4]  # nothing appended


def test_a_file_named_archive_is_refused_and_kept(debug_config):
    cfg = debug_config("train.max_steps=4", name="run")
    train.main(cfg)
    os.remove(os.path.join(cfg.out_dir, "checkpoint.pt"))
    with open(os.path.join(cfg.out_dir, "archive"), "w") as f:
        f.write("mine")
    with pytest.raises(RunDirError, match=r"archive is a file, where earlier runs' files would be archived"):
        train.main(debug_config("train.max_steps=4", "train.archive_existing=true", name="run"))
    assert read_bytes(os.path.join(cfg.out_dir, "archive")) == b"mine"
    assert os.path.isfile(os.path.join(cfg.out_dir, "best.pt"))


def test_the_same_run_restarting_before_its_first_checkpoint_archives_its_logs(debug_config):
    cfg = debug_config(name="restart")
    os.makedirs(cfg.out_dir)
    save_config_history(cfg.out_dir, config_to_dict(cfg), 0)  # what a run killed in its first epoch leaves
    with open(os.path.join(cfg.out_dir, "metrics.jsonl"), "w") as f:
        f.write('{"step": 2, "train/loss": 1.0}\n')
    other = debug_config("optim.lr=0.01", name="restart")
    with pytest.raises(RunDirError, match="earlier run"):  # another config: refused
        train.main(other)
    train.main(debug_config(name="restart"))  # the same command: the logs are moved aside, the run starts
    archived = os.listdir(os.path.join(cfg.out_dir, "archive"))
    assert (len(archived) == 1
            and "metrics.jsonl" in os.listdir(os.path.join(cfg.out_dir, "archive", archived[0])))
    assert sum(1 for r in read_metrics(cfg.out_dir) if r["step"] == 2 and "train/loss" in r) == 1



def _fake_wandb(monkeypatch):
    """A stand-in for the wandb package (not installed here) that, as wandb.init(dir=out_dir) does, makes
    out_dir/wandb/ with a run folder in it."""
    import types

    def init(dir, id=None, **kwargs):
        os.makedirs(os.path.join(dir, "wandb", f"offline-run-{id}"), exist_ok=True)
        with open(os.path.join(dir, "wandb", f"offline-run-{id}", "run.wandb"), "w") as f:
            f.write("events")
        return types.SimpleNamespace(log=lambda *a, **k: None, finish=lambda: None)

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))


@pytest.mark.parametrize("logged", [True, False], ids=["killed_after_logging", "failed_before_logging"])
def test_a_restart_is_not_refused_for_the_wandb_folder_its_own_run_left(debug_config, monkeypatch, logged):
    """log.wandb=true makes out_dir/wandb/ when the run starts: a run killed before its first checkpoint (or a start
    that failed before its first logged update) left it beside its logs, and the same command was refused, naming
    the folder the run itself made. It is archived with the other logs (nothing deleted); a wandb/ folder in a run
    that did not enable wandb is still refused."""
    _fake_wandb(monkeypatch)
    run = ("log.wandb=true", "log.tensorboard=false", "train.max_steps=2")
    cfg = debug_config(*run, name="wandb_restart")
    os.makedirs(cfg.out_dir)
    save_config_history(cfg.out_dir, config_to_dict(cfg), 0)  # what the killed run wrote before training
    sys.modules["wandb"].init(dir=cfg.out_dir, id="killed")
    with open(os.path.join(cfg.out_dir, "train.log"), "w") as f:
        f.write("started\n")
    if logged:
        with open(os.path.join(cfg.out_dir, "metrics.jsonl"), "w") as f:
            f.write('{"step": 2, "train/loss": 1.0}\n')
    assert train.main(debug_config(*run, name="wandb_restart")).state.step == 2
    archived = os.path.join(cfg.out_dir, "archive")
    (stamp,) = os.listdir(archived)
    assert read_bytes(os.path.join(archived, stamp, "wandb", "offline-run-killed", "run.wandb")) == b"events"
    assert os.path.isfile(os.path.join(cfg.out_dir, "checkpoint.pt"))

    other = debug_config("log.tensorboard=false", "train.max_steps=2", name="not_wandb")  # wandb off
    os.makedirs(os.path.join(other.out_dir, "wandb"))
    save_config_history(other.out_dir, config_to_dict(other), 0)
    with pytest.raises(RunDirError, match=r"holds files of an earlier run \(config.yaml, wandb\)"):
        train.main(other)
    assert os.path.isdir(os.path.join(other.out_dir, "wandb"))

def test_a_second_run_in_the_same_folder_is_refused(debug_config):
    cfg = debug_config(name="busy")
    os.makedirs(cfg.out_dir)
    with lock_folder(cfg.out_dir):  # another run holding the folder
        with pytest.raises(RunDirError, match=r"in use by another run \(pid \d+"):
            train.main(cfg)
    assert not os.path.exists(os.path.join(cfg.out_dir, "metrics.jsonl"))


@pytest.mark.parametrize("target", ["empty", "missing"])
def test_a_lock_file_that_is_a_link_is_refused_and_nothing_is_written_through_it(tmp_path, target):
    """out_dir/.run.lock a symbolic link (to an empty file of the user's, or to none): the lock was taken through
    it, its text written into that file (or a new file made there, left behind) and the user's link removed at
    the release."""
    out, elsewhere = str(tmp_path / "run"), tmp_path / "elsewhere"
    os.makedirs(out)
    if target == "empty":
        elsewhere.write_bytes(b"")
    lock = os.path.join(out, ".run.lock")
    os.symlink(elsewhere, lock)
    with pytest.raises(RunDirError, match=r"\.run\.lock is a symbolic link, where a run keeps its lock file: remove "
                                          r"the link, or choose another out_dir"):
        with lock_folder(out):
            pass
    assert os.readlink(lock) == str(elsewhere) and os.listdir(out) == [".run.lock"]
    assert (elsewhere.read_bytes() == b"") if target == "empty" else not elsewhere.exists()


def folder_bytes(folder):
    """{relative path: bytes} of every file under `folder`, hidden ones included."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            out[os.path.relpath(path, folder)] = read_bytes(path)
    return out


def test_a_run_started_at_the_same_moment_is_refused_before_it_writes_anything(debug_config, monkeypatch):
    # The racing order, made deterministic: the winner has claimed the folder and is looking at its files
    # (check_fresh_start, archiving) while the loser tries to lock it. What the winner sees at that instant,
    # and the folder after the loser's refusal, must hold the winner's files only, byte for byte.
    import engine.run_dir as run_dir
    cfg = debug_config(name="race")
    with run_dir.claim_run_dir(cfg.out_dir, config_to_dict(cfg)):
        for name, text in (("config.yaml", "winner: 1\n"), ("train.log", "winner log\n"),
                           ("metrics.jsonl", '{"step": 1}\n')):
            with open(os.path.join(cfg.out_dir, name), "w") as f:
                f.write(text)
        winners = folder_bytes(cfg.out_dir)
        seen = []  # the folder as the winner would list it each time the loser has opened a file or asks for the lock

        def after(call):
            def spy(*args, **kwargs):
                result = call(*args, **kwargs)
                seen.append(folder_bytes(cfg.out_dir))
                return result
            return spy

        monkeypatch.setattr(run_dir, "open", after(open), raising=False)
        monkeypatch.setattr(run_dir.fcntl, "flock", after(run_dir.fcntl.flock))
        with pytest.raises(RunDirError, match=r"in use by another run \(pid \d+"):
            train.main(cfg)
        monkeypatch.undo()
        assert seen and all(state == winners for state in seen)  # at no instant a file of the loser's there
        assert folder_bytes(cfg.out_dir) == winners
        assert run_dir.earlier_run_files(cfg.out_dir) == ["config.yaml", "metrics.jsonl", "train.log"]


def test_changed_settings_on_resume_are_refused_unless_asked_for(debug_config):
    cfg = debug_config("train.max_steps=2", name="ch")
    train.main(cfg)
    config_before = read_bytes(os.path.join(cfg.out_dir, "config.yaml"))
    with pytest.raises(CheckpointError,
                       match=r"other settings \(optim.lr: None -> 0.01\).*allow_changed_config"):
        train.main(debug_config("train.max_steps=3", "optim.lr=0.01", name="ch"))
    assert read_bytes(os.path.join(cfg.out_dir, "config.yaml")) == config_before  # never trained with 0.01
    # paths, logging and max_steps may change
    assert train.main(debug_config("train.max_steps=3", "data.num_workers=1", name="ch")).state.step == 3
    done = train.main(debug_config("train.max_steps=4", "optim.lr=0.01", "train.allow_changed_config=true",
                                   name="ch"))
    assert done.state.step == 4
    kept = [n for n in os.listdir(cfg.out_dir) if n.startswith("config.until_step")]
    assert "config.until_step3.yaml" in kept
    assert "lr: 0.01" in open(os.path.join(cfg.out_dir, "config.yaml")).read()



def test_a_resume_that_changes_only_train_resume_keeps_the_earlier_config_and_a_repeat_keeps_nothing(debug_config):
    """config.yaml is the resolved config of the run as last started (docs/operations.md): a restart whose only new
    value is train.resume writes it there, so the earlier config.yaml (the same run's, train.resume empty) is kept
    as config.until_step<N>.yaml at the update the run went on from; the same command again (a requeued job)
    changes nothing and keeps nothing."""
    import yaml

    cfg = debug_config("train.max_steps=2", "log.tensorboard=false", name="resume_only")
    train.main(cfg)
    config = os.path.join(cfg.out_dir, "config.yaml")
    before = read_bytes(config)
    ckpt = os.path.join(cfg.out_dir, "checkpoint.pt")
    again = ("train.max_steps=2", "log.tensorboard=false", f"train.resume={ckpt}")
    for _ in range(2):
        assert train.main(debug_config(*again, name="resume_only")).state.step == 2
        assert sorted(n for n in os.listdir(cfg.out_dir) if n.startswith("config")) == [
            "config.until_step2.yaml", "config.yaml"]
        assert read_bytes(os.path.join(cfg.out_dir, "config.until_step2.yaml")) == before
    old, new = yaml.safe_load(before), yaml.safe_load(open(config))
    assert (old["train"].pop("resume"), new["train"].pop("resume")) == ("", ckpt)
    assert new == old

def test_a_roll_back_keeps_the_abandoned_branchs_best_and_metrics(tmp_path, caplog):
    """A roll-back to an earlier checkpoint of the run (a copy in out_dir) used to let the new branch
    overwrite best.pt (or keep the abandoned branch's best.pt under the new branch's summary) and cut
    metrics.jsonl: both are kept as <name>.until_step<N>, and best.pt is the new branch's."""
    out = tmp_path / "lm"

    def config(*extra):
        return load_config(["configs/lm/kjv_nano.yaml"], [f"out_dir={out}", "log.tensorboard=false", *extra])

    train.main(config("train.max_steps=6"))
    torch.save(torch.load(out / "checkpoint.pt", weights_only=True), out / "at6.pt")  # the user's own copy
    train.main(config())  # on to update 12
    abandoned_best, abandoned_metrics = read_bytes(out / "best.pt"), read_bytes(out / "metrics.jsonl")
    assert torch.load(out / "best.pt", weights_only=True)["state"]["step"] == 12  # val loss fell: the premise
    caplog.clear()
    run = train.main(config(f"train.resume={out / 'at6.pt'}", "optim.lr=3e-3", "train.allow_changed_config=true"))
    assert read_bytes(out / "best.until_step6.pt") == abandoned_best
    assert read_bytes(out / "metrics.until_step6.jsonl") == abandoned_metrics
    assert "kept as" in caplog.text
    best = torch.load(out / "best.pt", weights_only=True)
    assert best["config"]["optim"]["lr"] == 3e-3  # the new branch's weights, as the summary says
    assert (best["state"]["step"], best["metrics"]["val/loss"]) == (run.state.best_step, run.state.best_value)
    assert [r["step"] for r in read_metrics(out)] == sorted(r["step"] for r in read_metrics(out))


def test_a_resume_onto_another_validation_set_keeps_the_old_best_and_scores_anew(tmp_path, caplog):
    """Resumed with train.allow_changed_config=true and another validation set (data.val_windows 64 -> 8), the
    run compared the new set's losses with the best of the old set, so best.pt held whichever set scored lower:
    the old best.pt is kept as best.until_step<N>.pt, and best.pt is chosen among validations on the new set."""
    out = tmp_path / "lm"

    def config(*extra):
        return load_config(["configs/lm/kjv_nano.yaml"], [f"out_dir={out}", "log.tensorboard=false", *extra])

    train.main(config("train.max_steps=6"))
    old_best = read_bytes(out / "best.pt")
    caplog.clear()
    run = train.main(config("data.val_windows=8", "train.allow_changed_config=true"))
    assert read_bytes(out / "best.until_step6.pt") == old_best
    assert "resuming with another validation set (data.val_windows: 64 -> 8)" in caplog.text
    best = torch.load(out / "best.pt", weights_only=True)
    new_set = [r for r in read_metrics(out) if "val/loss" in r and r["step"] > 6]  # validations on 8 windows
    assert [r["step"] for r in new_set] == [12]
    assert best["state"]["step"] == run.state.best_step == 12
    assert best["metrics"]["val/loss"] == run.state.best_value == new_set[0]["val/loss"]


def test_a_run_resumed_into_a_new_folder_writes_its_own_best(tmp_path):
    """Resumed from another folder's checkpoint, the run's out_dir has no best.pt: its first validation
    writes one (the inherited best score described a file in the other folder)."""
    source = load_config(["configs/lm/kjv_nano.yaml"], [f"out_dir={tmp_path / 'a'}", "log.tensorboard=false",
                                                        "train.max_steps=6"])
    train.main(source)
    moved = load_config(["configs/lm/kjv_nano.yaml"], [f"out_dir={tmp_path / 'b'}", "log.tensorboard=false",
                                                       f"train.resume={tmp_path / 'a' / 'checkpoint.pt'}",
                                                       "optim.lr=1e-30", "sched.min_lr=0",
                                                       "train.allow_changed_config=true"])
    # lr 1e-30 leaves every fp32 weight as it was: update 12's validation ties the inherited best, and a tie
    # does not beat it
    run = train.main(moved)
    best = torch.load(tmp_path / "b" / "best.pt", weights_only=True)
    assert best["state"]["step"] == run.state.best_step == 12
    assert not any(name.startswith("best.until") for name in os.listdir(tmp_path / "b"))


def test_a_finished_run_resumed_into_a_new_folder_writes_its_best_there(debug_config):
    """With nothing left to train, the one validation of a finished checkpoint resumed into a new out_dir used
    to be reported only: the folder got no best.pt (nor checkpoint.pt) and the summary said 'no validation
    yet'."""
    source = debug_config(name="a")
    train.main(source)
    finished = os.path.join(source.out_dir, "checkpoint.pt")
    moved = debug_config(f"train.resume={finished}", name="b")
    run = train.main(moved)
    best = torch.load(os.path.join(moved.out_dir, "best.pt"), weights_only=True)
    done = torch.load(finished, weights_only=True)
    assert best["state"]["step"] == run.state.best_step == done["state"]["step"]
    assert all(torch.equal(best["model"][k], v) for k, v in done["model"].items())
    assert best["metrics"]["val/top1"] == run.state.best_value == run.metrics["val/top1"]
    # and the folder is a run folder: its checkpoint.pt (which the requeued command continues) knows that best
    own = torch.load(os.path.join(moved.out_dir, "checkpoint.pt"), weights_only=True)
    assert own["state"]["best_step"] == best["state"]["step"] and own["resumed_from"] == finished
    assert train.main(debug_config(f"train.resume={finished}", name="b")).state.best_step == 8


@pytest.mark.parametrize("longer", [["sched.epochs=3"], ["sched.steps=12"]])
def test_a_finished_run_extended_keeps_its_checkpoint_and_best(debug_config, caplog, longer):
    """A finished run resumed in its out_dir with a longer schedule replaced checkpoint.pt, the finished run's last
    state, at its first write (and best.pt at its first better validation): both are kept as
    <name>.until_step<N>.pt first. A run stopped at train.max_steps and continued keeps nothing: its checkpoint.pt
    is no finished run's."""
    train.main(debug_config("train.max_steps=4", name="e"))
    out = train.main(debug_config(name="e")).state  # on to the schedule's end
    assert out.step == 8
    folder = debug_config(name="e").out_dir
    finished = {name: read_bytes(os.path.join(folder, name)) for name in ("checkpoint.pt", "best.pt")}
    assert not [n for n in os.listdir(folder) if n.endswith(".pt") and ".until_step" in n]  # the premise: none yet
    caplog.clear()
    assert train.main(debug_config(*longer, "train.allow_changed_config=true", name="e")).state.step == 12
    assert read_bytes(os.path.join(folder, "checkpoint.until_step8.pt")) == finished["checkpoint.pt"]
    assert read_bytes(os.path.join(folder, "best.until_step8.pt")) == finished["best.pt"]
    assert torch.load(os.path.join(folder, "checkpoint.pt"), weights_only=True)["state"]["step"] == 12
    assert "extending the run finished at update 8" in caplog.text
    # the extended run re-run: finished under its own schedule, nothing left to train, nothing more kept
    train.main(debug_config(*longer, "train.allow_changed_config=true", name="e"))
    assert sorted(n for n in os.listdir(folder) if ".until_step" in n and n.endswith(".pt")) == [
        "best.until_step8.pt", "checkpoint.until_step8.pt"]


@pytest.mark.parametrize("archive_existing", [False, True])
def test_a_resume_from_a_kept_checkpoint_of_its_own_folder_without_checkpoint_pt_is_a_resume(debug_config, tmp_path,
                                                                                           caplog, archive_existing):
    """checkpoint.pt moved away, then train.resume=out_dir/checkpoint.until_step<N>.pt (the finished run's state that
    an extension kept, or a roll-back's abandoned branch): the claim took only a snapshot for the folder's own, so
    the folder was refused as holding an earlier run's files, the file to resume from among them, with or without
    train.archive_existing=true (which a resume refuses as a start's setting). It is a roll-back, as from a
    snapshot."""
    extended = ("sched.steps=12", "train.allow_changed_config=true")
    train.main(debug_config(name="e"))  # finished at update 8
    train.main(debug_config(*extended, name="e"))  # extended to 12: the finished state kept
    folder = debug_config(name="e").out_dir
    kept = os.path.join(folder, "checkpoint.until_step8.pt")
    finished = read_bytes(kept)
    os.rename(os.path.join(folder, "checkpoint.pt"), tmp_path / "moved.pt")
    caplog.clear()
    if archive_existing:  # a start's setting, which a resume refuses: nothing moved before the refusal
        with pytest.raises(CheckpointError, match=r"continues a run, and only a run's start reads "
                                                  r"train.archive_existing: False -> True"):
            train.main(debug_config(*extended, f"train.resume={kept}", "train.archive_existing=true", name="e"))
        assert read_bytes(kept) == finished and not os.path.exists(os.path.join(folder, "archive"))
    out = train.main(debug_config(*extended, f"train.resume={kept}", name="e"))
    assert f"resumed from {kept} at epoch 2, update 8" in caplog.text
    assert out.state.step == 12
    assert read_bytes(kept) == finished  # the kept file in place, as it was
    assert not os.path.exists(os.path.join(folder, "archive"))  # nothing of the run's own moved aside


def test_a_finished_run_extended_from_its_last_snapshot_keeps_its_best(debug_config):
    """Extended from the snapshot of its last epoch (train.resume=, a roll-back to the finished state), the run kept
    checkpoint.pt in that snapshot but let its first better validation replace best.pt: kept too."""
    cfg = debug_config("train.keep_every_epochs=1", name="s")
    train.main(cfg)
    best = read_bytes(os.path.join(cfg.out_dir, "best.pt"))
    snapshot = os.path.join(cfg.out_dir, "snapshots", "epoch0002.pt")
    train.main(debug_config("train.keep_every_epochs=1", f"train.resume={snapshot}", "sched.epochs=3",
                            "train.allow_changed_config=true", name="s"))
    assert read_bytes(os.path.join(cfg.out_dir, "best.until_step8.pt")) == best
    assert torch.load(snapshot, weights_only=True)["state"]["step"] == 8  # the finished state, in its snapshot


def test_a_refused_fine_tune_or_resume_leaves_no_folder_and_moves_no_file(debug_config, tmp_path, capsys):
    """The refusal of a val split that reads the start's training data came once out_dir was claimed: a refused
    fine-tune (model.pretrained=) or resume (train.resume= into a new out_dir) left a folder holding train.log, and
    one into a folder of a failed start's logs archived them first. Both are refused before the claim now."""
    digits = ("data.dataset=digits", "model.num_classes=10")
    start = debug_config(*digits, "train.max_steps=1", name="a")
    train.main(start)
    overlapping = "data.digits_val_fraction=0.3"  # val images among those the start trained on (fraction 0.2)
    with pytest.raises(ConfigError, match="among the digits model.pretrained="):
        train.main(debug_config(*digits, f"model.pretrained={tmp_path / 'a' / 'best.pt'}", overlapping, name="b"))
    assert not (tmp_path / "b").exists()
    # --print-config, which prints a config once it passes the checks a run makes before it starts, refuses it too
    code, _, err = run_entry("train.py", ["--config", DEBUG_CONFIG, f"out_dir={tmp_path / 'b'}", *digits,
                                          f"model.pretrained={tmp_path / 'a' / 'best.pt'}", overlapping,
                                          "--print-config"], capsys)
    assert code == 1 and err.startswith("error: data.digits_val_fraction=0.3: 185 of its val images"), err
    with pytest.raises(ConfigError, match="among the digits .*checkpoint.pt was trained on"):
        train.main(debug_config(*digits, f"train.resume={tmp_path / 'a' / 'checkpoint.pt'}", overlapping,
                                "train.allow_changed_config=true", name="c"))
    assert not (tmp_path / "c").exists()
    failed = tmp_path / "d"  # what a start that failed leaves, which a claim moves to d/archive/<time>/
    failed.mkdir()
    (failed / "train.log").write_text("09:00:00 train INFO commit ...\n")
    with pytest.raises(ConfigError, match="among the digits model.pretrained="):
        train.main(debug_config(*digits, f"model.pretrained={tmp_path / 'a' / 'best.pt'}", overlapping, name="d"))
    assert os.listdir(failed) == ["train.log"]


def test_best_pt_is_read_without_mmap_on_a_file_system_that_has_none(debug_config, monkeypatch):
    """Resume compares best.pt's update with the checkpoint's best: unread, best.pt would be moved aside at
    every resume."""
    from engine.best_checkpoint import _recorded_state

    cfg = debug_config("train.max_steps=4", name="nm")
    run = train.main(cfg)
    real = torch.load

    def without_mmap(*args, **kwargs):
        if kwargs.get("mmap"):
            raise RuntimeError("mmap is not supported on this file system")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", without_mmap)
    assert _recorded_state(os.path.join(cfg.out_dir, "best.pt"))["step"] == run.state.best_step > 0


def test_partial_writes_of_an_interrupted_run_are_removed(debug_config):
    cfg = debug_config("train.max_steps=2", name="tmp")
    train.main(cfg)
    stale = os.path.join(cfg.out_dir, "checkpoint.pt.tmp.4194999")
    # a snapshot copy cut short (engine/snapshots.py copies where a hard link is impossible); pid 4194999
    # is above Linux's largest pid, so its writer is not running
    os.makedirs(os.path.join(cfg.out_dir, "snapshots"))
    stale_snapshot = os.path.join(cfg.out_dir, "snapshots", "epoch1.pt.partial-4194999-0a1b2c3d")
    kept = os.path.join(cfg.out_dir, "snapshots", "epoch1.pt.partial-notes.txt")  # not our name pattern
    for path in (stale, stale_snapshot, kept):
        with open(path, "wb") as f:
            f.write(b"\0" * 1000)
    train.main(debug_config("train.max_steps=3", name="tmp"))
    assert not os.path.exists(stale) and not os.path.exists(stale_snapshot)
    assert os.path.exists(kept)


def test_only_the_temporaries_of_the_files_a_run_writes_are_removed(tmp_path, caplog):
    """remove_partial_writes matched any `*.partial-[<host>-]<pid>-<8 hex>` name: a user's file of that shape in the
    run folder (notes.txt.partial-...) was deleted as a partial write. Now only the temporary names of the files this
    program writes there (the list below, by hand) are; any other stays, named in no warning."""
    import logging

    from engine.run_dir import partial_path, remove_partial_writes

    host = os.path.basename(partial_path("/x/checkpoint.pt")).split("-")[1]  # this machine's
    dead = f"{host}-4194999-0a1b2c3d"  # 4194999: above Linux's largest pid, its writer is not running
    (tmp_path / "snapshots").mkdir()
    ours = ["checkpoint.pt", "best.pt", "config.yaml", "metrics.jsonl", "checkpoint.until_step4.pt",
            "checkpoint.until_step4.2.pt", "metrics.until_step4.jsonl", "metrics.until_step4.2.jsonl",
            "eval_best.json", "eval_best_act_max.csv", "eval_best_act_max.png",
            "snapshots/epoch0002.pt", "snapshots/epoch0002-1.pt", "snapshots/eval_epoch0002.json"]
    ours = [f"{name}.partial-{dead}" for name in ours] + ["metrics.jsonl.partial-4194999-0a1b2c3d",
                                                          "best.pt.tmp.4194999"]
    users = [f"notes.txt.partial-{dead}", "mydata.partial-4194999-0a1b2c3d", f"checkpoint.pt.bak.partial-{dead}",
             f"snapshots/mine.pt.partial-{dead}", "results.tmp.4194999"]
    for name in ours + users:
        (tmp_path / name).write_bytes(b"\0" * 10)
    with caplog.at_level(logging.WARNING):
        assert sorted(remove_partial_writes(str(tmp_path))) == sorted(ours)
    assert all((tmp_path / name).exists() for name in users) and not any((tmp_path / n).exists() for n in ours)
    assert not any(os.path.basename(name) in caplog.text for name in users)


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="process start times are read from Linux's /proc")
def test_a_temporary_whose_pid_a_process_started_since_holds_is_removed_and_no_other_one(tmp_path, caplog):
    """A pid that runs is no proof that its process wrote a temporary file: a container's train.py is pid 1 (or the
    same low pid) in every container, so a killed run's held checkpoint.pt write carried the pid of the next run,
    and an earlier version's `checkpoint.pt.tmp.1` the pid of init; both were kept, and warned about, at every run.
    Now one written before the process holding its pid started is removed; one written since stays, named."""
    import logging

    import psutil

    from engine.run_dir import partial_path, process_start, remove_partial_writes

    started = psutil.Process(os.getpid()).create_time()  # the reference, read by another library
    assert abs(process_start(os.getpid()) - started) < 1.5
    before, since = tmp_path / "before", tmp_path / "since"
    for folder in (before, since):
        folder.mkdir()
        for path in (partial_path(str(folder / "checkpoint.pt")), str(folder / f"checkpoint.pt.tmp.{os.getpid()}")):
            with open(path, "wb") as f:
                f.write(b"\0" * 10)
            if folder == before:
                os.utime(path, (started - 86400, started - 86400))  # a day before this process started
    with caplog.at_level(logging.WARNING):
        assert len(remove_partial_writes(str(before))) == 2 and os.listdir(before) == []
        assert remove_partial_writes(str(since)) == [] and len(os.listdir(since)) == 2
    (line,) = [r.getMessage() for r in caplog.records if "kept in" in r.getMessage()]
    assert all(name in line for name in os.listdir(since)) and f"pid {os.getpid()}, running since" in line


def test_a_temporary_its_running_writer_renames_meanwhile_is_passed_over(tmp_path, monkeypatch):
    """A live writer (an evaluate.py finishing its eval_best.json) may rename its temporary into place between
    remove_partial_writes' listing and its reading of the file's time: the file is gone, not an error (train.py
    ended at its claim on a FileNotFoundError traceback); the written file stays, nothing is removed."""
    import engine.run_dir as run_dir

    temporary = run_dir.partial_path(str(tmp_path / "eval_best.json"))  # this process's: its writer runs
    with open(temporary, "w") as f:
        f.write('{"quant": {}}')
    real = run_dir.process_start

    def process_start(pid):  # the writer's rename lands after the listing, before the file's time is read
        os.replace(temporary, tmp_path / "eval_best.json")
        return real(pid)

    monkeypatch.setattr(run_dir, "process_start", process_start)
    assert run_dir.remove_partial_writes(str(tmp_path)) == []
    assert os.listdir(tmp_path) == ["eval_best.json"] and (tmp_path / "eval_best.json").read_text() == '{"quant": {}}'


def test_unusable_out_dirs_are_refused_before_training(tmp_path, monkeypatch, debug_config):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(RunDirError, match="cannot be used: Not a directory"):
        train.main(load_config([DEBUG_CONFIG], [f"out_dir={blocker}/run"]))

    import engine.run_dir as run_dir

    def read_only(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", path)

    monkeypatch.setattr(run_dir, "open", read_only, raising=False)  # the write probe of prepare_folder
    with pytest.raises(RunDirError, match="cannot be used: Permission denied"):
        train.main(debug_config(name="ro"))


def test_a_full_disk_found_by_the_write_probe_refuses_the_claim_and_leaves_the_folder_empty(tmp_path, monkeypatch):
    """The probe's fsync is where a full disk shows (creating the empty lock file still works there): the claim
    is one error naming the disk, and neither the probe nor the lock file is left behind."""
    from engine.run_dir import claim_run_dir

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    out = str(tmp_path / "run")
    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(RunDirError, match=r"out_dir '.*run': the disk is full \(No space left on device"):
        with claim_run_dir(out, CONFIG):
            pass
    monkeypatch.undo()
    assert os.listdir(out) == []


def test_a_lock_file_that_cannot_be_made_names_the_setting_that_gave_the_folder(tmp_path, monkeypatch):
    """lock_folder's caller names the option (train_detection.py's --work-dir): its error says that option."""
    import engine.run_dir as run_dir

    def read_only(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", path)

    monkeypatch.setattr(run_dir, "open", read_only, raising=False)
    with pytest.raises(RunDirError, match=r"^--work-dir '.*' cannot be used: Permission denied; choose a writable "
                                          r"--work-dir$"):
        with run_dir.lock_folder(str(tmp_path), "--work-dir"):
            pass


# -- checkpoint writes and metrics ---------------------------------------------------------------------

@pytest.mark.parametrize("failure", [OSError(errno.ENOSPC, "No space left on device"),
                                     RuntimeError("[enforce fail at inline_container.cc] unexpected pos 64")])
def test_a_full_disk_keeps_the_last_checkpoint_and_leaves_no_partial_file(tmp_path, monkeypatch, failure):
    path = str(tmp_path / "checkpoint.pt")
    save_atomic({"model": {"w": torch.ones(3)}, "config": {}}, path)
    good = read_bytes(path)

    def full_disk(payload, f):
        f.write(b"\1" * 4096)
        raise failure

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(CheckpointError, match="the disk is full .* MB free.*previous file is unchanged"):
        save_atomic({"model": {"w": torch.zeros(3)}, "config": {}}, path)
    assert read_bytes(path) == good and os.listdir(tmp_path) == ["checkpoint.pt"]


def test_a_checkpoint_is_on_disk_before_its_name_replaces_the_previous_one(tmp_path, monkeypatch):
    """The order of a durable atomic write, written out: the new bytes go to a file other than checkpoint.pt, that
    file is flushed to disk (fsync of its descriptor), and only then renamed over checkpoint.pt. Without the fsync
    a power loss after the rename can leave checkpoint.pt empty: the previous checkpoint is gone and the new one
    never reached the disk."""
    path = str(tmp_path / "checkpoint.pt")
    events, fsync, replace = [], os.fsync, os.replace

    def record_fsync(fd):  # the file by its inode: the descriptor has no name on every system
        events.append(("fsync", os.fstat(fd).st_ino))
        fsync(fd)

    def record_replace(src, dst):
        events.append(("replace", os.stat(src).st_ino, str(src), str(dst)))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", record_fsync)
    monkeypatch.setattr(os, "replace", record_replace)
    save_atomic({"model": {"w": torch.ones(3)}, "config": {}}, path)
    assert [e[0] for e in events] == ["fsync", "replace"], events
    (_, synced), (_, renamed, source, target) = events
    assert synced == renamed and source != path and target == path
    assert torch.equal(torch.load(path, weights_only=True)["model"]["w"], torch.ones(3))
    assert os.listdir(tmp_path) == ["checkpoint.pt"]


def test_a_failed_first_write_says_no_earlier_file_existed_and_leaves_none(tmp_path, monkeypatch):
    """The message must not promise a previous checkpoint that was never written."""
    def full_disk(payload, f):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(CheckpointError, match=r"the disk is full .*; no earlier file existed and no partial file "
                                              r"was left"):
        save_atomic({"model": {"w": torch.ones(3)}, "config": {}}, str(tmp_path / "checkpoint.pt"))
    assert os.listdir(tmp_path) == []


def test_a_write_into_a_folder_that_vanished_is_a_checkpoint_error_naming_the_write(tmp_path):
    """out_dir deleted or its mount gone mid-run: the probe of the free space in that folder raised its own
    FileNotFoundError, which hid the write's error and was no CheckpointError (the other ranks of a DDP run
    waited at the next collective for the rank that stopped)."""
    path = tmp_path / "gone" / "checkpoint.pt"
    with pytest.raises(CheckpointError, match=rf"^could not write {path}: \[Errno 2\] No such file or directory.*; "
                                              r"no earlier file existed"):
        save_atomic({"model": {"w": torch.ones(3)}, "config": {}}, str(path))
    assert not os.path.exists(tmp_path / "gone")


def test_a_failed_checkpoint_write_stops_training_with_the_old_checkpoint(debug_config, monkeypatch):
    cfg = debug_config("train.max_steps=4", name="fail")
    train.main(debug_config("train.max_steps=2", name="fail"))
    good = read_bytes(os.path.join(cfg.out_dir, "checkpoint.pt"))

    def full_disk(payload, f):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(CheckpointError, match="disk is full"):
        train.main(cfg)
    assert read_bytes(os.path.join(cfg.out_dir, "checkpoint.pt")) == good
    assert not [n for n in os.listdir(cfg.out_dir) if ".partial-" in n]


def test_a_truncated_last_metrics_line_is_repaired_on_resume(debug_config):
    cfg = debug_config("train.max_steps=2", name="m")
    train.main(cfg)
    with open(os.path.join(cfg.out_dir, "metrics.jsonl"), "a") as f:
        f.write('{"step": 3, "train/lo')  # what a full disk or a kill mid-write leaves
    train.main(debug_config("train.max_steps=4", name="m"))
    steps = [r["step"] for r in read_metrics(cfg.out_dir) if "train/loss" in r]  # every line is JSON again
    assert steps == [2, 4]


# -- data ------------------------------------------------------------------------------------------------

def folder_config(root, *overrides):
    return load_config([DEBUG_CONFIG], ["data.dataset=folder", f"data.root={root}", "model.num_classes=2",
                                        "data.auto_augment=", *overrides])


def test_val_classes_must_equal_train_classes(tmp_path):
    make_folder(tmp_path, {"train": {"a": 8, "d": 8}, "val": {"a": 2, "x": 2}})
    cfg = folder_config(tmp_path)
    with pytest.raises(DataError, match=r"different class folders \(val lacks \['d'\]; val has classes train "
                                        r"lacks: \['x'\]\)"):
        build_loaders(cfg.data, img_size=32, batch_size_per_gpu=8, eval_batch_size_per_gpu=8, rank=0,
                      world_size=1, seed=0, num_classes=2)


def test_a_corrupt_val_image_is_excluded_and_named_never_replaced(tmp_path, caplog):
    make_folder(tmp_path, {"train": {"a": 4, "b": 4}, "val": {"a": 3, "b": 2}})
    with open(tmp_path / "val" / "b" / "1.png", "wb") as f:
        f.write(b"not an image")
    cfg = folder_config(tmp_path)
    loader = build_eval_loader(cfg.data, img_size=32, batch_size_per_gpu=2, rank=0, world_size=1,
                               num_classes=2)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 2))
    with caplog.at_level("WARNING"):
        result = evaluate_loader(model, loader, torch.device("cpu"))
    assert result["count"] == 4 and result["excluded"] == 1  # 5 files, 4 readable: true counts
    assert "1 unreadable image(s)" in caplog.text and os.path.join("b", "1.png") in caplog.text


# -- divergence ------------------------------------------------------------------------------------------

def test_divergence_guard_counts_consecutive_high_windows():
    guard = DivergenceGuard(factor=3.0, windows=2)
    guard.check(1, 10.0, 2.0)
    guard.check(2, 5.0, 2.0)  # back under 3x: the streak restarts
    guard.check(3, 7.0, 2.0)
    with pytest.raises(DivergenceError,
                       match=r"above 3x its initial value 2 for 2 log windows \(now 7 at update 4"):
        guard.check(4, 7.0, 2.0)
    DivergenceGuard(3.0, 1).check(1, 1e9, None)  # no reference yet: nothing to say


def test_divergence_guard_threshold_is_strictly_above_factor_times_the_initial_loss():
    """The rule of engine/divergence.py, naively: a window counts when mean > factor * initial (strictly)."""
    initial, factor = 0.5, 4.0  # 4 x 0.5 = 2.0; factor + initial would be 4.5
    guard = DivergenceGuard(factor, windows=1)
    for loss in (2.0, 1.0, 2.0 - 1e-9):  # at or under the threshold: no window counts
        guard.check(1, loss, initial)
    assert guard.streak == 0
    with pytest.raises(DivergenceError):
        guard.check(2, 3.0, initial)  # above 4 x 0.5 (under 4 + 0.5)
    DivergenceGuard(factor, windows=1).check(1, 1e9, 0.0)  # a reference of 0 (no loss yet to scale): no verdict


def test_a_finite_divergence_stops_training_without_a_checkpoint(debug_config):
    cfg = debug_config("data.mixup=0", "data.cutmix=0")
    loaders = build_loaders(cfg.data, img_size=32, batch_size_per_gpu=8, eval_batch_size_per_gpu=8, rank=0,
                            world_size=1, seed=0, num_classes=4)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 4))
    losses = iter([1.0] + [50.0] * 20)  # update 1 sets the reference; then 50x it, finite

    def compute_loss(m, x, y):
        return m(x).sum() * 0 + next(losses)

    saves = []
    loop = TrainLoop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                     compute_loss=compute_loss, device=torch.device("cpu"), log_every=1, ckpt_every=10,
                     save=lambda: saves.append(1), divergence=DivergenceGuard(3.0, 3))
    state = TrainState()
    with pytest.raises(DivergenceError, match="at update 4"):
        loop.run_epoch(loaders.train, state, batch_size_per_gpu=8)
    assert state.initial_loss == 1.0 and saves == []


def test_a_resumed_run_keeps_the_divergence_streak_and_stops_where_the_uninterrupted_one_does(debug_config):
    """Losses 1 then 50 (above 3 x 1) with one update per log window and 3 windows to stop: the uninterrupted
    run stops at update 4 (high windows 2, 3, 4). Interrupted after update 2 (one high window) and resumed from
    its checkpointed state, it stops at update 4 too, not at 5 as a streak restarted at 0 would."""
    cfg = debug_config("data.mixup=0", "data.cutmix=0")
    loaders = build_loaders(cfg.data, img_size=32, batch_size_per_gpu=8, eval_batch_size_per_gpu=8, rank=0,
                            world_size=1, seed=0, num_classes=4)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 4))
    losses = iter([1.0] + [50.0] * 20)

    def loop(**kwargs):
        return TrainLoop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                         compute_loss=lambda m, x, y: m(x).sum() * 0 + next(losses), device=torch.device("cpu"),
                         log_every=1, divergence=DivergenceGuard(3.0, 3), **kwargs)

    state = TrainState()
    assert loop(max_steps=2).run_epoch(loaders.train, state, batch_size_per_gpu=8) == "max_steps"
    payload = {"model": model.state_dict(), "state": state.state_dict()}  # what checkpoint.pt keeps of them
    resumed = TrainState()
    restore_training(payload, model=model, optimizer=None, state=resumed)
    with pytest.raises(DivergenceError, match="for 3 log windows .*at update 4"):
        loop().run_epoch(loaders.train, resumed, batch_size_per_gpu=8)
    older = {k: v for k, v in state.state_dict().items() if k != "divergence_streak"}  # a checkpoint without it
    restored = TrainState(divergence_streak=5)
    restore_training({"model": model.state_dict(), "state": older}, model=model, optimizer=None, state=restored)
    assert restored.divergence_streak == 5  # untouched: a fresh TrainState of train.py holds 0


def test_the_divergence_reference_is_the_first_updates_mean_over_its_micro_batches(debug_config):
    """With gradient accumulation the reference was the first micro-batch's loss alone (1.0 here, not the
    update's 2.0): one lucky or unlucky micro-batch moved the threshold of every later window."""
    cfg = debug_config("data.mixup=0", "data.cutmix=0")
    loaders = build_loaders(cfg.data, img_size=32, batch_size_per_gpu=4, eval_batch_size_per_gpu=8, rank=0,
                            world_size=1, seed=0, num_classes=4)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 4))
    losses = iter([1.0, 3.0] + [0.5] * 40)  # update 1 = micro-batches 1.0 and 3.0

    def compute_loss(m, x, y):
        return m(x).sum() * 0 + next(losses)

    loop = TrainLoop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), accum_steps=2,
                     compute_loss=compute_loss, device=torch.device("cpu"), log_every=2,
                     divergence=DivergenceGuard(3.0, 3))
    state = TrainState()
    loop.run_epoch(loaders.train, state, batch_size_per_gpu=4)
    assert state.step >= 2 and state.initial_loss == pytest.approx(2.0)


def test_the_nan_message_names_the_update(debug_config):
    cfg = debug_config()
    loaders = build_loaders(cfg.data, img_size=32, batch_size_per_gpu=8, eval_batch_size_per_gpu=8, rank=0,
                            world_size=1, seed=0, num_classes=4)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 4))
    loop = TrainLoop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                     device=torch.device("cpu"), compute_loss=lambda m, x, y: m(x).sum() * float("nan"),
                     ckpt_every=1, save=lambda: None)
    with pytest.raises(NonFiniteLossError, match="nan at or before update 1;"):
        loop.run_epoch(loaders.train, TrainState(), batch_size_per_gpu=8)


# -- evaluate.py: validation first, results merged, written as they come ----------------------------------

def run_eval(*argv):
    return evaluate.main(evaluate.parse_args(list(argv)))


def test_results_are_merged_skipped_and_never_silently_replaced(checkpoint, tmp_path, monkeypatch):
    def run_csvless(*argv):
        # no per-layer CSV and plot (a plot costs most of a second): the merge does not depend on them
        return run_eval(*argv, "quant.act_max_csv=false")

    out = str(tmp_path / "r.json")
    run_csvless("--checkpoint", checkpoint, "--quant", "percentile", "--bits", "w8a8", "--out", out)
    run_csvless("--checkpoint", checkpoint, "--quant", "repq", "--bits", "w8a8", "--out", out)
    saved = json.load(open(out))
    assert set(saved["quant"]) == {"percentile", "repq"}  # the second call added, it did not replace
    first = saved["quant"]["percentile"]["w8a8"]
    assert "written" in first and first["settings"]["calibration"]["images"] == 32

    import quant

    calls = []
    monkeypatch.setattr(evaluate, "evaluate_quantized",
                        lambda *a, **k: calls.append(a) or pytest.fail("re-ran"))
    run_csvless("--checkpoint", checkpoint, "--quant", "percentile", "--bits", "w8a8", "--out", out)  # skipped
    monkeypatch.setattr(evaluate, "evaluate_quantized", quant.evaluate_quantized)
    with pytest.raises(ResultsError,
                       match=r"other settings \(.*options.act_range 'percentile_mse' -> 'minmax'\)"):
        run_csvless("--checkpoint", checkpoint, "--quant", "percentile", "--bits", "w8a8", "--out", out,
                    "quant.percentile.act_range=minmax")
    run_csvless("--checkpoint", checkpoint, "--quant", "percentile", "--bits", "w8a8", "--out", out,
                "--recompute", "quant.percentile.act_range=minmax")
    saved = json.load(open(out))
    assert (saved["history"][0]["pipeline"] == "percentile"
            and saved["history"][0]["written"] == first["written"])
    assert saved["quant"]["percentile"]["w8a8"]["settings"]["options"]["act_range"] == "minmax"


def test_each_result_is_written_as_soon_as_it_is_done(checkpoint, tmp_path, monkeypatch):
    import quant

    out = str(tmp_path / "r.json")

    def fail_on_repq(name, *args, **kwargs):
        if name == "repq":
            raise RuntimeError("the machine went away")
        return quant.evaluate_quantized(name, *args, **kwargs)

    monkeypatch.setattr(evaluate, "evaluate_quantized", fail_on_repq)
    with pytest.raises(RuntimeError):
        run_eval("--checkpoint", checkpoint, "--quant", "percentile", "repq", "--bits", "w8a8", "--out", out)
    assert set(json.load(open(out))["quant"]) == {"percentile"}


def test_results_of_other_weights_are_refused(checkpoint, tmp_path):
    out = str(tmp_path / "r.json")
    run_eval("--checkpoint", checkpoint, "--quant", "--out", out)
    payload = torch.load(checkpoint, weights_only=True)
    payload["model"] = {k: v + 1 if v.is_floating_point() else v for k, v in payload["model"].items()}
    other = str(tmp_path / "other.pt")
    torch.save(payload, other)
    with pytest.raises(ResultsError, match="another evaluation.*fingerprint"):
        run_eval("--checkpoint", other, "--quant", "--out", out)


# -- one error line per user error ------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["train.py", "optim.lr=-1"], "'optim.lr' must be > 0"),
    (["train.py", "sched.epochs=0"], "'sched.epochs' must be >= 1"),
    (["train.py", "train.batch_size=0"], "'train.batch_size' must be >= 1"),
    (["train.py", "--config", "BROKEN"], "not valid YAML"),
    (["train.py", "out_dir=FILE/run"], "cannot be used: Not a directory"),
    (["train.py", "out_dir=FILE"], "is a file, not a folder; choose another out_dir"),  # said "File exists"
    (["train.py", "out_dir=/dev/null"], "is a device, a pipe or a broken link, not a folder"),
])
def test_train_user_errors_are_one_error_line(tmp_path, argv, message, capsys):
    """train.py's __main__ in this process (a process of its own would import torch again: seconds each);
    the real process's exit status and stderr: test_a_corrupt_latest_checkpoint_is_one_error_line_with_the_
    command_that_continues (test_train.py) and test_the_whole_process_writes_one_line_and_exits_2."""
    broken, blocker = tmp_path / "broken.yaml", tmp_path / "file"
    broken.write_text("model: [vit\n")
    blocker.write_text("")
    argv = [a.replace("BROKEN", str(broken)).replace("FILE", str(blocker)) for a in argv]
    code, _, err = run_entry(argv[0], argv[1:], capsys)
    lines = err.strip().splitlines()
    assert code == 1 and lines[-1].startswith("error: ") and message in lines[-1], lines[-5:]
    assert not any("Traceback" in line for line in lines)


@pytest.mark.parametrize("extra, message", [
    (["--bits", "w4a4", "nonsense"], "'nonsense' is not of the form 'w4a4'"),
    (["--bits", "w0a4"], "bits must lie in 2..16"),
    (["--bits", "w33a4"], "bits must lie in 2..16"),
    (["--quant", "repqq"], "unknown quantization pipeline"),
    (["model.name=vit_micro"], "does not fit model 'vit_micro'"),
    (["--ema"], "has no 'model_ema' weights"),
    # the result's folder is refused naming the flag that chose it (it said "out_dir", evaluate.py's no option)
    (["--out", "FILE/r.json"], "is a file, not a folder; choose another --out"),
    # the log's own name: the log, opened first, was then refused as a result that is not JSON
    (["--out", "NEW/eval.log"], "evaluate.py writes its log to eval.log in the result's folder; give the result "
                                "another name"),
])
def test_evaluate_user_errors_are_one_error_line_before_any_work(checkpoint, tmp_path, capsys, extra, message):
    """evaluate.py's `__main__` run in this process (a process each would import torch again: seconds each);
    tests/test_evaluate.py::test_bad_inputs_are_clear_errors runs a refusal as a process."""
    out, blocker = tmp_path / "r.json", tmp_path / "file"
    blocker.write_text("")
    extra = [a.replace("FILE", str(blocker)).replace("NEW", str(tmp_path / "new")) for a in extra]
    given_out = [] if "--out" in extra else ["--out", str(out)]  # a flag given twice is refused
    code, _, err = run_entry("evaluate.py", ["--checkpoint", checkpoint, *given_out, *extra], capsys)
    lines = err.strip().splitlines()
    assert code == 1 and lines[-1].startswith("error: ") and message in lines[-1], lines[-5:]
    assert not any("Traceback" in line for line in lines)
    assert not out.exists() and not (tmp_path / "new").exists()  # nothing was evaluated, nothing written


def test_best_checkpoint_is_written_only_when_top1_improves(tmp_path):
    from engine.best_checkpoint import BestCheckpoint
    from engine.loop import TrainState

    written = []
    model = torch.nn.Linear(2, 2)
    best = BestCheckpoint(str(tmp_path / "best.pt"), model=model, ema=None, config={"a": 1},
                          classes=["x", "y"],
                          save=lambda payload_fn, path: written.append((payload_fn(), path)))
    state = TrainState()
    state.best_value = 50.0  # as restored from a checkpoint: the earlier run's best
    assert not best.offer(state, {"val/top1": 50.0}) and not written  # equal is not better
    assert best.offer(state, {"val/top1": 60.0}) and state.best_value == 60.0
    payload, path = written[-1]
    assert (path.endswith("best.pt") and payload["metrics"]["val/top1"] == 60.0
            and payload["classes"] == ["x", "y"])
    assert torch.equal(payload["model"]["weight"], model.weight) and "model_ema" not in payload
    assert not best.offer(state, {"val/top1": 55.0}) and len(written) == 1


def test_a_lower_is_better_score_keeps_the_lowest_and_names_its_epoch_and_update(tmp_path):
    """A language model's val/loss: best.pt is written for each new minimum only (a tie keeps the earlier
    weights), and best_epoch / best_step name the validation: the epoch in progress (1-based) for a mid-epoch
    one, the epoch just completed at an epoch end."""
    from engine.best_checkpoint import BestCheckpoint
    from engine.loop import TrainState

    written = []
    best = BestCheckpoint(str(tmp_path / "best.pt"), model=torch.nn.Linear(2, 2), ema=None, config={},
                          classes=None, save=lambda payload_fn, path: written.append(payload_fn()["metrics"]),
                          key="val/loss", higher_is_better=False)
    state = TrainState()
    offers = []
    for value, (epoch, epoch_batches, step) in zip([3.0, 2.5, 2.5, 2.7, 1.0],
                                                   [(0, 4, 2), (1, 0, 4), (1, 2, 5), (1, 4, 6), (2, 6, 11)]):
        state.epoch, state.epoch_batches, state.step = epoch, epoch_batches, step
        offers.append(best.offer(state, {"val/loss": value}))
    assert offers == [True, True, False, False, True] and [m["val/loss"] for m in written] == [3.0, 2.5, 1.0]
    assert (state.best_value, state.best_epoch, state.best_step) == (1.0, 3, 11)
    state.epoch, state.epoch_batches, state.step = 3, 0, 12  # an epoch end: epoch 3 just completed
    assert best.offer(state, {"val/loss": 0.5}) and (state.best_epoch, state.best_step) == (3, 12)


def test_a_script_output_under_a_file_is_refused_before_any_work(tmp_path):
    from engine.run_dir import RunDirError, refuse_existing_outputs
    (tmp_path / "afile").write_text("mine")
    with pytest.raises(RunDirError, match=r"cannot write under .*afile/x: .*afile is not a folder"):
        refuse_existing_outputs([str(tmp_path / "afile" / "x" / "out.json")], overwrite=False)
    refuse_existing_outputs([str(tmp_path / "new" / "deeper" / "out.json")], overwrite=False)  # made later
    assert (tmp_path / "afile").read_text() == "mine"


def test_a_table_script_never_writes_over_a_file_it_reads(tmp_path):
    """paper_table.py r.json --out r.json --overwrite replaced evaluate.py's result file with a table;
    compare_act_max.py --out <run>/eval_best_act_max --overwrite its input CSV."""
    import compare_act_max
    import paper_table

    result = tmp_path / "r.json"
    result.write_text(json.dumps({"model": "m", "method": "CD", "fp": {"top1": 80.0},
                                  "max_act": {"module": 1.0, "block": 1.0}, "quant": {}}))
    before = result.read_text()
    with pytest.raises(SystemExit, match=r"r.json is an input of this command and would be replaced"):
        paper_table.main([str(result), "--out", str(result), "--overwrite"])
    csv_path = tmp_path / "eval_best_act_max.csv"
    csv_path.write_text("name,kind,block,type,max\nblocks.0,block,0,block,2.0\n")
    with pytest.raises(SystemExit, match=r"eval_best_act_max.csv is an input of this command"):
        compare_act_max.main([f"a={csv_path}", "--out", str(tmp_path / "eval_best_act_max"), "--overwrite"])
    assert result.read_text() == before and csv_path.read_text().startswith("name,kind")


# -- run folders: claim_run_dir's decisions on hand-made folders (no training) ------------------------------

def _folder(path, files):
    """A folder holding `files` ({name: text}; a name ending in '/' is a folder), as an earlier run left it."""
    os.makedirs(path, exist_ok=True)
    for name, text in files.items():
        if name.endswith("/"):
            os.makedirs(os.path.join(path, name), exist_ok=True)
        else:
            os.makedirs(os.path.dirname(os.path.join(path, name)), exist_ok=True)
            with open(os.path.join(path, name), "wb" if isinstance(text, bytes) else "w") as f:
                f.write(text)


def _tree(path):
    """{relative path: text} of every file under `path` (folders by their files)."""
    out = {}
    for folder, _, names in os.walk(path):
        for name in names:
            full = os.path.join(folder, name)
            with open(full, errors="surrogateescape") as f:  # a file of another program may be no UTF-8 text
                out[os.path.relpath(full, path)] = f.read()
    return out


CONFIG = {"out_dir": "x", "optim": {"lr": 0.1}, "train": {"seed": 0, "max_steps": None}}
SAVED = "out_dir: x\noptim:\n  lr: 0.1\ntrain:\n  seed: 0\n  max_steps: null\n"  # CONFIG as config.yaml


@pytest.mark.parametrize("files, config, archive_existing, outcome", [
    ({}, CONFIG, False, "start"),
    # what a start that failed before its first logged update leaves: archived, whatever the config
    ({"train.log": "t", "config.yaml": SAVED, "tb/": ""}, {**CONFIG, "optim": {"lr": 9.0}}, False, "archived"),
    ({"train.log": "t", "config.yaml": SAVED, "metrics.jsonl": ""}, {**CONFIG, "optim": {"lr": 9.0}}, False,
     "archived"),
    # the same config restarting after a kill before its first checkpoint: archived; another config: refused
    ({"train.log": "t", "config.yaml": SAVED, "metrics.jsonl": "{}\n"}, CONFIG, False, "archived"),
    ({"train.log": "t", "config.yaml": SAVED, "metrics.jsonl": "{}\n"}, {**CONFIG, "optim": {"lr": 9.0}}, False,
     "refused"),
    # only paths and limits differ (ENVIRONMENT_KEYS): still the same run
    ({"config.yaml": SAVED, "metrics.jsonl": "{}\n"}, {**CONFIG, "out_dir": "y", "train": {"seed": 0, "max_steps": 3}},
     False, "archived"),
    # a result (best.pt) is never moved without archive_existing, even with the same config and no metrics
    ({"config.yaml": SAVED, "metrics.jsonl": "{}\n", "best.pt": "w"}, CONFIG, False, "refused"),
    ({"config.yaml": SAVED, "best.pt": "w"}, CONFIG, False, "refused"),
    ({"notes.txt": "mine"}, CONFIG, False, "refused"),
    ({"notes.txt": "mine", "best.pt": "w", "snapshots/": ""}, CONFIG, True, "archived"),
    # the write probe of another process (evaluate.py writing into the folder at that instant) is not an earlier
    # run's file: neither refused nor moved away from under its writer
    ({".write_test.4242": "ok"}, CONFIG, False, "start"),
    # a file of that prefix that is not a probe's name (.write_test.<pid>) is a file like any other
    ({".write_test.notes": "mine"}, CONFIG, False, "refused"),
    # checkpoint.pt: the run resumes, nothing is moved (archive_existing or not)
    ({"checkpoint.pt": "c", "best.pt": "w", "notes.txt": "mine"}, {**CONFIG, "optim": {"lr": 9.0}}, True, "start"),
])
def test_claiming_a_folder_starts_archives_or_refuses_as_the_rules_say(tmp_path, files, config, archive_existing,
                                                                      outcome):
    """The decision table of engine/run_dir.py's docstring, on folders made by hand: what is moved goes whole
    to archive/<time>/ (an earlier archive stays where it is), and nothing is ever deleted."""
    from engine.run_dir import claim_run_dir

    out = str(tmp_path / "run")
    _folder(out, {**files, "archive/20000101-000000/best.pt": "older"})
    before = _tree(out)
    if outcome == "refused":
        with pytest.raises(RunDirError, match="holds files of an earlier run"):
            with claim_run_dir(out, config, archive_existing):
                pass
        assert _tree(out) == before
        return
    with claim_run_dir(out, config, archive_existing):
        assert os.path.exists(os.path.join(out, ".run.lock"))
    after = _tree(out)
    if outcome == "start":
        assert after == before
        return
    moved = [a for a in os.listdir(os.path.join(out, "archive")) if a != "20000101-000000"]
    assert len(moved) == 1
    expected = {"archive/20000101-000000/best.pt": "older",
                **{f"archive/{moved[0]}/{name}": text for name, text in before.items() if "/" not in name}}
    assert after == expected  # every file moved, the earlier archive untouched, nothing else left
    assert sorted(os.listdir(os.path.join(out, "archive", moved[0]))) == sorted(n.rstrip("/") for n in files)



@pytest.mark.parametrize("files", [
    {"config.yaml": "optim:\n  lr: 0.1\n"},  # a recipe of the user's: some sections, not a run's whole config
    {"config.yaml": "optim:\n  lr: 0.1\n", "train.log": "t", "tb/": ""},
    {"config.yaml": "- a list\n"},  # YAML, but no mapping
    {"config.yaml": "out_dir: [unclosed\n"},  # not YAML
    {"config.yaml": "out_dir: x\noptim: 0.1\ntrain:\n  seed: 0\n"},  # a run's keys, a section that is no mapping
    # another program's, in Latin-1: no UTF-8 text (before, a UnicodeDecodeError traceback, also with archive_existing)
    {"config.yaml": b"name: caf\xe9\n"},
])
def test_a_config_yaml_that_no_run_wrote_is_refused_naming_it_and_never_moved(tmp_path, files):
    """A folder holding only a config.yaml (with or without start logs) looked like a start that failed before its
    first update and was moved to archive/<time>/ without asking, though the user wrote it. A run dumps its whole
    config (every section of CONFIG): a file of other top-level keys is refused, naming it, and stays."""
    from engine.run_dir import claim_run_dir

    out = str(tmp_path / "run")
    _folder(out, files)
    before = _tree(out)
    with pytest.raises(RunDirError, match=r"holds config.yaml, which is not a config train.py writes .*move "
                                          r"config.yaml out of the folder, or use another out_dir") as refused:
        with claim_run_dir(out, CONFIG, archive_existing=False):
            pass
    assert "\n" not in str(refused.value)
    assert _tree(out) == before and not os.path.exists(os.path.join(out, "archive"))
    with pytest.raises(RunDirError, match="holds files of an earlier run"):  # beside a result: the files are named
        _folder(out, {"best.pt": "w"})
        with claim_run_dir(out, CONFIG, archive_existing=False):
            pass
    with claim_run_dir(out, CONFIG, archive_existing=True):  # asked for: everything is moved, nothing deleted
        pass
    assert os.listdir(out) == ["archive"]

def test_archives_made_in_the_same_second_never_share_a_folder(tmp_path, monkeypatch):
    import datetime as real_datetime

    import engine.run_dir as run_dir

    class Frozen(real_datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2030, 1, 2, 3, 4, 5)

    monkeypatch.setattr(run_dir.datetime, "datetime", Frozen)
    out = str(tmp_path / "run")
    for i in range(3):
        _folder(out, {"best.pt": f"run {i}"})
        run_dir.archive(out, ["best.pt"])
    assert _tree(out) == {"archive/20300102-030405/best.pt": "run 0", "archive/20300102-030405-1/best.pt": "run 1",
                          "archive/20300102-030405-2/best.pt": "run 2"}


def test_each_config_change_at_one_step_is_kept_and_an_unchanged_config_keeps_nothing(tmp_path):
    out = str(tmp_path / "c")
    os.makedirs(out)
    for lr in (0.1, 0.1, 0.2, 0.3, 0.4):  # the second save is the same config: nothing to keep
        save_config_history(out, {"optim": {"lr": lr}}, step=3)
    import yaml

    kept = {n: yaml.safe_load(open(os.path.join(out, n)))["optim"]["lr"] for n in os.listdir(out)}
    assert kept == {"config.until_step3.yaml": 0.1, "config.until_step3.2.yaml": 0.2,
                    "config.until_step3.3.yaml": 0.3, "config.yaml": 0.4}


@pytest.mark.parametrize("hard_links", [True, False], ids=["hard_links", "no_hard_links"])
def test_a_link_leading_nowhere_at_a_name_a_run_keeps_a_file_under_is_never_written_over(tmp_path, monkeypatch,
                                                                                        hard_links):
    """A snapshot (snapshots/epoch<E>.pt) or a kept file (best.until_step<N>.pt) is given a name no file holds; a
    symbolic link of the user's there whose target is gone (a disk not mounted) held no file by os.path.exists, and
    was replaced: by the copy of a file system without hard links, and by os.link's EEXIST taken for one."""
    from engine.run_dir import keep_as_until_step
    from engine.snapshots import keep_snapshot

    if not hard_links:
        def no_link(*args, **kwargs):
            raise OSError(errno.EPERM, "Operation not permitted")
        monkeypatch.setattr(os, "link", no_link)
    checkpoint, best = str(tmp_path / "checkpoint.pt"), str(tmp_path / "best.pt")
    for path in (checkpoint, best):
        with open(path, "wb") as f:
            f.write(b"weights")
    os.makedirs(tmp_path / "snapshots")
    links = {str(tmp_path / "snapshots" / "epoch0001.pt"): "/gone/epoch0001.pt",
             str(tmp_path / "best.until_step3.pt"): "/gone/best.until_step3.pt"}
    for link, target in links.items():
        os.symlink(target, link)
    snapshot = keep_snapshot(checkpoint, 1, True, torch.device("cpu"))
    kept = keep_as_until_step(best, 3)
    assert os.path.basename(snapshot) == "epoch0001-1.pt" and read_bytes(snapshot) == b"weights"
    assert os.path.basename(kept) == "best.until_step3.2.pt" and read_bytes(kept) == b"weights"
    assert {link: os.readlink(link) for link in links} == links
    # best.pt itself such a link when a resume finds it is no best of the run's: moved aside, not written over later
    from engine.best_checkpoint import BestCheckpoint

    os.symlink("/gone/best.pt", best)
    matcher = BestCheckpoint(best, model=torch.nn.Linear(2, 2), ema=None, config={}, classes=None,
                             save=lambda payload_fn, target: None)
    moved = matcher.match_file(TrainState(step=4, best_value=40.0, best_step=2), True, torch.device("cpu")).kept
    assert moved == str(tmp_path / "best.until_step4.pt") and os.readlink(moved) == "/gone/best.pt"


def test_a_config_yaml_write_that_fails_leaves_the_old_one_in_place_and_no_temporary(tmp_path, monkeypatch):
    """A full disk when a resume with new settings writes config.yaml. Before, the old config.yaml had been moved
    aside (config.until_step3.yaml) before the write, whose half-written temporary stayed, and train.py ended in an
    OSError traceback instead of an error: line."""
    import engine.run_dir as run_dir

    out = str(tmp_path / "c")
    os.makedirs(out)
    save_config_history(out, {"optim": {"lr": 0.1}}, step=0)
    before = read_bytes(os.path.join(out, "config.yaml"))

    def full_disk(config, f, **options):
        f.write("optim:\n")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(run_dir, "dump_yaml", full_disk)
    with pytest.raises(RunDirError, match=r"could not write .*config\.yaml: the disk is full .* re-run the same"):
        save_config_history(out, {"optim": {"lr": 0.2}}, step=3)
    assert os.listdir(out) == ["config.yaml"] and read_bytes(os.path.join(out, "config.yaml")) == before


def test_only_settings_that_change_what_a_run_computes_count_as_changed():
    """config_changes / start_only_changes / recipe against hand-written lists: paths, limits, logging and the
    quant section may change on resume (ENVIRONMENT_KEYS, 'log.*' and 'quant.*' as wildcards), free-form
    dicts compare whole, the seed is not part of a recipe."""
    from engine.run_dir import config_changes, recipe, start_only_changes

    saved = {"out_dir": "a", "model": {"name": "vit", "pretrained": "", "kwargs": {"depth": 2}},
             "optim": {"lr": 0.1}, "cd": {"lam_per_role": {"fc2": 1.0}},
             "train": {"seed": 0, "max_steps": None, "archive_existing": False, "keep_every_epochs": 0},
             "log": {"tensorboard": True, "act_max": False}, "quant": {"bits": ["w4a4"], "aphq": {"iters": 5}}}
    current = {"out_dir": "b", "model": {"name": "vit", "pretrained": "w.pt", "kwargs": {"depth": 3}},
               "optim": {"lr": 0.2}, "cd": {"lam_per_role": {"fc2": 2.0}},
               "train": {"seed": 1, "max_steps": 4, "archive_existing": True, "keep_every_epochs": 1},
               "log": {"tensorboard": False, "act_max": True}, "quant": {"bits": ["w3a3"], "aphq": {"iters": 9}}}
    assert config_changes(saved, current) == ["cd.lam_per_role: {'fc2': 1.0} -> {'fc2': 2.0}",
                                              "model.kwargs: {'depth': 2} -> {'depth': 3}",
                                              "optim.lr: 0.1 -> 0.2", "train.seed: 0 -> 1"]
    assert start_only_changes(saved, current) == ["model.pretrained: '' -> 'w.pt'",
                                                  "train.archive_existing: False -> True"]
    assert recipe(current) == {"model.name": "vit", "model.kwargs": {"depth": 3}, "optim.lr": 0.2,
                               "cd.lam_per_role": {"fc2": 2.0}}


@pytest.mark.parametrize("key, old, new", [
    ("model.pretrained", "", "w.pt"), ("model.pretrained_strict", True, False),
    ("train.archive_existing", False, True)])
def test_each_setting_only_a_start_reads_is_a_start_only_change(key, old, new):
    """docs/operations.md names the settings only a run's start reads: model.pretrained, model.pretrained_strict
    and train.archive_existing. None of them counts as a computed change (a resume may not read them at all), so
    each must be listed by start_only_changes, or a changed value would be ignored on resume without a word."""
    from engine.run_dir import config_changes, start_only_changes

    section, name = key.split(".")
    saved, current = {section: {name: old}}, {section: {name: new}}
    assert config_changes(saved, current) == []
    assert start_only_changes(saved, current) == [f"{key}: {old!r} -> {new!r}"]


@pytest.mark.parametrize("key, old, new", [
    ("train.eval_every_epochs", 1, 5), ("train.eval_every_steps", 0, 250), ("train.log_every_steps", 50, 10),
    ("train.ckpt_every_steps", 0, 100), ("train.divergence_factor", 3.0, None), ("train.divergence_windows", 3, 5),
    ("train.eval_batch_size_per_gpu", 256, 64), ("train.batch_size_per_gpu", 8, 4), ("train.device", "auto", "cpu"),
    ("train.compile", False, True),
    ("data.num_workers", 8, 2), ("data.timeout", None, 60.0), ("data.pin_memory", True, False)])
def test_when_a_run_reports_checks_and_where_it_runs_may_change_on_resume(key, old, new):
    """How often a run validates, logs and writes checkpoint.pt, its divergence guard, its eval batch, the split of
    its global batch into per-process batches, device, compilation and data loader workers change nothing an update
    computes: a resume may change them."""
    from engine.run_dir import config_changes

    section, name = key.split(".")
    assert config_changes({section: {name: old}, "optim": {"lr": 0.1}},
                          {section: {name: new}, "optim": {"lr": 0.1}}) == []


@pytest.mark.parametrize("archive_existing", [False, True])
def test_a_roll_back_to_the_folders_own_snapshot_without_checkpoint_pt_is_claimed_as_it_is(tmp_path,
                                                                                         archive_existing):
    """checkpoint.pt moved away (the unusable-checkpoint error's advice), then train.resume=<its snapshot>: the
    folder was refused as another run's, and with train.archive_existing=true its snapshots were archived with
    the rest, the one to resume from included (then 'no such file'). A resume from anywhere else still counts
    as a fresh start in that folder."""
    from engine.run_dir import claim_run_dir

    out = str(tmp_path / "run")
    _folder(out, {"best.pt": "w", "metrics.jsonl": "{}\n", "config.yaml": SAVED, "snapshots/epoch0001.pt": "s",
                  "archive/1/checkpoint.pt": "c"})
    before = _tree(out)
    own = {**CONFIG, "train": {**CONFIG["train"], "resume": os.path.join(out, "snapshots", "epoch0001.pt")}}
    with claim_run_dir(out, own, archive_existing):
        pass
    assert _tree(out) == before
    (tmp_path / "elsewhere.pt").write_text("c")
    for resume in (str(tmp_path / "elsewhere.pt"), os.path.join(out, "archive", "1", "checkpoint.pt")):
        other = {**CONFIG, "optim": {"lr": 9.0}, "train": {**CONFIG["train"], "resume": resume}}
        with pytest.raises(RunDirError, match="holds files of an earlier run"):
            with claim_run_dir(out, other, False):
                pass
        assert _tree(out) == before


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_folder_where_a_script_writes_a_file_is_refused_even_with_overwrite(tmp_path, overwrite):
    """compare_act_max.py --out X --overwrite, with a folder named X.csv, ended in an IsADirectoryError
    traceback after the inputs were read; the folder and what it holds stay as they were."""
    from engine.run_dir import RunDirError, refuse_existing_outputs
    (tmp_path / "o.csv").mkdir()
    (tmp_path / "o.csv" / "mine.txt").write_text("mine")
    with pytest.raises(RunDirError, match=r"o.csv is a folder, where this command writes a file"):
        refuse_existing_outputs([str(tmp_path / "o.png"), str(tmp_path / "o.csv")], overwrite=overwrite)
    assert (tmp_path / "o.csv" / "mine.txt").read_text() == "mine"
    # an output folder (gpu_check.py's logs): an existing one is replaced only with --overwrite, a file never
    folder = str(tmp_path / "o.csv")
    if overwrite:
        refuse_existing_outputs([str(tmp_path / "o.json")], overwrite, folders=[folder])
    else:
        with pytest.raises(RunDirError, match=r"o.csv already exist\(s\); .* add --overwrite"):
            refuse_existing_outputs([str(tmp_path / "o.json")], overwrite, folders=[folder])
    (tmp_path / "logs").write_text("mine")
    with pytest.raises(RunDirError, match=r"logs is a file, where this command writes a folder"):
        refuse_existing_outputs([str(tmp_path / "o.json")], overwrite, folders=[str(tmp_path / "logs")])


def test_a_roll_back_to_before_the_first_validation_keeps_the_abandoned_best(tmp_path):
    """A resume point with no validation yet (a snapshot of epoch 1 under train.eval_every_epochs=2) and a best.pt
    written later by the branch it abandons: best.pt is kept as best.until_step<N>.pt, as after any roll-back,
    before the resumed run's first validation writes best.pt afresh. The check used to be skipped when the
    resume point had no best score, and that validation overwrote the abandoned branch's best.pt."""
    from engine.best_checkpoint import BestCheckpoint

    path = tmp_path / "best.pt"
    torch.save({"model": {}, "config": {}, "state": TrainState(step=8, best_value=40.0, best_step=8).state_dict()},
               path)
    abandoned = read_bytes(path)
    best = BestCheckpoint(str(path), model=torch.nn.Linear(2, 2), ema=None, config={}, classes=None,
                          save=lambda payload_fn, target: None)
    state = TrainState(step=4)  # resumed at update 4, before any validation
    kept = best.match_file(state, True, torch.device("cpu")).kept
    assert kept == str(tmp_path / "best.until_step4.pt") and read_bytes(kept) == abandoned and not path.exists()
    assert (state.best_value, state.best_step) == (None, 0)
    assert best.match_file(TrainState(step=4), True, torch.device("cpu")).kept is None  # no best.pt: nothing to keep


def test_a_best_pt_of_another_update_clears_the_whole_best_score_of_the_resume_point(tmp_path):
    """The resume point's own best (epoch 1, update 3) does not describe a best.pt written at update 8 of the
    branch it abandons: that file is kept aside unchanged, and the score, its epoch and its update are all
    cleared (a checkpoint written before the next validation names no epoch and update of a best.pt gone)."""
    from engine.best_checkpoint import BestCheckpoint

    path = tmp_path / "best.pt"
    abandoned_state = TrainState(step=8, best_value=70.0, best_step=8).state_dict()
    torch.save({"model": {}, "config": {}, "state": abandoned_state}, path)
    abandoned = read_bytes(path)
    best = BestCheckpoint(str(path), model=torch.nn.Linear(2, 2), ema=None, config={}, classes=None,
                          save=lambda payload_fn, target: None)
    state = TrainState(step=5, best_value=50.0, best_epoch=1, best_step=3)
    kept = best.match_file(state, True, torch.device("cpu")).kept
    assert kept == str(tmp_path / "best.until_step5.pt") and read_bytes(kept) == abandoned
    assert not path.exists() and (state.best_value, state.best_epoch, state.best_step) == (None, 0, 0)


def test_a_path_is_inside_a_folder_only_below_it_not_beside_it_with_the_same_prefix(tmp_path):
    """is_inside decides whether train.resume names the folder's own snapshot (a roll-back, never archived):
    out_dir/snapshots_old/ shares the prefix of out_dir/snapshots but is another folder; a link resolves."""
    from engine.run_dir import is_inside

    snapshots = tmp_path / "snapshots"
    for folder in (snapshots, tmp_path / "snapshots_old", tmp_path / "elsewhere"):
        folder.mkdir()
    (snapshots / "epoch0001.pt").write_bytes(b"x")
    (tmp_path / "snapshots_old" / "epoch0001.pt").write_bytes(b"x")
    os.symlink(snapshots / "epoch0001.pt", tmp_path / "elsewhere" / "link.pt")
    assert is_inside(str(snapshots / "epoch0001.pt"), str(snapshots))
    assert not is_inside(str(tmp_path / "snapshots_old" / "epoch0001.pt"), str(snapshots))
    assert is_inside(str(tmp_path / "elsewhere" / "link.pt"), str(snapshots))
    assert not is_inside(str(tmp_path), str(snapshots))

def test_best_pt_of_a_run_with_ema_holds_the_averaged_weights_beside_the_raw_ones(tmp_path):
    """evaluate.py --ema reads best.pt's model_ema: with train.ema on, best.pt holds the EMA's weights (not the
    raw ones again) under model_ema, and the raw weights under model."""
    from timm.utils import ModelEmaV3

    from engine.best_checkpoint import BestCheckpoint
    from engine.loop import TrainState

    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    ema = ModelEmaV3(model, decay=0.5)
    with torch.no_grad():
        model.weight.add_(1.0)  # the raw weights move on; the average is half-way (decay 0.5, no warmup)
    ema.update(model, step=10)
    want_ema = {k: v.clone() for k, v in ema.module.state_dict().items()}
    assert not torch.equal(want_ema["weight"], model.weight)
    written = []
    best = BestCheckpoint(str(tmp_path / "best.pt"), model=model, ema=ema, config={}, classes=None,
                          save=lambda payload_fn, path: written.append(payload_fn()))
    assert best.offer(TrainState(step=10), {"val/top1": 1.0})
    payload = written[0]
    assert torch.equal(payload["model"]["weight"], model.weight)
    for key, value in want_ema.items():
        assert torch.equal(payload["model_ema"][key], value), key


def test_a_resume_keeps_the_best_score_of_the_best_pt_it_wrote(tmp_path):
    """The same command resumed: best.pt was written at the checkpoint's best_step, so it stays where it is and
    the score stays the one to beat (a worse validation after the resume must not overwrite it)."""
    from engine.best_checkpoint import BestCheckpoint

    path = tmp_path / "best.pt"
    torch.save({"model": {}, "config": {}, "state": TrainState(step=6, best_value=60.0, best_step=6).state_dict()},
               path)
    before = read_bytes(path)
    written = []
    best = BestCheckpoint(str(path), model=torch.nn.Linear(2, 2), ema=None, config={}, classes=None,
                          save=lambda payload_fn, target: written.append(target))
    state = TrainState(step=9, best_value=60.0, best_epoch=2, best_step=6)  # checkpoint.pt, 3 updates later
    assert best.match_file(state, True, torch.device("cpu")).kept is None
    assert (state.best_value, state.best_epoch, state.best_step) == (60.0, 2, 6) and read_bytes(path) == before
    assert not best.offer(state, {"val/top1": 55.0}) and not written
    assert sorted(os.listdir(tmp_path)) == ["best.pt"]



def test_a_resume_into_a_new_folder_refused_on_its_checkpoint_leaves_no_folder(debug_config, tmp_path):
    """train.resume=PATH into a new out_dir, refused on the checkpoint file itself: missing, without the EMA this run
    keeps, of model.drop's earlier meaning, or holding weights that do not fit the model of its config. These came
    after out_dir was claimed, leaving a new folder with train.log; now before it, and the resume still runs."""
    train.main(debug_config("train.max_steps=2", name="a"))
    payload = torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=True)
    old = {**payload, "config": {**payload["config"], "model": {**payload["config"]["model"], "drop": 0.1}}}
    del old["model_drop_sites"]  # written when model.drop was timm's classifier-head dropout
    torch.save(old, tmp_path / "old.pt")
    torch.save({**payload, "model": {k: v for k, v in payload["model"].items() if k != "cls_token"}},
               tmp_path / "misfit.pt")
    for name, (resume, *overrides), error, message in (
            ("b", ("none.pt",), CheckpointError, r"none.pt: no such file"),
            ("c", ("a/checkpoint.pt", "train.ema=true", "train.allow_changed_config=true"), CheckpointError,
             r"written without an EMA of the weights"),
            ("d", ("old.pt", "model.drop=0.1"), CheckpointError, r"as timm's classifier-head dropout"),
            ("e", ("misfit.pt",), CheckpointError, r"its weights do not fit the model of its own config .*cls_token")):
        with pytest.raises(error, match=message):
            train.main(debug_config(f"train.resume={tmp_path / resume}", *overrides, name=name))
        assert not (tmp_path / name).exists(), name
    out = train.main(debug_config(f"train.resume={tmp_path / 'a' / 'checkpoint.pt'}", "train.max_steps=3", name="f"))
    assert out.state.step == 3


def test_a_fine_tune_refused_on_its_model_pretrained_file_leaves_no_folder(debug_config, tmp_path):
    """model.pretrained missing, or of another architecture (a 2-block run's weights into 3 blocks), was refused by
    the model's build after out_dir was claimed: the refused start left a new folder holding train.log. Refused
    before the claim now; a fitting file still loads, its line logged once."""
    train.main(debug_config("train.max_steps=1", name="a"))
    weights = tmp_path / "a" / "best.pt"
    for name, overrides, message in (("b", (f"model.pretrained={tmp_path / 'none.pt'}",), r"none.pt is no such file"),
                                     ("c", (f"model.pretrained={weights}", "model.kwargs.depth=3"),
                                      r"best.pt does not fit VisionTransformer: missing \['blocks.2.")):
        with pytest.raises(ModelError, match=message):
            train.main(debug_config(*overrides, name=name))
        assert not (tmp_path / name).exists(), name
    train.main(debug_config(f"model.pretrained={weights}", "train.max_steps=1", name="d"))
    assert (tmp_path / "d" / "train.log").read_text().count(f"loaded {weights}") == 1

"""A sweep file edited since its runs trained or were evaluated is refused with --run before anything starts.

train.py continues a run's checkpoint.pt only with the settings it was written with, and evaluate.py adds to a result
file only entries computed with the settings it holds: a changed cd.lam, or a quant.calib_images added to the sweep's
'evaluate' list, was refused at that run's turn, after the runs before it had trained or validated and been evaluated
again (and after evaluate.py had loaded the model), with advice (--out, out_dir) that a sweep does not take; the later
runs were not started. The sweep refuses such a run up front in one line, in its own terms; --recompute passes
evaluate.py's --recompute on to the runs whose result file disagrees. The reference for each refusal is train.py's
and evaluate.py's own: what the sweep refuses, they refuse, and what it lets through, they take (but for the updates
per epoch of a run whose settings that size its training data changed: train.py counts them once it has read the data,
and refuses them at the run's turn)."""
import logging
import os
import shutil

import pytest
import torch

import evaluate
import train
from configs import ConfigError, load_config
from engine.checkpoint import CheckpointError
from engine.eval_results import ResultsError
from engine.run_dir import RunDirError
from tests.conftest import DEBUG_CONFIG, ROOT
from tests.sweep_refusals import refused_at_start

import sweep  # noqa: E402  (scripts/, on the path of the tests)

ITEMS = ["sched.epochs=1", "sched.warmup_epochs=0", "log.tensorboard=false"]  # run 'a' as it trained
EVALUATED = ["quant.pipelines=[rtn,percentile]", "quant.calib_images=8"]  # its evaluation as it is in the file


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """out_root with run 'a' trained (tiny.yaml, 4 updates) and evaluated (rtn and percentile, 8 calibration
    images) into its eval_best.json, as a sweep of it leaves them."""
    root = tmp_path_factory.mktemp("sweep")
    folder = root / "runs" / "a"
    train.main(load_config([DEBUG_CONFIG], [*ITEMS, f"out_dir={folder}"]))
    evaluate.main(evaluate.parse_args(["--checkpoint", str(folder / "best.pt"), "--out",
                                       str(folder / "eval_best.json"), *EVALUATED]))
    return root


def sweep_file(root, path, items=ITEMS, evaluated=EVALUATED, before=False) -> str:
    """A sweep of run 'a' (with `items`, evaluated with `evaluated`) in root/runs; `before`: a run 'b' first."""
    runs = (f"  b: [{', '.join(ITEMS)}]\n" if before else "") + f"  a: [{', '.join(items)}]\n"
    path.write_text(f"configs: [configs/debug/tiny.yaml]\nout_root: {root / 'runs'}\n"
                    f"evaluate: [{', '.join(repr(e) for e in evaluated)}]\nruns:\n{runs}")
    return str(path)


@pytest.mark.parametrize("evaluated, says", [
    (["quant.pipelines=[percentile]", "quant.calib_images=16"], "percentile w4a4 computed with other settings "
                                                               "(calibration.images 8 -> 16)"),
    (["quant.pipelines=[rtn]", "quant.rtn.symmetric=true"], "rtn w4a16 computed with other settings "
                                                            "(options.symmetric False -> True)"),
    ([*EVALUATED, "quant.act_max_extra_modules=[head]"], "activation maxima over quant.act_max_extra_modules=[]"),
], ids=["calibration", "option", "maxima"])
def test_an_evaluation_setting_changed_since_is_refused_before_anything_starts(trained, tmp_path, capsys,
                                                                                evaluated, says):
    folder = trained / "runs" / "a"
    log = (folder / "train.log").stat()
    message = refused_at_start(sweep_file(trained, tmp_path / "s.yaml", evaluated=evaluated, before=True))
    assert f"{folder / 'eval_best.json'} holds {says}" in message
    assert "give the sweep --recompute" in message and "--out" not in message
    # nothing ran: run b not started, run a not validated again
    assert not (trained / "runs" / "b").exists() and (folder / "train.log").stat() == log
    assert capsys.readouterr().out == ""
    with pytest.raises(ResultsError, match="--recompute"):  # evaluate.py's own refusal of that command
        evaluate.main(evaluate.parse_args(["--checkpoint", str(folder / "best.pt"), "--out",
                                           str(folder / "eval_best.json"), *evaluated]))


@pytest.mark.parametrize("evaluated", [EVALUATED, ["quant.pipelines=[rtn]"],
                                       ["quant.pipelines=[percentile]", "quant.calib_images=8", "quant.bits=[w8a8]"]],
                         ids=["same", "fewer", "other bits"])
def test_an_evaluation_that_adds_to_the_file_is_not_refused_and_gets_no_recompute(trained, tmp_path, evaluated):
    """Settings alike, or entries the file does not hold yet (other bit-widths): evaluate.py adds to it."""
    runs = sweep.expand(sweep_file(trained, tmp_path / "s.yaml", evaluated=evaluated), [])
    sweep.plan_changed_evaluations(runs, recompute=False, world_size=1, sweep_path="s.yaml")
    sweep.plan_changed_evaluations(runs, recompute=True, world_size=1, sweep_path="s.yaml")
    (_, evaluation) = sweep.commands(runs[0], "", evaluate=True)
    assert "--recompute" not in evaluation
    folder = trained / "runs" / "a"
    evaluate.main(evaluate.parse_args(evaluation[evaluation.index("evaluate.py") + 1:]))  # takes it
    assert (folder / "eval_best.json").exists()


def test_recompute_reaches_the_evaluate_command_of_a_run_whose_file_disagrees_only(trained, tmp_path):
    path = sweep_file(trained, tmp_path / "s.yaml", evaluated=["quant.pipelines=[percentile]", "quant.calib_images=16"],
                      before=True)
    runs = sweep.expand(path, [])
    with pytest.raises(ConfigError, match="sweep run 'a'"):
        sweep.plan_changed_evaluations(runs, recompute=False, world_size=1, sweep_path=path)
    sweep.plan_changed_evaluations(runs, recompute=True, world_size=1, sweep_path=path)
    evaluations = {run["name"]: sweep.commands(run, "", evaluate=True)[1] for run in runs}
    assert "--recompute" in evaluations["a"] and "--recompute" not in evaluations["b"]  # b: no result file


@pytest.mark.parametrize("flags", [["--recompute"], ["--recompute", "--evaluate"], ["--recompute", "--run"]])
def test_recompute_without_run_and_evaluate_is_refused(trained, tmp_path, capsys, flags):
    """The files are read where the commands run: a printed command would carry it for no reason known."""
    with pytest.raises(SystemExit) as stop:
        sweep.main([sweep_file(trained, tmp_path / "s.yaml"), *flags])
    assert stop.value.code == 2  # a usage error, as argparse's
    out, message = capsys.readouterr()
    assert message.startswith("error: ") and ": --recompute " in message and message.count("\n") == 1
    assert out == ""


@pytest.mark.parametrize("changed, says", [
    ("optim.lr=0.01", "optim.lr: None -> 0.01"),
    ("cd.enabled=true", "cd.enabled: False -> True"),
])
def test_a_training_setting_changed_since_is_refused_before_anything_starts(trained, tmp_path, capsys, changed, says):
    folder = trained / "runs" / "a"
    log = (folder / "train.log").stat()
    message = refused_at_start(sweep_file(trained, tmp_path / "s.yaml", items=[*ITEMS, changed], before=True))
    assert "train.py would refuse it at its start" in message and says in message
    assert f"another out_root in {tmp_path / 's.yaml'}" in message
    assert not (trained / "runs" / "b").exists() and (folder / "train.log").stat() == log
    assert capsys.readouterr().out == ""
    with pytest.raises(CheckpointError, match="written with other settings"):  # train.py's own refusal
        train.main(load_config([DEBUG_CONFIG], [*ITEMS, changed, f"out_dir={folder}"]))


def copied_run(trained, root):
    """root/runs/a: a copy of the trained run 'a' (its files' times kept: its result file is not older than best.pt),
    for a test whose train.py reference writes to the run's folder."""
    shutil.copytree(trained / "runs" / "a", root / "runs" / "a")
    return root / "runs" / "a"


LONGER = ["sched.epochs=2", "sched.warmup_epochs=0", "log.tensorboard=false", "train.allow_changed_config=true"]


# environment: train.max_steps may always change; 4 is run a's length (a stop beyond it train.py refuses at its start).
# more data: 128 samples in batches of 32 are 4 updates per epoch, as the checkpoint's 64 in batches of 16 (the
# checkpoint's count of 64 in batches of 32 would be 2, which the sweep refused though train.py continued the run)
# allowed: a finished run takes a changed validation setting (a changed training setting would act on no update:
# train.py refuses it, tests/test_resume_nothing_to_train.py)
@pytest.mark.parametrize("items", [ITEMS, [*ITEMS, "data.synthetic_val_size=32", "train.allow_changed_config=true"],
                                   [*ITEMS, "train.max_steps=4"], LONGER,
                                   [*LONGER, "data.synthetic_train_size=128", "train.batch_size=32",
                                    "train.batch_size_per_gpu=16"]],
                         ids=["same", "allowed", "environment", "longer schedule", "more data, larger batch"])
def test_settings_train_py_continues_with_are_not_refused(trained, tmp_path, caplog, items):
    """...nor announced: the sweep printed train.py's "resuming with changed settings" before any run had started
    (the run it named was not the next to run), and train.py printed it again at that run's resume. The reference is
    train.py's resume of the run's own command, which counts the run's data and continues the checkpoint."""
    root = tmp_path / "copy"
    folder = copied_run(trained, root)
    runs = sweep.expand(sweep_file(root, tmp_path / "s.yaml", items=items), [])
    with caplog.at_level(logging.WARNING):
        sweep.refuse_changed_training_settings(runs, "s.yaml", world_size=1)
    assert "resuming with changed settings" not in caplog.text
    assert runs[0]["overrides"][-1] == f"out_dir={folder}"
    with caplog.at_level(logging.INFO):
        train.main(load_config([DEBUG_CONFIG], runs[0]["overrides"]))  # continues
    assert f"resumed from {folder / 'checkpoint.pt'} at epoch 1, update 4" in caplog.text
    assert ("resuming with changed settings" in caplog.text) == ("train.allow_changed_config=true" in items)


# train.allow_changed_config=true takes the changed settings; the run's length and layout must still continue the
# checkpoint's 4 updates (1 epoch of 4 updates: 64 samples, 8 per process, 2 accumulation steps)
@pytest.mark.parametrize("items, says", [
    (["sched.steps=3", "log.tensorboard=false", "train.allow_changed_config=true"],
     "is at update 4, beyond the 3 updates of this run's schedule (sched.steps=3)"),
    ([*ITEMS, "train.batch_size=32", "train.batch_size_per_gpu=16", "train.allow_changed_config=true"],
     "is at update 4, beyond the 2 updates of this run's schedule (sched.epochs=1, 2 updates each)"),
    ([*ITEMS, "train.batch_size=8", "sched.min_lr=1e-6", "train.allow_changed_config=true"],
     "this run has 1 process(es) x 8 per process x 1 accumulation step(s), 8 updates per epoch"),
    # the data settings as they were (data.pin_memory: how batches are copied), so the checkpoint's count is the run's
    ([*ITEMS, "data.pin_memory=false", "train.batch_size=32", "train.batch_size_per_gpu=16",
      "train.allow_changed_config=true"], "is at update 4, beyond the 2 updates of this run's schedule"),
    (["sched.epochs=2", "sched.warmup_epochs=0", "log.tensorboard=false", "data.pin_memory=false",
      "train.batch_size=32", "train.batch_size_per_gpu=16", "train.allow_changed_config=true"],
     "this run has 1 process(es) x 16 per process x 2 accumulation step(s), 2 updates per epoch of 64"),
    # data settings changed that do not size the training data (the validation set, the targets' smoothing): the
    # checkpoint's count of 64 is still the run's, and the sweep counts its updates from it (before, any changed data
    # setting left them to train.py, which refused the run at its turn)
    ([*ITEMS, "data.synthetic_val_size=32", "train.batch_size=32", "train.batch_size_per_gpu=16",
      "train.allow_changed_config=true"], "is at update 4, beyond the 2 updates of this run's schedule"),
    ([*ITEMS, "data.label_smoothing=0.0", "train.batch_size=32", "train.batch_size_per_gpu=16",
      "train.allow_changed_config=true"], "is at update 4, beyond the 2 updates of this run's schedule"),
], ids=["shorter schedule", "larger batch", "smaller batch", "larger batch, data environment",
        "longer schedule, larger batch", "larger batch, validation set", "larger batch, label smoothing"])
def test_a_resume_the_run_s_length_cannot_continue_is_refused_before_anything_starts(trained, tmp_path, capsys,
                                                                                      items, says):
    """check_resumable lets train.allow_changed_config=true through, and train.py refused such a run only once it had
    counted its data (the schedule shorter than the checkpoint's update, another number of updates per epoch), after
    the runs before it. The sweep refuses it up front with train.py's own error."""
    root = tmp_path / "copy"
    folder = copied_run(trained, root)
    log = (folder / "train.log").stat()
    message = refused_at_start(sweep_file(root, tmp_path / "s.yaml", items=items, before=True))
    assert "train.py would refuse it at its start" in message and says in message
    assert not (root / "runs" / "b").exists() and (folder / "train.log").stat() == log
    assert capsys.readouterr().out == ""
    with pytest.raises(CheckpointError) as refused:  # train.py's own refusal of the run's command, in its words
        train.main(load_config([DEBUG_CONFIG], [*items, f"out_dir={folder}"]))
    assert str(refused.value) in message


def test_a_poly_run_of_another_power_with_updates_left_is_refused_before_anything_starts(tmp_path, capsys):
    """A checkpoint whose poly schedule decayed with another power (written before build_scheduler set it) continues
    only with train.allow_changed_config=true: train.py refused it once it knew the updates left, after the runs
    before it; the sweep refuses it up front, and lets it through with train.allow_changed_config=true."""
    items = ["sched.name=poly", "sched.epochs=1", "sched.warmup_epochs=0", "log.tensorboard=false"]
    folder = tmp_path / "runs" / "a"
    train.main(load_config([DEBUG_CONFIG], [*items, "train.max_steps=2", f"out_dir={folder}"]))  # 2 of 4 updates
    payload = torch.load(folder / "checkpoint.pt", map_location="cpu", weights_only=False)
    payload["scheduler"]["power"] = 0.1  # create_scheduler_v2's default, as the earlier code wrote it
    torch.save(payload, folder / "checkpoint.pt")
    capsys.readouterr()  # the training's log
    message = refused_at_start(sweep_file(tmp_path, tmp_path / "s.yaml", items=items, before=True))
    assert "train.py would refuse it at its start" in message
    assert not (tmp_path / "runs" / "b").exists() and capsys.readouterr().out == ""
    with pytest.raises(ConfigError) as refused:  # train.py's own refusal
        train.main(load_config([DEBUG_CONFIG], [*items, f"out_dir={folder}"]))
    assert "power 0.1" in str(refused.value) and str(refused.value) in message
    allowed = sweep.expand(sweep_file(tmp_path, tmp_path / "s.yaml", items=[*items, "train.allow_changed_config=true"]),
                           [])
    sweep.refuse_changed_training_settings(allowed, "s.yaml", world_size=1)


def logs_only(trained, root):
    """root/runs/a: the logs of run 'a' without its checkpoint.pt, best.pt or result, as a run that stopped before
    its first checkpoint (its second Ctrl-C, a streak the divergence guard withheld) leaves its folder."""
    folder = root / "runs" / "a"
    folder.mkdir(parents=True)
    for name in ("train.log", "config.yaml", "metrics.jsonl"):
        shutil.copy2(trained / "runs" / "a" / name, folder / name)
    return folder


def test_logs_of_a_run_without_a_checkpoint_under_other_settings_are_refused_before_anything_starts(
        trained, tmp_path, capsys, monkeypatch):
    """train.py refuses a folder that holds an earlier run's files and no checkpoint.pt, but for the logs of the same
    command (a restart): with the run's settings edited since, it was refused at its turn, after the runs before it
    had trained, and the later runs were not started. The reference is train.py's own refusal of the run's command."""
    root = tmp_path / "copy"
    folder = logs_only(trained, root)
    monkeypatch.setattr(sweep, "run_one", lambda *a: pytest.fail("a run started"))
    items = [*ITEMS, "optim.lr=0.01"]
    message = refused_at_start(sweep_file(root, tmp_path / "s.yaml", items=items, before=True))
    assert "train.py would refuse it at its start" in message and "holds files of an earlier run" in message
    assert f"another out_root in {tmp_path / 's.yaml'}" in message
    assert capsys.readouterr().out == "" and sorted(p.name for p in folder.iterdir()) == [
        "config.yaml", "metrics.jsonl", "train.log"]
    with pytest.raises(RunDirError) as refused:  # train.py's own refusal of the run's command, in its words
        train.main(load_config([DEBUG_CONFIG], [*items, f"out_dir={folder}"]))
    assert str(refused.value) in message


def test_logs_of_the_same_command_without_a_checkpoint_are_not_refused(trained, tmp_path, caplog):
    """The same command restarts such a run (train.py moves its logs to archive/): the sweep lets it through."""
    root = tmp_path / "copy"
    folder = logs_only(trained, root)
    runs = sweep.expand(sweep_file(root, tmp_path / "s.yaml"), [])
    sweep.refuse_changed_training_settings(runs, "s.yaml", world_size=1)
    with caplog.at_level(logging.WARNING):
        train.main(load_config([DEBUG_CONFIG], runs[0]["overrides"]))  # restarts
    assert "stopped before its first checkpoint" in caplog.text and (folder / "checkpoint.pt").is_file()



def test_a_relative_input_the_claim_would_archive_is_found_from_any_folder(trained, tmp_path, monkeypatch):
    """train.archive_existing=true moves an earlier run's files aside, and train.py refuses it where the run reads one
    of them (model.pretrained=<the folder's best.pt>), a relative path read in the repository root, where the commands
    run. The sweep, started from another folder, read it from there and let the run through to train.py's refusal."""
    root = tmp_path / "copy"
    folder = logs_only(trained, root)
    shutil.copy2(trained / "runs" / "a" / "best.pt", folder / "best.pt")
    weights = os.path.relpath(folder / "best.pt", ROOT)
    items = [*ITEMS, "train.archive_existing=true", f"model.pretrained={weights}"]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sweep, "run_one", lambda *a: pytest.fail("a run started"))
    message = refused_at_start(sweep_file(root, tmp_path / "s.yaml", items=items))
    assert f"model.pretrained={weights} lies in out_dir" in message
    monkeypatch.chdir(ROOT)
    with pytest.raises(RunDirError) as refused:  # train.py's own refusal of the run's command, run where it runs
        train.main(load_config([DEBUG_CONFIG], [*items, f"out_dir={folder}"]))
    assert str(refused.value) in message


def test_a_train_resume_of_other_settings_is_refused_before_anything_starts(trained, tmp_path, monkeypatch):
    """Runs that continue one checkpoint (a shared warm-up: train.resume=<run a's checkpoint.pt> in each run's items, or
    on the command line) each with its own settings: train.py refuses such a run at its start, and the sweep let it
    through to that refusal, at the turn of the run after the first to train. Run 'a' here starts in a fresh folder
    from the trained checkpoint with another optim.lr; the run before it, of the checkpoint's settings, would train."""
    warm_up = trained / "runs" / "a" / "checkpoint.pt"
    root = tmp_path / "fresh"
    items = [*ITEMS, "optim.lr=0.01", f"train.resume={warm_up}"]
    monkeypatch.setattr(sweep, "run_one", lambda *a: pytest.fail("a run started"))
    message = refused_at_start(sweep_file(root, tmp_path / "s.yaml", items=items, before=True))
    assert "train.py would refuse it at its start" in message and "optim.lr: None -> 0.01" in message
    assert not (root / "runs").exists()
    with pytest.raises(CheckpointError, match="written with other settings"):  # train.py's own refusal
        train.main(load_config([DEBUG_CONFIG], [*items, f"out_dir={root / 'runs' / 'a'}"]))


def test_a_train_resume_in_an_earlier_run_s_folder_is_left_to_that_run(trained, tmp_path):
    """Run 'a' continuing the checkpoint.pt of run 'b', which b writes first in the sweep: what that file will hold
    is b's to say, so the sweep does not compare a's settings with the file there now."""
    root = tmp_path / "copy"
    shutil.copytree(trained / "runs" / "a", root / "runs" / "b")
    items = [*ITEMS, "optim.lr=0.01", f"train.resume={root / 'runs' / 'b' / 'checkpoint.pt'}"]
    runs = sweep.expand(sweep_file(root, tmp_path / "s.yaml", items=items, before=True), [])
    sweep.refuse_changed_training_settings(runs, "s.yaml", world_size=1)


def test_a_train_resume_beside_a_checkpoint_of_another_start_is_refused_before_anything_starts(trained, tmp_path,
                                                                                                monkeypatch):
    """A run's train.resume=<a warm-up elsewhere> whose folder holds checkpoint.pt of a start that did not begin from it
    (the run trained before without train.resume): train.py refuses it at its start, as its next checkpoint would
    replace that run's progress, and the sweep let it through to that refusal, after the runs before it had trained.
    Same settings as the warm-up's: only the folder's other start is wrong. The reference is train.py's refusal."""
    root = tmp_path / "other"
    folder = copied_run(trained, root)  # a fresh start's checkpoint.pt (no train.resume)
    warm_up = tmp_path / "warm" / "checkpoint.pt"
    warm_up.parent.mkdir()
    shutil.copy2(trained / "runs" / "a" / "checkpoint.pt", warm_up)
    items = [*ITEMS, f"train.resume={warm_up}"]
    monkeypatch.setattr(sweep, "run_one", lambda *a: pytest.fail("a run started"))
    message = refused_at_start(sweep_file(root, tmp_path / "s.yaml", items=items, before=True))
    assert "train.py would refuse it at its start" in message and "did not start from it" in message
    assert not (root / "runs" / "b").exists()
    with pytest.raises(CheckpointError) as refused:  # train.py's own refusal of the run's command, in its words
        train.main(load_config([DEBUG_CONFIG], [*items, f"out_dir={folder}"]))
    assert str(refused.value) in message

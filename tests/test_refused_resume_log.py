"""A refused resume appended to the run's train.log: logging began before the resume checks, so a command refused
with "use another out_dir" (another model, changed settings, a schedule the checkpoint is past) added its lines and
its error line to the log of the run it did not continue. A resume's lines now reach train.log once the run goes on:
a refused command leaves every file of out_dir byte for byte as it was, and an accepted one writes all its lines,
those before the acceptance included, after the run's earlier ones."""
import os

import pytest

import train
from tests.conftest import DEBUG_CONFIG, run_entry
from tests.test_resume_nothing_to_train import folder_digest


@pytest.mark.parametrize("refused", [["model.name=vit_micro"], ["optim.lr=0.1"],
                                     ["sched.epochs=1", "sched.warmup_epochs=0", "train.allow_changed_config=true"]],
                         ids=["another model", "changed setting", "schedule past"])
def test_a_refused_resume_leaves_every_file_of_out_dir_as_it_was(debug_config, capsys, refused):
    """Checked through train.py's command line, whose error line goes to the run's log file where one is open;
    'schedule past' is refused once the data are counted, after the model's lines were logged."""
    command = ["--config", DEBUG_CONFIG, f"out_dir={debug_config().out_dir}", "log.tensorboard=false"]
    assert run_entry("train.py", command, capsys)[0] == 0  # its log handlers end with it, as a process's
    before = folder_digest(debug_config().out_dir)
    code, out, err = run_entry("train.py", [*command, *refused], capsys)
    assert code == 1 and err.startswith("error: ") and err.count("\n") == 1, err
    assert "train INFO commit" in out  # the console has the lines
    assert folder_digest(debug_config().out_dir) == before


def test_an_accepted_resume_writes_all_its_lines_after_the_run_s(debug_config):
    cfg = debug_config("train.max_steps=2", "log.tensorboard=false")
    train.main(cfg)
    log = os.path.join(cfg.out_dir, "train.log")
    with open(log) as f:
        first = f.read()
    train.main(debug_config("train.max_steps=4", "optim.lr=0.01", "train.allow_changed_config=true",
                            "log.tensorboard=false"))
    with open(log) as f:
        text = f.read()
    assert text.startswith(first)
    added = [line.split(" ", 1)[1] for line in text[len(first):].splitlines()]
    order = [next(i for i, line in enumerate(added) if line.startswith(start)) for start in (
        "train INFO commit", "train INFO model vit_nano", "train WARNING resuming with changed settings: optim.lr: "
        "None -> 0.01", "train INFO resumed from", "train INFO update 4/", "train INFO run summary")]
    assert order == sorted(order) and order[0] == 0


@pytest.mark.parametrize("changed, refusal, built", [
    (["train.ema=true"], "without an EMA of the weights", False),
    (["data.synthetic_train_size=96"], "6 updates per epoch", True)], ids=["ema turned on", "updates per epoch"])
def test_a_resume_refused_after_the_model_is_built_says_no_resuming_line(debug_config, capsys, changed, refusal, built):
    """A refusal once the model is built (other updates per epoch, counted from the data) came after the "resuming
    with changed settings" warning, saying the run resumed. The refusal's error line is the only word on it now.
    train.ema=true on a checkpoint without EMA weights was refused so too; it is refused before the model is built
    now (train.py check_checkpoint_fits), and says no resuming line either."""
    command = ["--config", DEBUG_CONFIG, f"out_dir={debug_config().out_dir}", "log.tensorboard=false"]
    assert run_entry("train.py", [*command, "train.max_steps=4"], capsys)[0] == 0  # updates left to train
    code, out, err = run_entry("train.py", [*command, *changed, "train.allow_changed_config=true"], capsys)
    assert code == 1 and err.startswith("error: ") and refusal in err and err.count("\n") == 1, err
    assert ("train INFO model vit_nano" in out) == built  # refused after the model was built, or before
    assert "resuming with changed settings" not in out + err

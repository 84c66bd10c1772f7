"""A changed training setting (train.allow_changed_config=true) on a run with no update left to train, a finished run
re-run or one at its train.max_steps, trained nothing, yet config.yaml recorded the new settings and the log said
"resuming with changed settings", while checkpoint.pt and best.pt kept the old ones. It is refused with one error
line that names the change and the fix, with every file of out_dir left as it was; a new validation set acts on the
validation such a run makes again, and stays allowed. The tiny config trains 2 epochs of 4 updates."""
import hashlib
import os

import pytest
import yaml

import train
from configs import ConfigError, load_config
from tests.conftest import DEBUG_CONFIG, run_entry


def folder_digest(folder) -> dict:
    """{relative path: md5} of every file under `folder`."""
    found = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, folder)] = hashlib.md5(f.read()).hexdigest()
    return found


@pytest.mark.parametrize("change, says", [("optim.lr=0.5", "optim.lr: None -> 0.5"),
                                          ("model.drop_path=0.2", "model.drop_path: 0.1 -> 0.2")])
def test_a_finished_run_re_run_with_changed_training_settings_is_refused(debug_config, caplog, change, says):
    """...and with a new validation set alone it validates on that set."""
    cfg = debug_config("log.tensorboard=false")
    assert train.main(cfg).state.step == 8  # the whole schedule: nothing is left to train
    before = folder_digest(cfg.out_dir)
    allowed = ("log.tensorboard=false", "train.allow_changed_config=true")
    with pytest.raises(ConfigError) as refused:
        train.main(debug_config(*allowed, change, "data.synthetic_val_size=32"))
    message = str(refused.value)
    assert "is at update 8, the end of the run's schedule" in message and "nothing is left to train" in message
    assert f"({says})" in message and "a longer sched.epochs" in message and "another out_dir" in message
    assert folder_digest(cfg.out_dir) == before  # config.yaml names the settings the weights were trained with
    with caplog.at_level("INFO"):
        assert train.main(debug_config(*allowed, "data.synthetic_val_size=32")).state.step == 8
    assert "validation at update 8: 32 images" in caplog.text


def test_a_run_at_its_max_steps_takes_changed_settings_only_with_updates_to_train(debug_config):
    cfg = debug_config("train.max_steps=2", "log.tensorboard=false")
    train.main(cfg)
    before = folder_digest(cfg.out_dir)
    changed = ("optim.lr=0.5", "train.allow_changed_config=true", "log.tensorboard=false")
    with pytest.raises(ConfigError, match=r"is at update 2, train.max_steps=2: nothing is left to train, so the "
                                          r"changed settings \(optim.lr: None -> 0.5\).* a larger train.max_steps"):
        train.main(debug_config("train.max_steps=2", *changed))
    assert folder_digest(cfg.out_dir) == before
    assert train.main(debug_config("train.max_steps=4", *changed)).state.step == 4  # two updates with them
    with open(os.path.join(cfg.out_dir, "config.yaml")) as f:
        assert yaml.safe_load(f)["optim"]["lr"] == 0.5


def test_the_refusal_is_one_error_line_and_leaves_train_log_as_it_was(debug_config, capsys):
    """Through train.py's command line (its __main__ block: the error line goes to the log file it has open)."""
    out_dir = debug_config().out_dir
    command = ["--config", DEBUG_CONFIG, f"out_dir={out_dir}", "log.tensorboard=false"]
    assert run_entry("train.py", command, capsys)[0] == 0  # its log handlers end with it, as a process's
    before = folder_digest(out_dir)
    code, _, err = run_entry("train.py", [*command, "optim.lr=0.5", "train.allow_changed_config=true"], capsys)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith("error: ") and "nothing is left" in lines[0], err
    assert folder_digest(out_dir) == before


def test_a_sweep_refuses_such_a_run_before_any_run_starts(tmp_path):
    """scripts/sweep.py makes train.py's checks of a resume's length before its first run (check_resume_point)."""
    import sweep  # scripts/, on the path of the tests

    items = ["sched.epochs=1", "sched.warmup_epochs=0", "log.tensorboard=false"]
    train.main(load_config([DEBUG_CONFIG], [*items, f"out_dir={tmp_path / 'runs' / 'a'}"]))
    path = tmp_path / "s.yaml"
    path.write_text(f"configs: [configs/debug/tiny.yaml]\nout_root: {tmp_path / 'runs'}\nruns:\n"
                    f"  a: [{', '.join([*items, 'optim.lr=0.01', 'train.allow_changed_config=true'])}]\n")
    runs = sweep.expand(str(path), [])
    with pytest.raises(ConfigError, match=r"sweep run 'a': train.py would refuse it at its start: .* is at update 4, "
                                          r"the end of the run's schedule .*nothing is left to train"):
        sweep.refuse_changed_training_settings(runs, str(path), world_size=1)

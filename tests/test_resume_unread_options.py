"""A resume compares the checkpoint's settings with the new ones (engine/run_dir.py config_changes). A key that the
config rules leave unread in both (train.ema_decay while train.ema is false in both) changes nothing computed: a run
saved with such an option beside its switch off resumes once the option, which the loader refuses as ignored, is
dropped from the command."""
import pytest

import train
from configs import config_to_dict, load_config
from engine.checkpoint import CheckpointError
from engine.run_dir import config_changes
from tests.conftest import DEBUG_CONFIG


def test_a_key_unread_in_both_configs_is_no_change():
    """Hand-written pairs: train.ema_decay under train.ema=false on both sides is left out; under a switch that
    is on in either config it counts, as does any key no rule leaves unread."""
    off = {"train": {"ema": False, "ema_decay": 0.5}, "optim": {"lr": 0.1}}
    assert config_changes(off, {"train": {"ema": False, "ema_decay": 0.99996}, "optim": {"lr": 0.1}}) == []
    assert config_changes(off, {"train": {"ema": True, "ema_decay": 0.99996}, "optim": {"lr": 0.1}}) == [
        "train.ema: False -> True", "train.ema_decay: 0.5 -> 0.99996"]
    assert config_changes({"train": {"ema": True, "ema_decay": 0.5}},
                          {"train": {"ema": False, "ema_decay": 0.99996}}) == [
        "train.ema: True -> False", "train.ema_decay: 0.5 -> 0.99996"]
    assert config_changes(off, {"train": {"ema": False, "ema_decay": 0.99996}, "optim": {"lr": 0.2}}) == [
        "optim.lr: 0.1 -> 0.2"]


def test_a_config_without_the_deciding_key_keeps_the_change():
    """An older run's config may lack a deciding key: nothing then says the key is unread, and it counts."""
    assert config_changes({"train": {"ema_decay": 0.5}}, {"train": {"ema": False, "ema_decay": 0.99996}}) == [
        "train.ema: None -> False", "train.ema_decay: 0.5 -> 0.99996"]


def test_a_run_saved_with_an_ignored_option_resumes_without_it():
    """A run started with train.ema=false train.ema_decay=0.5 (accepted then, its config.yaml holds both) is
    resumed with train.ema=false alone (the loader refuses the pair): the checkpoint's ema_decay 0.5 against
    the default is no changed setting, so no train.allow_changed_config=true is asked for."""
    current = load_config([DEBUG_CONFIG], ["train.ema=false"])
    saved = config_to_dict(current)
    saved["train"]["ema_decay"] = 0.5
    assert current.train.ema_decay != 0.5
    train.check_resumable(saved, current, "checkpoint.pt")
    with pytest.raises(CheckpointError, match=r"other settings \(train.ema: False -> True; "
                                              r"train.ema_decay: 0.5 -> "):
        train.check_resumable(saved, load_config([DEBUG_CONFIG], ["train.ema=true"]), "checkpoint.pt")

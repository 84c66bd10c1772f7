"""scripts/mechanism.py: an override that a subcommand does not read is refused with the fix that ends the
refusals (drop it), before the config loader's rules would ask for a deciding key the subcommand does not read
either (data.root over a digits checkpoint: "set data.dataset as well", then data.dataset refused in turn)."""
import os

import pytest

import mechanism
from tests.test_mechanism import make_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "digits.pt")


def refusal(capsys, argv) -> str:
    """The one `error:` line of a refused command."""
    assert mechanism.cli(argv) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


@pytest.mark.parametrize("command, extra, named", [
    ("alignment", ["data.root=/x"], "data.root=/x: `alignment` does not read data.root (it reads model.*); drop it"),
    ("energies", ["data.val_split=val"], "data.val_split=val: `energies` does not read data.val_split"),
    # the loader named data.root first and asked for data.dataset, which `alignment` then refused
    ("alignment", ["data.dataset=folder", "data.root=/x"], "data.dataset=folder: `alignment` does not read"),
])
def test_the_first_refusal_names_the_unread_override_and_dropping_it_runs(checkpoint, tmp_path, capsys, command,
                                                                          extra, named):
    out = str(tmp_path / "o")
    line = refusal(capsys, [command, "--checkpoint", checkpoint, "--out", out, *extra])
    assert named in line and "as well" not in line, line
    # the advice followed: every override the refusals name is dropped, each refusal saying "drop it", and it runs
    left = list(extra)
    while left:
        line = refusal(capsys, [command, "--checkpoint", checkpoint, "--out", out, *left])
        item = line[len("error: "):].split(": ", 1)[0]
        assert item in left and line.endswith("; drop it"), line
        left.remove(item)
    assert mechanism.cli([command, "--checkpoint", checkpoint, "--out", out]) == 0
    assert os.path.isfile(os.path.join(out, f"{command}.png"))


def test_an_override_it_reads_still_meets_the_loaders_rules_and_a_misspelt_key_its_suggestion(checkpoint, tmp_path,
                                                                                               capsys):
    out = str(tmp_path / "o")
    # surrogate reads data.*: data.root over digits is the loader's refusal, whose fix (data.dataset) it reads
    line = refusal(capsys, ["surrogate", "--checkpoint", checkpoint, "--out", out, "data.root=/x"])
    assert "data.root=/x would be ignored" in line and "set data.dataset" in line, line
    line = refusal(capsys, ["alignment", "--checkpoint", checkpoint, "--out", out, "data.rot=/x"])
    assert "unknown config key 'data.rot'; did you mean 'data.root'?" in line, line
    # a training-batch key surrogate never reads is named before the loader's data.root
    line = refusal(capsys, ["surrogate", "--checkpoint", checkpoint, "--out", out, "data.root=/x", "data.mixup=0.2"])
    assert "data.mixup=0.2: `surrogate` does not read data.mixup" in line, line


def test_remove_with_the_training_transform_is_not_refused_its_keys_before_the_config_is_read():
    """remove reads data.hflip when quant.calib_transform=train, which only the config says: not refused early."""
    args = mechanism.parse_args(["remove", "--checkpoint", "c.pt", "--out", "o", "quant.calib_transform=train",
                                 "data.hflip=0"])
    mechanism.check_overrides_first(args)
    args = mechanism.parse_args(["surrogate", "--checkpoint", "c.pt", "--out", "o", "data.hflip=0"])
    with pytest.raises(mechanism.MechanismError, match="`surrogate` does not read data.hflip"):
        mechanism.check_overrides_first(args)

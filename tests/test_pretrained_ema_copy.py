"""A model.pretrained file holding an EMA copy beside its raw weights (timm's and DeiT's {'model', 'model_ema'} or
{'state_dict', 'state_dict_ema'}, a train.ema=true run's checkpoint) loads the raw set, and the log says so, with
how to start from the EMA copy instead; the way it gives, followed, loads the EMA weights."""
import logging

import pytest
import torch

import train
from configs import load_config
from models import ModelError, build_model


def nano(*overrides):
    return load_config(None, ["model.name=vit_nano", "model.num_classes=4", *overrides]).model


def weights(seed: int) -> dict:
    torch.manual_seed(seed)
    return build_model(nano()).state_dict()


def loaded_line(path, caplog) -> tuple[dict, str]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="models.pretrained"):
        state = build_model(nano(f"model.pretrained={path}", "model.pretrained_strict=true")).state_dict()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"loaded {path}")]
    assert len(lines) == 1, caplog.text
    return state, lines[0]


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("raw, ema", [("model", "model_ema"), ("state_dict", "state_dict_ema")])
def test_the_raw_weights_load_and_the_unused_ema_copy_is_named(raw, ema, tmp_path, caplog, monkeypatch):
    plain, averaged = weights(0), weights(1)
    path = tmp_path / "both.pth"
    torch.save({raw: plain, ema: averaged, "epoch": 3}, path)
    state, line = loaded_line(path, caplog)
    assert same(state, plain)
    assert f"(raw weights; the file's EMA copy ({ema}) is not used" in line, line
    advice = line.split("its own, ")[1].split(", and give that)")[0]
    monkeypatch.chdir(tmp_path)
    exec(advice.replace("PATH", repr(str(path))), {"torch": torch})  # the advice, as worded
    assert same(loaded_line(tmp_path / "ema.pth", caplog)[0], averaged)


def test_a_file_without_an_ema_copy_says_nothing_of_one(tmp_path, caplog):
    torch.save({"model": weights(0)}, tmp_path / "raw.pth")
    assert "EMA" not in loaded_line(tmp_path / "raw.pth", caplog)[1]


def test_a_run_of_train_ema_true_given_as_model_pretrained_names_its_ema_copy(debug_config, caplog):
    run = train.main(debug_config("train.ema=true", "train.max_steps=1", name="ema"))
    best = debug_config(name="ema").out_dir + "/best.pt"
    payload = torch.load(best, weights_only=True)
    state, line = loaded_line(best, caplog)
    assert same(state, payload["model"]) and "EMA copy (model_ema) is not used" in line, line
    assert run.state.step == 1


@pytest.mark.parametrize("ema", ["state_dict_ema", "model_ema"])
def test_a_file_holding_only_an_ema_copy_is_refused_as_such_and_its_advice_followed_loads_it(ema, tmp_path,
                                                                                           caplog, monkeypatch):
    """A file with the EMA copy alone was refused as holding "no state dict ... give a weights file"; the refusal
    names the copy and gives the same way to start from it as the log line above, which followed loads it."""
    averaged = weights(1)
    path = tmp_path / "ema_only.pth"
    torch.save({ema: averaged, "epoch": 3}, path)
    with pytest.raises(ModelError) as refused:
        build_model(nano(f"model.pretrained={path}"))
    message = str(refused.value)
    assert message.startswith(f"model.pretrained={path} holds only an EMA copy of the weights ('{ema}')"), message
    advice = message.split("save it as a file of its own, ")[1].split(", and give that")[0]
    monkeypatch.chdir(tmp_path)
    exec(advice.replace("PATH", repr(str(path))), {"torch": torch})  # the advice, as worded
    assert same(loaded_line(tmp_path / "ema.pth", caplog)[0], averaged)


@pytest.mark.parametrize("raw, ema, entry, problem", [
    ("state_dict", "state_dict_ema", {"_version": 2},
     "has 1 entry of 33 that holds no tensor, e.g. '_version' (int 2)"),
    ("model", "model_ema", None, "is a list")])
def test_a_file_whose_raw_entry_is_no_state_dict_beside_an_ema_copy_is_refused_for_the_raw_entry(
        raw, ema, entry, problem, tmp_path):
    """{'state_dict': {..., '_version': 2}, 'state_dict_ema': ...} was refused as holding "only an EMA copy ... no
    raw weights", though its raw weights are there (with an entry that is no tensor): the refusal is a file's without
    a state dict, naming the raw entry and what is wrong with it."""
    plain = weights(0)
    assert len(plain) == 32  # the count the refusal names, with the one entry that is no tensor
    path = tmp_path / "both.pth"
    torch.save({raw: {**plain, **entry} if entry else list(plain.values()), ema: weights(1)}, path)
    with pytest.raises(ModelError) as refused:
        build_model(nano(f"model.pretrained={path}"))
    assert str(refused.value) == (f"model.pretrained={path} holds no state dict (parameter name -> tensor), neither "
                                  f"as a whole nor under 'model' / 'state_dict' / 'module'; its '{raw}' {problem}: "
                                  f"give a weights file")

"""A weights file torch's weights-only reader refuses is named with advice a user can follow (timm's own, 'retry
with weights_only=False', is no setting of model.pretrained), and following it loads the weights; a file of no
weights format, or a link that names no file, is named as such."""
import fractions
import os

import numpy
import pytest
import torch
from safetensors.torch import save_file

from configs.schema import ModelConfig
from models import ModelError, build_model


def weights() -> dict:
    torch.manual_seed(0)
    return build_model(ModelConfig(name="vit_nano", num_classes=10)).state_dict()


def load(path) -> dict:
    return build_model(ModelConfig(name="vit_nano", num_classes=10, pretrained=str(path),
                                   pretrained_strict=True)).state_dict()


def test_a_safetensors_file_named_pth_is_named_as_such_and_loads_under_its_own_extension(tmp_path):
    source = weights()
    path = tmp_path / "w.pth"
    save_file(source, path)
    with pytest.raises(ModelError) as refused:
        load(path)
    message = str(refused.value)
    assert message == (f"model.pretrained={path} is a safetensors file under another name, which torch's reader "
                       f"cannot read: give it the .safetensors extension"), message
    os.rename(path, tmp_path / "w.safetensors")  # the advice, followed
    loaded = load(tmp_path / "w.safetensors")
    assert all(torch.equal(loaded[k], v) for k, v in source.items())


def test_a_file_with_python_objects_beside_its_tensors_names_them_and_how_to_save_the_weights_alone(tmp_path):
    source = weights()
    path = tmp_path / "run.pth"
    torch.save({"model": source, "ratio": fractions.Fraction(1, 2)}, path)
    with pytest.raises(ModelError) as refused:
        load(path)
    message = str(refused.value)
    assert message.startswith(f"model.pretrained={path} holds Python objects beside its tensors "
                              f"(fractions.Fraction) that weights-only loading refuses") and "\n" not in message
    assert "retry with weights_only" not in message, message
    torch.save(torch.load(path, weights_only=False)["model"], tmp_path / "alone.pth")  # the advice, followed
    loaded = load(tmp_path / "alone.pth")
    assert all(torch.equal(loaded[k], v) for k, v in source.items())


def not_weights_line(path, what: str) -> str:
    return (f"model.pretrained={path} is not a torch or safetensors weights file ({what}, not the zip archive or "
            f"legacy format torch.save writes, nor safetensors); give a .pth/.pt/.safetensors file")


def test_a_file_of_no_weights_format_is_named_as_such_not_told_to_be_unpickled_unsafely(tmp_path):
    """A YAML file, a numpy .npy array, random bytes and an empty file are no weights: torch's reader fails on them
    as on a pickle (or, for random bytes, in a memo lookup), and following 'load it with weights_only=False' would
    unpickle a text file."""
    files = {"config.pth": ("a text file", b"model:\n  name: vit_nano\n"), "random.pth": ("binary data", None),
             "empty.pth": ("an empty file", b"")}
    for name, (_, data) in files.items():
        (tmp_path / name).write_bytes(data if data is not None else bytes(range(256)) * 4)
    numpy.save(tmp_path / "array.npy", numpy.ones(3))
    files["array.npy"] = ("binary data", None)
    for name, (what, _) in files.items():
        with pytest.raises(ModelError) as refused:
            load(tmp_path / name)
        assert str(refused.value) == not_weights_line(tmp_path / name, what), refused.value


def test_the_legacy_torch_format_loads_and_one_weights_only_reading_cannot_read_is_named_with_the_way_to_load_it(
        tmp_path):
    """A file in torch's legacy format is a weights file, not refused as none: at pickle protocol 2 (torch's
    default) it loads; at protocol 4, whose opcodes torch's weights-only reader does not take, it is named as a
    torch file, and the advice, followed, loads it."""
    source = weights()
    torch.save(source, tmp_path / "legacy.pth", _use_new_zipfile_serialization=False)
    loaded = load(tmp_path / "legacy.pth")
    assert all(torch.equal(loaded[k], v) for k, v in source.items())
    for name, legacy, protocol in (("legacy4.pth", True, 4), ("zip5.pth", False, 5)):  # the current format too
        path = tmp_path / name
        torch.save(source, path, _use_new_zipfile_serialization=not legacy, pickle_protocol=protocol)
        with pytest.raises(ModelError) as refused:
            load(path)
        message = str(refused.value)
        assert message.startswith(f"model.pretrained={path} is a torch file whose pickle weights-only loading "
                                  f"cannot read (a pickle protocol other than torch's default 2 or 3") \
            and "legacy format" not in message and "Python objects" not in message, message
    torch.save(torch.load(path, weights_only=False), tmp_path / "again.pth")  # the advice, followed
    loaded = load(tmp_path / "again.pth")
    assert all(torch.equal(loaded[k], v) for k, v in source.items())


def test_a_link_that_names_no_file_is_named_as_such_not_as_no_such_file(tmp_path):
    """ls lists a dangling link and a loop of links: 'no such file' would contradict it."""
    os.symlink(tmp_path / "gone.pth", tmp_path / "dangling.pth")
    os.symlink(tmp_path / "b.pth", tmp_path / "a.pth")
    os.symlink(tmp_path / "a.pth", tmp_path / "b.pth")
    for name in ("dangling.pth", "a.pth"):
        with pytest.raises(ModelError) as refused:
            load(tmp_path / name)
        assert str(refused.value) == (f"pretrained weights not found: model.pretrained={tmp_path / name} is a link "
                                      f"that names no file (a loop of links, or its target is gone); give the path "
                                      f"of the weights file itself"), refused.value

"""A config file may give the entries of a free-form dict field (model.kwargs, cd.lam_per_role) under several
spellings: only the same entry given twice is refused, as for overrides (configs/loader.py)."""
import pytest

from configs import ConfigError, load_config

TINY = "configs/debug/tiny.yaml"


@pytest.mark.parametrize("text, entries", [
    ("model:\n  kwargs: {depth: 3}\nmodel.kwargs.embed_dim: 64\n", {"depth": 3, "embed_dim": 64}),
    ("model.kwargs.embed_dim: 64\nmodel:\n  kwargs: {depth: 3}\n", {"depth": 3, "embed_dim": 64}),
    ("model.kwargs: {depth: 3}\nmodel.kwargs.embed_dim: 64\nmodel:\n  name: vit_nano\n", {"depth": 3, "embed_dim": 64}),
])
def test_two_entries_in_two_spellings_are_both_set(tmp_path, text, entries):
    path = tmp_path / "kw.yaml"
    path.write_text(text)
    base = load_config([TINY]).model.kwargs
    assert load_config([TINY, str(path)]).model.kwargs == {**base, **entries}  # the tiny recipe's, then the file's
    # the same entries given as overrides: the reference the file's reading must agree with
    assert load_config([TINY], [f"model.kwargs.{k}={v}" for k, v in entries.items()]).model.kwargs == {**base,
                                                                                                     **entries}


def test_cd_roles_in_two_spellings_are_both_set(tmp_path):
    path = tmp_path / "cd.yaml"
    path.write_text("cd:\n  enabled: true\n  lam_per_role: {fc2: 0.02}\ncd.lam_per_role.proj: 0.01\n")
    assert load_config([TINY, str(path)]).cd.lam_per_role == {"fc2": 0.02, "proj": 0.01}


@pytest.mark.parametrize("text, key", [
    ("model:\n  kwargs: {depth: 3}\nmodel.kwargs.depth: 4\n", "model.kwargs.depth"),
    ("model.kwargs.depth: 4\nmodel.kwargs: null\n", "model.kwargs"),  # emptied after an entry: the entry is lost
])
def test_the_same_entry_set_twice_is_refused(tmp_path, text, key):
    path = tmp_path / "kw.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"^{path}: {key} is set twice, under .*; keep one$"):
        load_config([TINY, str(path)])

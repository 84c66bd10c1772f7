"""scripts/bench_pair_check.py and scripts/cd_update_memory.py refuse what they cannot time or measure with one
`error:` line (exit status 2), as scripts/cd_precision.py does: a model CD finds no pairs in was
UnsupportedModelError's traceback in both, and bench_pair_check.py's --model next to --lm-config was dropped
unread (the LM was timed under a command that named a timm model too)."""
from __future__ import annotations

import os

import cd_models  # noqa: F401  (one torch thread)
import pytest

import bench_pair_check
import cd_update_memory
from tests.conftest import ROOT

LM = os.path.join(ROOT, "configs", "lm", "kjv_nano.yaml")


def refused(main, argv, capsys) -> tuple[int, list[str], str]:
    """(exit status, stderr lines, stdout) of main(argv), which must stop with a usage error."""
    with pytest.raises(SystemExit) as done:
        main(argv)
    captured = capsys.readouterr()
    return done.value.code, captured.err.strip().splitlines(), captured.out


@pytest.mark.parametrize("main", [bench_pair_check.main, cd_update_memory.main], ids=["bench_pair_check",
                                                                                      "cd_update_memory"])
def test_a_model_without_pairs_is_one_error_line(main, capsys):
    """resnet18 has no Transformer block, so no pair: the refusal names the flag and says why."""
    code, lines, out = refused(main, ["--model", "resnet18"], capsys)
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    assert "--model resnet18: no matrix pair found in ResNet" in lines[0], lines
    assert out == ""  # nothing measured or printed before the refusal


@pytest.mark.parametrize("model", ["vit_tiny_patch16_224", "vit_base_patch16_224"])  # the latter is the default
def test_model_and_lm_config_together_are_refused_not_one_dropped(model, capsys, monkeypatch):
    monkeypatch.setattr(bench_pair_check, "build", lambda args: pytest.fail("a model was built"))
    code, lines, _ = refused(bench_pair_check.main, ["--model", model, "--lm-config", LM], capsys)
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    assert f"--model {model} and --lm-config {LM}" in lines[0] and "give one" in lines[0], lines


def test_without_model_or_lm_config_the_default_timm_model_is_built(monkeypatch):
    """--model's default is None (so that a --model beside --lm-config is seen): without either, ViT-B/16 is timed."""
    built = []

    class Built(Exception):
        pass

    def create_model(name):
        built.append(name)
        raise Built  # stop here: the name is what is checked, not the minutes of timing

    monkeypatch.setattr(bench_pair_check.timm, "create_model", create_model)
    with pytest.raises(Built):
        bench_pair_check.main(["--repeats", "1"])
    assert built == ["vit_base_patch16_224"]


@pytest.mark.parametrize("given", ["", "no_such.yaml"])
def test_an_lm_config_that_is_no_file_is_refused_not_the_default_model_timed(given, capsys, monkeypatch):
    """`--lm-config ''` (an unset shell variable) was read as no --lm-config: ViT-B/16 was timed in its place."""
    monkeypatch.setattr(bench_pair_check, "build", lambda args: pytest.fail("a model was built"))
    code, lines, out = refused(bench_pair_check.main, ["--lm-config", given], capsys)
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    assert f"--lm-config {given!r}: no such file; give a configs/lm/*.yaml" in lines[0], lines
    assert out == ""

"""`python -m cd --gated-mlp`: the CLI's form of find_pairs' gated_mlp=True (train.py's cd.gated_mlp=true), so that
a model refused for its gated MLPs (eva02, aimv2) can have its gated pairs listed, and the refusal names the flag."""
from __future__ import annotations

import pytest
import timm
import torch

from cd.__main__ import main as cd_main
from cd.pairs import find_pairs
from cd_models import vit_table_rows

EVA = "eva02_tiny_patch14_224"


def _meta(name: str):
    """The full-size timm model on the meta device, built here apart from the CLI's own copy."""
    with torch.device("meta"):
        return timm.create_model(name, pretrained=False)


def _refusal(capsys, argv: list[str]) -> str:
    """The one `error:` line (status 2, nothing on stdout) of `python -m cd argv`."""
    with pytest.raises(SystemExit) as done:
        cd_main(argv)
    out, err = capsys.readouterr()
    assert done.value.code == 2 and out == "" and err.count("\n") == 1, (out, err)
    return err


def test_gated_mlp_lists_eva02s_pairs_with_the_up_half_of_its_packed_fc1(capsys):
    """eva02_tiny (dim 192, 3 heads, 12 blocks; GluMlp with hidden 512, so fc1 is the packed [W_gate; W_up] of 1024
    rows and, gate_last=False, act(x1) * x2 makes rows 512:1024 W_up): the rows written by hand, and the same W2 / W1
    as find_pairs(gated_mlp=True) on a copy built here. No note: the small copy's checks ran with the flag too."""
    cd_main(["--model", EVA, "--gated-mlp"])
    out, err = capsys.readouterr()
    assert err == ""
    lines = out.splitlines()
    assert lines[0] == f"{EVA}:" and lines[-1] == "48 pairs: qkv 12, proj 12, fc1 12, fc2 12"
    rows = [line.split() for line in lines[3:-1]]  # after the name, header and rule; no cell holds a space
    assert rows == vit_table_rows(depth=12, dim=192, hidden=512, packed_fc1=True)
    library = find_pairs(_meta(EVA), gated_mlp=True)
    assert [(r[3], r[5]) for r in rows] == [(p.name, p.upstream_label) for p in library]


def test_the_refusal_of_a_gated_model_names_the_flag(capsys):
    err = _refusal(capsys, ["--model", EVA])
    assert err.startswith(f"error: {EVA}: block 'blocks.0' (EvaBlock) is not supported by CD: gated MLP GluMlp")
    assert "--gated-mlp" in err  # the CLI's own fix, not only the library's keyword


def test_gated_mlp_on_a_model_without_one_is_refused_as_find_pairs_refuses_it(capsys):
    """find_pairs refuses gated_mlp=True on a ViT (the switch would add no pair): the CLI refuses its flag there."""
    vit = _meta("vit_tiny_patch16_224")
    assert len(find_pairs(vit)) == 48
    with pytest.raises(ValueError, match="has no gated MLP"):
        find_pairs(vit, gated_mlp=True)
    err = _refusal(capsys, ["--model", "vit_tiny_patch16_224", "--gated-mlp"])
    assert err.startswith("error: vit_tiny_patch16_224: --gated-mlp") and "has no gated MLP" in err


def test_gated_mlp_beside_families_is_refused(capsys):
    """The family table already shows what gated_mlp=True finds: the flag would change nothing there."""
    err = _refusal(capsys, ["--families", "--gated-mlp"])
    assert err.startswith("error: --gated-mlp is for --model") and "drop --gated-mlp" in err

"""scripts/mechanism.py `energies --compare`: the second model must be another model of the first one's architecture.

A model of another width, name or task has other pair matrices, whose energies grow with their size, so a ratio of
the two says nothing of the method; the first model again (its file, or a copy of its weights) is drawn with ratio
1.000. Each is refused in one `error:` line before the energies are computed, and no output is written.
"""
import os
import shutil

import pytest
import torch

from cd_models import tiny_vit
from test_mechanism import make_checkpoint

import mechanism

WIDE = {"model.kwargs": "{embed_dim: 64, num_heads: 2}"}  # vit_nano is 32 wide with 2 heads
LANGUAGE = {"model.name": "gpt2_nano", "data.dataset": "kjv", "model.num_classes": 65}


@pytest.fixture
def energies_not_computed(monkeypatch):
    """A refusal is made before the work: pair_energies raises if it is reached."""
    def reached(*args, **kwargs):
        raise AssertionError("pair_energies ran before the refusal")
    monkeypatch.setattr(mechanism, "pair_energies", reached)


def refusal(capsys, argv) -> str:
    """The one `error:` line `cli` prints for `argv`, after checking that it exits 1 and writes nothing."""
    out = argv[argv.index("--out") + 1]
    assert mechanism.cli(argv) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert not os.path.exists(out)
    return err


@pytest.mark.parametrize("overrides, expected", [
    (WIDE, r'is of model\.kwargs=\{"embed_dim": 64, "num_heads": 2\}, the first model \(.*base\.pt\) of '
           r'model\.kwargs=\{\}'),
    (LANGUAGE, r"is a language model \(data\.dataset=kjv\), the first model \(.*base\.pt\) an image classifier "
               r"\(data\.dataset=digits\)"),
    ({"model.name": "swin_nano"}, r"is of model\.name=swin_nano, the first model \(.*base\.pt\) of "
                                  r"model\.name=vit_nano"),
])
def test_a_compare_of_another_architecture_is_refused_before_the_energies(tmp_path, capsys, energies_not_computed,
                                                                          overrides, expected):
    """Width 64 beside 32 was drawn with a ratio near 4 (||W2 W1n||_F^2 grows with the width), a GPT beside a ViT
    role by role; both exited 0."""
    import re

    base = make_checkpoint(tmp_path / "base.pt", 0)
    other = make_checkpoint(tmp_path / "other.pt", 1, **overrides)
    err = refusal(capsys, ["energies", "--checkpoint", base, "--compare", other, "--out", str(tmp_path / "e")])
    assert re.search(rf"^error: --compare .*other\.pt {expected}: pair energies are compared between two "
                     rf"checkpoints of one architecture", err), err


def test_the_first_model_again_is_refused(tmp_path, capsys, energies_not_computed):
    """The same file (by another path too), a copy of it, and a checkpoint of the same weights under another
    method's config each drew one model twice, with ratio 1.000."""
    base = make_checkpoint(tmp_path / "base.pt", 0)
    os.symlink(base, tmp_path / "link.pt")
    shutil.copy(base, tmp_path / "copy.pt")
    relabelled = make_checkpoint(tmp_path / "relabelled.pt", 0, **{"cd.enabled": "true"})  # seed 0: base's weights
    for compare, expected in ((base, "is the file of the first model"),
                              (str(tmp_path / "link.pt"), "is the file of the first model"),
                              (str(tmp_path / "copy.pt"), "holds the same weights as the first model"),
                              (relabelled, "holds the same weights as the first model")):
        err = refusal(capsys, ["energies", "--checkpoint", base, "--compare", compare, "--out", str(tmp_path / "e")])
        assert err.startswith(f"error: --compare {compare} {expected} ("), err
    weights = str(tmp_path / "w.pth")
    torch.save(torch.load(base, weights_only=True)["model"], weights)
    err = refusal(capsys, ["energies", "--model", "vit_nano", "--weights", weights, "--compare", weights,
                           "--out", str(tmp_path / "e")])
    assert err.startswith(f"error: --compare {weights} is the file of the first model"), err


def test_another_run_of_the_same_architecture_is_drawn(tmp_path):
    """The checks leave a comparison of two runs of one architecture as it was: both drawn, one row each per pair."""
    base = make_checkpoint(tmp_path / "base.pt", 0)
    other = make_checkpoint(tmp_path / "other.pt", 1, **{"cd.enabled": "true"})
    result = mechanism.main(["energies", "--checkpoint", base, "--compare", other, "--out", str(tmp_path / "e")])
    assert result["labels"] == ["Baseline", "CD"] and len(result["rows"]) == 2 * 8


def test_pairs_differ_by_the_shapes_of_their_matrices():
    """Two ViTs of one layer naming but other widths have the same (role, W2 name) rows, which was all the check
    compared; their stacked matrices' shapes (from the widths: qkv W2 3d x d, W1 the norm's d) tell them apart."""
    import timm

    narrow = mechanism.pair_energies(tiny_vit())
    wide = mechanism.pair_energies(timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=64,
                                                     depth=2, num_heads=2, num_classes=10))
    assert [(r["role"], r["w2"]) for r in narrow] == [(r["role"], r["w2"]) for r in wide]
    assert mechanism.pairs_differ(narrow, wide) == ("qkv blocks.0.attn.qkv.weight (W2 96x32, W1 32) against qkv "
                                                    "blocks.0.attn.qkv.weight (W2 192x64, W1 64)")
    assert mechanism.pairs_differ(narrow, mechanism.pair_energies(tiny_vit(seed=1))) is None
    assert mechanism.pairs_differ(narrow, narrow[:4]) == "8 rows of pairs against 4"
    fc2 = next(r for r in narrow if r["role"] == "fc2")  # timm's vit_tiny MLP: 4 x the width
    assert (fc2["w2_shape"], fc2["w1_shape"]) == ((32, 128), (128, 32))


def test_a_compared_weights_file_of_another_attention_variant_is_built_as_its_own(tmp_path, monkeypatch):
    """A --compare weights file was built as the first model's model.attn: kv_bias weights beside a softmax checkpoint
    were refused with 'set model.attn=kv_bias', which the checkpoint's own check then refused (no comparison could be
    made); plain weights beside a kv_bias checkpoint loaded into a kv_bias model with zero sinks, silently. Each is
    now built as the variant its keys hold (the model's keys are the file's), and its energies are those of the
    train.py checkpoint the file was saved from."""
    from models.sink_weights import model_variant

    built = []
    load_compare = mechanism.load_compare
    monkeypatch.setattr(mechanism, "load_compare", lambda *a: built.append(load_compare(*a)) or built[-1])
    for first_attn, other_attn in (("softmax", "kv_bias"), ("kv_bias", "softmax")):
        folder = tmp_path / first_attn
        folder.mkdir()
        base = make_checkpoint(folder / "base.pt", 0, **{"model.attn": first_attn})
        other = make_checkpoint(folder / "other.pt", 1, **{"model.attn": other_attn})
        weights = folder / "other.pth"
        state = torch.load(other, weights_only=True)["model"]
        torch.save(state, weights)
        assert any(".sink_" in k for k in state) == (other_attn == "kv_bias")
        results = [mechanism.main(["energies", "--checkpoint", base, "--compare", str(compare),
                                   "--out", str(folder / name)])
                   for compare, name in ((other, "from_checkpoint"), (weights, "from_weights"))]
        assert model_variant(built[-1].model) == other_attn and set(built[-1].model.state_dict()) == set(state)
        energies = [[r["energy"] for r in res["rows"] if r["label"] == res["labels"][1]] for res in results]
        assert len(energies[0]) == 8 and energies[0] == pytest.approx(energies[1], rel=1e-6)


def test_a_compared_weights_file_the_load_refuses_is_named_as_compare(tmp_path, capsys, monkeypatch):
    """The load's refusal of a --compare weights file named model.pretrained=<absolute path>, a key the user had not
    typed, and an EMA copy alone was advised saved 'to start from it'; it names --compare as given, and the advice,
    followed, draws the comparison."""
    monkeypatch.chdir(tmp_path)
    base = make_checkpoint(tmp_path / "base.pt", 0)
    state = torch.load(make_checkpoint(tmp_path / "other.pt", 1), weights_only=True)["model"]
    torch.save({"state_dict_ema": state}, "ema_only.pth")
    err = refusal(capsys, ["energies", "--checkpoint", base, "--compare", "ema_only.pth", "--out", "e"])
    assert err == ("error: --compare ema_only.pth holds only an EMA copy of the weights ('state_dict_ema'), no raw "
                   "weights: to compare it, save it as a file of its own, "
                   "torch.save(torch.load(PATH)['state_dict_ema'], 'ema.pth'), and give that as --compare")
    torch.save(torch.load("ema_only.pth")["state_dict_ema"], "ema.pth")  # the advice, PATH the file
    result = mechanism.main(["energies", "--checkpoint", base, "--compare", "ema.pth", "--out", "e"])
    assert result["labels"] == ["Baseline", "ema.pth"]
    (tmp_path / "garbage.pth").write_bytes(b"not a torch file")
    err = refusal(capsys, ["energies", "--checkpoint", base, "--compare", "garbage.pth", "--out", "e2"])
    assert err.startswith("error: --compare garbage.pth is not a torch or safetensors weights file (a text file"), err
    assert "model.pretrained" not in err and str(tmp_path) not in err, err

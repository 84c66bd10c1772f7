"""scripts/mechanism.py: each figure's math against a direct computation written here, on tiny random timm
models (tests/cd_models.py), and the command line (files written, overwrite refused, one-line errors).

References: Sec. 3.1, Eq. (1)-(2); Sec. 3.2, Eq. (7)-(8); App. A.1, Eq. (13); App. A.2, Eq. (23).
"""
import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import train
from cd_models import normalized, tiny_swin, tiny_vit
from configs import load_config
from tests.conftest import DEMO_CONFIG, ROOT, check_overwrite_keeps_others_files

import mechanism

SCRIPT = os.path.join(ROOT, "scripts", "mechanism.py")


def randomize_biases(model: nn.Module, seed: int = 0) -> nn.Module:
    """Non-zero linear biases (timm initialises them to zero, which would hide a dropped bias)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear) and m.bias is not None:
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=gen))
    return model


# --- App. A.1, Eq. (13): alignment ----------------------------------------------------------------------
def test_alignment_matches_a_direct_svd():
    model = tiny_vit()
    for name, block in mechanism.ffn_blocks(model):
        w1 = block.mlp.fc1.weight.detach().double()  # (hidden 128, dim 32)
        w2 = block.mlp.fc2.weight.detach().double()  # (dim 32, hidden 128)
        u, s, _ = torch.linalg.svd(w1, full_matrices=False)
        expected = torch.empty(u.shape[1], w2.shape[0], dtype=torch.float64)
        for i in range(u.shape[1]):
            for j in range(w2.shape[0]):
                expected[i, j] = abs(torch.dot(w2[j] / torch.linalg.vector_norm(w2[j]), u[:, i]))
        alpha, sv = mechanism.alignment(block.mlp.fc1.weight, block.mlp.fc2.weight)
        assert alpha.shape == (32, 32)
        torch.testing.assert_close(alpha, expected, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(sv, torch.linalg.svdvals(w1))
        assert float(alpha.max()) <= 1 + 1e-12  # |cos| of unit vectors


def test_ranking_is_by_the_strongest_row_of_each_direction():
    model = tiny_vit()
    rows, alphas = mechanism.rank_directions(mechanism.ffn_pairs(model))
    assert len(rows) == 2 * 32 and [r["rank"] for r in rows] == list(range(64))
    assert all(a["alpha"] >= b["alpha"] for a, b in zip(rows, rows[1:]))
    for r in rows[:5]:
        alpha = alphas[r["block"]]
        assert r["alpha"] == pytest.approx(float(alpha[r["direction"]].max()))
        assert r["row"] == int(alpha[r["direction"]].argmax())
        w2 = model.get_submodule(r["block"]).mlp.fc2.weight.detach().double()
        # gain = s_i |w2_j . u_i|, the factor of the term in Eq. (1)
        assert r["gain"] == pytest.approx(r["singular_value"] * r["alpha"] * float(w2[r["row"]].norm()))


# --- App. A.1: removing directions ------------------------------------------------------------------------
@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_removing_k_directions_drops_the_rank_by_k_and_keeps_the_rest(k):
    w1 = tiny_vit().blocks[0].mlp.fc1.weight.detach()  # (128, 32), full rank 32
    removed = [0, 5, 2][:k]
    before = torch.linalg.svdvals(w1.double())
    after_w = mechanism.remove_directions(w1, removed)
    assert after_w.dtype == w1.dtype and after_w.shape == w1.shape
    # the rank in the stored dtype (fp32): a removed value is left at fp32 rounding of W, ~1e-7 s_max
    assert int(torch.linalg.matrix_rank(after_w)) == 32 - k
    after = torch.linalg.svdvals(after_w.double())
    kept = [i for i in range(32) if i not in removed]
    torch.testing.assert_close(after[:32 - k], before[kept], rtol=1e-5, atol=1e-6)
    assert all(float(v) < 1e-5 * float(before[0]) for v in after[32 - k:])  # the removed ones: zero
    if k == 0:
        assert torch.equal(after_w, w1)


def test_model_without_changes_only_the_named_fc1_weights():
    model = tiny_vit()
    copy = mechanism.model_without(model, [{"block": "blocks.1", "direction": 3}])
    before, after = model.state_dict(), copy.state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed == ["blocks.1.mlp.fc1.weight"]
    assert int(torch.linalg.matrix_rank(after["blocks.1.mlp.fc1.weight"])) == 31


def test_model_without_takes_a_wrapped_model_as_ffn_pairs_does():
    class Wrapper(nn.DataParallel):  # a DataParallel on no device: the model as `.module`
        def __init__(self, model: nn.Module) -> None:
            nn.Module.__init__(self)  # DataParallel's own would move the model to a GPU where there is one
            self.module, self.device_ids = model, []

    wrapped = Wrapper(tiny_vit())
    copy = mechanism.model_without(wrapped, [{"block": "blocks.1", "direction": 3}])
    before, after = wrapped.state_dict(), copy.state_dict()
    assert [k for k in before if not torch.equal(before[k], after[k])] == ["module.blocks.1.mlp.fc1.weight"]
    assert int(torch.linalg.matrix_rank(after["module.blocks.1.mlp.fc1.weight"])) == 31


# --- Sec. 3.2, Eq. (7)-(8): the surrogate ------------------------------------------------------------------
def test_surrogate_equals_the_ffn_when_the_activation_is_the_identity():
    torch.manual_seed(0)
    model = randomize_biases(tiny_vit()).eval()
    images = torch.randn(3, 3, 32, 32)
    blocks = mechanism.ffn_blocks(model)
    gelu = mechanism.capture_ffn(model, blocks, images)
    for _, block in blocks:
        block.mlp.act = nn.Identity()
    norm2_out = {}
    hooks = [b.norm2.register_forward_hook(lambda m, i, o, n=n: norm2_out.__setitem__(n, o.flatten(0, -2)))
             for n, b in blocks]
    captured = mechanism.capture_ffn(model, blocks, images)
    for h in hooks:
        h.remove()
    for name, block in blocks:
        z, real = captured[name]
        assert z.shape == (3 * 17, 32)  # 16 patches + cls per image
        torch.testing.assert_close(z, norm2_out[name])  # the FFN input is norm2(x)
        with torch.no_grad():
            # with the biases kept, the surrogate is the branch with phi = identity
            torch.testing.assert_close(mechanism.ffn_surrogate(block.mlp, z, bias=True), real)
            # the paper's Eq. (8) has no biases: W_F2 W_F1 z exactly
            w1, w2 = block.mlp.fc1.weight.double(), block.mlp.fc2.weight.double()
            torch.testing.assert_close(mechanism.ffn_surrogate(block.mlp, z).double(),
                                       z.double() @ (w2 @ w1).T, rtol=1e-5, atol=1e-5)
        # and with GELU the real output is not the surrogate (the hooks saw another function)
        assert not torch.allclose(gelu[name][1], real, atol=1e-3)


def test_surrogate_without_biases_equals_the_ffn_of_a_bias_free_model():
    model = tiny_vit().eval()  # timm initialises the linear biases to zero
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear) and m.bias is not None:
                m.bias.zero_()
    blocks = mechanism.ffn_blocks(model)
    for _, block in blocks:
        block.mlp.act = nn.Identity()
    captured = mechanism.capture_ffn(model, blocks, torch.randn(2, 3, 32, 32))
    for name, block in blocks:
        z, real = captured[name]
        with torch.no_grad():
            torch.testing.assert_close(mechanism.ffn_surrogate(block.mlp, z), real)


# --- Sec. 3.1, Eq. (2) with App. A.2, Eq. (23): pair energies ----------------------------------------------
def direct_energies(model: nn.Module, blocks: list[str]) -> dict:
    """(role, block) -> (||W2 W1n||_F^2, ||W2 W1||_F^2), written from the parameter names."""
    P = {k: v.detach().double() for k, v in model.state_dict().items()}
    out = {}
    for b in blocks:
        qkv = P[f"{b}.attn.qkv.weight"]
        d = qkv.shape[0] // 3
        for role, w2, w1 in (("qkv", qkv, torch.diag(P[f"{b}.norm1.weight"])),
                             ("proj", P[f"{b}.attn.proj.weight"], qkv[2 * d:]),
                             ("fc1", P[f"{b}.mlp.fc1.weight"], torch.diag(P[f"{b}.norm2.weight"])),
                             ("fc2", P[f"{b}.mlp.fc2.weight"], P[f"{b}.mlp.fc1.weight"])):
            out[(role, b)] = (float(torch.linalg.matrix_norm(w2 @ normalized(w1)) ** 2),
                              float(torch.linalg.matrix_norm(w2 @ w1) ** 2))
    return out


def test_energies_match_a_direct_computation():
    model = tiny_vit()
    rows = mechanism.pair_energies(model)
    expected = direct_energies(model, ["blocks.0", "blocks.1"])
    assert len(rows) == len(expected) == 8
    for r in rows:
        energy, raw = expected[(r["role"], r["block"])]
        assert r["energy"] == pytest.approx(energy, rel=1e-5)
        assert r["energy_raw"] == pytest.approx(raw, rel=1e-9)


def test_energies_include_swin_patch_merging():
    model = tiny_swin()
    rows = [r for r in mechanism.pair_energies(model) if r["role"] == "reduction"]
    assert len(rows) == 1
    red = model.get_submodule(rows[0]["block"])
    w2, g = red.reduction.weight.detach().double(), red.norm.weight.detach().double()
    assert rows[0]["energy"] == pytest.approx(float(((w2 * g) ** 2).sum() / (g ** 2).mean()), rel=1e-5)
    assert len(mechanism.ffn_blocks(model)) == 4  # layers.N.blocks.M, flattened


# --- the command line ---------------------------------------------------------------------------------------
def make_checkpoint(path, seed: int = 0, **overrides) -> str:
    """A train.py-shaped checkpoint ({"model", "config"}) of a random vit_nano on digits, in milliseconds."""
    from configs import config_to_dict, load_config
    from models import build_model

    cfg = load_config([DEMO_CONFIG], [f"{k}={v}" for k, v in {"model.name": "vit_nano", **overrides}.items()])
    torch.manual_seed(seed)
    model = randomize_biases(build_model(cfg.model), seed)
    torch.save({"model": model.state_dict(), "config": config_to_dict(cfg)}, path)
    return str(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt")
    return (make_checkpoint(folder / "base.pt", 0),
            make_checkpoint(folder / "cd.pt", 1, **{"cd.enabled": "true"}))


def test_alignment_and_energies_write_their_files_and_refuse_to_overwrite(checkpoints, tmp_path, capsys):
    base, cd = checkpoints
    out = str(tmp_path / "figs")
    result = mechanism.main(["alignment", "--checkpoint", base, "--out", out])
    with open(os.path.join(out, "alignment.csv")) as f:
        lines = f.read().splitlines()
    assert lines[0] == "rank,block,block_index,direction,row,alpha,singular_value,gain"
    assert len(lines) == 1 + 2 * 32 and len(result["ranked"]) == 64
    result = mechanism.main(["energies", "--checkpoint", base, "--compare", cd, "--out", out])
    assert result["labels"] == ["Baseline", "CD"] and len(result["rows"]) == 16
    for name in ("alignment.png", "energies.png", "energies.csv"):
        assert os.path.getsize(os.path.join(out, name)) > 0
    mtime = os.path.getmtime(os.path.join(out, "energies.png"))
    with pytest.raises(mechanism.MechanismError, match="already exist.*--overwrite"):
        mechanism.main(["energies", "--checkpoint", base, "--out", out])
    assert os.path.getmtime(os.path.join(out, "energies.png")) == mtime
    mechanism.main(["energies", "--checkpoint", base, "--out", out, "--overwrite"])
    with open(os.path.join(out, "energies.csv")) as f:
        assert len(f.read().splitlines()) == 1 + 8  # one model now


@pytest.mark.slow  # scores digits images per removed direction (about 16 s)
def test_surrogate_and_remove_on_digits_images(checkpoints, tmp_path):
    base, _ = checkpoints
    out = str(tmp_path / "figs")
    result = mechanism.main(["surrogate", "--checkpoint", base, "--out", out, "--images", "2",
                             "--blocks", "1"])
    assert [r["block"] for r in result["blocks"]] == ["blocks.1"]
    assert result["blocks"][0]["tokens"] == 2 * 17 and -1 <= result["blocks"][0]["pearson"] <= 1
    lm = tmp_path / "lm"
    train.main(load_config([os.path.join(ROOT, "configs/lm/kjv_nano.yaml")],
                           [f"out_dir={lm}", "sched.steps=2", "sched.warmup_steps=1", "train.eval_every_steps=2"]))
    with pytest.raises(mechanism.MechanismError, match=r"^`surrogate`: .* is a language model \(data.dataset=kjv\)"):
        mechanism.main(["surrogate", "--checkpoint", str(lm / "best.pt"), "--out", str(tmp_path / "lm_figs" / "a")])
    with pytest.raises(mechanism.MechanismError, match=r"--images 100000: the val split has \d+ images"):
        mechanism.main(["surrogate", "--checkpoint", base, "--out", str(tmp_path / "many"), "--images", "100000"])
    # a refusal leaves no folder it made (both levels of lm_figs/a), and the folders it did not make stay
    assert not (tmp_path / "lm_figs").exists() and not (tmp_path / "many").exists() and lm.is_dir()
    mechanism.main(["remove", "--checkpoint", base, "--out", out, "--k", "1", "quant.calib_images=4"])
    with open(os.path.join(out, "remove.json")) as f:
        saved = json.load(f)
    assert [r["k"] for r in saved["results"]] == [0, 1] and saved["pipeline"] == "repq"
    assert saved["results"][1]["removed"][0]["block"] in ("blocks.0", "blocks.1")
    for r in saved["results"]:
        assert 0 <= r["fp_top1"] <= 100 and 0 <= r["quant_top1"] <= 100
        assert 0 < r["max_act_ffn"] <= r["max_act_module"] and r["max_act_block"] > 0
    for name in ("surrogate.png", "surrogate.csv", "remove.png"):
        assert os.path.getsize(os.path.join(out, name)) > 0


def test_remove_takes_out_the_top_k_directions_and_reads_fc2(checkpoints, tmp_path, monkeypatch):
    """`remove --k 2`: step k zeroes the top k directions of a ranking written here (App. A.1), not only the
    k-th; FP top-1, the block maximum and max_act_ffn (max |mlp.fc2 output|) are those of a model rebuilt here
    as U S' V^T; and the quantized model is that same model (the quantization itself is spied out)."""
    from data import build_eval_loader
    from models import build_model

    base, _ = checkpoints
    quantized = []  # the FC1 weights of each model handed to the quantization

    def spy(pipeline, model, *args, **kwargs):
        quantized.append({f"blocks.{i}": b.mlp.fc1.weight.detach().clone() for i, b in enumerate(model.blocks)})
        return {"top1": 0.0}
    monkeypatch.setattr(mechanism, "evaluate_quantized", spy)
    result = mechanism.main(["remove", "--checkpoint", base, "--out", str(tmp_path / "r"), "--k", "2"])
    cfg = load_config([DEMO_CONFIG], ["model.name=vit_nano"])  # as make_checkpoint built it
    model = build_model(cfg.model)
    model.load_state_dict(torch.load(base, weights_only=True)["model"])
    model.eval()
    svd, ranking = {}, []
    for i, block in enumerate(model.blocks):
        w1, w2 = block.mlp.fc1.weight.detach().double(), block.mlp.fc2.weight.detach().double()
        svd[i] = torch.linalg.svd(w1, full_matrices=False)
        u = svd[i][0]
        for d in range(u.shape[1]):  # alpha_d = max_j |w2_j . u_d| / |w2_j| (Eq. (13))
            alpha = max(abs(float(w2[j] @ u[:, d])) / float(w2[j].norm()) for j in range(w2.shape[0]))
            ranking.append((alpha, i, d))
    top = [(f"blocks.{i}", d) for _, i, d in sorted(ranking, reverse=True)[:2]]
    loader = build_eval_loader(cfg.data, img_size=32, batch_size_per_gpu=360, rank=0, world_size=1, num_classes=10)
    assert [r["k"] for r in result["results"]] == [0, 1, 2] and len(quantized) == 3
    for r, weights in zip(result["results"], quantized):
        k = r["k"]
        assert [(x["block"], x["direction"]) for x in r["removed"]] == top[:k]
        ref = copy.deepcopy(model)
        with torch.no_grad():
            for i, block in enumerate(ref.blocks):
                u, s, vh = svd[i]
                s = s.clone()
                s[[d for b, d in top[:k] if b == f"blocks.{i}"]] = 0
                block.mlp.fc1.weight.copy_((u @ torch.diag(s) @ vh).float())
        for name, w in weights.items():
            torch.testing.assert_close(w, ref.get_submodule(name).mlp.fc1.weight, rtol=0, atol=1e-5)
        seen = {"fc2": 0.0, "block": 0.0}
        hooks = [m.register_forward_hook(lambda m, i, o, key=key: seen.__setitem__(
                 key, max(seen[key], float(o.abs().max())))) for b in ref.blocks for key, m in (("fc2", b.mlp.fc2),
                                                                                             ("block", b))]
        correct = total = 0
        with torch.no_grad():
            for x, y in loader:
                correct += int((ref(x).argmax(dim=1) == y).sum())
                total += len(y)
        for h in hooks:
            h.remove()
        assert r["fp_top1"] == pytest.approx(100 * correct / total, abs=100 / total + 1e-9)
        assert r["max_act_ffn"] == pytest.approx(seen["fc2"], rel=1e-4)
        assert r["max_act_block"] == pytest.approx(seen["block"], rel=1e-4)


def test_remove_takes_every_direction_of_the_chosen_blocks_and_refuses_one_more(checkpoints, tmp_path, monkeypatch):
    """`--k` may be the number of directions of the chosen blocks (vit_nano: 32 per block), not one more; the
    scoring is stubbed out (this is about the count), so the 33 steps take a second."""
    base, _ = checkpoints
    monkeypatch.setattr(mechanism, "evaluate", lambda model, loader, device: {"top1": 0.0})
    monkeypatch.setattr(mechanism, "evaluate_quantized", lambda *args, **kwargs: {"top1": 0.0})
    result = mechanism.main(["remove", "--checkpoint", base, "--out", str(tmp_path / "all"), "--blocks", "0",
                             "--k", "32"])
    assert [r["k"] for r in result["results"]] == list(range(33))
    assert sorted(x["direction"] for x in result["results"][-1]["removed"]) == list(range(32))
    with pytest.raises(mechanism.MechanismError, match=r"^--k 33: the chosen blocks have only 32 directions"):
        mechanism.main(["remove", "--checkpoint", base, "--out", str(tmp_path / "more"), "--blocks", "0", "--k", "33"])


def test_alignment_of_a_swin_with_stages_of_different_widths(tmp_path):
    ckpt = make_checkpoint(tmp_path / "swin.pt", 0, **{"model.name": "swin_nano"})
    result = mechanism.main(["alignment", "--checkpoint", ckpt, "--out", str(tmp_path / "o")])
    # swin_nano: one block of width 32 (r = 32) and one of width 64 (r = 64)
    assert sorted({(r["block"], r["block_index"]) for r in result["ranked"]}) == [
        ("layers.0.blocks.0", 0), ("layers.1.blocks.0", 1)]
    assert len(result["ranked"]) == 32 + 64
    assert os.path.getsize(tmp_path / "o" / "alignment.png") > 0


def test_a_weights_file_with_a_model_name_works(checkpoints, tmp_path):
    base, _ = checkpoints
    weights = tmp_path / "w.pth"
    torch.save(torch.load(base, weights_only=True)["model"], weights)
    a = mechanism.main(["alignment", "--checkpoint", base, "--out", str(tmp_path / "a")])
    b = mechanism.main(["alignment", "--model", "vit_nano", "--weights", str(weights), "model.num_classes=10",
                        "--out", str(tmp_path / "b")])
    assert [r["alpha"] for r in a["ranked"]] == [r["alpha"] for r in b["ranked"]]


@pytest.fixture
def figures_not_drawn(monkeypatch):
    """The subcommands' figures laid out and saved as empty files: drawing them (tight_layout, savefig: seconds per
    figure on a busy CPU) is what test_alignment_and_energies_write_their_files_and_refuse_to_overwrite checks; a
    test of what a subcommand loads and computes does not read them."""
    from matplotlib.figure import Figure

    def save_empty(self, path, *args, **kwargs):
        with open(path, "wb"):
            pass

    monkeypatch.setattr(Figure, "tight_layout", lambda self, *args, **kwargs: None)
    monkeypatch.setattr(Figure, "savefig", save_empty)


def test_a_backbone_without_classifier_is_read_by_alignment_and_energies_but_not_scored(checkpoints, tmp_path,
                                                                                        figures_not_drawn):
    """Backbones are published without a classifier (DINOv2, MAE): alignment and energies, which read the blocks'
    matrices alone, take such a file as it is (they refused it as not fitting the model); remove scores top-1 and
    still refuses it, and so does alignment for a file that lacks a block matrix. The figures are not drawn
    (figures_not_drawn)."""
    from models import ModelError

    base, _ = checkpoints
    state = torch.load(base, weights_only=True)["model"]
    backbone = tmp_path / "backbone.pth"
    torch.save({k: v for k, v in state.items() if not k.startswith("head.")}, backbone)
    a = mechanism.main(["alignment", "--checkpoint", base, "--out", str(tmp_path / "a")])
    b = mechanism.main(["alignment", "--model", "vit_nano", "--weights", str(backbone), "--out", str(tmp_path / "b")])
    assert [r["alpha"] for r in a["ranked"]] == [r["alpha"] for r in b["ranked"]]
    e = mechanism.main(["energies", "--checkpoint", base, "--compare", str(backbone), "--out", str(tmp_path / "e")])
    energies = [[r["energy"] for r in e["rows"] if r["label"] == label] for label in e["labels"]]
    assert len(energies[0]) == 8 and energies[0] == energies[1]  # vit_nano: 2 blocks x 4 pairs
    with pytest.raises(ModelError, match=r"does not fit VisionTransformer: missing \['head.weight', 'head.bias'\]"):
        mechanism.main(["remove", "--model", "vit_nano", "--weights", str(backbone), "model.num_classes=10",
                        "--out", str(tmp_path / "r")])
    lacking = tmp_path / "lacking.pth"
    torch.save({k: v for k, v in state.items() if k != "blocks.0.mlp.fc2.weight"}, lacking)
    with pytest.raises(ModelError, match=r"missing \['blocks.0.mlp.fc2.weight'\]"):
        mechanism.main(["alignment", "--model", "vit_nano", "--weights", str(lacking), "--out", str(tmp_path / "l")])


@pytest.mark.parametrize("argv, expected", [
    (["alignment", "--checkpoint", "missing.pt", "--out", "{out}"], "--checkpoint missing.pt: no such file"),
    (["alignment", "--out", "{out}"], "nothing to load"),
    (["alignment", "--checkpoint", "{ckpt}", "--model", "vit_nano", "--out", "{out}"], "not both"),
    (["alignment", "--model", "vit_nano", "--weights", "no.pth", "--out", "{out}"], "--weights no.pth"),
    (["alignment", "--checkpoint", "{ckpt}", "--out", "{out}", "--blocks", "7"], "--blocks 7: no such block"),
    (["remove", "--checkpoint", "{ckpt}", "--out", "{out}", "--bits", "w4a16"],  # was a ValueError traceback
     "--pipeline repq --bits w4a16: repq quantizes activations"),
    (["energies", "--checkpoint", "{ckpt}", "--out", "{out}", "--compare", "no.pt"], "--compare no.pt"),
    (["alignment", "--checkpoint", "{ckpt}", "--out", "{out}", "optim.lrr=1"], "did you mean 'optim.lr'"),
    (["energies", "--checkpoint", "{ckpt}", "--out", "{ckpt}"], "is a file; give a folder"),
    # a setting the subcommand does not read, or one its own flag sets, is refused (each ran ignoring it)
    (["remove", "--checkpoint", "{ckpt}", "--out", "{out}", "--k", "0", "quant.bits=[w3a3]"],
     "quant.bits=[w3a3]: `remove` sets quant.bits from --bits; give --bits instead"),
    (["remove", "--checkpoint", "{ckpt}", "--out", "{out}", "quant={{pipelines: [percentile]}}"],
     "`remove` sets quant.pipelines from --pipeline"),
    (["remove", "--checkpoint", "{ckpt}", "--out", "{out}", "--pipeline", "percentile", "quant.repq.reparam=false"],
     "`remove` does not read quant.repq.reparam"),
    (["surrogate", "--checkpoint", "{ckpt}", "--out", "{out}", "train.device=cpu"], "give --device instead"),
    (["alignment", "--checkpoint", "{ckpt}", "--out", "{out}", "data.dataset=folder", "data.root=/nonexistent"],
     "data.dataset=folder: `alignment` does not read data.dataset (it reads model.*); drop it"),
    (["energies", "--checkpoint", "{ckpt}", "--out", "{out}", "optim.lr=0.01"], "`energies` does not read optim.lr"),
    # keys of a section a subcommand reads that it still does not read (all were accepted and ignored)
    (["surrogate", "--checkpoint", "{ckpt}", "--out", "{out}", "data.hflip=0"],
     "data.hflip=0: `surrogate` does not read data.hflip (a setting of the training transform"),
    (["remove", "--checkpoint", "{ckpt}", "--out", "{out}", "data.scale=[0.5,1.0]"],
     "`remove` does not read data.scale (a setting of the training transform, and it reads eval-transform images"),
    (["remove", "--checkpoint", "{ckpt}", "--out", "{out}", "data.auto_augment=''"],
     "`remove` does not read data.auto_augment"),
    (["remove", "--checkpoint", "{ckpt}", "--out", "{out}", "data.mixup=0"],
     "`remove` does not read data.mixup (a setting of training batches)"),
    (["surrogate", "--checkpoint", "{ckpt}", "--out", "{out}", "data.label_smoothing=0"],
     "`surrogate` does not read data.label_smoothing (a setting of training batches)"),
    (["alignment", "--checkpoint", "{ckpt}", "--out", "{out}", "model.drop_path=0.2"],
     "`alignment` does not read model.drop_path (a training-mode setting, and the model is read in eval mode)"),
    (["energies", "--checkpoint", "{ckpt}", "--out", "{out}", "--config", "{drop_path_yaml}"],
     "changes model.drop_path: 0.0 -> 0.3 over "),
    # a module pattern that names no module was recorded as probed while adding nothing
    (["remove", "--checkpoint", "{ckpt}", "--out", "{out}", 'quant.act_max_extra_modules=["nosuch.module"]'],
     "quant.act_max_extra_modules: 'nosuch.module' names no module of VisionTransformer"),
    # a --config layer over the checkpoint's own: CD's recipe relabelled a baseline's weights "CD"
    (["energies", "--checkpoint", "{ckpt}", "--out", "{out}", "--config", "configs/method/cd.yaml"],
     "--config configs/method/cd.yaml changes cd.enabled: False -> True over "),
    (["energies", "--checkpoint", "{ckpt}", "--out", "{out}", "model.name=vit_small_patch16_224"],
     "model.name=vit_small_patch16_224: the model and its weights come from --checkpoint "),
    # the flag's own model.name item beside the user's: the flag's refusal, not a key given twice
    (["alignment", "--model", "vit_nano", "--weights", "{ckpt}", "--out", "{out}", "model.name=vit_tiny_patch16_224"],
     "model.name=vit_tiny_patch16_224: `alignment` sets model.name from --model; give --model instead"),
])
def test_user_errors_are_one_error_line(checkpoints, tmp_path, capsys, argv, expected):
    drop_path_yaml = tmp_path / "drop_path.yaml"
    drop_path_yaml.write_text("model:\n  drop_path: 0.3\n")
    argv = [a.format(out=tmp_path / "o", ckpt=checkpoints[0], drop_path_yaml=drop_path_yaml) for a in argv]
    assert mechanism.cli(argv) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines
    assert not (tmp_path / "o").exists()  # a refused command leaves no empty output folder behind


@pytest.mark.parametrize("argv, expected", [
    (["surrogate", "--checkpoint", "{ckpt}", "--out", "{out}", "--images", "0"], "--images: 0: must be at least 1"),
    (["alignment", "--checkpoint", "{ckpt}"], "the following arguments are required: --out"),
    (["alignment", "--checkpoint", "{ckpt}", "--out", "{out}", "--k", "2"], "unrecognized arguments"),
    (["figures", "--checkpoint", "{ckpt}", "--out", "{out}"], "unknown subcommand 'figures'"),
    (["energies", "--checkpoint", "{ckpt}", "--out", "{out}", "--device", "cuda"], "unrecognized arguments: --device"),
    (["alignment", "--checkpoint", "{ckpt}", "--out", "{out}", "--device", "cpu"], "unrecognized arguments: --device"),
    # a value a flag refuses on its own (these exited 1, after parsing): a usage error as argparse's
    (["alignment", "--checkpoint", "{ckpt}", "--out", "{out}", "--threads", "0"], "--threads: 0: must be at least 1"),
    (["remove", "--checkpoint", "{ckpt}", "--out", "{out}", "--k", "-1"], "--k: -1: must be at least 0"),
    (["remove", "--checkpoint", "{ckpt}", "--out", "{out}", "--bits", "w4"],
     "--bits w4: bit-width 'w4' is not of the form 'w4a4'"),
    (["energies", "--checkpoint", "{ckpt}", "--out", "{out}", "--labels", "a", "b"],
     "--labels a b: give one label per model (1)"),
    (["alignment", "--checkpoint", "{ckpt}", "--out", "{out}", "--blocks"],  # ran on every block
     "--blocks without a block: give 0-based positions or names, or drop --blocks for all"),
    (["alignment", "--checkpoint", "{ckpt}", "--out", "{out}", "--blocks", "data.root=x"],  # an override, no block
     "--blocks without a block"),
    (["energies", "--checkpoint", "{ckpt}", "--out", "{out}", "--labels"],  # drew the default labels
     "--labels without a label: give one per model, or drop --labels for the defaults"),
])
def test_usage_errors_are_one_error_line_with_status_2(checkpoints, tmp_path, capsys, argv, expected):
    """argparse's own refusals (and an unknown subcommand): the same one line, with argparse's status 2."""
    argv = [a.format(out=tmp_path / "o", ckpt=checkpoints[0]) for a in argv]
    with pytest.raises(SystemExit) as done:
        mechanism.cli(argv)
    assert done.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: mechanism.py") and expected in lines[0], lines
    assert lines[0].endswith(" --help"), lines  # names where the usage is
    assert not (tmp_path / "o").exists()


def test_an_existing_output_is_one_error_line_from_the_script(checkpoints, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "alignment.csv").write_text("mine")
    proc = subprocess.run([sys.executable, SCRIPT, "alignment", "--checkpoint", checkpoints[0],
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and "--overwrite" in lines[0]
    assert (out / "alignment.csv").read_text() == "mine" and not (out / "alignment.png").exists()


def test_ema_without_ema_weights_is_refused(checkpoints, tmp_path, capsys):
    """--ema beside a bare state dict (--weights, or a --compare weights file) was dropped silently: the
    numbers were those of the only weights there are."""
    payload = torch.load(checkpoints[0], weights_only=True)
    weights, with_ema = tmp_path / "w.pth", tmp_path / "ema.pt"
    torch.save(payload["model"], weights)
    torch.save({**payload, "model_ema": payload["model"]}, with_ema)
    for argv, expected in (
            (["--model", "vit_nano", "--weights", str(weights), "model.num_classes=10"],
             f"--ema: --weights {weights} is one set of weights, with no EMA copy"),
            (["--checkpoint", str(with_ema), "--compare", str(weights)],
             f"--ema: --compare {weights} is a weights file, with no EMA copy")):
        assert mechanism.cli(["energies", *argv, "--ema", "--out", str(tmp_path / "o")]) == 1
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines
    assert not (tmp_path / "o").exists()


def test_strongest_cells_crop_the_rows_of_the_chosen_directions():
    """The crop's FC2 rows are the strongest among the chosen directions, not over every direction
    (written out by hand: row 3 peaks in direction 2 only, which is not chosen)."""
    alpha = torch.tensor([[0.9, 0.0, 0.0, 0.0],
                          [0.85, 0.1, 0.0, 0.0],
                          [0.0, 0.0, 0.0, 0.8],
                          [0.2, 0.2, 0.1, 0.1]], dtype=torch.float64)
    assert mechanism.strongest_cells(alpha, 2) == ([0, 1], [0, 1])


def test_surrogate_stats_match_a_direct_count():
    """The top-1% sign agreement, maxima and channel figures against a loop over the entries."""
    gen = torch.Generator().manual_seed(0)
    real = torch.randn(50, 8, generator=gen, dtype=torch.float64)
    sur = real.clone()
    order = real.flatten().abs().argsort(descending=True)
    flipped = order[:4]  # the top 1% is the 4 largest of 400 entries: flip the signs of 3 of them
    sur.view(-1)[flipped[1:]] *= -1
    sur.view(-1)[order[4]] *= -1  # outside the top 1%: must not count
    sur[:, 5] *= 3.0  # channel 5 carries the surrogate's largest outputs
    stats = mechanism.surrogate_stats("b", real, sur)
    assert stats["top1pct_sign_agreement"] == 0.25
    assert stats["max_abs_real"] == round(max(abs(v) for v in real.flatten().tolist()), 4)
    assert stats["channel_max_surrogate"] == 5
    assert stats["channel_max_real"] == max(range(8), key=lambda c: max(abs(v) for v in real[:, c].tolist()))
    # the real outputs peak in channels 3..7, the surrogate's in 0..4: two of the top five are shared
    real, sur = torch.zeros(4, 8, dtype=torch.float64), torch.zeros(4, 8, dtype=torch.float64)
    for c in range(8):
        real[0, c], sur[1, c] = 10.0 + c, 100.0 - 10 * c
    assert mechanism.surrogate_stats("b", real, sur)["top5_channels_shared"] == 2


def test_remove_reads_the_training_transform_when_it_calibrates_on_it():
    """quant.calib_transform=train: remove's calibration images go through the training transform, whose keys it
    then reads (surrogate, on val images, never does)."""
    from configs import load_config

    cfg = load_config([], ["quant.calib_transform=train"])
    args = mechanism.parse_args(["remove", "--checkpoint", "c.pt", "--out", "o", "data.hflip=0", "data.scale=[0.5,1]"])
    mechanism.check_overrides(args, cfg)
    args = mechanism.parse_args(["surrogate", "--checkpoint", "c.pt", "--out", "o", "data.hflip=0"])
    with pytest.raises(mechanism.MechanismError, match="`surrogate` does not read data.hflip"):
        mechanism.check_overrides(args, cfg)
    # the train split: remove calibrates on it, surrogate reads val images alone
    cfg = load_config([], ["data.dataset=synthetic"])
    mechanism.check_overrides(mechanism.parse_args(["remove", "--checkpoint", "c.pt", "--out", "o",
                                                    "data.synthetic_train_size=8"]), cfg)
    args = mechanism.parse_args(["surrogate", "--checkpoint", "c.pt", "--out", "o", "data.synthetic_train_size=8"])
    with pytest.raises(mechanism.MechanismError, match=r"`surrogate` does not read data.synthetic_train_size \(a "
                                                       r"setting of the train split, and it reads val images only\)"):
        mechanism.check_overrides(args, cfg)


def test_remove_records_the_extra_modules_its_maxima_are_over(checkpoints, tmp_path, monkeypatch, figures_not_drawn):
    """quant.act_max_extra_modules sets which modules max_act_module is over: remove.json says so (the quantization
    is left out: its score is not what this checks)."""
    monkeypatch.setattr(mechanism, "evaluate_quantized", lambda *args, **kwargs: {"top1": 0.0})
    out = tmp_path / "r"
    mechanism.main(["remove", "--checkpoint", checkpoints[0], "--out", str(out), "--k", "0",
                    'quant.act_max_extra_modules=["head"]'])
    saved = json.loads((out / "remove.json").read_text())
    assert saved["act_max_extra_modules"] == ["head"]


def test_remove_records_the_settings_its_numbers_depend_on(checkpoints, tmp_path, monkeypatch, figures_not_drawn):
    """remove.json names the quantization options (quant.first_last applied), the calibration batch and the val
    data its numbers were computed with, and the overrides given: a quant.repq.reparam=false run does not read as
    one of the defaults. The scoring and the quantization are stubbed out (the record is what this checks)."""
    monkeypatch.setattr(mechanism, "evaluate", lambda model, loader, device: {"top1": 0.0})
    monkeypatch.setattr(mechanism, "evaluate_quantized", lambda *args, **kwargs: {"top1": 0.0})
    given = ["quant.repq.reparam=false", "quant.calib_seed=7", "quant.calib_images=4", "quant.first_last=w8a8",
             "data.crop_pct=0.5"]
    runs = {}
    for name, overrides in (("default", []), ("given", given)):
        mechanism.main(["remove", "--checkpoint", checkpoints[0], "--out", str(tmp_path / name), "--k", "0",
                        *overrides])
        runs[name] = json.loads((tmp_path / name / "remove.json").read_text())["settings"]
    default, other = runs["default"], runs["given"]
    assert default["quant"]["options"]["reparam"] is True and other["quant"]["options"]["reparam"] is False
    # quant.first_last=w8a8: stem and head at 8 bits (configs/quant.py FIRST_LAST_PRESETS), over repq's own None
    assert default["quant"]["options"]["head_w_bits"] is None
    assert {k: other["quant"]["options"][k] for k in ("stem_w_bits", "stem_a_bits", "head_w_bits", "head_a_bits")} \
        == {"stem_w_bits": 8, "stem_a_bits": 8, "head_w_bits": 8, "head_a_bits": 8}
    assert (default["quant"]["calibration"]["seed"], other["quant"]["calibration"]["seed"]) == (0, 7)
    assert other["quant"]["calibration"]["images"] == 4 and other["quant"]["calibration"]["transform"] == "eval"
    assert other["data"]["eval_transform"]["crop_pct"] == 0.5 != default["data"]["eval_transform"]["crop_pct"]
    assert (default["overrides"], other["overrides"]) == ([], given) and other["weights"] == "raw"


def test_remove_reads_the_options_of_the_pipeline_it_runs():
    """`remove --pipeline percentile` reads quant.percentile.* and not quant.repq.* (the other pipeline's)."""
    from configs import Config

    args = mechanism.parse_args(["remove", "--checkpoint", "c.pt", "--out", "o", "--pipeline", "percentile",
                                 "quant.percentile.act_range=minmax"])
    mechanism.check_overrides(args, Config())
    args.overrides = ["quant.repq.reparam=false"]
    with pytest.raises(mechanism.MechanismError, match="`remove` does not read quant.repq.reparam"):
        mechanism.check_overrides(args, Config())


def test_surrogate_stats_pearson_and_maxima_match_a_direct_computation():
    """Pearson's r over every entry and each side's largest |value|, against the formulas written out here (a
    surrogate correlated with the real output but not equal to it, its maximum away from the real one)."""
    gen = torch.Generator().manual_seed(1)
    real = torch.randn(30, 6, generator=gen, dtype=torch.float64)
    sur = 0.5 * real + torch.randn(30, 6, generator=gen, dtype=torch.float64)
    sur[0, 0] = -7.0
    stats = mechanism.surrogate_stats("b", real, sur)
    r, s = real.flatten().tolist(), sur.flatten().tolist()
    mr, ms = sum(r) / len(r), sum(s) / len(s)
    cov = sum((a - mr) * (b - ms) for a, b in zip(r, s))
    pearson = cov / (sum((a - mr) ** 2 for a in r) * sum((b - ms) ** 2 for b in s)) ** 0.5
    assert 0.2 < pearson < 0.9 and stats["pearson"] == pytest.approx(pearson, abs=6e-5)
    assert stats["max_abs_surrogate"] == 7.0
    assert stats["max_abs_real"] == pytest.approx(max(abs(v) for v in r), abs=6e-5)


def test_blocks_are_chosen_once_each_by_position_or_name_and_a_negative_position_is_refused():
    """`--blocks 1 blocks.1 0 1` is blocks.1 then blocks.0, each once (a block named twice would rank its
    directions twice); -1 is no 0-based position (it read as the last block)."""
    blocks = mechanism.ffn_blocks(tiny_vit())
    chosen = mechanism.select_blocks(blocks, ["1", "blocks.1", "0", "1"])
    assert [name for name, _ in chosen] == ["blocks.1", "blocks.0"]
    with pytest.raises(mechanism.MechanismError, match=r"^--blocks -1: no such block; give 0\.\.1"):
        mechanism.select_blocks(blocks, ["-1"])


def test_energies_of_two_baselines_print_their_means_and_ratio_and_refuse_another_architecture(checkpoints, tmp_path,
                                                                                              capsys):
    """Two checkpoints of one method are told apart by file name; each role's printed mean energy and the ratio
    second / first are those of direct_energies on the saved weights; a --compare of another architecture
    (swin_nano beside vit_nano) is refused, not drawn pair by pair against other pairs."""
    import re

    from models import build_model

    base, _ = checkpoints
    other = make_checkpoint(tmp_path / "other.pt", 2)
    result = mechanism.main(["energies", "--checkpoint", base, "--compare", other, "--out", str(tmp_path / "e")])
    assert result["labels"] == ["Baseline (base.pt)", "Baseline (other.pt)"]
    printed = capsys.readouterr().out
    means = []
    for path in (base, other):
        model = build_model(load_config([DEMO_CONFIG], ["model.name=vit_nano"]).model)
        model.load_state_dict(torch.load(path, weights_only=True)["model"])
        energies = direct_energies(model, ["blocks.0", "blocks.1"])
        means.append({role: (energies[(role, "blocks.0")][0] + energies[(role, "blocks.1")][0]) / 2
                      for role in ("qkv", "proj", "fc1", "fc2")})
    for role in ("qkv", "proj", "fc1", "fc2"):
        line = re.search(rf"^{role}: mean energy Baseline \(base\.pt\) (\S+), Baseline \(other\.pt\) (\S+) "
                         rf"\(ratio (\S+)\)$", printed, re.M)
        assert line, printed
        first, second, ratio = (float(v) for v in line.groups())
        assert first == pytest.approx(means[0][role], rel=1e-3) and second == pytest.approx(means[1][role], rel=1e-3)
        assert ratio == pytest.approx(means[1][role] / means[0][role], abs=1.5e-3)
    swin = make_checkpoint(tmp_path / "swin.pt", 0, **{"model.name": "swin_nano"})
    with pytest.raises(mechanism.MechanismError, match=r"--compare .*swin\.pt is of model\.name=swin_nano, "):
        mechanism.main(["energies", "--checkpoint", base, "--compare", swin, "--out", str(tmp_path / "s")])
    assert not (tmp_path / "s").exists()


def test_two_runs_of_one_method_are_told_apart_by_their_run_folders(checkpoints, tmp_path):
    """Each run's file is best.pt: the labels were 'Baseline (best.pt)' twice, in the legend, CSV and printout."""
    for run, seed in (("a", 0), ("b", 2)):
        (tmp_path / run).mkdir()
        make_checkpoint(tmp_path / run / "best.pt", seed)
    result = mechanism.main(["energies", "--checkpoint", str(tmp_path / "a" / "best.pt"),
                             "--compare", str(tmp_path / "b" / "best.pt"), "--out", str(tmp_path / "e")])
    assert result["labels"] == ["Baseline (a/best.pt)", "Baseline (b/best.pt)"]
    assert mechanism.distinct_tails(["/x/a/best.pt", "/y/a/best.pt"]) == ["x/a/best.pt", "y/a/best.pt"]


def test_a_config_layer_reaches_the_compared_checkpoint_too_and_is_checked_there(checkpoints, tmp_path):
    """--config layers over --checkpoint's config were left off --compare's: the two models were read otherwise.
    A layer of a key `energies` reads (model.*) that changes nothing here is taken for both."""
    base, cd = checkpoints
    layer = tmp_path / "layer.yaml"
    layer.write_text("model:\n  drop: 0.0\n")
    result = mechanism.main(["energies", "--checkpoint", base, "--compare", cd, "--config", str(layer),
                             "--out", str(tmp_path / "e")])
    assert result["labels"] == ["Baseline", "CD"]
    layer.write_text("cd:\n  enabled: false\n")  # the baseline's own value, CD's compared checkpoint's not
    with pytest.raises(mechanism.MechanismError, match=r"changes cd.enabled: True -> False over .*cd\.pt's own"):
        mechanism.main(["energies", "--checkpoint", base, "--compare", cd, "--config", str(layer),
                        "--out", str(tmp_path / "f")])


@pytest.mark.parametrize("command, foreign", [("energies", "energies.png"), ("energies", "energies.csv"),
                                              ("alignment", "alignment.csv")])
def test_overwrite_replaces_only_the_files_mechanism_wrote(checkpoints, tmp_path, command, foreign):
    """--overwrite replaced any surrogate / alignment / remove / energies file of its name in --out: a paper's
    figure or another script's table of that name was lost. The script marks its outputs (a PNG's text entry Source,
    a CSV's header of its columns, a JSON's keys) and replaces only those, refusing any other before any work with
    one error naming the file and leaving every file as it was; the reference is the files' bytes before."""
    base, _ = checkpoints
    out = tmp_path / "figs"
    argv = [command, "--checkpoint", base, "--out", str(out)]
    other = b"\x89PNG\r\n\x1a\nsomeone's figure" if foreign.endswith(".png") else b"name,value\nlr,0.1\n"
    check_overwrite_keeps_others_files(lambda extra: mechanism.main(argv + extra), out, foreign, other,
                                       mechanism.MechanismError, f"{out / foreign} is not a file mechanism.py wrote")

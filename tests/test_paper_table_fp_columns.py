"""scripts/paper_table.py checks every float column it prints: a language model's table shows FP32 and BF16
perplexity, and a NaN BF16 PPL (a bare NaN in the JSON: a loss that was NaN in bf16) was printed as `nan ± nan`
with status 0. An older result without ppl_bf16 shows '-' (or fewer seeds) there, as before."""
import json

import pytest

import paper_table

ABSENT = object()  # a result written without ppl_bf16 (None is a JSON null, which is no number)


def lm_result(ppl, ppl_bf16=ABSENT, block=10.0):
    """A language model's evaluate.py result, as the table reads it; ppl_bf16 left out when ABSENT."""
    fp = {"ppl": ppl, **({} if ppl_bf16 is ABSENT else {"ppl_bf16": ppl_bf16})}
    return {"model": "gpt2_micro", "method": "Baseline", "fp": fp, "max_act": {"module": 9.0, "block": block},
            "quant": {"rtn": {"w4a16": {"ppl": ppl + 0.1}}}}


def write(path, result):
    path.write_text(json.dumps(result))  # json.dumps writes float("nan") as a bare NaN, as the reviewer's file had
    return str(path)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "3.6", None])
@pytest.mark.parametrize("over_seeds", [False, True])
def test_a_bf16_perplexity_that_is_no_number_is_named_not_printed(tmp_path, bad, over_seeds):
    files = [write(tmp_path / "r1.json", lm_result(3.6, bad)), write(tmp_path / "r2.json", lm_result(3.62, 3.62))]
    with pytest.raises(SystemExit) as refused:
        paper_table.main(files + (["--over-seeds"] if over_seeds else []))
    message = str(refused.value.code)
    assert message == f"error: {files[0]} has no number at fp.ppl_bf16: re-evaluate it with evaluate.py " \
                      "(--recompute for a quantized entry)"


def test_a_result_without_a_bf16_perplexity_is_still_tabulated(tmp_path):
    """Only the columns a result has are checked: the older file's BF16 cell is the other seed's value."""
    files = [write(tmp_path / "old.json", lm_result(3.6)), write(tmp_path / "new.json", lm_result(3.62, 3.64))]
    table = paper_table.main([*files, "--over-seeds"])
    row = next(line for line in table.splitlines() if line.startswith("| gpt2_micro"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # FP32: mean 3.61, sample std |3.62 - 3.6| / sqrt(2) = 0.0141; BF16: the one value, of 1 of the 2 results
    assert cells[2:4] == ["3.61 ± 0.01", "3.64 (n=1)"]

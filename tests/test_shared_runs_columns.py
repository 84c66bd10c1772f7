"""Runs one paper table reuses from another are evaluated for every column of the table that reuses them: Table 6
(configs/sweeps/attn_sink.yaml) takes its softmax rows from Table 1's vit_b_baseline / vit_b_cd
(configs/sweeps/pretrain_main.yaml), whose sweep evaluates other pipelines; the documents that advise the reuse give
the evaluate.py commands that add the missing ones to the result file the table reads."""
import os
import re

import pytest

from configs.loader import read_yaml_file
from tests.conftest import ROOT
from tests.test_docs import commands

SHARED = ("vit_b_baseline", "vit_b_cd")  # Table 1's runs that Table 6's softmax rows are
ADVICE = ("configs/sweeps/attn_sink.yaml", "docs/reproduce.md")  # where the reuse is advised


def pipelines(sweep: str) -> set[str]:
    """The quant.pipelines of the sweep's evaluate.py commands (its `evaluate` list)."""
    words = read_yaml_file(os.path.join(ROOT, "configs", "sweeps", sweep))["evaluate"]
    listed = [re.fullmatch(r"quant\.pipelines=\[(.*)\]", w) for w in words]
    return {p.strip() for m in listed if m for p in m.group(1).split(",")}


def added_pipelines(document: str, checkpoint: str) -> set[str]:
    """The pipelines the evaluate.py commands of `document` add to the result beside `checkpoint` (their --quant
    words; --out left at its default, the eval_best.json a sweep writes and paper_table.py reads)."""
    found = set()
    for script, args in commands(document):
        if script != "evaluate.py" or args[args.index("--checkpoint") + 1:][:1] != [checkpoint] or "--out" in args:
            continue
        for word in args[args.index("--quant") + 1:]:  # its pipelines: the words up to the next flag or override
            if word.startswith("-") or "=" in word:
                break
            found.add(word)
    return found


def test_the_result_file_of_a_checkpoint_is_the_one_the_sweep_writes():
    """evaluate.py's default --out for RUN/best.pt is RUN/eval_best.json, the file scripts/sweep.py names and the
    table reads: the added columns land in it."""
    import evaluate
    out = evaluate.default_out_path(os.path.join("runs", "pretrain", "vit_b_cd", "best.pt"), "unused")
    assert out == os.path.abspath(os.path.join("runs", "pretrain", "vit_b_cd", "eval_best.json"))


@pytest.mark.parametrize("document", ADVICE)
@pytest.mark.parametrize("run", SHARED)
def test_table_6s_softmax_rows_get_every_column_of_table_6(document, run):
    """pretrain_main.yaml evaluates [repq, aphq]; Table 6 needs [percentile, repq]: the advice to reuse the runs
    gave no way to the percentile column before."""
    out_root = read_yaml_file(os.path.join(ROOT, "configs", "sweeps", "pretrain_main.yaml"))["out_root"]
    assert run in read_yaml_file(os.path.join(ROOT, "configs", "sweeps", "pretrain_main.yaml"))["runs"]
    missing = pipelines("attn_sink.yaml") - pipelines("pretrain_main.yaml")
    assert missing  # otherwise nothing is needed (and this test says nothing)
    added = added_pipelines(document, f"{out_root}/{run}/best.pt")
    assert missing <= added, f"{document}: no evaluate.py command adds {sorted(missing - added)} to {run}'s result"

"""evaluate.py's result file is a JSON named *.json: its maxima files are named after its stem (<stem>_act_max.csv),
and scripts/compare_act_max.py finds the result a CSV was measured with as <stem>.json beside it. A --out of
another name (`--out runs/x/eval_ema`) was evaluated and written, and compare_act_max.py then refused its CSV as
having no result file beside it, asking for an evaluation that had been made: such an --out is one `error:` line
before any work, naming the .json path to give."""
import os

import pytest

from tests.conftest import run_entry


@pytest.mark.parametrize("name", ["eval_ema", "eval.res", "eval.JSON"])
def test_an_out_not_named_json_is_refused_before_any_work(checkpoint, tmp_path, capsys, name):
    out = tmp_path / "r" / name
    code, _, err = run_entry("evaluate.py", ["--checkpoint", checkpoint, "--out", str(out)], capsys)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1, err
    stem = os.path.splitext(str(out))[0] if name != "eval_ema" else str(out)
    assert lines[0] == (f"error: --out {out}: evaluate.py writes a JSON result whose name ends in .json (its "
                        f"maxima files are named after it, and compare_act_max.py finds it by that name beside "
                        f"them); give e.g. --out {stem}.json"), lines[0]
    assert not (tmp_path / "r").exists()


def test_an_out_link_to_a_json_file_is_taken(checkpoint, tmp_path, capsys):
    """The name that counts is the written file's: a link named *.json to it is taken, as any *.json."""
    (tmp_path / "real").mkdir()
    (tmp_path / "links").mkdir()
    os.symlink(tmp_path / "real" / "r.json", tmp_path / "links" / "r.json")
    code, _, err = run_entry("evaluate.py", ["--checkpoint", checkpoint, "--out", str(tmp_path / "links" / "r.json"),
                                             "quant.act_max_csv=false"], capsys)
    assert code == 0, err
    assert (tmp_path / "real" / "r.json").is_file()

"""The activation-maxima CSV and plot are written whole (a temporary file beside them, then a rename), and the
result file never names one that does not exist: evaluate.py saves the JSON naming them before writing them (a second
evaluate.py adding to the file meanwhile must know them as its own), and where that save or a write fails or is
interrupted (Ctrl-C), the names of the files that are not there are dropped again before the error goes on."""
from __future__ import annotations

import json
import os

import matplotlib.figure
import pytest

import evaluate
from engine.act_max_files import plot, write_csv
from engine.eval_results import EvalResults

RECORDS = [{"name": f"blocks.{i}.mlp.fc2", "kind": "output", "block": i, "type": "mlp.fc2", "max": 2.0 ** i}
           for i in range(3)]
IDENTITY = {"model": "m", "data": {}, "weights": "w", "eval_amp": "none", "images": 1}


class Interrupting:
    """A value whose text is asked for by the CSV writer: a Ctrl-C there, half-way through the rows."""

    def __str__(self) -> str:
        raise KeyboardInterrupt


def test_an_interrupted_csv_write_keeps_the_earlier_file_whole_and_no_temporary(tmp_path):
    path = tmp_path / "r_act_max.csv"
    write_csv(RECORDS, path)
    before = path.read_text()
    with pytest.raises(KeyboardInterrupt):
        write_csv([{**r, "max": 3.0 ** i} for i, r in enumerate(RECORDS)] + [{**RECORDS[0], "max": Interrupting()}],
                  path)
    assert path.read_text() == before
    assert sorted(os.listdir(tmp_path)) == ["r_act_max.csv"]


def test_an_interrupted_plot_keeps_the_earlier_file_whole_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "r_act_max.png"
    plot(RECORDS, path)
    before = path.read_bytes()
    assert before.startswith(b"\x89PNG") and before[-8:-4] == b"IEND"  # a complete PNG ends with its IEND chunk

    def cut_savefig(self, fname, **kwargs):
        with open(fname, "wb") as f:
            f.write(b"\x89PNG half")
        raise KeyboardInterrupt
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", cut_savefig)
    with pytest.raises(KeyboardInterrupt):
        plot(RECORDS, path)
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["r_act_max.png"]


def test_a_plot_is_written_in_the_format_its_extension_names(tmp_path):
    plot(RECORDS, tmp_path / "a.pdf")
    plot(RECORDS, tmp_path / "a.png")
    assert (tmp_path / "a.pdf").read_bytes().startswith(b"%PDF")
    assert (tmp_path / "a.png").read_bytes().startswith(b"\x89PNG")


def named(tmp_path) -> tuple[EvalResults, dict]:
    """A result file's record whose max_act names the maxima files beside it, as evaluate.py gives it."""
    paths = evaluate.act_max_paths(str(tmp_path / "r"))
    results = EvalResults.open(str(tmp_path / "r.json"), IDENTITY)
    results.update(max_act={"module": 1.0, "block": 2.0, **paths})
    return results, paths


def test_a_write_interrupted_after_the_save_leaves_no_name_of_a_file_not_written(tmp_path):
    results, paths = named(tmp_path)

    def write():  # the CSV is written, then Ctrl-C before the plot
        write_csv(RECORDS, paths["csv"])
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        evaluate.save_naming_act_max_files(results, write, paths)
    saved = json.loads((tmp_path / "r.json").read_text())["max_act"]
    assert saved == {"module": 1.0, "block": 2.0, "csv": paths["csv"]}
    assert all(os.path.exists(saved[key]) for key in ("csv",))
    assert sorted(os.listdir(tmp_path)) == ["r.json", "r_act_max.csv"]


def test_an_earlier_complete_file_stays_named(tmp_path):
    """A file an earlier call wrote is there: the result file may name it (the old one, whole)."""
    results, paths = named(tmp_path)
    write_csv(RECORDS, paths["csv"])
    plot(RECORDS, paths["plot"])

    def write():
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        evaluate.save_naming_act_max_files(results, write, paths)
    saved = json.loads((tmp_path / "r.json").read_text())["max_act"]
    assert saved["csv"] == paths["csv"] and saved["plot"] == paths["plot"]


def test_an_uninterrupted_save_names_both_files_and_writes_them(tmp_path):
    results, paths = named(tmp_path)
    evaluate.save_naming_act_max_files(results, lambda: (write_csv(RECORDS, paths["csv"]),
                                                         plot(RECORDS, paths["plot"])), paths)
    saved = json.loads((tmp_path / "r.json").read_text())["max_act"]
    assert saved["csv"] == paths["csv"] and saved["plot"] == paths["plot"]
    assert all(os.path.exists(p) for p in paths.values())

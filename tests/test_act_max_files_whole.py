"""The activation-maxima CSV and plot are written whole (a temporary file beside them, then a rename), and the
result file never names one that does not exist: evaluate.py saves the JSON naming them before writing them (a second
evaluate.py adding to the file meanwhile must know them as its own), and where that save or a write fails or is
interrupted (Ctrl-C), the names of the files that are not there are dropped again before the error goes on."""
from __future__ import annotations

import hashlib
import json
import os

import pytest

import evaluate
import engine.act_max_ownership
from engine import outputs
from engine.act_max_files import plot_bytes
from engine.eval_results import EvalResults

RECORDS = [{"name": f"blocks.{i}.mlp.fc2", "kind": "output", "block": i, "type": "mlp.fc2", "max": 2.0 ** i}
           for i in range(3)]
IDENTITY = {"model": "m", "data": {}, "weights": "w", "eval_amp": "none", "images": 1}


def test_an_interrupted_bytes_write_keeps_the_earlier_file_whole_and_no_temporary(tmp_path, monkeypatch):
    """Half the bytes written, then Ctrl-C: the file at the name is the earlier complete one, no temporary stays."""
    path = tmp_path / "r_act_max.png"
    outputs.write_bytes(str(path), b"\x89PNG earlier", overwrite=False)

    class HalfWritten:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.f.write(data[:len(data) // 2])
            raise KeyboardInterrupt
    monkeypatch.setattr(outputs, "open", lambda *a, **k: HalfWritten(open(*a, **k)), raising=False)
    with pytest.raises(KeyboardInterrupt):
        outputs.write_bytes(str(path), b"\x89PNG the new one, longer", overwrite=True)
    assert path.read_bytes() == b"\x89PNG earlier"
    assert sorted(os.listdir(tmp_path)) == ["r_act_max.png"]


def test_a_plot_is_made_in_the_format_asked():
    assert plot_bytes(RECORDS, "pdf").startswith(b"%PDF")
    png = plot_bytes(RECORDS, "png")
    assert png.startswith(b"\x89PNG") and png[-8:-4] == b"IEND"  # a complete PNG ends with its IEND chunk


def named(tmp_path) -> tuple[EvalResults, dict]:
    """A result file's record whose max_act names the maxima files beside it, as evaluate.py gives it."""
    paths = evaluate.act_max_paths(str(tmp_path / "r"))
    results = EvalResults.open(str(tmp_path / "r.json"), IDENTITY)
    results.update(max_act={"module": 1.0, "block": 2.0, **paths})
    return results, paths


def recorded(path) -> dict:
    """What a result file records of the file at `path`: its size and SHA-256."""
    data = open(path, "rb").read()
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


CONTENTS = {"csv": b"name,max\r\nblocks.0,1.0\r\n", "plot": b"\x89PNG not drawn"}


def interrupted_at(monkeypatch, stop: str) -> None:
    """A Ctrl-C when evaluate.py starts writing the maxima file whose path ends in `stop`."""
    write = engine.act_max_ownership.write_bytes

    def cut(path, data, overwrite):
        if str(path).endswith(stop):
            raise KeyboardInterrupt
        return write(path, data, overwrite)
    monkeypatch.setattr(engine.act_max_ownership, "write_bytes", cut)


def test_a_write_interrupted_after_the_save_leaves_no_name_of_a_file_not_written(tmp_path, monkeypatch):
    results, paths = named(tmp_path)
    interrupted_at(monkeypatch, ".png")  # the CSV is written, then Ctrl-C before the plot
    with pytest.raises(KeyboardInterrupt):
        evaluate.save_naming_act_max_files(results, CONTENTS, paths)
    saved = json.loads((tmp_path / "r.json").read_text())["max_act"]
    assert saved == {"module": 1.0, "block": 2.0, "csv": paths["csv"], "digests": {"csv": recorded(paths["csv"])}}
    assert open(paths["csv"], "rb").read() == CONTENTS["csv"]
    assert sorted(os.listdir(tmp_path)) == ["r.json", "r_act_max.csv"]


def test_an_earlier_complete_file_stays_named(tmp_path, monkeypatch):
    """Files an earlier call wrote are there: the result file names them (the old ones, whole, with their digests)
    when this call's writes are interrupted."""
    results, paths = named(tmp_path)
    evaluate.save_naming_act_max_files(results, CONTENTS, paths)
    before = {key: recorded(path) for key, path in paths.items()}
    again = EvalResults.open(str(tmp_path / "r.json"), IDENTITY)
    own = evaluate.check_act_max_files(again.data, str(tmp_path / "r"))
    again.update(max_act={"module": 3.0, "block": 4.0, **paths})
    interrupted_at(monkeypatch, ".csv")
    with pytest.raises(KeyboardInterrupt):
        evaluate.save_naming_act_max_files(again, {key: data + b"new" for key, data in CONTENTS.items()}, paths,
                                           own=own)
    saved = json.loads((tmp_path / "r.json").read_text())["max_act"]
    assert saved["csv"] == paths["csv"] and saved["plot"] == paths["plot"] and saved["digests"] == before
    assert {key: open(path, "rb").read() for key, path in paths.items()} == CONTENTS


def test_an_uninterrupted_save_names_both_files_and_writes_them(tmp_path):
    results, paths = named(tmp_path)
    evaluate.save_naming_act_max_files(results, CONTENTS, paths)
    saved = json.loads((tmp_path / "r.json").read_text())["max_act"]
    assert saved["csv"] == paths["csv"] and saved["plot"] == paths["plot"]
    assert {key: open(path, "rb").read() for key, path in paths.items()} == CONTENTS
    assert saved["digests"] == {key: recorded(path) for key, path in paths.items()}

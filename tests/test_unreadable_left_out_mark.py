"""A score that left out val images it could not read (engine/loop.py records them as `excluded`: a link to
nothing, a broken file, an I/O error) is of fewer images than the split holds, as a val folder of fewer files is:
it is marked † in evaluate.py's table and in scripts/paper_table.py's, with a note saying how many of how many were
left out (engine/result_table.unreadable_left_out). Was: `count: 11, excluded: 1` beside `images: 12` printed as a
plain row, while a val folder holding 11 images got a †."""
import json
import os

import paper_table
import evaluate
import train
from configs import load_config
from engine import result_table
from tests.conftest import DEBUG_CONFIG, make_folder


def test_a_val_image_left_out_by_evaluate_is_marked_with_how_many(tmp_path):
    """The reviewer's case: one val image a link to an unmounted disk; the run's val names are unchanged, so only
    the images left out tell the score apart from the run's."""
    make_folder(tmp_path / "data", {"train": {"a": 8, "b": 8}, "val": {"a": 3, "b": 3}})
    train.main(load_config([DEBUG_CONFIG], [f"out_dir={tmp_path / 'run'}", "model.num_classes=2",
                                            "data.dataset=folder", f"data.root={tmp_path / 'data'}",
                                            "train.max_steps=1", "sched.epochs=1", "sched.warmup_epochs=0",
                                            "log.tensorboard=false"]))
    image = tmp_path / "data" / "val" / "a" / "0.png"
    image.unlink()
    os.symlink(tmp_path / "gone" / "0.png", image)  # a dangling link: os.path.exists is False
    files = [os.path.join(d, f) for d, _, names in os.walk(tmp_path / "data" / "val") for f in names]
    unreadable = sum(not os.path.exists(f) for f in files)
    assert (len(files), unreadable) == (6, 1)
    out = tmp_path / "e.json"
    evaluate.main(evaluate.parse_args(["--checkpoint", str(tmp_path / "run" / "best.pt"), "--quant",
                                       "--out", str(out)]))
    saved = json.loads(out.read_text())
    assert (saved["images"], saved["fp"]["count"], saved["fp"]["excluded"]) == (6, 5, 1)
    lines = result_table.markdown_table([saved]).splitlines()[2:]
    assert lines[0].startswith("| vit_nano† | Baseline |"), lines
    assert lines[-1] == f"† vit_nano Baseline: evaluated with {unreadable} of its {len(files)} val images left out " \
                        "as unreadable"


def result(fp_excluded, quant_excluded, root="/data/pets", method="Baseline"):
    """A classifier's evaluate.py result of 12 val images, `fp_excluded` of them left out by its float pass and
    `quant_excluded` by its Percentile W4A4 pass."""
    return {"model": "vit_nano", "method": method, "images": 12, "checkpoint": f"/runs/{method}/best.pt",
            "data": {"dataset": "folder", "root": root, "val_split": "val"},
            "fp": {"top1": 50.0, "count": 12 - fp_excluded, "excluded": fp_excluded},
            "max_act": {"module": 9.0, "block": 8.0},
            "quant": {"percentile": {"w4a4": {"top1": 40.0, "count": 12 - quant_excluded,
                                              "excluded": quant_excluded}}}}


def write(path, data):
    path.write_text(json.dumps(data))
    return str(path)


def test_paper_table_rows_mark_a_left_out_image_of_any_pass(tmp_path):
    """The rows layout marks the row; the note names the pass that left images out where they differ."""
    files = [write(tmp_path / "all.json", result(0, 0)), write(tmp_path / "fp.json", result(1, 1, method="CD")),
             write(tmp_path / "q.json", result(0, 2, method="TWEO"))]
    table = paper_table.main(files)
    rows = {line.split("|")[2].strip(): line for line in table.splitlines() if line.startswith("| vit_nano")}
    assert rows["Baseline"].startswith("| vit_nano | Baseline |")
    assert rows["CD"].startswith("| vit_nano† | CD |") and rows["TWEO"].startswith("| vit_nano† | TWEO |")
    notes = [line for line in table.splitlines() if line.startswith("†")]
    assert notes == ["† vit_nano CD: evaluated with 1 of its 12 val images left out as unreadable",
                     "† vit_nano TWEO: evaluated with 2 of its 12 val images left out as unreadable "
                     "(Percentile W4A4)"]


def test_paper_table_finetune_marks_the_entry_and_its_average(tmp_path):
    files = [write(tmp_path / "b.json", result(0, 0)), write(tmp_path / "c.json", result(3, 3, method="CD"))]
    table = paper_table.main(["--layout", "finetune", *files])
    lines = table.splitlines()
    assert "| Pets | 50.00 / 40.00 / -10.00 | 50.00 / 40.00 / -10.00† |" in lines  # Baseline, CD
    assert "| Average | 50.00 / 40.00 / -10.00 | 50.00 / 40.00 / -10.00† |" in lines
    assert [line for line in lines if line.startswith("†")] == [
        "† Pets CD: evaluated with 3 of its 12 val images left out as unreadable"]

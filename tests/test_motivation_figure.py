"""scripts/motivation_figure.py refuses classifiers' results measured differently, as scripts/compare_act_max.py
refuses them (the same pair, the same difference named), and also those quantized with other settings of the drawn
entry; results measured alike are drawn by both."""
import csv
import json

import pytest

from tests.conftest import load_script


def write_result(folder, name, **fields) -> str:
    """`<name>.json` as evaluate.py writes it (raw weights in fp32, best.pt, RepQ W4A4 at the default calibration)
    with its `<name>_act_max.csv` beside it; `fields` replace its entries. The path of the CSV."""
    csv_path = str(folder / f"{name}_act_max.csv")
    module = float(len(name))  # each run's own maxima (compare_act_max.py refuses one file's given twice)
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["name", "kind", "block", "type", "max"])
        writer.writeheader()
        writer.writerows([{"name": "blocks.0", "kind": "block", "block": 0, "type": "block", "max": 9.0},
                          {"name": "blocks.0.mlp.fc2", "kind": "module", "block": 0, "type": "mlp.fc2",
                           "max": module}])
    record = {"model": "vit_t", "model_kwargs": {}, "checkpoint": f"/runs/{name}/best.pt", "checkpoint_kind": "best",
              "weights": "raw", "eval_amp": "none", "images": 48, "data": {"dataset": "digits"}, "method": name,
              "recipe": {"model.kwargs": {}}, "fp": {"top1": 90.0},
              "max_act": {"module": module, "block": 9.0, "csv": csv_path, "plot": csv_path[:-4] + ".png"},
              "quant": {"repq": {"w4a4": {"top1": 80.0, "settings": {"calibration": {"images": 32, "seed": 0}}}}},
              **fields}
    with open(folder / f"{name}.json", "w") as f:
        json.dump(record, f)
    return csv_path


@pytest.mark.parametrize("fields, difference", [
    ({"images": 16}, "images: 48 vs 16"),  # was a note at most: circles of 48 and 16 images side by side
    ({"data": {"dataset": "synthetic"}}, "data: "),
    ({"weights": "ema"}, "weights: "),
    ({"eval_amp": "bf16"}, "eval_amp: "),
    ({"checkpoint_kind": "latest", "checkpoint": "/runs/CD/checkpoint.pt"}, "checkpoint_kind: "),
    ({"max_act": {"module": 5.0, "block": 9.0, "extra_modules": ["head"]}}, "max_act.extra_modules: "),
])
def test_motivation_figure_refuses_what_compare_act_max_refuses(tmp_path, fields, difference):
    compare_act_max, motivation_figure = load_script("compare_act_max"), load_script("motivation_figure")
    base = write_result(tmp_path, "Baseline")
    cd = write_result(tmp_path, "CD", **fields)
    if "max_act" in fields:  # the CSV beside it, as evaluate.py records it
        record = json.loads((tmp_path / "CD.json").read_text())
        record["max_act"].update(csv=cd, plot=cd[:-4] + ".png")
        (tmp_path / "CD.json").write_text(json.dumps(record))
    with pytest.raises(SystemExit, match=rf"error: .*Baseline.* and .*CD.* were measured differently \({difference}"):
        compare_act_max.main([f"Baseline={base}", f"CD={cd}", "--out", str(tmp_path / "cmp" / "x")])
    with pytest.raises(SystemExit, match=rf"error: .*Baseline.json and .*CD.json were measured differently "
                                         rf"\({difference}"):
        motivation_figure.main([str(tmp_path / "Baseline.json"), str(tmp_path / "CD.json"),
                                "--out", str(tmp_path / "fig")])
    assert not (tmp_path / "fig").exists()


def test_motivation_figure_refuses_other_settings_of_the_drawn_entry_and_draws_results_alike(tmp_path):
    """The quantized score is the circle's height: another calibration size was a note on stderr at most. Results
    measured alike are drawn (and compare_act_max.py takes them too)."""
    compare_act_max, motivation_figure = load_script("compare_act_max"), load_script("motivation_figure")
    base, cd = write_result(tmp_path, "Baseline"), write_result(tmp_path, "CD")
    rows = motivation_figure.main([str(tmp_path / "Baseline.json"), str(tmp_path / "CD.json"),
                                   "--out", str(tmp_path / "fig")])
    assert [r["method"] for r in rows] == ["Baseline", "CD"]
    compare_act_max.main([f"Baseline={base}", f"CD={cd}", "--out", str(tmp_path / "cmp" / "x")])
    write_result(tmp_path, "TWEO", quant={"repq": {"w4a4": {"top1": 80.0, "settings": {
        "calibration": {"images": 128, "seed": 0}}}}})
    with pytest.raises(SystemExit, match=r"error: .*Baseline.json and .*TWEO.json were measured differently \(repq "
                                         r"w4a4 settings: calibration.images 32 -> 128\)"):
        motivation_figure.main([str(tmp_path / n) for n in ("Baseline.json", "CD.json", "TWEO.json")]
                               + ["--out", str(tmp_path / "fig2")])
    assert not (tmp_path / "fig2").exists()

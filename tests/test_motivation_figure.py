"""scripts/motivation_figure.py refuses classifiers' results measured differently, as scripts/compare_act_max.py
refuses them (the same pair, the same difference named), and also those quantized with other settings of the drawn
entry; results measured alike are drawn by both."""
import csv
import json

import pytest

from tests.conftest import check_overwrite_keeps_others_files, load_script


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


def test_each_method_label_has_a_colour_of_its_own_in_its_familys_hue(tmp_path, monkeypatch):
    """Two CD strengths of a sweep (or two TWEO settings) were drawn in one blue, two legend entries alike. Every
    label gets its own face colour; a family's labels keep its hue (shades of tab:blue for CD), and a family given
    once keeps its colour."""
    import colorsys

    from matplotlib.colors import to_rgb

    motivation_figure = load_script("motivation_figure")
    drawn = []
    monkeypatch.setattr(motivation_figure, "save_figure", lambda fig, path, overwrite, **_: drawn.append(fig))
    methods = ["Baseline", "CD (lam 0.005)", "CD (lam 0.05)", "TWEO", "TWEO (rescaled)", "Noise", "CD + TWEO"]
    for method in methods:
        write_result(tmp_path, method)
    motivation_figure.main([str(tmp_path / f"{m}.json") for m in methods] + ["--out", str(tmp_path / "fig")])
    (ax,) = drawn[0].axes
    face = {c.get_label(): tuple(float(v) for v in c.get_facecolor()[0][:3]) for c in ax.collections}
    assert sorted(face) == sorted(methods)
    assert len(set(face.values())) == len(methods), face  # one colour per label
    assert [label for label, _ in zip(methods, ax.get_legend().get_texts())] == methods
    assert face["Baseline"] == pytest.approx(to_rgb("tab:gray"))

    def hue(rgb):
        return colorsys.rgb_to_hsv(*rgb)[0]
    for family, labels in (("tab:blue", ["CD (lam 0.005)", "CD (lam 0.05)"]),
                           ("tab:orange", ["TWEO", "TWEO (rescaled)"])):
        assert [hue(face[label]) for label in labels] == pytest.approx([hue(to_rgb(family))] * 2, abs=1e-6)


@pytest.mark.parametrize("flags, expected", [
    (["--pipeline", "foo"], "argument --pipeline: invalid choice: 'foo'"),  # was 'the results lack foo w4a4'
    (["--bits", "w4"], "--bits w4: bit-width 'w4' is not of the form 'w4a4'"),
])
def test_a_pipeline_or_bit_width_that_none_has_is_a_usage_error(tmp_path, capsys, flags, expected):
    write_result(tmp_path, "Baseline")
    with pytest.raises(SystemExit) as done:
        load_script("motivation_figure").main([str(tmp_path / "Baseline.json"), "--out", str(tmp_path / "fig"),
                                               *flags])
    assert done.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines
    assert not (tmp_path / "fig").exists()


@pytest.mark.parametrize("bits", ["w04a4", " W4A4 "])
def test_a_bit_width_spelled_otherwise_draws_the_entry_evaluate_named_by_its_parsed_form(tmp_path, capsys, bits):
    """--bits w04a4 (or " W4A4 ") is w4a4 to parse_bits, and evaluate.py names its result's entry w4a4 (quant/plan.py:
    the parsed form); the key was the text lowercased, so the results were said to lack the entry and the error sent
    the user to `evaluate.py --bits w04a4`, which writes w4a4 again. The entry is drawn; one lacking is named by the
    name evaluate.py gives it."""
    motivation_figure = load_script("motivation_figure")
    write_result(tmp_path, "Baseline")
    rows = motivation_figure.main([str(tmp_path / "Baseline.json"), "--out", str(tmp_path / "fig"), "--bits", bits])
    assert [(r["method"], r["quantized"]) for r in rows] == [("Baseline", 80.0)]  # the w4a4 entry written above
    with pytest.raises(SystemExit) as lacking:
        motivation_figure.main([str(tmp_path / "Baseline.json"), "--out", str(tmp_path / "fig8"), "--bits", "W08a8"])
    assert "lack repq w8a8 " in str(lacking.value.code) and "--bits w8a8 on their" in str(lacking.value.code)


def write_detector_result(folder, name, method, **fields) -> str:
    """`<name>.json` as evaluate_detection.py writes it (the paper's Swin-T 1x config on COCO val, test batch 1,
    RepQ-ViT W4A4 at the default calibration); `fields` replace its entries. Its path."""
    record = {"task": "detection", "config": ["/repo/configs/detection/mask_rcnn_swin_t_1x.py"],
              "config_sha256": "0" * 16, "overrides": [], "checkpoint": f"/runs/{name}/epoch_12.pth",
              "fingerprint": name, "method": method,
              "data": {"root": "/datasets/coco/", "ann_file": "/datasets/coco/annotations/instances_val2017.json",
                       "images": 5000, "partial": False},
              "annotations_sha256": "a" * 64, "fp": {"bbox_mAP": 0.42, "segm_mAP": 0.39},
              "max_act": {"backbone": 40.0 + len(name), "head": 90.0, "padding": {
                  "counted": True, "pad_size_divisor": 32, "pad_value": 0, "batch_size": 1}},
              "quant": {"repq": {"w4a4": {"bbox_mAP": 0.36, "segm_mAP": 0.35, "settings": {
                  "calib_images": 1, "calib_seed": 0}}}},
              **fields}
    path = str(folder / f"{name}.json")
    with open(path, "w") as f:
        json.dump(record, f)
    return path


@pytest.mark.parametrize("fields, difference", [
    # the circle's height: CD calibrated on 32 images beside a baseline on 1
    ({"quant": {"repq": {"w4a4": {"bbox_mAP": 0.38, "segm_mAP": 0.36, "settings": {"calib_images": 32,
                                                                                     "calib_seed": 0}}}}},
     "repq w4a4 settings: calib_images 1 -> 32"),
    ({"data": {"root": "/datasets/coco/", "ann_file": "/datasets/coco/annotations/instances_val2017.json",
               "images": 500, "partial": False}}, "data: "),
    ({"annotations_sha256": "b" * 64}, "annotations_sha256: "),
    # the area: maxima of test batches of 2 images, padded to the larger one, beside batch 1's
    ({"max_act": {"backbone": 41.0, "head": 90.0, "padding": {"counted": True, "pad_size_divisor": 32,
                                                              "pad_value": 0, "batch_size": 2}}},
     "max_act.padding: "),
])
def test_motivation_figure_refuses_detectors_measured_differently(tmp_path, fields, difference):
    """The detection panel's circles are compared as the classifiers' are: another calibration, val data or test
    batch padding drew a setting as the method (the detectors were not compared at all). Detectors measured alike
    are drawn, beside a classifier measured on other data."""
    motivation_figure = load_script("motivation_figure")
    write_result(tmp_path, "Baseline")
    base = write_detector_result(tmp_path, "det_base", "Baseline")
    cd = write_detector_result(tmp_path, "det_cd", "CD")
    rows = motivation_figure.main([str(tmp_path / "Baseline.json"), base, cd, "--out", str(tmp_path / "fig")])
    assert [(r["task"], r["method"]) for r in rows] == [("classification", "Baseline"), ("detection", "Baseline"),
                                                       ("detection", "CD")]
    other = write_detector_result(tmp_path, "det_other", "CD", **fields)
    with pytest.raises(SystemExit, match=rf"error: .*det_base.json and .*det_other.json were measured differently "
                                         rf"\({difference}"):
        motivation_figure.main([base, other, "--out", str(tmp_path / "fig2")])
    assert not (tmp_path / "fig2").exists()


@pytest.mark.parametrize("foreign", ["motivation.png", "motivation.csv"])
def test_overwrite_replaces_only_the_figure_and_table_this_script_wrote(tmp_path, foreign):
    """--overwrite replaced any motivation.png and motivation.csv in --out: a paper's figure or another script's CSV
    of that name was lost. The script marks its outputs (the PNG's text entry Source, the CSV's header of its
    columns), as compare_act_max.py does, and --overwrite replaces only files so marked, refusing any other with one
    error line and leaving every file as it was; the reference is the files' bytes before."""
    motivation_figure = load_script("motivation_figure")
    results = [str(tmp_path / "Baseline.json"), str(tmp_path / "CD.json")]
    for name in ("Baseline", "CD"):
        write_result(tmp_path, name)
    out = tmp_path / "fig"
    other = b"\x89PNG\r\n\x1a\nsomeone's figure" if foreign.endswith(".png") else b"name,value\nlr,0.1\n"
    check_overwrite_keeps_others_files(lambda extra: motivation_figure.main([*results, "--out", str(out), *extra]),
                                       out, foreign, other, SystemExit,
                                       f"error: {out / foreign} is not a file motivation_figure.py wrote")

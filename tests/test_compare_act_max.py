"""scripts/compare_act_max.py: per-block maxima averaged over runs, against values written into the CSVs, and
the result files beside them (how each was evaluated) compared before any average."""
import csv
import json
import os
import re

import pytest

from tests.conftest import load_script


def load():
    return load_script("compare_act_max")


def write(path, rows, result=True, **fields):
    """The CSV at `path` and, for a `<stem>_act_max.csv` with `result`, the result file `<stem>.json` evaluate.py
    writes beside it (as an evaluation of the raw weights in fp32 with the model.kwargs trained with; `fields`
    replace its entries)."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["name", "kind", "block", "type", "max"])
        writer.writeheader()
        writer.writerows(rows)
    path = str(path)
    if result and path.endswith("_act_max.csv"):
        record = {"model": "vit_t", "model_kwargs": {}, "checkpoint": path + ".pt", "checkpoint_kind": "best",
                  "weights": "raw",
                  "eval_amp": "none", "images": 100, "data": {"dataset": "digits"}, "method": "CD",
                  "recipe": {"model.kwargs": {}, "train.lr": 0.001}, "fp": {"top1": 90.0},
                  "max_act": {"module": 1.0, "block": 1.0, "csv": path, "plot": path[:-4] + ".png"},
                  "quant": {}, **fields}
        with open(path[:-len("_act_max.csv")] + ".json", "w") as f:
            json.dump(record, f)


def run_rows(block_out, norm, fc2):
    rows = []
    for b, (o, n, f) in enumerate(zip(block_out, norm, fc2)):
        rows += [{"name": f"blocks.{b}", "kind": "block", "block": b, "type": "block", "max": o},
                 {"name": f"blocks.{b}.norm1", "kind": "module", "block": b, "type": "norm1", "max": n},
                 {"name": f"blocks.{b}.mlp.fc2", "kind": "module", "block": b, "type": "mlp.fc2", "max": f}]
    return rows + [{"name": "norm", "kind": "module", "block": -1, "type": "norm", "max": 999.0}]


def test_means_ranges_and_refusals(tmp_path, capsys):
    compare = load()
    write(tmp_path / "a_s0_act_max.csv", run_rows([1.0, 4.0], [10.0, 2.0], [3.0, 7.0]))
    write(tmp_path / "a_s1_act_max.csv", run_rows([3.0, 6.0], [20.0, 1.0], [5.0, 9.0]))
    write(tmp_path / "b_s0_act_max.csv", run_rows([2.0, 2.0], [1.0, 1.0], [1.0, 1.0]))
    out = str(tmp_path / "cmp")
    rows = compare.main([f"a={tmp_path}/a_s*_act_max.csv", f"b={tmp_path}/b_s*_act_max.csv", "--out", out])
    a1 = next(r for r in rows if r["method"] == "a" and r["block"] == 1)
    assert (a1["runs"], a1["block_mean"], a1["block_min"], a1["block_max"]) == (2, 5.0, 4.0, 6.0)
    assert a1["module_mean"] == 8.0  # max over the block's modules (7, 9), then the mean; the final norm
    assert "| 0 | 2.0 / 15.0 | 2.0 / 1.0 |" in capsys.readouterr().out  # (block -1) is not a block
    assert os.path.getsize(out + ".png") > 0 and os.path.exists(out + ".csv")
    with pytest.raises(SystemExit, match="already exist.*choose another --out or add --overwrite"):
        compare.main([f"a={tmp_path}/a_s*_act_max.csv", "--out", out])
    with pytest.raises(SystemExit, match="names no act_max CSV"):
        compare.main([f"a={tmp_path}/nothing*.csv", "--out", str(tmp_path / "other")])
    good = (tmp_path / "cmp.csv").read_bytes()
    write(tmp_path / "empty_act_max.csv", [])
    with pytest.raises(SystemExit, match="empty_act_max.csv holds no block rows"):
        compare.main([f"a={tmp_path}/empty_act_max.csv", "--out", out, "--overwrite"])
    assert (tmp_path / "cmp.csv").read_bytes() == good  # a refused run leaves the good output as it was
    write(tmp_path / "deep_s2_act_max.csv", run_rows([1.0, 1.0, 1.0], [1.0] * 3, [1.0] * 3))
    with pytest.raises(SystemExit, match=r"deep_s2_act_max.csv has blocks \[0, 1, 2\].*different models"):
        compare.main([f"a={tmp_path}/[ad]*_s*_act_max.csv", "--out", str(tmp_path / "mixed")])
    with pytest.raises(SystemExit) as twice:  # a usage error, as argparse's
        compare.main([f"a={tmp_path}/a_s0_act_max.csv", f"a={tmp_path}/b_s0_act_max.csv", "--out",
                      str(tmp_path / "twice")])
    assert twice.value.code == 2 and "method 'a' is given twice" in capsys.readouterr().err
    # one run as two methods, or a copy of it as a second seed: its maxima would count twice
    (tmp_path / "copy").mkdir()
    (tmp_path / "copy" / "a_s0_act_max.csv").write_bytes((tmp_path / "a_s0_act_max.csv").read_bytes())
    for groups in ([f"a={tmp_path}/a_s0_act_max.csv", f"b={tmp_path}/a_s*_act_max.csv"],
                   [f"a={tmp_path}/*/a_s0_act_max.csv", f"b={tmp_path}/a_s0_act_max.csv"]):
        with pytest.raises(SystemExit, match=r"a_s0_act_max.csv \(b\) holds the same maxima as .*a_s0_act_max.csv "
                                             r"\(a\): one run would count twice"):
            compare.main([*groups, "--out", str(tmp_path / "twice")])
    with pytest.raises(SystemExit, match=r"copy \(a\) cannot be read"):  # a folder the glob matched
        compare.main([f"a={tmp_path}/co*", "--out", str(tmp_path / "twice")])
    assert not os.path.exists(tmp_path / "twice.csv")


def test_a_file_that_is_not_an_act_max_csv_is_named(tmp_path):
    """The error names the file (was 'a CSV lacks the column ...' without it), and a row cut short is one
    error line too (was a TypeError traceback)."""
    compare = load()
    (tmp_path / "eval_best.json").write_text('{\n  "fp": {}\n}\n')
    with pytest.raises(SystemExit, match=r"eval_best.json is not an act_max CSV of evaluate.py \(no column 'block'\)"):
        compare.main([f"a={tmp_path}/eval_best.json", "--out", str(tmp_path / "o")])
    (tmp_path / "short.csv").write_text("name,kind,block,type,max\nblocks.0,block,0\n")
    with pytest.raises(SystemExit, match=r"short.csv is not an act_max CSV of evaluate.py"):
        compare.main([f"a={tmp_path}/short.csv", "--out", str(tmp_path / "o")])
    assert not os.path.exists(tmp_path / "o.csv")


def test_the_csv_holds_min_mean_max_over_runs_in_any_order(tmp_path):
    """Every statistic of the written CSV against values worked out by hand, with the larger run first (the
    max is not the last run's value) and the module maxima differing between the runs."""
    compare = load()
    write(tmp_path / "m_s0_act_max.csv", run_rows([9.0, 2.0], [1.0, 8.0], [4.0, 3.0]))
    write(tmp_path / "m_s1_act_max.csv", run_rows([5.0, 6.0], [2.0, 1.0], [7.0, 1.0]))
    out = str(tmp_path / "cmp")
    compare.main([f"m={tmp_path}/m_s*_act_max.csv", "--out", out])
    with open(out + ".csv", newline="") as f:
        got = [{k: (v if k == "method" else float(v)) for k, v in row.items()} for row in csv.DictReader(f)]
    # block 0: outputs 9, 5; modules max(1, 4) = 4 and max(2, 7) = 7. block 1: outputs 2, 6; modules 8 and 1
    assert got == [
        {"method": "m", "block": 0, "runs": 2, "block_mean": 7.0, "block_min": 5.0, "block_max": 9.0,
         "module_mean": 5.5, "module_min": 4.0, "module_max": 7.0},
        {"method": "m", "block": 1, "runs": 2, "block_mean": 4.0, "block_min": 2.0, "block_max": 6.0,
         "module_mean": 4.5, "module_min": 1.0, "module_max": 8.0}]


def test_a_shallower_run_of_a_method_is_refused_not_a_traceback(tmp_path):
    """A later run with fewer blocks than the first (another model) is one error naming it, as a deeper one is."""
    compare = load()
    write(tmp_path / "m_s0_act_max.csv", run_rows([1.0, 2.0, 3.0], [1.0] * 3, [1.0] * 3))
    write(tmp_path / "m_s1_act_max.csv", run_rows([1.0, 2.0], [1.0] * 2, [1.0] * 2))
    with pytest.raises(SystemExit, match=r"m_s1_act_max.csv has blocks \[0, 1\], .*m_s0_act_max.csv has "
                                         r"\[0, 1, 2\]"):
        compare.main([f"m={tmp_path}/m_s*_act_max.csv", "--out", str(tmp_path / "cmp")])
    assert not os.path.exists(tmp_path / "cmp.csv")
    # as many blocks as the first run, but other ones (a file without block 0's output row): refused by the
    # blocks it has, not averaged block by block (a KeyError traceback when only the counts were compared)
    rows = run_rows([1.0, 2.0, 3.0], [1.0] * 3, [1.0] * 3)
    write(tmp_path / "m_s1_act_max.csv", [r for r in rows if r["name"] != "blocks.0"]
          + [{"name": "blocks.3", "kind": "block", "block": 3, "type": "block", "max": 4.0}])
    with pytest.raises(SystemExit, match=r"m_s1_act_max.csv has blocks \[1, 2, 3\], .*m_s0_act_max.csv has "
                                         r"\[0, 1, 2\]"):
        compare.main([f"m={tmp_path}/m_s*_act_max.csv", "--out", str(tmp_path / "cmp")])
    assert not os.path.exists(tmp_path / "cmp.csv")


@pytest.mark.parametrize("field, value, setting", [
    ("eval_amp", "bf16", r"eval_amp: \"none\" vs \"bf16\""),
    ("weights", "ema", r"weights: \"raw\" vs \"ema\""),
    ("images", 50, "images: 100 vs 50"),
    ("data", {"dataset": "fashion_mnist"}, "data: "),
    ("model_kwargs", {"gelu": "tanh"}, r"other model.kwargs \(as trained vs model.kwargs=\{\"gelu\": \"tanh\"\}"),
    ("recipe", {"model.kwargs": {}, "train.lr": 0.01}, "trained with other settings .*train.lr"),
    ("fingerprint", "f0", "hold the same weights"),  # one run's best.pt and checkpoint.pt of the same weights
])
def test_runs_of_a_method_evaluated_differently_are_refused(tmp_path, field, value, setting):
    """Two seeds whose maxima were measured otherwise (the result files beside the CSVs differ in one setting)
    are one error naming both CSVs and the setting, not a mean of unlike numbers (was: averaged silently)."""
    compare = load()
    write(tmp_path / "s0_act_max.csv", run_rows([1.0, 2.0], [1.0] * 2, [1.0] * 2),
          **({"fingerprint": "f0"} if field == "fingerprint" else {}))
    write(tmp_path / "s1_act_max.csv", run_rows([3.0, 4.0], [1.0] * 2, [1.0] * 2), **{field: value})
    with pytest.raises(SystemExit) as e:
        compare.main([f"m={tmp_path}/s*_act_max.csv", "--out", str(tmp_path / "cmp")])
    message = str(e.value)
    assert message.startswith("error: ") and "\n" not in message
    assert "s0_act_max.csv" in message and "s1_act_max.csv" in message
    assert re.search(setting, message) and re.search(r"[;:] give [^;()]+$", message)  # the setting, then the fix
    assert not os.path.exists(tmp_path / "cmp.csv")


def test_the_settings_of_quantized_entries_do_not_part_runs(tmp_path):
    """The maxima come from the float pass: seeds whose result files hold a pipeline run with other options are
    averaged (paper_table --over-seeds would refuse them, for their quantized cells)."""
    compare = load()
    entry = lambda iters: {"repq": {"w4a4": {"top1": 50.0, "settings": {"options": {"iters": iters}}}}}
    write(tmp_path / "s0_act_max.csv", run_rows([1.0], [1.0], [1.0]), quant=entry(1))
    write(tmp_path / "s1_act_max.csv", run_rows([3.0], [1.0], [1.0]), quant=entry(2))
    rows = compare.main([f"m={tmp_path}/s*_act_max.csv", "--out", str(tmp_path / "cmp")])
    assert [r["block_mean"] for r in rows] == [2.0]


def test_a_csv_without_its_result_file_is_refused_with_how_to_measure_again(tmp_path):
    """The settings of a CSV without evaluate.py's JSON beside it are unknown: one error naming it and the
    command that writes both (was: averaged as if measured alike)."""
    compare = load()
    write(tmp_path / "s0_act_max.csv", run_rows([1.0], [1.0], [1.0]))
    write(tmp_path / "s1_act_max.csv", run_rows([3.0], [1.0], [1.0]), result=False)
    with pytest.raises(SystemExit, match=r"^error: .*s1_act_max.csv has no result file of evaluate.py beside it "
                                         r"\(.*s1.json\).*python evaluate.py --checkpoint"):
        compare.main([f"m={tmp_path}/s*_act_max.csv", "--out", str(tmp_path / "cmp")])
    write(tmp_path / "other.csv", run_rows([3.0], [1.0], [1.0]))  # not named as evaluate.py names them
    with pytest.raises(SystemExit, match=r"other.csv has no result file of evaluate.py beside it"):
        compare.main([f"m={tmp_path}/other.csv", "--out", str(tmp_path / "cmp")])
    # the JSON beside it records an evaluation that wrote no CSV (quant.act_max_csv=false): not this CSV's
    write(tmp_path / "s2_act_max.csv", run_rows([3.0], [1.0], [1.0]), max_act={"module": 1.0, "block": 1.0})
    with pytest.raises(SystemExit, match=r"s2.json lists no act_max CSV .*quant.act_max_csv=true"):
        compare.main([f"m={tmp_path}/s2_act_max.csv", "--out", str(tmp_path / "cmp")])
    assert not os.path.exists(tmp_path / "cmp.csv")


def test_a_method_evaluated_with_other_model_kwargs_than_trained_is_marked(tmp_path, capsys):
    """Seeds alike, but all evaluated with model.kwargs their recipe did not train with: the method's column is
    marked † with a note naming the kwargs; a method as trained is not (was: no mark)."""
    compare = load()
    for seed in (0, 1):
        write(tmp_path / f"t_s{seed}_act_max.csv", run_rows([1.0 + seed], [1.0], [1.0]), model_kwargs={"gelu": "tanh"})
    write(tmp_path / "p_s0_act_max.csv", run_rows([5.0], [1.0], [1.0]))
    compare.main([f"tanh={tmp_path}/t_s*_act_max.csv", f"plain={tmp_path}/p_s*_act_max.csv",
                  "--out", str(tmp_path / "cmp")])
    out = capsys.readouterr().out
    assert "| block | tanh† (block / module) | plain (block / module) |" in out
    assert '† tanh: evaluated with model.kwargs={"gelu": "tanh"} (trained with {})' in out
    assert "plain†" not in out and "† plain" not in out


@pytest.mark.parametrize("field, value, setting", [
    ("eval_amp", "bf16", r"eval_amp: \"none\" vs \"bf16\""),
    ("weights", "ema", r"weights: \"raw\" vs \"ema\""),
    ("images", 50, "images: 100 vs 50"),
    ("data", {"dataset": "fashion_mnist"}, r"data: \{\"dataset\": \"digits\"\} vs \{\"dataset\": \"fashion_mnist\"\}"),
    ("checkpoint_kind", "latest", r"checkpoint_kind: \"best\" vs \"latest\""),  # CD's checkpoint.pt, the best.pt
])
def test_methods_measured_under_other_settings_are_refused(tmp_path, field, value, setting):
    """Two methods whose maxima were measured otherwise (e.g. the baseline under bf16 autocast, CD in fp32) are one
    error naming a CSV of each, the setting and the fix, not drawn side by side (was: a figure mixing the setting's
    effect into the method's)."""
    compare = load()
    write(tmp_path / "base_s0_act_max.csv", run_rows([1.0, 2.0], [1.0] * 2, [1.0] * 2))
    for seed in (0, 1):
        write(tmp_path / f"cd_s{seed}_act_max.csv", run_rows([3.0 + seed, 4.0], [1.0] * 2, [1.0] * 2),
              checkpoint=f"cd_s{seed}.pt", **{field: value})
    with pytest.raises(SystemExit) as e:
        compare.main([f"baseline={tmp_path}/base_s*_act_max.csv", f"cd={tmp_path}/cd_s*_act_max.csv",
                      "--out", str(tmp_path / "cmp")])
    message = str(e.value)
    assert message.startswith("error: ") and "\n" not in message
    assert "base_s0_act_max.csv (baseline)" in message and "cd_s0_act_max.csv (cd)" in message
    assert re.search(setting, message) and re.search(r": give [^;()]+\(python evaluate.py [^;]+, or compare ", message)
    assert not os.path.exists(tmp_path / "cmp.csv") and not os.path.exists(tmp_path / "cmp.png")


def test_methods_of_other_recipes_and_quantized_settings_are_compared(tmp_path):
    """What makes the methods differ (their recipes: CD's settings, another lr), the quantized entries' settings
    (not of the float pass) and another model are no setting of the maxima: the methods are drawn side by side."""
    compare = load()
    write(tmp_path / "base_s0_act_max.csv", run_rows([1.0], [1.0], [1.0]),
          quant={"repq": {"w4a4": {"top1": 50.0, "settings": {"options": {"iters": 1}}}}})
    write(tmp_path / "cd_s0_act_max.csv", run_rows([3.0], [1.0], [1.0]), model="vit_s", checkpoint="cd.pt",
          recipe={"model.kwargs": {}, "train.lr": 0.01, "cd.lambda": 0.1},
          quant={"repq": {"w4a4": {"top1": 50.0, "settings": {"options": {"iters": 2}}}}})
    rows = compare.main([f"baseline={tmp_path}/base_s*_act_max.csv", f"cd={tmp_path}/cd_s*_act_max.csv",
                         "--out", str(tmp_path / "cmp")])
    assert [(r["method"], r["block_mean"]) for r in rows] == [("baseline", 1.0), ("cd", 3.0)]


def test_a_public_model_beside_runs_is_drawn_whatever_file_the_runs_scored(tmp_path):
    """model.pretrained weights (README: evaluate.py model.pretrained=/weights/deit_base.pth) are no file of a run:
    beside a run's best.pt or checkpoint.pt they are drawn, not refused for scoring no "same file of each run"
    (there is none to score instead); runs' best.pt beside checkpoint.pt stay refused."""
    compare = load()
    write(tmp_path / "deit_act_max.csv", run_rows([9.0], [1.0], [1.0]), checkpoint="/weights/deit_base.pth",
          checkpoint_kind="weights", recipe=None, method="vit_t")
    for kind, block in (("best", 3.0), ("latest", 4.0)):
        write(tmp_path / f"cd_{kind}_act_max.csv", run_rows([block], [1.0], [1.0]), checkpoint=f"cd/{kind}.pt",
              checkpoint_kind=kind)
        rows = compare.main([f"deit={tmp_path}/deit_act_max.csv", f"cd={tmp_path}/cd_{kind}_act_max.csv",
                             "--out", str(tmp_path / f"cmp_{kind}")])
        assert [(r["method"], r["block_mean"]) for r in rows] == [("deit", 9.0), ("cd", block)]
    with pytest.raises(SystemExit, match=r'checkpoint_kind: "best" vs "latest"'):
        compare.main([f"best={tmp_path}/cd_best_act_max.csv", f"latest={tmp_path}/cd_latest_act_max.csv",
                      "--out", str(tmp_path / "cmp_mixed")])


def measured_with_extra_modules(csv_path, patterns):
    """Rewrite the result file beside `csv_path` as of an evaluation with quant.act_max_extra_modules=patterns."""
    json_path = str(csv_path)[:-len("_act_max.csv")] + ".json"
    with open(json_path) as f:
        record = json.load(f)
    record["max_act"]["extra_modules"] = patterns
    with open(json_path, "w") as f:
        json.dump(record, f)


def test_maxima_over_other_extra_modules_are_refused(tmp_path):
    """A seed, or a method, whose module maxima also count modules outside the blocks
    (quant.act_max_extra_modules) measured another maximum: one error naming the setting, not a mean or a figure of
    unlike numbers (was: averaged and drawn silently)."""
    compare = load()
    for seed in (0, 1):
        write(tmp_path / f"a_s{seed}_act_max.csv", run_rows([1.0 + seed], [1.0], [1.0]))
    measured_with_extra_modules(tmp_path / "a_s1_act_max.csv", ["patch_embed.proj"])
    with pytest.raises(SystemExit, match=r'^error: .*a_s0_act_max.csv and .*a_s1_act_max.csv were evaluated '
                                         r'differently \(max_act.extra_modules: \[\] vs \["patch_embed.proj"\]\)'):
        compare.main([f"m={tmp_path}/a_s*_act_max.csv", "--out", str(tmp_path / "cmp")])
    # the seeds alike, the methods not
    measured_with_extra_modules(tmp_path / "a_s0_act_max.csv", ["patch_embed.proj"])
    write(tmp_path / "b_s0_act_max.csv", run_rows([5.0], [1.0], [1.0]), checkpoint="b.pt")
    with pytest.raises(SystemExit, match=r'were measured differently \(max_act.extra_modules: '
                                         r'\["patch_embed.proj"\] vs \[\]\); .*quant.act_max_extra_modules'):
        compare.main([f"a={tmp_path}/a_s*_act_max.csv", f"b={tmp_path}/b_s*_act_max.csv",
                      "--out", str(tmp_path / "cmp")])
    assert not os.path.exists(tmp_path / "cmp.csv")
    measured_with_extra_modules(tmp_path / "b_s0_act_max.csv", ["patch_embed.proj"])  # alike: compared
    rows = compare.main([f"a={tmp_path}/a_s*_act_max.csv", f"b={tmp_path}/b_s*_act_max.csv",
                         "--out", str(tmp_path / "cmp")])
    assert [(r["method"], r["block_mean"]) for r in rows] == [("a", 1.5), ("b", 5.0)]


def test_methods_measured_on_other_val_images_under_the_same_root_are_refused(tmp_path):
    """Two methods' maxima measured on a val folder exported again at the same path with as many other images
    were drawn side by side as measured alike (val_names was not among the float settings compared); a result
    that records no names (an older file) is not compared on them."""
    compare = load()
    write(tmp_path / "a_s0_act_max.csv", run_rows([1.0], [1.0], [1.0]), val_names="a" * 64)
    write(tmp_path / "b_s0_act_max.csv", run_rows([5.0], [1.0], [1.0]), checkpoint="b.pt", val_names="b" * 64)
    methods = [f"a={tmp_path}/a_s0_act_max.csv", f"b={tmp_path}/b_s0_act_max.csv"]
    with pytest.raises(SystemExit, match=r"were measured differently \(val_names: aaaaaaaaaaaa\.\.\. vs "
                                         r"bbbbbbbbbbbb\.\.\.: other val images"):
        compare.main([*methods, "--out", str(tmp_path / "cmp")])
    assert not os.path.exists(tmp_path / "cmp.csv")
    write(tmp_path / "b_s0_act_max.csv", run_rows([5.0], [1.0], [1.0]), checkpoint="b.pt")  # records no names
    rows = compare.main([*methods, "--out", str(tmp_path / "cmp")])
    assert [(r["method"], r["block_mean"]) for r in rows] == [("a", 1.0), ("b", 5.0)]


@pytest.mark.parametrize("group, out, expected", [
    ("cd={tmp}/none.csv", "{tmp}/", "names a folder, not the path of the two files"),  # wrote {tmp}/.csv, .png.png
    ("cd={tmp}/none.csv", "{tmp}", "names a folder, not the path of the two files"),
    ("cd={tmp}/none.csv", "{tmp}/cmp.png",
     "give the path without extension (.png and .csv are added), e.g. --out {tmp}/cmp"),
    ("{tmp}/none.csv", "{tmp}/cmp", "'{tmp}/none.csv' is not method=GLOB"),
    ("={tmp}/none.csv", "{tmp}/cmp", "'={tmp}/none.csv' is not method=GLOB"),  # a method without a name
])
def test_an_out_or_a_group_of_another_form_is_a_usage_error_before_anything_is_read(tmp_path, capsys, group, out,
                                                                                      expected):
    """Values the arguments refuse on their own exited 1 after parsing; they are usage errors (status 2), as
    argparse's, in one line."""
    group, out, expected = (text.format(tmp=tmp_path) for text in (group, out, expected))
    with pytest.raises(SystemExit) as refused:
        load().main([group, "--out", out])
    assert refused.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines
    assert list(tmp_path.iterdir()) == []


def record_digests(csv_path, plot=b"a plot"):
    """The result file beside `csv_path` records the size and SHA-256 of the CSV (as evaluate.py does, computed here
    with hashlib) and of a plot it writes beside."""
    import hashlib

    csv_path, json_path = str(csv_path), str(csv_path)[:-len("_act_max.csv")] + ".json"
    with open(csv_path, "rb") as f:
        data = f.read()
    with open(csv_path[:-4] + ".png", "wb") as f:
        f.write(plot)
    with open(json_path) as f:
        record = json.load(f)
    record["max_act"]["digests"] = {key: {"bytes": len(b), "sha256": hashlib.sha256(b).hexdigest()}
                                    for key, b in (("csv", data), ("plot", plot))}
    with open(json_path, "w") as f:
        json.dump(record, f)


def test_a_csv_other_than_the_one_its_result_file_records_is_refused(tmp_path):
    """The result file records the size and SHA-256 of the CSV evaluate.py wrote; a CSV edited since, or another
    evaluation's put at its name, was read with the settings of that result file as if they were its own."""
    compare = load()
    write(tmp_path / "s0_act_max.csv", run_rows([1.0], [2.0], [3.0]))
    write(tmp_path / "s1_act_max.csv", run_rows([3.0], [1.0], [1.0]))
    for name in ("s0_act_max.csv", "s1_act_max.csv"):
        record_digests(tmp_path / name)
    rows = compare.main([f"m={tmp_path}/s*_act_max.csv", "--out", str(tmp_path / "cmp")])
    assert [(r["block_mean"], r["module_mean"]) for r in rows] == [(2.0, 2.0)]  # as recorded: read
    with open(tmp_path / "s1_act_max.csv", "a") as f:  # edited: a row more
        f.write("blocks.0.mlp.fc1,module,0,mlp.fc1,50.0\n")
    with pytest.raises(SystemExit, match=r"^error: .*s1_act_max.csv is not the CSV that .*s1.json records .*"
                                         r"edited or replaced since.*evaluate.py --out .*s1.json"):
        compare.main([f"m={tmp_path}/s*_act_max.csv", "--out", str(tmp_path / "cmp2")])
    # another evaluation's CSV at the name of s1's (whose own is gone): the same rows as s0's, not s1's
    (tmp_path / "s1_act_max.csv").write_bytes((tmp_path / "s0_act_max.csv").read_bytes().replace(b"3.0", b"4.0"))
    with pytest.raises(SystemExit, match=r"s1_act_max.csv is not the CSV that .*s1.json records"):
        compare.main([f"m={tmp_path}/s1_act_max.csv", "--out", str(tmp_path / "cmp2")])
    assert not os.path.exists(tmp_path / "cmp2.csv")


@pytest.mark.parametrize("stem", ["c_act_max", "c_act_max.replaced1"])
def test_overwrite_never_replaces_a_maxima_file_evaluate_py_wrote(tmp_path, stem):
    """--out naming evaluate.py's per-layer plot and CSV of a result file (c.json) replaced them under --overwrite:
    files this script did not write. Refused, and both stay as they were; this script's own outputs are still
    replaced."""
    compare = load()
    write(tmp_path / "a_act_max.csv", run_rows([1.0], [2.0], [3.0]))
    write(tmp_path / "c_act_max.csv", run_rows([9.0], [9.0], [9.0]))
    record_digests(tmp_path / "c_act_max.csv", plot=b"evaluate.py's plot")
    if stem != "c_act_max":  # the old maxima's files that --recompute moved aside
        for end in (".csv", ".png"):
            os.replace(tmp_path / f"c_act_max{end}", tmp_path / f"{stem}{end}")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(SystemExit, match=rf"^error: .*{re.escape(stem)}\.png is a per-layer maxima file that "
                                         r"evaluate.py wrote for .*c\.json; --overwrite replaces only this script's "
                                         r"outputs: choose another --out$"):
        compare.main([f"a={tmp_path}/a_act_max.csv", "--out", str(tmp_path / stem), "--overwrite"])
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    compare.main([f"a={tmp_path}/a_act_max.csv", "--out", str(tmp_path / "cmp")])
    assert compare.main([f"a={tmp_path}/a_act_max.csv", "--out", str(tmp_path / "cmp"), "--overwrite"])


@pytest.mark.parametrize("foreign", [".png", ".csv"])
def test_overwrite_replaces_only_files_this_script_wrote(tmp_path, foreign):
    """--out X --overwrite replaced any X.png and X.csv but evaluate.py's maxima files: a paper's figure or another
    script's CSV at that name was lost. This script marks its outputs (the PNG's text entry Source, the CSV's header
    of its columns) and --overwrite replaces only files so marked, refusing any other with one error line and
    leaving every file as it was; the reference is the files' bytes before."""
    compare = load()
    write(tmp_path / "a_act_max.csv", run_rows([1.0], [2.0], [3.0]))
    out = tmp_path / "figure"
    compare.main([f"a={tmp_path}/a_act_max.csv", "--out", str(out)])
    mine = (tmp_path / f"figure{foreign}").read_bytes()
    compare.main([f"a={tmp_path}/a_act_max.csv", "--out", str(out), "--overwrite"])  # its own: replaced
    other = b"\x89PNG\r\n\x1a\nsomeone's figure" if foreign == ".png" else b"name,value\nlr,0.1\n"
    (tmp_path / f"figure{foreign}").write_bytes(other)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(SystemExit) as refused:
        compare.main([f"a={tmp_path}/a_act_max.csv", "--out", str(out), "--overwrite"])
    message = str(refused.value.code)
    assert message.startswith(f"error: {out}{foreign} is not a file compare_act_max.py wrote") and "\n" not in message
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    (tmp_path / f"figure{foreign}").write_bytes(mine)  # this script's file again: replaced
    compare.main([f"a={tmp_path}/a_act_max.csv", "--out", str(out), "--overwrite"])

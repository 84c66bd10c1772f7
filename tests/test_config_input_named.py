"""What a config refusal names when the input is of another shape than a config's: a folder given as --config (not
"not found": it is there), a file of two YAML documents (the rule it breaks, not only 'but found another document'),
one key spelt twice inside one section (each spelling, not the section twice), one value given to a list field (the
list that means it), and a sweep file given as --config (scripts/sweep.py runs it)."""
import os

import pytest

import sweep  # noqa: E402  (scripts/, on the path of the tests)
from configs import ConfigError, load_config
from tests.conftest import DEBUG_CONFIG, DEMO_CONFIG, ROOT, run_entry


def refusal(paths, overrides=()) -> str:
    with pytest.raises(ConfigError) as refused:
        load_config(paths, list(overrides))
    return str(refused.value)


def test_a_folder_given_as_a_config_is_named_a_folder_with_a_file_in_it(tmp_path):
    folder = tmp_path / "recipes"
    (folder / "b_sub").mkdir(parents=True)
    (folder / "b_sub" / "x.yaml").write_text("optim: {lr: 0.1}\n")
    (folder / "notes.txt").write_text("")
    (folder / "b.yml").write_text("optim: {lr: 0.1}\n")
    (folder / "a_sub").mkdir()
    (folder / "a_sub" / "a.yaml").write_text("optim: {lr: 0.1}\n")
    # only the folder's own files are read (a walk of `--config /` took seconds and named any YAML file at all)
    assert refusal([str(folder)]) == (f"{folder} is a folder, not a YAML file: give a file in it, e.g. "
                                      f"{folder / 'b.yml'}")
    assert refusal([str(folder / "b_sub")]).endswith(f"e.g. {folder / 'b_sub' / 'x.yaml'}")
    configs = os.path.join(ROOT, "configs")  # absolute: relative to another working folder it named the wrong one
    for holds_none in (tmp_path / "empty", tmp_path / "deep"):
        holds_none.mkdir()
    (tmp_path / "deep" / "sub").mkdir()
    (tmp_path / "deep" / "sub" / "x.yaml").write_text("optim: {lr: 0.1}\n")
    for holds_none in (tmp_path / "empty", tmp_path / "deep"):
        assert refusal([str(holds_none)]) == (f"{holds_none} is a folder, not a YAML file and holds no .yaml file: "
                                              f"this repository's configs are in {configs}, e.g. "
                                              f"{os.path.join(configs, 'debug', 'tiny.yaml')}")


def test_the_reviewers_command_names_the_folder(capsys):
    """`train.py --config configs` said 'config file not found: configs'."""
    code, _, err = run_entry("train.py", ["--config", "configs", "--print-config"], capsys)
    assert code == 1 and err.startswith("error: configs is a folder, not a YAML file and holds no .yaml file: this "
                                        f"repository's configs are in {os.path.join(ROOT, 'configs')}, e.g. ")
    example = err.strip().rpartition("e.g. ")[2]
    assert os.path.isabs(example) and os.path.isfile(example) and example.endswith(".yaml")


def test_two_yaml_documents_are_named_as_such_with_the_second_ones_line(tmp_path):
    path = tmp_path / "two.yaml"
    path.write_text("optim:\n  lr: 0.1\n---\noptim:\n  lr: 0.2\n")  # the second document starts on line 3
    assert refusal([str(path)]) == (f"{path}: not valid YAML: expected a single document in the stream, but found "
                                    f"another document (line 3, column 1)")


def test_an_unclosed_bracket_names_the_line_it_opened_on(tmp_path):
    path = tmp_path / "open.yaml"
    path.write_text("model:\n  name: [vit_micro\n")  # opened on line 2, the file ends on line 3
    message = refusal([str(path)])
    assert message.startswith(f"{path}: not valid YAML: while parsing a flow sequence started at line 2, ")
    assert message.endswith("(line 3, column 1)")


@pytest.mark.parametrize("text, first, second", [
    # the reviewer's file: both spellings inside `model`, which said "under 'model' and under 'model'"
    ("model:\n  kwargs: {depth: 2}\n  kwargs.depth: 3\n", "model.kwargs", "model.kwargs.depth"),
    ("model:\n  kwargs.depth: 3\n  kwargs: {depth: 2}\n", "model.kwargs.depth", "model.kwargs"),
    ("optim:\n  lr: 0.1\noptim.lr: 0.2\n", "optim", "optim.lr"),  # apart at the top level: the top-level keys
])
def test_one_key_spelt_twice_inside_one_section_names_both_spellings(tmp_path, text, first, second):
    path = tmp_path / "twice.yaml"
    path.write_text(text)
    key = "model.kwargs.depth" if text.startswith("model") else "optim.lr"
    assert refusal([DEBUG_CONFIG, str(path)]) == (f"{path}: {key} is set twice, under '{first}' and under "
                                                  f"'{second}'; keep one")


def test_distinct_entries_inside_one_section_are_not_twice(tmp_path):
    path = tmp_path / "two_entries.yaml"
    path.write_text("model:\n  kwargs: {depth: 2}\n  kwargs.embed_dim: 32\n")
    assert load_config([DEBUG_CONFIG, str(path)]).model.kwargs == {"depth": 2, "embed_dim": 32}


@pytest.mark.parametrize("key, value", [("quant.pipelines", "repq"), ("quant.bits", "w4a4")])
def test_one_value_given_to_a_list_field_names_the_list_and_that_list_is_taken(tmp_path, key, value):
    message = refusal([DEBUG_CONFIG], [f"{key}={value}"])
    assert message.endswith(f"got '{value}' (str); give a list: {key}=[{value}]")
    fix = message.rpartition("give a list: ")[2]
    cfg = load_config([DEBUG_CONFIG], [fix])  # the fix it names is accepted and means the one item
    assert getattr(cfg.quant, key.split(".")[1]) == [value]
    # in a file: the YAML value to write there
    section, _, leaf = key.partition(".")
    path = tmp_path / "q.yaml"
    path.write_text(f"{section}:\n  {leaf}: {value}\n")
    assert refusal([DEBUG_CONFIG, str(path)]).endswith(f"give a list: [{value}]")
    path.write_text(f"{section}:\n  {leaf}: [{value}]\n")
    assert getattr(load_config([DEBUG_CONFIG, str(path)]).quant, leaf) == [value]


@pytest.mark.parametrize("override", ["quant.bits=4", "quant.pipelines=5", "optim.betas=0.9"])
def test_a_value_that_no_list_of_the_field_takes_gets_no_list_advice(override):
    """An int is no str item (quant.bits), and optim.betas is a pair: a one-item list would be refused too."""
    assert "give a list" not in refusal([DEBUG_CONFIG], [override])


@pytest.mark.parametrize("key, text, written, items", [
    ("quant.pipelines", "repq,aphq", "[repq,aphq]", ["repq", "aphq"]),
    ("quant.bits", "w4a4,w8a8", "[w4a4,w8a8]", ["w4a4", "w8a8"]),
    ("quant.act_max_extra_modules", "a.*,b", "[a.*,b]", ["a.*", "b"]),
    ("data.mean", "0.5,0.5,0.5", "[0.5,0.5,0.5]", (0.5, 0.5, 0.5)),  # a tuple field: no advice was given at all
    ("optim.betas", "(0.9,0.95)", "[0.9,0.95]", (0.9, 0.95)),  # Python's tuple, as DeiT prints its --opt-betas
    ("data.scale", "0.08, 1", "[0.08,1]", (0.08, 1.0)),
])
def test_a_list_given_as_comma_joined_text_names_the_list_of_its_items(tmp_path, key, text, written, items):
    """`quant.pipelines=repq,aphq` (timm's and argparse's comma lists) is one text to YAML: the fix named was the
    one-item list ['repq,aphq'], whose item is no pipeline; a tuple field (data.mean=0.5,0.5,0.5) named no fix. The
    fix is now the list of the items, written without spaces (one shell word), and it is taken (on the digits, whose
    images read data.mean)."""
    message = refusal([DEMO_CONFIG], [f"{key}={text}"])
    assert message.endswith(f"(str); give a list: {key}={written}"), message
    cfg = load_config([DEMO_CONFIG], [f"{key}={written}"])
    section, _, leaf = key.partition(".")
    assert getattr(getattr(cfg, section), leaf) == items
    path = tmp_path / "q.yaml"
    path.write_text(f"{section}:\n  {leaf}: {text}\n")  # in a file: the YAML value to write there
    assert refusal([DEMO_CONFIG, str(path)]).endswith(f"give a list: {written}")


def test_a_sweep_file_given_as_a_config_names_scripts_sweep(capsys):
    path = "configs/sweeps/cd_lambda.yaml"
    code, _, err = run_entry("train.py", ["--config", path], capsys)
    assert code == 1 and err == (f"error: {path} is a sweep file (configs, out_root, runs), not a config: run it "
                                 f"with python scripts/sweep.py {path} (it prints each run's train.py command; --run "
                                 f"runs them)\n"), err
    assert [run["name"] for run in sweep.expand(os.path.join(ROOT, path), [])] == [
        "baseline", "lam0.0025", "lam0.005", "lam0.01"]  # the file is one scripts/sweep.py takes


def test_a_config_with_a_key_runs_is_told_its_unknown_key():
    """Only a file without a config section is taken for a sweep file: a config's stray key stays an unknown key."""
    with pytest.raises(ConfigError, match=r"unknown config key 'runs'"):
        load_config([DEBUG_CONFIG], ["runs=3"])


@pytest.mark.parametrize("path", ["", " "])
def test_an_empty_config_path_is_named_as_empty(path):
    """`--config "$RECIPE"` with the variable unset: 'config file not found: ' named no input and no fix."""
    assert refusal([path]) == f"a YAML file path is empty ({path!r}; an unset shell variable?): give the file's path"

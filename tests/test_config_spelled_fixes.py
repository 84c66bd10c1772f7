"""Values refused for their spelling, not their meaning, say the spelling the field takes (Python's None for
null, a whole float for an int, 0/1 for a bool), in the override's form on the command line and as the value
alone in a file; and a section given as an empty mapping (`model={}`, `model: {}`), which sets nothing, is
refused as a dict field's `{}` is, rather than passed as a reset to the defaults that it is not."""
from __future__ import annotations

import glob

import pytest

from configs.loader import ConfigError, load_config

TINY = "configs/debug/tiny.yaml"


@pytest.mark.parametrize("override, fix, named, unnamed", [
    # each with a value alike in form that the field takes in no spelling: nothing is named for it
    ("optim.lr=None", "; YAML spells it null: optim.lr=null", "optim.lr=null", "sched.epochs=None"),  # not optional
    ("optim.lr=none", "; YAML spells it null: optim.lr=null", "optim.lr=null", "sched.epochs=none"),
    ("optim={lr: None}", "; YAML spells it null: optim.lr=null", "optim.lr=null", "optim={lr: Nine}"),
    ("sched.epochs=3.0", "; give sched.epochs=3", "sched.epochs=3", "train.batch_size=1.5"),  # no whole number
    ("train.seed=4.0", "; give train.seed=4", "train.seed=4", "sched.epochs=1e30"),  # 10**30: beyond int64
    ("train.compile=1", "; give true or false", "train.compile=true", "train.compile=2"),  # no bool
    ("train.compile=0", "; give true or false", "train.compile=false", "train.compile=1.0"),
])
def test_an_override_spelt_another_way_names_the_spelling_that_is_taken(override, fix, named, unnamed):
    with pytest.raises(ConfigError) as refused:
        load_config([TINY], [override])
    message = str(refused.value)
    assert message.startswith("command line: '") and message.endswith(fix) and "\n" not in message, message
    load_config([TINY], [named])  # the spelling named is taken
    with pytest.raises(ConfigError) as refused:
        load_config([TINY], [unnamed])
    assert "; give" not in str(refused.value) and "spells it" not in str(refused.value), refused.value


@pytest.mark.parametrize("text, fix", [
    ("optim:\n  lr: None\n", "; YAML spells it null"),
    ("optim.lr: none\n", "; YAML spells it null"),
    ("sched:\n  epochs: 3.0\n", "; give 3"),
    ("train:\n  compile: 1\n", "; give true or false"),
])
def test_a_file_value_spelt_another_way_names_the_value_to_write_in_its_place(tmp_path, text, fix):
    """In a file the fix is the value alone, written where the refused one stands: `optim.lr=null` is no YAML
    line, and `optim.lr: null` beside an `optim:` mapping would be a key set twice."""
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as refused:
        load_config([TINY, str(path)])
    assert str(refused.value).startswith(f"{path}: '") and str(refused.value).endswith(fix), refused.value
    mended = text.replace("None", "null").replace("none", "null").replace("3.0", "3").replace(": 1", ": true")
    path.write_text(mended)
    load_config([TINY, str(path)])  # the value the fix names is taken


@pytest.mark.parametrize("override, key, example", [
    ("model={}", "model", "model.name=..."),
    ("cd={}", "cd", "cd.enabled=..."),
    ("quant={aphq: {}}", "quant.aphq", "quant.aphq.stem_w_bits=..."),  # a section inside a section
])
def test_a_section_given_as_an_empty_mapping_is_refused(override, key, example):
    """`model=null` is refused as a section and `model.kwargs={}` as a mapping that changes nothing; `model={}` was
    taken, leaving every key the recipe set."""
    with pytest.raises(ConfigError) as refused:
        load_config([TINY], [override])
    assert str(refused.value) == f"command line: '{key}' = {{}} changes nothing; give its keys ({example})"


def test_a_file_section_given_as_an_empty_mapping_is_refused_and_no_shipped_config_has_one(tmp_path):
    """A file's `model: {}` reads as a reset to the defaults as much as the override does (over an earlier file's
    model, it would keep that file's keys): the same refusal, with the file's form of the fix. Every config
    shipped in configs/ (sweep files aside, which are not configs) still loads."""
    path = tmp_path / "recipe.yaml"
    path.write_text("model: {}\n")
    with pytest.raises(ConfigError) as refused:
        load_config([TINY, str(path)])
    assert str(refused.value) == f"{path}: 'model' = {{}} changes nothing; give its keys ({{name: ...}})"
    configs = [p for p in glob.glob("configs/**/*.yaml", recursive=True) if "/sweeps/" not in p]
    assert len(configs) > 20
    for config in configs:
        load_config([config])


@pytest.mark.parametrize("word, read", [("off", "false"), ("no", "false"), ("On", "true"), ("YES", "true")])
def test_a_yaml_boolean_given_to_a_field_of_choices_is_named_as_one(tmp_path, word, read):
    """YAML 1.1 reads an unquoted yes/no/on/off (any case) as a boolean: train.amp=off was refused as "must be one
    of 'none', 'fp16', 'bf16'; got False", which names no off and no boolean. The line says now that YAML read the
    value as a boolean, on the command line and in a file; no choice of train.amp is such a word, so it sends the user
    to the choices, not to quoting."""
    config = tmp_path / "amp.yaml"
    config.write_text(f"train:\n  amp: {word}\n")
    for files, overrides, source in (([TINY], [f"train.amp={word}"], "command line"),
                                     ([TINY, str(config)], [], str(config))):
        with pytest.raises(ConfigError) as refused:
            load_config(files, overrides)
        message = str(refused.value)
        assert message.startswith(f"{source}: 'train.amp' must be one of 'none', 'fp16', 'bf16'; got {read.title()}; "
                                  f"YAML 1.1 read the value as the boolean {read} ") and "\n" not in message, message
        assert message.endswith("no choice is such a word: give one of the choices"), message


@pytest.mark.parametrize("source, fix", [("command line", "x.mode='off', inside the shell's quotes"),
                                         ("f.yaml", "'off'")])
def test_a_yaml_boolean_for_a_choice_that_is_such_a_word_is_told_to_be_quoted(source, fix):
    """A field whose choices are words YAML 1.1 reads as booleans (on / off): the line names the choice quoted, and
    the quoted word, text, is taken."""
    from typing import Literal

    from configs.loader import coerce_value

    annotation = Literal["on", "off", "auto"]
    with pytest.raises(ConfigError) as refused:
        coerce_value(False, annotation, "x.mode", source)
    assert str(refused.value).endswith(f"YAML 1.1 read the value as the boolean false (it reads an unquoted yes, no, "
                                       f"on, off, true or false so), not as text: quote it to keep it as text: {fix}")
    assert coerce_value("off", annotation, "x.mode", source) == "off"


BOOLEAN = "; YAML read the value as the boolean {}, not a number: give "


@pytest.mark.parametrize("override, fix, named", [
    # DeiT's --repeated-aug is a switch (3 repeats); here the key is the count
    ("data.repeated_aug=true", BOOLEAN.format("true") + "data.repeated_aug=3 (its default)", "data.repeated_aug=3"),
    ("data.repeated_aug=false", BOOLEAN.format("false") + "data.repeated_aug=0", "data.repeated_aug=0"),
    ("data.mixup=false", BOOLEAN.format("false") + "data.mixup=0", "data.mixup=0"),
    # 0 is no epoch count, and 300 is no meaning of false: no value is named
    ("sched.epochs=false", BOOLEAN.format("false") + "a number", "sched.epochs=3"),
    ("model.img_size=true", BOOLEAN.format("true") + "a number", "model.img_size=32"),
    ("data.repeated_aug=yes", BOOLEAN.format("true") + "data.repeated_aug=3 (its default)", "data.repeated_aug=3"),
])
def test_a_boolean_given_to_a_number_field_names_a_number_to_give(override, fix, named):
    """data.repeated_aug=true was refused as "'data.repeated_aug' expects int, ..., got True (bool)", with no word of
    what to give: a DeiT user's switch. The line now says that YAML read a boolean and names a number the key takes:
    its default for true, 0 for false where the key takes 0."""
    with pytest.raises(ConfigError) as refused:
        load_config([TINY], [override])
    message = str(refused.value)
    assert message.startswith("command line: '") and message.endswith(fix) and "\n" not in message, message
    load_config([TINY], [named])


def test_a_boolean_given_to_a_number_field_in_a_file_names_the_value_alone(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("data:\n  repeated_aug: true\n")
    with pytest.raises(ConfigError) as refused:
        load_config([TINY, str(path)])
    assert str(refused.value).startswith(f"{path}: 'data.repeated_aug' expects int")
    assert str(refused.value).endswith("; YAML read the value as the boolean true, not a number: give 3 (its default)")


def text_keys() -> list[str]:
    """Every schema key whose field takes text but not null (data.root, model.name, out_dir, ...)."""
    from configs.loader import _takes, get_key, schema_hints, schema_keys, takes_text
    from configs.schema import Config

    found = []
    for key in schema_keys():
        owner, _, name = key.rpartition(".")
        section = get_key(Config(), owner) if owner else Config()
        annotation = schema_hints(type(section))[name]
        if takes_text(annotation) and not _takes(annotation, type(None)):
            found.append(key)
    return found


def test_every_text_field_given_null_names_the_fix_on_the_command_line_and_in_a_file(tmp_path):
    """`root: ~` in a file (YAML's null) was refused as "'data.root' expects str, got None (NoneType)", which names
    no fix: the line now says YAML read no value and what to write, for every text field, on the command line and
    in a file (`key: ~`, `key: null`, `key:` alike); the empty text it names is taken where the key takes it."""
    keys = text_keys()
    assert {"data.root", "model.name", "out_dir", "train.resume", "model.pretrained", "optim.name"} <= set(keys)
    path = tmp_path / "recipe.yaml"
    for key in keys:
        *sections, name = key.split(".")
        with pytest.raises(ConfigError) as refused:
            load_config([TINY], [f"{key}=null"])
        assert str(refused.value) == (f"command line: '{key}' expects str, got None (NoneType); YAML reads null as no "
                                      f"value, not as text: give the text, or {key}= with nothing after it for empty "
                                      f"text"), refused.value
        for written in ("~", "null", ""):
            path.write_text("".join(f"{'  ' * i}{s}:\n" for i, s in enumerate(sections))
                            + f"{'  ' * len(sections)}{name}: {written}\n")
            with pytest.raises(ConfigError) as refused:
                load_config([TINY, str(path)])
            assert str(refused.value) == (f"{path}: '{key}' expects str, got None (NoneType); YAML reads null, ~ and a "
                                          f"key with no value as no value, not as text: write the text (quoted, '~', "
                                          f"for a ~ of its own) or '' for empty text"), refused.value
    for key in ("out_dir", "train.resume", "model.pretrained"):  # the empty text named is taken
        load_config([TINY], [f"{key}="])


@pytest.mark.parametrize("override, named", [
    ("quant.bits=null", "quant.bits=[]"),
    ("quant.act_max_extra_modules=null", "quant.act_max_extra_modules=[]"),
    ("sched.epochs=null", "sched.epochs=30"),  # the demo's own, not the schema's 300
    ("train.compile=null", "train.compile=false"),
    ("data.mean=null", "data.mean=[0.5,0.5,0.5]"),  # one shell word; the demo's, not ImageNet's
])
def test_null_given_to_a_field_that_takes_none_names_its_default(tmp_path, override, named):
    """`quant.bits=null` (no bit-widths meant) was refused as "expects list of str, got None" with no fix: the line
    names the value the key has without it (here the config's, or the default where it sets none), which is taken
    (for a list field, [] is also what no items are)."""
    demo = "configs/demo/vit_digits.yaml"
    with pytest.raises(ConfigError) as refused:
        load_config([demo], [override])
    message = str(refused.value)
    assert message.endswith(f"; YAML reads null as no value, which this key does not take: give a value, e.g. the "
                            f"one it has without it, {named}") and "\n" not in message, message
    load_config([demo], [named])
    path = tmp_path / "recipe.yaml"
    path.write_text(f"{override.partition('=')[0]}: null\n")
    with pytest.raises(ConfigError) as refused:
        load_config([demo, str(path)])
    assert str(refused.value).endswith(f"give a value, e.g. the one it has without it, {named.partition('=')[2]}"), \
        refused.value


@pytest.mark.parametrize("config, override, named", [
    ("configs/lm/kjv_cpu.yaml", "model.drop_path=null", "model.drop_path=0.0"),  # 0.1 is refused for a GPT
    ("configs/lm/kjv_cpu.yaml", "train.batch_size=null", "train.batch_size=32"),  # not the schema's 1024
    ("configs/demo/vit_digits.yaml", "sched.epochs=null", "sched.epochs=30"),
])
def test_null_names_the_value_the_key_has_without_it_not_the_schema_default(tmp_path, config, override, named):
    """The fix named for null was the schema's default whatever the config gave: on a language model's config
    model.drop_path=0.1, which the model refuses, and over a recipe its batch size or epochs replaced by DeiT's."""
    with pytest.raises(ConfigError) as refused:
        load_config([config], [override])
    assert str(refused.value).endswith(f"give a value, e.g. the one it has without it, {named}"), refused.value
    assert load_config([config], [named]) == load_config([config])  # the run the config alone gives
    path = tmp_path / "over.yaml"
    path.write_text(f"{override.partition('=')[0]}: null\n")  # in a file over the config: the value before it
    with pytest.raises(ConfigError) as refused:
        load_config([config, str(path)])
    assert str(refused.value).endswith(f"e.g. the one it has without it, {named.partition('=')[2]}"), refused.value

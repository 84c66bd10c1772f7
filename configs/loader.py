"""Strict config loading: dataclass defaults < YAML files (in order) < `key=value` overrides.

    cfg = load_config(["configs/pretrain/vit_b.yaml"], ["optim.lr=1e-3", "out_dir=runs/x"])

Values are parsed as YAML (so `1e-3`, `true`, `null`, `[1, 2]` work; numbers as YAML 1.2 reads them, and a number
field refuses `010` and `1:30`, which YAML 1.1 reads as octal 8 and base-60 90) and checked against the field's
annotation (an int also against int64's range); an override value that YAML would cut at an unquoted ` #` (a
comment), or read as the empty string (`|`, `>`: block scalars with no lines), is refused, a quoted one keeps it; a
number, date or boolean given to a text field is refused with its quoted form (`data.val_split='2012'`). An unknown
key is an error that names the key and its
closest matches in any section; so is a value of the wrong type or outside a `Literal` choice, a key given twice in one
YAML mapping, and a key that two overrides set. `dict` fields (e.g. `model.kwargs`, `cd.lam_per_role`) accept
any keys, also as dotted overrides (`cd.lam_per_role.fc2=0.02`); a mapping given to one adds its entries to what
earlier layers put there, as a section's keys do, and null empties it. A key that the resolved config would not
read is refused (`READ_ONLY_WHEN`: data.root while data.dataset is digits or synthetic, cd.* while cd.enabled is false,
optim.lr_base while optim.lr is set, data.mixup_prob while mixup and cutmix are both 0, data.mixup while
data.mixup_prob is 0, sched.warmup_lr or sched.warmup_prefix without a warmup, log.wandb_* while log.wandb is false,
...): every override (unless the overrides switch its section off
themselves: cd.enabled=false beside cd.lam, a sweep's baseline), and every value a file changes where the
deciding key comes from what the file is layered over (a layer of image settings over an LM recipe's
data.dataset=kjv); a deciding key set by the same file or a later layer makes the file's key moot on purpose.
"""
from __future__ import annotations

import copy
import dataclasses
import datetime
import difflib
import functools
import os
import re
import sys
import types
import typing
from typing import Annotated, Any, Callable, Iterable, Iterator, Literal, Optional, Sequence, Union

import yaml

from .constraints import LOCALE_FIX, Range, UserPath, check_together, finite
from .schema import ADAM_OPTIMIZERS, Config


class ConfigError(ValueError):
    """A config file or override that does not fit the schema."""


class _YamlLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2's numbers (below: `1e-3` and `5E4` are floats, 010 and 1:30 no YAML 1.1 octal or
    base-60 integers), that refuses a key given twice in one mapping (PyYAML keeps the last one silently: a second
    `optim:` section would drop the first one's keys)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first_line = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` may be overridden key by key
                    continue
                key = self.construct_object(key_node, deep=True)
                if not isinstance(key, typing.Hashable):
                    continue  # SafeLoader reports unhashable keys itself
                line = key_node.start_mark.line + 1
                if key in first_line:
                    raise yaml.constructor.ConstructorError(
                        problem=f"key '{key}' appears twice (lines {first_line[key]} and {line}); keep one")
                first_line[key] = line
        return super().construct_mapping(node, deep=deep)


class AmbiguousNumber(str):
    """A plain scalar that YAML versions read as different numbers: a leading zero (010: octal 8 in YAML 1.1, 10 in
    YAML 1.2) or digits with colons (1:30: base 60, 90, in YAML 1.1). Kept as its text, which a text field takes as
    it is; a number field refuses it (`coerce_value`) rather than read it as YAML 1.2 would: a recipe written for
    YAML 1.1 means 8, and other readers of the same file (PyYAML's safe_load in a user's script) still read 8."""


AMBIGUOUS_NUMBER = "tag:config,ambiguous-number"
_NUMBER_START = list("-+0123456789.")
# SafeLoader's YAML 1.1 int and float resolvers read 010 as 8 and 1:30 as 90, and its float wants `1.0e-3`; in
# their place (the first match wins, so the ambiguous forms come first): YAML 1.2's integers (decimal, 0x hex,
# 0o octal, with 1.1's `_` separators), floats with a point or an exponent (`1e-3` and `5E4` too), and the rest
_YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers
            if first not in _NUMBER_START or tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_NUMBER_RESOLVERS = [(tag, re.compile(pattern, re.X)) for tag, pattern in (
    (AMBIGUOUS_NUMBER, r"^[-+]?(?:0[0-9_]+|[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?)$"),
    ("tag:yaml.org,2002:int", r"^(?:[-+]?(?:0|[1-9][0-9_]*)|0x[0-9a-fA-F_]+|0o[0-7_]+)$"),
    ("tag:yaml.org,2002:float", r"""^(?:[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[0-9][0-9_]*[eE][-+]?[0-9]+
                                 |\.[0-9_]+(?:[eE][-+]?[0-9]+)?|\.(?:inf|Inf|INF))|\.(?:nan|NaN|NAN))$"""))]
for _first in _NUMBER_START:  # before the others (timestamps: 2024-01-31) for these first characters
    _YamlLoader.yaml_implicit_resolvers[_first] = [*_NUMBER_RESOLVERS,
                                                   *_YamlLoader.yaml_implicit_resolvers.get(_first, [])]
_YamlLoader.add_constructor(AMBIGUOUS_NUMBER, lambda loader, node: AmbiguousNumber(loader.construct_scalar(node)))


class _YamlDumper(yaml.SafeDumper):
    """SafeDumper that quotes a string wherever the loader above, or PyYAML's own YAML 1.1 reading, would take its
    plain text for something else. SafeDumper alone quotes by YAML 1.1 only: out_dir='1e-3' was written plain and
    read back by --config as the float 0.001 (also 5E4, 0o17, +.5e3); with the loader's resolvers alone, '0b101'
    would be written plain and read as 5 by safe_load (saved_config, a user's script)."""


# a plain scalar is written only where the resolvers read it back as its own type: the first match of either
# reading (the loader's first, so a number keeps its tag) decides, and a string matched by any is quoted
_YamlDumper.yaml_implicit_resolvers = {
    first: _YamlLoader.yaml_implicit_resolvers.get(first, []) + yaml.SafeDumper.yaml_implicit_resolvers.get(first, [])
    for first in {*_YamlLoader.yaml_implicit_resolvers, *yaml.SafeDumper.yaml_implicit_resolvers}}


def parse_yaml(text: str) -> Any:
    """Parse YAML text (a file or one override value) the way every config value is parsed."""
    return yaml.load(text, Loader=_YamlLoader)


def dump_yaml(data: Any, stream=None, **options) -> Optional[str]:
    """`data` as YAML (yaml.safe_dump's `options`) that parse_yaml, and yaml.safe_load, read back as it is: every
    config written (a run's config.yaml, --print-config) is taken back by --config."""
    return yaml.dump(data, stream, Dumper=_YamlDumper, **options)


def load_config(paths: Sequence[str] | str | None = None, overrides: Iterable[str] = ()) -> Config:
    """Build a Config from defaults, then each YAML file in `paths`, then `overrides`; keys that must agree
    with each other are checked last (configs/constraints.py `check_together`)."""
    if isinstance(paths, str):
        paths = [paths]
    cfg = layer_config(Config(), paths or (), overrides)
    problems = check_together(cfg)
    if problems:
        raise ConfigError(problems[0])
    return cfg


CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root


def _checkout_hint(path: str) -> str:
    """When a relative `path` is missing from the working folder but the checkout has it (`configs/...` given
    from a job's own folder, as schedulers start jobs): a hint naming both."""
    if os.path.isabs(path) or not os.path.isfile(os.path.join(CHECKOUT, path)):
        return ""
    return (f" (a relative path starts at the working folder, {os.getcwd()}); the checkout's file is "
            f"{os.path.join(CHECKOUT, path)}: give that path")


def _yaml_file_example(folder: str) -> str:
    """': give a file in it, e.g. <folder>/<first .yaml file directly in it>' (in sorted order), or, where it holds
    none directly, ' and holds no .yaml file: this repository's configs are in <checkout>/configs, e.g.
    <checkout>/configs/debug/tiny.yaml'. Only the folder's own entries are read: walking its tree took seconds for
    `--config /` and suggested any YAML file at all (/root/.pyenv/.github/FUNDING.yml)."""
    try:
        found = sorted(e.name for e in os.scandir(folder) if e.is_file() and e.name.endswith((".yaml", ".yml")))
    except OSError:
        found = []
    if found:
        return f": give a file in it, e.g. {os.path.join(folder, found[0])}"
    configs = os.path.join(CHECKOUT, "configs")  # absolute: a relative path from elsewhere named another folder
    return (f" and holds no .yaml file: this repository's configs are in {configs}, e.g. "
            f"{os.path.join(configs, 'debug', 'tiny.yaml')}")


def read_yaml_file(path: str) -> dict:
    """The top-level mapping of the YAML file at `path` (a config or a sweep file); a missing file, invalid
    YAML, a key given twice or a non-mapping is a ConfigError naming the file (and the line)."""
    if not path.strip():  # `--config "$RECIPE"` with the variable unset: 'config file not found: ' named nothing
        raise ConfigError(f"a YAML file path is empty ({path!r}; an unset shell variable?): give the file's path")
    if os.path.isdir(path):  # "not found" would send the user looking for a path that is there
        raise ConfigError(f"{path} is a folder, not a YAML file{_yaml_file_example(path)}")
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}{_checkout_hint(path)}")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a YAML text file (not UTF-8 text: a checkpoint or weights file? those "
                          f"are --checkpoint / model.pretrained)") from None
    try:
        data = parse_yaml(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {_yaml_problem(e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def layer_config(cfg: Config, paths: Sequence[str], overrides: Iterable[str]) -> Config:
    """Apply the YAML files `paths` in order, then `overrides`, to `cfg` (the defaults, or a checkpoint's
    config) in place, and return it. Every override, and every key a file changes from what `cfg` had, must be
    read by the result (`check_keys_read`; a key a later file or override sets again is checked there), unless
    the file's key was made moot on purpose: by the same file setting the deciding key (a run's own
    config.yaml says what it means), or by a later layer changing the deciding key's value or switching its
    section off (a recipe of another data set over it, cd.enabled=false over cd.yaml). Setting the deciding
    key again to the value it had does not make a key read."""
    overrides = list(overrides)
    before = copy.deepcopy(cfg)
    deciders = {decider for _, decider, _ in READ_ONLY_WHEN}
    layer: dict[str, int] = {}  # dotted key -> the last layer that set it (files 0, 1, ...; the overrides last)
    set_in: dict[str, set] = {}  # dotted key -> every file that set it (a later layer may repeat its value)
    values: dict[str, Any] = {}  # dotted key -> the value its last file gives it
    decided: list[dict] = []  # per file: the deciding keys' values once that file was applied
    for index, path in enumerate(paths):
        data = read_yaml_file(path)
        if "runs" in data and not set(data) & {f.name for f in dataclasses.fields(Config)}:
            # a sweep file (scripts/sweep.py: configs, out_root, runs) given as a config: its first key is no
            # config key, which says nothing of what the file is
            raise ConfigError(f"{path} is a sweep file (configs, out_root, runs), not a config: run it with "
                              f"python scripts/sweep.py {path} (it prints each run's train.py command; --run runs "
                              f"them)")
        _merge(cfg, data, path="", source=path)
        # what the file set (override_settings) -> the mapping keys, as written, down to where it was set
        spelt: dict[tuple, tuple] = {}
        for key, value in data.items():
            # `optim.lr: 0.1` beside `optim: {lr: 0.2}`: the YAML check of repeated keys sees two keys, and the later
            # spelling would replace the earlier without a word. A dict field counts by entry, as for overrides:
            # `model: {kwargs: {depth: 3}}` beside `model.kwargs.embed_dim: 64` sets two entries
            for written, dotted, inner in _written_settings((str(key),), value, cfg):
                for setting in override_settings(dotted, inner, cfg):
                    twice = next((earlier for earlier in spelt if setting[:len(earlier)] == earlier[:len(setting)]
                                  and not (".".join(earlier) in dict_fields() and len(setting) > len(earlier))), None)
                    if twice is not None:
                        first, second = _spellings_apart(spelt[twice], written)
                        raise ConfigError(f"{path}: {'.'.join(min(twice, setting, key=len))} is set twice, under "
                                          f"'{first}' and under '{second}'; keep one")
                    spelt[setting] = written
            for dotted, inner in dotted_settings(str(key), value, cfg).items():
                layer[dotted], values[dotted] = index, inner
                set_in.setdefault(dotted, set()).add(index)
        decided.append({decider: copy.deepcopy(decider_value(cfg, decider)) for decider in deciders})
    cfg = apply_overrides(cfg, overrides)
    layer.update(dict.fromkeys((key for item in overrides for key in override_keys(item)), len(paths)))
    from_files = {key: values[key] for key, index in layer.items() if index < len(paths) and _changed(before, cfg, key)}

    def excused(key: str, decider: Union[str, When]) -> bool:
        own = layer[key]
        # a key among its When's other keys (cd.lam in CD_LAM_READ) is not excused by its own layer; the deciding
        # key of a section ("cd." under cd.enabled) is
        keys = [k for k in decider_keys(decider) if k != key] or decider_keys(decider)
        last = max(layer.get(k, -1) for k in keys)
        final = decider_value(cfg, decider)
        # the key's own file set the deciding key too (train: {ema: false, ema_decay: 0.999}, a run's config.yaml):
        # it says what it means, whatever a later layer repeats (train.ema=false over that config.yaml)
        if last == own or any(own in set_in.get(k, ()) for k in keys):
            return True
        # a section switched off again at the value it had still says what it means (cd.enabled=false over a file's
        # cd.lam); a single option's switch given false again does not (as check_keys_read's overrides)
        off = final is False and decider in section_switches()
        return last > own and (final != decided[own][decider] or off)

    check_keys_read(cfg, from_files, sources={key: paths[layer[key]] for key in from_files}, excused=excused)
    return cfg


def _written_settings(written: tuple, value: Any, cfg: Config) -> list[tuple[tuple, str, Any]]:
    """(the mapping keys as written, the dotted key, its value) of each setting of a file's entry, as
    `dotted_settings` splits it: a section given as a mapping by its keys, each written key kept."""
    dotted = ".".join(written)
    if isinstance(value, dict) and dataclasses.is_dataclass(_section(cfg, dotted)):
        return [s for name, sub in value.items() for s in _written_settings((*written, str(name)), sub, cfg)]
    return [(written, dotted, value)]


def _spellings_apart(first: tuple, second: tuple) -> tuple[str, str]:
    """Two written key paths that set one key, each up to the first key where they part ('optim' and 'optim.lr';
    'model.kwargs' and 'model.kwargs.depth' for `model: {kwargs: {depth: 2}, kwargs.depth: 3}`), joined by dots."""
    part = next((i for i, (a, b) in enumerate(zip(first, second)) if a != b), min(len(first), len(second)) - 1)
    return ".".join(first[:part + 1]), ".".join(second[:part + 1])


def _changed(before: Config, after: Config, key: str) -> bool:
    """Whether `key` differs between the two configs (a key new to a free-form dict field does)."""
    try:
        return get_key(before, key) != get_key(after, key)
    except (KeyError, AttributeError):
        return True


def apply_overrides(cfg: Config, overrides: Iterable[str], rules: Optional[Sequence] = None) -> Config:
    """Apply `key=value` overrides to `cfg` in place (and return it), checked like everything else; an
    override that the resulting config would ignore is refused (`check_keys_read` by `rules`, default
    READ_ONLY_WHEN; DETECTOR_RULES for a detector's pipeline options), and so is one that sets a key an earlier item
    set (optim.lr twice, train.seed=5 after train={seed: 2}); emptying a dict field with null before giving its
    entries is the one order that means both."""
    given = {}
    # what an earlier item set (override_settings) -> that item; a dict field itself there was emptied by it, and
    # a later item may give its entries
    set_by: dict[tuple, str] = {}
    overrides = list(overrides)
    for index, item in enumerate(overrides):
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value"
                              + _word_without_value_fix(item, overrides[index + 1:index + 2]))
        try:
            value = parse_yaml(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            if any("\udc80" <= c <= "\udcff" for c in raw):  # bytes the locale could not decode (PEP 383)
                raise ConfigError(f"override {item!r}: the command line has bytes the locale's encoding "
                                  f"({sys.getfilesystemencoding()}) cannot decode; {LOCALE_FIX}") from None
            raise ConfigError(f"override {item!r}: the value is not valid YAML: {_yaml_problem(e)}") from None
        if raw.strip() and _drops_a_comment(raw):
            # `out_dir=/runs/exp #2` would be read as out_dir=/runs/exp: another run's folder, resumed silently
            raise ConfigError(f"override {item!r}: YAML reads ' #' and what follows as a comment, so the value "
                              f"would be {_show(value)}; quote the value to keep the '#' "
                              f"({key.strip()}={_single_quoted(raw.strip())}, inside the shell's quotes), or drop "
                              f"the comment")
        if value == "" and raw.strip() and not _quoted_scalar(raw):
            # `out_dir=|` is YAML's block scalar with no lines: "", which train.py replaces by runs/<recipe>
            raise ConfigError(f"override {item!r}: YAML reads {raw.strip()!r} as an empty string, not as that "
                              f"text; quote the value to keep it ({key.strip()}={_single_quoted(raw.strip())}, "
                              f"inside the shell's quotes), or give {key.strip()}='' for an empty value")
        try:
            _assign(cfg, key.strip().split("."), value, path="", source="command line")
        except TextReadAsValue as e:
            if e.key != key.strip():  # an item of a list or of a section given as a mapping: not the override's text
                raise
            raise ConfigError(e.on_command_line(raw)) from None
        except RefusedValueError as e:
            if value is None and raw.strip() == "~" and e.key == key.strip() and e.takes_text:
                # YAML's null sign, where a path key (out_dir=~) means the home folder: only quoted is it text
                raise ConfigError(f"override {item!r}: YAML reads '~' as null, not as the text '~' (a path key's home "
                                  f"folder); quote it ({key.strip()}='~', inside the shell's quotes)") from None
            raise
        given.update(dotted_settings(key.strip(), value, cfg))
        for setting in override_settings(key.strip(), value, cfg):
            # as a key twice in a YAML file: the later item would replace the earlier one without a word
            twice = [earlier for earlier in set_by if setting[:len(earlier)] == earlier[:len(setting)]
                     and not (".".join(earlier) in dict_fields() and len(setting) > len(earlier))]
            if twice:
                entries_first = ".".join(setting) in dict_fields() and len(twice[0]) > len(setting)
                raise ConfigError(f"override {item!r} sets {'.'.join(setting)}, which the override "
                                  f"{set_by[twice[0]]!r} sets already; keep one"
                                  + (" (or empty the dict before giving its entries)" if entries_first else ""))
            set_by[setting] = item
    check_keys_read(cfg, given, rules=READ_ONLY_WHEN if rules is None else rules)
    return cfg


def _word_without_value_fix(item: str, after: list[str]) -> str:
    """The fix for a word without '=' that is a key whose value came as the next word (`optim.lr 1e-3`: '; give
    optim.lr=1e-3, one word'); '' otherwise. (A YAML file given without --config: configs/cli.parse_known, where the
    entry has --config.)"""
    word = item.strip()
    if word in schema_keys() and not dataclasses.is_dataclass(get_key(Config(), word)):
        value = after[0] if after and "=" not in after[0] and not after[0].startswith("-") else "VALUE"
        return f"; give {word}={value}, one word"
    return ""


def _drops_a_comment(raw: str) -> bool:
    """Whether parsing `raw` as YAML skips a comment: a '#' after whitespace outside quotes (the scanner puts
    comments, and nothing else but whitespace, between its tokens)."""
    tokens = list(yaml.scan(raw, Loader=_YamlLoader))
    return any("#" in raw[a.end_mark.index:b.start_mark.index] for a, b in zip(tokens, tokens[1:]))


def _quoted_scalar(raw: str) -> bool:
    """Whether the YAML text `raw` is one quoted scalar ('' or "": an empty string given as one), not a block scalar
    (`|`, `>`) or a tag (`!!str`) that reads as empty text too."""
    node = yaml.compose(raw, Loader=_YamlLoader)
    return isinstance(node, yaml.ScalarNode) and node.style in ("'", '"')


@functools.lru_cache(maxsize=None)
def dict_fields() -> frozenset:
    """The dotted keys of the free-form dict fields (model.kwargs, cd.lam_per_role)."""
    cfg = Config()
    return frozenset(key for key in schema_keys() if isinstance(get_key(cfg, key), dict))


def override_settings(key: str, value: Any, cfg: Config) -> list[tuple[str, ...]]:
    """What the override `key=value` sets, each as the parts of its dotted key: a section given as a mapping
    (train={seed: 7}) by key, and a free-form dict field by entry, however spelt (model.kwargs={depth: 2} and
    model.kwargs.depth=2 set the entry depth, model.kwargs.mlp.cfg=4 the entry 'mlp.cfg'); a dict field given
    null or {} (emptied) is the field itself, and only then."""
    settings = []
    for dotted, inner in dotted_settings(key, value, cfg).items():
        field = next((f for f in dict_fields() if dotted == f or dotted.startswith(f + ".")), None)
        if field is None:
            settings.append(tuple(dotted.split(".")))
        elif dotted != field:
            settings.append((*field.split("."), dotted[len(field) + 1:]))
        elif isinstance(inner, dict) and inner:
            settings += [(*field.split("."), str(entry)) for entry in inner]
        else:
            settings.append(tuple(field.split(".")))
    return settings


class RefusedValueError(ConfigError):
    """A value of a known key that the schema refuses (its type, or a range of configs/constraints.py); `key` is its
    dotted key. evaluate.py tells a checkpoint's recorded value that this version's checks refuse (one an earlier
    version accepted) from a key this version does not know. `takes_text`: the key's field takes a string (a quoted
    value can be the fix)."""

    def __init__(self, message: str, key: str, takes_text: bool = False):
        super().__init__(message)
        self.key, self.takes_text = key, takes_text


class IgnoredOverrideError(ConfigError):
    """An override, or a value of a config file, of a key that the config, as resolved, never reads (e.g.
    data.root for digits)."""


SET = "set"  # in READ_ONLY_WHEN: any value of the deciding key but null and ""
NONZERO = "nonzero"  # in READ_ONLY_WHEN: any number but 0


@dataclasses.dataclass(frozen=True)
class When:
    """A deciding condition over several keys (READ_ONLY_WHEN's decider where one key's value does not say it):
    `holds(*values of keys)`, worded as `text` in the refusal; `fix`, where given, replaces the refusal's
    "drop it or set <keys> as well" (a When over the key's own value, whose fix is another key)."""
    keys: tuple[str, ...]
    holds: Callable[..., bool]
    text: str
    fix: str = ""

    def __str__(self) -> str:
        return " / ".join(self.keys)


def decider_keys(decider: Union[str, When]) -> tuple[str, ...]:
    """The keys whose values decide (one, or a When's)."""
    return decider.keys if isinstance(decider, When) else (decider,)


def decider_value(cfg: Any, decider: Union[str, When]) -> Any:
    """The deciding key's value, or the values of a When's keys (a tuple)."""
    if isinstance(decider, When):
        return tuple(get_key(cfg, key) for key in decider.keys)
    return get_key(cfg, decider)


def _reads(value: Any, read_with: tuple) -> bool:
    return (value in read_with or (SET in read_with and value not in (None, ""))
            or (NONZERO in read_with and not isinstance(value, str) and value != 0))


def _reads_under(decider: Union[str, When], value: Any, read_with: tuple) -> bool:
    return decider.holds(*value) if isinstance(decider, When) else _reads(value, read_with)


# the timm Mixup that data/loader.py builds: none when both alphas are 0, the switch only when both are above 0
MIXUP_ON = When(("data.mixup", "data.cutmix"), lambda mixup, cutmix: mixup > 0 or cutmix > 0,
                "data.mixup or data.cutmix is above 0 (a Mixup is built)")
MIXUP_AND_CUTMIX = When(("data.mixup", "data.cutmix"), lambda mixup, cutmix: mixup > 0 and cutmix > 0,
                        "data.mixup and data.cutmix are both above 0 (the Mixup switches between them)")
# timm's Mixup at data.mixup_prob 0 mixes no batch: its lam stays 1, so the alphas change no image and no target;
# mixup and cutmix both 0 still say that no Mixup is built (the plain label-smoothing loss, any batch size)
MIXUP_DRAWN = When(("data.mixup_prob", "data.mixup", "data.cutmix"),
                   lambda prob, mixup, cutmix: prob > 0 or (mixup <= 0 and cutmix <= 0),
                   "data.mixup_prob is above 0 (a batch is mixed) or data.mixup and data.cutmix are both 0 (no Mixup "
                   "is built)", "drop it, or give data.mixup_prob above 0 (at 0 no batch is mixed)")
# engine/optim.py: a warmup from warmup_lr of sched.warmup_steps updates (with sched.steps) or warmup_epochs
WARMUP = When(("sched.steps", "sched.warmup_steps", "sched.warmup_epochs"),
              lambda steps, warmup_steps, warmup_epochs: (warmup_steps if steps is not None else warmup_epochs) > 0,
              "the schedule has a warmup (sched.warmup_epochs above 0, or with sched.steps sched.warmup_steps)")

# timm's transforms_imagenet_train turns colour jitter off under an auto_augment policy, unless the policy names
# DeiT III's 3-Augment ('3a' in the string), which keeps the ColorJitter of data.color_jitter
COLOR_JITTER_ON = When(("data.auto_augment",), lambda policy: policy == "" or "3a" in policy,
                       "data.auto_augment is \"\" or holds 3a (timm builds a ColorJitter)")
# cd/decay.py aux_loss: the loss form weighs each pair by lam_role / lam and aligns the weighted penalty P to the
# task loss (loss_coef * P * detach(|L| / P)), so scaling every weight by one factor cancels: without the budget
# rule (wd -> wd - lam) cd.lam acts only as the base of cd.lam_per_role's weights, and as 0, which switches the
# term off (with no cd.lam_per_role) or leaves the roles without an entry out
CD_LAM_READ = When(("cd.enabled", "cd.mode", "cd.budget", "cd.lam_per_role", "cd.lam"),
                   lambda enabled, mode, budget, per_role, lam: (not enabled or mode != "loss" or budget
                                                                 or bool(per_role) or lam == 0),
                   "cd.mode is decoupled, cd.budget is true (wd -> wd - lam), cd.lam_per_role is set (lam is its "
                   "weights' base) or cd.lam is 0 (the loss form aligns its term to the task loss: lam's size cancels)",
                   "drop it: cd.loss_coef scales the loss term")
LM_DATA = ("tokens", "kjv")  # the data sets of a language model (a GPT), read as token windows
# models/pretrained.py loads a GPT's weights strictly whatever pretrained_strict says: its LM head is its token
# embedding, no classifier to drop (a GPT is what trains on the token data sets)
PRETRAINED_STRICT_READ = When(("model.pretrained", "data.dataset"),
                              lambda pretrained, dataset: pretrained not in (None, "") and dataset not in LM_DATA,
                              "model.pretrained is set and the model is a vision model (a GPT loads its weights "
                              "strictly: its LM head is its token embedding)")

# quant/aphq/pipeline.py computes the APH (its probes, eps and KL temperature) for the APH-weighted loss of a
# reconstruction that runs (iters above 0) and for the MLP reconstruction only
APH_COMPUTED = When(("quant.aphq.loss", "quant.aphq.iters", "quant.aphq.mlp_reconstruct"),
                    lambda loss, iters, mlp: (loss == "aph" and iters != 0) or mlp,
                    "quant.aphq.mlp_reconstruct is true or quant.aphq.loss is aph with quant.aphq.iters above 0 (the "
                    "APH is computed)")
# APHQ's progress lines come from its block and MLP reconstructions
APHQ_TRAINS = When(("quant.aphq.iters", "quant.aphq.mlp_reconstruct"), lambda iters, mlp: iters != 0 or mlp,
                   "quant.aphq.iters is above 0 or quant.aphq.mlp_reconstruct is true (something is trained)")
# quant/aphq/pipeline.py and detector.py draw the reconstruction set for those trainings only: a classifier's
# calibration-only run draws just its calib_images calibration images (the reconstruction set's first ones, the same
# images at any recon_images), a detector's none (its calibration batch is evaluate_detection.py's)
APHQ_RECON_SET_READ = dataclasses.replace(
    APHQ_TRAINS, fix="drop it: a calibration-only run (quant.aphq.iters=0) without the MLP reconstruction draws no "
                     "reconstruction set, only its calibration images")
# quant/aphq/pipeline.py and detector.py draw random numbers from quant.aphq.seed only in a reconstruction (batch
# draws, QDrop masks, Rademacher probes; the MLP reconstruction's too) and for search_max_rows' row subsets: a
# calibration-only run (iters 0) without either is the same under any seed
APHQ_SEED_READ = When(("quant.aphq.iters", "quant.aphq.mlp_reconstruct", "quant.aphq.search_max_rows"),
                      lambda iters, mlp, rows: iters != 0 or mlp or rows is not None,
                      "quant.aphq.iters is above 0, quant.aphq.mlp_reconstruct is true or quant.aphq.search_max_rows "
                      "is set (something is drawn at random)",
                      "drop it: a calibration-only run (quant.aphq.iters=0) without quant.aphq.search_max_rows draws "
                      "nothing at random")
# quant/aphq/adaround.py RoundingSchedule: the rounding regulariser is off for the first warmup * iters iterations,
# so at warmup 1 it never acts and its weight and exponents are never read
APHQ_ROUNDING_ACTS = When(("quant.aphq.warmup",), lambda warmup: warmup < 1,
                          "quant.aphq.warmup is below 1 (the rounding regulariser acts after the warm-up)",
                          "drop it, or give quant.aphq.warmup below 1")
# quant/gplq/qat.py at quant.gplq.steps=0 makes no update: its loss, and so the teacher PCA, is never computed; a
# pca_weight of 0 says as much (GPLQ's detection recipe gives it) and passes
GPLQ_PCA_WEIGHT_READ = When(("quant.gplq.steps", "quant.gplq.pca_weight"),
                            lambda steps, weight: steps != 0 or weight == 0,
                            "quant.gplq.steps is not 0 (stage 1 makes updates) or quant.gplq.pca_weight is 0",
                            "drop it, or give quant.gplq.steps above 0 (stage 1 makes no update at 0)")
# quant/gplq/qat.py param_groups: AdamW moves the weights at quant.gplq.lr and the LSQ scales at scale_lr (null: lr);
# at lr 0 with scale_lr null or 0 neither group moves, and stage 1 would make its passes for the model of steps=0
GPLQ_STAGE1_MOVES = When(("quant.gplq.lr", "quant.gplq.scale_lr"),
                         lambda lr, scale_lr: lr != 0 or scale_lr not in (None, 0),
                         "quant.gplq.lr is not 0 or quant.gplq.scale_lr is above 0 (stage 1 updates the weights or the "
                         "LSQ scales)",
                         "stage 1 would update nothing; give quant.gplq.steps=0, or a learning rate above 0")
# quant.gplq.batch_size_per_gpu: the batch of stage 1's loader (read when it makes updates) and, on a classifier, of
# QwT's passes over its images (quant/gplq/pipeline.py fit_on_images); a detector's QwT feeds one image at a time
# (quant/gplq/qwt.py fit_block_compensation_streamed), so there only stage 1 reads it. Each is a model's own rule
# (CLASSIFIER_ONLY, DETECTOR_ONLY): the options alone do not say the model, and evaluate_detection.py hands a
# detector its recipe's batch of 1 (configs/quant.py GPLQ_DETECTION) whatever the steps
GPLQ_CLASSIFIER_BATCH_READ = (("quant.gplq.batch_size_per_gpu",),
                              When(("quant.gplq.steps", "quant.gplq.qwt"), lambda steps, qwt: steps != 0 or qwt,
                                   "quant.gplq.steps is not 0 (stage 1 trains on its loader) or quant.gplq.qwt is "
                                   "true (QwT's passes)", "drop it, or give quant.gplq.steps above 0 or "
                                   "quant.gplq.qwt=true"), None)
GPLQ_DETECTOR_BATCH_READ = (("quant.gplq.batch_size_per_gpu",), "quant.gplq.steps", (NONZERO,))
# the stem / head bit-widths of every pipeline that has them (configs/quant.py FirstLastOptions), which
# quant.first_last=w8a8 replaces (configs/quant.py with_first_last)
FIRST_LAST_KEYS = tuple(f"quant.{name}.{option}" for name, section in vars(Config().quant).items()
                        if dataclasses.is_dataclass(section)
                        for option in ("stem_w_bits", "stem_a_bits", "head_w_bits", "head_a_bits")
                        if hasattr(section, option))

# the option sections of the pipelines that quantize image models only (quant/registry.py: no causal_lm among their
# tasks; tests/test_config_unread_details.py checks the list against it): no evaluation of a language model runs them
IMAGE_PIPELINE_SECTIONS = ("quant.percentile.", "quant.repq.", "quant.aphq.", "quant.gplq.")
IMAGE_PIPELINE_KEYS = tuple(f"{section}{f.name}" for section in IMAGE_PIPELINE_SECTIONS
                            for f in dataclasses.fields(getattr(Config().quant, section.split(".")[1])))

# quant/aphq/reconstruct.py: at drop_prob 0 (the probability of the quantized element) every activation quantizer of a
# classifier returns its float input while a unit is reconstructed, so the learned scales get no gradient. A
# detector's neck units reconstruct with QDrop off whatever drop_prob says (quant/aphq/detector.py: the official
# set_qdrop reaches no convolution), and their activation scales train at act_lr at any drop_prob
APHQ_ACT_LR_READ = (("quant.aphq.act_lr",), "quant.aphq.drop_prob", (NONZERO,))
# Keys that only some settings read: (keys, the key that decides, the values with which they are read), or
# (keys, a When, None). A key ending in "." stands for every key of that section but the deciding one.
READ_ONLY_WHEN = [
    (("data.root", "data.train_split", "data.val_split"), "data.dataset", ("folder", "tokens")),
    (("data.val_windows",), "data.dataset", LM_DATA),
    (IMAGE_PIPELINE_KEYS, "data.dataset", ("folder", "digits", "synthetic")),  # no pipeline of a language model
    # a language model calibrates on token windows and synthetic images get no transform either (GPLQ's QwT images
    # likewise: a classifier's are train-split images, which on synthetic data are the same under both transforms)
    (("quant.calib_transform", "quant.gplq.stage2_train_transform"), "data.dataset", ("folder", "digits")),
    (("data.kjv_val_fraction",), "data.dataset", ("kjv",)),
    (("data.mean", "data.std", "data.interpolation", "data.crop_pct", "data.scale",
      "data.ratio", "data.hflip", "data.auto_augment", "data.color_jitter", "data.reprob", "data.remode",
      "data.recount"), "data.dataset", ("folder", "digits")),  # image transforms: synthetic images get none
    # timm's eval crop modes differ only on an image that is not square: every digits image is (digits_img_size on
    # each side), so center, squash and border give the same pixels
    (("data.crop_mode",), "data.dataset", ("folder",)),
    (("data.repeated_aug", "data.mixup", "data.cutmix", "data.mixup_prob", "data.mixup_switch_prob",
      "data.mixup_mode", "data.label_smoothing"), "data.dataset",
     ("folder", "digits", "synthetic")),  # sampling and targets of images: a language model reads none of them
    (("sched.epochs", "sched.warmup_epochs", "sched.per_step", "sched.warmup_prefix"), "sched.steps", (None,)),
    (("sched.warmup_steps",), "sched.steps", (SET,)),
    (("model.pretrained_strict",), PRETRAINED_STRICT_READ, None),
    (("data.synthetic_train_size", "data.synthetic_val_size"), "data.dataset", ("synthetic",)),
    (("data.digits_img_size", "data.digits_val_fraction"), "data.dataset", ("digits",)),
    (("optim.lr_base", "optim.lr_base_batch", "optim.lr_scaling"), "optim.lr", (None,)),  # a set lr is the lr
    (("cd.",), "cd.enabled", (True,)),
    (("cd.loss_coef",), "cd.mode", ("loss",)),
    (("cd.lam",), CD_LAM_READ, None),
    (("cd.matmul_precision",), "cd.mode", ("decoupled",)),  # the loss form's penalty runs in fp32 under autograd
    # target A decays composable pairs alone, a column scaling in fp32 (cd/update.py): no product to set
    (("cd.matmul_precision",), "cd.targets", ("B", "C", "A+B")),
    (("tweo.",), "tweo.enabled", (True,)),
    # the rescaled term lam * P * detach(|L| / P) has the gradient lam * |L| * grad(P) / P, and P's factor
    # (tau + eps)^-p cancels in grad(P) / P: tau and eps change only the logged tweo/penalty, not what trains
    (("tweo.tau", "tweo.eps"), "tweo.rescale", (False,)),
    (("train.ema_decay", "train.ema_warmup"), "train.ema", (True,)),
    (("train.divergence_windows",), "train.divergence_factor", (SET,)),  # the guard is off without a factor
    (("log.wandb_project", "log.wandb_mode"), "log.wandb", (True,)),
    (("data.mixup_prob", "data.mixup_mode"), MIXUP_ON, None),
    (("data.mixup_switch_prob",), MIXUP_AND_CUTMIX, None),
    (("data.mixup", "data.cutmix"), MIXUP_DRAWN, None),
    (("data.mixup_switch_prob", "data.mixup_mode"), "data.mixup_prob", (NONZERO,)),  # no batch mixed: lam stays 1
    # engine/optim.py: warmup_prefix puts the cosine after warmup_epochs, which moves nothing at 0
    (("sched.warmup_lr", "sched.warmup_prefix"), WARMUP, None),
    (FIRST_LAST_KEYS, "quant.first_last", ("official",)),
    (("quant.aphq.temperature", "quant.aphq.hessian_probe", "quant.aphq.hessian_eps"), APH_COMPUTED, None),
    # quant.aphq.iters=0 is calibration only: no block reconstruction, nothing captured for it
    (("quant.aphq.weight_lr", "quant.aphq.act_lr", "quant.aphq.round_weight", "quant.aphq.beta_start",
      "quant.aphq.beta_end", "quant.aphq.warmup", "quant.aphq.drop_prob", "quant.aphq.input_mix_prob",
      "quant.aphq.normalize_loss", "quant.aphq.loss", "quant.aphq.cache_device"), "quant.aphq.iters", (NONZERO,)),
    APHQ_ACT_LR_READ,  # a classifier's only (CLASSIFIER_ONLY)
    (("quant.aphq.log_every",), APHQ_TRAINS, None),
    (("quant.aphq.recon_images",), APHQ_RECON_SET_READ, None),
    (("quant.aphq.seed",), APHQ_SEED_READ, None),
    (("quant.aphq.round_weight", "quant.aphq.beta_start", "quant.aphq.beta_end"), APHQ_ROUNDING_ACTS, None),
    # quant/aphq/reconstruct.py multiplies the rounding regulariser by round_weight: at 0 its exponents and warm-up
    # change no gradient
    (("quant.aphq.beta_start", "quant.aphq.beta_end", "quant.aphq.warmup"), "quant.aphq.round_weight", (NONZERO,)),
    (("optim.momentum",), "optim.name", ("sgd", "momentum")),  # engine/optim.py passes them to these only
    (("optim.betas", "optim.eps"), "optim.name", ADAM_OPTIMIZERS),
    (("data.color_jitter",), COLOR_JITTER_ON, None),
    (("data.remode", "data.recount"), "data.reprob", (NONZERO,)),  # timm builds no RandomErasing at reprob 0
    (("quant.aphq.mlp_iters", "quant.aphq.mlp_lr", "quant.aphq.mlp_clip_percentile", "quant.aphq.mlp_clip_weight"),
     "quant.aphq.mlp_reconstruct", (True,)),
    # quant/aphq/mlp_recon.py weighs the clipped branch's term by mlp_clip_weight: at 0 its clip level is never used
    (("quant.aphq.mlp_clip_percentile",), "quant.aphq.mlp_clip_weight", (NONZERO,)),
    (("quant.gplq.pca_variance", "quant.gplq.pca_multiple", "quant.gplq.pca_images"), "quant.gplq.pca_weight",
     (NONZERO,)),  # no PCA loss, no teacher PCA
    # stage 1's optimizer, AMP, logs, checkpoint interval and PCA loss; with no update (steps 0) none of them acts
    (("quant.gplq.lr", "quant.gplq.scale_lr", "quant.gplq.weight_decay", "quant.gplq.amp", "quant.gplq.log_every",
      "quant.gplq.ckpt_every", "quant.gplq.pca_variance", "quant.gplq.pca_multiple", "quant.gplq.pca_images"),
     "quant.gplq.steps", (NONZERO,)),
    # AdamW's decoupled decay is p *= 1 - lr * weight_decay, on the weights' group alone (the LSQ scales' has none)
    (("quant.gplq.weight_decay",), "quant.gplq.lr", (NONZERO,)),
    (("quant.gplq.lr", "quant.gplq.scale_lr"), GPLQ_STAGE1_MOVES, None),
    (("quant.gplq.pca_weight",), GPLQ_PCA_WEIGHT_READ, None),
    (("quant.gplq.stage2_images", "quant.gplq.stage2_train_transform", "quant.gplq.qwt_ridge",
      "quant.gplq.qwt_target"), "quant.gplq.qwt", (True,)),  # stage 2 draws images only for QwT's fits
    (("quant.gplq.matmul_percentile",), "quant.gplq.matmul_operands", (True,)),  # the float matmuls have no range
    GPLQ_CLASSIFIER_BATCH_READ,  # a classifier's only (CLASSIFIER_ONLY)
    (("quant.repq.round_zero_point",), "quant.repq.reparam", (True,)),  # the LayerNorm fold is its only reader
]
# READ_ONLY_WHEN entries that hold for a classifier's pipeline options only. A config (train.py, evaluate.py) runs
# APHQ on classifiers alone (on no language model), so it applies them; a detector's options (evaluate_detection.py
# --quant-options: DETECTOR_RULES; PipelineData.detector_samples) read those keys all the same, so the options' own
# rules (`_section_rules`: parse_options, unread_options) leave them to whoever knows the model: the pipeline
# (quant/aphq/pipeline.py APHQPipeline.__call__: check_options_read(..., classifier=True)), a result file by its task
# (engine/eval_results.py read_options)
CLASSIFIER_ONLY = (APHQ_ACT_LR_READ, GPLQ_CLASSIFIER_BATCH_READ)
# Rules of a detector's pipeline options alone, which no config (a classifier's) applies: evaluate_detection.py's
# --quant-options (DETECTOR_RULES)
DETECTOR_ONLY = (GPLQ_DETECTOR_BATCH_READ,)
DETECTOR_RULES = [rule for rule in READ_ONLY_WHEN if rule not in CLASSIFIER_ONLY] + list(DETECTOR_ONLY)
# Keys of a switched-off section that are read all the same: cd.gated_mlp decides which pairs a baseline
# logs energies for (train.py's pair_energy_source), CD on or off.
READ_ALWAYS = {"cd.gated_mlp"}


def unread_by_rules(cfg: Any, keys: Iterable[str], rules: Sequence = READ_ONLY_WHEN,
                undecided: bool = False) -> Iterator[tuple[str, Union[str, When], tuple, Any]]:
    """(key, decider, read_with, value) for each of `keys` (dotted) that a rule of `rules` (READ_ONLY_WHEN entries)
    makes unread in `cfg` (a Config, or nested dicts of one), rule by rule in `rules`' order and within a rule in
    `keys`' order; `value`: the deciding key's value in `cfg` (a When's: a tuple). READ_ALWAYS keys are never
    unread. `undecided`: a rule whose deciding key `cfg` lacks (KeyError) or holds in a form the rule cannot weigh
    (TypeError) decides nothing (its keys stay read), where by default the error goes to the caller."""
    keys = list(keys)
    for rule_keys, decider, read_with in rules:
        try:
            value = decider_value(cfg, decider)
            if _reads_under(decider, value, read_with):
                continue
        except (KeyError, TypeError):
            if not undecided:
                raise
            continue
        for key in keys:
            if key in READ_ALWAYS or not any(key == k or (k.endswith(".") and key.startswith(k)) for k in rule_keys):
                continue  # not a key this decider makes unread
            yield key, decider, read_with, value


def _section_rules(section: str, classifier: bool = False, detector: bool = False) -> list:
    """The READ_ONLY_WHEN entries whose keys and deciding keys all lie in the config section `section`; those of
    CLASSIFIER_ONLY only for `classifier` options (the options alone do not say which model they quantize), and
    for a `detector`'s the DETECTOR_RULES ones instead (CLASSIFIER_ONLY's left out, DETECTOR_ONLY's in)."""
    if classifier and detector:
        raise ValueError("options quantize a classifier or a detector, not both")
    prefix = section + "."
    rules = DETECTOR_RULES if detector else [rule for rule in READ_ONLY_WHEN
                                             if classifier or rule not in CLASSIFIER_ONLY]
    return [rule for rule in rules if all(key.startswith(prefix) for key in (*rule[0], *decider_keys(rule[1])))]


def _in_section(section: str, options: Any) -> dict:
    """`options` as the config section `section` of a tree of nested dicts (quant.aphq -> {quant: {aphq: ..}})."""
    tree = options
    for part in reversed(section.split(".")):
        tree = {part: tree}
    return tree


def section_switches(rules: Sequence = READ_ONLY_WHEN) -> frozenset:
    """The deciding keys among `rules` that switch a whole config section off: those of a rule over a section
    ("cd." under cd.enabled, "tweo." under tweo.enabled). Given as false they excuse the section's other keys
    (`check_keys_read`); the switch of a single step or option (quant.gplq.qwt, quant.aphq.mlp_reconstruct) does
    not, so that its options given beside it are refused rather than dropped without a word."""
    return frozenset(decider for keys, decider, _ in rules
                     if isinstance(decider, str) and any(key.endswith(".") for key in keys))


def check_keys_read(cfg: Config, given: dict, sources: Optional[dict] = None,
                    excused: Optional[Callable[[str, str], bool]] = None, rules: Sequence = READ_ONLY_WHEN) -> None:
    """Refuse a key (`given`: dotted key -> value) that `cfg` ignores, e.g. data.root while data.dataset is
    digits, or cd.lam while cd.enabled is false, naming its file (`sources`: key -> file; overrides have none).
    `excused(key, decider)` lets a deciding key make a key moot; by default (overrides) a whole section switched
    off explicitly (cd.enabled=false next to cd.lam=..., as a sweep's baseline run gets them: `section_switches`)
    says what it means and passes, and any other deciding override does not excuse a key it makes unread
    (data.dataset=kjv next to data.mixup=0.8 is refused, and so is quant.gplq.matmul_operands=false next to
    quant.gplq.matmul_percentile=0.9: a switch of one option is no section). `rules`: the READ_ONLY_WHEN entries
    to apply."""
    sources = sources or {}
    if excused is None:
        switches = section_switches(rules)

        def excused(key: str, decider: Union[str, When]) -> bool:
            return decider in switches and given.get(decider, None) is False
    for key, decider, read_with, value in unread_by_rules(cfg, given, rules):
        if not excused(key, decider):
            if isinstance(decider, When):
                when, now = decider.text, ", ".join(f"{k}={_show(v)}" for k, v in zip(decider.keys, value))
                fix = (f"drop it from {sources[key]}, or layer it over a recipe where {when}"
                       if key in sources else decider.fix or f"drop it or set {decider} as well")
                why = f"{key} is read only when {when}, and here {now}"
            else:
                readers = " or ".join(map(_show, read_with))
                fix = (f"drop it from {sources[key]}, or layer it over a recipe whose {decider} is {readers}"
                       if key in sources else _override_fix(decider, read_with, value))
                why = f"{key} is read only when {decider} is {readers}, and it is {_show(value)}"
            raise IgnoredOverrideError(
                f"{f'{sources[key]}: ' if key in sources else ''}{key}={_show(given[key])} would be ignored: "
                f"{why}; {fix}")


def _override_fix(decider: str, read_with: tuple, value: Any) -> str:
    """The fix a refused override is offered, by the deciding key's current `value`: at null the key needs a value,
    given beside the override; set, where the override is read only at null (sched.per_step beside sched.steps=6), it
    goes back to null ("set sched.steps as well" would name a key set already)."""
    if value is not None and None in read_with:
        return f"drop it or set {decider}=null as well"
    return f"drop it or set {decider} as well"


def check_options_read(options: Any, given: Iterable[str], classifier: bool = False) -> None:
    """Refuse, as an override is refused, an option among `given` (the field names a caller set itself) that
    `options`, the dataclass of a config section (APHQOptions of quant.aphq), leaves unread: by the READ_ONLY_WHEN
    entries whose keys and deciding keys all lie in that section. For the Python API (quant/pipeline_base.py
    parse_options), which has no config around the options. No pipeline section is switched off whole
    (`section_switches`), so a switch given as false beside the options it leaves unread does not excuse them.
    `classifier`: the options quantize a classifier, so CLASSIFIER_ONLY's rules apply too (act_lr at drop_prob=0);
    without it they are left to the pipeline, which knows the model."""
    given = list(given)
    for section in config_sections(type(options)):
        prefix = section + "."
        check_keys_read(_in_section(section, options), {prefix + key: getattr(options, key) for key in given},
                        rules=_section_rules(section, classifier))


def unread_options(section: str, options: dict, classifier: bool = False, detector: bool = False) -> set[str]:
    """The names among `options` ({name: value} of the config section `section`, e.g. quant.aphq: a result file's
    recorded pipeline options) that the READ_ONLY_WHEN entries whose keys and deciding keys all lie in that section
    say are unread under these very values (recon_images at iters=0); CLASSIFIER_ONLY's too for `classifier`
    options (act_lr at drop_prob=0), as `check_options_read`; for a `detector`'s the DETECTOR_RULES that
    evaluate_detection.py --quant-options applies (batch_size_per_gpu at steps=0, DETECTOR_ONLY). A rule whose
    deciding option `options` lacks or holds in a form the rule cannot weigh (a file older than the option) decides
    nothing: its keys stay. A deciding option is never unread by its own rule."""
    prefix = section + "."
    found = unread_by_rules(_in_section(section, options), [prefix + name for name in options],
                            _section_rules(section, classifier, detector), undecided=True)
    return {key[len(prefix):] for key, decider, _, _ in found if key not in decider_keys(decider)}


@functools.lru_cache(maxsize=None)
def config_sections(section_type: type) -> tuple:
    """The dotted keys of the config sections that are `section_type` dataclasses (quant.aphq: APHQOptions)."""
    cfg = Config()
    return tuple(key for key in schema_keys() if type(get_key(cfg, key)) is section_type)


def get_key(cfg: Any, key: str) -> Any:
    """The value of the dotted `key` in `cfg` (a Config or one of its sections)."""
    for part in key.split("."):
        cfg = cfg[part] if isinstance(cfg, dict) else getattr(cfg, part)
    return cfg


def _show(value: Any) -> str:
    """A value as it is written in an override (true, null, 0.01, /datasets/x)."""
    return dump_yaml(value, default_flow_style=True).splitlines()[0]


def dotted_settings(key: str, value: Any, cfg: Config) -> dict:
    """{dotted key: value} of one override; a section given as a mapping (cd={lam: 0.01}) counts by key."""
    if isinstance(value, dict) and dataclasses.is_dataclass(_section(cfg, key)):
        return {k: v for name, sub in value.items() for k, v in dotted_settings(f"{key}.{name}", sub, cfg).items()}
    return {key: value}


def _section(cfg: Config, key: str) -> Any:
    """get_key(cfg, key), or None for a dotted key inside a free-form dict field (model.kwargs.a.b holds the
    entry 'a.b', not 'a')."""
    try:
        return get_key(cfg, key)
    except (KeyError, AttributeError, TypeError):
        return None


def override_keys(item: str) -> list[str]:
    """The dotted keys that the override `key=value` sets: one, or those of a section given as a mapping
    (train={seed: 7} sets train.seed); the key itself when the item is malformed (apply_overrides says why)."""
    key, _, raw = item.partition("=")
    try:
        return list(dotted_settings(key.strip(), parse_yaml(raw) if raw.strip() else "", Config()))
    except (yaml.YAMLError, AttributeError, KeyError, TypeError):  # not valid YAML, not a key of the schema
        return [key.strip()]


def device_of_overrides(overrides: Iterable[str]) -> str:
    """train.device as the command line's overrides alone set it, for a process that could not read its --config
    files (it joins the others' process group on that device's backend); its default, "auto", where they do not
    set it or their value cannot be read."""
    given = [item for item in overrides if "train.device" in override_keys(item)]
    try:
        return load_config([], given).train.device
    except Exception:  # noqa: BLE001 - on an error path already: never a second error
        return "auto"


def overlapping_keys(item: str, keys) -> list[str]:
    """The dotted `keys` that the override `item` sets, however it is spelt: the key itself, a section given as a
    mapping (train={seed: 7} sets train.seed) or a part of a key's value (cd.lam_per_role.fc2=0.5 changes
    cd.lam_per_role). In the order of `keys`."""
    given = override_keys(item)
    return [k for k in keys if any(a == k or a.startswith(k + ".") or k.startswith(a + ".") for a in given)]


def _yaml_problem(e: yaml.YAMLError) -> str:
    """'<context>, <problem> (line L, column C)' from a PyYAML error, without its multi-line context dump. The
    context is what the problem is read against: 'but found another document' alone says nothing of the rule
    ('expected a single document in the stream') it breaks; a context 'while parsing' something begun on an
    earlier line names that line (an unclosed bracket's)."""
    mark = getattr(e, "problem_mark", None)
    if mark is not None:
        problem = getattr(e, "problem", None) or str(e)
        context, begun = getattr(e, "context", None), getattr(e, "context_mark", None)
        if context and context.startswith("while") and begun is not None and begun.line != mark.line:
            context = f"{context} started at line {begun.line + 1}"
        return f"{context + ', ' if context else ''}{problem} (line {mark.line + 1}, column {mark.column + 1})"
    if isinstance(e, yaml.reader.ReaderError):  # a control character: PyYAML gives an offset, no line
        return f"unacceptable character #x{e.character:04x} at character {e.position + 1}"
    return str(e).splitlines()[0]


SAVED_CONFIG = "saved config"  # the source of a config rebuilt from a checkpoint or config.yaml


def config_from_dict(data: dict) -> Config:
    """Rebuild a Config from `config_to_dict` output (e.g. stored in a checkpoint), strictly."""
    cfg = Config()
    _merge(cfg, data, path="", source=SAVED_CONFIG)
    return cfg


def config_to_dict(cfg: Any) -> dict:
    """Plain nested dict (tuples become lists) for YAML/JSON and checkpoints."""
    return plain(dataclasses.asdict(cfg))


def plain(value: Any) -> Any:
    """`value` with tuples as lists, all the way down (what YAML and JSON write)."""
    if isinstance(value, (list, tuple)):
        return [plain(x) for x in value]
    if isinstance(value, dict):
        return {k: plain(x) for k, x in value.items()}
    return value


def _merge(node: Any, data: dict, path: str, source: str) -> None:
    for key, value in data.items():
        _assign(node, str(key).split("."), value, path, source)


@functools.lru_cache(maxsize=None)
def schema_hints(cls: type) -> dict:
    """The resolved annotations of schema dataclass `cls` (read them, do not change them). Cached: resolving every
    string annotation of a class again for each key made a whole config's load take 90-160 ms."""
    return typing.get_type_hints(cls, include_extras=True)


def _assign(node: Any, parts: list, value: Any, path: str, source: str) -> None:
    """Set the (dotted) key `parts` below dataclass `node` to `value`, checked against the schema."""
    name, rest = parts[0], parts[1:]
    hints = schema_hints(type(node))
    key = path + name
    if name not in hints:
        raise ConfigError(_unknown_key_message(".".join([key, *rest]), path[:-1], hints, source))
    current = getattr(node, name)
    if dataclasses.is_dataclass(current):
        if rest:
            return _assign(current, rest, value, key + ".", source)
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: '{key}' is a section; give its keys, not {value!r}")
        if not value:  # it reads as "back to the defaults", yet sets nothing: every key an earlier layer set stays
            first = dataclasses.fields(current)[0].name
            example = f"{key}.{first}=..." if source == "command line" else f"{{{first}: ...}}"
            raise ConfigError(f"{source}: '{key}' = {{}} changes nothing; give its keys ({example})")
        return _merge(current, value, key + ".", source)
    annotation = hints[name]
    if not rest and isinstance(value, dict) and current and (annotation is dict or _origin(annotation) is dict):
        # a mapping adds its entries to a dict field, as a section's keys do: a later file's model.kwargs:
        # {depth: 2} keeps the embed_dim an earlier file gave (replacing would drop it without a word)
        if not value:
            raise ConfigError(f"{source}: '{key}' = {{}} changes nothing: a mapping adds its entries to "
                              f"{_show(current)}; give null to empty it")
        return setattr(node, name, {**current, **coerce_value(value, annotation, key, source)})
    if not rest:
        return setattr(node, name, coerce_value(value, annotation, key, source, before=current))
    if annotation is dict or _origin(annotation) is dict:
        # a dotted key into a free-form dict field: cd.lam_per_role.fc2=0.02
        if not _entry_name(".".join(rest)):
            raise ConfigError(f"{source}: '{'.'.join([key, *rest])}' names an entry of {key} with an empty name; give "
                              f"the entry's name ({key}.NAME)")
        refuse_ambiguous_numbers(value, ".".join([key, *rest]), source)
        setattr(node, name, {**current, ".".join(rest): value})
        return
    raise ConfigError(f"{source}: '{key}' is {describe_type(annotation)}; it has no sub-key '{rest[0]}'")


def _unknown_key_message(key: str, section: str, hints: dict, source: str) -> str:
    """'unknown config key' with the closest keys of any section, else the keys of `section`, where the
    lookup failed."""
    matches = close_keys(key)
    where = f"section '{section}'" if section else "the top level"
    hint = f"; did you mean {', '.join(map(repr, matches))}?" \
        if matches else f"; valid keys in {where}: {', '.join(sorted(hints))}"
    return f"{source}: unknown config key '{key}'{hint}"


@functools.lru_cache(maxsize=None)
def schema_keys(node: Any = Config, prefix: str = "") -> tuple:
    """Every dotted key of the schema, sections included (`model`, `model.name`, ..., `quant.aphq.iters`)."""
    keys = ()
    for f in dataclasses.fields(node):
        keys += (prefix + f.name,)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            keys += schema_keys(type(default), prefix + f.name + ".")
    return keys


def close_keys(key: str) -> list:
    """The (at most 3) schema keys closest to the unknown dotted `key`, searched in every section: the last part
    counts most (`train.epochs` -> `sched.epochs`, `epochs` -> `sched.epochs`), the whole key breaks ties
    (`optim.lrr` -> `optim.lr` before `quant.gplq.lr`)."""
    leaf = key.rpartition(".")[2]

    def score(candidate: str) -> float:
        ratio = lambda a, b: difflib.SequenceMatcher(None, a, b).ratio()
        return 0.6 * ratio(leaf, candidate.rpartition(".")[2]) + 0.4 * ratio(key, candidate)

    scored = sorted(((score(c), c) for c in schema_keys()), key=lambda sc: -sc[0])[:3]
    return [c for s, c in scored if s >= max(0.6, scored[0][0] - 0.15)]


def _origin(annotation: Any) -> Any:
    return typing.get_origin(annotation)


def describe_type(annotation: Any) -> str:
    """'int, >= 1', 'one of fp16 | bf16 | none', 'float or null, > 0' from a schema annotation."""
    origin = _origin(annotation)
    if origin is Annotated:
        base, *ranges = typing.get_args(annotation)
        return ", ".join([describe_type(base)] + [r.describe() for r in ranges])
    if origin is Literal:
        return "one of " + " | ".join(map(str, typing.get_args(annotation)))
    if origin in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else describe_type(a)
                           for a in typing.get_args(annotation))
    if origin in (tuple, list) and typing.get_args(annotation):
        args = typing.get_args(annotation)
        if origin is list or args[1:] == (Ellipsis,):
            return f"{origin.__name__} of {describe_type(args[0])}"
        return f"{origin.__name__} ({', '.join(map(describe_type, args))})"
    if origin in (tuple, list, dict):
        return origin.__name__
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


INT64 = Range(-2 ** 63, 2 ** 63 - 1)  # the range of every int value (up to sys.maxsize on 64-bit Python)


class _ValueProblem(ConfigError):
    """A value of the field's type that the field cannot take (not finite, beyond int64): reported as it is, not as a
    type."""


def coerce_value(value: Any, annotation: Any, key: str, source: str, before: Any = None) -> Any:
    """Check `value` against `annotation` (its type, and the ranges of an `Annotated` one); return it in the
    field's canonical type. A ConfigError says `source`, `key`, the value and what the field expects. Used for
    every config value and for a pipeline's options handed over as a mapping (quant.pipeline_base). `before`: the
    value the key has before this one (the config files' for an override), named as the fix for a null."""

    def fail(reason: str = ""):
        refusal = (f"{source}: '{key}' expects {describe_type(annotation)}, got {value!r}"
                   f" ({type(value).__name__}){reason}{_one_item_list_fix(value, annotation, key, source)}"
                   f"{_spelling_fix(value, annotation, key, source, before)}")
        if isinstance(value, (int, float, datetime.date)) and takes_text(annotation):  # bool is an int
            raise TextReadAsValue(refusal, key, _show(value))
        raise RefusedValueError(refusal, key, takes_text(annotation))

    if isinstance(value, AmbiguousNumber):  # text where text is taken; a number field cannot know which is meant
        try:
            return coerce_value(str(value), annotation, key, source)
        except ConfigError:
            raise ConfigError(ambiguous_number_message(value, key, source)) from None

    origin = _origin(annotation)
    if origin is Annotated:  # a value range (constraints.py) on top of the type
        base, *ranges = typing.get_args(annotation)
        try:
            value = coerce_value(value, base, key, source, before)
        except RefusedValueError:
            # a whole float for an int is refused with the int as its fix, unless the int is out of range too:
            # 'give sched.epochs=0' for sched.epochs=0.0 would send the user to a second refusal
            if isinstance(value, float) and value.is_integer() and _takes(base, int):
                problem = next(filter(None, (allowed.violation(int(value)) for allowed in ranges)), None)
                if problem:
                    raise RefusedValueError(f"{source}: '{key}' must be a whole number {problem}; got {value!r}",
                                            key) from None
            raise
        for allowed in ranges:
            value = allowed.normalize(value) if hasattr(allowed, "normalize") else value  # UserPath: ~ expanded
            if source == SAVED_CONFIG and isinstance(allowed, UserPath):
                continue  # a path of the machine and locale the run was saved on: read, not used, here
            problem = allowed.violation(value)
            if problem:
                raise RefusedValueError(f"{source}: '{key}' must be {problem}; got {value!r}", key)
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(annotation)
        if value is None:
            if type(None) in args:
                return None
            fail()
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce_value(value, arg, key, source)
            except _ValueProblem:  # of the right type but not a usable value: that is the answer
                raise
            except ConfigError:
                pass
        fail()
    if origin is Literal:
        choices = typing.get_args(annotation)
        if value not in choices:
            raise ConfigError(f"{source}: '{key}' must be one of {', '.join(map(repr, choices))}; "
                              f"got {value!r}{_boolean_choice_fix(value, choices, key, source)}")
        return value
    if annotation is bool:
        if isinstance(value, bool):
            return value
        fail()
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if INT64.violation(value):  # islice, torch, numpy and timm's samplers take C integers
                raise _ValueProblem(f"{source}: '{key}' must be {INT64.describe()} (a 64-bit integer); got {value!r}")
            return value
        fail()
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            # .nan passes every range check (comparisons are False), .inf is no rate, 1e400 written as an integer
            # has no float
            if not finite(value):
                raise _ValueProblem(f"{source}: '{key}' must be a finite number; got {value!r}")
            return float(value)
        fail()
    if annotation is str:
        if isinstance(value, str):
            return value
        fail()
    if annotation in (tuple, list) or origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            fail()
        args = typing.get_args(annotation)
        if args:  # list[str], Tuple[float, ...], Tuple[float, float]: each item checked (else a TypeError later)
            each = args[:1] * len(value) if origin is list or args[1:] == (Ellipsis,) else args
            if len(each) != len(value):
                fail()
            value = [coerce_value(v, a, f"{key}[{i}]", source) for i, (v, a) in enumerate(zip(value, each))]
        return tuple(value) if (annotation is tuple or origin is tuple) else list(value)
    if annotation is dict or origin is dict:
        if value is None:
            return {}
        if not isinstance(value, dict):
            fail()
        for entry, item in value.items():  # free-form entries reach timm (model.kwargs) or CD as they are
            if not _entry_name(entry):
                raise ConfigError(f"{source}: '{key}' has an entry named {entry!r} ({type(entry).__name__}); give each "
                                  f"entry a name of text with no empty part between dots")
            refuse_ambiguous_numbers(item, f"{key}.{entry}", source)
        return dict(value)
    raise ConfigError(f"{source}: '{key}' has an unsupported annotation {annotation!r}")


def _entry_name(entry: Any) -> bool:
    """Whether `entry` names an entry of a free-form dict field: text whose parts between dots are not empty (a
    model.kwargs entry is a keyword of the model's constructor: '' or 1 reached timm, refused once train.py had built
    the model, after its first file; a dotted name is the entry model.kwargs.mlp.cfg=4 sets)."""
    return isinstance(entry, str) and all(part.strip() for part in entry.split("."))


def _one_item_list_fix(value: Any, annotation: Any, key: str, source: str) -> str:
    """'; give a list: quant.pipelines=[repq]' where a list or tuple field is given one value that it takes as a
    list's only item, or text that joins its items with commas (`quant.pipelines=repq,aphq`, `data.mean=0.5,0.5,0.5`,
    `optim.betas=(0.9,0.95)`: timm's and argparse's lists, which YAML reads as one text) that it takes as those items;
    the list without spaces (one shell word), in the override's form on the command line, the YAML value in a file;
    '' otherwise."""
    if value is None or isinstance(value, (list, tuple, dict)):
        return ""
    annotation = _field_annotation(key, annotation)  # with its ranges: a fixed-length tuple's count
    items = [value]
    if isinstance(value, str) and "," in value:
        text = value.strip()
        text = text[1:-1] if text[:1] + text[-1:] == "()" else text
        try:
            items = [parse_yaml(part) for part in text.split(",")]
        except yaml.YAMLError:
            return ""
    try:  # the whole field's check (its ranges too): the list advised is one it takes
        coerce_value(items, annotation, key, source)
    except ConfigError:
        return ""  # not items the list takes either: the type named is the whole answer
    return f"; give a list: {key + '=' if source == 'command line' else ''}[{','.join(map(_show, items))}]"


def _field_annotation(key: str, annotation: Any) -> Any:
    """The schema's annotation of `key`, its ranges included, where `key` is a schema key; else `annotation`.
    coerce_value checks an Annotated field's type without its ranges first, and a fix worked out there must pass
    them too."""
    if key not in schema_keys():
        return annotation
    owner, _, name = key.rpartition(".")
    return schema_hints(type(get_key(Config(), owner) if owner else Config()))[name]


def _spelling_fix(value: Any, annotation: Any, key: str, source: str, before: Any = None) -> str:
    """The fix for a value that means one the field takes but is written another way: Python's None for null
    ('; YAML spells it null: optim.lr=null'), a whole float for an int ('; give sched.epochs=3'), 0 or 1 for a bool
    ('; give true or false'), a boolean for a number (`_number_for`), null for text (a file's `root: ~`) or for
    another field that takes none (the value it has `before`, else its default; one shell word); '' otherwise.
    The override's form on the command line; elsewhere (a file's line, a mapping's entry, a list's item) the value
    alone, written where the refused one stands ('; give 3')."""
    given = f"{key}=" if source == "command line" and "[" not in key else ""
    if value is None and takes_text(annotation) and not _takes(annotation, type(None)):
        # `root: ~` in a file, YAML's null, where the user meant no path ('') or the home folder ('~')
        if given:
            return (f"; YAML reads null as no value, not as text: give the text, or {given} with nothing after it for "
                    f"empty text")
        return ("; YAML reads null, ~ and a key with no value as no value, not as text: write the text (quoted, '~', "
                "for a ~ of its own) or '' for empty text")
    if takes_text(annotation):  # a number or bool there is text YAML read otherwise: TextReadAsValue says to quote it
        return ""
    if value is None and not _takes(annotation, type(None)) and key in schema_keys():
        # never null: the field takes none. The value the config gives it, not the schema's: on a language model's
        # config the schema's model.drop_path (0.1) is refused, and over a recipe it would replace the recipe's value
        had = before if before is not None else get_key(Config(), key)
        written = f"[{','.join(map(_show, had))}]" if isinstance(had, (list, tuple)) else _show(had)
        what = "the one it has without it" if before is not None else "its default"
        return (f"; YAML reads null as no value, which this key does not take: give a value, e.g. {what}, "
                f"{given}{written}")
    if isinstance(value, str) and value.strip().lower() == "none" and _takes(annotation, type(None)):
        return f"; YAML spells it null: {given}null" if given else "; YAML spells it null"
    if isinstance(value, float) and value.is_integer() and _takes(annotation, int):
        try:  # the field's own check: a count beyond int64 is no fix
            coerce_value(int(value), annotation, key, source)
        except ConfigError:
            return ""
        return f"; give {given}{int(value)}"
    if type(value) is int and value in (0, 1) and _takes(annotation, bool):
        return "; give true or false"
    if isinstance(value, bool) and not _takes(annotation, bool) and (_takes(annotation, int)
                                                                   or _takes(annotation, float)):
        number = _number_for(value, annotation, key)
        return (f"; YAML read the value as the boolean {str(value).lower()}, not a number: give "
                + (f"{given}{number}{' (its default)' if value else ''}" if number is not None else "a number"))
    return ""


def _number_for(switch: bool, annotation: Any, key: str) -> Optional[Union[int, float]]:
    """A number the field `key` takes for a boolean `switch` given to it (data.repeated_aug=true, DeiT's switch): its
    schema default for true, 0 for false (the count or rate that does nothing), where the field, with its ranges,
    takes that value; else None."""
    default = get_key(Config(), key) if key in schema_keys() else None
    annotation = _field_annotation(key, annotation)  # with its ranges (sched.epochs: no 0)
    number = default if switch else 0
    if number is None or isinstance(number, bool) or (switch and number == 0):
        return None
    try:
        coerce_value(number, annotation, key, "")
    except ConfigError:
        return None
    return number


def _boolean_choice_fix(value: Any, choices: tuple, key: str, source: str) -> str:
    """For a boolean given to a field of text choices: that YAML 1.1 read the word as a boolean (an unquoted yes, no,
    on, off, true or false, any case: `amp: off` is False), and the fix: the choice that word is, quoted ('; ... quote
    it to keep it as text: quantize_bmm='off''), or where no choice is such a word, one of the choices; '' for any
    other value."""
    if not isinstance(value, bool) or not any(isinstance(c, str) for c in choices):
        return ""
    words = [c for c in choices if isinstance(c, str) and parse_yaml(c) is value]  # 'off' for False
    read = (f"; YAML 1.1 read the value as the boolean {str(value).lower()} (it reads an unquoted yes, no, on, off, "
            "true or false so), not as text")
    if not words:
        return f"{read}; quoted it stays text, but no choice is such a word: give one of the choices"
    given = f"{key}=" if source == "command line" and "[" not in key else ""
    quoted = " or ".join(f"{given}{_single_quoted(w)}" for w in words)
    shell = ", inside the shell's quotes" if given else ""
    return f"{read}: quote it to keep it as text: {quoted}{shell}"


def _takes(annotation: Any, kind: type) -> bool:
    """Whether a field of `annotation` takes values of type `kind` itself (through Annotated and Union)."""
    origin = _origin(annotation)
    if origin is Annotated:
        return _takes(typing.get_args(annotation)[0], kind)
    if origin in (Union, types.UnionType):
        return any(_takes(arg, kind) for arg in typing.get_args(annotation))
    return annotation is kind


class TextReadAsValue(ConfigError):
    """A number, date or boolean (as YAML reads `2012`, `2024-01-31`, `on`) given to a field that takes text: the
    refusal says to quote it. `key` is the field's dotted key, `text` the value as YAML writes it; apply_overrides
    shows the override's own text instead (`on`, not `true`)."""

    def __init__(self, refusal: str, key: str, text: str):
        self.refusal, self.key, self.text = refusal, key, text
        super().__init__(f"{refusal}; quote it to keep it as text: {_single_quoted(text)}")

    def on_command_line(self, raw: str) -> str:
        """The refusal for the override `<key>=<raw>`, with that override quoted as the shell passes it on."""
        return (f"{self.refusal}; quote it to keep it as text ({self.key}={_single_quoted(raw.strip())}, inside "
                f"the shell's quotes)")


def _single_quoted(text: str) -> str:
    """`text` as a YAML single-quoted scalar, which reads back as that text whatever its characters."""
    return "'" + text.replace("'", "''") + "'"


def takes_text(annotation: Any) -> bool:
    """Whether a field of `annotation` takes a string (str, Optional[str], Annotated[str, ...])."""
    origin = _origin(annotation)
    if origin is Annotated:
        return takes_text(typing.get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        return any(takes_text(arg) for arg in typing.get_args(annotation))
    return annotation is str


def ambiguous_number_message(value: str, key: str, source: str) -> str:
    """The refusal of `value`, an AmbiguousNumber given to the number field `key`: naming both readings and the fix."""
    digits = value.replace("_", "")
    if ":" in digits:
        whole, _, fraction = digits.lstrip("+-").partition(".")
        base60 = functools.reduce(lambda total, part: total * 60 + int(part), whole.split(":"), 0)
        return (f"{source}: '{key}' = {value}: YAML 1.1 reads digits with colons as a base-60 number ({value} is "
                f"{'-' if digits.startswith('-') else ''}{base60}{'.' + fraction if fraction else ''}); write the "
                f"number itself")
    sign = "-" if digits.startswith("-") else ""
    octal = (f", or {sign}0o{digits.lstrip('+-0') or 0} for octal {int(digits, 8)}"
             if set(digits.lstrip("+-")) <= set("01234567") else "")
    return (f"{source}: '{key}' = {value}: YAML 1.1 reads a leading zero as octal, YAML 1.2 as decimal; write "
            f"{int(digits)} for decimal{octal}")


def refuse_ambiguous_numbers(value: Any, key: str, source: str) -> None:
    """Refuse an AmbiguousNumber anywhere in `value` (an entry of a free-form dict field, `key`): its field has no
    type that says whether text or a number is meant."""
    if isinstance(value, AmbiguousNumber):
        message = ambiguous_number_message(value, key, source)
        raise ConfigError(message.replace("; write", "; quote it for text, or write"))
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for part, item in items:
        refuse_ambiguous_numbers(item, f"{key}.{part}" if isinstance(value, dict) else f"{key}[{part}]", source)

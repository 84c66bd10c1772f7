"""What train.py and evaluate.py tell users about the config on the command line.

    python train.py --help                    # the options, and every config section in one line each
    python train.py --help-config sched       # every key of a section: default, type, range, help text
    python train.py --config configs/pretrain/vit_b.yaml optim.lr=1e-3 --print-config   # resolved YAML

The help texts are the schema's own comments (configs/schema.py, configs/quant.py): the comment after a
field, else the comment lines right above it; a section's line is the first line of its class docstring.
A flag that users of timm / DeiT type from habit (`--epochs 3`, `--output_dir x`) is refused with our
spelling of it (`sched.epochs=3`, `out_dir=x`). Every entry point and script parses its command line with
`OneLineParser`, whose usage errors are one `error:` line.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import io
import re
import sys
import textwrap
import tokenize
from typing import Any, Optional

from .loader import (ConfigError, close_keys, config_to_dict, describe_type, dump_yaml, get_key, plain,
                     schema_hints, schema_keys)
from .schema import Config

# timm / DeiT flags (normalized: no leading dashes, "-" -> "_") and what to write instead ("": nothing);
# "{}" takes the value that was given with the flag. Flags named like one of our keys (--warmup-epochs,
# --drop-path, --clip-grad, --min-lr, ...) are found in the schema and need no entry.
FOREIGN_FLAGS = {
    "resume": "train.resume={}",
    "output_dir": "out_dir={}",
    "output": "out_dir={}",
    "epochs": "sched.epochs={}",
    "model": "model.name={}",
    "data_path": "data.root={}",
    "data_dir": "data.root={}",
    "data": "data.root={}",
    "lr": "optim.lr={} (the peak lr; DeiT's --lr, scaled by batch / 512, is optim.lr_base={})",
    "batch_size": "train.batch_size_per_gpu={} (per process, as timm's and DeiT's --batch-size; "
                  "train.batch_size is the global batch)",
    "b": "train.batch_size_per_gpu={} (per process; train.batch_size is the global batch)",
    "weight_decay": "optim.weight_decay={}",
    "wd": "optim.weight_decay={}",
    "seed": "train.seed={}",
    "opt": "optim.name={}",
    "sched": "sched.name={}",
    "finetune": "model.pretrained={}",
    # evaluate.py's flag given to train.py: the checkpoint of a run to continue, or weights to start from
    "checkpoint": "train.resume={} to continue that run (model.pretrained={} to fine-tune from its weights)",
    "pretrained": "model.pretrained=hub (or a local weights file)",
    "initial_checkpoint": "model.pretrained={}",
    "nb_classes": "model.num_classes={}",
    "input_size": "model.img_size={}",
    "smoothing": "data.label_smoothing={}",
    "aa": "data.auto_augment={}",
    "workers": "data.num_workers={}",
    "j": "data.num_workers={}",
    "pin_mem": "data.pin_memory=true",
    "model_ema": "train.ema=true",
    "model_ema_decay": "train.ema_decay={}",
    "amp": "train.amp=fp16 (or bf16)",
    "eval": "python evaluate.py --checkpoint PATH",
}


# argparse actions that keep one value: given twice, the last replaces the first
SINGLE_VALUE = (argparse._StoreAction, argparse._StoreConstAction, argparse.BooleanOptionalAction)


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage error (an unknown flag, a bad choice or type, a missing argument) is the one
    `error:` line every other refusal is, `error: PROG: MESSAGE; see PROG --help`, with argparse's exit status
    2, instead of argparse's usage block and second line. Every entry point builds its parser from it
    (tests/test_usage_errors.py checks); add_subparsers makes subparsers of the same class.

    An option that holds one value (store, store_const, store_true/false, BooleanOptionalAction) given more
    than once is refused, under any spelling (`--out x`, `--out=x`, an alias, an abbreviation): argparse
    keeps the last silently, so `--checkpoint A --checkpoint B` would score B alone, as a key=value given
    twice is refused (configs/loader.py). append, extend and count options take repeats: that is their use."""

    def parse_known_args(self, args=None, namespace=None):
        outer, self._given = getattr(self, "_given", None), {}
        try:
            namespace, extras = super().parse_known_args(args, namespace)
            twice = [f"{'/'.join(a.option_strings)} is given {'twice' if n == 2 else f'{n} times'}"
                     for a, n in self._given.values() if n > 1]
            if twice:
                self.error(f"{'; '.join(twice)}; give {'it' if len(twice) == 1 else 'each'} once")
            return namespace, extras
        finally:
            self._given = outer  # a parse inside a parse (a subparser has its own instance; this is cheap)

    def _get_values(self, action, arg_strings):
        # argparse calls this once per option occurrence, after resolving aliases, abbreviations and `--x=v`
        if action.option_strings and isinstance(action, SINGLE_VALUE) and self._given is not None:
            _, n = self._given.get(id(action), (action, 0))
            self._given[id(action)] = (action, n + 1)
        return super()._get_values(action, arg_strings)

    def error(self, message: str):
        # argparse's messages are one line; a type's own message (ArgumentTypeError) might not be
        message = " ".join(message.splitlines())
        self.exit(2, f"error: {self.prog}: {message}; see {self.prog} --help\n")

    def _print_message(self, message: str, file=None) -> None:
        """argparse's output (--help, usage, exit messages), with what the console's encoding cannot show as
        backslash escapes: help texts with ± or † print on an ASCII console (LC_ALL=C with PYTHONUTF8=0,
        PYTHONIOENCODING=ascii) instead of ending in a UnicodeEncodeError."""
        try:
            super()._print_message(message, file)
        except UnicodeEncodeError:
            encoding = getattr(file or sys.stderr, "encoding", None) or "ascii"
            super()._print_message(message.encode(encoding, "backslashreplace").decode(encoding), file)


def first_line(doc: Optional[str]) -> str:
    """The first paragraph of a module's docstring joined into one line, for a parser's description (its first
    physical line alone ended a sentence that runs on into the next line mid-way); "" under `python -OO`, which
    strips docstrings (a script's `__doc__` is None there)."""
    return " ".join(re.split(r"\n\s*\n", (doc or "").strip(), maxsplit=1)[0].split())


def at_least(low: float, kind: type = int):
    """An argparse `type` for counts, sizes and budgets: a `kind` number >= `low`, refused by argparse (one
    `error:` line naming the flag, with OneLineParser) otherwise, e.g. `--repeats 0`."""
    def parse(text: str):
        value = kind(text)
        if not value >= low:  # NaN too
            raise argparse.ArgumentTypeError(f"{text}: must be at least {low}")
        return value
    parse.__name__ = kind.__name__  # argparse's "invalid int value" for text that is no number
    return parse


def move_overrides(args: argparse.Namespace, *flags: str) -> None:
    """Move key=value words out of list flags (nargs "+" / "*") into `args.overrides`. Such a flag takes every
    word after it, so `--bits w4a4 data.root=/d` would read the override as a bit-width: the override is what
    the user meant, as it is anywhere else on the line. A flag left with no word of its own is empty ([])."""
    for flag in flags:
        values = getattr(args, flag, None)
        if values:
            args.overrides += [v for v in values if "=" in v]
            setattr(args, flag, [v for v in values if "=" not in v])


def repeated(values: list) -> list:
    """The items that `values` holds more than once, each once, sorted."""
    return sorted({v for v in values if values.count(v) > 1})


def refuse_repeats(parser: argparse.ArgumentParser, *flags: tuple[str, Optional[list]]) -> None:
    """parser.error, `argument FLAG: X given twice; give each value once`, for the first (flag, values) of a
    list flag (nargs "+" / "*") whose values repeat one (values None: the flag was not given). Each value of
    such a flag is one run, row or measurement of a script: a repeat timed or measured it again and printed its
    row twice (or kept only the last under its key)."""
    for flag, values in flags:
        twice = repeated(values or [])
        if twice:
            parser.error(f"argument {flag}: {', '.join(map(str, twice))} given twice; give each value once")


def named_twice(what: str, values: list) -> Optional[str]:
    """'<what> names X twice: give each once' for a list of pipelines or bit-widths that repeats one (each
    would run twice, the first result moved to the JSON's history), or None."""
    twice = repeated(values)
    return f"{what} names {', '.join(twice)} twice: give each once" if twice else None


def device_problem(text: str) -> Optional[str]:
    """Why `text` names no device this process can hold data on (None if it does: the CPU or a visible CUDA
    device): not a torch device (`gpu`), a device the machine lacks (cuda without a GPU, cuda:3 beside two)
    or one that holds no data (meta). Such a device fails with a traceback at the first tensor moved there."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        return "not a torch device; give cpu, cuda or cuda:N"
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            return (f"{count} CUDA device(s) are visible (cuda:0 .. cuda:{count - 1})" if count
                    else "no CUDA device is visible; give cpu")
    elif device.type != "cpu":
        return "give cpu, cuda or cuda:N"
    return None


def torch_device(text: str):
    """An argparse `type` for a --device (`device_problem`): refused by argparse, one `error:` line naming
    the flag, e.g. `--device gpu`, or `--device cuda` on a machine without a GPU."""
    import torch

    problem = device_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(f"{text}: {problem}")
    return torch.device(text)


def add_config_arguments(parser: argparse.ArgumentParser, entry: str,
                         print_help: str = "print the resolved config (YAML) and exit without running") -> None:
    """--help-config [SECTION] and --print-config, and the list of sections at the end of --help. `print_help`:
    --print-config's help, which says what the entry checks before it prints (train.py: its checks before a run)."""
    parser.add_argument("--help-config", nargs="?", const="", default=None, metavar="SECTION",
                        action=_HelpConfig, help="list every config key (of SECTION, e.g. sched or "
                        "quant.aphq) with its default, type, allowed values and meaning, and exit")
    parser.add_argument("--print-config", action="store_true", help=print_help)
    parser.epilog = sections_overview(entry)


def passed_on_epilog(parser: argparse.ArgumentParser, target: argparse.ArgumentParser, target_entry: str) -> str:
    """The end of --help of a script that runs `target_entry` (evaluate.py) with the key=value overrides it is
    given: where those keys are listed, and which of the target's flags the script has too (with its own
    meaning, above in its --help) and which it does not take. Read from both parsers, so a flag added to
    evaluate.py shows up here without a second list to keep."""
    own = {o for action in parser._actions for o in action.option_strings}
    flags = [action.option_strings[-1] for action in target._actions
             if action.option_strings and not isinstance(action, argparse._HelpAction)]
    shared = [f for f in flags if f in own]
    other = [f for f in flags if f not in own]
    return (f"{target_entry}'s options: the key=value overrides go to {target_entry} (`python {target_entry} "
            f"--help-config` lists every key). Of its flags this command has {', '.join(shared) or 'none'} (see "
            f"above) and does not take {', '.join(other) or 'any other'}.")


def parse_known(parser: argparse.ArgumentParser, argv: list[str], entry: str,
                own_flags: Optional[dict] = None) -> argparse.Namespace:
    """parser.parse_intermixed_args(argv), except that an unknown flag with a known meaning is a
    ConfigError that names our spelling of it (`own_flags` adds or replaces entries of FOREIGN_FLAGS), and so is a
    YAML file given among the key=value overrides, where the parser has --config."""
    args, unknown = parser.parse_known_intermixed_args(argv)
    files = [w for w in getattr(args, "overrides", None) or [] if "=" not in w and w.endswith((".yaml", ".yml"))]
    if files and "--config" in parser._option_string_actions:  # `train.py configs/x.yaml`: the flag left out
        raise ConfigError(f"override {files[0]!r} is not of the form key=value; a config file is given with --config: "
                          f"--config {files[0]}")
    for token in unknown:
        if token.startswith("-"):
            message = foreign_flag_message(token, argv, entry, {**FOREIGN_FLAGS, **(own_flags or {})})
            if message:
                raise ConfigError(message)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def foreign_flag_message(token: str, argv: list[str], entry: str, flags: dict) -> Optional[str]:
    """'--epochs is not an option of train.py; ...' for a flag with a known equivalent, else None."""
    flag, eq, value = token.partition("=")
    if not eq:  # `--epochs 3`: the value is the next item, unless that is an option or an override
        later = argv[argv.index(token) + 1:] if token in argv else []
        value = later[0] if later and not later[0].startswith("-") and "=" not in later[0] else ""
    name = flag.lstrip("-").replace("-", "_")
    if name in flags:
        ours = flags[name]
    elif name in schema_keys():  # --optim.lr=1e-3
        ours = name + "={}"
    else:  # --warmup-epochs 5: a key of the schema under that name (the training sections first)
        same = [k for k in schema_keys() if k.rpartition(".")[2] == name]
        same = [k for k in same if not k.startswith("quant.")] or same
        if len(same) != 1:
            return None
        ours = same[0] + "={}"
    if not ours:
        return f"{flag} is not an option of {entry}; drop it"
    ours = ours.replace("{}", value or "VALUE")
    note = "" if ours.startswith(("-", "python")) else \
        f"; settings are key=value arguments, python {entry} --help-config lists them"
    return f"{flag} is not an option of {entry}; use {ours}{note}"


def print_config(cfg: Config) -> None:
    """The resolved config as YAML on stdout; `--config` takes it back as it is."""
    print(dump_yaml(config_to_dict(cfg), sort_keys=False), end="")


def sections_overview(entry: str) -> str:
    """The config sections in one line each, for the end of --help."""
    lines = [f"config sections (key=value arguments override the --config files; `python {entry}",
             "--help-config [SECTION]` lists every key with its default, type, allowed values and meaning):"]
    for f in dataclasses.fields(Config):
        value = getattr(Config(), f.name)
        text = _section_line(type(value)) if dataclasses.is_dataclass(value) else field_help(Config, f.name)
        lines.append(f"  {f.name:<9} {text}")
    return "\n".join(lines)


def config_help(section: str = "") -> str:
    """Every key of `section` ("" = all), one entry each: key = default (type, allowed values), help."""
    if section and section not in schema_keys():
        matches = close_keys(section)
        raise ConfigError(f"unknown config section '{section}'"
                          + (f"; did you mean {', '.join(map(repr, matches))}?" if matches else ""))
    node = get_key(Config(), section) if section else Config()
    if not dataclasses.is_dataclass(node):
        owner, _, name = section.rpartition(".")
        return _key_entry(get_key(Config(), owner) if owner else Config(), name, section) + "\n"
    return "\n".join(_section_entries(node, section + "." if section else "")) + "\n"


def _section_entries(node: Any, prefix: str) -> list[str]:
    out = []
    if prefix:
        out.append(f"{prefix[:-1]}: {_section_line(type(node))}")
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            out += ["", *_section_entries(value, prefix + f.name + ".")]
        else:
            out.append(_key_entry(node, f.name, prefix + f.name))
    return out


def _key_entry(node: Any, name: str, key: str) -> str:
    hints = schema_hints(type(node))
    default = dump_yaml(plain(getattr(node, name)), default_flow_style=True)
    head = f"  {key} = {default.splitlines()[0]}  ({describe_type(hints[name])})"
    body = textwrap.fill(field_help(type(node), name), width=100, initial_indent=" " * 6,
                         subsequent_indent=" " * 6)
    return f"{head}\n{body}" if body else head


def _section_line(cls: type) -> str:
    return (inspect.getdoc(cls) or "").split("\n\n")[0].replace("\n", " ")


def field_help(cls: type, name: str) -> str:
    """The comment that documents field `name` of dataclass `cls` (searched in the class that defines it)."""
    for klass in cls.__mro__:
        if name in vars(klass).get("__annotations__", {}):
            return _comments(klass).get(name, "")
    return ""


@functools.lru_cache(maxsize=None)
def _comments(klass: type) -> dict:
    """{field: help text} from the comments of `klass`'s source: the comment on the field's line (with
    its continuation lines, indented `#   `), else the comment lines right above it."""
    try:
        lines, _ = inspect.getsourcelines(klass)
    except OSError:  # no source next to the bytecode: no help texts, but the keys, defaults and types
        return {}
    comments = {}
    for tok in tokenize.generate_tokens(io.StringIO("".join(lines)).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0] - 1] = (tok.string.lstrip("#").strip(), tok.line.strip().startswith("#"),
                                          tok.string.startswith("#  "))
    fields = {f.name for f in dataclasses.fields(klass)}
    found = {}
    for i, line in enumerate(lines):
        name = line.strip().partition(":")[0]
        if not (line.startswith("    ") and not line.startswith("     ") and name in fields):
            continue
        if i in comments and not comments[i][1]:  # on the field's line, then its continuations
            text, j = [comments[i][0]], i + 1
            while j in comments and comments[j][1] and comments[j][2]:
                text.append(comments[j][0])
                j += 1
        else:  # the comment-only lines right above (not the continuation of the field above's comment)
            text, j = [], i - 1
            while j in comments and comments[j][1]:
                text.insert(0, comments[j])
                j -= 1
            while text and text[0][2]:
                text.pop(0)
            text = [t[0] for t in text]
        found[name] = " ".join(text)
    return found


class _HelpConfig(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        try:
            text = config_help(values or "")
        except ConfigError as e:  # one `error:` line, as for every other user error (no usage block)
            parser.exit(2, f"error: {e} (--help-config alone lists every section)\n")
        print(text, end="")
        parser.exit()

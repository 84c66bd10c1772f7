"""The documentation works: every relative link in the repository's Markdown files resolves (the file, and
the heading after `#`); every `train.py` / `evaluate.py` command in the Markdown code blocks and inline code, in
the module docstrings of the code (entry points, scripts, packages) and in the comments of the YAML configs
parses, its config resolved as `--print-config` resolves it where that needs no file a run writes; every
`scripts/<x>.py`, `evaluate_detection.py` and `python -m cd` command there parses through that script's own
parser, and a sweep's through its dry path; every repository file a command names exists, and every config key
they set as `key=value` (inline too) is one of configs/schema.py. The files are
read when the tests are collected, so the checks follow the documents as they change."""
import argparse
import ast
import fnmatch
import glob
import importlib
import importlib.util
import json
import os
import re
import shlex
import subprocess

import pytest
import yaml

from configs import config_from_dict, load_config
from configs.loader import read_yaml_file
from tests.conftest import ROOT, load_script


def repository_files(root: str, pattern: str) -> list[str]:
    """The repository's own files whose name matches `pattern` (`*.md`), relative to `root`: what git tracks or
    would track (untracked but not ignored), so that what a command the README suggests writes into the checkout
    (build/ and *.egg-info of `pip install .`, runs/, a venv) is never read as documentation. Without git (a
    copy of the files), every match outside hidden folders and the folders .gitignore names."""
    try:
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z", "--",
                                 pattern], cwd=root, capture_output=True, check=True).stdout.decode()
        if os.path.exists(os.path.join(root, ".git")) or listed:
            return sorted(p for p in listed.split("\0") if p and os.path.isfile(os.path.join(root, p)))
    except (OSError, subprocess.CalledProcessError):
        pass
    ignored = set()
    if os.path.exists(os.path.join(root, ".gitignore")):
        with open(os.path.join(root, ".gitignore")) as f:
            ignored = {line.strip().strip("/") for line in f if line.strip().endswith("/")}
    paths = (os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "**", pattern), recursive=True))
    return sorted(p for p in paths
                  if not any(part.startswith(".") or part in ignored or fnmatch.fnmatch(part, "*.egg-info")
                             for part in p.split(os.sep)[:-1]))


MARKDOWN = repository_files(ROOT, "*.md")
# The examples outside the Markdown: each module's docstring (entry points open with how to run them; the tests'
# own docstrings describe what they try, refused commands included) and each YAML config's comments.
DOCSTRINGS = [p for p in repository_files(ROOT, "*.py") if p.split("/")[0] != "tests"]
YAML_COMMENTS = repository_files(ROOT, "*.yaml")
DOCUMENTS = MARKDOWN + DOCSTRINGS + YAML_COMMENTS
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)


def prose(text: str) -> str:
    """`text` without code blocks and inline code (where `[a](b)` is code, not a link)."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def links(path: str) -> list[str]:
    with open(os.path.join(ROOT, path)) as f:
        text = prose(f.read())
    return [m.group(1) for m in re.finditer(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text)
            if not re.match(r"[a-z][a-z0-9+.-]*:", m.group(1))]  # http:, https:, mailto: are not relative


def anchors(path: str) -> set[str]:
    """GitHub's heading anchors of a Markdown file: lower case, punctuation dropped, spaces as hyphens,
    repeats numbered -1, -2, ..."""
    with open(path) as f:
        headings = re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", FENCE.sub("", f.read()), re.M)
    seen: dict = {}
    out = set()
    for heading in headings:
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").lower()).replace(" ", "-")
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out


def test_there_are_documents_with_links():
    assert "README.md" in MARKDOWN and sum(len(links(p)) for p in MARKDOWN) > 0


@pytest.mark.parametrize("path", MARKDOWN)
def test_every_relative_link_resolves(path):
    broken = []
    for link in links(path):
        target, _, anchor = link.partition("#")
        full = os.path.normpath(os.path.join(ROOT, os.path.dirname(path), target)) if target \
            else os.path.join(ROOT, path)
        if not os.path.exists(full):
            broken.append(f"{link} (no such file)")
        elif anchor and full.endswith(".md") and anchor not in anchors(full):
            broken.append(f"{link} (no heading #{anchor} in {os.path.relpath(full, ROOT)})")
    assert not broken, f"{path}: {broken}"


PLACEHOLDER_RECIPE = "configs/pretrain/vit_b.yaml"  # what `--config ...` ("your recipe") stands for


def as_markdown(path: str) -> str:
    """The document `path` as Markdown: a Markdown file as it is; of a Python file its module docstring, its
    examples indented by 4 spaces or more (`    python train.py ...`) as code blocks, of a YAML file its comments
    without the `# `, those indented by 2 spaces or more (`#   python train.py ...`) as code blocks; the rest
    is prose (a list item's continuation, indented less, included)."""
    with open(os.path.join(ROOT, path)) as f:
        text = f.read()
    if path.endswith(".md"):
        return text
    if path.endswith(".py"):
        text, indent = ast.get_docstring(ast.parse(text)) or "", 4
    else:
        text = "\n".join(re.sub(r"^# ?", "", line.strip()) if line.strip().startswith("#") else ""
                         for line in text.splitlines())
        indent = 2
    return re.sub(rf"(?m)((?:^ {{{indent},}}\S.*\n?)+)", lambda m: "```\n" + m.group(1).rstrip("\n") + "\n```\n",
                  text + "\n")


def documented_command_lines(path: str) -> list[str]:
    """The shell lines of `path` a user would copy: every line of its code blocks (continuation lines joined)
    and every inline code span in its prose."""
    text = as_markdown(path)
    lines = [line for block in FENCE.findall(text) for line in re.sub(r"\\\n", " ", block).splitlines()]
    return lines + re.findall(r"`([^`\n]+)`", FENCE.sub("", text))


def commands(path: str) -> list[tuple[str, list[str]]]:
    """(script, its arguments) of every train.py / evaluate.py command in the code blocks and inline code of
    `path` (continuation lines joined; comments, shell variables and `...` placeholders as a user would fill
    them in; a command elided to `evaluate.py ...` has nothing to check, and one named in prose, as
    "`evaluate.py`'s JSON", is no command)."""
    found = []
    for word, launcher, words in invocations(path, r"(train|evaluate)\.py"):
        if word not in ("train.py", "evaluate.py") or launcher == "-m":
            continue
        args = []
        for arg in words:
            if arg == "..." and args[-1:] == ["--config"]:
                arg = PLACEHOLDER_RECIPE
            args.append(re.sub(r"=\.\.\.$", "=placeholder", arg))
        if args[-1:] == ["..."]:
            args = args[:-1]
            if not args:
                continue
        found.append((word, args))
    return found


def invocations(path: str, script: str) -> list[tuple[str, str, list[str]]]:
    """(word, the word before it, the words after it up to a shell operator) of every word of the documented
    command lines of `path` that a launcher runs (after `python`, `torchrun`, `-m` or a `--flag` of theirs), on
    the lines where the regex `script` stands as a word; a script named in prose ("`scripts/sweep.py` prints")
    is not run."""
    found = []
    for line in documented_command_lines(path):
        if not re.search(rf"(^|\s)({script})(\s|$)", line):
            continue
        words = shlex.split(line, comments=True)
        for i, word in enumerate(words):
            if i > 0 and (words[i - 1] in ("python", "torchrun", "-m") or words[i - 1].startswith("--")):
                rest = words[i + 1:]
                ends = [k for k, w in enumerate(rest) if w in ("&&", ";", "|", "||")]
                found.append((word, words[i - 1], rest[:ends[0]] if ends else rest))
    return found


def once_each(rows: list[tuple]) -> list[tuple]:
    """`rows` (document, command ...) with each command once, after the documents that show it, joined by ", ": a
    command that a config's comment, a script's docstring and the README all show is checked once."""
    shown: dict = {}
    for path, *command in rows:
        shown.setdefault(repr(command), (command, {}))[1][path] = None
    return [(", ".join(paths), *command) for command, paths in shown.values()]


DOCUMENTED_COMMANDS = once_each([(path, script, args) for path in DOCUMENTS for script, args in commands(path)])


def test_the_readme_has_commands():
    assert any("README.md" in path.split(", ") and script == "train.py" for path, script, _ in DOCUMENTED_COMMANDS)
    assert any("README.md" in path.split(", ") and script == "evaluate.py" for path, script, _ in DOCUMENTED_COMMANDS)


def test_the_docstrings_and_config_comments_have_commands():
    """The examples outside the Markdown are read: an entry point's docstring (continuation lines joined), a
    script's, and a config's comment (without its `#`)."""
    assert ("train.py", ["--config", "configs/pretrain/vit_b.yaml", "data.root=placeholder"]) in commands("train.py")
    assert ("bench_overhead", ["--device", "cpu", "--small", "--out", "/tmp/ovh"], False) \
        in script_commands("scripts/bench_overhead.py")
    assert ("train.py", ["--config", "configs/pretrain/vit_b.yaml", "data.root=/datasets/imagenet"]) \
        in commands("configs/pretrain/vit_b.yaml")


@pytest.mark.parametrize("path, script, args", DOCUMENTED_COMMANDS,
                         ids=[f"{p}: {s} {' '.join(a)}"[:120] for p, s, a in DOCUMENTED_COMMANDS])
def test_every_documented_command_parses(path, script, args, monkeypatch, capsys):
    import evaluate
    import train

    monkeypatch.chdir(ROOT)  # the commands name configs relative to the repository root
    if script == "evaluate.py":
        parsed = evaluate.parse_args(args)
        if parsed.checkpoint and not os.path.exists(parsed.checkpoint):
            # the checkpoint that a run writes holds the config: the overrides must be valid keys and values
            load_config(parsed.config or [], parsed.overrides)
            return
    asks_help = any(a in ("-h", "--help", "--help-config") for a in args)
    with pytest.raises(SystemExit) as done:
        # (--print-config once: a flag given twice is refused)
        given = args if asks_help or "--print-config" in args else [*args, "--print-config"]
        (train if script == "train.py" else evaluate).parse_args(given)
    assert done.value.code in (0, None)
    out = capsys.readouterr().out
    if asks_help:  # help prints text and exits 0; a section that does not exist is an error, not help
        assert out.strip()
        return
    config_from_dict(yaml.safe_load(out))  # the printed config is a whole, valid one


def brace_words(word: str) -> list[str]:
    """bash's brace expansion of one word: `{a,b}_{x,y}` -> a_x a_y b_x b_y."""
    m = re.search(r"\{([^{}]*,[^{}]*)\}", word)
    if not m:
        return [word]
    return [w for alt in m.group(1).split(",") for w in brace_words(word[:m.start()] + alt + word[m.end():])]


def script_commands(path: str) -> list[tuple[str, list[str], bool]]:
    """(script, its arguments, elided) of every `python scripts/<x>.py` (or `torchrun ... scripts/<x>.py`),
    `evaluate_detection.py` and `python -m cd` command in `path`, the script named by its module (`sweep`,
    `evaluate_detection`, `cd.__main__`). Words expand as bash expands braces, except a braced subcommand right
    after the script (`mechanism.py {surrogate,remove} ...`), which stands for one command each; a `...` word
    marks an elided command ("the arguments of the one above", trailing or as in `train_detection.py ...
    --resume`), whose other words are checked but not its completeness."""
    found = []
    for word, launcher, args in invocations(path, r"scripts/\w+\.py|evaluate_detection\.py|-m cd"):
        entry = re.fullmatch(r"scripts/(\w+)\.py|(evaluate_detection)\.py|(cd)", word)
        if not entry or (entry.group(3) and launcher != "-m"):
            continue
        module = entry.group(1) or entry.group(2) or "cd.__main__"
        elided = "..." in args
        args = [a for a in args if a != "..."]
        for head in (brace_words(args[0]) if args else [None]):
            rest = [w for a in args[1:] for w in brace_words(a)]
            found.append((module, ([head] if head is not None else []) + rest, elided))
    return found


SCRIPT_COMMANDS = once_each([(path, name, args, elided) for path in DOCUMENTS
                             for name, args, elided in script_commands(path)])


def test_the_documents_have_script_commands():
    scripts = {name for _, name, _, _ in SCRIPT_COMMANDS}
    assert {"sweep", "paper_table", "mechanism", "bench_overhead", "evaluate_detection", "cd.__main__"} <= scripts


class Parsed(Exception):
    """Raised in place of a script's work once its own parser has accepted the arguments."""


def parse_with_script(name: str, args: list[str], monkeypatch) -> tuple:
    """Run the script's main(args) (scripts/<name>.py, or the module `name`) up to the moment the argument
    parser it builds for itself (flags, choices, types, subcommands) returns, then stop it: (parser,
    namespace), or (parser, None) where argparse refused the arguments (SystemExit, one `error:` line).
    The examples are written for the machines they name: the parser sees one with 8 visible GPUs (as under
    `torchrun --nproc_per_node=8`), so `--device cuda` is checked for its spelling, not this machine's."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    seen = []
    for method in ("parse_args", "parse_intermixed_args"):
        original = getattr(argparse.ArgumentParser, method)

        def stop_after(self, *a, _original=original, **kw):
            seen.append(self)
            raise Parsed(self, _original(self, *a, **kw))
        monkeypatch.setattr(argparse.ArgumentParser, method, stop_after)
    try:
        script = importlib.import_module(name) if name in ("evaluate_detection", "cd.__main__") \
            else load_script(name)
        script.main(args)
    except Parsed as done:
        return done.args
    except SystemExit as e:
        if e.code in (0, None):
            raise AssertionError(f"{name} {shlex.join(args)} exited before parsing") from e
        return (seen[-1] if seen else None), None
    raise AssertionError(f"{name} {shlex.join(args)} returned without parsing its arguments")


@pytest.mark.parametrize("path, name, args, elided", SCRIPT_COMMANDS,
                         ids=[f"{p}: {n} {' '.join(a)}"[:120] for p, n, a, _ in SCRIPT_COMMANDS])
def test_every_documented_script_command_parses(path, name, args, elided, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    parser, parsed = parse_with_script(name, args, monkeypatch)
    err = capsys.readouterr().err
    if parsed is None and elided:  # `mechanism.py alignment ...`: the flags it names must exist
        assert parser is not None, err
        assert "the following arguments are required" in err, err
        unknown = [a.split("=")[0] for a in args
                   if a.startswith("-") and a.split("=")[0] not in parser._option_string_actions]
        assert not unknown, f"{path}: {name} has no {unknown}"
        return
    assert parsed is not None, f"{path}: {name} {shlex.join(args)}: {err}"


SWEEP_COMMANDS = [c for c in SCRIPT_COMMANDS if c[1] == "sweep" and not c[3]]


@pytest.mark.parametrize("path, name, args, elided", SWEEP_COMMANDS,
                         ids=[f"{p}: {' '.join(a)}"[:120] for p, _, a, _ in SWEEP_COMMANDS])
def test_every_documented_sweep_expands_into_commands(path, name, args, elided, monkeypatch, capsys):
    """A sweep's dry path (without --run it checks every run's config and prints the commands): the overrides
    and run names the document gives are valid for that sweep file; `key=...` stands for a value of yours."""
    monkeypatch.chdir(ROOT)
    dry = [re.sub(r"=\.\.\.$", "=placeholder", a) for a in args if a != "--run"]
    assert load_script("sweep").main(dry) == 0, f"{path}: {capsys.readouterr().err}"
    assert "train.py" in capsys.readouterr().out


def runs_the_epochs_protocol(name: str, args: list[str]) -> bool:
    """Whether a script command runs the epochs protocol (scripts/overhead_epochs.py, directly or as
    `bench_overhead.py --protocol epochs`)."""
    return name == "overhead_epochs" or (name == "bench_overhead" and (
        "--protocol=epochs" in args or any(a == "--protocol" and b == "epochs" for a, b in zip(args, args[1:]))))


EPOCHS_COMMANDS = [c for c in SCRIPT_COMMANDS if runs_the_epochs_protocol(c[1], c[2]) and not c[3]]


class FirstRun(Exception):
    """Raised in place of the epochs protocol's first train.py run."""


@pytest.mark.parametrize("path, name, args, elided", EPOCHS_COMMANDS,
                         ids=[f"{p}: {' '.join(a)}"[:120] for p, _, a, _ in EPOCHS_COMMANDS])
def test_every_documented_epochs_protocol_is_accepted_up_to_its_first_run(path, name, args, elided, monkeypatch,
                                                                           capsys, tmp_path):
    """The epochs protocol checks its whole plan before its first run (every run's config, each per-GPU batch
    on the launcher's processes against the global batch, the launcher's program), as a sweep's dry path
    does: the document's command gets that far. The first run is stopped. Its --out is a folder of the test's
    own: the protocol records each run's launcher (runs/<folder>.launcher.json) just before that run, and the
    example's results/ under the checkout may hold a user's records."""
    import sys

    monkeypatch.chdir(ROOT)
    # the environment the example assumes is active (its torchrun on PATH)
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    out = str(tmp_path / "out")
    args = ([out if i and args[i - 1] == "--out" else a for i, a in enumerate(args)] if "--out" in args
            else [*args, "--out", out])

    def first_run(cmd, **kw):
        raise FirstRun(cmd)
    import launchers  # the protocol runs train.py through launchers.ForwardedSignals (scripts/ is on the path)
    monkeypatch.setattr(launchers.ForwardedSignals, "run", lambda self, cmd: first_run(cmd))
    monkeypatch.setattr(subprocess, "run", first_run)
    with pytest.raises(FirstRun) as started:
        load_script(name).main(args)
    assert os.path.join(ROOT, "train.py") in started.value.args[0], f"{path}: {capsys.readouterr().err}"


REPOSITORY_FOLDERS = ("cd", "configs", "data", "docs", "engine", "models", "quant", "scripts")  # README's Layout


def command_values(path: str) -> list[str]:
    """The words of the commands of `path` (its documented lines that run python, torchrun or bash), a key=value
    word as its value, braces expanded."""
    values = []
    for line in documented_command_lines(path):
        if not re.search(r"(^|\s)(python|torchrun|bash)\s", line):
            continue
        try:
            words = shlex.split(line, comments=True)
        except ValueError:  # prose that is not a command
            continue
        for word in words:
            values += brace_words(word.split("=", 1)[1] if re.match(r"[\w.]+=", word) else word)
    return values


def repository_paths(path: str) -> list[str]:
    """The repository files and folders that the commands of `path` name (a word, or the value of a
    key=value word, under one of the checkout's own top-level folders, such as configs/, data/ or scripts/);
    an upper-case placeholder (`configs/detection/SETTING.py`) stands for any name."""
    return [one for one in command_values(path)
            if one.split("/")[0] in REPOSITORY_FOLDERS and "/" in one and "*" not in one]


def test_the_path_check_reads_the_commands_paths():
    assert {"configs/sweeps/pretrain_main.yaml", "scripts/install_mmcv.sh"} <= set(repository_paths("README.md"))


@pytest.mark.parametrize("path", DOCUMENTS)
def test_every_repository_file_a_documented_command_names_exists(path):
    missing = [p for p in repository_paths(path)
               if not glob.glob(os.path.join(ROOT, re.sub(r"\b[A-Z][A-Z_]{2,}\b", "*", p)))]
    assert not missing, f"{path}: {missing}"


# A setting a document names as `section.key=value`, in a command or in inline code of the prose (`train.resume=PATH`),
# which no command test parses when it stands alone; these name keys of another schema or of an example on purpose
OTHER_SETTINGS = ("train.epochs=",     # README.md's example of an unknown key ("did you mean 'sched.epochs'?")
                  "quant.minmax.",     # docs/extending.md's example pipeline, whose section a fork adds
                  "model.backbone.")   # MMDetection's config keys (scripts/train_detection.py), not configs/schema.py
SETTING = re.compile(r"(?<![\w./-])((?:model|data|optim|sched|train|log|cd|tweo|quant)(?:\.\w+)+)=")


def documented_settings(path: str) -> list[str]:
    """The dotted config keys that `path` sets as `key=value` in its code blocks and inline code."""
    return [m.group(1) for line in documented_command_lines(path) for m in SETTING.finditer(line)
            if not (m.group(1) + "=").startswith(OTHER_SETTINGS)]


def test_the_setting_check_reads_inline_settings():
    readme = set(documented_settings("README.md"))
    assert {"train.keep_every_epochs", "model.kwargs.depth", "quant.aphq.iters"} <= readme
    assert "train.epochs" not in readme


@pytest.mark.parametrize("path", DOCUMENTS)
def test_every_config_key_a_document_sets_exists(path):
    """A renamed or removed key leaves no `key=value` in the documents: each is a key of configs/schema.py, or an
    entry of one of its free-form dicts (`model.kwargs.depth`)."""
    from configs.loader import dict_fields, schema_keys

    keys, free = set(schema_keys()), tuple(f + "." for f in dict_fields())
    unknown = [k for k in documented_settings(path) if k not in keys and not k.startswith(free)]
    assert not unknown, f"{path}: no such config key: {unknown}"


def test_every_sweep_output_a_documented_command_names_is_under_a_sweeps_out_root():
    """A command that reads a sweep's runs (`paper_table.py runs/sweeps/digits/*/eval_best.json`) names the
    folder its sweep file writes them to (out_root), not the sweep file's name where the two differ."""
    roots = [str(read_yaml_file(p).get("out_root"))
             for p in glob.glob(os.path.join(ROOT, "configs", "sweeps", "*.yaml"))]
    wrong = [(path, value) for path in DOCUMENTS for value in command_values(path)
             if value.startswith("runs/sweeps/") and not any(value == r or value.startswith(r + "/") for r in roots)]
    assert not wrong, f"no sweep's out_root (configs/sweeps/*.yaml: {sorted(roots)}) holds {wrong}"


def integration_examples() -> list[str]:
    """The complete examples of cd/README.md's integrations section (Python blocks that import a framework
    integration and train), each to run as a user would paste it."""
    with open(os.path.join(ROOT, "cd", "README.md")) as f:
        text = f.read()
    section = text.split("### In transformers, Lightning and MMEngine", 1)[1].split("\n### ", 1)[0]
    blocks = re.findall(r"^```python\n(.*?)^```", section, re.S | re.M)
    return [b for b in blocks if "cd.integrations" in b and (".train()" in b or ".fit(" in b)]


def test_the_integrations_section_has_an_example_per_framework():
    found = " ".join(integration_examples())
    assert all(f"cd.integrations.{name}" in found for name in ("hf", "lightning", "mmengine"))
    with open(os.path.join(ROOT, "cd", "README.md")) as f:
        text = f.read()
    # the MMDetection config lines are the ones the complete MMEngine example runs
    assert 'custom_hooks = [dict(type="ColinearityDecayHook", lam=0.005)]' in text
    assert 'custom_hooks=[dict(type="ColinearityDecayHook", lam=0.005)]' in found


def test_each_integration_example_needs_only_what_its_install_line_installs():
    """A user installs the extra that the example's text names (its own `pip install` line, else its framework's
    row of the table) and pastes the code: every module it imports must come with that install."""
    import ast
    import sys
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    with open(os.path.join(ROOT, "cd", "README.md")) as f:
        section = f.read().split("### In transformers, Lightning and MMEngine", 1)[1].split("\n### ", 1)[0]
    for code in integration_examples():
        before = section[:section.index(code)].removesuffix("```python\n").rstrip().rsplit("\n\n", 1)[-1]  # its intro
        framework = next(n for n in ("hf", "lightning", "mmengine") if f"cd.integrations.{n}" in code)
        named = re.findall(r'pip install "?\.\[([\w,]+)\]', before)
        if not named:  # the table's install column: cd.integrations.<name> comes with the extra [<name>]
            assert f"`pip install .[{framework}]`" in section
        extras = named[-1].split(",") if named else [framework]
        installed = {"cd"} | {re.split(r"[<>=! ]", d)[0] for d in project["dependencies"]}
        for extra in extras:
            installed |= {re.split(r"[<>=! ]", d)[0] for d in project["optional-dependencies"][extra]}
        imported = {name.split(".")[0] for node in ast.walk(ast.parse(code))
                    for name in ([a.name for a in node.names] if isinstance(node, ast.Import) else
                                 [node.module] if isinstance(node, ast.ImportFrom) else [])}
        assert imported - sys.stdlib_module_names <= installed, (framework, extras, imported - installed)


# Runs each example file named on its command line in a child forked from an interpreter that has imported torch,
# torchvision and transformers alone (every example imports them: torch itself, the others through its framework,
# `python -X importtime` of each; torchvision brings torch._dynamo, seconds): each has its own module state, globals
# (those of `python -c`) and working folder, as a fresh `python -c` would, without three starts of those. Prints each
# child's exit code.
RUN_EACH_IN_A_FORK = r"""
import os, sys, traceback
import torch  # noqa: F401
for name in ("torchvision", "transformers"):
    try:
        __import__(name)
    except ImportError:  # an example that needs it fails in its own child, as it would alone
        pass
codes = []
for path in sys.argv[1:]:
    pid = os.fork()
    if pid == 0:
        os.chdir(os.path.dirname(path))
        sys.argv = ["-c"]
        for fd, name in ((1, "stdout.txt"), (2, "stderr.txt")):
            os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        code = 0
        try:
            exec(compile(open(path).read(), "<string>", "exec"), {"__name__": "__main__"})
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
print(codes)
"""


@pytest.mark.slow
def test_integration_examples_run_as_written(tmp_path):
    """Each complete example of cd/README.md's integrations section runs as pasted (in a folder of its own, with
    only the `cd` package on PYTHONPATH, as `pip install .` gives it) and logs CD's metrics after its 4 updates."""
    import sys

    names = ["hf", "lightning", "mmengine"]
    examples = dict(zip(names, integration_examples(), strict=True))
    installed = {name: importlib.util.find_spec(module) is not None
                 for name, module in zip(names, ("transformers", "lightning", "mmengine"))}
    paths = []
    for name, code in examples.items():
        if installed[name]:
            (tmp_path / name).mkdir()
            paths.append(tmp_path / name / "example.py")
            paths[-1].write_text(code)
    # `cd` alone on the path, as `pip install .` installs it: the checkout's root would also make whatever else lies
    # there importable (a data folder named datasets/ as Hugging Face's `datasets`)
    site = tmp_path / "site"
    site.mkdir()
    (site / "cd").symlink_to(os.path.join(ROOT, "cd"))
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", RUN_EACH_IN_A_FORK, *map(str, paths)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == str([0] * len(paths)), {p.parent.name: (p.parent / "stderr.txt").read_text()[-3000:]
                                                           for p in paths}
    for path in paths:
        out = (path.parent / "stdout.txt").read_text()
        assert "cd/pair_energy/fc2" in out and "'cd/updates': 4.0" in out, (path.parent.name, out[-2000:])
    if not all(installed.values()):
        pytest.skip(f"not installed, not run: {[n for n, ok in installed.items() if not ok]}")


@pytest.mark.parametrize("with_git", [True, False])
def test_files_that_readme_commands_write_are_not_documentation(tmp_path, with_git):
    """`pip install .` from the checkout (the README suggests it) writes build/lib/cd/README.md, whose
    relative links break there, and build/lib/cd/*.py; runs/ and a venv hold Markdown and modules of their own."""
    for rel in ("README.md", "docs/a.md", "build/lib/cd/README.md", "runs/x/notes.md", ".venv/lib/x.md",
                "colinearity_decay.egg-info/x.md", "cd/__main__.py", "build/lib/cd/__main__.py", ".venv/lib/x.py"):
        os.makedirs(os.path.dirname(tmp_path / rel) or tmp_path, exist_ok=True)
        (tmp_path / rel).write_text("# x\n")
    (tmp_path / ".gitignore").write_text("runs/\nbuild/\n.venv/\n*.egg-info/\n")
    if with_git:
        subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
        subprocess.run(["git", "add", "README.md"], cwd=tmp_path, check=True)
    assert repository_files(str(tmp_path), "*.md") == ["README.md", "docs/a.md"]
    assert repository_files(str(tmp_path), "*.py") == ["cd/__main__.py"]


def test_the_json_of_an_evaluation_without_checkpoint_is_where_the_readme_and_help_say(capsys):
    """`evaluate.py --config ... model.pretrained=FILE` has no checkpoint folder to write beside: the README's
    command and `--out`'s help name the file it writes."""
    import evaluate

    documented = "runs/eval/<model.name>.json"
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    line = next(ln for ln in readme.splitlines() if "# your own weights file" in ln)
    assert documented in line
    with pytest.raises(SystemExit):
        evaluate.parse_args(["--help"])
    assert documented in " ".join(capsys.readouterr().out.split())
    assert evaluate.default_out_path(None, "vit_base_patch16_224") == os.path.join(
        "runs", "eval", "vit_base_patch16_224.json")


def test_the_committed_lm_study_report_has_the_marks_notes_and_captions_lm_study_writes(tmp_path):
    """docs/figures/lm_study.md is lm_study.py's report of configs/sweeps/kjv_lm_dose (its run folders are not
    kept): written again for runs of its points and seeds evaluated as the sweep evaluates them (its
    `evaluate:` settings, quant.calib_images=64), the report has the same tables, marks (* of a quantized number
    of other settings than the defaults), notes and captions; only the numbers differ. The committed file was
    written before lm_study.py marked such numbers and had none. Its section on the points' training settings
    (the recipe of each eval_best.json, which the file predates) is not compared."""
    from engine.quant_settings import quant_settings
    from tests.test_lm_study import write_run

    lm_study, dose_report = load_script("lm_study"), load_script("dose_report")
    with open(os.path.join(ROOT, "docs", "figures", "lm_study.md"), encoding="utf-8") as f:
        committed = f.read()
    first_table = committed.split("\n\n")[0].splitlines()[2:]
    # the seeds column lists each point's seed numbers (e.g. 0,1,2,3)
    seeds = {line.split(" | ")[0].strip("| "): [int(s) for s in line.split(" | ")[1].split(",")]
             for line in first_table}
    sweep = read_yaml_file(os.path.join(ROOT, "configs", "sweeps", "kjv_lm_dose.yaml"))
    cfg = load_config([os.path.join(ROOT, path) for path in sweep["configs"]], sweep["evaluate"])
    for point, numbers in seeds.items():
        for seed in numbers:
            folder = tmp_path / f"{point}_s{seed}"
            write_run(tmp_path, folder.name, ppl=4.0 + seed / 100, rtn=5.0, block_max=20.0, kurtosis=10.0,
                      fc2_final=100.0)
            result = json.loads((folder / "eval_best.json").read_text())
            for pipeline, bits in lm_study.COLUMNS + lm_study.ACT_BITS:  # as evaluate.py records each entry
                settings = json.loads(json.dumps(quant_settings(cfg, pipeline), default=str))
                result["quant"].setdefault(pipeline, {})[bits] = {"ppl": 4.5, "settings": settings}
            # as evaluate.py records it (without, the report notes the seeds it cannot tell)
            result["train_seed"] = seed
            (folder / "eval_best.json").write_text(json.dumps(result))
    written = lm_study.tables(dose_report.by_point(dose_report.read_sweep(str(tmp_path))))

    def skeleton(text: str) -> list[str]:
        """The lines, a table row's cells reduced to its point and each cell's marks."""
        return [" | ".join([cells[0]] + [re.sub(r"[^*†‡]", "", c) for c in cells[1:]])
                if (cells := line.strip("| ").split(" | ")) and line.startswith("| ") and line[2:7] != "Point" else line
                for line in text.split("\n\nTraining settings of each point")[0].splitlines()]

    assert skeleton(committed) == skeleton(written)


def test_the_extending_guide_names_the_method_cd_reads_for_the_input_of_a_model_of_ones_own():
    """A model class of one's own trained by train.py gets CD only if CD can tell its input (train.py passes no
    example_input= and no verify=False): docs/extending.md's construction step names the method that does it, and
    a model without timm's or torchvision's size attributes that defines it (returning a meta batch) gets its pairs
    checked, where the same model without it is refused."""
    import torch
    import torch.nn as nn
    from timm.models.vision_transformer import Block

    from cd import UnsupportedModelError, find_pairs

    with open(os.path.join(ROOT, "docs", "extending.md"), encoding="utf-8") as f:
        text = f.read()
    section = text[text.index("## A model family or a block layout"):]
    construction = section[:section.index("\n2. ")]
    methods = re.findall(r"`(\w+)\(\)` method", construction)
    assert methods, "docs/extending.md's construction step names no method of the model for CD's input"

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(16, 32)
            self.blocks = nn.Sequential(Block(32, 4), Block(32, 4))
            self.head = nn.Linear(32, 10)

        def forward(self, x):
            return self.head(self.blocks(self.embed(x)).mean(1))

    with pytest.raises(UnsupportedModelError, match="cannot tell the input size"):
        find_pairs(Net())
    for name in methods:
        model = type("Documented", (Net,), {name: lambda self: torch.zeros(1, 8, 16, device="meta")})()
        assert find_pairs(model), name


def defined_names(path: str) -> set[str]:
    """The functions, classes and assigned names of a Python file, at any depth (methods and class fields too)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for target in targets for t in ast.walk(target) if isinstance(t, ast.Name)}
    return names


def test_every_name_the_extending_guide_places_in_a_file_is_defined_there():
    """docs/extending.md tells a fork where each addition goes as "`file.py`'s `NAME`" (`quant/plan.py`'s
    `DEFAULT_PIPELINES`): a name renamed or moved in the code leaves the guide pointing at nothing."""
    with open(os.path.join(ROOT, "docs", "extending.md"), encoding="utf-8") as f:
        text = " ".join(f.read().split())
    placed = re.findall(r"`([\w/]+\.py)`'s `(\w+)`", text)
    assert len(placed) >= 10, placed
    missing = [(file, name) for file, name in placed if name not in defined_names(os.path.join(ROOT, file))]
    assert not missing, f"docs/extending.md names these, which their files do not define: {missing}"


def measurement_table(heading: str) -> list[list[str]]:
    """The cells of the rows of docs/measurements.md's table under `## heading` (date, commit, hardware, command,
    figure), in the file's order (newest on top)."""
    with open(os.path.join(ROOT, "docs", "measurements.md"), encoding="utf-8") as f:
        text = f.read()
    section = text[text.index(f"## {heading}\n"):].split("\n## ")[0]
    return [[c.strip() for c in line.split("|")[1:-1]] for line in section.splitlines()
            if line.startswith("| 20") or line.startswith("| undated")]


def test_the_readme_quotes_the_latest_demo_timing_of_each_cpu_kind():
    """The README's demo timings are, for each CPU kind of docs/measurements.md's demo rows, the newest row that
    timed the README's first command, with that row's figure."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = " ".join(f.read().split())
    timed = re.compile(r"(\d+ min \d+ s) with the install")
    latest = {}
    for row in measurement_table("Demo and test suite"):
        kind = re.search(r"(AMD EPYC|Intel Xeon)", row[2])
        if kind and timed.search(row[4]) and "README first command" in row[4]:
            latest.setdefault(kind.group(1), (row[1], timed.search(row[4]).group(1)))
    assert set(latest) == {"AMD EPYC", "Intel Xeon"}, latest
    quoted = dict((kind, (commit, took)) for took, kind, commit in
                  re.findall(r"took (\d+ min \d+ s) on a 2-core (AMD EPYC|Intel Xeon) VM at ([0-9a-f]{7})", readme)
                  + re.findall(r"and (\d+ min \d+ s) on a 2-core (AMD EPYC|Intel Xeon) VM at ([0-9a-f]{7})", readme))
    assert quoted == latest


def test_the_digits_quantization_table_has_the_figures_of_the_rows_it_names():
    """quant/README.md's digits table: percentile, repq and gplq (defaults) are the 673a7f7 row's figures at that
    commit (the current quantile code), aphq and gplq at lr 1e-4 the 0ac52a9 row's."""
    rows = {row[1].split()[0]: row for row in measurement_table("Quantization")}
    current = {model: [float(v) for v in figures.split(" / ")] for model, figures in
               re.findall(r"(ViT|Swin) (\d+\.\d+ / \d+\.\d+ / \d+\.\d+) \(", rows["673a7f7"][4])}
    numpy = {model: [float(v) for v in figures.split(" / ")] for model, figures in
             re.findall(r"(ViT|Swin) ((?:\d+\.\d+ / ){4}\d+\.\d+)", rows["0ac52a9"][4])}
    with open(os.path.join(ROOT, "quant", "README.md"), encoding="utf-8") as f:
        text = f.read()
    section = text[text.index("## Measured on digits (CPU), W4A4"):].split("\n## ")[0]
    table = {line.split("|")[1].strip().split("_")[0]: [float(c.split()[0]) for c in line.split("|")[2:-1]]
             for line in section.splitlines() if line.startswith("| vit_micro") or line.startswith("| swin_micro")}
    for model, key in (("vit", "ViT"), ("swin", "Swin")):
        percentile, repq, aphq, gplq, gplq_lr = table[model]
        assert [percentile, repq, gplq] == current[key], (model, table[model], current[key])
        assert [aphq, gplq_lr] == [numpy[key][2], numpy[key][4]], (model, table[model], numpy[key])


# the last line: the machines the code was developed on (a remote runner's calls of limited minutes), not a user's
HISTORY = re.compile(r"since commit|before commit|those commits|(?:this|earlier|previous) session|this task|\blent\b"
                     r"|no longer reproduces?|this version's|\bsince [0-9a-f]{7}\b"
                     r"|remote runner|the runner's|\bone-call\b|-minute call\b", re.I)


@pytest.mark.parametrize("path", MARKDOWN)
def test_the_prose_describes_the_software_not_how_it_was_developed(path):
    """The documents say what the code does and which code a figure was computed with (a measurements row's
    commit); a sentence about the order of development ("since commit X it does Y", "those commits") is not
    kept in the prose. Table rows (a row records its commit) are not read."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        lines = [line for line in FENCE.sub("", f.read()).splitlines() if not line.startswith("|")]
    found = [line for line in lines if HISTORY.search(line)]
    assert not found, found


NUMBER_WORDS = {w: i for i, w in enumerate("zero one two three four five six seven eight nine ten".split())}


def test_a_count_of_the_quantization_pipelines_is_the_number_registered():
    """"all N quantization pipelines" in a document is every pipeline of quant/registry.py's PIPELINES: a count
    written when there were fewer (docs/attention_sinks.md said four of eight) tells a user the others do not run."""
    from quant import PIPELINES

    wrong = []
    for path in MARKDOWN:
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            text = " ".join(f.read().split())
        for m in re.finditer(r"\b(\w+) quantization pipelines\b", text, re.I):
            if m.group(1).lower() in NUMBER_WORDS and NUMBER_WORDS[m.group(1).lower()] != len(PIPELINES):
                wrong.append((path, m.group(0)))
    assert not wrong, f"{wrong}: PIPELINES has {len(PIPELINES)}"

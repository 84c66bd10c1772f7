"""A script's --help says what each of its options takes and, where an option has a default,
what the default is: the help text of every argument is there, and names its default value."""
import argparse
import glob
import os

import pytest

from tests.conftest import ROOT, run_entry


def parsers_of(path: str, command: list[str], monkeypatch, capsys) -> list[argparse.ArgumentParser]:
    """The parsers `python path *command --help` reads its command line with (recorded as they parse), after
    checking that it prints the help and exits 0."""
    seen = []
    parse = argparse.ArgumentParser.parse_known_args

    def recording(self, *args, **kwargs):
        seen.append(self)
        return parse(self, *args, **kwargs)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", recording)
    code, out, _ = run_entry(path, [*command, "--help"], capsys)
    assert code == 0 and out.startswith("usage: "), out
    return seen


def thin_helps(parser: argparse.ArgumentParser) -> list[str]:
    """The arguments of `parser` whose help is missing, or does not name the default they take when not given."""
    thin = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        name = "/".join(action.option_strings) or action.dest
        text = (action.help or "") % {**vars(action), "prog": parser.prog}
        if not text.strip():
            thin.append(f"{name}: no help")
        elif action.default not in (None, False, "", [], argparse.SUPPRESS) and not action.required and \
                str(action.default) not in text and "default" not in text:
            thin.append(f"{name}: its default {action.default!r} is not in its help")
    return thin


# the scripts with a command line: the others are libraries of these, which refuse to run (their own test)
SCRIPTS = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "scripts", "*.py"))
                 if os.path.basename(p) not in ("bench_env.py", "launchers.py", "overhead_run_folders.py",
                                                 "readme_tables.py", "training_title.py"))


# mechanism.py's --help is its overview; each subcommand's --help lists the options
COMMAND_LINES = [(path, []) for path in SCRIPTS if path != "scripts/mechanism.py"] + \
    [("scripts/mechanism.py", [command]) for command in ("surrogate", "alignment", "remove", "energies")]


@pytest.mark.parametrize("path, command", COMMAND_LINES)
def test_every_option_says_what_it_takes_and_its_default(path, command, monkeypatch, capsys):
    parsers = parsers_of(path, command, monkeypatch, capsys)
    assert parsers
    thin = [item for parser in parsers for item in thin_helps(parser)]
    assert not thin, thin

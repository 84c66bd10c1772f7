"""Every `evaluate.py --<option>` that the code's comments and docstrings, the Markdown and the config comments
name is an option evaluate.py's parser has: a reader looking up where seeds are averaged was sent to
`evaluate.py --over-seeds`, which is scripts/paper_table.py's option. test_docs.py parses the commands of code
blocks and inline code; this reads every mention, prose and comments included."""
import os
import re

import evaluate
from tests.conftest import ROOT
from tests.test_docs import repository_files

MENTION = re.compile(r"\bevaluate\.py`?\s+(--[a-z][\w-]*)")


def mentions() -> list[tuple[str, int, str]]:
    """(file, line, option) of every `evaluate.py --option` in the repository's code, Markdown and YAML (the tests
    name refused options on purpose)."""
    found = []
    for pattern in ("*.py", "*.md", "*.yaml"):
        for path in repository_files(ROOT, pattern):
            if path.split("/")[0] == "tests":
                continue
            with open(os.path.join(ROOT, path), encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    found += [(path, number, m.group(1)) for m in MENTION.finditer(line)]
    return found


def test_every_evaluate_py_option_named_is_one_it_has():
    options = set(evaluate.build_parser()._option_string_actions)
    named = mentions()
    assert any(option == "--checkpoint" for _, _, option in named)  # the mentions are found
    unknown = [f"{path}:{number}: {option}" for path, number, option in named if option not in options]
    assert not unknown, unknown

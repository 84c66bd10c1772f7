"""No module of the repository defines one top-level name twice: Python keeps the last definition, so a test (or
a helper, or a function of the package) written twice under one name exists once, and an edited first copy would
never run at all."""
import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def redefined_names(source: str) -> list:
    """Top-level functions and classes defined more than once in `source` (a module's text)."""
    tree = ast.parse(source)
    names = Counter(node.name for node in tree.body
                    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))
    return sorted(name for name, count in names.items() if count > 1)


def test_the_check_sees_a_test_defined_twice():
    twice = "def test_a():\n    assert 1\n\n\nclass _Helper:\n    pass\n\n\ndef test_a():\n    assert 2\n"
    assert redefined_names(twice) == ["test_a"]
    assert redefined_names("def test_a():\n    pass\n\n\ndef test_b():\n    pass\n") == []


def test_no_module_defines_a_name_twice():
    modules = [path for path in sorted(ROOT.rglob("*.py"))
               if not any(part.startswith(".") for part in path.relative_to(ROOT).parts)]  # .venv, .venv-ci, .git
    assert len(modules) > 100 and ROOT / "tests" / "test_module_names.py" in modules
    found = {str(path.relative_to(ROOT)): redefined_names(path.read_text()) for path in modules}
    assert {name: twice for name, twice in found.items() if twice} == {}

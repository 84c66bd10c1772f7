"""DESIGN.md's one-way dependencies, read from the import statements of the repository's own files.

configs/ imports no other package of the project; models/ knows nothing of cd/ or quant/; cd/ and quant/ never
import data/ or the entry points (train.py, evaluate.py, evaluate_detection.py, scripts/). `cd/` installing on its
own (torch alone) is tests/test_cd_package.py's.
"""
import ast
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENTRY_POINTS = {"train", "evaluate", "evaluate_detection", "scripts"}


def absolute_imports(path: Path) -> set[str]:
    """The top-level names a file imports absolutely (a relative import stays inside its package)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def package_files(package: str) -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "-z", f"{package}/*.py"], cwd=ROOT, check=True,
                            capture_output=True).stdout
    return [ROOT / name for name in filter(None, listed.decode().split("\0"))]


@pytest.mark.parametrize("package, forbidden", [
    ("configs", {"cd", "models", "data", "quant", "engine"} | ENTRY_POINTS),
    ("models", {"cd", "quant"}),
    ("cd", {"data"} | ENTRY_POINTS),
    ("quant", {"data"} | ENTRY_POINTS),
])
def test_packages_import_only_in_the_designed_direction(package, forbidden):
    files = package_files(package)
    assert files, package  # the listing found the package's files
    wrong = {str(p.relative_to(ROOT)): sorted(absolute_imports(p) & forbidden) for p in files}
    assert {k: v for k, v in wrong.items() if v} == {}


def test_absolute_imports_reads_both_import_forms(tmp_path):
    """The reader the test above relies on: both statement forms, dotted names, relative imports left out."""
    f = tmp_path / "m.py"
    f.write_text("import cd.wrappers\nfrom quant.layers import X\nfrom . import data\nfrom .cd import y\n"
                 "def f():\n    import train\n")
    assert absolute_imports(f) == {"cd", "quant", "train"}

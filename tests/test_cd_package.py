"""The installable method: `pip wheel .` holds the `cd` package only, and `cd` runs on torch alone.

The wheel is built from a copy of the tracked files (setuptools writes build/ and *.egg-info into the
source tree), without build isolation so that no download is needed (setuptools comes with the venv).
"""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _build_wheel(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout
    for rel in filter(None, tracked.decode().split("\0")):
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_bytes((ROOT / rel).read_bytes())
    # An untracked module of cd/ not yet committed still belongs to the package under test.
    for f in (ROOT / "cd").glob("*.py"):
        (src / "cd" / f.name).write_bytes(f.read_bytes())
    out = tmp_path / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out)], check=True, capture_output=True)
    (wheel,) = out.glob("*.whl")
    return wheel


@pytest.mark.slow  # builds the wheel
def test_wheel_holds_only_cd_and_declares_torch(tmp_path):
    wheel = _build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        z.extractall(tmp_path / "site")
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"cd"}, names
    assert {"cd/__init__.py", "cd/pairs.py", "cd/update.py", "cd/decay.py", "cd/wrappers.py"} <= set(names)
    requires = [line for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    assert any(r.startswith("Requires-Dist: torch") for r in requires), requires
    assert all("extra ==" in r for r in requires if "timm" in r), requires  # timm is an optional extra
    assert "cd/integrations/hf.py" in names and "cd/integrations/mmengine.py" in names
    for framework in ("transformers", "lightning", "mmengine"):  # optional extras too (pip install .[hf], ...)
        assert all("extra ==" in r for r in requires if framework in r) and any(framework in r for r in requires)

    # The installed package alone (repository not on sys.path) finds pairs and steps an optimizer,
    # importing none of the repository's packages.
    code = (
        "import sys, timm, torch\n"
        "from cd import ColinearityDecay\n"
        "m = timm.create_model('vit_tiny_patch16_224', img_size=32, patch_size=8, embed_dim=32, depth=2,"
        " num_heads=2, num_classes=3)\n"
        "opt = torch.optim.AdamW(m.parameters(), lr=1e-3)\n"
        "cd = ColinearityDecay(m, lam=0.005); cd.attach(opt)\n"
        "m(torch.randn(2, 3, 32, 32)).sum().backward(); opt.step()\n"
        "assert cd.num_updates == 1 and len(cd.pairs) == 8\n"
        "bad = sorted({'models', 'data', 'engine', 'configs', 'quant', 'transformers', 'lightning', 'mmengine'}"
        " & set(sys.modules))\n"
        "assert not bad, bad\n"
        "assert sys.modules['cd'].__file__.startswith(sys.argv[1]), sys.modules['cd'].__file__\n"
    )
    site = str(tmp_path / "site")
    subprocess.run([sys.executable, "-c", code, site], cwd=tmp_path, check=True,
                   env={"PYTHONPATH": site, "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})

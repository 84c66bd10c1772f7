"""What docs/mini_reproduction.md ("On a GPU") and configs/sweeps/fashion_mnist_gpu.yaml tell a GPU machine to run
works as written: the one-call gpu_check command (in scripts/gpu_check.py's docstring too) names only flags the
script takes, with budgets that fit a 10-minute command, the stated shortest `sched.epochs` is accepted by the
GPU study's configs while the next shorter one is refused, the study's one command reads its kit and writes into
$OUT, and the times stated for scripts/gpu_session.sh are its defaults."""
import os
import re
import shlex
import subprocess

import pytest
import torch

from configs import ConfigError, load_config
from tests.conftest import ROOT, load_script

DOC = os.path.join(ROOT, "docs", "mini_reproduction.md")
SWEEP = os.path.join(ROOT, "configs", "sweeps", "fashion_mnist_gpu.yaml")
GPU_CONFIGS = [os.path.join(ROOT, "configs", "finetune", f) for f in
               ("fashion_mnist_dinov2_s14.yaml", "fashion_mnist_dinov2_s14_gpu.yaml")]
COMMAND_LIMIT_S = 600  # the 10 minutes the doc states


def read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def one_call(text: str) -> list[str]:
    """The words of the documented one-call command: from `nvidia-smi` to the end of its continued lines."""
    start = text.index("nvidia-smi -L;")
    lines = []
    for line in text[start:].splitlines():
        lines.append(line.rstrip().removesuffix("\\"))
        if not line.rstrip().endswith("\\"):
            break
    return shlex.split(" ".join(lines), posix=True)


@pytest.mark.parametrize("where", ["docs/mini_reproduction.md", "scripts/gpu_check.py"])
def test_the_one_call_gpu_check_takes_its_flags_and_fits_the_command_limit(where, monkeypatch, capsys):
    gpu_check = load_script("gpu_check")
    words = one_call(read(DOC) if where.endswith(".md") else gpu_check.__doc__)  # the docstring as printed
    assert words[:2] == ["nvidia-smi", "-L;"] and "python3" in words and "python" not in words
    argv = words[words.index("scripts/gpu_check.py") + 1:]
    out = argv[argv.index("--out") + 1]
    assert out.startswith("$OUT/"), out  # written into the folder the user keeps, not into the repository
    total = float(argv[argv.index("--total-budget") + 1])
    budgets = [float(argv[i + 1].split("=")[1]) for i, w in enumerate(argv) if w == "--budget"]
    assert sum(budgets) <= total <= COMMAND_LIMIT_S - 30, (budgets, total)  # 30 s: start-up, nvidia-smi, imports
    # the script's own parser and budget checks accept the flags: it stops only where it finds no GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as stop:
        gpu_check.main(argv)
    assert stop.value.code == 2 and "no CUDA device visible" in capsys.readouterr().err
    prose = " ".join(read(DOC).split())
    stated = re.search(r"at most\s+(\d+) s of stages \(the budgets below add up to (\d+) s\)", prose)
    assert stated and (float(stated[1]), float(stated[2])) == (total, sum(budgets)), stated


def test_the_stated_shortest_schedule_is_accepted_and_a_shorter_one_refused():
    stated = set()
    for text in (read(DOC), read(SWEEP)):
        text = " ".join(text.replace("`", "").replace("#", "").split())
        stated.add(int(re.search(r"sched\.epochs=N,? (?:with )?N >= (\d+)", text)[1]))
    (shortest,) = stated
    load_config(GPU_CONFIGS, [f"sched.epochs={shortest}"])
    with pytest.raises(ConfigError, match="is not shorter than sched.epochs"):
        load_config(GPU_CONFIGS, [f"sched.epochs={shortest - 1}"])
    load_config(GPU_CONFIGS, ["sched.epochs=1", "sched.warmup_epochs=0.2"])  # the doc's way to one epoch


def test_the_offline_study_reads_its_kit_and_writes_into_out():
    """The study's one command on a machine whose runs/ is lost: kit/ is git-ignored, so the doc says to copy it
    beside the checkout; the runs read the kit, and the report and the runs' archive are written under $OUT."""
    text = read(DOC)
    prose = " ".join(text.split())
    assert subprocess.run(["git", "check-ignore", "-q", "kit/fashion_mnist"], cwd=ROOT).returncode == 0
    assert "`kit/` is git-ignored: copy it to the GPU machine beside the checkout" in prose
    start = text.index("python3 scripts/sweep.py configs/sweeps/fashion_mnist_gpu.yaml")
    words = [w.rstrip(";") for w in shlex.split(text[start:text.index("```", start)].replace("\\\n", " "))]
    assert {"data.root=kit/fashion_mnist", "model.pretrained=kit/dinov2_s14_half.safetensors"} <= set(words)
    written = [words[i + 1] for i, w in enumerate(words) if w == "--out"] + [words[words.index("czf") + 1]]
    assert len(written) == 2 and all(w.startswith("$OUT/") for w in written), written


def test_the_session_script_times_the_doc_states_are_its_defaults():
    """docs/mini_reproduction.md states scripts/gpu_session.sh's limit, its study's deadline and its figure and
    pytest budgets; each is read from the script, so a changed default fails here until the doc follows."""
    script = read(os.path.join(ROOT, "scripts", "gpu_session.sh"))
    limit = int(re.search(r"^LIMIT=\$\{LIMIT:-(\d+)\}", script, re.M)[1])  # not SMOKE's
    margin = int(re.search(r"END_MARGIN=\$\{END_MARGIN:-(\d+)\}", script)[1])
    figures = re.search(r"FIGURES=\(--total-budget (\d+) --budget precision=(\d+) --budget overhead=(\d+) "
                        r"--budget quant=(\d+) --budget aphq_unit=(\d+)\)", script)
    pytest_budget = int(re.search(r"PYTEST=\(--total-budget (\d+) --budget pytest=\1\)", script)[1])
    prose = " ".join(read(DOC).split())
    assert f"in one command sized to end within {limit} s (`LIMIT`)" in prose
    assert f"before the study's deadline ({limit - margin} s after the start)" in prose
    stages = " + ".join(figures.groups()[1:])
    assert f"(below; budgets {stages} s, at most {figures[1]} s)" in prose, stages
    assert f"then its pytest stage (at most {pytest_budget} s)" in prose
    measurements = " ".join(read(os.path.join(ROOT, "docs", "measurements.md")).split())
    assert f"in one command sized to end within {limit} s" in measurements
    # a config's comment names the script's setting, not its figure: a number of seconds there is a measurement's
    # (test_doc_figures), which a limit is not
    assert "in one command sized to end within its LIMIT" in " ".join(read(SWEEP).replace("#", "").split())

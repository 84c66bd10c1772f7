"""scripts/bench_overhead.py refuses a --widths value that its heads (head dim 64) do not divide with one `error:`
line before any timing, by bench_quant.py's rule: it was timm's AssertionError traceback when the model was built,
in the step protocol only after the whole batch sweep had run, and nothing was written."""
from __future__ import annotations

import cd_models  # noqa: F401  (one torch thread)
import pytest
from timm.models.vision_transformer import Attention

from tests.conftest import load_script


def timm_builds(width: int) -> bool:
    """Whether timm's ViT attention takes `width` with the benchmarks' heads: head dim 64, at least one head (the
    reference the rule is checked against is timm itself)."""
    try:
        Attention(width, num_heads=max(1, width // 64))
    except AssertionError:
        return False
    return True


def test_the_rule_refuses_exactly_the_widths_timm_cannot_build():
    import bench_quant

    refused = {w for w in range(1, 320) if bench_quant.undivided_heads("--widths", w)}
    assert refused == {w for w in range(1, 320) if not timm_builds(w)}
    assert {129, 200, 319} <= refused and not {64, 96, 127, 192, 256} & refused


@pytest.mark.parametrize("argv", [
    ["--batches", "2", "--widths", "200", "--width-batch", "2"],  # the reviewer's: after the batch sweep
    ["--apply-only", "--widths", "64", "200"],                    # after the first width's timing
])
def test_an_undivided_width_is_one_error_line_before_any_timing(argv, tmp_path, capsys, monkeypatch):
    bench = load_script("bench_overhead")
    monkeypatch.setattr(bench, "Runner", lambda *a, **k: pytest.fail("a step was timed"))
    monkeypatch.setattr(bench, "measure_apply", lambda *a, **k: pytest.fail("apply was timed"))
    with pytest.raises(SystemExit) as refused:
        bench.main(["--device", "cpu", "--small", "--steps", "1", "--warmup", "0", *argv, "--out", str(tmp_path)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert refused.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    assert "--widths 200: its 3 heads (dim // 64) do not divide it; give a multiple of 64" in lines[0], lines
    assert not list(tmp_path.iterdir())

"""scripts/quant_sensitivity.py into an --out that holds a variant's JSON of other weights (an earlier run with
another --checkpoint, or the same checkpoint file trained again) is refused before the first evaluation, with this
command's fixes: its --out is a folder whose file names the command sets, so evaluate.py's refusal, reached after
the variants before it ran, said "give --out another file". The earlier JSON is written by evaluate.py itself;
evaluate.main then stands in for the variants' evaluations (the checks are what is tested)."""
import json
import shutil

import pytest

import evaluate
from engine.eval_results import ResultsError
from tests.conftest import DEBUG_CONFIG, load_script, run_entry

EVALUATE = evaluate.main  # the real one, for the earlier JSON: `evaluations` stands in for it in the command


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """best.pt of two configs/debug/tiny.yaml runs of other seeds: two sets of weights of one model."""
    import train
    from configs import load_config

    paths = []
    for seed in (0, 1):
        out = tmp_path_factory.mktemp(f"tiny_s{seed}")
        train.main(load_config([DEBUG_CONFIG], [f"out_dir={out}", "train.max_steps=1", f"train.seed={seed}",
                                                "log.tensorboard=false"]))
        paths.append(str(out / "best.pt"))
    return paths


def official_of(checkpoint: str, out) -> dict:
    """official.json in `out` as evaluate.py writes it for the variant 'official' (percentile alone, for speed)."""
    out.mkdir(exist_ok=True)
    EVALUATE(evaluate.parse_args(["--checkpoint", checkpoint, "--out", str(out / "official.json"), "--bits", "w4a4",
                                  "--quant", "percentile"]))
    return json.loads((out / "official.json").read_text())


def test_a_variant_json_of_another_checkpoint_is_refused_before_any_evaluation(two_checkpoints, tmp_path,
                                                                               evaluations, capsys):
    first, second = two_checkpoints
    out = tmp_path / "sens"
    earlier = official_of(first, out)
    capsys.readouterr()  # evaluate.py's log of it
    code, printed, _ = run_entry("scripts/quant_sensitivity.py", ["--checkpoint", second, "--out", str(out)], capsys)
    path = out / "official.json"
    assert isinstance(code, str) and "\n" not in code and not printed and evaluations == [], (code, evaluations)
    assert code.startswith(f"error: {path} holds results of another evaluation (checkpoint: {first!r} in the file, "
                           f"{second!r} now; fingerprint: {earlier['fingerprint']!r} in the file, "), code
    assert code.endswith(f"by an earlier run of this command into --out {out}: give --out another folder, or move "
                         f"{path} away"), code
    assert "another file" not in code and json.loads(path.read_text()) == earlier


def test_a_checkpoint_trained_again_at_the_same_path_is_refused_by_its_fingerprint(two_checkpoints, tmp_path,
                                                                                   evaluations):
    run = tmp_path / "run"
    run.mkdir()
    checkpoint = str(run / "best.pt")
    shutil.copy(two_checkpoints[0], checkpoint)
    out = tmp_path / "sens"
    earlier = official_of(checkpoint, out)["fingerprint"]
    shutil.copy(two_checkpoints[1], checkpoint)  # the run trained again into the same folder
    with pytest.raises(ResultsError, match=rf"holds results of another evaluation \(fingerprint: '{earlier}' in the "
                                           r"file, '[0-9a-f]{16}' now\) .*give --out another folder"):
        load_script("quant_sensitivity").main(["--checkpoint", checkpoint, "--out", str(out)])
    assert evaluations == []


def test_a_variant_json_of_the_same_weights_is_continued(two_checkpoints, tmp_path, evaluations):
    out = tmp_path / "sens"
    official_of(two_checkpoints[0], out)
    load_script("quant_sensitivity").main(["--checkpoint", two_checkpoints[0], "--out", str(out)])
    assert evaluations[0] == "official.json"

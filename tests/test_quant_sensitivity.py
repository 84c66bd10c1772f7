"""scripts/quant_sensitivity.py checks every variant's evaluate.py command before the first evaluation: a variant
whose own setting the checkpoint cannot take is skipped and said to be, and a variant's JSON in --out computed with
other settings is refused with this command's fixes. evaluate.main stands in (a top-1 per file and pipeline): the
checks are what is tested, the variants' evaluations are tests/test_evaluate.py's."""
import json

import pytest

import evaluate
from engine.eval_results import ResultsError
from engine.quant_settings import quant_settings
from tests.conftest import load_script, run_entry


@pytest.fixture(scope="module")
def synthetic_checkpoint(tmp_path_factory):
    """best.pt of configs/debug/tiny.yaml: a vit_nano on synthetic images, which no transform prepares."""
    import train
    from configs import load_config
    from tests.conftest import DEBUG_CONFIG

    out = tmp_path_factory.mktemp("tiny")
    train.main(load_config([DEBUG_CONFIG], [f"out_dir={out}", "train.max_steps=1", "log.tensorboard=false"]))
    return str(out / "best.pt")


def test_a_variant_the_checkpoint_cannot_take_is_skipped_before_any_evaluation(synthetic_checkpoint, tmp_path,
                                                                               evaluations, capsys):
    """calib=train adds quant.calib_transform=train itself, which evaluate.py refuses for synthetic images (no
    transform prepares them): the command died after computing the variants before it, naming a setting the user
    never gave. The variant list is the command's, not the user's: it is skipped, with a line saying so, and
    recorded in the summary; the others run. So is 'gplq stage2 eval' (quant.gplq.stage2_train_transform=false),
    refused for synthetic images alike."""
    sens = load_script("quant_sensitivity")
    out = tmp_path / "sens"
    out.mkdir()  # evaluate.py, which stands in here, makes it
    table = sens.main(["--checkpoint", synthetic_checkpoint, "--out", str(out)])
    assert "calib-train.json" not in evaluations and "official.json" in evaluations and "calib=train" not in table
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
    assert warnings and warnings[0].startswith(f"warning: variant 'calib=train' skipped: evaluate.py refuses its "
                                               f"quant.calib_transform=train for {synthetic_checkpoint} ("), warnings
    assert "would be ignored" in warnings[0]
    summary = json.loads((out / "sensitivity_w4a4.json").read_text())
    assert set(summary["skipped"]) == {"calib=train", "gplq stage2 eval"} and summary["top1"] == table
    assert "gplq_stage2_eval.json" not in evaluations and "gplq stage2 eval" not in table
    assert any(line.startswith("warning: variant 'gplq stage2 eval' skipped: evaluate.py refuses its "
                               "quant.gplq.stage2_train_transform=false") for line in warnings), warnings


def test_a_variant_computed_with_other_settings_in_out_is_refused_with_this_commands_fix(synthetic_checkpoint,
                                                                                        tmp_path, evaluations,
                                                                                        capsys):
    """An earlier run into the same --out with quant.calib_images=8 left official.json of those settings: the
    refusal offered evaluate.py's fixes, '--recompute' (which this command has not) and 'give --out another file'
    (its --out is a folder). Refused before the first evaluation, naming the file and this command's fixes."""
    out = tmp_path / "sens"
    out.mkdir()
    cfg, _ = evaluate.resolve_config(evaluate.parse_args(["--checkpoint", synthetic_checkpoint, "--quant",
                                                          "percentile", "quant.calib_images=8"]))
    earlier = {"quant": {"percentile": {"w4a4": {"top1": 40.0, "settings": quant_settings(cfg, "percentile")}}}}
    (out / "official.json").write_text(json.dumps(earlier))
    code, printed, err = run_entry("scripts/quant_sensitivity.py",
                                   ["--checkpoint", synthetic_checkpoint, "--out", str(out)], capsys)
    assert isinstance(code, str) and "\n" not in code and not printed, (code, err)
    assert code.startswith(f"error: {out / 'official.json'} holds percentile w4a4 of variant 'official' computed "
                           f"with other settings (calibration.images 8 -> 32) by an earlier run of this command into "
                           f"--out {out}: give --out another folder, or move {out / 'official.json'} away"), code
    assert "--recompute" not in code and evaluations == []
    with pytest.raises(ResultsError, match="give --out another folder"):  # as main() raises it
        load_script("quant_sensitivity").main(["--checkpoint", synthetic_checkpoint, "--out", str(out)])
    # the settings it was computed with: the file is the variant's, continued
    load_script("quant_sensitivity").main(["--checkpoint", synthetic_checkpoint, "--out", str(out),
                                           "quant.calib_images=8"])
    assert "official.json" in evaluations


def test_a_bit_width_spelled_otherwise_reads_the_entries_evaluate_names_by_its_parsed_form(synthetic_checkpoint,
                                                                                        tmp_path, monkeypatch):
    """--bits w04a4 is w4a4 to parse_bits, and evaluate.py names its results' entries by the parsed form
    (quant/plan.py): the table was read at the text lowercased, 'w04a4', a KeyError after the first evaluation.
    evaluate.main stands in with its own resolved config's bit-widths (quant.plan.planned) as the entries' names."""
    from quant.plan import planned

    def named_as_evaluate_names_them(args):
        cfg, _ = evaluate.resolve_config(args)
        return {"quant": {p: {bits: {"top1": 50.0}} for p, bits in planned(cfg)}}

    monkeypatch.setattr(evaluate, "main", named_as_evaluate_names_them)
    out = tmp_path / "sens"
    out.mkdir()
    table = load_script("quant_sensitivity").main(["--checkpoint", synthetic_checkpoint, "--out", str(out), "--bits",
                                                   "w04a4"])
    assert table["official"] and all(v == 50.0 for row in table.values() for v in row.values())
    assert json.loads((out / "sensitivity_w4a4.json").read_text())["bits"] == "w4a4"

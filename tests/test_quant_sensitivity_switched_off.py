"""scripts/quant_sensitivity.py gives an extra quant.gplq.* override to every GPLQ run; the `gplq operands float`
variant switches quant.gplq.matmul_operands off, which leaves quant.gplq.matmul_percentile unread, and evaluate.py
refuses that pair. The variant runs without the option (a note line says so), and the other GPLQ variants keep it:
it was skipped as one "evaluate.py refuses its quant.gplq.matmul_operands=false", a refusal of its own setting."""
import pytest

from tests.conftest import load_script

OPTION = "quant.gplq.matmul_percentile=0.999"


@pytest.fixture(scope="module")
def synthetic_checkpoint(tmp_path_factory):
    """best.pt of configs/debug/tiny.yaml (a vit_nano, one update)."""
    import train
    from configs import load_config
    from tests.conftest import DEBUG_CONFIG

    out = tmp_path_factory.mktemp("tiny")
    train.main(load_config([DEBUG_CONFIG], [f"out_dir={out}", "train.max_steps=1", "log.tensorboard=false"]))
    return str(out / "best.pt")


def test_the_variant_that_switches_an_option_off_runs_without_it(synthetic_checkpoint, tmp_path):
    sens = load_script("quant_sensitivity")
    variants, skipped = sens.checked_variants(synthetic_checkpoint, str(tmp_path), [OPTION], "w4a4", False)
    assert "gplq operands float" in variants and "gplq operands float" not in skipped, skipped
    for variant, (pipelines, extra) in variants.items():
        args = sens.variant_args(synthetic_checkpoint, str(tmp_path), [OPTION], "w4a4", variant, pipelines, extra)
        # the variant's own switch: its command has the switch and not the option; every other GPLQ run the option
        expected = "gplq" in pipelines and "quant.gplq.matmul_operands=false" not in extra
        assert (OPTION in args.overrides) == expected, (variant, args.overrides)


def test_main_says_which_variant_runs_without_the_option(synthetic_checkpoint, tmp_path, evaluations, capsys):
    sens = load_script("quant_sensitivity")
    out = tmp_path / "sens"
    out.mkdir()  # evaluate.py, which stands in here, makes it
    table = sens.main(["--checkpoint", synthetic_checkpoint, "--out", str(out), OPTION])
    assert "gplq operands float" in table and "gplq_operands_float.json" in evaluations
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: ")]
    assert notes == [f"note: variant 'gplq operands float' runs without {OPTION}, which its "
                     f"quant.gplq.matmul_operands=false leaves unread"], notes



def test_a_section_override_the_switch_leaves_partly_unread_is_refused_before_any_evaluation(tmp_path):
    """quant.gplq={matmul_percentile: 0.999, steps: 50}: the `gplq operands float` variant reads steps but not
    matmul_percentile, so the override can neither go to it whole (evaluate.py refuses the pair) nor be dropped (the
    variant would run without steps=50); it was kept whole and the variant skipped as a refusal of its own switch.
    Refused (ConfigError: `__main__` prints it as one error line) before any evaluation, naming the key to split off."""
    from configs.loader import ConfigError

    sens = load_script("quant_sensitivity")
    out = tmp_path / "sens"
    with pytest.raises(ConfigError, match=r"'gplq operands float'.*give quant\.gplq\.matmul_percentile as an override"):
        sens.main(["--checkpoint", str(tmp_path / "best.pt"), "--out", str(out),
                   "quant.gplq={matmul_percentile: 0.999, steps: 50}"])
    assert not out.exists()  # nothing evaluated, nothing written
    assert sens.switched_off(["quant.gplq.matmul_percentile=0.999", "quant.gplq.steps=50"],
                             ["quant.gplq.matmul_operands=false"]) == ["quant.gplq.matmul_percentile=0.999"]

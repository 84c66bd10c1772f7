"""scripts/quant_sensitivity.py's command line: a word that is no key=value override (a second bit-width after
--bits) is refused, and the overrides given reach evaluate.py as overrides, never as further bit-widths."""
import pytest

from test_evaluate import load_sensitivity_script


def test_a_second_bit_width_is_refused_before_anything_runs(tmp_path, capsys):
    sens = load_sensitivity_script()
    with pytest.raises(SystemExit) as e:
        sens.main(["--checkpoint", str(tmp_path / "best.pt"), "--out", str(tmp_path / "sens"), "--bits", "w4a4",
                   "w3a3"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ")
    assert "'w3a3' is not a key=value override" in err and "--bits takes one bit-width" in err
    assert not (tmp_path / "sens").exists()



def test_a_bit_width_of_another_form_is_a_usage_error(tmp_path, capsys):
    """`--bits w4` exited 1 with evaluate.py's refusal of quant.bits, a key the user never gave; a value the flag
    refuses is a usage error (status 2) naming the flag, before anything runs."""
    with pytest.raises(SystemExit) as e:
        load_sensitivity_script().main(["--checkpoint", str(tmp_path / "best.pt"), "--out", str(tmp_path / "sens"),
                                        "--bits", "w4"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ")
    assert "--bits w4: bit-width 'w4' is not of the form 'w4a4'" in err
    assert not (tmp_path / "sens").exists()


@pytest.mark.parametrize("overrides", [["quant.gplq.steps=5"], ["w3a3"], ["quant.gplq.steps=5", "w8a8"]])
def test_the_overrides_never_extend_evaluates_bit_widths(tmp_path, overrides):
    """What evaluate.py is given to compute: the one bit-width of --bits and the variant's pipelines, whatever the
    overrides are (its --bits and --quant take every following word without '=')."""
    sens = load_sensitivity_script()
    args = sens.variant_args(str(tmp_path / "best.pt"), str(tmp_path), overrides, "w4a4", "official", ["gplq"], [])
    assert args.bits == ["w4a4"] and args.quant == ["gplq"]
    assert [o for o in args.overrides if o in overrides] == overrides

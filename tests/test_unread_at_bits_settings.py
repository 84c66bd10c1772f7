"""An option a pipeline does not read at an entry's bit-width changes no number of that entry: APHQ's round_zero_point
is read only by the LayerNorm fold, which the official code does only when a_bits == w_bits (utils/wrap_net.py). A
stored W4A8 APHQ entry is then reused whatever round_zero_point it recorded, and results differing only there average
as seeds; at W4A4 another value is other settings."""
import dataclasses

import pytest

from configs.quant import APHQOptions
from engine.eval_results import EvalResults, ResultsError, evaluation_difference

IDENTITY = {"model": "vit_nano"}


def settings(round_zero_point: bool) -> dict:
    """An APHQ entry's settings with every option at its default but round_zero_point."""
    return {"options": dataclasses.asdict(APHQOptions(round_zero_point=round_zero_point))}


def stored(tmp_path, bits: str, round_zero_point: bool) -> EvalResults:
    """A result file holding one APHQ entry at `bits` computed with `round_zero_point`."""
    results = EvalResults.open(str(tmp_path / "r.json"), IDENTITY)
    results.add("aphq", bits, {"top1": 50.0}, settings(round_zero_point))
    results.save()
    return EvalResults.open(str(tmp_path / "r.json"), IDENTITY)


@pytest.mark.parametrize("bits", ["w4a8", "w8a4", "w3a16"])
def test_an_entry_at_unequal_bits_is_reused_whatever_its_round_zero_point(tmp_path, bits):
    results = stored(tmp_path, bits, True)
    assert results.plan("aphq", bits, settings(False), recompute=False) is False


def test_an_entry_at_equal_bits_of_another_round_zero_point_is_refused(tmp_path):
    results = stored(tmp_path, "w4a4", True)
    with pytest.raises(ResultsError, match=r"computed with other settings \(options.round_zero_point True -> False"):
        results.plan("aphq", "w4a4", settings(False), recompute=False)


@pytest.mark.parametrize("bits, alike", [("w4a8", True), ("w4a4", False)])
def test_results_differing_only_in_an_unread_option_are_one_evaluation(bits, alike):
    a, b = ({**IDENTITY, "quant": {"aphq": {bits: {"top1": 50.0, "settings": settings(z)}}}} for z in (True, False))
    difference = evaluation_difference(a, b)
    assert (difference is None) is alike, difference


@pytest.mark.parametrize("bits, marked", [("w4a8", []), ("w8a4", []), ("w4a4", ["quant.aphq.round_zero_point=False"])])
def test_a_table_marks_round_zero_point_only_where_it_is_read(bits, marked):
    """paper_table.py / dose_report.py / evaluate.py's table mark a result computed with non-default settings '*':
    not for an option the entry's bits leave unread (its number is the default's), also through the cell helper."""
    from engine.result_table import entries_nondefault, nondefault_settings
    entry = settings(round_zero_point=False)
    assert nondefault_settings("aphq", entry, bits) == marked
    assert entries_nondefault("aphq", [{"settings": entry}], bits) == marked
    assert nondefault_settings("aphq", entry) == ["quant.aphq.round_zero_point=False"]  # no bits: compared in full

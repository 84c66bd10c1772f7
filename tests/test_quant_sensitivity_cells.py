"""scripts/quant_sensitivity.py's numbers: every cell of the summary JSON and of the printed table is the top-1 of
its own variant, pipeline and bit-width, and the change column is the variant's top-1 minus official's. evaluate.main
stands in with a top-1 that says where it came from, worked out here again for the expected cells."""
import json

import pytest

import evaluate
from tests.conftest import load_script

PIPELINES = ["percentile", "repq", "gplq", "aphq"]  # the table's columns, in order
DECOY = 1000.0  # added to the top-1 written under a bit-width that was not asked for


def file_name(variant: str) -> str:
    """The JSON in --out that the command names for `variant` (scripts/quant_sensitivity.py variant_args)."""
    return variant.replace(" ", "_").replace("=", "-") + ".json"


def change(variant_index: int) -> int:
    """The variant's top-1 minus official's (index 0): odd variants lose points, even ones gain them, so the
    table holds both signs."""
    return -variant_index if variant_index % 2 else variant_index


def top1(pipeline: str, variant_index: int) -> float:
    """The top-1 the stand-in gives `pipeline` in the variant at `variant_index`: the pipeline in the tens, the
    variant in the units, .25 so that no cell is a round number."""
    return 40.25 + 10 * PIPELINES.index(pipeline) + change(variant_index)


@pytest.fixture
def encoded_evaluations(monkeypatch):
    """evaluate.main stands in: top1(pipeline, variant) under the bit-width asked for (args.bits), a decoy under
    the others, so that a cell read at another pipeline, variant or bit-width holds another number."""
    variants = load_script("quant_sensitivity").VARIANTS
    index = {file_name(v): i for i, v in enumerate(variants)}

    def stand_in(args):
        i = index[args.out.rsplit("/", 1)[-1]]
        names = {*args.bits, "w4a4", "w3a3", "w8a8"}
        return {"quant": {p: {b: {"top1": top1(p, i) + (0 if b == args.bits[0] else DECOY)} for b in names}
                          for p in args.quant}}

    monkeypatch.setattr(evaluate, "main", stand_in)
    return variants


def printed_cells(stdout: str, bits: str) -> dict:
    """{variant: {column: cell text}} of the markdown table printed, its header checked."""
    lines = [line for line in stdout.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == [f"variant ({bits})", *PIPELINES], header
    rows = {}
    for line in lines[2:]:
        variant, *cells = [c.strip() for c in line.strip("|").split("|")]
        rows[variant] = dict(zip(PIPELINES, cells, strict=True))
    return rows


@pytest.mark.parametrize("bits", ["w4a4", "w3a3"])
def test_every_cell_is_its_variants_pipelines_top1_and_change(encoded_evaluations, tmp_path, capsys, bits):
    """A checkpoint path with no file leaves its checks to evaluate.py, which stands in: every variant runs.
    APHQ runs in official and first_last=w8a8 only (--with-aphq); the other cells of its column are empty."""
    out = tmp_path / "sens"
    out.mkdir()  # evaluate.py, which stands in here, makes it
    load_script("quant_sensitivity").main(["--checkpoint", str(tmp_path / "best.pt"), "--out", str(out),
                                           "--bits", bits, "--with-aphq"])
    expected = {v: {p: top1(p, i) for p in pipelines + (["aphq"] if v in ("official", "first_last=w8a8") else [])}
                for i, (v, (pipelines, _)) in enumerate(encoded_evaluations.items())}
    summary = json.loads((out / f"sensitivity_{bits}.json").read_text())
    assert summary["bits"] == bits and summary["top1"] == expected
    rows = printed_cells(capsys.readouterr().out, bits)
    assert list(rows) == list(expected)
    for i, (variant, row) in enumerate(expected.items()):
        for p in PIPELINES:
            if p not in row:
                cell = ""
            elif variant == "official":
                cell = f"{row[p]:.2f}"
            else:
                cell = f"{row[p]:.2f} ({change(i):+.2f})"
            assert rows[variant][p] == cell, (variant, p)
    # written out: first_last=w8a8 (index 1) is a point worse than official, calib=train (index 2) two better
    assert rows["official"]["repq"] == "50.25"
    assert rows["first_last=w8a8"]["repq"] == "49.25 (-1.00)" and rows["first_last=w8a8"]["aphq"] == "69.25 (-1.00)"
    assert rows["calib=train"]["repq"] == "52.25 (+2.00)" and rows["calib=train"]["gplq"] == ""


def test_a_change_is_the_difference_of_the_figures_printed():
    """1 and 2 of 3 images right: 33.33 official and 66.67 printed, 33.34 apart; the change of the unrounded top-1s,
    33.333..., printed +33.33, was a cell whose arithmetic fails."""
    table = load_script("quant_sensitivity").markdown({"official": {"repq": 100 / 3}, "calib=train": {"repq": 200 / 3}},
                                                      "w4a4")
    official, variant = table.splitlines()[2:]
    assert "| 33.33 |" in official and "| 66.67 (+33.34) |" in variant


def test_overwrite_replaces_only_a_summary_this_script_wrote(encoded_evaluations, tmp_path, monkeypatch):
    """--overwrite replaced any sensitivity_<bits>.json in --out, a fixed name in a folder the user gave: another
    script's JSON of that name was lost. It replaces only its own summary (known by its keys) and refuses any other
    before the first evaluation, with one error naming the file, which stays as it was."""
    from engine.run_dir import RunDirError

    sensitivity = load_script("quant_sensitivity")
    out = tmp_path / "sens"
    out.mkdir()
    argv = ["--checkpoint", str(tmp_path / "best.pt"), "--out", str(out), "--bits", "w4a4"]
    sensitivity.main(argv)
    summary = out / "sensitivity_w4a4.json"
    mine = summary.read_bytes()
    sensitivity.main(argv + ["--overwrite"])  # its own: replaced
    others = b'{"bits": "w4a4", "note": "someone else\'s table"}\n'
    summary.write_bytes(others)
    monkeypatch.setattr(evaluate, "main", lambda args: pytest.fail("evaluated over another's file"))
    with pytest.raises(RunDirError) as refused:
        sensitivity.main(argv + ["--overwrite"])
    message = str(refused.value)
    assert message.startswith(f"{summary} is not a file quant_sensitivity.py wrote") and "\n" not in message
    assert summary.read_bytes() == others
    summary.write_bytes(mine)  # this script's summary again: replaced
    monkeypatch.undo()
    monkeypatch.setattr(evaluate, "main", lambda args: {"quant": {p: {"w4a4": {"top1": 1.0}} for p in args.quant}})
    sensitivity.main(argv + ["--overwrite"])
    assert json.loads(summary.read_text())["top1"]["official"]["percentile"] == 1.0

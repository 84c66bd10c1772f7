"""The family coverage table in cd/README.md is what scripts/cd_families.py generates now, and
`python -m cd --families` prints its CD column."""
from __future__ import annotations

from pathlib import Path

import pytest

from cd.__main__ import main as cd_main
from tests.conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
import readme_tables  # noqa: E402


def _script():
    return load_script("cd_families")


@pytest.mark.slow  # builds every family's tiny model (about 13 s)
def test_readme_table_is_current_and_cli_prints_the_cd_column(capsys):
    script = _script()
    want = script.table()
    got = script.readme_table((ROOT / "cd" / "README.md").read_text())
    assert got == want, "cd/README.md's family table is stale: run python scripts/cd_families.py --write"
    rows = {line.split(" | ")[0].lstrip("| "): line for line in want.splitlines()[2:]}
    # the families the table must state (issue: vit ... convnext), each supported or refused with a reason
    assert {"vit", "deit (distilled)", "deit3", "dinov2", "dinov2 + registers", "swin", "swinv2", "eva02",
            "beit", "cait", "xcit", "SwiGLU ViT (aimv2)", "convnext", "GPT-2 (transformers)",
            "GPT-2, nanoGPT-style (nn.Linear c_attn)", "ViT (transformers)",
            "Llama, multi-head attention (transformers)", "Llama, grouped-query attention (transformers)",
            "Swin (MMDetection)", "ViT (torchvision)", "Swin (torchvision)"} == set(rows)
    # issue 32's families: GPT-2's Conv1D, transformers' ViT, Llama's gated MLP (opt-in), MMDetection's Swin
    assert rows["GPT-2 (transformers)"].split(" | ")[2] == "GPT2Block (x2): qkv, proj, fc1, fc2"
    # the same names on nn.Linear layers, stored (out, in) (was refused: the layout assumed Conv1D's (in, out))
    assert rows["GPT-2, nanoGPT-style (nn.Linear c_attn)"].split(" | ")[2] == "Block (x2): qkv, proj, fc1, fc2"
    assert rows["Llama, multi-head attention (transformers)"].split(" | ")[2].endswith(
        "With cd.gated_mlp=true: LlamaDecoderLayer (x2): qkv x3, proj, fc1 x2, fc2")
    assert "grouped-query attention" in rows["Llama, grouped-query attention (transformers)"]
    assert "num_key_value_heads=num_attention_heads" in rows["Llama, grouped-query attention (transformers)"]
    assert rows["Swin (MMDetection)"].split(" | ")[2] == ("SwinBlock (x4): qkv, proj, fc1, fc2; "
                                                          "PatchMerging (x1): reduction")
    # torchvision's: nn.MultiheadAttention's own in_proj_weight as the fused qkv; Swin's MLP by Sequential index
    assert rows["ViT (torchvision)"].split(" | ")[2] == "EncoderBlock (x2): qkv, proj, fc1, fc2"
    assert rows["Swin (torchvision)"].split(" | ")[2] == ("SwinTransformerBlock (x4): qkv, proj, fc1, fc2; "
                                                          "PatchMerging (x1): reduction")
    assert rows["swinv2"].split(" | ")[2].startswith("refused: ")
    assert rows["vit"].split(" | ")[2:] == ["Block (x2): qkv, proj, fc1, fc2", "supported", "supported",
                                            "supported", "supported |"]
    cd_main(["--families"])
    out = capsys.readouterr().out
    def cd_columns(table: str) -> list:
        return [[c.strip(" |") for c in line.split(" | ")[:3]] for line in table.splitlines()[2:]]
    assert cd_columns(out) == cd_columns(want)


def test_write_replaces_only_the_text_between_the_markers(tmp_path):
    """--write puts the new table between the markers; the document before and after them stays as it was."""
    doc = tmp_path / "README.md"
    doc.write_text("# doc\n<!-- b -->\nold table\n<!-- e -->\n## more\ntext <!-- e --> again\n")
    readme_tables.table_command("x", lambda: "new table", doc, "<!-- b -->", "<!-- e -->", ["--write"])
    assert doc.read_text() == "# doc\n<!-- b -->\nnew table\n<!-- e -->\n## more\ntext <!-- e --> again\n"
    assert readme_tables.marked_table(doc.read_text(), "<!-- b -->", "<!-- e -->") == "new table"


def test_write_into_a_document_without_its_markers_is_one_error_line(tmp_path):
    """readme_tables.table_command --write on a document whose end marker an edit removed: one error line
    and the document as it was (was an IndexError traceback)."""
    doc = tmp_path / "README.md"
    doc.write_text("# doc\n<!-- b -->\nold table\n")
    with pytest.raises(SystemExit, match=r"^error: .*README.md lacks the markers <!-- b --> \.\.\. <!-- e -->"):
        readme_tables.table_command("x", lambda: "new table", doc, "<!-- b -->", "<!-- e -->", ["--write"])
    assert doc.read_text() == "# doc\n<!-- b -->\nold table\n"


def test_write_into_a_document_whose_end_marker_comes_first_is_one_error_line(tmp_path):
    """An end marker only before the begin marker (an edit moved it) is no pair around a table either: one error
    line and the document as it was."""
    doc = tmp_path / "README.md"
    doc.write_text("# doc\n<!-- e -->\n<!-- b -->\nold table\n")
    with pytest.raises(SystemExit, match=r"^error: .*README.md lacks the markers <!-- b --> \.\.\. <!-- e -->"):
        readme_tables.table_command("x", lambda: "new table", doc, "<!-- b -->", "<!-- e -->", ["--write"])
    assert doc.read_text() == "# doc\n<!-- e -->\n<!-- b -->\nold table\n"



def test_write_into_a_document_without_its_begin_marker_is_one_error_line(tmp_path):
    """A document that lost its begin marker (only the end marker left) is named too, and stays as it was."""
    doc = tmp_path / "README.md"
    doc.write_text("# doc\nold table\n<!-- e -->\n")
    with pytest.raises(SystemExit, match=r"^error: .*README.md lacks the markers <!-- b --> \.\.\. <!-- e -->"):
        readme_tables.table_command("x", lambda: "new table", doc, "<!-- b -->", "<!-- e -->", ["--write"])
    assert doc.read_text() == "# doc\nold table\n<!-- e -->\n"


@pytest.mark.parametrize("threads, want", [(None, 1), ("3", 3)])
def test_the_table_is_measured_with_the_threads_omp_num_threads_gives(monkeypatch, threads, want):
    """The tables' figures are measured with OMP_NUM_THREADS threads, one when it is unset: torch's thread
    count while the table is made."""
    import torch
    if threads is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", threads)
    seen = []
    before = torch.get_num_threads()
    try:
        readme_tables.table_command("x", lambda: seen.append(torch.get_num_threads()) or "table",
                                    Path("README.md"), "<!-- b -->", "<!-- e -->", [])
    finally:
        torch.set_num_threads(before)
    assert seen == [want]

@pytest.mark.parametrize("threads", ["4,2", "0", ""])
def test_a_thread_count_torch_cannot_take_is_one_error_line(monkeypatch, threads):
    """OMP_NUM_THREADS=4,2 (an OpenMP list), 0 or empty was a ValueError traceback from int()."""
    monkeypatch.setenv("OMP_NUM_THREADS", threads)
    with pytest.raises(SystemExit, match=rf"^error: OMP_NUM_THREADS='{threads}': give one positive number"):
        readme_tables.table_command("x", lambda: "table", Path("README.md"), "<!-- b -->", "<!-- e -->", [])


def test_a_missing_library_is_named_in_its_row_and_every_extra_column_reads_not_run(monkeypatch):
    """cd.families.family_table: a family whose library is not installed keeps its row (the library named, "not
    run" in each extra column); an extra column's "|" cannot split a row. Written out here for two families."""
    from cd import families

    def missing():
        raise ImportError("No module named 'somelib'", name="somelib")

    monkeypatch.setattr(families, "FAMILIES", {"vit": families.FAMILIES["vit"]})
    monkeypatch.setattr(families, "OTHER_FAMILIES", {"Other (somelib)": ("somelib `Model`", missing)})
    table = families.family_table({"first": lambda model: "a|b", "second": lambda model: "c"})
    assert table.splitlines() == [
        "| family | model | CD pairs per block, by role | first | second |",
        "|---|---|---|---|---|",
        "| vit | timm `vit_tiny_patch16_224` | Block (x2): qkv, proj, fc1, fc2 | a/b | c |",
        "| Other (somelib) | somelib `Model` | not checked: somelib is not installed | not run | not run |"]



@pytest.mark.parametrize("column, weights, inputs", [("aphq (start)", "AdaRoundQuantizer", "UniformQuantizer"),
                                                     ("gplq (start)", "UniformQuantizer", "LSQQuantizer")])
def test_the_aphq_and_gplq_columns_convert_with_their_own_layout_at_w4a4_and_calibrate(monkeypatch, column,
                                                                                      weights, inputs):
    """Each start-of-pipeline column converts the tiny ViT with its own pipeline's layout (APHQ: AdaRound weights;
    GPLQ: LSQ activations), at 4 bits inside the blocks, and calibrates every quantizer; its unit check refuses a
    model whose quantizers lie outside every reconstruction unit (here: no units at all)."""
    from cd.families import build_family
    from quant.quantizers import Quantizer
    script = _script()
    seen, real_calibrate = [], script.calibrate

    def calibrate(model, images):
        seen.append(model)
        return real_calibrate(model, images)

    monkeypatch.setattr(script, "calibrate", calibrate)
    assert script.COLUMNS[column](build_family("vit")) == "supported"
    (quantized,) = seen
    qkv = quantized.get_submodule("blocks.0.attn.qkv")
    assert (type(qkv.weight_quantizer).__name__, qkv.weight_quantizer.bits) == (weights, 4)
    assert (type(qkv.input_quantizer).__name__, qkv.input_quantizer.bits) == (inputs, 4)
    quantizers = [m for m in quantized.modules() if isinstance(m, Quantizer) and m.enabled]
    assert quantizers and all(q.calibrated for q in quantizers)
    monkeypatch.setattr(script, "find_units", lambda model: [])
    cell = script.COLUMNS[column](build_family("vit"))
    assert cell.startswith("refused: ") and cell.endswith("quantizers lie outside every reconstruction unit"), cell

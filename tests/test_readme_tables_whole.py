"""scripts/readme_tables.py --write rewrites cd/README.md or quant/README.md on purpose, but it wrote the document
in place: a write cut short (a full disk, a kill) left it truncated. It now appears whole or stays as it was."""
import os
import subprocess
import sys
import textwrap

from tests.conftest import ROOT

LIMIT = 64 * 1024  # the most bytes a file of the writing process may hold (RLIMIT_FSIZE): a disk that fills up


def test_a_write_cut_short_leaves_the_document_as_it_was(tmp_path):
    """The new document is larger than the process may write (the kernel refuses the write past the limit, EFBIG,
    as a full disk refuses it): the document keeps its earlier text, and no temporary file is left beside it."""
    doc = tmp_path / "README.md"
    before = "# doc\n<!-- b -->\nold table\n<!-- e -->\n" + "text after the table\n" * 4000  # 84 KB
    doc.write_text(before, encoding="utf-8")
    code = textwrap.dedent(f"""
        import resource, signal, sys
        from pathlib import Path
        sys.path.insert(0, {os.path.join(ROOT, "scripts")!r})
        import readme_tables
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (OSError) instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, ({LIMIT}, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        readme_tables.table_command("x", lambda: "new table", Path({str(doc)!r}), "<!-- b -->", "<!-- e -->",
                                    ["--write"])
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert done.returncode != 0 and "File too large" in done.stderr, done.stderr[-2000:]
    assert doc.read_text(encoding="utf-8") == before
    assert os.listdir(tmp_path) == ["README.md"]


def test_a_write_keeps_each_marker_on_a_line_of_its_own(tmp_path, monkeypatch):
    """The table goes between the markers, each on a line of its own, and the text around them stays as it was: a
    marker glued to the table's last line is no longer a comment line of its own in the rendered document."""
    import torch

    from tests.conftest import load_script

    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # the test process keeps its own thread count
    doc = tmp_path / "README.md"
    doc.write_text("# doc\n<!-- b -->\nold table\n<!-- e -->\ntext after\n", encoding="utf-8")
    load_script("readme_tables").table_command("x", lambda: "| a |\n|---|", doc, "<!-- b -->", "<!-- e -->",
                                               ["--write"])
    assert doc.read_text(encoding="utf-8") == "# doc\n<!-- b -->\n| a |\n|---|\n<!-- e -->\ntext after\n"


def test_a_write_keeps_the_line_ends_of_a_crlf_document(tmp_path, monkeypatch):
    """A document checked out with CRLF line ends (git's core.autocrlf on Windows) keeps them, the table's lines
    too: read as text and written back, every line of it turned LF, a diff of the whole document for one table."""
    import torch

    from tests.conftest import load_script

    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # the test process keeps its own thread count
    doc = tmp_path / "README.md"
    doc.write_bytes(b"# doc\r\n<!-- b -->\r\nold table\r\n<!-- e -->\r\ntext after\r\n")
    load_script("readme_tables").table_command("x", lambda: "| a |\n|---|", doc, "<!-- b -->", "<!-- e -->",
                                               ["--write"])
    assert doc.read_bytes() == b"# doc\r\n<!-- b -->\r\n| a |\r\n|---|\r\n<!-- e -->\r\ntext after\r\n"

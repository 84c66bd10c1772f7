"""A return to the branch a roll-back left takes that branch's records back into metrics.jsonl, as best.pt takes
its own back (tests/test_best_branches.py). The reviewer's sequence: a run to update 4 (copied as ck4.pt), branch
A on to 12, branch B from ck4.pt to 6 (A's records moved into metrics.until_step4.jsonl), then A again from its
kept checkpoint at 12 to 14: metrics.jsonl read steps 2, 4, 6 (B's), 14 before, a history no run had. The
expected records are A's lines as metrics.jsonl held them when A stopped, read here from the file, not rebuilt."""
import logging
import os
import shutil

import train


def _lines(path: str) -> list[str]:
    with open(path) as f:
        return f.readlines()


def _step(line: str) -> int:
    return int(line.split('"step": ')[1].split(",")[0].rstrip("}\n"))


def test_a_return_to_a_left_branch_takes_its_records_back(debug_config, caplog):
    common = ["sched.epochs=4", "train.eval_every_steps=2"]
    train.main(debug_config(*common, "train.max_steps=4"))
    out_dir = debug_config().out_dir
    ck4 = os.path.join(out_dir, "ck4.pt")
    shutil.copyfile(os.path.join(out_dir, "checkpoint.pt"), ck4)
    train.main(debug_config(*common, "train.max_steps=12"))  # branch A
    branch_a = _lines(os.path.join(out_dir, "metrics.jsonl"))
    assert _step(branch_a[-1]) == 12
    train.main(debug_config(*common, f"train.resume={ck4}", "train.max_steps=6", "optim.lr=0.05",
                            "train.allow_changed_config=true"))  # branch B
    branch_b = _lines(os.path.join(out_dir, "metrics.jsonl"))
    assert {_step(line) for line in branch_b} == {2, 4, 6}
    with caplog.at_level(logging.WARNING):
        back = train.main(debug_config(*common, f"train.resume={os.path.join(out_dir, 'checkpoint.until_step4.pt')}",
                                       "train.max_steps=14"))
    assert back.state.step == 14
    final = _lines(os.path.join(out_dir, "metrics.jsonl"))
    assert final[:len(branch_a)] == branch_a  # A's own records, B's none
    assert {_step(line) for line in final[len(branch_a):]} == {14}
    # nothing lost: B's file kept whole, A's kept file left as it was
    assert _lines(os.path.join(out_dir, "metrics.until_step12.jsonl")) == branch_b
    assert _lines(os.path.join(out_dir, "metrics.until_step4.jsonl")) == branch_a
    said = [r.getMessage() for r in caplog.records if "held another branch's records" in r.getMessage()]
    assert len(said) == 1 and "metrics.until_step12.jsonl" in said[0] and "metrics.until_step4.jsonl" in said[0]


def test_a_plain_resume_keeps_metrics_jsonl_in_place(debug_config, caplog):
    """The same command after a stop: the records before the checkpoint are its own, nothing is moved or said."""
    train.main(debug_config("train.eval_every_steps=2", "train.max_steps=4"))
    out_dir = debug_config().out_dir
    before = _lines(os.path.join(out_dir, "metrics.jsonl"))
    with caplog.at_level(logging.WARNING):
        train.main(debug_config("train.eval_every_steps=2"))
    assert _lines(os.path.join(out_dir, "metrics.jsonl"))[:len(before)] == before
    assert not [name for name in os.listdir(out_dir) if name.startswith("metrics.until_step")]
    assert "engine.metrics" not in {r.name for r in caplog.records}


def test_a_copy_that_fails_midway_leaves_no_half_file_under_the_kept_name(tmp_path, monkeypatch):
    """On a file system without hard links the kept metrics.until_step<N>.jsonl is a copy: one that stops midway (a
    full disk, a kill) must leave no half file under the kept name, which a later resume would read as the whole
    records of the branch it keeps; metrics.jsonl stays as it was."""
    import errno

    from engine import metrics

    path = tmp_path / "metrics.jsonl"
    records = "".join(f'{{"step": {step}, "train/loss": 1.0}}\n' for step in (2, 4, 6, 8))
    path.write_text(records)

    def no_hard_links(source, target):
        raise OSError(errno.EPERM, "Operation not permitted")

    def half_copy(source, target):
        with open(source) as f, open(target, "w") as out:
            out.write(f.read()[:20])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "link", no_hard_links)
    monkeypatch.setattr(shutil, "copyfile", half_copy)
    try:
        metrics._truncate_after(str(path), 4)
    except OSError as e:
        assert e.errno == errno.ENOSPC
    else:
        raise AssertionError("the failed copy was not reported")
    assert not (tmp_path / "metrics.until_step4.jsonl").exists()
    assert path.read_text() == records
    assert not [name for name in os.listdir(tmp_path) if name.startswith("metrics.until_step")]

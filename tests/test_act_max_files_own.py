"""Nothing lost: evaluate.py replaces a maxima CSV / plot at its result file's names only where it is the file that
result file lists (the path it records, links resolved, with the size and SHA-256 it records; or that content where
the recorded path names nothing any more, the folder moved). A file of that name beside a copy of the result file,
one changed since it was written, or one written there by another command while the passes ran is kept."""
import json
import os
import shutil

import pytest

import evaluate
from engine.act_max_files import digest as act_max_digest
from engine.eval_results import EvalResults
from engine.run_dir import RunDirError

MINE = "my,own,table\n1,2,3\n"
EXTRA = "quant.act_max_extra_modules=[patch_embed.proj,norm]"


def evaluate_into(checkpoint, out, *argv) -> dict:
    evaluate.main(evaluate.parse_args(["--checkpoint", checkpoint, "--quant", "--out", str(out), *argv]))
    return json.loads(out.read_text())


def test_a_file_beside_a_copy_of_the_result_file_is_not_its_own(checkpoint, tmp_path):
    """A result file copied into another folder lists the maxima files beside the original: a file of the same name
    beside the copy is the user's, refused before any pass and kept, with or without the recorded digests (a result
    file written before they were), and not moved aside by a --recompute either."""
    evaluate_into(checkpoint, tmp_path / "e" / "res.json")
    copy = tmp_path / "f" / "res.json"
    copy.parent.mkdir()
    shutil.copy(tmp_path / "e" / "res.json", copy)
    mine = tmp_path / "f" / "res_act_max.csv"
    mine.write_text(MINE)
    with pytest.raises(RunDirError, match=r"f/res_act_max.csv exists and was not written for this result file"):
        evaluate_into(checkpoint, copy)
    data = json.loads(copy.read_text())
    del data["max_act"]["digests"]  # as written before evaluate.py recorded them: the listed path decides
    copy.write_text(json.dumps(data))
    with pytest.raises(RunDirError, match=r"f/res_act_max.csv exists and was not written for this result file"):
        evaluate_into(checkpoint, copy)
    # maxima over other modules without the files: the result file's own go aside, a file not its own stays
    saved = evaluate_into(checkpoint, copy, EXTRA, "quant.act_max_csv=false", "--recompute")
    assert mine.read_text() == MINE and sorted(os.listdir(mine.parent)) == ["eval.log", "res.json",
                                                                            "res_act_max.csv"]
    assert saved["history"][0]["max_act"]["csv"] == str(tmp_path / "e" / "res_act_max.csv")


def test_a_moved_folder_keeps_its_files_but_not_a_file_changed_since(checkpoint, tmp_path):
    """The folder renamed (the recorded path names nothing now): the files of the recorded content are its own,
    written again and listed at their new path; one changed since it was written (a table of the user's saved over
    it) is not, even at the path the result file lists."""
    evaluate_into(checkpoint, tmp_path / "a" / "r.json")
    os.rename(tmp_path / "a", tmp_path / "b")
    out = tmp_path / "b" / "r.json"
    saved = evaluate_into(checkpoint, out)
    assert saved["max_act"]["csv"] == str(tmp_path / "b" / "r_act_max.csv")
    assert sorted(os.listdir(tmp_path)) == ["b"]
    (tmp_path / "b" / "r_act_max.csv").write_text(MINE)
    with pytest.raises(RunDirError, match=r"r_act_max.csv exists and was not written for this result file"):
        evaluate_into(checkpoint, out)
    assert (tmp_path / "b" / "r_act_max.csv").read_text() == MINE


def test_a_file_written_at_the_path_while_the_passes_ran_is_kept(checkpoint, tmp_path, monkeypatch):
    """The files' paths are checked when the result file is opened, and written after the passes: one that
    another evaluate.py adding to the same result file wrote meanwhile is its own and replaced; one another command
    wrote there is kept, with one error naming it, and the result file keeps the maxima without naming it."""
    out = tmp_path / "e.json"
    csv_path = tmp_path / "e_act_max.csv"
    real = evaluate.save_naming_act_max_files

    def meanwhile(action):
        def save(*args, **kwargs):  # between this call's open and its save
            monkeypatch.setattr(evaluate, "save_naming_act_max_files", real)
            action()
            return real(*args, **kwargs)
        monkeypatch.setattr(evaluate, "save_naming_act_max_files", save)

    meanwhile(lambda: evaluate_into(checkpoint, out))  # the same evaluation, run to its end
    saved = evaluate_into(checkpoint, out)
    assert saved["max_act"]["csv"] == str(csv_path) and csv_path.read_text().startswith("name,kind,block")

    os.remove(csv_path)
    meanwhile(lambda: csv_path.write_text(MINE))
    with pytest.raises(RunDirError, match=r"e_act_max.csv was written by another command while evaluate.py ran"):
        evaluate_into(checkpoint, out)
    assert csv_path.read_text() == MINE
    saved = json.loads(out.read_text())
    assert "csv" not in saved["max_act"] and "csv" not in saved["max_act"]["digests"]


def write_maxima_files(stem, content: str) -> dict:
    """Write `content` at both maxima file names of `stem`; {"csv": path, "plot": path}."""
    paths = evaluate.act_max_paths(str(stem))
    for path in paths.values():
        with open(path, "w") as f:
            f.write(content)
    return paths


def test_a_result_without_digests_in_a_moved_folder_keeps_its_files_but_not_beside_a_copy(tmp_path):
    """A result file written before digests were recorded lists the absolute paths of the folder it was written
    in: copied off that machine (the listed path names nothing here), the files of the listed names beside it are
    its own; beside a copy whose original folder is still there, they are not."""
    gone = tmp_path / "cluster" / "runs" / "vit"  # never made: the training machine's folder
    old = {"max_act": {"module": 1.0, "block": 1.0, "csv": str(gone / "eval_best_act_max.csv"),
                       "plot": str(gone / "eval_best_act_max.png")}}
    here = tmp_path / "here"
    here.mkdir()
    write_maxima_files(here / "eval_best", MINE)
    assert sorted(evaluate.check_act_max_files(old, str(here / "eval_best"))) == ["csv", "plot"]
    # the listed original is there: this is a copy, and the files beside it are someone else's
    gone.mkdir(parents=True)
    write_maxima_files(gone / "eval_best", MINE)
    with pytest.raises(RunDirError, match=r"here/eval_best_act_max.csv exists and was not written for this result"):
        evaluate.check_act_max_files(old, str(here / "eval_best"))
    # another file name than the one listed is not the result's own either
    other = tmp_path / "other"
    other.mkdir()
    write_maxima_files(other / "eval_last", MINE)
    shutil.rmtree(gone)
    with pytest.raises(RunDirError, match=r"other/eval_last_act_max.csv exists and was not written for this result"):
        evaluate.check_act_max_files(old, str(other / "eval_last"))


def test_files_with_the_recorded_digests_beside_a_copy_of_the_folder_are_its_own_others_are_not(tmp_path):
    """A copy of the whole folder, the original still there, holds the very bytes the result recorded: its own
    (replacing them loses nothing); a file of other content at the copy's names is someone else's."""
    (tmp_path / "a").mkdir()
    paths = write_maxima_files(tmp_path / "a" / "r", MINE)
    data = {"max_act": {"module": 1.0, "block": 1.0, **paths,
                        "digests": {key: act_max_digest(MINE.encode()) for key in paths}}}
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    assert sorted(evaluate.check_act_max_files(data, str(tmp_path / "b" / "r"))) == ["csv", "plot"]
    (tmp_path / "b" / "r_act_max.csv").write_text("my,own,table\n")
    with pytest.raises(RunDirError, match=r"b/r_act_max.csv exists and was not written for this result file"):
        evaluate.check_act_max_files(data, str(tmp_path / "b" / "r"))


def test_maxima_written_meanwhile_keep_a_file_not_theirs_at_their_names(tmp_path):
    """Maxima over other modules that another evaluate.py wrote while this call ran move to history under
    --recompute, their files aside; a file at the names they list that is not of the content they record (someone
    else's, put there since) is not theirs: it stays where it is, and history names no file for them."""
    out = tmp_path / "e.json"
    stem = str(tmp_path / "e")
    results = EvalResults.open(str(out), {"model": "vit_tiny"})
    assert results.plan_max_act([], recompute=True) is False  # the file has no maxima yet
    results.update(max_act={"module": 2.0, "block": 2.0})
    # meanwhile: another evaluate.py's maxima over other modules, and someone's files at their names since
    paths = write_maxima_files(stem, MINE)
    out.write_text(json.dumps({"model": "vit_tiny", "quant": {}, "max_act": {
        "module": 1.0, "block": 1.0, "extra_modules": ["norm"], **paths,
        "digests": {key: act_max_digest(b"the maxima the other call wrote") for key in paths}}}))
    results.save(lambda listed: evaluate.keep_act_max_files(stem, listed))
    assert sorted(os.listdir(tmp_path)) == ["e.json", "e_act_max.csv", "e_act_max.png"]
    assert all(open(path).read() == MINE for path in paths.values())
    (retired,) = json.loads(out.read_text())["history"]
    assert retired["max_act"]["extra_modules"] == ["norm"] and "csv" not in retired["max_act"]

"""Which activation-maxima files a result file of evaluate.py owns, and writing them so that nothing is lost.

evaluate.py writes the per-layer maxima of a result file `<stem>.json` as `<stem>_act_max.csv` and `.png`
(engine.act_max_files makes them) and lists them, with the size and SHA-256 of each, under the result's max_act. A
file at those names is replaced only where it is the result's own (`own_act_max_files`): the listed file, or the very
bytes it recorded wherever the folder moved; any other file there (another command's, one beside a copied result
file) is refused (`check_act_max_files`) or kept (`publish_act_max_files`). The result file is saved naming the files
before they are written, so that another evaluate.py adding to it meanwhile knows them as its own, and where a write
fails or is interrupted the names of the files that are not there are dropped again (`save_naming_act_max_files`):
a result file never names a maxima file that does not exist. --recompute moves the old maxima's files aside
(`keep_act_max_files`).
"""
from __future__ import annotations

import contextlib
import json
import os
from typing import Callable, Optional

from engine.act_max_files import csv_bytes, digest, file_digest, plot_bytes
from engine.eval_results import EvalResults, ResultsError
from engine.outputs import write_bytes
from engine.preemption import stop_signals_blocked
from engine.run_dir import RunDirError


def act_max_paths(stem: str) -> dict[str, str]:
    """The per-layer maxima files written next to the result file `<stem>.json` (quant.act_max_csv)."""
    return {"csv": stem + "_act_max.csv", "plot": stem + "_act_max.png"}


def act_max_contents(records: list, title: str) -> dict[str, bytes]:
    """The files of `act_max_paths` for the per-layer maxima `records`: {"csv": CSV, "plot": PNG}."""
    return {"csv": csv_bytes(records), "plot": plot_bytes(records, "png", title)}


def own_act_max_files(max_act: dict, paths: dict[str, str]) -> dict[str, dict]:
    """{key: the file's digest} for each maxima file at `paths` ({"csv": path, "plot": path}) that is the one a
    result's `max_act` lists ({"csv": path, "plot": path, "digests": {key: size and SHA-256}}): at the path it lists
    (links resolved) and, where it records a digest, with that content (a file put there since, or edited, is
    another); or, with a recorded digest, that content at another path (the folder moved, renamed or copied: a
    file of the very bytes the result wrote, so replacing it loses nothing); a result recording no digests (written
    before they were) takes a file of the listed file name there where the listed path names nothing any more. Any
    other file at those names (beside a copy of the result file, say) is never its own, whatever its name."""
    max_act = max_act if isinstance(max_act, dict) else {}
    recorded = max_act.get("digests") if isinstance(max_act.get("digests"), dict) else {}
    own = {}
    for key, path in paths.items():
        listed, expected, there = max_act.get(key), recorded.get(key), file_digest(path)
        if there is None or not isinstance(listed, str):
            continue
        if os.path.realpath(listed) == os.path.realpath(path):
            is_own = expected is None or there == expected  # results written before digests: the path decides
        elif not recorded:
            # written before digests, with the absolute path evaluate.py records: the folder copied off the
            # training machine (or a relative --out read from elsewhere) lists a path that is gone. Its file name
            # decides there; where the listed file is still there, this is a copy and the file beside it another
            is_own = os.path.basename(listed) == os.path.basename(path) and not os.path.lexists(listed)
        else:  # the bytes it wrote, wherever they are now
            is_own = expected is not None and there == expected
        if is_own:
            own[key] = there
    return own


def check_act_max_files(data: dict, stem: str) -> dict[str, dict]:
    """Refuse to overwrite maxima files that this result file did not write (nothing is lost): a file at their path
    that is not the one the result's max_act lists (`own_act_max_files`) is someone else's. {key: digest} of the
    files that are its own: those the call may replace."""
    own = own_act_max_files(data.get("max_act") or {}, act_max_paths(stem))
    foreign = [path for key, path in act_max_paths(stem).items() if os.path.exists(path) and key not in own]
    if foreign:
        raise RunDirError(f"{foreign[0]} exists and was not written for this result file; evaluate.py would "
                          f"overwrite it with the per-layer maxima: move it away, give --out another name, or "
                          f"set quant.act_max_csv=false")
    return own


def listed_act_max_files(path: str) -> dict:
    """The max_act of the result file at `path` as it is now ({} where there is none or it cannot be read: the save
    after tells why)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    max_act = data.get("max_act") if isinstance(data, dict) else None
    return max_act if isinstance(max_act, dict) else {}


def publish_act_max_files(contents: dict[str, bytes], named: dict[str, str], own: dict[str, list]) -> None:
    """Write each of `contents` whole at its path in `named`, replacing a file there only where it is one this call
    found to be the result file's own (`own`: key -> the digests of those files), else only where no file is: a
    file another command put there while the passes ran is kept (RunDirError naming it)."""
    for key, data in contents.items():
        path = named[key]
        there = file_digest(path)
        if os.path.exists(path) and there not in own.get(key, []):
            raise written_meanwhile(path)
        try:
            write_bytes(path, data, overwrite=there is not None)
        except RunDirError:
            if not os.path.exists(path):  # a link that reaches no file: its own message
                raise
            raise written_meanwhile(path) from None


def written_meanwhile(path: str) -> RunDirError:
    """The refusal of a maxima file that another command wrote at `path` while this call ran."""
    return RunDirError(f"{path} was written by another command while evaluate.py ran; it is kept and the per-layer "
                       f"maxima files are not written (the result file keeps the maxima): move it away, give --out "
                       f"another name, or set quant.act_max_csv=false")


def files_still_there(max_act: dict, own: dict[str, list]) -> dict:
    """`max_act` naming only the maxima files that are there: each as it records it (its digest; none recorded:
    written before digests were), or one of the result's own that this call did not replace (`own`), named with
    its digest; the name and digest of any other are dropped."""
    recorded = max_act.get("digests")
    max_act, digests = dict(max_act), dict(recorded) if isinstance(recorded, dict) else {}
    for key in ("csv", "plot"):
        if not isinstance(max_act.get(key), str):
            continue
        there = file_digest(max_act[key])
        if there is not None and digests.get(key) in (None, there):
            continue
        if there is not None and there in own.get(key, []):
            digests[key] = there
            continue
        del max_act[key]
        digests.pop(key, None)
    max_act.pop("digests", None)
    return max_act | ({"digests": digests} if digests else {})


def save_naming_act_max_files(results: EvalResults, contents: Optional[dict[str, bytes]], named: dict[str, str],
                              keep_files: Optional[Callable[[dict], dict]] = None,
                              own: Optional[dict[str, dict]] = None) -> None:
    """Save `results`, whose max_act names the maxima files `named` ({"csv": path, "plot": path}) before they are
    written, with the size and SHA-256 of each of `contents` ({"csv": bytes, "plot": bytes}; None: none written),
    then write them whole (`publish_act_max_files`); `keep_files`: EvalResults.save's. A file at a path is replaced
    only where it is the result file's own: found so when the call opened it (`own`, `check_act_max_files`), or
    listed now (written meanwhile by another evaluate.py adding to it). Where the save or a write fails or is
    interrupted (Ctrl-C), the names of the files that are not there as it records them are dropped and the result
    file saved again, stop signals held, before the error goes on: it never names a maxima file that does not
    exist, and one it names is the earlier complete file or this call's."""
    found = {key: [own_digest] for key, own_digest in (own or {}).items()}
    if contents:
        results.update(max_act={**results.data["max_act"],
                                "digests": {key: digest(data) for key, data in contents.items()}})
        for key, listed_digest in own_act_max_files(listed_act_max_files(results.path), named).items():
            found.setdefault(key, []).append(listed_digest)
    write = (lambda: publish_act_max_files(contents, named, found)) if contents else None
    try:
        results.save(keep_files, then=write)  # under the result file's lock: another call finds the files whole
    except BaseException:
        # a failing second save keeps the file as the first left it; the error that came first is the one told
        with stop_signals_blocked(), contextlib.suppress(Exception):
            there = files_still_there(results.data["max_act"], found)
            if there != results.data["max_act"]:
                results.update(max_act=there)
                results.save(keep_files)
        raise


def keep_act_max_files(stem: str, listed: dict) -> dict[str, str]:
    """Move the maxima files of the result file `<stem>.json` that it lists (`listed`: its max_act's
    {"csv": path, "plot": path} and their "digests", the files its own as `own_act_max_files` tells them) aside as
    <stem>_act_max.replaced<N>.csv / .png, N the first number free for both, before maxima over other modules
    (--recompute) replace those they are of: a later call writes the new maxima's files at those names. A file
    listed at another path (before the result file was renamed) is not written over and stays where it is; a file
    at those names that is not its own stays too. {"csv": path, "plot": path} where the listed files lie now."""
    current = act_max_paths(stem)
    movable = {key: current[key] for key in own_act_max_files(listed, current)}
    kept = {key: path for key, path in listed.items() if key in current and key not in movable
            and isinstance(path, str) and os.path.realpath(path) != os.path.realpath(current[key])}
    aside = lambda path, n: "{0}.replaced{2}{1}".format(*os.path.splitext(path), n)
    n = 1
    while any(os.path.lexists(aside(path, n)) for path in current.values()):
        n += 1
    for key, path in movable.items():
        try:
            os.replace(path, aside(path, n))
        except OSError as e:
            raise ResultsError(f"could not move {path} aside as {aside(path, n)} ({e.strerror or e}); the "
                               f"result file is unchanged: fix the folder, or give --out another file") from None
        kept[key] = aside(path, n)
    return kept

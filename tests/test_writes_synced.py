"""docs/operations.md: files are written through a temporary file, fsync and a rename. Without the fsync a machine
that goes down just after the rename may leave the new name empty (XFS; ext4 without auto_da_alloc) and the previous
file gone. Each writer that publishes a file by a rename is checked here by recording the fsyncs and the renames by
inode: every file renamed into place was fsynced before."""
from __future__ import annotations

import errno
import os

import pytest

from engine import metrics, run_dir


def write_output(folder):
    run_dir.write_whole(str(folder / "out.json"), lambda tmp: open(tmp, "w").write("{}"))


def write_config(folder):
    run_dir.save_config_history(str(folder), {"seed": 1}, 0)
    run_dir.save_config_history(str(folder), {"seed": 2}, 4)  # another config: the first kept, a new one written


def cut_metrics(folder):
    path = folder / "metrics.jsonl"
    path.write_text("".join(f'{{"step": {step}, "train/loss": 1.0}}\n' for step in (2, 4, 6)))
    metrics._truncate_after(str(path), 4)


def copy_without_hard_links(folder, monkeypatch):
    (folder / "a.pt").write_bytes(b"weights")

    def no_hard_links(source, target):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_hard_links)
    run_dir.link_or_copy(str(folder / "a.pt"), str(folder / "b.pt"))


WRITERS = {"write_whole": write_output, "config.yaml": write_config, "metrics.jsonl cut at a resume": cut_metrics,
           "link_or_copy's copy": copy_without_hard_links}


@pytest.mark.parametrize("name", list(WRITERS))
def test_every_file_renamed_into_place_was_fsynced_first(tmp_path, monkeypatch, name):
    synced, renamed, fsync, replace = set(), [], os.fsync, os.replace

    def record_fsync(fd):  # the file by its inode: a descriptor has no name on every system
        synced.add(os.fstat(fd).st_ino)
        fsync(fd)

    def record_replace(src, dst):
        inode = os.stat(src).st_ino
        renamed.append((os.path.basename(dst), inode in synced))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", record_fsync)
    monkeypatch.setattr(os, "replace", record_replace)
    writer = WRITERS[name]
    writer(tmp_path, monkeypatch) if name == "link_or_copy's copy" else writer(tmp_path)
    published = [dst for dst, _ in renamed]
    assert published and all(was_synced for _, was_synced in renamed), renamed
    assert not [f for f in os.listdir(tmp_path) if ".partial-" in f], os.listdir(tmp_path)

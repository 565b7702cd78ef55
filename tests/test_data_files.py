"""data/files.py, what every command that writes a folder leans on: appends and atomic writes never go through a link
that leaves the folder, a FIFO is refused rather than waited on, and a folder's lock is on the folder itself, so
deleting a file in it lets no second writer in."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from data import files

REPO = Path(__file__).resolve().parent.parent


def test_open_append_never_writes_through_a_link_inside_the_folder_or_out(tmp_path):
    """A link inside the folder was followed: a metrics.jsonl linking to a save's meta.json destroyed it."""
    run, outside = tmp_path / "run", tmp_path / "outside.jsonl"
    run.mkdir()
    outside.write_text("theirs\n")
    (run / "metrics.jsonl").symlink_to(outside)
    with pytest.raises(OSError, match=f"a link to {outside}, outside {run}"):
        files.open_append(run / "metrics.jsonl", run)
    assert outside.read_text() == "theirs\n"
    (run / "metrics.jsonl").unlink()
    (run / "kept.jsonl").write_text("")
    (run / "metrics.jsonl").symlink_to("kept.jsonl")
    with pytest.raises(OSError, match=f"a link to {run / 'kept.jsonl'}: "):
        files.open_append(run / "metrics.jsonl", run)
    assert (run / "kept.jsonl").read_text() == ""
    with files.open_append(outside) as f:  # outside any run folder: a path the user chose, a regular file
        f.write("more\n")
    assert outside.read_text() == "theirs\nmore\n"


@pytest.mark.parametrize("kind", ["FIFO", "folder"])
def test_a_fifo_or_a_folder_is_refused_not_waited_on(tmp_path, kind):
    """Was: open() of a FIFO with no writer (or no reader) blocks forever. The calls run in a child process with a
    timeout, so that a blocking open fails this test instead of hanging the suite."""
    path = tmp_path / "x"
    os.mkfifo(path) if kind == "FIFO" else path.mkdir()
    what = "a FIFO" if kind == "FIFO" else "a folder"
    code = ("import sys\nfrom data import files\n"
            "for call in (files.read_bytes, files.open_regular, files.open_append):\n"
            "    try:\n"
            "        call(sys.argv[1])\n"
            "    except OSError as e:\n"
            "        print(e.strerror)\n")
    out = subprocess.run([sys.executable, "-c", code, str(path)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.stdout.splitlines() == [f"{what}, not a regular file"] * 3, out


def test_atomic_write_replaces_a_link_and_never_writes_through_it(tmp_path):
    outside = tmp_path / "outside.json"
    outside.write_text("theirs")
    (tmp_path / "run").mkdir()
    link = tmp_path / "run" / "attempts.json"
    link.symlink_to(outside)
    files.write_json(link, [1])
    assert outside.read_text() == "theirs" and not link.is_symlink() and link.read_text() == "[1]"
    planted = link.with_name(f".{link.name}.{os.getpid()}.tmp")  # a link where the temporary file goes
    planted.symlink_to(outside)
    files.write_json(link, [2])
    assert outside.read_text() == "theirs" and link.read_text() == "[2]" and not planted.exists()


def test_a_folder_lock_survives_the_deletion_of_every_file_in_it(tmp_path):
    """Was: the lock was on OUT/.lock; deleting that file let a second writer lock a new one."""
    folder = tmp_path / "run"
    first = files.lock_folder(folder)
    assert first is not None and folder.is_dir()
    (folder / ".lock").write_text("{}")
    (folder / ".lock").unlink()
    assert files.lock_folder(folder) is None  # another open file description: refused, as another process is
    files.unlock_folder(first)
    second = files.lock_folder(folder)
    assert second is not None
    files.unlock_folder(second)


def test_a_folder_swapped_between_the_open_and_the_lock_is_locked_where_it_is_now(tmp_path, monkeypatch):
    """A writer that swaps a new folder in (prepare, export) can do so between another's open() and its flock(): that
    one must end up holding the folder now at the path, not the one renamed away."""
    folder = tmp_path / "out"
    folder.mkdir()
    flock, swapped = files.fcntl.flock, []

    def swap_first(fd, how):
        if not swapped:
            swapped.append(os.rename(folder, tmp_path / "old"))
            folder.mkdir()
        return flock(fd, how)
    monkeypatch.setattr(files.fcntl, "flock", swap_first)
    held = files.lock_folder(folder)
    assert held is not None and os.fstat(held).st_ino == folder.stat().st_ino
    files.unlock_folder(held)


def test_make_folders_and_remove_created_touch_only_what_they_made(tmp_path):
    (tmp_path / "a").mkdir()
    created = files.make_folders(tmp_path / "a" / "b" / "c")
    assert created == [tmp_path / "a" / "b", tmp_path / "a" / "b" / "c"]
    (tmp_path / "a" / "b" / "theirs").write_text("")  # someone else's file meanwhile: b is not removed
    files.remove_created(created)
    assert (tmp_path / "a" / "b" / "theirs").exists() and not (tmp_path / "a" / "b" / "c").exists()

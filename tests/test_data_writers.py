"""prepare.py as a writer of folders: of two preparations into one --out started together exactly one wins whole and
the other says so (exit 2); a full disk is one line, exit 3, leaving the folder as it was; an --out whose name is too
long, an empty --out, PATH or --data are one line, exit 2."""
import json
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from data import prepare as data_prepare
from data.loader import DataError
from data.prepare import prepared_folder
from tests.test_save_integrity import one_error_line

REPO = Path(__file__).resolve().parent.parent
# a preparation that pauses (a file says when) with its set built, before it swaps the set in
PREPARE_PAUSED = """import sys, time
import data.prepare as prepare
import data.files as files
swap, marker = files.swap, sys.argv.pop(1)
def paused_swap(*args):
    open(marker, "w").close()
    time.sleep(6)
    swap(*args)
files.swap = paused_swap
sys.exit(prepare.main(sys.argv[1:]))
"""


def corpus(folder, text):
    folder.mkdir()
    (folder / "a.txt").write_text(text * 200)
    return folder


def test_of_two_preparations_into_one_out_exactly_one_wins_whole(tmp_path, capsys):
    """Was: both exited 0, the second's set swapped in, then the first's over it. The first here pauses with its set
    built, before its swap; the second, started then, is refused and changes nothing."""
    mine, theirs, out, marker = corpus(tmp_path / "mine", "first "), corpus(tmp_path / "theirs", "second "), \
        tmp_path / "out", tmp_path / "paused"
    argv = [str(marker), "text", str(mine), "--out", str(out), "--val-fraction", "0"]
    first = subprocess.Popen([sys.executable, "-c", PREPARE_PAUSED, *argv], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not marker.exists():
        assert first.poll() is None and time.time() < deadline, first.communicate()
        time.sleep(0.05)
    capsys.readouterr()
    assert data_prepare.main(["text", str(theirs), "--out", str(out), "--val-fraction", "0"]) == 2
    assert one_error_line(capsys.readouterr().err) == (f"error: {out} is being written by another process (a "
                                                       "preparation of it): wait for it to end, or choose another "
                                                       "--out (nothing was changed)")
    _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    meta = json.loads((out / "meta.json").read_text())
    assert meta["source"]["paths"] == [str(mine)] and meta["train_tokens"] == len("first " * 200) + 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "out", "paused", "theirs"]  # nothing hidden left


def no_bigger_files_than(limit):
    """preexec_fn: files past `limit` bytes cannot be written (EFBIG, as a full disk gives ENOSPC), and the signal
    that would kill the process for it is ignored, as a file system that is full sends none."""
    def apply():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    return apply


def test_a_full_disk_is_one_line_exit_3_leaving_out_as_it_was(tmp_path):
    """Was: OSError: [Errno 27] File too large (or 28, No space left on device), a traceback."""
    text = corpus(tmp_path / "text", "words and more words\n" * 50)
    out = tmp_path / "data" / "out"
    proc = subprocess.run([sys.executable, "-m", "data.prepare", "text", str(text), "--out", str(out), "--workers",
                           "1"], cwd=REPO, capture_output=True, text=True, timeout=120,
                          preexec_fn=no_bigger_files_than(64 << 10))
    assert proc.returncode == 3, proc.stderr
    assert one_error_line(proc.stderr) == f"error: cannot write {out}: File too large; nothing was changed there"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["text"]  # not out, not the folder made for it, no .tmp


def test_an_out_whose_name_is_too_long_is_one_line_exit_2(tmp_path, capsys):
    """Was: OSError: [Errno 36] File name too long, a traceback, from the hidden folder's longer name."""
    text = corpus(tmp_path / "text", "some text\n")
    for name in ("x" * 250, "y" * 300):  # too long with the hidden folder's suffix; too long on its own
        assert data_prepare.main(["text", str(text), "--out", str(tmp_path / name / "out" if len(name) > 255 else
                                                                 tmp_path / name)]) == 2
        line = one_error_line(capsys.readouterr().err)
        assert line.startswith(f"error: --out: {tmp_path / name}") and f"the name {name[:16]}... is too long for " \
            f"the file system ({len(name)} bytes; 255 at most, less 13 for the hidden folder it is built in)" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["text"]


def test_empty_paths_are_one_line(tmp_path, capsys):
    """Was: --out '' prepared into the current folder's place, PATH '' read the current folder, --data '' trained
    on the default corpus."""
    assert data_prepare.main(["pystdlib", "--out", ""]) == 2
    assert one_error_line(capsys.readouterr().err) == "error: --out: an empty path: name a folder"
    assert data_prepare.main(["text", "", "--out", str(tmp_path / "out")]) == 2
    assert one_error_line(capsys.readouterr().err) == "error: an empty PATH: name a file or a folder"
    with pytest.raises(DataError, match="^--data: an empty path; name a prepared data folder, or leave --data out"):
        prepared_folder("")
    assert list(tmp_path.iterdir()) == []

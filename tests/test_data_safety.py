"""Preparing data never loses data: a preparation is built beside its --out and swapped in whole, so a failed,
interrupted (Ctrl-C, SIGTERM) or killed run leaves the previous data set as it was; an --out holding anything but a
data set of the same kind is refused untouched; an --out inside the corpus is not read. Interruptions, a FIFO in the
corpus and a worker that dies are one line on stderr, never a traceback or a hang.

Run as `python -m tests.test_data_safety MARKER ARGS...`, this file runs `prepare.py ARGS` with every unit of work
after the corpus's first one touching MARKER and then taking 3 s, so that a test can signal it halfway through; with
`MARKER --slow-start ARGS...`, each worker process touches MARKER and takes 3 s before it sets its signals up."""
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from data import prepare as data_prepare
from data import text as data_text
from data.loader import DataError
from data.prepare import prepare
from data.text import Tokenizing, prepare_text
from tests.processes import alive, all_gone, children_started

REPO = Path(__file__).resolve().parent.parent


def blocking_main(argv):
    marker, *args = argv
    tokenize, start_worker = Tokenizing.__call__, data_text._start_worker

    def slow(self, unit):
        if unit[0][:2] != (0, 0):  # not the corpus's first unit
            Path(marker).touch()
            time.sleep(3)
        return tokenize(self, unit)

    def slow_start(*job_args):  # a worker still starting up, as on a loaded machine
        Path(marker).touch()
        time.sleep(3)
        return start_worker(*job_args)

    if args[0] == "--slow-start":
        args, data_text._start_worker = args[1:], slow_start
    else:
        Tokenizing.__call__ = slow
    return data_prepare.main(args)


def snapshot(folder):
    """{relative path: bytes} of every file under folder, hidden ones included."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def hidden(folder):
    return sorted(p.name for p in Path(folder).iterdir() if p.name.startswith("."))


def stderr_lines(err):
    """stderr without the progress bar's lines."""
    lines = err.replace("\r", "\n").splitlines()
    return [line for line in lines if line.strip() and not line.startswith("tokenizing (")]


def big_corpus(folder, files=3, size=700_000):
    """`files` text files of `size` bytes: more than one unit of work (1 MiB) in all."""
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(files):
        words = rng.choice(["alpha", "beta", "gamma\n", "delta.\n"], size // 6)
        (folder / f"f{i}.txt").write_text(" ".join(words)[:size])
    return folder


@pytest.fixture
def previous(tmp_path):
    """(--out, its files): a text data set prepared there before."""
    (tmp_path / "old.txt").write_text("the previous data set\n")
    out = tmp_path / "sets" / "mine"
    prepare_text([tmp_path / "old.txt"], out, val_fraction=0)
    return out, snapshot(out)


def run_cli(args, capsys):
    try:
        code = data_prepare.main([str(a) for a in args])
    except SystemExit as e:
        code = e.code
    return code, stderr_lines(capsys.readouterr().err)


def test_an_out_holding_anything_else_is_refused_untouched(tmp_path, previous, capsys):
    """Was: `text --out` at a pystdlib set deleted its meta.json before refusing; pystdlib overwrote a text set."""
    text_set, text_files = previous
    src = tmp_path / "src"
    src.mkdir()
    for i in range(120):  # pystdlib needs 100 files for a val split
        (src / f"m{i:03d}.py").write_text(f"v = {i}\n")
    py_set = prepare("pystdlib", tmp_path / "py", src_dir=src)
    py_files, _ = snapshot(py_set), capsys.readouterr()
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "notes.txt").write_text("mine, not a data set's")
    code, err = run_cli(["text", tmp_path / "old.txt", "--out", py_set], capsys)
    assert code == 2 and len(err) == 1 and "pystdlib_train_000000.bin" in err[0] and "--out" in err[0], err
    code, err = run_cli(["text", tmp_path / "old.txt", "--out", mixed], capsys)
    assert code == 2 and len(err) == 1 and "notes.txt" in err[0], err
    with pytest.raises(DataError, match="text_train_000000.bin"):
        prepare("pystdlib", text_set, src_dir=src)
    assert snapshot(py_set) == py_files and snapshot(text_set) == text_files
    assert snapshot(mixed) == {"notes.txt": b"mine, not a data set's"}
    assert not hidden(tmp_path) and not hidden(text_set.parent)


def test_a_failed_re_prepare_keeps_the_previous_set(tmp_path, previous):
    """Was: the previous set's meta.json and shards were deleted first, so a bad line later in the corpus lost it."""
    out, files = previous
    corpus = tmp_path / "new"
    corpus.mkdir()
    (corpus / "a.txt").write_text("plenty of good text " * 50)
    (corpus / "b.jsonl").write_text('{"text": "fine"}\n{"text": oops}\n')
    with pytest.raises(DataError, match="b.jsonl: the line at byte 17 is not JSON"):
        prepare_text([corpus], out, val_fraction=0, shard_tokens=100)  # several shards written before the error
    assert snapshot(out) == files and not hidden(out.parent)


def test_an_out_inside_the_corpus_is_not_read(tmp_path, capsys):
    """Was: with a glob matching its files, the second run read (and deleted) its own earlier output."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("some text\n")
    argv = ["text", corpus, "--out", corpus / "out", "--glob", "*", "--val-fraction", "0"]
    assert run_cli(argv, capsys)[0] == 0
    first = snapshot(corpus / "out")
    code, err = run_cli(argv, capsys)
    assert code == 0 and snapshot(corpus / "out") == first, err
    assert "note: skipped 3 files: 3 in the output folder" in err, err  # meta.json and 2 shards


def start_blocked(tmp_path, argv, **popen):
    """prepare.py argv in a process whose second unit of work blocks: (process, marker) once it is blocked there."""
    marker = tmp_path / "blocked"
    proc = subprocess.Popen([sys.executable, "-m", "tests.test_data_safety", str(marker), *map(str, argv)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run never reached its second unit"
        time.sleep(0.05)
    return proc


@pytest.mark.parametrize("how", ["SIGTERM", "Ctrl-C", "Ctrl-C while a worker starts"])
def test_an_interrupted_re_prepare_is_one_line_and_keeps_the_previous_set(tmp_path, previous, how):
    """Was: SIGTERM left a .tmp shard in --out, which had lost its meta.json; Ctrl-C printed tracebacks (one per
    worker), and still one from a worker that had not yet set SIGINT aside when it came (its start-up slowed here).
    SIGTERM goes to the main process; Ctrl-C, as a terminal sends it, to the process group."""
    out, files = previous
    corpus = big_corpus(tmp_path / "corpus")
    workers = 1 if how == "SIGTERM" else 2
    slow = ["--slow-start"] if how.endswith("starts") else []
    proc = start_blocked(tmp_path, [*slow, "text", corpus, "--out", out, "--workers", workers], start_new_session=True)
    if how == "SIGTERM":
        proc.send_signal(signal.SIGTERM)
    else:
        os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    code, name = (143, "SIGTERM") if how == "SIGTERM" else (130, "SIGINT")
    err = stderr_lines(err)
    assert proc.returncode == code and len(err) == 1 and err[0].startswith(f"error: interrupted by {name}"), err
    assert snapshot(out) == files and not hidden(out.parent)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_killed_run_leaves_nothing_the_next_run_keeps(tmp_path, previous, workers):
    """SIGKILL cannot be caught: the previous set stays whole, the workers die with their parent, and the next
    preparation of the same --out removes what the killed one left. Was: a .tmp shard inside --out that nothing
    removed; tokenizing workers left alive, holding the folder's lock, so every later preparation was refused."""
    if workers > len(os.sched_getaffinity(0)):
        pytest.skip("one core: the work runs in the main process")
    out, files = previous
    corpus = big_corpus(tmp_path / "corpus")
    proc = start_blocked(tmp_path, ["text", corpus, "--out", out, "--workers", workers])
    started = children_started(proc.pid, workers if workers > 1 else 0, within_s=60)
    proc.kill()
    proc.communicate(timeout=60)
    assert all_gone(started, within_s=30), [p for p in started if alive(p)]
    assert snapshot(out) == files
    prepare_text([corpus], out, val_fraction=0)
    assert not hidden(out) and not hidden(out.parent)


def test_a_fifo_in_the_corpus_is_skipped_and_named_one_refused(tmp_path):
    """Was: open() of a FIFO named *.txt blocked forever. Only regular files are read; the skipped ones are told."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("some text\n")
    os.mkfifo(corpus / "pipe.txt")
    for argv, code, needle in [([corpus], 0, "1 FIFO"), ([corpus / "pipe.txt"], 2, "pipe.txt: not a regular file")]:
        out = subprocess.run([sys.executable, "-m", "data.prepare", "text", *map(str, argv), "--out",
                              str(tmp_path / f"out{code}")], cwd=REPO, capture_output=True, text=True, timeout=60,
                             check=False)
        err = stderr_lines(out.stderr)
        assert out.returncode == code and any(needle in line for line in err), out
        assert code == 0 or len(err) == 1, err


def test_a_worker_killed_is_one_line_and_exit_3(tmp_path, previous, monkeypatch, capsys):
    """As the out-of-memory killer would: was a BrokenProcessPool traceback."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: the work runs in this process")
    out, files = previous
    corpus, parent = big_corpus(tmp_path / "corpus"), os.getpid()
    tokenize = Tokenizing.__call__

    def killed(self, unit):
        if os.getpid() != parent and unit[0][:2] != (0, 0):
            os.kill(os.getpid(), signal.SIGKILL)
        return tokenize(self, unit)

    monkeypatch.setattr(Tokenizing, "__call__", killed)
    code, err = run_cli(["text", corpus, "--out", out, "--workers", 2], capsys)
    assert code == 3 and len(err) == 1 and "worker" in err[0] and "--workers" in err[0], err
    assert snapshot(out) == files and not hidden(out.parent)


def test_workers_are_capped_at_the_work_and_the_cores(tmp_path, monkeypatch):
    """Was: --workers 1000 started 1000 processes for a few units of work, 10x slower than a few."""
    made = []

    class Recording(ProcessPoolExecutor):
        def __init__(self, workers, *args, **kwargs):
            made.append(workers)
            super().__init__(min(workers, 2), *args, **kwargs)

    monkeypatch.setattr(data_text, "ProcessPoolExecutor", Recording)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"{i}.txt").write_text("x" * 100)
    prepare_text([corpus], tmp_path / "few", workers=1000, unit_bytes=100)  # 3 units
    prepare_text([corpus], tmp_path / "one", workers=1000)  # 1 unit: no pool
    assert made == [min(3, len(os.sched_getaffinity(0)))] or (made == [] and len(os.sched_getaffinity(0)) == 1)


if __name__ == "__main__":
    sys.exit(blocking_main(sys.argv[1:]))

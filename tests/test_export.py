"""python -m data.export as a writer of folders: of two exports into one new folder started together exactly one
wins whole and the other says so (exit 2); an export stopped by SIGTERM or Ctrl-C leaves nothing behind; an empty
path and a config claiming 10^6 layers are one line. The exports that must not hang run in child processes with a
timeout, so that a hang fails the test instead of the suite."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import data.export
from tests.test_checkpoint import run1
from tests.test_save_integrity import one_error_line

REPO = Path(__file__).resolve().parent.parent
# an export whose write of model.safetensors is followed by `then` (a pause, a signal to itself)
EXPORT_THEN = """import os, signal, sys, time
from data import export
write, then = export.write_safetensors, sys.argv.pop(1)
marker = sys.argv.pop(1) if then == "pause" else None
def written_then(*args, **kwargs):
    write(*args, **kwargs)
    open(marker, "w").close() if marker else os.kill(os.getpid(), getattr(signal, then))
    time.sleep(6)
export.write_safetensors = written_then
sys.exit(export.main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run with saves at steps 2 and 4: two exports of different weights."""
    run = tmp_path_factory.mktemp("export") / "run"
    run1(["--out", str(run), "--steps", "4", "--save-every", "2"])
    return run


def export_then(then, *argv):
    return subprocess.Popen([sys.executable, "-c", EXPORT_THEN, then, *map(str, argv)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_of_two_exports_into_one_new_folder_exactly_one_wins_whole(saved, tmp_path, capsys):
    """Was: both exited 0, and the folder held the one that renamed last (or, in between, a mix). The first here
    pauses with its files written, before its rename; the second, started then, is refused and changes nothing."""
    alone = tmp_path / "alone"
    assert data.export.main([str(saved / "step_0000002"), str(alone)]) == 0
    out, paused = tmp_path / "hf", tmp_path / "paused"
    first = export_then("pause", paused, saved / "step_0000002", out)
    deadline = time.time() + 120
    while not paused.exists():
        assert first.poll() is None and time.time() < deadline, first.communicate()
        time.sleep(0.05)
    capsys.readouterr()
    assert data.export.main([str(saved / "step_0000004"), str(out)]) == 2
    assert one_error_line(capsys.readouterr().err) == (f"error: {out} is being written by another process (an export "
                                                       "into it): wait for it to end, or export into another folder "
                                                       "(nothing was changed)")
    _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in alone.iterdir())
    for p in alone.iterdir():
        assert (out / p.name).read_bytes() == p.read_bytes(), p.name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alone", "hf", "paused"]  # no staging folder left


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT", "SIGHUP"])
def test_an_export_stopped_by_a_signal_leaves_nothing_behind(saved, tmp_path, sig):
    """Was: SIGTERM killed it with its staging folder .OUT.export-PID left beside OUT; Ctrl-C was a traceback."""
    out = tmp_path / "new" / "hf"
    proc = export_then(sig, saved, out)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + getattr(signal, sig), err
    assert one_error_line(err) == f"error: interrupted by {sig}: nothing was written to {out}"
    assert list(tmp_path.iterdir()) == []  # neither OUT, nor its staging folder, nor the folder made for it


def test_an_empty_path_is_one_line(saved, capsys):
    for argv, which in (([str(saved), ""], "OUT_DIR"), (["", "x"], "RUN_DIR")):
        assert data.export.main(argv) == 2
        assert one_error_line(capsys.readouterr().err).startswith(f"error: {which} is an empty path; usage: ")


def test_a_config_claiming_a_million_layers_is_one_line_not_hours(saved, tmp_path):
    """Was: the export built the config's model on the meta device to learn its shapes: 10^6 layers took hours."""
    save = tmp_path / "step_0000002"
    shutil.copytree(saved / "step_0000002", save)
    meta = json.loads((save / "meta.json").read_text())
    meta["config"]["model"]["n_layer"] = 10 ** 6
    (save / "meta.json").write_text(json.dumps(meta))
    try:
        out = subprocess.run([sys.executable, "-m", "data.export", str(save), str(tmp_path / "hf")], cwd=REPO,
                             capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail("the export built a model of 10^6 layers")
    assert out.returncode == 2 and one_error_line(out.stderr) == (
        f"error: {save / 'meta.json'}: its config's model has n_layer 1000000, the save holds tensors of 4 layers")
    assert not (tmp_path / "hf").exists() and os.listdir(tmp_path) == ["step_0000002"]

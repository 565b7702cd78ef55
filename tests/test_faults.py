"""Failures: a rank SIGKILLed mid-run under torchrun --max-restarts 1 (torchrun restarts both gloo workers,
--resume auto continues from the newest complete save, the run ends with the losses of an uninterrupted one);
a non-finite loss (exit 3, the last good save stays); the same step failing twice in a row (the next attempt
refuses to start); a full disk during a save, sync or async, on 1 process or on 2 ranks (exit 3 on every rank,
the temp folder removed, the previous save intact and named)."""
import builtins
import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import data.export
import data.files
import data.run
import data.saver
import data.saves
import model
import sample
import train
from bench.ranks import run_ranks
from data.metrics import read_metrics
from tests.layouts import BASE, train_losses
from tests.processes import children
from tests.test_checkpoint import ARGS, quiet
from tests.test_save_integrity import exit_of, one_error_line

CROSS_ENTROPY = model.cross_entropy_loss

REPO = Path(__file__).resolve().parent.parent
FLAGS = ["--peak-tflops", "1", "--steps", "8", "--save-every", "2", "--resume", "auto"]


def workers(agent_pid):
    """{rank: pid} of the training processes torchrun started (its children with RANK in their environment)."""
    found = {}
    for pid in children(agent_pid):
        try:
            env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
        except OSError:
            continue
        if "RANK" in env:
            found[int(env["RANK"])] = pid
    return found


def steps_logged(metrics):
    return [row["step"] for row in read_metrics(metrics)[0]] if metrics.exists() else []


def test_a_killed_rank_is_restarted_and_the_run_ends_as_if_uninterrupted(tmp_path):
    run, metrics = tmp_path / "run", tmp_path / "metrics.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--max-restarts", "1", "--monitor-interval", "0.2", "train.py", *BASE, *FLAGS,
           "--out", str(run), "--metrics", str(metrics)]
    agent = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 180
        while max(steps_logged(metrics), default=0) < 3 and agent.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        os.kill(workers(agent.pid)[1], signal.SIGKILL)  # rank 1 dies between steps 3 and 8
        output, _ = agent.communicate(timeout=240)
    finally:
        agent.kill()
    assert agent.returncode == 0, output[-4000:]
    attempts = json.loads((run / "attempts.json").read_text())
    assert len(attempts) == 2 and attempts[1]["status"] == "done", attempts
    # the record is written at saves (every 2 steps here), not every step: the killed attempt reached its last save
    assert attempts[0]["reached"] >= 2 and attempts[1]["resumed_from"] >= 2, attempts  # resumed, not restarted
    losses = {}
    for row in read_metrics(metrics)[0]:
        losses.setdefault(row["step"], []).append(row["loss"])
    assert sorted(losses) == list(range(1, 9))
    assert all(len(set(again)) == 1 for again in losses.values()), losses  # recomputed steps: bitwise the same
    uninterrupted = train_losses(2, FLAGS, out_dir=tmp_path / "uninterrupted")
    assert [losses[step][-1] for step in range(1, 9)] == uninterrupted


def test_sigterm_to_one_rank_stops_every_rank_after_the_same_step_and_saves_it(tmp_path):
    """Was: the signalled rank stopped alone after its step and saved nothing (a save needs every rank); its peer
    went on into a collective no one answered. Now the ranks' votes ride on the step's norm all-reduce: both stop
    after the same step, save it together and name it; a resume goes on from it."""
    run, metrics = tmp_path / "run", tmp_path / "metrics.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "--monitor-interval", "0.2", "train.py", *BASE, "--steps", "2000", "--out", str(run),
           "--metrics", str(metrics)]
    agent = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 180
        while max(steps_logged(metrics), default=0) < 2 and agent.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        os.kill(workers(agent.pid)[1], signal.SIGTERM)  # rank 1 alone, as `kill` of one worker sends it
        output, _ = agent.communicate(timeout=120)
    finally:
        agent.kill()
    lines = [line for line in output.splitlines() if line.startswith("error: stopped by SIGTERM")]
    assert lines, output[-4000:]
    step = int(lines[0].removeprefix("error: stopped by SIGTERM after step ").split(";")[0])
    assert lines[0] == (f"error: stopped by SIGTERM after step {step}; the newest save is "
                        f"{run / f'step_{step:07d}'}; --resume goes on from it"), output[-4000:]
    assert (run / f"step_{step:07d}" / "complete").exists()  # both ranks' pieces, finalized
    assert json.loads((run / "attempts.json").read_text())[-1]["status"] == f"stopped by SIGTERM after step {step}"
    assert steps_logged(metrics)[-1] == step
    losses = quiet(train.main, BASE + ["--steps", str(step + 1), "--out", str(run), "--metrics", str(metrics),
                                       "--resume"])
    assert len(losses) == 1  # one step more, from that save (in one process: loading is resharding)


def failing_loss(monkeypatch, at_call, error=None):
    """The model's loss becomes nan (or raises `error`) on its at_call-th call (one call per step here)."""
    calls = []

    def loss_fn(logits, targets, **padding):
        calls.append(1)
        loss = CROSS_ENTROPY(logits, targets, **padding)
        if len(calls) == at_call:
            if error:
                raise error
            return loss * float("nan")
        return loss
    monkeypatch.setattr(model, "cross_entropy_loss", loss_fn)  # GPT() takes it as its loss_fn
    return calls


def test_non_finite_loss_stops_with_exit_3_keeping_the_last_good_save(tmp_path, monkeypatch, capsys):
    """Step 3 goes nan: exit 3 naming step 3, the step-2 save stays newest. The restart fails at step 3 again and
    says so; the next one refuses to start (attempts.json) instead of looping."""
    run = ["--out", str(tmp_path), "--steps", "6", "--save-every", "2", "--resume", "auto"]
    errors = []
    for at_call in (3, 1, 1):  # attempt 2 resumes at step 3: its first call is step 3
        calls = failing_loss(monkeypatch, at_call)
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            train.main(ARGS + ["--micro-batch", "8"] + run)
        assert exit_info.value.code == 3
        errors.append(capsys.readouterr().err.strip().splitlines()[-1])
        assert [p.name for p in data.saves.complete_saves(tmp_path)] == ["step_0000002"]
    assert errors[0].startswith("error: step 3: non-finite loss nan") and "step_0000002" in errors[0], errors[0]
    assert "attempt 1 failed at this step too: not retrying" in errors[1], errors[1]
    assert errors[2].startswith("error: step 3 failed in two attempts in a row"), errors[2]
    assert calls == []  # the third attempt trained nothing
    records = json.loads((tmp_path / "attempts.json").read_text())
    assert [(r["resumed_from"], r["reached"]) for r in records] == [(0, 2), (2, 2)]


def test_crashes_at_the_same_step_twice_stop_the_restarts(tmp_path, monkeypatch):
    """A crash leaves its attempt 'running' at the last completed step; two in a row at step 2 stop the third."""
    run = ["--micro-batch", "8", "--out", str(tmp_path), "--steps", "3", "--resume", "auto"]
    for _ in range(2):
        failing_loss(monkeypatch, 2, error=RuntimeError("injected crash"))
        with pytest.raises(RuntimeError, match="injected crash"):
            quiet(train.main, ARGS + run)
    calls = failing_loss(monkeypatch, 0)
    with pytest.raises(SystemExit) as exit_info:
        quiet(train.main, ARGS + run)
    assert exit_info.value.code == 3 and calls == []


def test_the_attempt_record_is_written_when_something_changes_not_every_step(tmp_path, monkeypatch):
    """Rank 0 wrote and fsynced attempts.json after every step; now at the start, at each save and at the end (and
    once a minute in between): 12 steps saving every 6 write it 4 times."""
    written = []
    write = data.run.write_json
    monkeypatch.setattr(data.run, "write_json", lambda path, *a, **k: (written.append(path), write(path, *a,
                                                                                                        **k)))
    quiet(train.main, ARGS + ["--micro-batch", "8", "--out", str(tmp_path), "--steps", "12", "--save-every", "6"])
    assert len([p for p in written if p.name == "attempts.json"]) == 4, written
    (record,) = json.loads((tmp_path / "attempts.json").read_text())
    assert record == {"attempt": 1, "resumed_from": 0, "reached": 12, "status": "done", "run": record["run"]}
    assert len(record["run"]) == 16  # the run's identity: how the same run knows its folder again


def test_faults_module_marks_a_finished_attempt_done(tmp_path):
    attempts = data.run.Attempts(tmp_path, 0, resuming=False)
    attempts.begin(0)
    attempts.progress(3)
    assert attempts.end("done") == ""
    assert json.loads((tmp_path / "attempts.json").read_text())[-1]["status"] == "done"


# ---------------------------------------------------------------- a full disk during a save

class FullFile:
    """A file on a disk that fills up: the first write puts a few bytes down, then raises ENOSPC."""

    def __init__(self, real):
        self.real = real

    def write(self, data):
        self.real.write(data[:16])
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name):
        return getattr(self.real, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.real.close()


def full_disk_open(step, name):
    """An open() for data.saver (the rank files) or data.files (index files, meta.json) that fails writes to files
    named `name` in the temp folder of step's save."""
    def full_open(path, mode="r", *args, **kwargs):
        f = builtins.open(path, mode, *args, **kwargs)
        hit = "w" in mode and f".tmp_step_{step:07d}_" in str(path) and name in Path(path).name
        return FullFile(f) if hit else f
    return full_open


def assert_save_failed(run, err, step, intact, rank=None):
    """One line naming the step and the intact save; no temp folder left; the intact save verifies and is the
    newest."""
    line = one_error_line(err)
    where = f"rank {rank}: " if rank is not None else ""
    assert line == f"error: the save of step {step} failed ({where}No space left on device) and was removed; the " \
                   f"last good save, {run / intact}, is intact", line
    assert not list(run.glob(".tmp_*")) and not list(run.glob(".del_*"))
    assert [p.name for p in data.saves.complete_saves(run)] == [intact]
    data.saves.Saved(run / intact).validate().verify()


FULL = ["--micro-batch", "8", "--save-every", "2", "--keep", "1"]
ONE_PROCESS = {"sync": ([], 4, 4), "async, found at the next save": (["--async-save"], 6, 4),
               "async, found at the end": (["--async-save"], 4, 4)}  # flags, steps, the step whose save fails


@pytest.mark.parametrize("case", list(ONE_PROCESS))
def test_a_full_disk_during_a_save_is_exit_3_keeping_the_previous_save(tmp_path, monkeypatch, case):
    flags, steps, failing = ONE_PROCESS[case]
    monkeypatch.setattr(data.saver, "open", full_disk_open(failing, ".bin"), raising=False)
    code, err = exit_of(train.main, ARGS + FULL + flags + ["--out", str(tmp_path), "--steps", str(steps)])
    assert code == 3, err
    assert_save_failed(tmp_path, err, failing, "step_0000002")
    monkeypatch.delattr(data.saver, "open")
    if case == "sync":  # the previous save resumes
        assert len(quiet(train.main, ARGS + FULL + ["--out", str(tmp_path), "--steps", "4", "--resume"])) == 2


def _full_disk_rank(rank, world, run, flags, failing_rank, module, name):
    if rank == failing_rank:
        {"write": data.saver, "files": data.files}[module].open = full_disk_open(4, name)
    return exit_of(train.main, ARGS + ["--dp-mode", "fsdp", "--out", run, "--steps", "4", "--save-every", "2",
                                       "--keep", "1"] + flags)


TWO_RANKS = {  # flags, the rank whose write fails, the module whose open() it goes through, the file
    "sync, rank 1's data": ([], 1, "write", ".bin"),
    "async, rank 1's data": (["--async-save"], 1, "write", ".bin"),
    "sync, rank 1's index": ([], 1, "files", "rank00001.json"),
    "sync, rank 0's meta.json": ([], 0, "files", "meta.json"),
    "async, rank 0's meta.json": (["--async-save"], 0, "files", "meta.json"),
}


@pytest.mark.parametrize("case", list(TWO_RANKS))
def test_a_full_disk_on_one_rank_stops_both_ranks_alike(tmp_path, case):
    """fsdp on 2 ranks, each writing its own file: whichever write fails (a rank's data or index, rank 0's
    meta.json in its finalize), no rank hangs, both exit 3, and rank 0 names the failing rank and the intact save."""
    flags, failing_rank, module, name = TWO_RANKS[case]
    results = run_ranks(_full_disk_rank, 2, args=(str(tmp_path), flags, failing_rank, module, name), timeout=200)
    assert [code for code, _ in results] == [3, 3], results
    assert_save_failed(tmp_path, results[0][1], 4, "step_0000002", rank=failing_rank)


# ---------------------------------------------------------------- no save that cannot train

DIVERGE = ARGS + ["--micro-batch", "8", "--steps", "1", "--lr", "1e38", "--warmup", "0"]  # one update: all NaN


def test_an_update_that_leaves_the_weights_not_finite_writes_no_save(tmp_path):
    """Was: exit 0 and an all-NaN step_0000001, the save a resume or an export would take."""
    code, err = exit_of(train.main, DIVERGE + ["--out", str(tmp_path / "run")])
    assert code == 3, err
    assert one_error_line(err) == ("error: step 1: the update left the weights not finite; not saved; stopped, "
                                   "the last good save is none")
    assert not list((tmp_path / "run").glob("*step_*"))


@pytest.fixture
def nan_save(tmp_path, monkeypatch):
    """A save of all-NaN weights, as the code before the check wrote one (the check is patched away)."""
    with monkeypatch.context() as patch:
        patch.setattr(data.run, "not_finite", lambda *args: "")
        quiet(train.main, DIVERGE + ["--out", str(tmp_path / "run")])
    return tmp_path / "run"


def test_a_save_that_is_not_finite_is_never_good_nor_resumed_exported_or_sampled(nan_save, tmp_path, capsys):
    assert data.saves.last_good_save(nan_save) is None  # never named "the last good save"
    code, err = exit_of(train.main, DIVERGE + ["--out", str(nan_save), "--resume", "--steps", "2"])
    assert code == 2 and one_error_line(err).startswith("error: --resume:") and "not finite" in err, err
    assert data.export.main([str(nan_save), str(tmp_path / "hf")]) == 2
    assert "not finite" in one_error_line(capsys.readouterr().err) and not (tmp_path / "hf").exists()
    assert sample.main(["--run", str(nan_save), "--max-new-tokens", "3"]) == 2
    assert "not finite" in one_error_line(capsys.readouterr().err)


def test_the_stop_names_what_is_not_finite():
    """Was: a finite loss of 5.549 called "non-finite loss" when the gradient norm was."""
    assert data.run.non_finite_step(5.549, float("inf")) == "non-finite gradient norm inf (loss 5.549)"
    assert data.run.non_finite_step(float("nan"), 2.0) == "non-finite loss nan (gradient norm 2.0)"


# ---------------------------------------------------------------- ranks that disagree

def _rank_with_its_own_flags(rank, world, argv):
    return exit_of(train.main, argv + (["--lr", "0.1"] if rank == 1 else []))


def test_ranks_started_with_different_flags_stop_in_one_line_before_writing(tmp_path):
    """Was: two launches with different --lr both exited 0, their replicas diverged."""
    argv = ARGS + ["--micro-batch", "4", "--steps", "2", "--out", str(tmp_path / "run")]
    (code, err), (code1, _) = run_ranks(_rank_with_its_own_flags, 2, args=(argv,), timeout=120)
    assert code == code1 == 2
    assert one_error_line(err) == ("error: --lr: rank 1 has 0.1, rank 0 0.003: every rank must run the same "
                                   "command")
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- an output that cannot be written

@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("finished") / "run"
    quiet(train.main, ARGS + ["--steps", "2", "--out", str(run)])
    return run


COMMANDS = {  # name: argv after python, given a finished run and a fresh folder
    "train.py": lambda run, new: ["train.py", *ARGS, "--steps", "2", "--log-every", "1", "--out", str(new)],
    "sample.py": lambda run, new: ["sample.py", "--run", str(run), "--max-new-tokens", "4"],
    "data.prepare": lambda run, new: ["-m", "data.prepare", "text", "README.md", "--out", str(new)],
    "data.export": lambda run, new: ["-m", "data.export", str(run), str(new)],
    "bench.compare": lambda run, new: ["-m", "bench.compare", str(run)],
}


@pytest.mark.parametrize("into", ["head", "a full device"])
@pytest.mark.parametrize("command", COMMANDS)
def test_an_output_that_cannot_be_written_is_one_line_exit_3(finished_run, tmp_path, command, into):
    """stdout into a pipe whose reader is gone (`| head`), or onto /dev/full. Was: a BrokenPipeError or OSError
    traceback from each command; train.py's run now also records the attempt as failed and names the newest save."""
    if into == "head":
        reader, stdout = os.pipe()
        os.close(reader)
    else:
        stdout = os.open("/dev/full", os.O_WRONLY)
    try:
        proc = subprocess.run([sys.executable, *COMMANDS[command](finished_run, tmp_path / "new")], cwd=REPO,
                              stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(stdout)
    why = "the output's reader is gone" if into == "head" else "a write failed: No space left on device"
    assert proc.returncode == 3 and one_error_line(proc.stderr).startswith(f"error: {why}"), proc.stderr[-3000:]
    if command == "train.py":
        assert one_error_line(proc.stderr).endswith("stopped, the newest save is none")
        assert json.loads((tmp_path / "new" / "attempts.json").read_text())[-1]["status"].startswith("failed: ")

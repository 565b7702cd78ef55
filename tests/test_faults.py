"""Failures: a rank SIGKILLed mid-run under torchrun --max-restarts 1 (torchrun restarts both gloo workers,
--resume auto continues from the newest complete save, the run ends with the losses of an uninterrupted one);
a non-finite loss (exit 3, the last good save stays); the same step failing twice in a row (the next attempt
refuses to start)."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import model as M
import saves.restarts
import saves.write
import train
from tests.layouts import BASE, train_losses
from tests.test_checkpoint import ARGS, quiet

CROSS_ENTROPY = M.cross_entropy_loss

REPO = Path(__file__).resolve().parent.parent
FLAGS = ["--peak-tflops", "1", "--steps", "8", "--save-every", "2", "--resume", "auto"]


def workers(agent_pid):
    """{rank: pid} of the training processes torchrun started (its children with RANK in their environment)."""
    children = []
    for task in Path(f"/proc/{agent_pid}/task").iterdir():
        children += [int(p) for p in (task / "children").read_text().split()]
    found = {}
    for pid in children:
        try:
            env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
        except OSError:
            continue
        if "RANK" in env:
            found[int(env["RANK"])] = pid
    return found


def steps_logged(metrics):
    return [json.loads(line)["step"] for line in metrics.read_text().splitlines()] if metrics.exists() else []


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
    assert attempts[0]["reached"] >= 3 and attempts[1]["resumed_from"] >= 2, attempts  # resumed, not restarted
    losses = {}
    for line in metrics.read_text().splitlines():
        row = json.loads(line)
        losses.setdefault(row["step"], []).append(row["loss"])
    assert sorted(losses) == list(range(1, 9))
    assert all(len(set(again)) == 1 for again in losses.values()), losses  # recomputed steps: bitwise the same
    uninterrupted = train_losses(2, FLAGS, out_dir=tmp_path / "uninterrupted")
    assert [losses[step][-1] for step in range(1, 9)] == uninterrupted


def failing_loss(monkeypatch, at_call, error=None):
    """The model's loss becomes nan (or raises `error`) on its at_call-th call (one call per step here)."""
    calls = []

    def loss_fn(logits, targets):
        calls.append(1)
        loss = CROSS_ENTROPY(logits, targets)
        if len(calls) == at_call:
            if error:
                raise error
            return loss * float("nan")
        return loss
    monkeypatch.setattr(M, "cross_entropy_loss", loss_fn)  # GPT() takes it as its loss_fn
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
        assert [p.name for p in saves.write.complete_saves(tmp_path)] == ["step_0000002"]
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


def test_faults_module_marks_a_finished_attempt_done(tmp_path):
    attempts = saves.restarts.Attempts(tmp_path, 0, resuming=False)
    attempts.begin(0)
    attempts.progress(3)
    assert attempts.end("done") == ""
    assert json.loads((tmp_path / "attempts.json").read_text())[-1]["status"] == "done"

"""Surviving a killed rank: under torchrun --max-restarts 1, SIGKILL one of two gloo workers mid-run; torchrun
restarts both, --resume auto continues from the newest complete save, and the run ends with the losses of an
uninterrupted one."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.layouts import BASE, train_losses

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

"""A hang names itself. One rank of four is stopped (SIGSTOP) at the start of step 4; every other
rank leaves within --timeout plus a few seconds, exit 3, with one line naming the step, the
collective, its group and the rank that had not arrived. Nothing in the run folder is lost."""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import train
from bench.ranks import free_port
from data.metrics import read_metrics
from parallel.mesh import flight_recorder
from tests.layouts import BASE

REPO = Path(__file__).resolve().parent.parent
STOP_AT = 4  # the stopped rank's 4th train_step: after the start-up steps, under --timeout
TIMEOUT = 4
RANK_SCRIPT = f"""
import os, signal, sys
import train
if os.environ["RANK"] == "2":
    step, calls = train.train_step, []
    def stop(*args, **kwargs):
        calls.append(1)
        if len(calls) == {STOP_AT}:
            os.kill(os.getpid(), signal.SIGSTOP)
        return step(*args, **kwargs)
    train.train_step = stop
train.main(sys.argv[1:])
"""


def stopped(pid):
    return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "T"


def test_a_stopped_rank_is_named_by_every_other_rank(tmp_path):
    out, port = tmp_path / "run", free_port()
    argv = BASE + ["--steps", "8", "--micro-batch", "2", "--save-every", "2", "--timeout", str(TIMEOUT),
                   "--startup-timeout", "60", "--out", str(out)]
    procs = []
    for rank in range(4):  # LOCAL_RANK 0 each, as on four nodes: every rank prints its line
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, *argv], cwd=REPO, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        deadline = time.monotonic() + 240
        while not stopped(procs[2].pid):
            assert time.monotonic() < deadline and procs[2].poll() is None, procs[2].communicate()[1][-3000:]
            time.sleep(0.05)
        stopped_at, ended = time.monotonic(), {}
        while len(ended) < 3 and time.monotonic() < stopped_at + TIMEOUT + 30:
            for rank in (0, 1, 3):
                if rank not in ended and procs[rank].poll() is not None:
                    ended[rank] = time.monotonic() - stopped_at
            time.sleep(0.05)
    finally:
        procs[2].kill()
        for p in procs:
            if p.poll() is None:
                p.kill()
        outputs = [p.communicate() for p in procs]
    assert sorted(ended) == [0, 1, 3], (ended, [o[1][-2000:] for o in outputs])
    rows, _ = read_metrics(out / "metrics.jsonl")
    compute = rows[-1]["dt_s"]  # the other ranks' work in step 4 before its first collective, at most
    for rank in (0, 1, 3):  # the timeout, name_the_hang's 6 s for the late rank's word, then gone
        assert ended[rank] <= compute + TIMEOUT + 8, (rank, ended, compute, outputs[rank][1][-1500:])
        assert procs[rank].returncode == 3, outputs[rank][1][-2000:]
        line = outputs[rank][1].strip().splitlines()[-1]
        assert re.match(rf"error: step {STOP_AT}: all_reduce #1 of the step on group dp_cp \(ranks 0\.\.3\) "
                        r"(timed out|lost a peer that timed out); had not arrived: rank 2; stopped", line), line
    assert [r["step"] for r in rows] == [1, 2, 3]  # every finished step's row is there
    assert (out / "step_0000002" / "complete").exists()  # the last save is whole
    attempt = json.loads((out / "attempts.json").read_text())[-1]
    assert attempt["reached"] == 3 and attempt["status"].startswith(f"failed: step {STOP_AT}: all_reduce")


def test_nccl_runs_keep_a_flight_recorder_in_the_run_folder(tmp_path):
    env = flight_recorder(tmp_path)
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and int(env["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"].startswith(str(tmp_path))


def test_nccl_makes_its_communicators_at_start_up_with_the_flight_recorder_on(tmp_path, monkeypatch):
    """init_process_group gets this rank's device (NCCL then builds its communicators at once, not at each
    group's first collective) and the flight recorder's variables are set before it."""
    seen = {}

    class Stop(Exception):
        pass

    def init(backend, **kwargs):
        seen.update(kwargs, backend=backend, env=dict(os.environ))
        raise Stop
    monkeypatch.setattr(os, "environ", dict(os.environ))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", init)
    run = SimpleNamespace(backend="nccl", device="cuda:3", world=8, rank=3, startup_timeout=60.0, out=str(tmp_path),
                          tf32=True)
    with pytest.raises(Stop):
        train.start_distributed(run)
    assert seen["backend"] == "nccl" and seen["device_id"] == torch.device("cuda:3")
    assert seen["env"]["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "nccl_trace_rank_")

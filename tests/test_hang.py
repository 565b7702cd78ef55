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
if os.environ["RANK"] == os.environ["STOPPED_RANK"]:
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


def run_with_a_stopped_rank(out, flags, stop, per_node=1, world=4):
    """Starts `world` ranks of a run (per_node to a node) and SIGSTOPs rank `stop` at its step STOP_AT.
    Returns ({rank: seconds from the stop to its exit}, {rank: (exit status, stderr)}) of the others."""
    port = free_port()
    argv = BASE + ["--steps", "8", "--save-every", "2", "--timeout", str(TIMEOUT), "--startup-timeout", "60",
                   "--out", str(out), *flags]
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % per_node),
               "LOCAL_WORLD_SIZE": str(per_node), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "STOPPED_RANK": str(stop)}
        procs.append(subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, *argv], cwd=REPO, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    others = [r for r in range(world) if r != stop]
    try:
        deadline = time.monotonic() + 240
        while not stopped(procs[stop].pid):
            assert time.monotonic() < deadline and procs[stop].poll() is None, procs[stop].communicate()[1][-3000:]
            time.sleep(0.05)
        stopped_at, ended = time.monotonic(), {}
        while len(ended) < len(others) and time.monotonic() < stopped_at + TIMEOUT + 40:
            for rank in others:
                if rank not in ended and procs[rank].poll() is not None:
                    ended[rank] = time.monotonic() - stopped_at
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        outputs = [p.communicate()[1] for p in procs]
    assert sorted(ended) == others, (ended, [o[-2000:] for o in outputs])
    return ended, {r: (procs[r].returncode, outputs[r]) for r in others}


def error_lines(err):
    return [line for line in err.splitlines() if line.startswith("error:")]


def test_a_stopped_rank_is_named_by_every_other_rank(tmp_path):
    out = tmp_path / "run"
    # LOCAL_RANK 0 each, as on four nodes: every rank prints its line
    ended, outputs = run_with_a_stopped_rank(out, ["--micro-batch", "2"], stop=2)
    rows, _ = read_metrics(out / "metrics.jsonl")
    compute = rows[-1]["dt_s"]  # the other ranks' work in step 4 before its first collective, at most
    for rank, (code, err) in outputs.items():  # the timeout, name_the_hang's 6 s for the late rank's word, then gone
        assert ended[rank] <= compute + TIMEOUT + 8, (rank, ended, compute, err[-1500:])
        assert code == 3, err[-2000:]
        line = err.strip().splitlines()[-1]
        assert re.match(rf"error: step {STOP_AT}: all_reduce #1 of the step on group dp_cp \(ranks 0\.\.3\) "
                        r"(timed out|lost a peer that timed out); had not arrived: rank 2; stopped", line), line
    assert [r["step"] for r in rows] == [1, 2, 3]  # every finished step's row is there
    assert (out / "step_0000002" / "complete").exists()  # the last save is whole
    attempt = json.loads((out / "attempts.json").read_text())[-1]
    assert attempt["reached"] == 3 and attempt["status"].startswith(f"failed: step {STOP_AT}: all_reduce")


def test_under_tp_and_pp_the_stopped_rank_is_named_not_the_neighbour_waiting_for_it(tmp_path):
    """Ranks 0, 1 are pp stage 0 and 2, 3 stage 1, each pair a tp group; rank 2 stops. Was: rank 1, waiting on
    rank 3 in pp, blamed rank 3, which itself waited on rank 2 in tp."""
    _, outputs = run_with_a_stopped_rank(tmp_path / "run", ["--tp", "2", "--pp", "2", "--micro-batch", "1"], stop=2)
    for rank, (code, err) in outputs.items():
        line = error_lines(err)[-1]
        assert code == 3 and ("had not arrived: rank 2;" in line or "no word from rank 2;" in line), (rank, line)
        assert rank != 1 or "had not arrived: rank 3 (waiting in " in line, line


def test_a_node_whose_local_rank_0_stopped_still_prints_the_line(tmp_path):
    """Two nodes of two ranks; rank 2, the second node's local rank 0, stops. Was: only local rank 0 prints, so
    nothing on that node said why it ended; now its lowest rank that still runs does, and only that one."""
    _, outputs = run_with_a_stopped_rank(tmp_path / "run", ["--micro-batch", "2"], stop=2, per_node=2)
    lines = {rank: error_lines(err) for rank, (code, err) in outputs.items()}
    assert [len(lines[r]) for r in (0, 1, 3)] == [1, 0, 1], lines
    assert "had not arrived: rank 2;" in lines[3][0], lines


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

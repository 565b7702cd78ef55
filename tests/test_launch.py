"""Multi-node launch on one machine: train.sbatch under a stand-in SLURM (scontrol and srun on PATH) starts
two `torchrun --nnodes 2 --nproc_per_node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT` launchers,
one per "node", over loopback; their dp 2 x cp 2 run logs the same losses as one process."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from bench.labs import clean_exits as exits
from bench.ranks import free_port
from data.metrics import read_metrics
from tests.layouts import BASE

REPO = Path(__file__).resolve().parent.parent
STEPS = ["--steps", "3", "--peak-tflops", "1"]  # no CPU peak measurement: MFU is not under test

FAKE_SCONTROL = """#!/bin/bash
# scontrol show hostnames LIST: both "nodes" are this machine
echo 127.0.0.1; echo 127.0.0.1
"""
FAKE_SRUN = """#!/bin/bash
# srun [options] COMMAND...: one task per node; here the nodes are background processes on this machine
while [[ "$1" == --* ]]; do shift; done
echo "$@" > "$FAKE_SLURM_DIR/command"
pids=()
for node in $(seq "$SLURM_NNODES"); do
    "$@" > "$FAKE_SLURM_DIR/node$node.log" 2>&1 &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""


def read_losses(path):
    return [row["loss"] for row in read_metrics(path)[0]]  # the step rows; the run's summary row is not one


def test_two_torchrun_launchers_over_loopback_equal_one_process(tmp_path):
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "FAKE_SLURM_DIR": str(tmp_path),
           "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "2",
           "SLURM_JOB_ID": "test", "SLURM_SUBMIT_DIR": str(REPO), "RDZV_PORT": str(free_port())}
    run = BASE + STEPS + ["--cp", "2"]  # world 4 = dp 2 x cp 2: dp spans the two "nodes"
    sbatch = REPO / "bench" / "cluster" / "train.sbatch"
    launched = subprocess.Popen(["bash", str(sbatch), *run, "--out", str(tmp_path / "run"),
                                 "--metrics", str(tmp_path / "launched.jsonl")],
                                cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    single = subprocess.Popen([sys.executable, "train.py", *BASE, *STEPS, "--out", str(tmp_path / "single"),
                               "--metrics", str(tmp_path / "single.jsonl")],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = launched.communicate(timeout=360)
        single_out, _ = single.communicate(timeout=120)
    finally:
        for p in (launched, single):
            if p.poll() is None:
                p.kill()
    logs = "".join(p.read_text() for p in sorted(tmp_path.glob("node*.log")))
    assert launched.returncode == 0, out + logs[-6000:]
    assert single.returncode == 0, single_out
    command = (tmp_path / "command").read_text()
    assert (f".venv/bin/python -m parallel.launch --nnodes 2 --nproc_per_node 2 --rdzv-backend c10d "
            f"--rdzv-endpoint 127.0.0.1:{env['RDZV_PORT']} --rdzv-id test --max-restarts 3 train.py") in command
    assert "mesh: world 4 = dp 2 x pp 1 x cp 2 x tp 1" in logs
    got, expected = read_losses(tmp_path / "launched.jsonl"), read_losses(tmp_path / "single.jsonl")
    assert len(got) == 3
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=0)


def test_short_jobs_of_every_dp_mode_exit_0():
    """torchrun reported a 4-rank HSDP job as failed in 1 of 5 tries: a rank aborted after its last step, tearing down
    while a peer was still in the last collective. Each dp mode, and the tp x pp resume from an FSDP save, once here
    (`python -m bench.labs.clean_exits --repeat N --parallel 2` runs every layout family again and again)."""
    assert exits.main(["--repeat", "1", "--steps", "3", "--families", "ddp,fsdp,hsdp,fsdp -> tp pp resume"]) == 0


THREADS = """
import os, sys, threading
import train
def native_threads():  # the process's threads that are not Python's (tqdm's monitor is one of those)
    return len(os.listdir("/proc/self/task")) - len(threading.enumerate())
before = native_threads()
try:
    train.main(sys.argv[1:])
except SystemExit:
    pass
print(f"threads {before} {native_threads()}", flush=True)
"""


def test_a_finished_run_leaves_no_thread_to_the_interpreters_exit(tmp_path):
    """The process groups' worker threads (C++) are joined before main returns. Left to the interpreter's
    exit (the groups sit in reference cycles), a worker dropping a tensor there aborts the process
    after its last step, now and then, under load."""
    script = tmp_path / "threads.py"
    script.write_text(THREADS)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(script), *BASE, *STEPS, "--tp", "2", "--out", str(tmp_path / "run")],
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    counts = re.findall(r"threads (\d+) (\d+)", done.stdout)  # the two ranks' lines may share one line
    assert len(counts) == 2 and all(before == after for before, after in counts), counts


def test_under_torchrun_our_error_line_ends_the_console(tmp_path):
    """torchrun follows a failed worker with ~45 lines of its own; its report now ends with our line as the root
    cause (the worker's error file) instead of a pointer to its documentation."""
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           "train.py", "--model", "tiny", "--steps", "2", "--tp", "3", "--device", "cpu",
                           "--out", str(tmp_path / "run")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    tail = [line.strip() for line in done.stderr.strip().splitlines()[-3:]]
    assert tail[-2] == "traceback : error: --tp: tp·pp·cp = 3·1·1 = 3 does not divide the world size 2", tail


LAUNCH = [sys.executable, "-m", "parallel.launch", "--standalone", "--nproc_per_node", "2", "train.py"]


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_launched_job_stopped_ends_on_our_line_with_one_processs_status(tmp_path, sig):
    """Ctrl-C (a terminal's SIGINT to the job) or SIGTERM (Slurm's time limit) to the launcher. Was, under torchrun:
    our line, then torchrun's traceback of the signal, exit 1. Now our line ends it, exit 130 or 143."""
    run = tmp_path / "run"
    proc = subprocess.Popen([*LAUNCH, *BASE, "--steps", "2000", "--out", str(run)], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    metrics, deadline = run / "metrics.jsonl", time.time() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2) and time.time() < deadline:
        time.sleep(0.1)
    os.killpg(proc.pid, getattr(signal, sig))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + getattr(signal, sig) and "Traceback" not in err, err[-3000:]
    how = "interrupted" if sig == "SIGINT" else "stopped by SIGTERM"
    assert err.strip().splitlines()[-1].startswith(f"error: {how} after step "), err[-3000:]


def test_a_launched_job_that_fails_exits_with_the_workers_status(tmp_path):
    """Was, under torchrun: exit 1 for every failure, after its report. Now the worker's own: 2 for bad input."""
    done = subprocess.run([*LAUNCH, "--model", "tiny", "--steps", "2", "--tp", "3", "--device", "cpu",
                           "--out", str(tmp_path / "run")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.count("error: --tp: tp·pp·cp = 3·1·1 = 3 does not divide the world size 2") == 1, done.stderr

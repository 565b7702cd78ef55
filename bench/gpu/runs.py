"""The GPU run's training runs, each a child process with a deadline: train.py (our step) and bench/gpu/hf.py
(Hugging Face's), their per-step lines read back, those of a run stopped at its deadline too."""
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import model
from bench import common
from data.metrics import read_metrics


def child(cmd, timeout_s, log):
    """Runs cmd in its own process group until it ends or timeout_s passes (then kills the group): "ok", "stopped at
    the budget", "OOM" or what failed, from the end of its log."""
    with open(log, "a") as out:
        proc = subprocess.Popen(cmd, cwd=common.REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return "stopped at the budget"
    if code == 0:
        return "ok"
    text = Path(log).read_text()
    last = [line for line in text.splitlines() if line.strip()][-1:] or ["no output"]
    return "OOM" if "out of memory" in text else f"exit {code}: {last[0][:120]}"


def lines(path):
    """The step rows of a --metrics file (its summary left out); none before the child wrote one."""
    return read_metrics(path)[0] if Path(path).exists() else []


def finished(r, path, status):
    """The rows a child wrote to `path`, the first (it compiles) left out, the last r.window kept; the status says how
    many steps a stopped or failed run finished."""
    rows = lines(path)
    return rows[1:][-r.window:], status + (f" after {len(rows)} steps" if status != "ok" and rows else "")


def run_ours(r, tmp, preset, overrides, micro, compiled, dtype):
    """train.py in a child, its --metrics rows read back (those of a stopped run too): the row's numbers, status."""
    metrics, log = tmp / f"{preset}-{compiled}-{dtype}.jsonl", tmp / f"{preset}-{compiled}-{dtype}.log"
    shm = Path("/dev/shm")  # train.py saves at its last step (untimed, 12 B/param): into RAM when it has room
    room = shm.is_dir() and os.access(shm, os.W_OK) and os.statvfs(shm).f_bavail * os.statvfs(shm).f_frsize > 15 * (
        model.param_counts(common.preset_config(preset, **overrides))[0])
    with tempfile.TemporaryDirectory(dir=shm if room else None) as out:
        flags = [x for k, v in overrides.items() for x in (f"--{k.replace('_', '-')}", str(v))]
        if r.smoke:  # a CPU has no peak of its own in train.py: the bench gives it its best measured matmul rate
            flags += ["--peak-tflops", f"{common.measured_cpu_peak_tflops(min_s=0.2):.6g}"]
        status = child([sys.executable, "train.py", "--model", preset, *flags, "--device", r.device.type,
                        "--dtype", dtype, "--steps", str(r.steps), "--compile" if compiled else "--no-compile",
                        "--micro-batch", str(micro), "--global-batch", str(micro), "--log-every", "0",
                        "--eval-every", "0", "--metrics", str(metrics), "--out", out], r.deadline(compiled), log)
    rows, status = finished(r, metrics, status)

    def median(key):
        return common.median([row.get(key) for row in rows])
    mfu = median("mfu")
    return dict(tok_s=median("tok_s"), mfu=mfu, mfu_pct=mfu and 100 * mfu, tflops=median("tflops"),
                mem=max((x["mem_gb"] for x in rows if x.get("mem_gb") is not None), default=None),
                reserved=max((x["mem_reserved_gb"] for x in rows if x.get("mem_reserved_gb") is not None),
                             default=None)), status


def run_hf(r, tmp, preset, overrides, micro, compiled):
    """bench/gpu/hf.py in a child: Hugging Face's tokens/s, memory and attention implementation, status."""
    cfg = common.preset_config(preset, **overrides)
    out, log = tmp / f"hf-{preset}-{compiled}.jsonl", tmp / f"hf-{preset}.log"
    spec = {"cfg": cfg.__dict__, "micro": micro, "steps": r.steps, "compiled": compiled, "device": r.device.type,
            "dtype": r.dtype}
    status = child([sys.executable, "-m", "bench.gpu.hf", json.dumps(spec), str(out)], r.deadline(compiled), log)
    rows, status = finished(r, out, status)
    dt = common.median([x["dt"] for x in rows])
    return dict(tok_s=dt and micro * cfg.seq_len / dt, attn=rows[-1]["attn"] if rows else None,
                mem=rows[-1]["mem"] if rows else None, reserved=rows[-1]["reserved"] if rows else None), status

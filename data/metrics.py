"""What a run records: a JSON line per step, the console, the summary, memory, a profiler trace.

Per step (rank 0, --metrics): step, loss, lr, grad_norm, tokens, dt_s, tok_s, tflops, mfu, hfu,
mem_gb, mem_reserved_gb, comm_gb; val_loss after an evaluation. The run's summary is the last line.
"""
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

import model
from data import SaveError, TrainingFailure
from data.files import open_append
from parallel import ckpt
from parallel.memory import CPUMemory


def open_metrics(run):
    """Rank 0's --metrics file, opened to append before anything is written: a regular file, never
    through a link, and new, empty or a metrics file (never another run's meta.json, say)."""
    if run.rank != 0:
        return None
    try:
        Path(run.metrics).parent.mkdir(parents=True, exist_ok=True)
        f = open_append(run.metrics, run.out)
    except OSError as e:
        raise SaveError(f"--metrics: {run.metrics}: {e.strerror or e}") from None
    if not is_metrics(run.metrics):
        f.close()
        raise SaveError(f"--metrics: {run.metrics} is not a metrics file (its first line is no "
                        "step row or summary): a run appends only to its own kind; choose another")
    return f


def is_metrics(path):
    """Whether a file is empty or its first line is a JSON step row or summary."""
    with open(path, "rb") as f:
        first = f.readline(1 << 20)
    try:
        row = json.loads(first) if first else {"summary": None}
    except ValueError:
        return False
    return isinstance(row, dict) and ({"step", "loss"} <= row.keys() or "summary" in row)


class StepLog:
    """The per-step rows, the tqdm bar, the console lines, and the summary at the end."""

    def __init__(self, run, cfg, mesh, start, trainer, metrics_file):
        self.run, self.cfg, self.mesh, self.rank = run, cfg, mesh, mesh.global_rank
        self.device = torch.device(run.device)
        self.peak, peak_source = peak_flops(run)
        self.tokens = run.global_batch * cfg.seq_len
        recomputed = ckpt.recomputed_layers(cfg, run.ckpt)
        self.flops_model = model.flops_per_token(cfg) * self.tokens  # MFU's: 6N + 12·L·d·T a token
        self.flops_hw = model.flops_per_token(cfg, recomputed_layers=recomputed) * self.tokens
        self.metrics, self.rows, self.t0 = metrics_file, [], time.perf_counter()
        # CPU: no allocator counts, so an eager step counts its own tensors (a dispatch mode, under
        # which a compiled step would run eagerly: a compiled CPU run reports no memory)
        cpu = self.device.type == "cpu"
        self.cpu_memory = CPUMemory(trainer, count=not run.compile) if cpu else None
        if self.rank == 0:
            n_total, n_non_emb = model.param_counts(cfg)
            print(f"model {run.model}: {n_total / 1e6:.1f}M params ({n_non_emb / 1e6:.1f}M "
                  f"non-embedding), {self.flops_model / self.tokens / 1e6:.1f} MFLOP/token; peak "
                  f"{self.peak / 1e12:.3f} TFLOP/s from {peak_source}; {run.global_batch} x "
                  f"{cfg.seq_len} tokens per step", flush=True)
        self.bar = tqdm(range(start, run.steps), initial=start, total=run.steps, dynamic_ncols=True,
                        disable=self.rank != 0 or not sys.stderr.isatty())  # a file: the lines only

    def start_step(self):
        self.mesh.stats.reset()  # comm_gb counts this step's traffic only
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)  # mem_gb is this step's peak
        return time.perf_counter()

    def end_step(self, step, loss, health, trainer, t0, input_s=0.0):
        """The step's row, from one host read: the health, the loss scale and the global loss.
        input_s: the seconds the step waited for its batch (the loader's)."""
        values = [health, trainer.scaler.scale.reshape(1), loss.reshape(1)]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the optimizer step has finished: dt_s covers it
        grad_norm, overflow, bad_losses, sigint, sigterm, scale, loss = torch.cat(values).tolist()
        dt, world = time.perf_counter() - t0, self.mesh.world
        mfu = self.flops_model / dt / world / self.peak if self.peak else None
        hfu = self.flops_hw / dt / world / self.peak if self.peak else None
        row = {"step": step + 1, "loss": loss, "lr": trainer.opt.param_groups[0]["lr"],
               "grad_norm": grad_norm, "tokens": self.tokens, "dt_s": dt, "tok_s": self.tokens / dt,
               "tflops": self.flops_model / dt / world / 1e12, "mfu": mfu, "hfu": hfu,
               **(self.cpu_memory.gb() if self.cpu_memory else cuda_memory_gb(self.device)),
               "comm_gb": self.mesh.stats.total_bytes / 1e9, "input_s": input_s,
               "comm_wait_s": self.mesh.stats.wait_s, "pp_wait_s": self.mesh.stats.idle_s,
               "bad_losses": bad_losses, "stop_votes": (sigint, sigterm)}
        if trainer.scaler.enabled:
            row.update(loss_scale=scale, skipped=bool(overflow))  # the scale after this step
        return row

    def write(self, row):
        del row["bad_losses"]
        row["elapsed_s"] = time.perf_counter() - self.t0  # since the loop began, evaluations too
        self.rows.append(row)
        self.append(row)
        mfu = "n/a" if row["mfu"] is None else f"{row['mfu']:.1%}"
        self.bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tok_s']:.0f}", mfu=mfu)
        if self.rank == 0 and self.run.log_every and row["step"] % self.run.log_every == 0:
            extra = f" val {row['val_loss']:.4f}" if "val_loss" in row else ""
            mem = "n/a" if row["mem_gb"] is None else f"{row['mem_gb']:.2f} GB"
            self.bar.write(f"step {row['step']}: loss {row['loss']:.4f}{extra} lr {row['lr']:.2e} "
                           f"norm {row['grad_norm']:.3f} {row['tok_s']:.0f} tok/s mfu {mfu} "
                           f"mem {mem}")

    def close(self, out):
        """The summary (rank 0: printed, and the last metrics line). Returns every step's loss."""
        self.bar.close()
        if self.rank == 0 and self.rows:
            summary = run_summary(self.rows, time.perf_counter() - self.t0, out, self.run.flags,
                                  self.run.target_loss)
            # what bench/compare.py needs to price the run with the planner
            summary.update(resolved={k: v for k, v in vars(self.run).items() if k != "flags"},
                           model=dict(self.cfg.__dict__), gpu=gpu_name(self.run))
            self.bar.write(summary_line(summary))
            self.append({"summary": summary})
        if self.metrics:
            self.metrics.close()
        return [row["loss"] for row in self.rows]

    def append(self, line):
        """One JSON line into --metrics (rank 0). A full disk stops the run: exit 3."""
        if not self.metrics:
            return
        fd, data = self.metrics.fileno(), (json.dumps(line) + "\n").encode()
        whole = os.fstat(fd).st_size  # the file as it was: whole lines
        try:
            written = 0
            while written < len(data):  # unbuffered: nothing is left to flush at close
                written += os.write(fd, data[written:])
        except OSError as e:
            try:
                os.ftruncate(fd, whole)  # no torn line left behind
            except OSError:
                pass
            self.metrics.close()
            self.metrics = None
            raise TrainingFailure(f"--metrics: cannot write {self.run.metrics}: "
                                  f"{e.strerror or e}") from None


def read_metrics(path):
    """(the step rows of a --metrics file's newest run, the summaries of its attempts, newest last).
    Runs that shared the file (--metrics) are not spliced: the newest's rows follow the last
    summary another run folder wrote."""
    lines = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    ends = [(i, r["summary"]) for i, r in enumerate(lines) if "summary" in r]
    last = ends[-1][1] if ends else None
    newest = last.get("run") if isinstance(last, dict) else None
    others = [i + 1 for i, s in ends if isinstance(s, dict) and s.get("run") != newest]
    start = max(others, default=0)
    return ([r for r in lines[start:] if "summary" not in r],
            [s for i, s in ends if i >= start])


def run_summary(rows, wall_s, out, flags, target_loss=None):
    """The last train and val loss, the median tok/s and MFU (without the first step, which
    compiles, when there are others), the peak memory, the wall time, the flags. With a target
    loss: where the val loss first reached it, or the best it reached."""
    timed = rows[1:] or rows

    def median(key):
        return statistics.median(r[key] for r in timed) if timed[0][key] is not None else None

    def share(key):  # the median share of a step's time
        return statistics.median(r.get(key, 0.0) / r["dt_s"] for r in timed)
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    summary = {"run": str(out), "steps": rows[-1]["step"], "loss": rows[-1]["loss"],
               "val_loss": val[-1] if val else None, "tok_s": median("tok_s"), "mfu": median("mfu"),
               "mem_gb": max((r["mem_gb"] for r in rows if r["mem_gb"] is not None), default=None),
               "wall_s": wall_s, "flags": flags, "input_share": share("input_s"),
               "comm_wait_share": share("comm_wait_s"), "pp_wait_share": share("pp_wait_s")}
    if target_loss is not None:
        summary["target"] = time_to_target([r for r in rows if "val_loss" in r], target_loss)
    return summary


def time_to_target(evals, target):
    """{loss, reached, step, tokens, elapsed_s}: the first evaluation at or below target, or the
    best one (reached False)."""
    hit = next((r for r in evals if r["val_loss"] <= target), None)
    best = hit or min(evals, key=lambda r: r["val_loss"], default=None)
    if best is None:
        return {"loss": target, "reached": False, "step": None, "tokens": None, "elapsed_s": None,
                "val_loss": None}
    return {"loss": target, "reached": hit is not None, "step": best["step"],
            "tokens": best["step"] * best["tokens"], "elapsed_s": best["elapsed_s"],
            "val_loss": best["val_loss"]}


def summary_line(s):
    val = f", val {s['val_loss']:.4f}" if s["val_loss"] is not None else ""
    mfu = f", MFU {s['mfu']:.1%}" if s["mfu"] is not None else ""
    mem = f", peak memory {s['mem_gb']:.2f} GB" if s["mem_gb"] is not None else ""
    line = (f"done: step {s['steps']}, loss {s['loss']:.4f}{val}, {s['tok_s']:.0f} tok/s{mfu}"
            f"{mem}, {s['wall_s']:.0f} s, in {s['run']}")
    return line + ("\n" + target_line(s["target"]) if "target" in s else "")


def target_line(t):
    if t["reached"]:
        return (f"target: val {t['val_loss']:.4f} <= {t['loss']:g} first at step {t['step']}, "
                f"{t['tokens']:,} tokens, {t['elapsed_s']:.0f} s")
    if t["step"] is None:
        return f"target: val {t['loss']:g} not reached: no evaluation ran"
    return (f"target: val {t['loss']:g} not reached; best {t['val_loss']:.4f} at step {t['step']}, "
            f"{t['tokens']:,} tokens, {t['elapsed_s']:.0f} s")


# ---------------------------------------------------------------- the device's peak, and memory

# Dense bf16 tensor-core peaks in TFLOP/s, by the full name torch.cuda.get_device_name() reports
PEAK_TFLOPS = {
    "NVIDIA H100 80GB HBM3": 989.4, "NVIDIA H100 PCIe": 756.0, "NVIDIA H100 NVL": 835.0,
    "NVIDIA H200": 989.4, "NVIDIA H200 NVL": 835.0, "NVIDIA GH200 480GB": 989.4,
    "NVIDIA H800": 989.4,
    "NVIDIA A100-SXM4-80GB": 312.0, "NVIDIA A100-SXM4-40GB": 312.0, "NVIDIA A100 80GB PCIe": 312.0,
    "NVIDIA A100-PCIE-40GB": 312.0, "NVIDIA L4": 121.0, "NVIDIA L40": 181.0, "NVIDIA L40S": 362.0,
    "NVIDIA A10G": 125.0, "NVIDIA GeForce RTX 4090": 165.2,
}


def gpu_name(run):
    """The GPU's full name, or None on a CPU."""
    return torch.cuda.get_device_name(run.device) if run.backend == "nccl" else None


def peak_flops(run):
    """Per-device peak FLOP/s and where it came from: --peak-tflops, or the table by the GPU's name.

    A CPU has no honest peak (a measured matmul rate moved 70x between runs on shared cores), so
    MFU is shown there only with --peak-tflops.
    """
    if run.peak_tflops:
        return run.peak_tflops * 1e12, "--peak-tflops"
    if run.backend == "nccl":
        name = torch.cuda.get_device_name(run.device)
        if name in PEAK_TFLOPS:
            return PEAK_TFLOPS[name] * 1e12, f"{name} bf16 dense peak"
        return 0.0, f"{name} is not in the peak table; pass --peak-tflops"
    return 0.0, "no peak for a CPU: pass --peak-tflops for MFU"




def cuda_memory_gb(device):
    """The step's peak of allocated and reserved memory (the caching allocator's)."""
    return {"mem_gb": torch.cuda.max_memory_allocated(device) / 1e9,
            "mem_reserved_gb": torch.cuda.max_memory_reserved(device) / 1e9}


# ---------------------------------------------------------------- profiler

class NoProfiler:
    def step(self):
        pass

    def stop(self):
        pass


def start_profiler(enabled, out, rank):
    """--profile: a Chrome trace (OUT/trace_rank{r}.json) of steps 3-5 (step 1 compiles and warms
    up, step 2 warms the profiler)."""
    if not enabled:
        return NoProfiler()
    out.mkdir(parents=True, exist_ok=True)
    profiler = torch.profiler.profile(
        schedule=torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(str(out / f"trace_rank{rank}.json")))
    profiler.start()
    return profiler

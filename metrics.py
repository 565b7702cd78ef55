"""What a run records: a JSON line per step, the console, the summary, memory, a profiler trace.

Per step (rank 0, --metrics): step, loss, lr, grad_norm, tokens, dt_s, tok_s, tflops, mfu, hfu,
mem_gb, mem_reserved_gb, comm_gb; val_loss after an evaluation. The run's summary is the last line.
"""
import json
import os
import statistics
import time
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from tqdm import tqdm

import machine
import model
import optim
from bench.planner.layout import Cluster, Layout, invalid
from bench.planner.plan import error_bars
from config import UsageError
from data.files import open_append
from parallel import ckpt
from parallel.pp_schedule import chunks_per_rank
from saves import TrainingFailure


def open_metrics(run):
    """Rank 0's --metrics file, opened to append before anything is written: a regular file, never
    through a link out of the run folder."""
    if run.rank != 0:
        return None
    try:
        Path(run.metrics).parent.mkdir(parents=True, exist_ok=True)
        return open_append(run.metrics, run.out)
    except OSError as e:
        raise UsageError(f"--metrics: {run.metrics}: {e.strerror or e}") from None


class StepLog:
    """The per-step rows, the tqdm bar, the console lines, and the summary at the end."""

    def __init__(self, run, cfg, mesh, start, trainer, metrics_file):
        self.run, self.cfg, self.mesh, self.rank = run, cfg, mesh, mesh.global_rank
        self.device = torch.device(run.device)
        self.peak, peak_source = machine.peak_flops(run)
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
            if run.warmup >= run.steps:
                last = optim.lr_at(run.steps - 1, run.lr, run.min_lr, run.warmup, run.steps,
                                   run.warmdown)
                print(f"note: --warmup {run.warmup} >= --steps {run.steps}: the learning rate "
                      f"never reaches --lr {run.lr:g} (it ends at {last:.3g})", flush=True)
        self.bar = tqdm(range(start, run.steps), initial=start, total=run.steps,
                        disable=self.rank != 0, dynamic_ncols=True)

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
        grad_norm, overflow, bad_losses, scale, loss = torch.cat(values).tolist()
        dt, world = time.perf_counter() - t0, self.mesh.world
        mfu = self.flops_model / dt / world / self.peak if self.peak else None
        hfu = self.flops_hw / dt / world / self.peak if self.peak else None
        row = {"step": step + 1, "loss": loss, "lr": trainer.opt.param_groups[0]["lr"],
               "grad_norm": grad_norm, "tokens": self.tokens, "dt_s": dt, "tok_s": self.tokens / dt,
               "tflops": self.flops_model / dt / world / 1e12, "mfu": mfu, "hfu": hfu,
               **(self.cpu_memory.gb() if self.cpu_memory else cuda_memory_gb(self.device)),
               "comm_gb": self.mesh.stats.total_bytes / 1e9, "input_s": input_s,
               "comm_wait_s": self.mesh.stats.wait_s, "pp_wait_s": self.mesh.stats.idle_s,
               "bad_losses": bad_losses}
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
            summary["expected_mfu"] = expected_mfu(self.run, self.cfg)
            self.bar.write(summary_line(summary))
            if summary["expected_mfu"] and summary["mfu"] is not None:
                self.bar.write(speed_line(summary))
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
    """(the step rows of a --metrics file, the summaries of the runs that wrote it, newest last)."""
    lines = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [r for r in lines if "summary" not in r], [r["summary"] for r in lines if "summary" in r]


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


def expected_mfu(run, cfg):
    """[pessimistic, optimistic] MFU the planner predicts for this model, layout and GPU (its
    factors' range, --code ours), or None: a CPU, a GPU it has no figures for, a layout it does
    not price."""
    spec, (peak, _) = machine.SPECS.get(machine.gpu_name(run)), machine.peak_flops(run)
    if spec is None or not peak:
        return None
    hbm_gb, hbm_tbs, nvlink_gbs = spec
    cluster = Cluster(run.world, max(run.ranks_here, run.tp), hbm_gb=hbm_gb,
                      peak_tflops=peak / 1e12, intra_gbs=nvlink_gbs, hbm_tbs=hbm_tbs)
    kind = ckpt.parse(run.ckpt)[0]
    layout = Layout(dp=run.dp, tp=run.tp, pp=run.pp, cp=run.cp, dp_mode=run.dp_mode,
                    shard=(run.dp_shard or 0) * run.cp, micro=run.micro_batch,
                    ckpt=kind if kind in ("none", "selective") else "full",
                    schedule=run.pp_schedule,
                    V=chunks_per_rank(run.pp_schedule, run.pp_virtual) if run.pp > 1 else 1,
                    cp_mode=run.cp_mode, sp=run.sp, overlap=run.overlap, accumulate=run.accumulate,
                    fp8=run.dtype == "fp8")
    if invalid(cfg, cluster, layout, cfg.seq_len, run.global_batch, "ours"):
        return None
    return list(error_bars(cfg, cluster, layout, cfg.seq_len, run.global_batch, "ours")["all"])


WAITS = {"input_share": "input-bound: the step waited for its batch",
         "comm_wait_share": "exposed communication: the step waited in collectives",
         "pp_wait_share": "pipeline bubble: stages waited for their neighbours"}


def speed_line(s):
    """The measured MFU beside the planner's range; below it, the largest measured wait."""
    low, high = s["expected_mfu"]
    said = (f"speed: MFU {s['mfu']:.1%}; the planner predicts {low:.1%}-{high:.1%} for this "
            "model, layout and GPU")
    if s["mfu"] >= low:
        return said + (": within it" if s["mfu"] <= high else ": above it")
    why = max(WAITS, key=lambda k: s[k])
    if s[why] < 0.05:
        return said + ": below it, and no wait explains it (the kernels, compilation, the clocks)"
    return said + f": below it; {WAITS[why]} {s[why]:.0%} of its time"


def target_line(t):
    if t["reached"]:
        return (f"target: val {t['val_loss']:.4f} <= {t['loss']:g} first at step {t['step']}, "
                f"{t['tokens']:,} tokens, {t['elapsed_s']:.0f} s")
    if t["step"] is None:
        return f"target: val {t['loss']:g} not reached: no evaluation ran"
    return (f"target: val {t['loss']:g} not reached; best {t['val_loss']:.4f} at step {t['step']}, "
            f"{t['tokens']:,} tokens, {t['elapsed_s']:.0f} s")


# ---------------------------------------------------------------- memory

def cuda_memory_gb(device):
    """The step's peak of allocated and reserved memory (the caching allocator's)."""
    return {"mem_gb": torch.cuda.max_memory_allocated(device) / 1e9,
            "mem_reserved_gb": torch.cuda.max_memory_reserved(device) / 1e9}


class CPUMemory:
    """mem_gb on CPU: the tensors the run keeps (weights, gradients, Adam's state) plus the peak of
    what a step allocates, counted once, in the first step (every step is the same).
    count=False (a compiled run): nothing is counted, mem_gb is None."""

    def __init__(self, trainer, count=True):
        self.trainer, self.peak, self.counting = trainer, None, LiveBytes() if count else None
        if count:
            self.counting.__enter__()

    def gb(self):
        if self.counting is None:
            return {"mem_gb": None, "mem_reserved_gb": None}
        if self.peak is None:
            self.counting.__exit__(None, None, None)
            t = self.trainer
            params = list(t.wrapper.optim_params())
            kept = params + [p.grad for p in params if p.grad is not None]
            kept += [v for s in t.opt.state.values() for v in s.values()
                     if isinstance(v, torch.Tensor)]
            self.peak = (storage_bytes(kept) + self.counting.peak) / 1e9
        return {"mem_gb": self.peak, "mem_reserved_gb": None}


def storage_bytes(tensors):
    """Bytes of the distinct storages behind the tensors: views of one buffer count once. None and
    meta tensors, which hold no memory, are skipped."""
    storages = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and not t.is_meta:
            storage = t.untyped_storage()
            storages[id(storage)] = storage  # held here, so ids stay distinct
    return sum(s.nbytes() for s in storages.values())


class StorageMode(TorchDispatchMode):
    """A dispatch mode that also hears of every UntypedStorage.resize_ while active, through
    resized(storage, bytes before). The pipeline frees what it sent that way (parallel/pp.py); no
    finalizer sees it."""

    def __enter__(self):
        self.resize = resize = torch.UntypedStorage.resize_

        def counted(storage, n):
            before = storage.nbytes()
            out = resize(storage, n)
            self.resized(storage, before)
            return out
        torch.UntypedStorage.resize_ = counted
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self.resize
        return super().__exit__(*exc)

    def resized(self, storage, before):
        raise NotImplementedError


class LiveBytes(StorageMode):
    """Bytes of the storages that ops create while it is active, from creation until freed or
    resized; `peak` is the most at once. A finalizer on each storage marks its free."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak = {}, 0, 0

    def _free(self, key):
        self.now -= self.live.pop(key)

    def resized(self, storage, before):
        key = id(storage)
        if key in self.live:
            self.live[key] = storage.nbytes()
            self.now += storage.nbytes() - before
            self.peak = max(self.peak, self.now)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key, n = id(storage), storage.nbytes()
            if n and key not in inputs and key not in self.live:  # not a view, not in place
                self.live[key] = n
                self.now += n
                weakref.finalize(storage, self._free, key)
        self.peak = max(self.peak, self.now)
        return out


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

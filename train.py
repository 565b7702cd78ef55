"""Train a Llama-style GPT on any (dp x pp x cp x tp) layout.

    python train.py --model tiny --steps 200                      # one process, CPU or GPU
    torchrun --nproc_per_node 8 train.py --model small --tp 2 --dp-mode fsdp

Flags -> mesh -> model on the meta device -> pp.split -> tp -> cp -> activation checkpointing -> (zb1/zbv) the
backward split -> data-parallel wrap (which materializes this rank's weights) -> loop. The global batch at each
step is a function of (seed, step) only, and the loss is the mean over all its tokens, so every layout trains the
same model as one process.
"""
import json
import math
import os
import signal
import statistics
import sys
import threading
import time
import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from tqdm import tqdm

import config
import dry_run
import fp8
import model as M
import optim
from config import DTYPES, UsageError
from data.loader import DataError, TokenLoader
from data.prepare import prepared_folder
from parallel import ckpt, cp, ddp, fsdp, fsdp_accumulate, hsdp, pp, pp_bw_split, tp, tp_ring
from parallel.comm import ALL_GATHER
from parallel.mesh import LayoutError, Mesh
from saves import SaveError, TrainingFailure
from saves.restarts import restart_store
from saves.run import RunFolder

DATA_PARALLEL = {"ddp": ddp.wrap, "fsdp": fsdp.wrap, "hsdp": hsdp.wrap}


@dataclass
class Trainer:
    """What one training step touches: this rank's model chunks, their data-parallel wrapper, the optimizer."""
    chunks: list
    wrapper: object  # the protocol in parallel/__init__.py
    mesh: Mesh
    opt: torch.optim.Optimizer
    scaler: optim.LossScaler
    autocast: object
    micro_batch: int
    dtype: torch.dtype  # the compute dtype: matmul inputs, the residual stream, what tp, sp, pp and cp send


def build(cfg, mesh, run):
    """The model this rank runs: (its pipeline chunks, the data-parallel wrapper that owns their weights). Each
    parallelism, then each optional layer the run switches on, changes the chunks on the meta device; the wrapper
    materializes this rank's part of the weights last."""
    with torch.device("meta"):
        full = M.GPT(cfg)  # shapes only: no rank ever holds the whole model
    chunks = pp.split(full, mesh, run.micro_batches, run.pp_schedule, run.pp_virtual, run.pp_split) if mesh.pp > 1 \
        else [full]
    for chunk in chunks:
        if mesh.tp > 1:
            tp.parallelize(chunk, mesh, sequence_parallel=run.sp, overlap=run.overlap)
        if run.tp_ring:  # --sp's collectives as ring hops under the matmuls
            tp_ring.apply(chunk)
        if mesh.cp > 1:
            cp.parallelize(chunk, mesh, mode=run.cp_mode)
        if run.dtype == "fp8":  # the block matmuls; scales reduced over the groups that split their tensors
            fp8.apply(chunk, mesh.tp_group, mesh.cp_group)
        ckpt.apply(chunk, run.ckpt)
        if mesh.pp > 1 and run.pp_schedule in ("zb1", "zbv"):  # weight gradients wait for the schedule's W
            pp_bw_split.apply(chunk)
        if run.compile:  # before FSDP wraps the chunk's parts: its gather/free bookkeeping stays eager
            if run.ckpt == "selective":  # what a compiled block saves is the compiler's choice: steer it
                ckpt.selective_in_graph(chunk)
            compile_parts(chunk, final_norm=run.ckpt != "selective")

    def init_param(name, meta, flat=None, out=None):  # this rank's part of a weight's initial value, no more
        return M.local_init(name, meta, cfg, run.seed, flat, out)
    dp_options = dict(bucket_mb=run.bucket_mb) if run.dp_mode == "ddp" else dict(
        compute_dtype=DTYPES[run.dtype], reduce_dtype=DTYPES[run.reduce_dtype])
    if run.accumulate == "unsharded":  # a step's gradients summed unsharded, reduce-scattered once
        dp_options["cls"] = fsdp_accumulate.unsharded(hsdp.HSDP if run.dp_mode == "hsdp" else fsdp.FSDP)
    wrapper = DATA_PARALLEL[run.dp_mode](nn.ModuleList(chunks), mesh, torch.device(run.device), init_param,
                                         overlap=run.overlap, **dp_options)
    return chunks, fp8.gather_in_fp8(wrapper, mesh.tp_group) if run.fp8_all_gather else wrapper


def compile_parts(chunk, final_norm=True):
    """torch.compile each part of the chunk that holds its math: every block's forward, the embedding, the final norm
    and the loss (the chunked cross-entropy, forward and backward). What joins the parts stays eager: RoPE's cache,
    the head's one matmul, the pipeline's hand-offs, and every collective, around which a compiled part breaks its
    graph (parallel/comm.py). No compiled part reads the device back to the host: a step keeps its one host read.
    final_norm=False (--ckpt selective) leaves the final norm eager: its output goes to the head's eager matmul, and
    only from eager autograd can selective's rule take it (parallel/ckpt.py)."""
    for block in chunk.layers.values():
        block.forward = torch.compile(block.forward)
    # The embedding's and the loss's frames of their own (lambdas): torch.compile cannot start in torch.nn's forward
    # or in a partial, and would run both in one shared wrapper frame whose recompiles would turn shapes dynamic
    if chunk.embed_tokens is not None:  # the first pipeline stage
        embed = chunk.embed_tokens.forward
        chunk.embed_tokens.forward = torch.compile(lambda ids: embed(ids))
    if chunk.lm_head is not None:  # the last
        if final_norm:
            chunk.norm.forward = torch.compile(chunk.norm.forward)
        loss = chunk.loss_fn
        chunk.loss_fn = torch.compile(lambda logits, targets: loss(logits, targets))


def prepare(run, cfg, mesh):
    """The Trainer of a resolved run: the model built and materialized, AdamW over the wrapper's fp32 tensors, the
    loss scaler (fp16) and the autocast of the compute dtype."""
    torch.manual_seed(run.seed)
    chunks, wrapper = build(cfg, mesh, run)
    device = torch.device(run.device)
    autocast = torch.autocast(device.type, dtype=DTYPES[run.dtype]) if run.dtype != "fp32" else nullcontext()
    opt = optim.make_adamw(wrapper.optim_params(), run.lr, run.weight_decay, device)
    return Trainer(chunks, wrapper, mesh, opt, optim.LossScaler(run.dtype == "fp16", device), autocast,
                   run.micro_batch, DTYPES[run.dtype])


def split_batch(x, y, micro_batch, mesh):
    """This rank's rows -> [(x, y)] micro-batches (this cp rank's tokens under cp) and their RoPE positions."""
    batches = list(zip(x.split(micro_batch), y.split(micro_batch)))
    return cp.shard_batches(batches, mesh) if mesh.cp > 1 else (batches, None)


def forward_backward(trainer, x, y):
    """Every micro-batch's forward and backward; returns their summed loss. Each micro-batch loss is a local mean
    divided by the accumulation count, and gradients are averaged over dp x cp: the mean over the global batch."""
    t = trainer
    batches, positions = split_batch(x, y, t.micro_batch, t.mesh)
    if t.mesh.pp > 1:  # the pipeline schedule runs them all (parallel/pp.py)
        return pp.train_step(t.chunks, t.wrapper, t.mesh, batches, positions, t.autocast, t.scaler.scale, t.dtype)
    total = torch.zeros((), device=x.device)
    for i, (xb, yb) in enumerate(batches):
        t.wrapper.sync_grads = i == len(batches) - 1  # the gradient reduction runs in the last backward
        with t.autocast:
            loss = t.chunks[0](xb, yb, positions) / len(batches)
        (loss * t.scaler.scale).backward()
        total += loss.detach()
    return total


def train_step(trainer, x, y, lr, grad_clip):
    """One optimizer step with no host sync. Returns, on the device, this rank's share of the loss and the step's
    health: [global gradient norm, 1 if the gradients overflowed (fp16 skips that step), ranks whose loss is not
    finite]."""
    for group in trainer.opt.param_groups:
        group["lr"] = lr
    loss = forward_backward(trainer, x, y)
    return loss, optimizer_step(trainer, loss, grad_clip)


def optimizer_step(trainer, loss, grad_clip):
    """After the last backward: the gradient sync, the clip by the global norm, AdamW (skipped on an fp16 overflow),
    the loss scale's update, the gradients zeroed. Returns the step's health on the device (see train_step)."""
    t = trainer
    t.wrapper.finish_grad_sync()  # waits for the reductions still in flight, averages over dp x cp
    grad_norm, bad_losses = optim.unscale_and_clip(t.wrapper.grads_for_norm(), t.mesh.world_group, t.scaler.scale,
                                                   grad_clip, (~torch.isfinite(loss)).float())
    overflow = (~torch.isfinite(grad_norm)).float()
    optim.optimizer_step(t.opt, overflow if t.scaler.enabled else None)
    t.scaler.update(overflow)
    t.wrapper.zero_grad()
    return torch.stack([grad_norm, overflow, bad_losses])


@torch.no_grad()
def evaluate(trainer, loader, n_batches):
    t = trainer
    total = torch.zeros((), device=t.scaler.scale.device)
    for step in range(n_batches):
        x, y = loader.get(step)
        batches, positions = split_batch(x, y, t.micro_batch, t.mesh)
        if t.mesh.pp > 1:
            total += pp.eval_step(t.chunks, t.wrapper, t.mesh, batches, positions, t.autocast, t.dtype)
            continue
        for xb, yb in batches:
            with t.autocast:
                total += t.chunks[0](xb, yb, positions) / len(batches)
    return replica_mean(total / n_batches, t.mesh).item()


def replica_mean(local_loss, mesh):
    """The global mean loss (or losses) from each rank's local mean, on the device: the sum over the tp-rank-0 ranks,
    in rank order, divided by dp x cp; only the last pipeline stage's are not exact zeros (it sits on pp rank P-1, or
    0 under zbv). Gathered and summed here rather than all-reduced, so the result does not depend on how many losses
    are reduced at once. Scalars: not counted as traffic."""
    if mesh.world == 1:
        return local_loss
    flat = local_loss.reshape(-1).contiguous()
    gathered = flat.new_empty(mesh.world * flat.numel())
    ALL_GATHER(gathered, flat, group=mesh.world_group.pg)
    gathered = gathered.view(mesh.world, -1)  # (world, n): row r is rank r's losses
    owners = range(0, mesh.world, mesh.tp)  # tp rank 0 of each tp group: tp is innermost
    total = gathered[owners[0]]
    for r in owners[1:]:
        total = total + gathered[r]
    return (total / mesh.dp_cp_group.size).reshape(local_loss.shape)


def train(run):
    """Trains the resolved run; returns every step's global mean loss."""
    mesh = start_distributed(run)
    data = prepared_folder(run.data, run.rank, run.world)
    model = config.model_for(run, data)  # the model, checked against every constraint and the device
    cfg = model.cfg
    folder = RunFolder(run.out, mesh, run.device, model.config, model.layout, run.resume, run.keep, run.async_save)
    try:
        loader = TokenLoader(data, "train", cfg.seq_len, run.global_batch, run.seed, mesh.coord["dp"], mesh.dp,
                             run.device)
        val_loader = TokenLoader(data, "val", cfg.seq_len, run.global_batch, run.seed, mesh.coord["dp"], mesh.dp,
                                 run.device, prefetch=False) if run.eval_every else None
        if run.rank == 0 and run.world > 1:
            print(mesh.describe(), flush=True)
        trainer = prepare(run, cfg, mesh)
        start = folder.start(trainer.wrapper, trainer.opt, trainer.scaler, model.weights)
    except BaseException:
        folder.close()
        raise
    if run.rank == 0:
        print(f"run folder: {run.out}", flush=True)
    log = StepLog(run, cfg, mesh, start, trainer)
    profiler = start_profiler(run.profile, Path(run.out), run.rank)
    try:
        with CtrlC() as ctrl_c:
            for step in log.bar:
                t0 = log.start_step()
                x, y = loader.get(step)
                local_loss, health = train_step(trainer, x, y, scheduled_lr(run, step), run.grad_clip)
                row = log.end_step(step, local_loss, health, trainer, t0)  # the step's one host read
                if row["bad_losses"] or (not trainer.scaler.enabled and not math.isfinite(row["grad_norm"])):
                    raise folder.non_finite(step + 1, replica_mean(local_loss, mesh).item(), row["grad_norm"])
                if run.eval_every and (step + 1) % run.eval_every == 0:
                    with startup_timeout(mesh, run, first=step + 1 == run.eval_every):
                        row["val_loss"] = evaluate(trainer, val_loader, run.eval_batches)
                if (run.save_every and (step + 1) % run.save_every == 0) or step + 1 == run.steps:
                    row["save_stall_s"] = folder.save(step + 1, trainer.wrapper, trainer.opt, trainer.scaler)
                folder.progress(step + 1)
                log.write(row)
                profiler.step()
                if step + 1 - start == STARTUP_STEPS:
                    mesh.set_timeout(run.timeout)  # compiled, every stage warm: a hang now is a real one
                if ctrl_c.pressed:
                    raise KeyboardInterrupt
        folder.finish()  # waits for the last async save
    except KeyboardInterrupt:
        raise Interrupted(folder.interrupted()) from None
    finally:
        profiler.stop()
        loader.close()  # joins its thread
        folder.close()
    losses = log.close(run.out)  # the last collective (the losses' gather); then no thread is left but the main one
    if run.world > 1:
        mesh.world_group.barrier()  # every rank is past every collective before main() destroys the group
    return losses


# ---------------------------------------------------------------- setup and bookkeeping around the loop

STARTUP_STEPS = 2  # steps that run under --startup-timeout (compiling, stage after stage), before --timeout


class Interrupted(Exception):
    """Ctrl-C: one line saying where the run stopped and which save is the newest (exit 130)."""


class CtrlC:
    """While the loop runs, Ctrl-C ends the step in progress, then stops the run; a second one stops it at once.
    Raised at once, the first could land in a finalizer (LiveBytes marks frees with them), where Python prints and
    drops it, and the run would go on. Nothing changes off the main thread (Python gives it no signal handler) or
    where SIGINT was ignored from the start (a job a shell started in the background)."""

    def __init__(self):
        self.pressed, self.previous = False, None

    def __enter__(self):
        main = threading.current_thread() is threading.main_thread()
        if main and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            self.previous = signal.signal(signal.SIGINT, self._press)
        return self

    def _press(self, signum, frame):
        if self.pressed:
            raise KeyboardInterrupt
        self.pressed = True

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


def start_distributed(run):
    """The process group (nccl on CUDA, gloo on CPU; under --startup-timeout until the first steps are done) and the
    mesh. A caller's group (tests) is used as it is."""
    if run.backend == "nccl":
        torch.cuda.set_device(run.device)
    matmul_precision(run)
    if run.world > 1 and not dist.is_initialized():
        dist.init_process_group(run.backend, timeout=timedelta(seconds=run.startup_timeout),
                                **restart_store(run.rank, run.world))
    return Mesh(run.rank, run.world, dp=run.dp, pp=run.pp, cp=run.cp, tp=run.tp, dp_shard=run.dp_shard,
                timeout_s=run.startup_timeout)


def matmul_precision(run):
    """fp32 means fp32: the matmuls that stay fp32 use TF32 tensor cores only where the run asks for it (run.tf32:
    bf16, fp16 and fp8 runs on CUDA, or --tf32)."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = run.tf32


@contextmanager
def startup_timeout(mesh, run, first):
    """Runs a block (the first evaluation, which compiles again) under --startup-timeout when `first`."""
    if first:
        mesh.set_timeout(run.startup_timeout)
    try:
        yield
    finally:
        if first:
            mesh.set_timeout(run.timeout)


def scheduled_lr(run, step):
    return optim.lr_at(step, run.lr, run.min_lr, run.warmup, run.steps)


class StepLog:
    """Per-step metrics (one JSON line each in --metrics, rank 0), the tqdm bar, the console lines, and the run's
    summary at the end (printed, and as the last metrics line)."""

    def __init__(self, run, cfg, mesh, start, trainer):
        self.run, self.mesh, self.device, self.rank = run, mesh, torch.device(run.device), mesh.global_rank
        self.peak, peak_source = config.peak_flops(run, cfg)
        self.tokens = run.global_batch * cfg.seq_len
        recomputed = ckpt.recomputed_layers(cfg, run.ckpt)
        self.flops_model = M.flops_per_token(cfg) * self.tokens  # MFU: PaLM's 6N + 12·L·d·T per token
        self.flops_hw = M.flops_per_token(cfg, recomputed_layers=recomputed) * self.tokens  # HFU adds recompute
        self.metrics, self.local_losses, self.rows, self.t0 = None, [], [], time.perf_counter()
        # On CPU no allocator counts: an eager step counts its own tensors (a dispatch mode, under which a compiled
        # step would run eagerly, so a compiled CPU run reports no memory)
        self.cpu_memory = CPUMemory(trainer, count=not run.compile) if self.device.type == "cpu" else None
        if self.rank == 0:
            Path(run.metrics).parent.mkdir(parents=True, exist_ok=True)
            self.metrics = open(run.metrics, "a")
            n_total, n_non_emb = M.param_counts(cfg)
            print(f"model {run.model}: {n_total / 1e6:.1f}M params ({n_non_emb / 1e6:.1f}M non-embedding), "
                  f"{self.flops_model / self.tokens / 1e6:.1f} MFLOP/token; peak {self.peak / 1e12:.3f} TFLOP/s from "
                  f"{peak_source}; {run.global_batch} x {cfg.seq_len} tokens per step", flush=True)
            if run.warmup >= run.steps:
                last = optim.lr_at(run.steps - 1, run.lr, run.min_lr, run.warmup, run.steps)
                print(f"note: --warmup {run.warmup} >= --steps {run.steps}: the learning rate never reaches --lr "
                      f"{run.lr:g} (it ends at {last:.3g})", flush=True)
        self.bar = tqdm(range(start, run.steps), initial=start, total=run.steps, disable=self.rank != 0,
                        dynamic_ncols=True)

    def start_step(self):
        self.mesh.stats.reset()  # comm_gb counts this step's traffic only
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)  # mem_gb is this step's peak
        return time.perf_counter()

    def end_step(self, step, local_loss, health, trainer, t0):
        """Reads the step's scalars in one transfer: the health, the loss scale and the loss (averaged over replicas on
        the device first)."""
        self.local_losses.append(local_loss)
        values = [health, trainer.scaler.scale.reshape(1), replica_mean(local_loss, self.mesh).reshape(1)]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the optimizer step has finished: dt_s covers all of it
        grad_norm, overflow, bad_losses, scale, loss = torch.cat(values).tolist()
        dt, world = time.perf_counter() - t0, self.mesh.world
        row = {"step": step + 1, "loss": loss, "lr": trainer.opt.param_groups[0]["lr"],
               "grad_norm": grad_norm, "tokens": self.tokens, "dt_s": dt, "tok_s": self.tokens / dt,
               "tflops": self.flops_model / dt / world / 1e12,
               "mfu": self.flops_model / dt / world / self.peak if self.peak else None,
               "hfu": self.flops_hw / dt / world / self.peak if self.peak else None,
               **(self.cpu_memory.gb() if self.cpu_memory else cuda_memory_gb(self.device)),
               "comm_gb": self.mesh.stats.total_bytes / 1e9, "bad_losses": bad_losses}
        if trainer.scaler.enabled:
            row.update(loss_scale=scale, skipped=bool(overflow))  # the scale after this step's update
        return row

    def write(self, row):
        del row["bad_losses"]
        self.rows.append(row)
        if self.metrics:
            self.metrics.write(json.dumps(row) + "\n")
            self.metrics.flush()
        mfu = "n/a" if row["mfu"] is None else f"{row['mfu']:.1%}"
        self.bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tok_s']:.0f}", mfu=mfu)
        if self.rank == 0 and self.run.log_every and row["step"] % self.run.log_every == 0:
            extra = f" val {row['val_loss']:.4f}" if "val_loss" in row else ""
            mem = "n/a" if row["mem_gb"] is None else f"{row['mem_gb']:.2f} GB"
            self.bar.write(f"step {row['step']}: loss {row['loss']:.4f}{extra} lr {row['lr']:.2e} norm "
                           f"{row['grad_norm']:.3f} {row['tok_s']:.0f} tok/s mfu {mfu} mem {mem}")

    def close(self, out):
        """The summary (rank 0: printed, and the last metrics line), then every step's global loss, read in one
        transfer."""
        self.bar.close()
        losses = replica_mean(torch.stack(self.local_losses), self.mesh).tolist() if self.local_losses else []
        if self.rank == 0 and self.rows:
            summary = run_summary(self.rows, time.perf_counter() - self.t0, out, self.run.flags)
            self.bar.write(summary_line(summary))
            self.metrics.write(json.dumps({"summary": summary}) + "\n")
        if self.metrics:
            self.metrics.close()
        return losses


def read_metrics(path):
    """(the step rows of a --metrics file, the summaries of the runs that wrote it, newest last)."""
    lines = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [r for r in lines if "summary" not in r], [r["summary"] for r in lines if "summary" in r]


def run_summary(rows, wall_s, out, flags):
    """What a run ends with: the last train and val loss, the median tok/s and MFU over its steps (the first, which
    compiles and warms up, left out when there are others), the peak memory, the wall time, its flags."""
    timed = rows[1:] or rows
    median = lambda key: statistics.median(r[key] for r in timed) if timed[0][key] is not None else None  # noqa
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    return {"run": str(out), "steps": rows[-1]["step"], "loss": rows[-1]["loss"], "val_loss": val[-1] if val else None,
            "tok_s": median("tok_s"), "mfu": median("mfu"),
            "mem_gb": max((r["mem_gb"] for r in rows if r["mem_gb"] is not None), default=None),
            "wall_s": wall_s, "flags": flags}


def summary_line(s):
    val = f", val {s['val_loss']:.4f}" if s["val_loss"] is not None else ""
    mfu = f", MFU {s['mfu']:.1%}" if s["mfu"] is not None else ""
    mem = f", peak memory {s['mem_gb']:.2f} GB" if s["mem_gb"] is not None else ""
    return f"done: step {s['steps']}, loss {s['loss']:.4f}{val}, {s['tok_s']:.0f} tok/s{mfu}{mem}, " \
           f"{s['wall_s']:.0f} s, in {s['run']}"


class CPUMemory:
    """mem_gb on CPU, where no allocator counts: the tensors the run keeps (weights, gradients, Adam's state) plus the
    peak of the bytes a step allocates, counted once, in the first step (LiveBytes), as every step is the same.
    count=False (a compiled run): nothing counted, mem_gb None."""

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
            kept = [p for p in t.wrapper.optim_params()] + [p.grad for p in t.wrapper.optim_params()
                                                             if p.grad is not None]
            kept += [v for s in t.opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
            self.peak = (storage_bytes(kept) + self.counting.peak) / 1e9
        return {"mem_gb": self.peak, "mem_reserved_gb": None}


def storage_bytes(tensors):
    """Bytes of the distinct storages behind the tensors (views of one buffer count once; None and meta tensors, which
    hold no memory and all share data_ptr 0, are skipped)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
                if isinstance(t, torch.Tensor) and not t.is_meta}.values())


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages that ops create while active, from creation until freed; `peak` is the maximum.
    A storage's Python object outlives every tensor using it (PyTorch keeps it), so a finalizer marks the free."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak = {}, 0, 0

    def _free(self, key):
        self.now -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key, n = storage.data_ptr(), storage.nbytes()
            if n and key not in inputs and key not in self.live:  # views and in-place results are not new
                self.live[key] = n
                self.now += n
                weakref.finalize(storage, self._free, key)
        self.peak = max(self.peak, self.now)
        return out


def cuda_memory_gb(device):
    """The step's peak of allocated and reserved memory (the caching allocator's)."""
    return {"mem_gb": torch.cuda.max_memory_allocated(device) / 1e9,
            "mem_reserved_gb": torch.cuda.max_memory_reserved(device) / 1e9}


class NoProfiler:
    def step(self):
        pass

    def stop(self):
        pass


def start_profiler(enabled, out, rank):
    """--profile: a Chrome trace in --out (trace_rank{r}.json) of steps 3-5 as the metrics number them (from 1): step
    1 compiles and warms up, step 2 warms the profiler."""
    if not enabled:
        return NoProfiler()
    out.mkdir(parents=True, exist_ok=True)
    profiler = torch.profiler.profile(
        schedule=torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(str(out / f"trace_rank{rank}.json")))
    profiler.start()
    return profiler


def report_to_launcher(error):
    """Under torchrun the error line also goes into this worker's error file: torchrun's report, which follows it on
    the console, then ends with it as the root cause instead of a pointer to its documentation."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        Path(path).write_text(json.dumps({"message": f"error: {error}", "timestamp": str(int(time.time()))}))


def main(argv=None):
    if "--dry-run" in (sys.argv[1:] if argv is None else argv):  # rehearse the step on fake GPUs (dry_run.py)
        sys.exit(dry_run.main(argv))
    joined = dist.is_initialized()  # a caller's process group (tests) outlives this run; our own does not
    try:
        return train(config.resolve(argv))
    except KeyboardInterrupt:
        code, error = 130, "interrupted before training started; nothing was written"
    except (UsageError, LayoutError, DataError, SaveError) as e:
        code, error = 2, e
    except TrainingFailure as e:
        code, error = 3, e
    except Interrupted as e:
        code, error = 130, e
    finally:
        if not joined and dist.is_initialized():
            dist.destroy_process_group()  # a clean exit: no collective thread is left to the interpreter's end
    report_to_launcher(error)
    if int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", 0))) == 0:  # one line per node
        print(f"error: {error}", file=sys.stderr)
    elif int(os.environ.get("WORLD_SIZE", 1)) > 1:
        time.sleep(1)  # torchrun stops every worker once one exits: let local rank 0's line get out first
    sys.exit(code)


if __name__ == "__main__":
    main()

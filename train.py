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
import resource
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

import fp8
import model as M
import optim
from config import (
    DTYPES,
    UsageError,
    check_fits,
    check_layout,
    check_writable,
    data_identity,
    device_defaults,
    model_config,
    parse_args,
    peak_flops,
    run_config,
    run_layout,
)
from data.loader import DataError, TokenLoader, read_meta
from data.prepare import prepared_folder
from parallel import ckpt, cp, ddp, fsdp, hsdp, pp, tp
from parallel.comm import ALL_GATHER
from parallel.mesh import LayoutError, Mesh
from saves import SaveError
from saves.hf import init_from, start_from
from saves.load import find_resume, resume
from saves.restarts import Attempts, NonFiniteLoss, TrainingFailure, restart_store, stop_run
from saves.write import SaveFailed, Saver, agree_on_run_id, check_fresh_run_folder, remove_incomplete

DATA_PARALLEL = {"ddp": ddp.wrap, "fsdp": fsdp.wrap, "hsdp": hsdp.wrap}


@dataclass
class Run:
    """What one training step touches: this rank's model chunks, their data-parallel wrapper, the optimizer."""
    chunks: list
    wrapper: object  # the protocol in parallel/__init__.py
    mesh: Mesh
    opt: torch.optim.Optimizer
    scaler: optim.LossScaler
    autocast: object
    micro_batch: int


def build(cfg, mesh, args, n_micro, device):
    """The model this rank runs: (its pipeline chunks, the data-parallel wrapper that owns their weights)."""
    with torch.device("meta"):
        full = M.GPT(cfg)  # shapes only: no rank ever holds the whole model
    chunks = pp.split(full, mesh, n_micro, args.pp_schedule, args.pp_virtual, args.pp_split) if mesh.pp > 1 \
        else [full]
    for chunk in chunks:
        if mesh.tp > 1:
            tp.parallelize(chunk, mesh, sequence_parallel=args.sp, overlap=not args.no_overlap)
        if mesh.cp > 1:
            cp.parallelize(chunk, mesh, mode=args.cp_mode)
        if args.dtype == "fp8":  # the block matmuls; scales reduced over the groups that split their tensors
            fp8.apply(chunk, [mesh.tp_group, mesh.cp_group])
        ckpt.apply(chunk, args.ckpt)
        if mesh.pp > 1:
            pp.split_backward(chunk)  # zb1, zbv: weight gradients deferred to the schedule's W actions
        if args.compile:  # the block's own forward, before FSDP wraps it: its bookkeeping stays eager
            for block in chunk.layers.values():
                block.forward = torch.compile(block.forward)
    def init_param(name, meta, flat=None, out=None):  # this rank's part of a weight's initial value, no more
        return M.local_init(name, meta, cfg, args.seed, flat, out)

    dp_options = dict(bucket_mb=args.bucket_mb) if args.dp_mode == "ddp" else dict(
        compute_dtype=DTYPES[args.dtype], reduce_dtype=DTYPES[args.reduce_dtype], accumulate=args.accumulate)
    wrapper = DATA_PARALLEL[args.dp_mode](nn.ModuleList(chunks), mesh, device, init_param,
                                          overlap=not args.no_overlap, **dp_options)
    return chunks, fp8.gather_in_fp8(wrapper, mesh.tp_group) if args.fp8_all_gather else wrapper


def split_batch(x, y, micro_batch, mesh):
    """This rank's rows -> [(x, y)] micro-batches (this cp rank's tokens under cp) and their RoPE positions."""
    batches = list(zip(x.split(micro_batch), y.split(micro_batch)))
    return cp.shard_batches(batches, mesh) if mesh.cp > 1 else (batches, None)


def forward_backward(run, x, y):
    """Every micro-batch's forward and backward; returns their summed loss. Each micro-batch loss is a local mean
    divided by the accumulation count, and gradients are averaged over dp x cp: the mean over the global batch."""
    batches, positions = split_batch(x, y, run.micro_batch, run.mesh)
    if run.mesh.pp > 1:  # the pipeline schedule runs them all (parallel/pp.py)
        return pp.train_step(run.chunks, run.wrapper, run.mesh, batches, positions, run.autocast, run.scaler.scale)
    total = torch.zeros((), device=x.device)
    for i, (xb, yb) in enumerate(batches):
        run.wrapper.sync_grads = i == len(batches) - 1  # the gradient reduction runs in the last backward
        with run.autocast:
            loss = run.chunks[0](xb, yb, positions) / len(batches)
        (loss * run.scaler.scale).backward()
        total += loss.detach()
    return total


def train_step(run, x, y, lr, grad_clip):
    """One optimizer step with no host sync. Returns, on the device, this rank's share of the loss and the step's
    health: [global gradient norm, 1 if the gradients overflowed (fp16 skips that step), ranks whose loss is not
    finite]."""
    for group in run.opt.param_groups:
        group["lr"] = lr
    loss = forward_backward(run, x, y)
    run.wrapper.finish_grad_sync()  # waits for the reductions still in flight, averages over dp x cp
    grad_norm, bad_losses = optim.unscale_and_clip(run.wrapper.grads_for_norm(), run.mesh.world_group,
                                                   run.scaler.scale, grad_clip, (~torch.isfinite(loss)).float())
    overflow = (~torch.isfinite(grad_norm)).float()
    optim.optimizer_step(run.opt, overflow if run.scaler.enabled else None)
    run.scaler.update(overflow)
    run.wrapper.zero_grad()
    return loss, torch.stack([grad_norm, overflow, bad_losses])


@torch.no_grad()
def evaluate(run, loader, n_batches):
    total = torch.zeros((), device=run.scaler.scale.device)
    for step in range(n_batches):
        x, y = loader.get(step)
        batches, positions = split_batch(x, y, run.micro_batch, run.mesh)
        if run.mesh.pp > 1:
            total += pp.eval_step(run.chunks, run.wrapper, run.mesh, batches, positions, run.autocast)
            continue
        for xb, yb in batches:
            with run.autocast:
                total += run.chunks[0](xb, yb, positions) / len(batches)
    return replica_mean(total / n_batches, run.mesh).item()


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
    owners = [r for r in range(mesh.world) if mesh.coords(r)["tp"] == 0]
    total = gathered[owners[0]]
    for r in owners[1:]:
        total = total + gathered[r]
    return (total / mesh.dp_cp_group.size).reshape(local_loss.shape)


def train(args):
    dp, n_micro = check_layout(args, int(os.environ.get("WORLD_SIZE", 1)))  # before any process group forms
    check_writable(args.out, "--out", folder=True)
    if args.metrics:
        check_writable(args.metrics, "--metrics", folder=False)
    rank, world, device = init_distributed(args)
    device_defaults(args, device)
    mesh = Mesh(rank, world, dp=dp, pp=args.pp, cp=args.cp, tp=args.tp, dp_shard=args.dp_shard)
    folder = prepared_folder(args.data, rank, world)
    meta = read_meta(folder)
    cfg, weights = init_from(args.init_from, model_config(args, meta["vocab_size"]), args)  # config.json checked
    check_fits(cfg, args, dp, device)  # before anything is built
    config, layout = run_config(args, cfg, meta, data_identity(folder / "meta.json")), run_layout(args, mesh)
    saved = find_resume(args.out, args.resume, config)  # validated before anything is written
    if args.resume is None:
        check_fresh_run_folder(args.out)  # a fresh run never writes into another run's folder
    attempts = Attempts(args.out, rank, resuming=args.resume is not None)
    attempts.check()
    loader = TokenLoader(folder, "train", cfg.seq_len, args.global_batch, args.seed, mesh.coord["dp"], mesh.dp,
                         device)
    val_loader = TokenLoader(folder, "val", cfg.seq_len, args.global_batch, args.seed, mesh.coord["dp"], mesh.dp,
                             device, prefetch=False) if args.eval_every else None
    if rank == 0 and world > 1:
        print(mesh.describe(), flush=True)

    torch.manual_seed(args.seed)
    chunks, wrapper = build(cfg, mesh, args, n_micro, device)
    autocast = torch.autocast(device.type, dtype=DTYPES[args.dtype]) if args.dtype != "fp32" else nullcontext()
    opt = optim.make_adamw(wrapper.optim_params(), args.lr, args.weight_decay, device)
    run = Run(chunks, wrapper, mesh, opt, optim.LossScaler(args.dtype == "fp16", device), autocast, args.micro_batch)
    start = start_from(weights, run.wrapper, opt, rank) if weights and not saved else \
        resume(saved, run.wrapper, opt, run.scaler, layout, rank)  # a save, once there is one, wins
    run_id = agree_on_run_id(mesh, device)  # a barrier too: every rank has read the run folder
    if rank == 0 and args.resume:
        remove_incomplete(args.out)
    attempts.begin(start)  # rank 0 writes the record
    saver = Saver(args.out, mesh, device, keep=args.keep, async_save=args.async_save, run_id=run_id)
    log = StepLog(args, cfg, mesh, device, start)
    profiler = start_profiler(args.profile, Path(args.out), rank)

    for step in log.bar:
        t0 = log.start_step()
        x, y = loader.get(step)
        local_loss, health = train_step(run, x, y, scheduled_lr(args, step), args.grad_clip)
        row = log.end_step(step, local_loss, health, run, t0)  # the step's one host read
        if row["bad_losses"] or (not run.scaler.enabled and not math.isfinite(row["grad_norm"])):
            loss = replica_mean(local_loss, mesh).item()
            raise stop_run(NonFiniteLoss(step + 1, loss, row["grad_norm"]), saver, attempts, args.out)
        if args.eval_every and (step + 1) % args.eval_every == 0:
            row["val_loss"] = evaluate(run, val_loader, args.eval_batches)
        if (args.save_every and (step + 1) % args.save_every == 0) or step + 1 == args.steps:
            row["save_stall_s"] = save(saver, step + 1, run, save_header(config, layout, run.scaler), attempts, args)
        attempts.progress(step + 1)
        log.write(row)
        profiler.step()
    save(saver, None, run, None, attempts, args)  # waits for the last async save
    attempts.end("done")
    profiler.stop()
    loader.close()
    return log.close()


# ---------------------------------------------------------------- setup and bookkeeping around the loop

def init_distributed(args):
    """Reads torchrun's RANK, WORLD_SIZE and LOCAL_RANK; nccl on CUDA, gloo on CPU."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", timeout=timedelta(minutes=5),
                                **restart_store(rank, world))
    return rank, world, torch.device(device)


def save_header(config, layout, scaler):
    return {"config": config, "layout": layout, "scaler": scaler.state_dict()}


def save(saver, step, run, header, attempts, args):
    """Saves (step None: waits for the save in flight); a failed save (a full disk) stops the run with exit 3,
    recorded in the attempts, naming the last good save. Returns the seconds training stalled."""
    try:
        return saver.wait() if step is None else saver.save(step, run.wrapper, run.opt, header)
    except SaveFailed as e:
        raise stop_run(e, saver, attempts, args.out) from None


def scheduled_lr(args, step):
    return optim.lr_at(step, args.lr, args.min_lr, args.warmup, args.steps)


class StepLog:
    """Per-step metrics (one JSON line each with --metrics, rank 0), the tqdm bar and the console lines."""

    def __init__(self, args, cfg, mesh, device, start):
        self.args, self.mesh, self.device, self.rank = args, mesh, device, mesh.global_rank
        self.peak, peak_source = peak_flops(args, device, cfg)
        self.tokens = args.global_batch * cfg.seq_len
        recomputed = ckpt.recomputed_layers(cfg, args.ckpt)
        self.flops_model = M.flops_per_token(cfg) * self.tokens  # MFU: PaLM's 6N + 12·L·d·T per token
        self.flops_hw = M.flops_per_token(cfg, recomputed_layers=recomputed) * self.tokens  # HFU adds recompute
        self.metrics, self.local_losses = None, []
        if args.metrics and self.rank == 0:
            Path(args.metrics).parent.mkdir(parents=True, exist_ok=True)
            self.metrics = open(args.metrics, "a")
        if self.rank == 0:
            n_total, n_non_emb = M.param_counts(cfg)
            print(f"model {args.model}: {n_total / 1e6:.1f}M params ({n_non_emb / 1e6:.1f}M non-embedding), "
                  f"{self.flops_model / self.tokens / 1e6:.1f} MFLOP/token; peak {self.peak / 1e12:.3f} TFLOP/s from "
                  f"{peak_source}; {args.global_batch} x {cfg.seq_len} tokens per step", flush=True)
        self.bar = tqdm(range(start, args.steps), initial=start, total=args.steps, disable=self.rank != 0,
                        dynamic_ncols=True)

    def start_step(self):
        self.mesh.stats.reset()  # comm_gb counts this step's traffic only
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)  # mem_gb is this step's peak
        return time.perf_counter()

    def logs(self, step):
        return bool(self.metrics) or bool(self.args.log_every and (step + 1) % self.args.log_every == 0)

    def end_step(self, step, local_loss, health, run, t0):
        """Reads the step's scalars in one transfer: the health, the loss scale, and on a step that logs, the loss
        (averaged over replicas on the device first). Other steps keep their loss on the device until the end."""
        self.local_losses.append(local_loss)
        logged = self.logs(step)  # the same on every rank: the all-reduce below is collective
        values = [health, run.scaler.scale.reshape(1)] + [replica_mean(local_loss, self.mesh).reshape(1)] * logged
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the optimizer step has finished: dt_s covers all of it
        grad_norm, overflow, bad_losses, scale, *loss = torch.cat(values).tolist()
        dt, world = time.perf_counter() - t0, self.mesh.world
        row = {"step": step + 1, "loss": loss[0] if loss else None, "lr": run.opt.param_groups[0]["lr"],
               "grad_norm": grad_norm, "tokens": self.tokens, "dt_s": dt, "tok_s": self.tokens / dt,
               "tflops": self.flops_model / dt / world / 1e12,
               "mfu": self.flops_model / dt / world / self.peak if self.peak else None,
               "hfu": self.flops_hw / dt / world / self.peak if self.peak else None,
               **memory_gb(self.device), "comm_gb": self.mesh.stats.total_bytes / 1e9, "bad_losses": bad_losses}
        if run.scaler.enabled:
            row.update(loss_scale=scale, skipped=bool(overflow))  # the scale after this step's update
        return row

    def write(self, row):
        del row["bad_losses"]
        if row["loss"] is None:  # a step that does not log
            return
        if self.metrics:
            self.metrics.write(json.dumps(row) + "\n")
            self.metrics.flush()
        self.bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{row['tok_s']:.0f}", mfu=f"{(row['mfu'] or 0):.1%}")
        if self.rank == 0 and self.args.log_every and row["step"] % self.args.log_every == 0:
            extra = f" val {row['val_loss']:.4f}" if "val_loss" in row else ""
            self.bar.write(f"step {row['step']}: loss {row['loss']:.4f}{extra} lr {row['lr']:.2e} norm "
                           f"{row['grad_norm']:.3f} {row['tok_s']:.0f} tok/s mfu {(row['mfu'] or 0):.2%} "
                           f"mem {row['mem_gb']:.2f} GB")

    def close(self):
        """Every step's global loss, read in one transfer at the end."""
        if self.metrics:
            self.metrics.close()
        if not self.local_losses:
            return []
        return replica_mean(torch.stack(self.local_losses), self.mesh).tolist()


def memory_gb(device):
    """The step's peak of allocated and reserved memory; on CPU, the process's peak resident size for both."""
    if device.type == "cuda":
        return {"mem_gb": torch.cuda.max_memory_allocated(device) / 1e9,
                "mem_reserved_gb": torch.cuda.max_memory_reserved(device) / 1e9}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KB on Linux
    return {"mem_gb": rss, "mem_reserved_gb": rss}


class NoProfiler:
    def step(self):
        pass

    def stop(self):
        pass


def start_profiler(enabled, out, rank):
    """--profile: a Chrome trace of steps 2-4 in --out (trace_rank{r}.json)."""
    if not enabled:
        return NoProfiler()
    out.mkdir(parents=True, exist_ok=True)
    profiler = torch.profiler.profile(
        schedule=torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(str(out / f"trace_rank{rank}.json")))
    profiler.start()
    return profiler


def main(argv=None):
    joined = dist.is_initialized()  # a caller's process group (tests) outlives this run; our own does not
    try:
        return train(parse_args(argv))
    except (UsageError, LayoutError, DataError, SaveError) as e:
        code, error = 2, e
    except TrainingFailure as e:
        code, error = 3, e
    finally:
        if not joined and dist.is_initialized():
            dist.destroy_process_group()  # a clean exit: no collective thread is left to the interpreter's end
    if int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", 0))) == 0:  # one line per node
        print(f"error: {error}", file=sys.stderr)
    elif int(os.environ.get("WORLD_SIZE", 1)) > 1:
        time.sleep(1)  # torchrun stops every worker once one exits: let local rank 0's line get out first
    sys.exit(code)


if __name__ == "__main__":
    main()

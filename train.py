"""Train a Llama-style GPT on any (dp x pp x cp x tp) layout.

    python train.py --model tiny --steps 200                      # one process, CPU or GPU
    torchrun --nproc_per_node 8 train.py --model small --dtype bf16 --tp 2 --dp-mode fsdp

Flags -> mesh -> model on the meta device -> pp.split -> tp -> cp -> ckpt -> materialize -> ddp|fsdp|hsdp
-> loop. The global batch at each step is a function of (seed, step) only, and the loss is the mean
over all its tokens, so every layout trains the same model (DESIGN 2.3).
"""
import importlib
import json
import math
import os
import resource
import sys
import time
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

import checkpoint
import faults
import model as M
import optim
import reshard
from checkpoint import CheckpointError
from config import DTYPES, UsageError, check_args, model_config, parse_args, peak_flops, run_config
from data.loader import DataError, TokenLoader
from parallel.mesh import LayoutError, Mesh, infer_dp

REPO = Path(__file__).resolve().parent


def data_folder(args, rank, world):
    """--data, or the offline pystdlib corpus, which rank 0 prepares on first use."""
    if args.data:
        folder = Path(args.data)
        if not (folder / "meta.json").exists():
            raise DataError(f"--data: {folder} is not a prepared data folder (no meta.json); "
                            "run python data/prepare.py NAME")
        return folder
    folder = REPO / "data" / "pystdlib"
    if not (folder / "meta.json").exists():
        if rank == 0:
            from data.prepare import prepare
            prepare("pystdlib", folder)
        if world > 1:
            dist.barrier()
    return folder


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


def restart_store(rank, world):
    """Under torchrun --max-restarts, the rendezvous store outlives a failed attempt, and its keys (a killed peer's
    address) would be read again: the new workers then wait on a dead port. Each attempt gets its own key prefix."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None:
        return {}
    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0 and not agent_hosts_it, timeout=timedelta(minutes=5))
    return {"store": dist.PrefixStore(f"attempt_{restart}", store), "rank": rank, "world_size": world}


def build_model(cfg, mesh, args, device):
    """Composition in DESIGN order. Returns (the model chunks this rank runs, the data-parallel wrapper)."""
    with torch.device("meta"):
        full = M.GPT(cfg)
    chunks = importlib.import_module("parallel.pp").split(full, mesh, args) if mesh.pp > 1 else [full]
    for chunk in chunks:
        if mesh.tp > 1:
            importlib.import_module("parallel.tp").parallelize(chunk, mesh, sequence_parallel=args.sp)
        if mesh.cp > 1:
            importlib.import_module("parallel.cp").parallelize(chunk, mesh, mode=args.cp_mode)
        if args.ckpt != "none":
            importlib.import_module("parallel.ckpt").apply(chunk, args.ckpt)
        if args.compile:  # the block's own forward, before FSDP wraps it: its bookkeeping stays eager
            for block in chunk.layers.values():
                block.forward = torch.compile(block.forward)
    module = nn.ModuleList(chunks)
    if args.dp_mode == "ddp":
        for chunk in chunks:
            M.init_weights(chunk, args.seed, device)
        from parallel.ddp import DDP
        wrapper = DDP(module, mesh, bucket_mb=args.bucket_mb, overlap=not args.no_overlap)
    else:
        dp_module = importlib.import_module(f"parallel.{args.dp_mode}")
        # FSDP materializes one unit at a time: init_param(global name, meta param) -> this rank's
        # (tp-local) initial tensor on CPU in fp32, the same values init_weights gives.
        wrapper = dp_module.wrap(module, mesh, args, device=device,
                                 init_param=lambda name, p: M.local_init(name, p, cfg, args.seed))
    return chunks, wrapper


def micro_batches(x, y, micro):
    return list(zip(x.split(micro), y.split(micro)))


def forward_backward(chunks, wrapper, mesh, x, y, args, autocast, loss_scale):
    """Runs every micro-batch of this rank's share of the global batch; returns the summed loss.
    Each micro-batch loss is a local mean divided by the accumulation count, and gradients are
    averaged over dp x cp, so the result is the mean over every token of the global batch."""
    batches = micro_batches(x, y, args.micro_batch)
    positions = None
    if mesh.cp > 1:
        cp = importlib.import_module("parallel.cp")
        batches, positions = cp.shard_batches(batches, mesh)
    if mesh.pp > 1:
        return importlib.import_module("parallel.pp").train_step(chunks, wrapper, mesh, batches, positions,
                                                                 autocast, loss_scale)
    model, total = chunks[0], torch.zeros((), device=x.device)
    for i, (xb, yb) in enumerate(batches):
        wrapper.sync_grads = i == len(batches) - 1
        with autocast:
            loss = model(xb, yb, positions) / len(batches)
        (loss * loss_scale).backward()
        total += loss.detach()
    return total


@torch.no_grad()
def evaluate(chunks, mesh, loader, args, autocast):
    total = 0.0
    for step in range(args.eval_batches):
        x, y = loader.get(step)
        batches = micro_batches(x, y, args.micro_batch)
        positions = None
        if mesh.cp > 1:
            batches, positions = importlib.import_module("parallel.cp").shard_batches(batches, mesh)
        if mesh.pp > 1:
            total += importlib.import_module("parallel.pp").eval_step(chunks, mesh, batches, positions, autocast)
            continue
        for xb, yb in batches:
            with autocast:
                total += chunks[0](xb, yb, positions).item() / len(batches)
    return mean_over_replicas(total / args.eval_batches, mesh, x.device)


def mean_over_replicas(local_loss, mesh, device):
    """The global mean loss from each rank's local mean: sum over the last pipeline stage's tp-rank-0
    ranks, divided by dp x cp. A scalar for logging, so it is not counted as traffic."""
    if mesh.world == 1:
        return float(local_loss)
    owns = mesh.coord["pp"] == mesh.pp - 1 and mesh.coord["tp"] == 0
    t = torch.tensor([float(local_loss) if owns else 0.0], device=device)
    dist.all_reduce(t, group=mesh.world_group.pg)
    return t.item() / mesh.dp_cp_group.size


def peak_memory_gb(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # peak RSS (KB on Linux)


def train(args):
    check_args(args)
    rank, world, device = init_distributed(args)
    dp = infer_dp(world, args.tp, args.pp, args.cp, args.dp)
    if args.global_batch % (args.micro_batch * dp):
        raise UsageError(f"--global-batch: {args.global_batch} is not divisible by micro-batch x dp = "
                         f"{args.micro_batch} x {dp}")
    mesh = Mesh(rank, world, dp=dp, pp=args.pp, cp=args.cp, tp=args.tp, dp_shard=args.dp_shard)
    folder = data_folder(args, rank, world)
    meta = json.loads((folder / "meta.json").read_text())
    cfg = model_config(args, meta["vocab_size"])
    if mesh.cp > 1:
        importlib.import_module("parallel.cp").validate(cfg, mesh, args.cp_mode)
    loader = TokenLoader(folder, "train", cfg.seq_len, args.global_batch, args.seed, mesh.coord["dp"], dp, device)
    val_loader = TokenLoader(folder, "val", cfg.seq_len, args.global_batch, args.seed, mesh.coord["dp"], dp, device,
                             prefetch=False) if args.eval_every else None
    config = run_config(args, cfg, meta)
    saved = reshard.find_resume(args.out, args.resume, config)  # validated before anything is written
    attempts = faults.Attempts(args.out, rank, resuming=args.resume is not None)
    attempts.check()
    if rank == 0 and world > 1:
        print(mesh.describe(), flush=True)

    torch.manual_seed(args.seed)
    chunks, wrapper = build_model(cfg, mesh, args, device)
    opt = optim.make_adamw(wrapper.optim_params(), args.lr, args.weight_decay, device)
    scaler = optim.LossScaler(args.dtype == "fp16")
    start, layout = 0, run_layout(args, mesh)
    if saved:
        same_layout = saved.meta["layout"] == layout  # else: resharding, and each rank's RNG has no counterpart
        reshard.load(saved, wrapper, opt, rng_of_rank=rank if same_layout else None)
        scaler.load_state_dict(saved.meta["scaler"])
        start = saved.step
        if rank == 0:
            print(f"resumed from {saved.path} (step {start}{'' if same_layout else ', resharded'})", flush=True)
    run_id = checkpoint.agree_on_run_id(mesh, device)  # a barrier too: every rank has read the run folder
    if rank == 0 and args.resume:
        checkpoint.remove_incomplete(args.out)
    attempts.begin(start)  # rank 0 writes the record
    saver = checkpoint.Saver(args.out, mesh, device, keep=args.keep, async_save=args.async_save, run_id=run_id)

    peak, peak_source = peak_flops(args, device)
    tokens_per_step = args.global_batch * cfg.seq_len
    flops_model = M.flops_per_token(cfg) * tokens_per_step
    recomputed = 0
    if args.ckpt != "none":
        recomputed = importlib.import_module("parallel.ckpt").recomputed_layers(cfg, args.ckpt)
    flops_hw = M.flops_per_token(cfg, recomputed_layers=recomputed) * tokens_per_step
    autocast = (torch.autocast(device.type, dtype=DTYPES[args.dtype]) if args.dtype != "fp32" else nullcontext())
    out = Path(args.out)
    metrics = None
    if args.metrics and rank == 0:
        Path(args.metrics).parent.mkdir(parents=True, exist_ok=True)
        metrics = open(args.metrics, "a")
    if rank == 0:
        n_total, n_non_emb = M.param_counts(cfg)
        print(f"model {args.model}: {n_total / 1e6:.1f}M params ({n_non_emb / 1e6:.1f}M non-embedding), "
              f"{flops_model / tokens_per_step / 1e6:.1f} MFLOP/token; peak {peak / 1e12:.3f} TFLOP/s from "
              f"{peak_source}; {args.global_batch} x {cfg.seq_len} tokens per step", flush=True)

    profiler = None
    if args.profile:
        out.mkdir(parents=True, exist_ok=True)
        profiler = torch.profiler.profile(
            schedule=torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1),
            on_trace_ready=lambda p: p.export_chrome_trace(str(out / f"trace_rank{rank}.json")))
        profiler.start()
    losses = []
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, disable=rank != 0, dynamic_ncols=True)
    for step in bar:
        lr = optim.lr_at(step, args.lr, args.min_lr, args.warmup, args.steps)
        for group in opt.param_groups:
            group["lr"] = lr
        mesh.stats.reset()
        t0 = time.perf_counter()
        x, y = loader.get(step)
        local_loss = forward_backward(chunks, wrapper, mesh, x, y, args, autocast, scaler.scale)
        wrapper.finish_grad_sync()
        grad_norm = optim.unscale_and_clip(wrapper.grads_for_norm(), mesh.world_group, 1 / scaler.scale,
                                           args.grad_clip)
        loss = mean_over_replicas(local_loss.item(), mesh, device)
        if not math.isfinite(loss) or (not scaler.enabled and not torch.isfinite(grad_norm).item()):
            raise stop_run(faults.NonFiniteLoss(step + 1, loss, grad_norm.item()), saver, attempts, args.out)
        skipped = scaler.update(not torch.isfinite(grad_norm).item())
        if not skipped:
            opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        losses.append(loss)
        row = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm.item(), "tokens": tokens_per_step,
               "dt_s": dt, "tok_s": tokens_per_step / dt, "tflops": flops_model / dt / world / 1e12,
               "mfu": flops_model / dt / world / peak if peak else None,
               "hfu": flops_hw / dt / world / peak if peak else None,
               "mem_gb": peak_memory_gb(device), "comm_gb": mesh.stats.total_bytes / 1e9}
        if args.dtype == "fp16":
            row.update(loss_scale=scaler.scale, skipped=skipped)
        if args.eval_every and (step + 1) % args.eval_every == 0:
            row["val_loss"] = evaluate(chunks, mesh, val_loader, args, autocast)
        if (args.save_every and (step + 1) % args.save_every == 0) or step + 1 == args.steps:
            row["save_stall_s"] = saver.save(step + 1, wrapper, opt, {
                "config": config, "layout": layout, "scaler": scaler.state_dict(), "format": 1})
        attempts.progress(step + 1)
        if metrics:
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{row['tok_s']:.0f}", mfu=f"{(row['mfu'] or 0):.1%}")
        if rank == 0 and args.log_every and (step + 1) % args.log_every == 0:
            extra = f" val {row['val_loss']:.4f}" if "val_loss" in row else ""
            bar.write(f"step {step + 1}: loss {loss:.4f}{extra} lr {lr:.2e} norm {row['grad_norm']:.3f} "
                      f"{row['tok_s']:.0f} tok/s mfu {(row['mfu'] or 0):.2%} mem {row['mem_gb']:.2f} GB")
        if profiler:
            profiler.step()
    saver.wait()  # the last async save
    attempts.end("done")
    if profiler:
        profiler.stop()
    loader.close()
    if metrics:
        metrics.close()
    return losses


def run_layout(args, mesh):
    """Recorded in each save: a resume in the same layout also restores every rank's RNG states."""
    return {"world": mesh.world, **mesh.sizes, "dp_mode": args.dp_mode, "dp_shard": mesh.dp_shard, "sp": args.sp,
            "pp_schedule": args.pp_schedule, "pp_virtual": args.pp_virtual, "pp_split": args.pp_split,
            "cp_mode": args.cp_mode}


def stop_run(error, saver, attempts, out):
    """A non-finite loss: let an async save in flight (the last good one) finish, record the failure."""
    saver.wait()
    repeated = attempts.end(f"failed: {error}")
    newest = checkpoint.complete_saves(out)
    return faults.TrainingFailure(f"{error}; stopped, the last good save is {newest[-1] if newest else 'none'}"
                                  f"{repeated}")


def main(argv=None):
    try:
        return train(parse_args(argv))
    except (UsageError, LayoutError, DataError, CheckpointError) as e:
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except faults.TrainingFailure as e:
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"error: {e}", file=sys.stderr)
        sys.exit(3)


if __name__ == "__main__":
    main()

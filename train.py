"""Train a Llama-style GPT on any (dp x pp x cp x tp) layout.

    python train.py --model tiny --steps 200                     # one process, CPU or GPU
    torchrun --nproc_per_node 8 train.py --model small --tp 2 --dp-mode fsdp

Flags -> mesh -> the model on the meta device -> each parallelism and optional layer -> the
data-parallel wrapper, which materializes this rank's weights -> the loop. The global batch of a
step depends only on (seed, step), and the loss is the mean over all its tokens, so every layout
trains the same model as one process.
"""
import math
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

import config
import dry_run
import fp8
import launch
import metrics
import model
import optim
from config import DTYPES
from data.loader import TokenLoader
from data.prepare import prepared_folder
from parallel import (
    ckpt,
    compiled,
    cp,
    ddp,
    fsdp,
    fsdp_accumulate,
    hsdp,
    pp,
    pp_bw_split,
    tp,
    tp_fused,
    tp_ring,
)
from parallel.comm import ALL_GATHER
from parallel.materialize import local_init
from parallel.mesh import Mesh
from parallel.pp_schedule import SPLIT_BACKWARD
from saves.run import RunFolder

DATA_PARALLEL = {"ddp": ddp.wrap, "fsdp": fsdp.wrap, "hsdp": hsdp.wrap}


@dataclass
class Trainer:
    """What a step touches: this rank's chunks, their data-parallel wrapper, the optimizer."""
    chunks: list
    wrapper: object  # the protocol in parallel/__init__.py
    mesh: Mesh
    opt: torch.optim.Optimizer
    scaler: optim.LossScaler
    autocast: object
    micro_batch: int
    dtype: torch.dtype  # the compute dtype: matmul inputs, the residual stream, what is sent


def build(cfg, mesh, run):
    """(this rank's pipeline chunks, the data-parallel wrapper that owns their weights).

    Each parallelism, then each optional layer the run asks for, changes the chunks on the meta
    device. The wrapper materializes this rank's part of the weights last.
    """
    with torch.device("meta"):
        full = model.GPT(cfg)  # shapes only: no rank ever holds the whole model
    chunks = [full]
    if mesh.pp > 1:
        chunks = pp.split(full, mesh, run.accum_steps, run.pp_schedule, run.pp_virtual,
                          run.pp_split)
    zero_bubble = mesh.pp > 1 and run.pp_schedule in SPLIT_BACKWARD
    for chunk in chunks:
        if mesh.tp > 1:
            tp.parallelize(chunk, mesh, sequence_parallel=run.sp)
            if run.dtype != "fp8" and not zero_bubble:  # they need tp's plain path
                tp_fused.apply(chunk, overlap=run.overlap)
            if run.sp_ring:
                tp_ring.apply(chunk)
        if mesh.cp > 1:
            cp.parallelize(chunk, mesh, mode=run.cp_mode)
        if run.dtype == "fp8":
            fp8.apply(chunk, mesh.tp_group, mesh.cp_group)
        ckpt.apply(chunk, run.ckpt)
        if zero_bubble:  # weight gradients wait for the schedule's W
            pp_bw_split.apply(chunk)
        if run.compile:
            compiled.apply(chunk, selective=run.ckpt == "selective")

    def init_param(name, meta, flat=None, out=None):  # this rank's part of a weight's initial value
        return local_init(name, meta, cfg, run.seed, flat, out)
    if run.dp_mode == "ddp":
        options = dict(bucket_mb=run.bucket_mb)
    else:
        options = dict(compute_dtype=DTYPES[run.dtype], reduce_dtype=DTYPES[run.reduce_dtype])
    if run.accumulate == "unsharded":  # a step's gradients summed unsharded, reduce-scattered once
        sharded = hsdp.HSDP if run.dp_mode == "hsdp" else fsdp.FSDP
        options["cls"] = fsdp_accumulate.unsharded(sharded)
    wrap = DATA_PARALLEL[run.dp_mode]
    wrapper = wrap(nn.ModuleList(chunks), mesh, torch.device(run.device), init_param,
                   overlap=run.overlap, **options)
    if run.fp8_all_gather:
        wrapper = fp8.gather_in_fp8(wrapper, mesh.tp_group)
    return chunks, wrapper


def prepare(run, cfg, mesh):
    """The Trainer of a resolved run: the model built and materialized, AdamW over the wrapper's
    fp32 tensors, the loss scaler (fp16) and the autocast of the compute dtype."""
    torch.manual_seed(run.seed)
    chunks, wrapper = build(cfg, mesh, run)
    device = torch.device(run.device)
    dtype = DTYPES[run.dtype]
    autocast = torch.autocast(device.type, dtype=dtype) if run.dtype != "fp32" else nullcontext()
    opt = optim.make_adamw(wrapper.optim_params(), run.lr, run.weight_decay, device)
    scaler = optim.LossScaler(run.dtype == "fp16", device)
    return Trainer(chunks, wrapper, mesh, opt, scaler, autocast, run.micro_batch, dtype)


def split_batch(x, y, micro_batch, mesh):
    """This rank's rows -> [(x, y)] micro-batches (cp: this rank's tokens), their positions."""
    batches = list(zip(x.split(micro_batch), y.split(micro_batch)))
    return cp.shard_batches(batches, mesh) if mesh.cp > 1 else (batches, None)


def forward_backward(trainer, x, y):
    """Every micro-batch's forward and backward; returns their summed loss. A micro-batch's loss
    is its local mean over M, and dp x cp average the gradients: the global batch's mean."""
    t = trainer
    batches, positions = split_batch(x, y, t.micro_batch, t.mesh)
    if t.mesh.pp > 1:  # the pipeline schedule runs them all
        return pp.train_step(t.chunks, t.wrapper, t.mesh, batches, positions, t.autocast,
                             t.scaler.scale, t.dtype)
    total = torch.zeros((), device=x.device)
    for i, (xb, yb) in enumerate(batches):
        t.wrapper.sync_grads = i == len(batches) - 1  # the reduction runs in the last backward
        with t.autocast:
            loss = t.chunks[0](xb, yb, positions) / len(batches)
        (loss * t.scaler.scale).backward()
        total += loss.detach()
    return total


def train_step(trainer, x, y, lr, grad_clip):
    """One optimizer step with no host read. Returns, on the device, this rank's share of the loss
    and the step's health: [global gradient norm, 1 if fp16 overflowed, ranks with a bad loss]."""
    for group in trainer.opt.param_groups:
        group["lr"] = lr
    loss = forward_backward(trainer, x, y)
    return loss, optimizer_step(trainer, loss, grad_clip)


def optimizer_step(trainer, loss, grad_clip):
    """The gradient sync, the clip by the global norm, AdamW (skipped on an fp16 overflow), the
    loss scale's update, the gradients zeroed. Returns the step's health on the device."""
    t = trainer
    t.wrapper.finish_grad_sync()  # waits for the reductions in flight, averages over dp x cp
    bad_loss = (~torch.isfinite(loss)).float()
    grad_norm, bad_losses = optim.unscale_and_clip(t.wrapper.grads_for_norm(), t.mesh.world_group,
                                                   t.scaler.scale, grad_clip, bad_loss)
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
            total += pp.eval_step(t.chunks, t.wrapper, t.mesh, batches, positions, t.autocast,
                                  t.dtype)
            continue
        for xb, yb in batches:
            with t.autocast:
                total += t.chunks[0](xb, yb, positions) / len(batches)
    return replica_mean(total / n_batches, t.mesh).item()


def replica_mean(local_loss, mesh):
    """The global mean loss, on the device, from each rank's local mean: the sum over the tp-rank-0
    ranks, in rank order, over dp x cp. Only the last pipeline stage's losses are not zeros.
    Gathered and summed in a fixed order, not all-reduced, so it does not depend on how many
    losses are reduced at once. Scalars: not counted as traffic."""
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
    mesh = launch.start_distributed(run)
    data = prepared_folder(run.data, run.rank, run.world)
    spec = config.model_for(run, data)  # the model, checked against every constraint and the device
    cfg = spec.cfg
    folder = RunFolder(run.out, mesh, run.device, spec.config, spec.layout, run.resume, run.keep,
                       run.async_save)
    try:
        batches = (cfg.seq_len, run.global_batch, run.seed, mesh.coord["dp"], mesh.dp, run.device)
        loader = TokenLoader(data, "train", *batches)
        val_loader = None
        if run.eval_every:  # random windows, or the first --eval-tokens of the split
            val_loader = TokenLoader(data, "val", *batches, prefetch=False,
                                     fixed_tokens=run.eval_tokens)
        if run.rank == 0 and run.world > 1:
            print(mesh.describe(), flush=True)
        metrics_file = metrics.open_metrics(run)
        trainer = prepare(run, cfg, mesh)
        start = folder.start(trainer.wrapper, trainer.opt, trainer.scaler, spec.weights)
    except BaseException:
        folder.close()
        raise
    if run.rank == 0:
        print(f"run folder: {run.out}", flush=True)
    log = metrics.StepLog(run, cfg, mesh, start, trainer, metrics_file)
    profiler = metrics.start_profiler(run.profile, Path(run.out), run.rank)
    try:
        with launch.CtrlC() as ctrl_c:
            for step in log.bar:
                t0 = log.start_step()
                x, y = loader.get(step)
                lr = optim.lr_at(step, run.lr, run.min_lr, run.warmup, run.steps, run.warmdown)
                local_loss, health = train_step(trainer, x, y, lr, run.grad_clip)
                loss = replica_mean(local_loss, mesh)
                row = log.end_step(step, loss, health, trainer, t0, loader.wait_s)  # 1 host read
                overflow = not math.isfinite(row["grad_norm"])  # fp16's scaler skips such a step
                if row["bad_losses"] or (overflow and not trainer.scaler.enabled):
                    raise folder.non_finite(step + 1, row["loss"], row["grad_norm"])
                if run.eval_every and (step + 1) % run.eval_every == 0:
                    with launch.startup_timeout(mesh, run, first=step + 1 == run.eval_every):
                        row["val_loss"] = evaluate(trainer, val_loader, run.eval_batches)
                if (run.save_every and (step + 1) % run.save_every == 0) or step + 1 == run.steps:
                    row["save_stall_s"] = folder.save(step + 1, trainer.wrapper, trainer.opt,
                                                      trainer.scaler)
                folder.progress(step + 1)
                log.write(row)
                profiler.step()
                if step + 1 - start == launch.STARTUP_STEPS:
                    mesh.set_timeout(run.timeout)  # compiled, every stage warm: a hang now is real
                if ctrl_c.pressed:
                    raise KeyboardInterrupt
        folder.finish()  # waits for the last async save
    except KeyboardInterrupt:
        raise launch.Interrupted(folder.interrupted()) from None
    except RuntimeError as e:
        if not launch.timed_out(e):
            raise
        raise launch.Hung(folder.hung(launch.name_the_hang(mesh, step, e))) from None
    finally:
        profiler.stop()
        loader.close()  # joins its thread
        folder.close()
    losses = log.close(run.out)
    if run.world > 1:
        mesh.world_group.barrier()  # every rank is past every collective: the group may go
    return losses


def main(argv=None):
    """Trains; a failure is one line and an exit status: 2 bad input, 3 a failed run, 130 Ctrl-C."""
    if "--dry-run" in (sys.argv[1:] if argv is None else argv):  # rehearse on fake GPUs instead
        sys.exit(dry_run.main(argv, sys.modules[__name__]))
    return launch.run_or_exit(lambda: train(config.resolve(argv)))


if __name__ == "__main__":
    main()

"""Train a Llama-style GPT on any (dp x pp x cp x tp) layout.

    python train.py --model tiny --steps 200                     # one process, CPU or GPU
    torchrun --nproc_per_node 8 train.py --model small --tp 2 --dp-mode fsdp

Flags -> mesh -> the model on the meta device -> each parallelism and optional layer -> the
data-parallel wrapper, which materializes this rank's weights -> the loop. The global batch of a
step depends only on (seed, step), and the loss is the mean over all its tokens, so every layout
trains the same model as one process.
"""
import math
import os
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from signal import SIGINT, SIGTERM

import torch
import torch.distributed as dist
from torch import nn

import config
import model
from config import DTYPES
from data import TrainingFailure, UsageError, metrics
from data.ending import CtrlC, Hung, Interrupted, os_error_line, run_or_exit
from data.hf import init_from
from data.loader import TokenLoader, read_meta
from data.prepare import prepared_folder
from data.run import RunFolder, saved_config, saved_layout
from parallel import (
    ckpt,
    compiled,
    cp,
    ddp,
    fp8,
    fsdp,
    fsdp_accumulate,
    hsdp,
    memory,
    pp,
    pp_bw_split,
    tp,
    tp_overlap,
)
from parallel.comm import global_grad_norm, replica_mean
from parallel.materialize import local_init
from parallel.mesh import Mesh, init_process_group, name_the_hang, timed_out
from parallel.pp_schedule import SPLIT_BACKWARD

REPO = Path(__file__).resolve().parent
STARTUP_STEPS = 2  # steps under --startup-timeout (they compile, stage after stage), then --timeout
PER_RANK = ("rank", "local_rank", "device", "ranks_here")  # what differs between ranks of one run
DATA_PARALLEL = {"ddp": ddp.wrap, "fsdp": fsdp.wrap, "hsdp": hsdp.wrap}


# ---------------------------------------------------------------- the model the run trains

def model_for(run, data_folder):
    """(config, Hugging Face weights or None, what a save records of the run, of its layout): the
    model a run on a prepared data folder trains, checked against the layout and the device."""
    def checked(cfg):  # before a checkpoint's tensors are listed: a million layers never built
        check_layout(cfg, run)
        memory.check_fits(cfg, run)
    meta = read_meta(data_folder)
    cfg, weights = init_from(run.init_from, model_config(run, meta["vocab_size"]), run, checked)
    return cfg, weights, saved_config(cfg, run, data_folder, meta), saved_layout(run)


def model_config(run, vocab_size):
    """The ModelConfig of the preset, the shape flags and the data's vocabulary, checked."""
    base = model.PRESETS[run.model]
    names = ("n_layer", "d_model", "n_head", "n_kv_head", "ffn_dim", "vocab_size", "seq_len")
    overrides = {f: getattr(run, f) for f in names if getattr(run, f) is not None}
    values = {**base.__dict__, "dropout": run.dropout, **overrides}
    if not values["vocab_size"]:
        values["vocab_size"] = vocab_size
    if values["vocab_size"] < vocab_size:
        raise UsageError(f"--vocab-size: {values['vocab_size']} is below the data's vocabulary of "
                         f"{vocab_size}")
    cfg = model.ModelConfig(**values)
    tokens = run.micro_batch * cfg.seq_len // run.cp
    problem = cfg.validate() or (run.dtype == "fp8" and fp8.misfit(cfg, run.tp, tokens))
    if problem:
        raise UsageError(f"{problem[0]}: {problem[1]}")
    return cfg


def check_layout(cfg, run):
    """Every parallelism's constraints on this model, through its own check."""
    if run.tp > 1:
        tp.validate(cfg, run.tp, run.cp, run.sp)
    if run.cp > 1:
        cp.validate(cfg, run.cp, run.tp, run.cp_mode)
    if run.pp > 1:
        pp.layer_counts(cfg, run.pp, run.pp_virtual, run.accum_steps, run.pp_split, run.pp_schedule)


# ---------------------------------------------------------------- build

@dataclass
class Trainer:
    """What a step touches: this rank's chunks, their data-parallel wrapper, the optimizer."""
    chunks: list
    wrapper: object  # the protocol in parallel/__init__.py
    mesh: Mesh
    opt: torch.optim.Optimizer
    scaler: object  # LossScaler
    autocast: object
    micro_batch: int
    dtype: torch.dtype  # the compute dtype: matmul inputs, the residual stream, what is sent
    applied: list  # a line for each parallelism and layer build() applied


def build(cfg, mesh, run):
    """(this rank's pipeline chunks, the data-parallel wrapper that owns their weights, one line
    for each parallelism and layer applied). Each parallelism, then each optional layer the run
    asks for, changes the chunks on the meta device; the wrapper materializes this rank's part of
    the weights last."""
    with torch.device("meta"):
        full = model.GPT(cfg)  # shapes only: no rank ever holds the whole model
    chunks = [full]
    if mesh.pp > 1:
        chunks = pp.split(full, mesh, run.accum_steps, run.pp_schedule, run.pp_virtual,
                          run.pp_split)
    zero_bubble = mesh.pp > 1 and run.pp_schedule in SPLIT_BACKWARD
    fused = mesh.tp > 1 and run.dtype != "fp8" and not zero_bubble  # they need tp's plain path
    for chunk in chunks:
        if mesh.tp > 1:
            tp.parallelize(chunk, mesh, sequence_parallel=run.sp)
        if fused:
            tp_overlap.fuse_columns(chunk, overlap=run.overlap)
        if run.sp_ring:
            tp_overlap.rings(chunk)
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
    options = dict(bucket_mb=run.bucket_mb) if run.dp_mode == "ddp" else dict(
        compute_dtype=DTYPES[run.dtype], reduce_dtype=DTYPES[run.reduce_dtype])
    if run.accumulate == "unsharded":  # a step's gradients summed unsharded, reduce-scattered once
        sharded = hsdp.HSDP if run.dp_mode == "hsdp" else fsdp.FSDP
        options["cls"] = fsdp_accumulate.unsharded(sharded)
    wrap = DATA_PARALLEL[run.dp_mode]
    wrapper = wrap(nn.ModuleList(chunks), mesh, torch.device(run.device), init_param,
                   overlap=run.overlap, **options)
    if run.fp8_all_gather:
        wrapper = fp8.gather_in_fp8(wrapper, mesh.tp_group)
    g, k = mesh.dp_cp_group.size, mesh.shard_group.size
    dp = {"ddp": f"ddp: {g} replica(s), {run.bucket_mb:g} MB buckets",
          "fsdp": f"fsdp: model state sharded {g} ways", "hsdp": f"hsdp: {k} shards x {g // k}"}
    said = [(mesh.pp > 1, f"pp: {mesh.pp} stages, {run.pp_schedule}, M = {run.accum_steps}"),
            (mesh.tp > 1, f"tp: {mesh.tp}-way" + ", sequence parallel" * run.sp),
            (fused, "tp_overlap: f and its column matmuls as one Function"),
            (run.sp_ring, "tp_overlap: --sp's collectives as ring hops under the matmuls"),
            (mesh.cp > 1, f"cp: {mesh.cp}-way, {run.cp_mode}"),
            (run.dtype == "fp8", "fp8: the block matmuls" + ", the gathers" * run.fp8_all_gather),
            (run.ckpt != "none", f"ckpt: {run.ckpt}"),
            (zero_bubble, "pp_bw_split: each backward split into B and W"),
            (run.compile, "compiled: the blocks, the embedding and the loss"),
            (True, dp[run.dp_mode] + ", gradients synced after backward" * (1 - run.overlap)),
            (run.accumulate == "unsharded", "fsdp_accumulate: one reduce-scatter a step")]
    applied = [f"parallel/{line.replace(':', '.py:', 1)}" for on, line in said if on]
    return chunks, wrapper, applied


def prepare(run, cfg, mesh):
    """The Trainer of a resolved run: the model built and materialized, AdamW over the wrapper's
    fp32 tensors, the loss scaler (fp16) and the autocast of the compute dtype."""
    torch.manual_seed(run.seed)
    chunks, wrapper, applied = build(cfg, mesh, run)
    device, dtype = torch.device(run.device), DTYPES[run.dtype]
    autocast = torch.autocast(device.type, dtype=dtype) if run.dtype != "fp32" else nullcontext()
    opt = make_adamw(wrapper.optim_params(), run.lr, run.weight_decay, device)
    scaler = LossScaler(run.dtype == "fp16", device)
    return Trainer(chunks, wrapper, mesh, opt, scaler, autocast, run.micro_batch, dtype, applied)


# ---------------------------------------------------------------- AdamW, schedule, loss scale

def make_adamw(params, lr, weight_decay, device):
    """AdamW over fp32 masters, fused where torch can: matrices decay, norms (1-D) do not."""
    params = [p for p in params if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    try:
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
    except RuntimeError:  # no fused kernel for this device in this torch
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def lr_at(step, lr, min_lr, warmup, total, warmdown=None):
    """Linear warmup from lr/warmup to lr in `warmup` steps, then a decay to min_lr at `total`.

    warmdown None: cosine from the end of the warmup. warmdown K (warmup-stable-decay): lr until
    the last K steps, then linear to min_lr. A longer `total` lengthens the stable part."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if warmdown is not None:
        left = min(1.0, max(0, total - step) / warmdown) if warmdown else 1.0  # 1 while stable
        return min_lr + left * (lr - min_lr)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (lr - min_lr)


def adamw_step(opt, found_inf=None):
    """opt.step(), skipped where found_inf (0-dim) is 1: read on the device by fused AdamW."""
    if found_inf is None or opt.defaults.get("fused"):
        opt.found_inf = found_inf
        opt.step()
    elif not found_inf.item():
        opt.step()


class LossScaler:
    """Dynamic loss scaling for fp16. A disabled scaler (fp32, bf16) is 1.

    The loss is multiplied by `scale` so small gradients survive fp16. The gradients are divided
    back before the step. On inf or nan the step is skipped and the scale halved. After
    `interval` clean steps it doubles. The scale and the count of clean steps live on the device."""

    def __init__(self, enabled, device="cpu", scale=2.0 ** 16, interval=2000):
        self.enabled, self.interval = enabled, interval
        self.scale = torch.tensor(scale if enabled else 1.0, device=device)  # 0-dim fp32
        self.clean_steps = torch.zeros((), dtype=torch.int32, device=device)

    def state_dict(self):
        return {"scale": self.scale.item(), "clean_steps": int(self.clean_steps.item())}

    def load_state_dict(self, d):
        self.scale.fill_(d["scale"])
        self.clean_steps.fill_(d["clean_steps"] % self.interval)

    def update(self, found_inf):
        """After the step: halve on overflow (found_inf 1), double after `interval` clean steps."""
        if self.enabled:
            torch._amp_update_scale_(self.scale, self.clean_steps, found_inf, 2.0, 0.5,
                                     self.interval)


@torch.no_grad()
def unscale_and_clip(grads_and_replicas, world_group, loss_scale, max_norm, votes):
    """Divides the gradients by the loss scale and clips them to max_norm (0: no clipping).

    One pass, with no branch on a device value. Returns (norm, votes). norm: the pre-clip norm of
    the unscaled gradients, inf or nan if any gradient anywhere overflowed. votes: each rank's
    counts (a vector) summed over the world on the norm's all-reduce."""
    grads = [g for g, _ in grads_and_replicas]
    scaled_norm, votes = global_grad_norm(grads_and_replicas, world_group, also_sum=votes)
    norm = scaled_norm / loss_scale
    coef = 1 / loss_scale
    if max_norm > 0:
        coef = coef * (max_norm / (norm + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_(grads, coef)
    return norm, votes


# ---------------------------------------------------------------- the step

def forward_backward(trainer, x, y, total=None, backward=True):
    """Every micro-batch's forward and backward (or forward alone); adds their losses into `total`
    and returns it. A micro-batch's loss is its local mean over M, and dp x cp average the
    gradients: the global batch's mean."""
    t = trainer
    batches = list(zip(x.split(t.micro_batch), y.split(t.micro_batch)))  # cp: this rank's tokens
    batches, positions = cp.shard_batches(batches, t.mesh) if t.mesh.cp > 1 else (batches, None)
    total = torch.zeros((), device=x.device) if total is None else total
    if t.mesh.pp > 1 and backward:  # the pipeline schedule runs them all
        return total.add_(pp.train_step(t.chunks, t.wrapper, t.mesh, batches, positions,
                                        t.autocast, t.scaler.scale, t.dtype))
    if t.mesh.pp > 1:
        return total.add_(pp.eval_step(t.chunks, t.wrapper, t.mesh, batches, positions,
                                       t.autocast, t.dtype))
    with t.autocast:  # one region a step: a weight's compute-dtype copy is made once, not per batch
        for i, (xb, yb) in enumerate(batches):
            t.wrapper.sync_grads = i == len(batches) - 1  # the reduction runs in the last backward
            loss = t.chunks[0](xb, yb, positions) / len(batches)
            if backward:
                with torch.autocast(x.device.type, enabled=False):  # as if outside the region
                    (loss * t.scaler.scale).backward()
            total += loss.detach()
    return total


def train_step(trainer, x, y, lr, grad_clip, stop=None):
    """One optimizer step with no host read. Returns, on the device, this rank's share of the loss
    and the step's health: [global gradient norm, 1 if fp16 overflowed, ranks with a bad loss,
    ranks sent Ctrl-C, ranks sent SIGTERM]. stop: the signal this rank was sent, or None."""
    for group in trainer.opt.param_groups:
        group["lr"] = lr
    loss = forward_backward(trainer, x, y)
    return loss, optimizer_step(trainer, loss, grad_clip, stop)


def optimizer_step(trainer, loss, grad_clip, stop=None):
    """The gradient sync, the clip by the global norm, AdamW (skipped on an fp16 overflow), the
    loss scale's update, the gradients zeroed. Returns the step's health on the device."""
    t = trainer
    t.wrapper.finish_grad_sync()  # waits for the reductions in flight, averages over dp x cp
    votes = torch.stack([(~torch.isfinite(loss)).float(), loss.new_full((), stop == SIGINT),
                         loss.new_full((), stop == SIGTERM)])  # every rank stops on the same step
    grad_norm, votes = unscale_and_clip(t.wrapper.grads_for_norm(), t.mesh.world_group,
                                        t.scaler.scale, grad_clip, votes)
    overflow = (~torch.isfinite(grad_norm)).float()
    adamw_step(t.opt, overflow if t.scaler.enabled else None)
    t.scaler.update(overflow)
    t.wrapper.zero_grad()
    return torch.cat([torch.stack([grad_norm, overflow]), votes])


@torch.no_grad()
def evaluate(trainer, loader, n_batches):
    """The val loss: the global mean over n_batches global batches."""
    total = torch.zeros((), device=trainer.scaler.scale.device)
    for step in range(n_batches):
        forward_backward(trainer, *loader.get(step), total, backward=False)
    return replica_mean(total / n_batches, trainer.mesh).item()


def train(run):
    """Trains the resolved run; returns every step's global mean loss."""
    mesh = start_distributed(run)
    mesh.agree({k: v for k, v in vars(run).items() if k not in PER_RANK})
    data = prepared_folder(run.data, run.rank, run.world)
    cfg, weights, saved, layout = model_for(run, data)  # checked against the layout and device
    folder = RunFolder(run.out, mesh, run.device, saved, layout, run.resume, run.keep,
                       run.async_save)
    try:
        batches = (cfg.seq_len, run.global_batch, run.seed, mesh.coord["dp"], mesh.dp, run.device)
        loader = TokenLoader(data, "train", *batches)
        val_loader = None
        if run.eval_every:  # random windows, or the first --eval-tokens of the split
            val_loader = TokenLoader(data, "val", *batches, prefetch=False,
                                     fixed_tokens=run.eval_tokens, steps=run.eval_batches)
        if run.rank == 0 and run.world > 1:
            print(mesh.describe(run.ranks_here, run.device != "cpu"), flush=True)
        metrics_file = metrics.open_metrics(run)
        trainer = prepare(run, cfg, mesh)
        start = folder.start(trainer.wrapper, trainer.opt, trainer.scaler, weights)
    except BaseException:
        folder.close()
        raise
    if folder.finished(start, run.steps):  # a finished run resumed: it says so
        return []
    profiler, ctrl_c = metrics.start_profiler(run.profile, Path(run.out), run.rank), CtrlC()
    try:
        log = metrics.StepLog(run, cfg, mesh, start, trainer, metrics_file)  # prints the model
        if run.rank == 0:
            print("\n".join(trainer.applied + [f"run folder: {run.out}"]), flush=True)
            if run.warmup >= run.steps:
                last = lr_at(run.steps - 1, run.lr, run.min_lr, run.warmup, run.steps, run.warmdown)
                print(f"note: --warmup {run.warmup} >= --steps {run.steps}: the learning rate "
                      f"never reaches --lr {run.lr:g} (it ends at {last:.3g})", flush=True)
        with ctrl_c:
            for step in log.bar:
                t0 = log.start_step()
                x, y = loader.get(step)
                lr = lr_at(step, run.lr, run.min_lr, run.warmup, run.steps, run.warmdown)
                local_loss, health = train_step(trainer, x, y, lr, run.grad_clip, ctrl_c.pressed)
                loss = replica_mean(local_loss, mesh)
                row = log.end_step(step, loss, health, trainer, t0, loader.wait_s)  # 1 host read
                overflow = not math.isfinite(row["grad_norm"])  # fp16's scaler skips such a step
                if row["bad_losses"] or (overflow and not trainer.scaler.enabled):
                    raise folder.non_finite(step + 1, row["loss"], row["grad_norm"])
                if run.eval_every and (step + 1) % run.eval_every == 0:
                    first = step + 1 == run.eval_every  # it compiles again: a start-up wait
                    if first:
                        mesh.set_timeout(run.startup_timeout)
                    row["val_loss"] = evaluate(trainer, val_loader, run.eval_batches)
                    if first:
                        mesh.set_timeout(run.timeout)
                stop = ctrl_c.agreed(row.pop("stop_votes"), run.world)  # the same on every rank
                due = run.save_every and (step + 1) % run.save_every == 0
                if due or step + 1 == run.steps or stop == SIGTERM:  # SIGTERM: a time limit
                    row["save_stall_s"] = folder.save(step + 1, trainer.wrapper, trainer.opt,
                                                      trainer.scaler)
                folder.progress(step + 1)
                log.write(row)
                profiler.step()
                if step + 1 - start == STARTUP_STEPS:
                    mesh.set_timeout(run.timeout)  # compiled, every stage warm: a hang now is real
                if stop:
                    raise Interrupted(folder.interrupted(stop, agreed=True), stop)
        folder.finish()  # waits for the last async save
    except KeyboardInterrupt:
        raise Interrupted(folder.interrupted(ctrl_c.stop_signal), ctrl_c.stop_signal) from None
    except RuntimeError as e:
        if not timed_out(e):
            raise
        line, silent = name_the_hang(mesh, step, e)
        raise Hung(folder.stopped(line), silent) from None
    except OSError as e:  # stdout into `head`, or onto a full device
        raise TrainingFailure(folder.stopped(os_error_line(e))) from None
    finally:
        profiler.stop()
        loader.close()  # joins its thread
        folder.close()
    losses = log.close(run.out)
    if run.world > 1:
        mesh.world_group.barrier()  # every rank is past every collective: the group may go
    return losses


# ---------------------------------------------------------------- start and end

def start_distributed(run):
    """The process group (a caller's, in tests, is used as it is) and the mesh of the run."""
    if run.backend == "nccl":
        torch.cuda.set_device(run.device)
    # fp32 means fp32: matmuls that stay fp32 use TF32 only where the run asks
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = run.tf32
    if run.world > 1 and not dist.is_initialized():
        init_process_group(run.backend, run.device, run.rank, run.world, run.startup_timeout,
                           run.out)
    return Mesh(run.rank, run.world, dp=run.dp, pp=run.pp, cp=run.cp, tp=run.tp,
                dp_shard=run.dp_shard, timeout_s=run.startup_timeout)


def main(argv=None):
    """Trains; a failure is one line and an exit status: 2 bad input, 3 a failed run, 130 Ctrl-C.
    --dry-run becomes the rehearsal (this process runs bench/dry_run.py), which runs this step
    on fake GPUs."""
    argv = sys.argv[1:] if argv is None else list(argv)
    memory.expandable_segments(os.environ)  # read when CUDA first allocates, after this
    if "--dry-run" in argv:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get(
            "PYTHONPATH", "")]).rstrip(os.pathsep)}
        os.execve(sys.executable, [sys.executable, "-m", "bench.dry_run", *argv], env)
    return run_or_exit(lambda: train(config.resolve(argv)))


if __name__ == "__main__":
    main()

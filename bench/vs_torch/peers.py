"""The tensor- and pipeline-parallel peers of bench/vs_torch, on 2 gloo ranks, the same split of the same model:
parallel.tp.parallelize (+ tp_overlap, under sp with and without the rings) against DTensor's parallelize_module
(colwise q, k, v, gate, up, lm_head; rowwise o, down and the embedding; SequenceParallel norms; loss_parallel), and
parallel.pp.split + execute against torch.distributed.pipelining's GPipe, 1F1B and interleaved 1F1B on those chunks.
"""
import inspect
import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

import model
import train
from parallel import pp, tp, tp_overlap
from parallel.ddp import DDP
from parallel.materialize import init_weights
from parallel.mesh import Mesh

try:  # public since torch 2.5; torch 2.4 keeps DTensor under _tensor
    from torch.distributed.tensor import Replicate, Shard
except ImportError:
    from torch.distributed._tensor import Replicate, Shard

TORCH_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}
VIRTUAL = {"gpipe": 1, "1f1b": 1, "interleaved": 2}


def torch_tp_plan(sp):
    """parallelize_module plans for a GPT with full (materialized) weights, Megatron-style, as torchtitan does."""
    seq = Shard(1) if sp else Replicate()
    root = {"embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
            "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)}
    if sp:
        root["norm"] = SequenceParallel()
    block = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
             "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(output_layouts=seq),
             "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
             "mlp.down_proj": RowwiseParallel(output_layouts=seq)}
    if sp:  # one all-gather per sub-block (not one per reader), as ours does
        block.update({"input_layernorm": SequenceParallel(), "post_attention_layernorm": SequenceParallel(),
                      "self_attn": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                      desired_input_layouts=(Replicate(), None, None)),
                      "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))})
    return root, block


def torch_cross_entropy(logits, targets):
    """Mean cross-entropy of DTensor logits sharded over the vocab; under loss_parallel it is never gathered."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build_tp(impl, cfg, rank, world, seed, sp, ring=False):
    """(model, optimizer params, our wrapper or None, loss context) for ours or torch's tensor parallelism. ring: ours
    with tp_overlap's rings for the sp collectives (train.py --sp-ring)."""
    with torch.device("meta"):
        gpt = model.GPT(cfg)
    if impl == "ours-tp":
        mesh = Mesh(rank, world, tp=world)
        tp.parallelize(gpt, mesh, sequence_parallel=sp)
        tp_overlap.fuse_columns(gpt)
        if ring:
            tp_overlap.rings(gpt)
        init_weights(gpt, seed, "cpu")
        wrapper = DDP(nn.ModuleList([gpt]), mesh)
        return gpt, wrapper.optim_params(), wrapper, nullcontext
    init_weights(gpt, seed, "cpu")
    device_mesh = init_device_mesh("cpu", (world,))
    root, block = torch_tp_plan(sp)
    for layer in gpt.layers.values():
        parallelize_module(layer, device_mesh, block)
    parallelize_module(gpt, device_mesh, root)
    q = gpt.layers["0"].self_attn.q_proj.weight  # sharded for real: a DTensor, rows split over the ranks
    assert q.placements == (Shard(0),) and q.to_local().shape[0] == q.shape[0] // world, q.placements
    gpt.loss_fn = torch_cross_entropy
    if sp:
        gpt.seq_shards = world  # the residual stream holds T/t tokens; rope needs all T positions
    return gpt, list(gpt.parameters()), None, loss_parallel


def run_tp(rank, world, impl, cfg_fields, micro_batch, steps, warmup, seed, sp, ring=False):
    cfg = model.ModelConfig(**cfg_fields)
    torch.manual_seed(seed)
    net, params, wrapper, loss_ctx = build_tp(impl, cfg, rank, world, seed, sp, ring)
    gen = torch.Generator().manual_seed(seed * 1000)  # tp ranks read the same batch
    return timed_steps(net, params, wrapper, cfg, micro_batch, steps, warmup, gen, loss_ctx)


def step_and_clear(opt, wrapper):
    """Ours as train.py runs it (sync, step, the wrapper's zero_grad: grads stay views into its buffers); torch's
    wrappers sync inside backward, and their gradients are set to None."""
    if wrapper is not None:
        wrapper.finish_grad_sync()
    opt.step()
    if wrapper is not None:
        wrapper.zero_grad()
    else:
        opt.zero_grad(set_to_none=True)


def timed_steps(net, params, wrapper, cfg, micro_batch, steps, warmup, gen, loss_ctx=nullcontext):
    """Trains `net` for warmup + steps steps on random batches from `gen`; per step the wall and CPU seconds (after
    the warmup) and the loss. wrapper: ours (its gradient sync and zero_grad, as train.py calls them), or None for
    torch's (zero_grad(set_to_none=True), its idiom); loss_ctx: around forward and backward."""
    opt = train.make_adamw(params, 1e-3, 0.1, "cpu")
    losses, times, cpu = [], [], []
    for _ in range(warmup + steps):
        x = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len + 1), generator=gen)
        torch.distributed.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        with loss_ctx():
            loss = net(x[:, :-1], x[:, 1:])
            loss.backward()
        step_and_clear(opt, wrapper)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)  # this process's CPU seconds, all threads: robust to a busy host
        losses.append(loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item())
    return dict(losses=losses, times=times[warmup:], cpu=cpu[warmup:])


def run_pp(rank, world, impl, schedule, cfg_fields, micro_batch, n_micro, steps, warmup, seed):
    cfg = model.ModelConfig(**cfg_fields)
    torch.manual_seed(seed)
    mesh = Mesh(rank, world, pp=world)
    with torch.device("meta"):
        full = model.GPT(cfg)
    chunks = pp.split(full, mesh, n_micro, schedule, VIRTUAL[schedule])
    for chunk in chunks:
        init_weights(chunk, seed, "cpu")
    if impl == "ours-pp":
        wrapper = DDP(nn.ModuleList(chunks), mesh)
        params = wrapper.optim_params()
    else:
        stages = [PipelineStage(c, c.pipeline.virtual_stage, c.pipeline.n_virtual, torch.device("cpu")) for c in chunks]
        options = {"scale_grads": False} if "scale_grads" in inspect.signature(ScheduleGPipe.__init__).parameters \
            else {}  # the loss is already / M, as ours (older torch never scales)
        cls = TORCH_SCHEDULES[schedule]
        sched = cls(stages if schedule == "interleaved" else stages[0], n_micro,
                    loss_fn=lambda out, y: model.cross_entropy_loss(out, y) / n_micro, **options)
        params, wrapper = [p for c in chunks for p in c.parameters()], None
    opt = train.make_adamw(params, 1e-3, 0.1, "cpu")
    gen = torch.Generator().manual_seed(seed * 1000)
    last = rank == world - 1  # holds the last (virtual) stage in every schedule here
    losses, times, cpu = [], [], []
    for _ in range(warmup + steps):
        x = torch.randint(0, cfg.vocab_size, (micro_batch * n_micro, cfg.seq_len + 1), generator=gen)
        inputs, targets = x[:, :-1], x[:, 1:]
        torch.distributed.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        if impl == "ours-pp":
            batches = list(zip(inputs.split(micro_batch), targets.split(micro_batch)))
            loss = pp.execute(chunks, mesh, batches, None, nullcontext(), torch.float32, 1.0, wrapper)[0]
        else:
            mb_losses = []
            sched.step(*([inputs] if rank == 0 else []), target=targets if last else None, losses=mb_losses)
            loss = torch.stack(mb_losses).sum() if mb_losses else torch.zeros(())
        step_and_clear(opt, wrapper)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        losses.append(loss.item())
    return dict(losses=losses, times=times[warmup:], cpu=cpu[warmup:], last=last)

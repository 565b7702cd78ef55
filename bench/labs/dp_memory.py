"""L13 + L14: FSDP's per-rank model state for M = 1, 2, 4, 8, and its collectives per step.

    python -m bench.labs.dp_memory   # the tiny preset, fp32, one training step per layout
    python -m bench.labs.dp_memory --model small --seq-len 32 --micro-batch 1

After one step each rank measures the storage behind its parameters, gradients and Adam moments (DDP 16 B/param, FSDP
16·P/M plus padding, HSDP 16·P/K) and its bytes from the comm counters, against the theory (FSDP 3·(M-1)/M·4P, HSDP
the same with K plus the replicas' all-reduce of P/K, DDP 2·(M-1)/M·4P).
"""

import torch
from torch import nn

import model
import train
from bench import common
from bench.ranks import run_ranks
from parallel.ddp import DDP
from parallel.fsdp import FSDP
from parallel.hsdp import HSDP
from parallel.materialize import init_weights, local_init
from parallel.mesh import Mesh


def storage_bytes(tensors):
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(seen.values())


def _one_step(rank, world, mode, shard, cfg_fields, micro_batch, seed=1337):
    cfg = model.ModelConfig(**cfg_fields)
    mesh = Mesh(rank, world, dp_shard=shard)
    with torch.device("meta"):
        gpt = model.GPT(cfg)
    module = nn.ModuleList([gpt])
    init = lambda name, p, flat=None, out=None: local_init(name, p, cfg, seed, flat, out)
    if mode == "ddp":
        init_weights(gpt, seed, "cpu")
        wrapper = DDP(module, mesh)
    elif mode == "fsdp":
        wrapper = FSDP(module, mesh, mesh.dp_cp_group, init, "cpu")
    else:
        wrapper = HSDP(module, mesh, mesh.shard_group, init, "cpu")
    opt = train.make_adamw(wrapper.optim_params(), 1e-3, 0.1, "cpu")
    x = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len + 1), generator=torch.Generator().manual_seed(rank))
    mesh.stats.reset()
    loss = gpt(x[:, :-1], x[:, 1:])
    forward = mesh.stats.calls["all_gather"]  # one micro-batch: each gather is used where it starts
    loss.backward()
    gathers = {"forward": forward, "backward": mesh.stats.calls["all_gather"] - forward} if mode != "ddp" else {}
    wrapper.finish_grad_sync()
    opt.step()
    params = wrapper.optim_params()
    moments = [v for s in opt.state.values() for k, v in s.items() if k != "step"]
    return dict(param=storage_bytes(params), grad=storage_bytes(p.grad for p in params), adam=storage_bytes(moments),
                sent=dict(mesh.stats.bytes), calls=dict(mesh.stats.calls),
                gathers=gathers, units=len(getattr(wrapper, "units", [])))


def theory_bytes(mode, world, shard, P, E):
    """E: the embedding and norm + head units' params, which backward does not gather again."""
    if mode == "ddp":
        return 2 * (world - 1) / world * 4 * P
    K = world if mode == "fsdp" else shard
    R = world // K
    return (K - 1) / K * 4 * (3 * P - E) + 2 * (R - 1) / R * 4 * P / K


@common.command
def main(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--model", default="tiny")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=2)
    args = p.parse_args(argv)
    fields = {**model.PRESETS[args.model].__dict__, "seq_len": args.seq_len}
    fields["vocab_size"] = fields["vocab_size"] or 257  # the pystdlib byte vocabulary, as train.py uses
    layouts = [("ddp", 2, None), ("fsdp", 1, None), ("fsdp", 2, None), ("fsdp", 4, None), ("fsdp", 8, None),
               ("hsdp", 8, 2), ("hsdp", 8, 4)]
    if args.quick:
        fields = dict(fields, **common.QUICK_MODEL, seq_len=16)
        layouts = [("ddp", 2, None), ("fsdp", 1, None), ("fsdp", 2, None), ("hsdp", 4, 2)]
    cfg = model.ModelConfig(**fields)
    P, E = model.param_counts(cfg)[0], 2 * cfg.padded_vocab * cfg.d_model + cfg.d_model
    rows, fsdp8 = [], None
    for mode, world, shard in layouts:
        r = run_ranks(_one_step, world, args=(mode, shard, fields, args.micro_batch), timeout=300)[-1]  # last rank
        state = r["param"] + r["grad"] + r["adam"]
        sent, want = sum(r["sent"].values()), theory_bytes(mode, world, shard, P, E)
        label = dict(ddp=f"DDP, {world} ranks", fsdp=f"FSDP M={world}",
                     hsdp=f"HSDP K={shard} x R={world // (shard or 1)}")
        ag = f"{r['gathers'].get('forward', 0)} / {r['gathers'].get('backward', 0)}" if r["units"] else "-"
        rows.append([label[mode], f"{r['param'] / 1e6:.3f}", f"{r['grad'] / 1e6:.3f}", f"{r['adam'] / 1e6:.3f}",
                     f"{state / 1e6:.3f}", f"{state / (16 * P):.3f}", ag, r["calls"].get("reduce_scatter", 0),
                     r["calls"].get("all_reduce", 0), f"{sent / 1e6:.3f}", f"{want / 1e6:.3f}",
                     f"{sent / want:.4f}" if want else "-"])
        if mode == "fsdp" and world == max(w for m, w, _ in layouts if m == "fsdp"):
            fsdp8 = (world, state / (16 * P), r["gathers"], r["units"])
    common.write_result(
        args.out, "L13_fsdp_memory", f"L13/L14: model state and traffic per rank, {args.model} ({P / 1e6:.2f}M params)",
        ["layout", "params MB", "grads MB", "Adam MB", "total MB", "x 16P", "all-gathers fwd / bwd",
         "reduce-scatters", "all-reduces", "sent MB", "theory MB", "sent / theory"], rows,
        notes=[f"P = {P:,} params, fp32 master weights, grads and Adam moments: 16P = {16 * P / 1e6:.3f} MB "
               "replicated; measured on the last rank after one step from tensor storage (views counted once)",
               "FSDP units: the embedding, one per block, final norm + head; forward gathers each, backward the blocks "
               "again, and every backward reduce-scatters each unit into the shard gradients",
               "theory (one micro-batch): FSDP (M-1)/M x 4(3P - E), E = embedding + norm + head params; HSDP (shard K, "
               "replicas R): (K-1)/K x 4(3P - E) + 2(R-1)/R x 4P/K; DDP 2(g-1)/g x 4P (padding makes FSDP send a hair "
               "more)"])
    world, frac, gathers, units = fsdp8
    common.answer("L13", f"FSDP M={world} keeps {frac:.3f} of the replicated 16 B/param per rank")
    common.answer("L14", f"{gathers.get('forward')} all-gathers in forward and {gathers.get('backward')} in backward "
                         f"per micro-batch ({units} units: embedding, one per block, norm + head), 1 reduce-scatter "
                         "per unit per micro-batch")

"""L9 + L10: DDP bucket size vs the number of all-reduce calls, and how much of the sync hides under backward.

    python -m bench.labs.ddp_buckets   # world 2 gloo, a 4-layer d=256 GPT
    python -m bench.labs.ddp_buckets --quick

Per --bucket-mb (0: a bucket per parameter) with overlap on and off, each rank times backward and finish_grad_sync:
with overlap what the sync still waits for is the exposed communication. For a timeline: train.py --profile.
"""
import statistics
import time

import torch
from torch import nn

import model
import train
from bench import common
from bench.ranks import run_ranks
from parallel.ddp import DDP
from parallel.materialize import init_weights
from parallel.mesh import Mesh


def _sweep(rank, world, cfg_fields, settings, micro_batch, steps, warmup=2, seed=1337):
    """One DDP model per setting, stepped round-robin so that a busy host slows every setting alike."""
    cfg = model.ModelConfig(**cfg_fields)
    mesh = Mesh(rank, world)
    runs = []
    for bucket_mb, overlap in settings:
        with torch.device("meta"):
            gpt = model.GPT(cfg)
        init_weights(gpt, seed, "cpu")
        ddp = DDP(nn.ModuleList([gpt]), mesh, bucket_mb=bucket_mb, overlap=overlap)
        runs.append((gpt, ddp, train.make_adamw(ddp.optim_params(), 1e-3, 0.1, "cpu"), []))
    gen = torch.Generator().manual_seed(rank)
    for _ in range(warmup + steps):
        x = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len + 1), generator=gen)
        for gpt, ddp, opt, rows in runs:
            torch.distributed.barrier()
            mesh.stats.reset()
            t0 = time.perf_counter()
            gpt(x[:, :-1], x[:, 1:]).backward()
            t1 = time.perf_counter()
            in_backward = mesh.stats.calls["all_reduce"]  # the buckets backward launched
            ddp.finish_grad_sync()
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            rows.append((t2 - t0, t1 - t0, t2 - t1, mesh.stats.calls["all_reduce"], in_backward))
    out = []
    for (bucket_mb, overlap), (_, ddp, _, rows) in zip(settings, runs):
        rows = rows[warmup:]
        out.append(dict(bucket_mb=bucket_mb, overlap=overlap, buckets=len(ddp.buckets),
                        step=statistics.median(r[0] for r in rows), fwd_bwd=statistics.median(r[1] for r in rows),
                        exposed=statistics.median(r[2] for r in rows), calls=rows[-1][3], in_backward=rows[-1][4]))
    return out


@common.command
def main(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--micro-batch", type=int, default=4)
    args = p.parse_args(argv)
    fields = dict(n_layer=4, d_model=256, n_head=8, n_kv_head=4, ffn_dim=768, vocab_size=512, seq_len=128)
    sizes = [0, 0.25, 1, 4, 25]
    if args.quick:
        fields, sizes, args.steps = dict(common.QUICK_MODEL, vocab_size=64, seq_len=16), [0, 25], 2
    settings = [(mb, overlap) for mb in sizes for overlap in (True, False)]
    ranks = run_ranks(_sweep, args.world, args=(fields, settings, args.micro_batch, args.steps), timeout=900)
    P = model.param_counts(model.ModelConfig(**fields))[0]
    rows = []
    for per_rank in zip(*ranks):  # the slowest rank's medians
        r = per_rank[0]
        step, fb, exposed = (max(x[k] for x in per_rank) for k in ("step", "fwd_bwd", "exposed"))
        rows.append([f"{r['bucket_mb']:g}" + (" (per param)" if r["bucket_mb"] == 0 else ""),
                     "on" if r["overlap"] else "off", r["buckets"], r["calls"], r["in_backward"],
                     f"{fb * 1e3:.1f}", f"{exposed * 1e3:.1f}", f"{step * 1e3:.1f}"])
    common.write_result(args.out, "L10_ddp_buckets", "L9/L10: DDP bucket size, collective calls and overlap",
                        ["bucket MB", "overlap", "buckets", "all-reduce calls / step", "launched in backward",
                         "fwd+bwd ms", "exposed sync ms", "step ms"], rows,
                        notes=[f"world {args.world} gloo ranks; GPT {fields} ({P / 1e6:.2f}M params, "
                               f"{4 * P / 2**20:.1f} MiB of fp32 grads); micro-batch {args.micro_batch}; "
                               f"median of {args.steps} steps, slowest rank",
                               "exposed sync = time in finish_grad_sync after backward returned: the all-reduce "
                               "time not hidden under backward",
                               "trace: python train.py --profile --dp 2 ... writes out/trace_rank0.json; open it in "
                               "ui.perfetto.dev or chrome://tracing"])
    best = min(rows, key=lambda r: float(r[7]))
    common.answer("L10", f"{rows[0][3]} calls with per-parameter buckets vs {rows[-2][3]} with 25 MB; fastest step "
                         f"at {best[0]} MB overlap {best[1]} ({best[7]} ms)")
    on = [r for r in rows if r[1] == "on"]
    off = [r for r in rows if r[1] == "off"]
    common.answer("L9", f"with overlap the sync left after backward is {min(float(r[6]) for r in on):.1f} ms at best "
                        f"vs {min(float(r[6]) for r in off):.1f} ms without (buckets launch from hooks in backward)")

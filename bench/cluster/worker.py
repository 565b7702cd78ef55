"""What each rank of the emulated cluster runs, started by measure.py with torchrun in every node:
`python -m bench.cluster.worker --spec SPEC.json --out RESULT.json`. The spec names the tasks: "collectives"
(collective_bandwidth's sweep, intra- and inter-node groups) and "train" (each layout's train_step, timed per step
with its exposed communication and, just before, the ranks' rates); "order": "interleaved" puts consecutive ranks
(a tp group) on different nodes. Rank 0 writes the results.
"""
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import config
import train
from bench import common
from bench.cluster.net import join_cpu_share
from bench.gpu.factors import flops, linears
from bench.labs.collective_bandwidth import bench_rank


def placed_rank(order):
    """This process's global rank: torchrun's, or under "interleaved" local rank major."""
    rank, local, per_node = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"))
    nodes = int(os.environ["WORLD_SIZE"]) // per_node
    return local * nodes + rank // per_node if order == "interleaved" else rank


def gather(value):
    """Every rank's value (a JSON-able object), in rank order."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def shared_rate(fn, work, trials, trial_s=0.5):
    """work / seconds of fn() while every rank runs its own at the same time, the median of a few trials that start
    together: the rate a rank gets of cores it shares (a best-of of short trials would catch the moments when the
    other ranks happen to be descheduled)."""
    rates = []
    for _ in range(trials):
        dist.barrier()
        n, t0 = 0, time.perf_counter()
        while n == 0 or time.perf_counter() - t0 < trial_s:
            fn()
            n += 1
        rates.append(work * n / (time.perf_counter() - t0))
    return statistics.median(rates)


def attention(q, k, v):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()


class CountOps(TorchDispatchMode):
    """Counts the aten ops dispatched under it."""
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def small_ops(x, n=50):
    """n multiplies of a 4-element tensor and their backward: ops too small to cost more than their dispatch, half
    from Python (a step's forward), half from autograd's engine (its backward)."""
    y = x
    for _ in range(n):
        y = y * 1.0001
    y.sum().backward()


def device_rates(spec, trials):
    """Median over ranks, all running at once at the workload's sizes: matmul FLOP/s over a block's linears, causal
    attention fwd + bwd (12 d T FLOPs per token), memory bytes/s of a 16 MB add (past the caches) and host ops/s of
    ops too small to cost more than their dispatch."""
    cfg = train.model_config(config.parse_args(spec["model"]), 0)
    t, d, T, hd = spec["rate_rows"], cfg.d_model, cfg.seq_len, cfg.head_dim
    mm = linears(cfg, t, torch.float32, "cpu")
    q, kv = torch.randn(1, cfg.n_head, T, hd), torch.randn(1, cfg.n_kv_head, T, hd)
    a, b = torch.randn(2 ** 22), torch.randn(2 ** 22)
    tiny = torch.ones(4, requires_grad=True)
    with CountOps() as counted:
        small_ops(tiny)
    mine = {"matmul": shared_rate(lambda: [x @ w for x, w in mm], flops(mm), trials),
            "attention": shared_rate(lambda: attention(q, kv, kv), 12 * d * T * T, trials),
            "memory": shared_rate(lambda: a + b, 3 * 4 * a.numel(), trials),
            "host": shared_rate(lambda: small_ops(tiny), counted.n, trials)}
    ranks = gather(mine)
    return {k: statistics.median(r[k] for r in ranks) for k in mine}


def layout_args(spec, flags, rank=0, world=1):
    args = config.resolve(spec["model"] + ["--dtype", "fp32", "--device", "cpu", "--peak-tflops", "1"] + flags,
                          environ={"RANK": str(rank), "WORLD_SIZE": str(world)})
    return args, train.model_config(args, 0)


def train_layout(spec, flags, world, rank):
    """[(slowest rank's step seconds, most seconds blocked in collectives)] for each timed step of one layout, each
    train.py's own train_step."""
    args, cfg = layout_args(spec, flags, rank, world)
    mesh = train.start_distributed(args)
    run = train.prepare(args, cfg, mesh)
    rows = args.global_batch // mesh.dp
    steps = []
    for step in range(spec["warmup"] + spec["steps"]):
        ids = torch.randint(0, cfg.vocab_size, (args.global_batch, cfg.seq_len + 1),
                            generator=torch.Generator().manual_seed(step))
        mine = ids[mesh.coord["dp"] * rows:(mesh.coord["dp"] + 1) * rows]
        x, y = mine[:, :-1].contiguous(), mine[:, 1:].contiguous()
        dist.barrier()
        mesh.stats.reset()
        t0 = time.perf_counter()
        train.train_step(run, x, y, 1e-3, args.grad_clip)
        took = torch.tensor([time.perf_counter() - t0, mesh.stats.wait_s])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        if step >= spec["warmup"]:
            steps.append(took.tolist())
    sent = mesh.stats.total_bytes
    del run
    return steps, sent


@common.command
def main(argv=None):
    ap = common.parser(__doc__, results=False)
    ap.add_argument("--spec", required=True, help="a JSON file: tasks, model flags, layouts (see the docstring)")
    ap.add_argument("--out", required=True, help="rank 0 writes the results here (JSON)")
    args = ap.parse_args(argv)
    spec = json.loads(Path(args.spec).read_text())
    torch.set_num_threads(1)
    rank, world = placed_rank(spec.get("order", "node")), int(os.environ["WORLD_SIZE"])
    if spec.get("cgroups"):
        join_cpu_share(spec["cgroups"], rank)  # a rank is a device: its share of the cores, lent to no one
    if spec.get("rails", 1) > 1:  # a rank is a GPU with its own NIC: local rank J talks through rail J
        os.environ["GLOO_SOCKET_IFNAME"] = f"eth{int(os.environ['LOCAL_RANK']) % spec['rails']}"
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = {"world": world, "order": spec.get("order", "node"), "per_node": int(os.environ["LOCAL_WORLD_SIZE"]),
           "nodes": gather(os.readlink("/proc/self/ns/net"))}  # each rank's network namespace, in rank order
    if "collectives" in spec["tasks"]:
        out["collectives"] = bench_rank(rank, world, out["per_node"], spec["sizes"], spec["ops"], spec["target_s"])
    if "train" in spec["tasks"]:
        out["train"] = {name: {"steps": [], "sent": 0.0, "rates": []} for name in spec["layouts"]}
        for _ in range(spec["rounds"]):
            for name, flags in spec["layouts"].items():
                out["train"][name]["rates"].append(device_rates(spec, trials=1))  # at the load its steps see
                steps, sent = train_layout(spec, flags, world, rank)
                out["train"][name]["steps"] += steps
                out["train"][name]["sent"] = sent
    if rank == 0:
        Path(args.out).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown: gloo's threads of the many meshes' groups are not joined one by one

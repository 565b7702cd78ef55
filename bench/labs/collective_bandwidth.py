"""L12: collective bandwidth inside a node and across nodes, measured the way nccl-tests does.

    python -m bench.labs.collective_bandwidth   # here: 4 gloo processes on loopback, "2 per node"
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv-endpoint HOST:29500 -m bench.labs.collective_bandwidth   # a cluster

Per collective and message size S: t the slowest rank's mean per call, algbw = S / t, busbw = algbw x BUS_FACTOR
(nccl-tests' doc/PERFORMANCE.md), checked against parallel/comm.py's bytes. The intra-node groups (a node's ranks)
run at once, then the inter-node ones (local rank i of every node). Under torchrun the node is LOCAL_WORLD_SIZE (NCCL
on GPUs); without it the script starts --world gloo processes and pretends --gpus-per-node share a node.
"""
import os
import time

import torch
import torch.distributed as dist

from bench import common
from bench.ranks import run_ranks
from config import UsageError
from parallel.comm import CommStats, Group

BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n, "send_recv": lambda n: 1.0}
COUNTER = {"all_reduce": "all_reduce", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter",
           "all_to_all": "all_to_all", "send_recv": "send"}


def partitions(world, per_node):
    """{"intra-node": [[0..L-1], [L..2L-1], ...], "inter-node": [[0, L, 2L, ...], [1, L+1, ...], ...]}."""
    nodes = world // per_node
    out = {}
    if per_node > 1:
        out["intra-node"] = [list(range(k * per_node, (k + 1) * per_node)) for k in range(nodes)]
    if nodes > 1:
        out["inter-node"] = [list(range(i, world, per_node)) for i in range(per_node)]
    return out


def make_groups(rank, world, per_node, stats):
    """This rank's comm.Group of each kind. Every rank creates every group, in the same order."""
    mine = {}
    for kind, groups in partitions(world, per_node).items():
        for ranks in groups:
            pg = dist.new_group(ranks)
            if rank in ranks:
                mine[kind] = Group(kind, ranks, pg, rank, stats)
    return mine


def buffers(op, size_bytes, n, device):
    """(input, output) of the op for a message of size_bytes (float32 elements, divisible by n)."""
    count = size_bytes // 4
    full = torch.ones(count, device=device)
    part = torch.empty(count // n, device=device)
    return {"all_reduce": (full, None), "all_gather": (part.fill_(1), full), "reduce_scatter": (full, part),
            "all_to_all": (full, torch.empty_like(full)), "send_recv": (full, torch.empty_like(full))}[op]


def run_op(op, group, inp, out, device):
    if op != "send_recv":  # all_reduce(inp); all_gather, reduce_scatter, all_to_all(out, inp)
        return getattr(group, op)(*([inp] if op == "all_reduce" else [out, inp]))
    n, r = group.size, group.rank  # a ring: send to the next rank of the group, receive from the previous one
    for req in group.send_recv([(inp, (r + 1) % n)], [(out, (r - 1) % n)]):
        req.wait()


def world_max(value, device):
    t = torch.tensor([float(value)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def bench_rank(rank, world, per_node, sizes, ops, target_s):
    """Runs every (group kind, op, size) on this rank. Returns rows (rank 0's are the table)."""
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if dist.get_backend() == "nccl" else "cpu")
    stats = CommStats()
    groups = make_groups(rank, world, per_node, stats)
    kinds = list(partitions(world, per_node))
    rows = []
    for kind in kinds:
        group = groups[kind]
        n = group.size
        for op in ops:
            for size in sizes:
                size = size // (4 * n) * 4 * n  # whole float32 elements, divisible by n
                inp, out = buffers(op, size, n, device)
                run_op(op, group, inp, out, device)  # warm-up: connection setup, buffer registration
                common.sync(device)
                t0 = time.perf_counter()
                run_op(op, group, inp, out, device)
                common.sync(device)
                probe = world_max(time.perf_counter() - t0, device)  # every rank must agree on iters
                iters = max(2, min(50, int(target_s / max(probe, 1e-6))))
                stats.reset()
                world_max(0, device)  # a barrier
                t0 = time.perf_counter()
                for _ in range(iters):
                    run_op(op, group, inp, out, device)
                common.sync(device)
                t = world_max((time.perf_counter() - t0) / iters, device)
                counted = stats.bytes[COUNTER[op]] / iters
                algbw = size / t / 1e9
                busbw = algbw * BUS_FACTOR[op](n)
                assert abs(counted - busbw * 1e9 * t) <= 1e-6 * counted + 1, (op, counted, busbw * t)
                rows.append(dict(kind=kind, n=n, op=op, size=size, iters=iters, time_us=t * 1e6,
                                 algbw=algbw, busbw=busbw))
    return rows


def human(size):
    for unit, scale in (("GB", 2 ** 30), ("MB", 2 ** 20), ("KB", 2 ** 10)):
        if size >= scale:
            return f"{size / scale:.0f} {unit}"
    return f"{size} B"


def report(rows, world, per_node, backend, out, loopback):
    table = [[r["kind"], r["n"], r["op"], human(r["size"]), r["iters"], f"{r['time_us']:.1f}", f"{r['algbw']:.4g}",
              f"{r['busbw']:.4g}"] for r in rows]
    peak = {}
    for r in rows:
        key = (r["kind"], r["op"])
        peak[key] = max(peak.get(key, 0.0), r["busbw"])
    summary = [[op] + [f"{peak.get((kind, op), float('nan')):.4g}" for kind in ("intra-node", "inter-node")]
               for op in BUS_FACTOR]
    nodes = world // per_node
    notes = [f"world {world}: {nodes} node(s) x {per_node} rank(s); float32 buffers; time = the slowest rank's "
             "mean per call; one warm-up call, iterations sized to ~0.1 s.",
             "busbw factors (nccl-tests): all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n (S = the "
             "full gathered/scattered buffer), all-to-all (n-1)/n, send/recv 1 (each rank sends S to the next "
             "and receives S from the previous rank of a ring). busbw x time equals parallel/comm.py's byte "
             "counter for every row (checked)."]
    if loopback:
        notes.insert(0, f"LOOPBACK ONLY: all {world} processes run on this one machine over gloo/TCP loopback. "
                        f"The 'nodes' are pretend ({per_node} consecutive ranks each), so intra-node and "
                        "inter-node are the same wire here and differ only by noise. On a cluster run the same "
                        "script under torchrun (NCCL): intra-node is NVLink (H100: ~450 GB/s per direction, "
                        "nccl-tests all-reduce busbw ~360-480 GB/s), inter-node the NIC (400 Gb/s = 50 GB/s).")
    title = "L12: collective bandwidth vs message size, intra- vs inter-node" + (" (loopback only)" if loopback else "")
    common.write_result(out, "L12_collectives", title,
                        ["group", "n", "collective", "size", "iters", "time us", "algbw GB/s", "busbw GB/s"],
                        table, notes, backend=backend)
    common.write_result(out, "L12_collectives_peak", "L12: peak busbw per collective" +
                        (" (loopback only)" if loopback else ""),
                        ["collective", "intra-node busbw GB/s", "inter-node busbw GB/s"], summary,
                        ["The largest busbw over message sizes; see L12_collectives.md for the sweep."],
                        backend=backend)
    ar = [peak.get((k, "all_reduce")) for k in ("intra-node", "inter-node")]
    text = " vs ".join(f"{k} {v:.2f} GB/s" for k, v in zip(("intra-node", "inter-node"), ar) if v is not None)
    common.answer("L12", f"all-reduce peak busbw {text} ({backend}{', loopback only' if loopback else ''})")


@common.command
def main(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--world", type=int, default=4, help="processes to start when not under torchrun")
    p.add_argument("--gpus-per-node", type=int, default=2, help="ranks per pretend node when not under torchrun")
    p.add_argument("--sizes", help="message sizes in bytes, comma-separated (default: 4 KB..64 MB on CPU, "
                                   "1 KB..1 GB on GPU, x4 steps)")
    p.add_argument("--ops", default=",".join(BUS_FACTOR), help="collectives to run")
    p.add_argument("--target-s", type=float, default=0.1, help="seconds of iterations per measurement")
    args = p.parse_args(argv)
    ops = args.ops.split(",")
    unknown = set(ops) - set(BUS_FACTOR)
    if unknown:
        raise UsageError(f"--ops: unknown collectives {sorted(unknown)}; choose from {', '.join(BUS_FACTOR)}")
    under_torchrun = "WORLD_SIZE" in os.environ and "RANK" in os.environ
    gpu = torch.cuda.is_available() and under_torchrun
    if args.sizes:
        sizes = [int(s) for s in args.sizes.split(",")]
    elif args.quick:
        sizes = [4096, 65536]
    else:
        sizes = [2 ** e for e in (range(10, 31, 2) if gpu else range(12, 27, 2))]
    if under_torchrun:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if gpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if gpu else "gloo")
        rows = bench_rank(rank, world, per_node, sizes, ops, args.target_s)
        backend = dist.get_backend()
        dist.destroy_process_group()
        if rank == 0:
            # torchrun on one node has one pretend node too: loopback unless several nodes took part
            report(rows, world, per_node, backend, args.out, loopback=world == per_node and not gpu)
        return
    if args.world % args.gpus_per_node:
        raise UsageError(f"--world {args.world} is not a multiple of --gpus-per-node {args.gpus_per_node}")
    rows = run_ranks(bench_rank, args.world, args=(args.gpus_per_node, sizes, ops, args.target_s), timeout=600)[0]
    report(rows, args.world, args.gpus_per_node, "gloo", args.out, loopback=True)

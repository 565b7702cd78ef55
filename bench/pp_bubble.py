"""L26: the theoretical pipeline utilization M/(M+P-1) against the measured one.

    python bench/pp_bubble.py                      # P = 4 gloo ranks, M = 1, 4, 8, 16, 1F1B
    python bench/pp_bubble.py --schedule gpipe     # the same bubble, more memory
    python bench/pp_bubble.py --quick

Equal-cost stages: a 4-layer GPT (d 512, ffn 1536, 256 tokens per micro-batch, the 257-token byte vocab)
split 1,1,1,1, so the embedding lookup and the head (2·d·V FLOPs per token, ~2% of a layer) barely tilt the
first and last stage. Each rank runs one thread. The executor (parallel/pp.py) records per stage the seconds
spent inside forward and backward (busy) and the rest of the step (idle: the bubble, and waiting on a
neighbour); with timed=True the stages start and end each step together, so idle includes the fill before and
the drain after a stage's work. Measured utilization = busy / (busy + idle), the median over steps, then
averaged over stages.

Contention: 4 ranks share 2 cores. In the steady state all four stages compute and each runs at about half
speed; in the fill and drain fewer stages share the cores and run faster, which shrinks the bubble next to the
busy time. The column "2-core model" replays the schedule with processor sharing (k busy stages on C cores run
at min(1, C/k) speed) to show how much of the gap to M/(M+P-1) that explains; on one device per stage the two
coincide.
"""
import argparse
import os
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import model as M  # noqa: E402
from bench import common  # noqa: E402
from parallel import pp  # noqa: E402
from parallel import pp_schedule as S  # noqa: E402
from parallel.ddp import DDP  # noqa: E402
from parallel.launch import run_ranks  # noqa: E402
from parallel.mesh import Mesh  # noqa: E402

FULL = dict(n_layer=4, d_model=512, n_head=8, n_kv_head=8, ffn_dim=1536, vocab_size=257, seq_len=256)
QUICK = dict(n_layer=4, d_model=64, n_head=4, n_kv_head=4, ffn_dim=128, vocab_size=257, seq_len=32)


def _measure(rank, world, cfg_fields, schedule, micro_counts, steps, min_micro_batches, warmup=1):
    cfg = M.ModelConfig(**cfg_fields)
    mesh = Mesh(rank, world, pp=world)
    with torch.device("meta"):
        full = M.GPT(cfg)
    chunks = pp.split(full, mesh, n_micro=1, schedule=schedule, layer_split=(1,) * world)
    for chunk in chunks:
        M.init_weights(chunk, 1337, "cpu")
    wrapper = DDP(torch.nn.ModuleList(chunks), mesh)
    gen = torch.Generator().manual_seed(0)
    out = {}
    for n_micro in micro_counts:
        batches = [(torch.randint(0, cfg.vocab_size, (1, cfg.seq_len), generator=gen),
                    torch.randint(0, cfg.vocab_size, (1, cfg.seq_len), generator=gen)) for _ in range(n_micro)]
        rows = []
        for step in range(warmup + max(steps, min_micro_batches // n_micro)):  # short steps: more of them
            _, record = pp.execute(chunks, mesh, batches, None, nullcontext(), torch.float32, 1.0, wrapper, timed=True)
            for p in wrapper.params:
                p.grad = None
            if step >= warmup:
                rows.append((record.busy_s, record.wall_s, record.utilization))
        fwd = [e - s for a, s, e in record.events if a.op == "F"]
        bwd = [e - s for a, s, e in record.events if a.op == "B"]
        out[n_micro] = dict(util=statistics.median(r[2] for r in rows), wall=statistics.median(r[1] for r in rows),
                            busy=statistics.median(r[0] for r in rows), fwd=statistics.median(fwd),
                            bwd=statistics.median(bwd))
    return out


def processor_sharing(schedule, P, M, cores, f=1.0, b=2.0, dt=0.002):
    """Mean stage utilization when the stages' computes share `cores` CPUs evenly (fluid simulation)."""
    orders, last = S.SCHEDULES[schedule](P, M), P - 1
    finished, pc, current, busy, t = {}, [0] * P, [None] * P, [0.0] * P, 0.0
    while any(pc[r] < len(orders[r]) or current[r] for r in range(P)):
        for r in range(P):
            if current[r] is None and pc[r] < len(orders[r]):
                a = orders[r][pc[r]]
                dep = (("F", r - 1, a.mb) if r > 0 else None) if a.op == "F" else (
                    ("B", r + 1, a.mb) if r < last else ("F", r, a.mb))
                if dep is None or dep in finished:
                    current[r], pc[r] = [a, f if a.op == "F" else b], pc[r] + 1
        active = [r for r in range(P) if current[r]]
        for r in active:
            current[r][1] -= min(1.0, cores / len(active)) * dt
            busy[r] += dt
            if current[r][1] <= 1e-9:
                finished[(current[r][0].op, r, current[r][0].mb)] = True
                current[r] = None
        t += dt
    return sum(busy) / P / t


def main(argv=None):
    p = common.add_common_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    p.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"])
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--micro-batches", default="1,4,8,16", help="comma-separated M values")
    p.add_argument("--steps", type=int, default=3, help="measured steps per M (after one warmup step)")
    args = p.parse_args(argv)
    P, micro_counts = args.stages, [int(m) for m in args.micro_batches.split(",")]
    cfg, steps, min_micro_batches = (QUICK, 1, 0) if args.quick else (FULL, args.steps, 16)
    t0, load_before = time.time(), os.getloadavg()[0]
    per_rank = run_ranks(_measure, P, args=(cfg, args.schedule, micro_counts, steps, min_micro_batches), timeout=900)
    cores = common.cpu_cores()
    rows, worst = [], 0.0
    for m in micro_counts:
        utils = [r[m]["util"] for r in per_rank]
        measured, theory = statistics.mean(utils), m / (m + P - 1)
        shared = processor_sharing(args.schedule, P, m, cores) if cores < P else theory
        worst = max(worst, abs(measured / theory - 1))
        rows.append([m, f"{m}/{m + P - 1} = {theory:.3f}", f"{measured:.3f}", f"{min(utils):.3f}-{max(utils):.3f}",
                     f"{measured / theory - 1:+.1%}", f"{shared:.3f}", f"{per_rank[0][m]['fwd'] * 1e3:.0f}",
                     f"{per_rank[0][m]['bwd'] * 1e3:.0f}", f"{statistics.mean(r[m]['wall'] for r in per_rank):.2f}"])
    header = ["M", "theory M/(M+P-1)", "measured (mean of stages)", "stage range", "measured vs theory",
              f"{cores}-core model", "stage-0 F ms", "stage-0 B ms", "step s"]
    notes = [f"P = {P} stages, {args.schedule}, one gloo rank and one thread per stage, {cores} CPU cores; model "
             f"{cfg}, micro-batch 1 x {cfg['seq_len']} tokens; median of max({steps}, {min_micro_batches}/M) steps "
             "after one warmup step.",
             "busy = seconds inside a stage's forward/backward calls, idle = the rest of its step "
             "(StageRecord from parallel/pp.py); utilization = busy / (busy + idle).",
             f"largest deviation from M/(M+P-1): {worst:.1%} (acceptance: within 15%); "
             f"the {cores}-core model is the processor-sharing prediction (see the script's docstring).",
             f"wall time of the whole measurement: {time.time() - t0:.0f} s; 1-minute load average "
             f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after (other jobs on the cores stretch single "
             "forwards and backwards at random, and a pipeline turns each such stall into idle time downstream)."]
    title = f"L26: pipeline utilization, measured vs M/(M+P-1) ({args.schedule})"
    common.write_result(args.out, "L26_pp_bubble", title, header, rows, notes=notes)
    summary = ", ".join(f"M={r[0]}: {r[2]} vs {r[1].split(' = ')[1]}" for r in rows)
    common.answer("L26", f"P={P} {args.schedule}: measured vs theory M/(M+P-1): {summary}; "
                         f"worst deviation {worst:.1%}")
    return worst


if __name__ == "__main__":
    main()

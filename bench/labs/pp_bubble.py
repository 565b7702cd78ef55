"""L26: every pipeline schedule's utilization, measured against its theory, and the activation sets each keeps alive.

    python -m bench.labs.pp_bubble   # P = 4 gloo ranks, M = 8 and 16, all five schedules
    python -m bench.labs.pp_bubble --schedules 1f1b,zb1 --micro-batches 4,8
    python -m bench.labs.pp_bubble --quick

Equal-cost stages under every schedule; TimedPipeline (parallel/pp.py's executor with a clock) records each stage's
busy and idle seconds; the "cost model" and "cores model" columns replay the schedules with the measured F, B, W times
and with processor sharing (bench/README.md, "Pipeline parallel", says how and why).
"""
import os
import statistics
import time
from contextlib import nullcontext

import torch

import model
from bench import common
from bench.ranks import run_ranks
from parallel import pp, pp_bw_split
from parallel import pp_schedule as S
from parallel.ddp import DDP
from parallel.materialize import init_weights
from parallel.mesh import Mesh

FULL = dict(n_layer=8, d_model=512, n_head=8, n_kv_head=8, ffn_dim=1536, vocab_size=257, seq_len=128)
QUICK = dict(n_layer=8, d_model=64, n_head=4, n_kv_head=4, ffn_dim=128, vocab_size=257, seq_len=32)
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb1", "zbv")


class TimedPipeline(pp.Pipeline):
    """The executor with a clock: busy_s (inside F, B and W; on CUDA each synchronized), wall_s (between two pp-group
    barriers), events [(action, start, end)], utilization = busy / wall."""

    def run(self, actions):
        self.busy_s, self.events = 0.0, []
        self.group.all_reduce(torch.zeros(1, device=self.device))  # the stages start together
        self.t0 = time.perf_counter()
        loss = super().run(actions)
        self.group.all_reduce(torch.zeros(1, device=self.device))  # and end together: the drain counts as idle
        self.wall_s = time.perf_counter() - self.t0
        return loss

    max_in_flight = 0  # the most activation sets alive at once (forwards awaiting B or W)

    def compute(self, a, received):
        start = time.perf_counter()
        super().compute(a, received)
        self.max_in_flight = max(self.max_in_flight, len(self.alive))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        end = time.perf_counter()
        self.busy_s += end - start
        self.events.append((a, start - self.t0, end - self.t0))

    @property
    def utilization(self):
        return self.busy_s / self.wall_s if self.wall_s else 0.0


def chunks_per_rank(schedule):
    return S.chunks_per_rank(schedule, 2 if schedule == "interleaved" else 1)


def _measure(rank, world, cfg_fields, seqs, schedules, micro_counts, steps, min_micro_batches, warmup=1):
    """Per (schedule, M): each measured step's (utilization, seconds), peak activation sets, median F/B/W seconds (a
    stage's worth). The schedules take turns step by step, so a stall from another job on the machine hits them
    alike."""
    cfg = model.ModelConfig(**cfg_fields)
    mesh = Mesh(rank, world, pp=world)
    gen = torch.Generator().manual_seed(0)
    runs = {}
    for schedule in schedules:
        V = chunks_per_rank(schedule)
        with torch.device("meta"):
            full = model.GPT(cfg)
        chunks = pp.split(full, mesh, max(micro_counts), schedule, V, (cfg.n_layer // (world * V),) * (world * V))
        for chunk in chunks:
            if schedule in S.SPLIT_BACKWARD:  # zb1, zbv: weight gradients wait for the schedule's W
                pp_bw_split.apply(chunk)
            init_weights(chunk, 1337, "cpu")
        runs[schedule] = (chunks, DDP(torch.nn.ModuleList(chunks), mesh), V)
    out = {}
    for n_micro in micro_counts:
        shape = (seqs, cfg.seq_len)
        batches = [(torch.randint(0, cfg.vocab_size, shape, generator=gen),
                    torch.randint(0, cfg.vocab_size, shape, generator=gen)) for _ in range(n_micro)]
        records = {s: [] for s in schedules}
        for step in range(warmup + max(steps, min_micro_batches // n_micro)):  # short steps: more of them
            for schedule, (chunks, wrapper, _) in runs.items():
                _, record = pp.execute(chunks, mesh, batches, None, nullcontext(), torch.float32, 1.0, wrapper,
                                       runner=TimedPipeline)
                wrapper.zero_grad()
                if step >= warmup:
                    records[schedule].append(record)
        for schedule, rows in records.items():
            V = runs[schedule][2]
            times = {op: [e - s for r in rows for a, s, e in r.events if a.op == op] for op in S.COMPUTE}
            out[(schedule, n_micro)] = dict(
                steps=[(r.utilization, r.wall_s) for r in rows], sets=max(r.max_in_flight for r in rows) / V,
                **{op: V * statistics.median(t) if t else 0.0 for op, t in times.items()})
    return out


def cost_model(schedule, P, M, f, b, w):
    """Mean stage utilization of the schedule simulated with forward f, input gradient b and weight gradient w (the
    schedules that do not split the backward run b + w as one)."""
    V = chunks_per_rank(schedule)
    timeline = S.simulate(S.SCHEDULES[schedule](P, M, V), P, V, schedule in S.VSHAPED, f, b, w)
    end = max(e for row in timeline for _, e, _ in row)
    return sum(e - s for row in timeline for s, e, _ in row) / P / end


def processor_sharing(schedule, P, M, cores, dt=0.002):
    """Mean stage utilization when the stages' computes share `cores` CPUs evenly (fluid simulation), with a stage's
    F = B = W = 1 (a full backward 2), a chunk's 1/V of that."""
    V, vshape = chunks_per_rank(schedule), schedule in S.VSHAPED
    orders, last = S.SCHEDULES[schedule](P, M, V), P * V - 1
    cost = {"F": 1 / V, "B": (1 if schedule in S.SPLIT_BACKWARD else 2) / V, "W": 1 / V}
    finished, pc, current, busy, t = set(), [0] * P, [None] * P, [0.0] * P, 0.0
    while any(pc[r] < len(orders[r]) or current[r] for r in range(P)):
        for r in range(P):
            if current[r] is None and pc[r] < len(orders[r]):
                a = orders[r][pc[r]]
                v = S.stage_of(r, a.chunk, P, vshape)
                dep = S.dependency(a, v, last)
                if dep is None or dep in finished:
                    current[r], pc[r] = [(a.op, v, a.mb), cost[a.op]], pc[r] + 1
        active = [r for r in range(P) if current[r]]
        for r in active:
            current[r][1] -= min(1.0, cores / len(active)) * dt
            busy[r] += dt
            if current[r][1] <= 1e-9:
                finished.add(current[r][0])
                current[r] = None
        t += dt
    return sum(busy) / P / t


@common.command
def main(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated, of " + " ".join(SCHEDULES))
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--micro-batches", default="8,16", help="comma-separated M values")
    p.add_argument("--steps", type=int, default=5, help="measured steps per M (after one warmup step)")
    args = p.parse_args(argv)
    P, micro_counts = args.stages, [int(m) for m in args.micro_batches.split(",")]
    schedules = [s for s in args.schedules.split(",") if s]
    cfg, seqs, steps, min_micro_batches = (QUICK, 1, 1, 0) if args.quick else (FULL, 2, args.steps, 16)
    t0, load_before = time.time(), os.getloadavg()[0]
    per_rank = run_ranks(_measure, P, args=(cfg, seqs, schedules, micro_counts, steps, min_micro_batches), timeout=1200)
    cores = common.cpu_cores()
    rows, util, medians, worst = [], {}, {}, 0.0
    for m in micro_counts:
        for s in schedules:
            got = [r[(s, m)] for r in per_rank]
            walls = [statistics.mean(g["steps"][k][1] for g in got) for k in range(len(got[0]["steps"]))]
            fastest = [g["steps"][walls.index(min(walls))][0] for g in got]  # the least disturbed step, every stage
            util[(s, m)] = measured = statistics.mean(fastest)
            medians[(s, m)] = median = statistics.mean(statistics.median(u for u, _ in g["steps"]) for g in got)
            theory = S.theoretical_utilization(P, m, chunks_per_rank(s), s)
            shared = processor_sharing(s, P, m, cores) if cores < P else theory
            costs = cost_model(s, P, m, got[0]["F"], got[0]["B"], got[0]["W"])
            worst = max(worst, abs(measured / theory - 1))
            rows.append([m, s, f"{theory:.3f}", f"{measured:.3f}", f"{min(fastest):.3f}-{max(fastest):.3f}",
                         f"{measured / theory - 1:+.1%}", f"{median:.3f}", f"{costs:.3f}", f"{shared:.3f}",
                         " ".join(f"{g['sets']:g}" for g in got), "/".join(f"{got[0][op] * 1e3:.0f}" for op in "FBW"),
                         f"{min(walls):.2f}"])
    header = ["M", "schedule", "theory", "measured (mean of stages)", "stage range", "measured vs theory",
              "median step", "cost model", f"{cores}-core model", "activation sets, stages 0..P-1", "stage-0 F/B/W ms",
              "step s"]
    sets = {s: max(r[(s, m)]["sets"] for r in per_rank for m in micro_counts) for s in schedules}
    m0 = 8 if 8 in micro_counts else micro_counts[0]
    verdicts = [f"largest deviation from theory: {worst:.1%} (acceptance: within 15% for each schedule)"]
    if {"1f1b", "zb1"} <= set(schedules):
        verdicts += [f"zb1 - 1f1b at M = {m0}: {medians[('zb1', m0)] - medians[('1f1b', m0)]:+.3f} in the median step "
                     f"(acceptance: >= +0.08), {util[('zb1', m0)] - util[('1f1b', m0)]:+.3f} in the fastest (one "
                     f"sample: noisier); peak activation sets, the fullest stage: zb1 {sets['zb1']:g}, 1f1b "
                     f"{sets['1f1b']:g} (acceptance: zb1 <= 1f1b + 1). Stage by stage zb1 keeps P on each, where "
                     "1F1B keeps P - r on stage r: ZB-H1 runs stage r's W r micro-batches after its B, and a set "
                     "waiting for W keeps only each matmul's input and output gradient"]
    notes = [f"P = {P} stages, one gloo rank and one thread per stage, {cores} CPU cores; model {cfg}, micro-batch "
             f"{seqs} x {cfg['seq_len']} tokens, {cfg['n_layer'] // P} layers per stage; max({steps}, "
             f"{min_micro_batches}/M) steps after one warmup step, the schedules taking turns step by step. "
             "measured: the fastest step (other jobs on shared cores only add time, so the least disturbed step is the "
             "closest to the schedule's own behaviour); median step: each stage's median, averaged over stages.",
             "theory: F = B = W (pp_schedule.theoretical_utilization): M/(M+P-1), interleaved VM/(VM+P-1) with V = 2, "
             "zb1 3M/(3M+P-1), zbv 6M/(6M+P-1) once M fills the warmup.",
             "busy = seconds inside a stage's F, B and W actions, idle = the rest of its step (TimedPipeline: "
             "parallel/pp.py with a clock); utilization = busy / (busy + idle). F/B/W ms: a stage's worth (a chunk's "
             "x V); gpipe, 1f1b and interleaved run B and W as one backward, listed under B.", *verdicts,
             f"the {cores}-core model is the processor-sharing prediction (see the script's docstring). Wall time of "
             f"the whole measurement: {time.time() - t0:.0f} s; 1-minute load average {load_before:.1f} before, "
             f"{os.getloadavg()[0]:.1f} after (other jobs on the cores stretch single actions at random, and a "
             "pipeline turns each such stall into idle time downstream)."]
    title = "L26: pipeline utilization of each schedule, measured vs theory"
    common.write_result(args.out, "L26_pp_bubble", title, header, rows, notes=notes)
    summary = "; ".join(f"M={m}: " + ", ".join(f"{s} {util[(s, m)]:.3f}" for s in schedules) for m in micro_counts)
    common.answer("L26", f"P={P}, measured utilization (theory F = B = W): {summary}; worst deviation from theory "
                         f"{worst:.1%}")
    return worst

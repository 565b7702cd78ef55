"""The planner's search: every layout of a cluster, pruned (bench/README.md, "The planner's formulas"), each priced,
the best of each dp x tp x pp x cp mesh kept.
"""
import itertools
import math
from dataclasses import dataclass

from bench.planner.costs import shape_memory
from bench.planner.layout import GB, Layout, Shape, invalid
from bench.planner.step_time import members_per_node, shape_step_time
from model import param_counts

CKPTS = ("none", "selective", "op", "full")  # each saves more memory and recomputes more


@dataclass
class Plan:
    layout: Layout
    time: dict
    mem: dict
    fits: bool
    usable_gb: float  # what fits: HBM less the margin

    @property
    def mfu(self):
        return self.time["mfu"]


def evaluate(cfg, cl, lay, seq, batch, need_fit=False, checked=False, code="reference"):
    """The Plan of one layout (None if need_fit and it does not fit); ValueError if it cannot run."""
    why = None if checked else invalid(cfg, cl, lay, seq, batch, code)
    if why:
        raise ValueError(f"{lay}: {why}")
    s = Shape(cfg, lay, seq, batch, code)
    mem = shape_memory(s)
    fits = sum(mem.values()) <= cl.usable_gb(code) * GB  # below HBM less the code's margin (Cluster.margin_of)
    return Plan(lay, shape_step_time(s, cl), mem, fits, cl.usable_gb(code)) if fits or not need_fit else None


def pow2(limit):
    return [1 << i for i in range(int(math.log2(max(limit, 1))) + 1)]


def candidates(cfg, cl, seq, batch, max_micro=16, min_cp_tokens=1024, code="reference", fp8=False):
    """Every valid layout, pruned (bench/README.md), as families that differ only in micro-batch (ascending), each a
    list of one layout per checkpoint policy (CKPTS order); ours with both fsdp accumulations and the zero-bubble
    schedules, the reference with Megatron-LM's options. fp8: train.py --dtype fp8."""
    for tp in [x for x in pow2(cl.gpus_per_node) if cl.gpus % x == 0]:
        for cp in [c for c in pow2(seq // min_cp_tokens) if (cl.gpus // tp) % c == 0]:
            for pp in [p for p in range(1, cfg.n_layer + 1) if (cl.gpus // (tp * cp)) % p == 0]:
                dp = cl.gpus // (tp * cp * pp)
                if batch % dp:
                    continue
                g, local = dp * cp, members_per_node(cl.gpus_per_node, tp, cp, pp, dp, 1, "dp")
                shards = [k for k in pow2(g // 2) if k >= max(2, local)]
                modes = [("ddp", 0, "sharded")] + [(m, k, a) for m, k in [("fsdp", 0)] * (g > 1) + [
                    ("hsdp", k) for k in shards] for a in ("sharded", "unsharded")[:1 + (code == "ours")]]
                scheds = [("gpipe", 1), ("1f1b", 1)] if pp > 1 else [("1f1b", 1)]
                scheds += [("interleaved", v) for v in pow2((cfg.n_layer + 2) // pp) if v > 1 and pp > 1]
                scheds += zero_bubble(cfg, pp) if code == "ours" else []
                megatron = code == "reference"
                opts = [(o, d) for o in (False, True)[:1 + (megatron and tp > 1)] for d in (False, True)[:1 + megatron]]
                for (mode, shard, acc), (tp_overlap, dist_opt) in itertools.product(modes, opts):
                    if dist_opt and (mode != "ddp" or dp * cp == 1):
                        continue
                    for sched, V in scheds:
                        for cp_mode in ("ring", "ulysses", "allgather") if cp > 1 else ("ring",):
                            family = [[Layout(dp, tp, pp, cp, mode, shard, micro, c, sched, V, cp_mode,
                                              accumulate=acc, fp8=fp8, tp_comm_overlap=tp_overlap, dist_opt=dist_opt)
                                       for c in CKPTS] for micro in pow2(min(max_micro, batch // dp))]
                            family = [lays for lays in family if not invalid(cfg, cl, lays[0], seq, batch, code)]
                            if family:
                                yield family


def zero_bubble(cfg, pp):
    """The zero-bubble schedules train.py runs (parallel/pp_schedule.py; the simulator accepts every M >= P for
    both): zb1, and zbv's two chunks per rank where the model has a layer for each of the 2P chunks; not for the
    reference, which has none. Under fp8, which train.py refuses with them, invalid() drops them."""
    return [("zb1", 1)] * (pp > 1) + [("zbv", 2)] * (1 < pp and 2 * pp <= cfg.n_layer)


def rank_key(p):
    """By MFU; within 0.1 point, the simpler layout: ddp, hsdp, fsdp; fewer model splits; fewer options; smaller
    micro."""
    lay = p.layout
    return (-round(p.mfu, 3), ("ddp", "hsdp", "fsdp").index(lay.dp_mode), lay.tp * lay.pp * lay.cp,
            lay.tp_comm_overlap + lay.dist_opt, lay.micro)


def plan(cfg, cl, seq, batch, top=10, code="reference", fp8=False):
    """The `top` layouts that fit in memory, by predicted MFU, one per dp x tp x pp x cp mesh (its best
    dp mode, micro-batch, checkpointing, schedule and cp mode), for the implementation `code`, in fp8 or bf16."""
    best = {}
    for family in candidates(cfg, cl, seq, batch, code=code, fp8=fp8):
        for lays in family:
            # the lightest checkpointing that fits is the fastest; if none fits, larger micro-batches won't
            p = next((p for lay in lays if (p := evaluate(cfg, cl, lay, seq, batch, True, True, code))), None)
            if p is None:
                break
            mesh = (p.layout.dp, p.layout.tp, p.layout.pp, p.layout.cp)
            if mesh not in best or rank_key(p) < rank_key(best[mesh]):
                best[mesh] = p
    return sorted(best.values(), key=rank_key)[:top]


def default_batch_tokens(cfg):
    """GPT-3 / Llama practice: 0.5M tokens under 0.5B params, 1M under 3B, 4M under 100B, else 16M."""
    n = param_counts(cfg)[1]
    return 2**19 if n < 5e8 else 2**20 if n < 3e9 else 2**22 if n < 1e11 else 2**24

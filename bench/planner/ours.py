"""--code ours: the bytes this repository's parallel/*.py send (their traffic formulas, copied here: only the planner
reads them) and its memory through train.py's own model (parallel/memory.py). bench/README.md, "The planner's
formulas", states them; tests/test_plan_measured.py holds them to the comm counters and allocated bytes of CPU runs.
"""
import math
from dataclasses import replace
from types import SimpleNamespace

from bench.planner.layout import ACT_B, BUCKET_MB, G_B, W_B, shard_size
from parallel import memory

# ---- traffic formulas of parallel/*.py (bytes one rank sends)


def all_reduce_bytes(n_params, group_size, grad_bytes=4):
    """ddp.py: all-reduce n_params gradients, 2(g-1)/g · grad_bytes · n_params."""
    return 2 * (group_size - 1) / group_size * grad_bytes * n_params


def gathers_per_step(micro_batches, keep_gathered, backward=True):
    """fsdp.py: all-gathers of a unit per step; 1 when kept gathered (pp), else one per micro-batch for forward
    and, for a block (backward=True), one more for backward."""
    return 1 if keep_gathered else (1 + backward) * micro_batches


def gather_reduce_bytes(n_params, shard_size, gathers, compute_bytes, reduce_bytes, reduces=1):
    """fsdp.py, per step: (gathers·c + reduces·r)·(S-1)/S·n_params; reduces: the backwards (micro-batches)."""
    per_param = gathers * compute_bytes + reduces * reduce_bytes
    return per_param * (shard_size - 1) / shard_size * n_params


def replica_bytes(n_params, shard_size, replicas, grad_bytes=4):
    """hsdp.py: all-reduce the gradient shard over the replicas once per step, 2(R-1)/R · grad_bytes · n_params/K."""
    return 2 * (replicas - 1) / replicas * grad_bytes * n_params / shard_size


def seq_collective_bytes(tokens, d_model, tp, elem_bytes):
    """tp.py: an all_gather_seq or reduce_scatter_seq of (tokens, d)."""
    return (tp - 1) / tp * tokens * d_model * elem_bytes


def activation_collectives(layers, embedding, head, sequence_parallel, recompute):
    """tp.py: (tokens, d) collectives per micro-batch (an all-reduce counts 2). A block 8 (sp 10), +2 recomputed
    (sp 3); the embedding 2, the head 2 (sp 3)."""
    sp = sequence_parallel
    return layers * (8 + 2 * sp + recompute * (3 if sp else 2)) + 2 * embedding + (2 + sp) * head


def loss_bytes(tokens, tp):
    """tp.py: the loss's all-gather of (2, tokens) fp32, (t-1) · 2 · tokens · 4."""
    return (tp - 1) * 2 * tokens * 4


def p2p_bytes(sends, tokens, d_model, elem_bytes, seq_shards=1):
    """pp.py: a stage's sends per step, sends · tokens · d · e / seq_shards (sp)."""
    return sends * tokens * d_model * elem_bytes / seq_shards


def ulysses_bytes(tokens, head_dim, q_heads, kv_heads, cp, elem_bytes):
    """cp.py: (fwd, bwd) per layer, each (cp-1)/cp · tokens · hd · (2q + 2·lcm(kv, cp)) · e."""
    each = (cp - 1) / cp * tokens * head_dim * (2 * q_heads + 2 * math.lcm(kv_heads, cp)) * elem_bytes
    return each, each


def allgather_bytes(kv_elements, cp, elem_bytes):
    """cp.py: (fwd, bwd) per layer, K,V all-gathered and dK,dV reduce-scattered, each (cp-1) · kv · e."""
    each = (cp - 1) * kv_elements * elem_bytes
    return each, each


def ring_bytes(kv_elements, cp, elem_bytes):
    """ring_attention.py: (fwd, bwd) per layer, (cp-1) · kv · e each; backward adds cp hops of fp32 dK,dV."""
    forward = (cp - 1) * kv_elements * elem_bytes
    return forward, forward + cp * kv_elements * 4

# ---- a layout's traffic and memory


def fsdp_parts(s, layers, params, embed, head, w_bytes=W_B, g_bytes=G_B):
    """One stage's FSDP/HSDP traffic per step, {"gather", "reduce", "replica": (bytes per rank, ring steps)}, and its
    unit count; the end units (embedding, norm + head) are never gathered for backward."""
    lay, M, S, d = s.lay, s.M, shard_size(s.lay), s.cfg.d_model
    kept, ends = lay.pp > 1, s.p_embed * embed + (s.p_embed + d) * head
    blocks, once = gathers_per_step(M, kept), gathers_per_step(M, kept, backward=False)
    units, reduces = layers + embed + head, 1 if lay.accumulate == "unsharded" else M
    # fp8 (fp8.py): a block unit in 1 byte, and beside it its norm gains in bf16, (S-1)*2*v with v <= 2d
    norms = gather_reduce_bytes(layers * S * 2 * d, S, blocks, 2, 0, reduces=0) if lay.fp8 else 0.0
    parts = {"gather": (gather_reduce_bytes(params - ends, S, blocks, 1 if lay.fp8 else w_bytes, 0, reduces=0) + norms
                        + gather_reduce_bytes(ends, S, once, w_bytes, 0, reduces=0),
                        (layers * blocks * (1 + lay.fp8) + (embed + head) * once) * (S - 1)),
             "reduce": (gather_reduce_bytes(params, S, 0, 0, g_bytes, reduces=reduces), units * reduces * (S - 1))}
    if lay.dp_mode == "hsdp":
        R = lay.dp * lay.cp // S
        parts["replica"] = (replica_bytes(params, S, R, g_bytes), units * 2 * math.ceil(math.log2(R)))
    return parts, units


def ours_collectives(s, w_bytes=W_B, g_bytes=G_B, a_bytes=ACT_B):
    """collectives() of parallel/*.py: per group the most any rank of s.stages() sends, term by term what the comm
    counters of tests/test_plan_measured.py read."""
    cfg, lay, d, M, t = s.cfg, s.lay, s.cfg.d_model, s.M, s.t
    tp, cp, g = lay.tp, lay.cp, lay.dp * lay.cp
    redo = lay.ckpt in ("full", "op")  # a recomputed block repeats its forward collectives (but tp's last one)
    out = {}
    for layers, params, embed, head, sends in s.stages():
        mine = {}
        if tp > 1:  # an all-gather or reduce-scatter of the (t, d) activation; the loss's stats; sp norms' grads
            units = activation_collectives(layers, embed, head, lay.sp, redo)
            norms = all_reduce_bytes(d * (2 * layers + head), tp, g_bytes) if lay.sp else 0.0
            traffic = units * seq_collective_bytes(t, d, tp, a_bytes) + head * loss_bytes(t, tp)
            mine["tp"] = (M * traffic + norms, M * (units + head) * (tp - 1))
        if cp > 1:
            kv = 2 * cfg.head_dim * s.kv_local * t  # elements of this rank's K and V
            if lay.cp_mode == "ulysses":  # q, k, v to head shards and the output back; kv heads repeated to lcm
                fwd, bwd = ulysses_bytes(t, cfg.head_dim, cfg.n_head / tp, int(s.kv_local), cp, a_bytes)
            elif lay.cp_mode == "ring":  # K,V hop cp-1 times each way, backward adds cp hops of the fp32 dK,dV
                fwd, bwd = ring_bytes(kv, cp, a_bytes)
            else:  # allgather: an all-gather of K,V, in backward a reduce-scatter of dK,dV
                fwd, bwd = allgather_bytes(kv, cp, a_bytes)
            mine["cp"] = (M * layers * ((1 + redo) * fwd + bwd), M * layers * (cp - 1) * (3 + redo))
        if lay.pp > 1:  # activations forward, gradients back ((b, T/tp, d) under sp), in the compute dtype
            mine["pp"] = (p2p_bytes(M * sends, t, d, a_bytes, tp if lay.sp else 1), M * sends)
        if g > 1 and lay.dp_mode == "ddp":
            buckets = math.ceil(g_bytes * params / (BUCKET_MB * 1e6))
            mine["dp"] = (all_reduce_bytes(params, g, g_bytes), buckets * 2 * math.ceil(math.log2(g)))
        elif g > 1:
            parts, _ = fsdp_parts(s, layers, params, embed, head, w_bytes, g_bytes)
            (gb, gs), (rb, rs) = parts["gather"], parts["reduce"]
            mine["dp" if lay.dp_mode == "fsdp" else "shard"] = (gb + rb, gs + rs)
            if "replica" in parts:
                mine["replica"] = parts["replica"]
        for group, v in mine.items():
            out[group] = max(out.get(group, v), v)
    return out


def as_run(s, a_bytes):
    """The train.py run a layout is, as far as memory.stage_bytes reads one: fp32 where the planner prices a CPU
    cluster (a_bytes 4), else bf16 (fp8: its block matmuls), fp32 reductions, the layers split as train.py does."""
    lay = s.lay
    return SimpleNamespace(dtype="fp32" if a_bytes == 4 else "fp8" if lay.fp8 else "bf16", reduce_dtype="fp32",
        dp=lay.dp, dp_mode=lay.dp_mode, dp_shard=lay.shard // lay.cp if lay.dp_mode == "hsdp" else None,
        accumulate=lay.accumulate, tp=lay.tp, sp=lay.sp and lay.tp > 1, pp=lay.pp, pp_schedule=lay.schedule,
        pp_virtual=lay.V, pp_split=None, cp=lay.cp, ckpt=lay.ckpt, micro_batch=lay.micro, accum_steps=s.M,
        global_batch=s.batch)


def ours_memory(s, a_bytes):
    """{part: bytes} of the fullest pipeline stage by memory.step_bytes, train.py's own model (its pre-run check and
    --dry-run use it), with memory.MARGIN in place of the reference's overhead."""
    return memory.step_bytes(replace(s.cfg, seq_len=s.seq), as_run(s, a_bytes))

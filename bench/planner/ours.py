"""--code ours: the byte formulas of this repository's parallel/*.py and its own memory model, where the reference
ones (comm.py, memory.py) describe the implementation Llama 3 and Megatron-LM report, the one the
planner's calibration is for. Notation: layout.py; e the compute dtype's bytes, r the residual stream's: the
dtype of the weights forward sees, 4 under ddp (fp32 masters, autocast casts per matmul), e under fsdp and hsdp
(units gathered in the compute dtype); w the gathered units' bytes (e; 4 in an fp32 run).

tests/test_plan_measured.py holds these to fp32 CPU runs of train.train_step: bytes equal to the comm counters per
group, memory within 12% of the bytes allocated. The bytes come from the parallel modules' own traffic formulas (the
end of parallel/tp.py, cp.py, ring_attention.py, pp.py, ddp.py, fsdp.py, hsdp.py). They differ from the reference:
TP sends 8 (t, d) collectives per layer (sp: 10, as the reference; a recomputed block repeats 2, under sp 3), 2 each
for the embedding and the head (sp: 3), all counted in e, the loss all-gathers 2 fp32 per token, and sp norms
all-reduce their grads once per step (which of them overlap compute: step_time.py). Ring CP's backward adds cp hops
of the fp32 dK,dV accumulators; recomputation repeats the forward's CP traffic. PP sends each (t, d) activation and
its grad in r, and nothing else (shapes come from the config). FSDP units: the embedding, one per block, the final
norm + head; per microbatch forward gathers every unit, backward the blocks again, and every backward reduce-scatters
its unit (fp32) into the persistent shard gradient: with E the embedding, norm and head params of a stage,
(S-1)/S * M*((2P - E)*w + 4P); under pp a unit is gathered once per step and kept: (S-1)/S * P*(w + 4M). HSDP adds
one all-reduce of the fp32 shard gradients over the replicas per step, 2(R-1)/R * 4P/S. DDP: one of the buckets.

Memory: memory.step_bytes, train.py's own model of a step's peak per pipeline stage (memory.py says what it
counts), with memory.MARGIN of HBM left free. tests/test_dry_run.py holds it to fake-CUDA rehearsals at full world
size, tests/test_plan_measured.py to the CPU runs above.
"""
import math
from dataclasses import replace
from types import SimpleNamespace

from bench.planner.layout import ACT_B, BUCKET_MB, G_B, W_B, shard_size
from parallel import memory
from parallel.cp import allgather_bytes, ulysses_bytes
from parallel.ddp import all_reduce_bytes
from parallel.fsdp import gather_reduce_bytes, gathers_per_step
from parallel.hsdp import replica_bytes
from parallel.pp import p2p_bytes
from parallel.ring_attention import ring_bytes
from parallel.tp import activation_collectives, loss_bytes, seq_collective_bytes


def fsdp_parts(s, layers, params, embed, head, w_bytes=W_B, g_bytes=G_B):
    """One stage's FSDP/HSDP traffic per step, {"gather", "reduce", "replica": (bytes per rank, ring steps)}, and its
    unit count: parallel/fsdp.py's gathers_per_step and gather_reduce_bytes for the blocks and for the end units
    (embedding, norm + head; never gathered for backward), parallel/hsdp.py's replica_bytes."""
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
    """collectives() of this repository's parallel/*.py: for each group the most any rank of s.stages() sends,
    term by term what the comm counters of tests/test_plan_measured.py read."""
    cfg, lay, d, M, t = s.cfg, s.lay, s.cfg.d_model, s.M, s.t
    tp, cp, g = lay.tp, lay.cp, lay.dp * lay.cp
    redo = lay.ckpt == "full"  # a recomputed block repeats its forward collectives (but tp's last one)
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
        if lay.pp > 1:  # activations forward, gradients back ((b, T/tp, d) under sp), in the residual's dtype
            mine["pp"] = (p2p_bytes(M * sends, t, d, residual_bytes(s, a_bytes), tp if lay.sp else 1), M * sends)
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


def residual_bytes(s, a_bytes):
    """Bytes per element of the residual stream: the compute dtype's in every layout (the precision policy,
    parallel/__init__.py: the embedding's rows and every block's output). The pipeline sends it between stages."""
    return a_bytes


def as_run(s, a_bytes):
    """The train.py run a layout is, as far as memory.stage_bytes reads one: fp32 where the planner prices a CPU
    cluster (a_bytes 4), else bf16 (fp8: its block matmuls), fp32 reductions, the layers split as train.py splits
    them."""
    lay = s.lay
    return SimpleNamespace(
        dtype="fp32" if a_bytes == 4 else "fp8" if lay.fp8 else "bf16", reduce_dtype="fp32",
        dp=lay.dp, dp_mode=lay.dp_mode, dp_shard=lay.shard // lay.cp if lay.dp_mode == "hsdp" else None,
        accumulate=lay.accumulate, tp=lay.tp, sp=lay.sp and lay.tp > 1, pp=lay.pp, pp_schedule=lay.schedule,
        pp_virtual=lay.V, pp_split=None, cp=lay.cp, ckpt=lay.ckpt, micro_batch=lay.micro, accum_steps=s.M,
        global_batch=s.batch)


def ours_memory(s, a_bytes):
    """{part: bytes} of the fullest pipeline stage: train.py's own memory model (memory.step_bytes), the one its
    pre-run check and --dry-run use, with their margin (memory.MARGIN) in place of the reference's overhead."""
    return memory.step_bytes(replace(s.cfg, seq_len=s.seq), as_run(s, a_bytes))

"""Bytes each rank sends per step, by group, and peak memory per GPU of a layout: the reference implementation (the
one Llama 3 and Megatron-LM report); --code ours is ours.py. The formulas: bench/README.md, "The planner's formulas".
"""
import math

from bench.planner.layout import ACT_B, ADAM_B, BUCKET_MB, G_B, GB, MASTER_B, W_B, Shape, in_flight, shard_size
from bench.planner.ours import ours_collectives, ours_memory

OVERHEAD_GB = 4.0    # CUDA context, NCCL buffers, cuBLAS workspaces
FRAG = 0.05          # caching-allocator fragmentation: reserved exceeds allocated by ~5%


def collectives(s, w_bytes=W_B, g_bytes=G_B, a_bytes=ACT_B):
    """{group: (bytes sent per rank per step, ring steps per step)}, groups tp, cp, pp, dp, shard, replica."""
    if s.code == "ours":
        return ours_collectives(s, w_bytes, g_bytes, a_bytes)
    cfg, lay, d, n, M = s.cfg, s.lay, s.cfg.d_model, s.most, s.M
    tp, cp, S, g = lay.tp, lay.cp, shard_size(lay), lay.dp * lay.cp
    out = {}
    if tp > 1:  # per layer; plus the embedding's reduce-scatter, the head's all-gather and its grad's RS
        colls = n * (12 if lay.ckpt in ("full", "op") else 10 if lay.sp else 8) + (3 if lay.pp == 1 else 2)
        out["tp"] = (M * colls * (tp - 1) / tp * s.t * d * a_bytes, M * colls * (tp - 1))
    if cp > 1 and lay.cp_mode == "ulysses":
        heads = 2 * cfg.n_head / tp + 2 * max(s.kv_local, cp)  # q, k, v in and out back; kv replicated to cp
        out["cp"] = (M * n * 2 * (cp - 1) / cp * s.t * cfg.head_dim * heads * a_bytes, M * n * 4 * (cp - 1))
    elif cp > 1:  # ring: K,V in fwd, K,V and dK,dV in bwd; allgather: K,V all-gathered, dK,dV reduce-scattered
        kv = 2 * cfg.head_dim * s.kv_local * a_bytes * s.t  # this rank's K and V
        passes = 3 if lay.cp_mode == "ring" else 2
        out["cp"] = (M * n * passes * (cp - 1) * kv, M * n * passes * (cp - 1))
    if lay.pp > 1:  # per chunk an activation forward and a gradient back; with P = 2 one chunk end is idle
        sends = M * (2 * lay.V - (lay.pp == 2))
        out["pp"] = (sends * s.t * d * a_bytes / (tp if lay.sp else 1), sends)
    if g > 1 and lay.dist_opt:  # reduce-scatter the fp32 grads, all-gather the updated bf16 weights, in buckets
        buckets = math.ceil(g_bytes * s.p_gpu / (BUCKET_MB * 1e6))
        out["dp"] = ((g - 1) / g * (g_bytes + w_bytes) * s.p_gpu, buckets * 2 * (g - 1))
    elif g > 1 and lay.dp_mode == "ddp":
        buckets = math.ceil(g_bytes * s.p_gpu / (BUCKET_MB * 1e6))
        out["dp"] = (2 * (g - 1) / g * g_bytes * s.p_gpu, buckets * 2 * math.ceil(math.log2(g)))
    elif g > 1:
        rounds, gathers = (M, 2) if lay.pp == 1 else (1, 1)
        gathered = w_bytes * s.p_gpu - (w_bytes - 1) * s.p_fp8  # fp8: the block matmul weights in 1 byte
        out["dp" if lay.dp_mode == "fsdp" else "shard"] = (
            rounds * (gathers * gathered + g_bytes * s.p_gpu) * (S - 1) / S, rounds * (gathers + 1) * (n + 1) * (S - 1))
        if lay.dp_mode == "hsdp":
            R = g // S
            out["replica"] = (2 * (R - 1) / R * g_bytes * s.p_gpu / S, (n + 1) * 2 * math.ceil(math.log2(R)))
    return out


def comm_bytes(cfg, lay, seq, batch, w_bytes=W_B, g_bytes=G_B, a_bytes=ACT_B, code="reference"):
    """Predicted bytes sent per rank per step, {"tp", "cp", "pp", "dp"} ("dp": dp x cp, hsdp's shard + replica), for
    a global batch of `batch` sequences of `seq` tokens. Dtypes default to bf16 weights and activations, fp32 grads;
    an fp32 CPU run passes 4, 4, 4. code: "reference" or "ours"."""
    out = {"tp": 0.0, "cp": 0.0, "pp": 0.0, "dp": 0.0}
    for group, (nbytes, _) in collectives(Shape(cfg, lay, seq, batch, code), w_bytes, g_bytes, a_bytes).items():
        out["dp" if group in ("shard", "replica") else group] += nbytes
    return out


def act_per_token(s, ckpt, a_bytes=ACT_B):
    """Activation bytes one layer keeps per token on this GPU until its backward (the reference's)."""
    d, f, tp = s.cfg.d_model, s.cfg.ffn_dim, s.lay.tp
    sh = tp if s.lay.sp else 1  # sequence parallel shards the residual stream and the norms
    kv = 2 * s.cfg.head_dim * s.kv_local
    return a_bytes * {"none": 4 * d / sh + (2 * d + 3 * f) / tp + kv,
                      "selective": 2 * d / sh + (2 * d + 2 * f) / tp + kv,
                      "op": d / sh + (2 * d + f) / tp + kv / 2 + d, "full": d / sh}[ckpt]


def memory(cfg, lay, seq, batch, overhead_gb=OVERHEAD_GB, frag=FRAG, w_bytes=W_B, a_bytes=ACT_B, code="reference"):
    """Predicted peak bytes per GPU by part, the fuller of the first and last pipeline stage (arguments as in
    comm_bytes). An fp32 CPU run, to compare with allocated bytes: w_bytes=0, a_bytes=4, overhead_gb=0, frag=0."""
    return shape_memory(Shape(cfg, lay, seq, batch, code), overhead_gb, frag, w_bytes, a_bytes)


def shape_memory(s, overhead_gb=OVERHEAD_GB, frag=FRAG, w_bytes=W_B, a_bytes=ACT_B):
    """memory() of a Shape. --code ours: memory.step_bytes's parts (overhead and fragmentation are its margin's)."""
    if s.code == "ours":
        return ours_memory(s, a_bytes)
    lay, P, M = s.lay, s.lay.pp, s.M
    S = shard_size(lay) if lay.dp_mode != "ddp" else 1
    S_opt = lay.dp * lay.cp if lay.dist_opt else S  # Megatron's distributed optimizer shards master and Adam
    zero3 = lay.dp_mode != "ddp" and P == 1
    inflight, last_flight = in_flight(lay.schedule, M, P, lay.V)
    # one layer at a time remakes what it did not keep
    redo = act_per_token(s, "none", a_bytes) - act_per_token(s, lay.ckpt, a_bytes) + act_per_token(s, "full", a_bytes)
    recompute = redo * s.t if lay.ckpt in ("full", "op") else 0.0
    first, _, last = s.layers
    best = None
    for layers, params, flight, logits in ((first, s.p_first, inflight, P == 1), (last, s.p_last, last_flight, True)):
        gathered = 2 * s.p_layer * (w_bytes or MASTER_B) if zero3 else 0.0  # two full layers (prefetch)
        m = {"weights": w_bytes * params / (S if zero3 else 1) + gathered,
             "grads": G_B * (params / S + s.p_layer if zero3 else params),
             "master": MASTER_B * params / S_opt, "adam": ADAM_B * params / S_opt,
             "activations": flight * layers * s.t * act_per_token(s, lay.ckpt, a_bytes) + recompute,
             "logits": (a_bytes + 4) * s.t * s.cfg.padded_vocab / lay.tp if logits else 0.0}
        m["overhead"] = overhead_gb * GB + frag * sum(m.values())
        best = m if best is None or sum(m.values()) > sum(best.values()) else best
    return best

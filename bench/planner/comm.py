"""Bytes each rank sends per optimizer step, by group: the reference implementation (the one Llama 3 and
Megatron-LM report); --code ours is ours.py. Notation: layout.py; how long they take: step_time.py.

Bytes sent per rank, ring terms: all-reduce 2(g-1)/g*N, all-gather and reduce-scatter (g-1)/g*N (N the full
buffer), all-to-all (g-1)/g*N, send N. Ring steps: g-1 for all-gather, reduce-scatter, all-to-all; 2*log2 g
for an all-reduce (NCCL's tree); 1 per send. For a rank of the fuller pipeline stage.
TP, sequence parallel: 10 all-gathers/reduce-scatters of t*d*2 B per layer (4 fwd, 4 bwd, 2 re-gathers
of inputs for weight grads; without sp 8; full ckpt 12), plus 3 per microbatch for the embedding and head
(a stage with one of them: 2).
CP per layer: ring passes K,V (cp-1) times in fwd and K,V,dK,dV in bwd: 3*(cp-1)*4*hd*kv_local*t bytes;
allgather (Llama 3) all-gathers K,V and reduce-scatters dK,dV, 2/3 of that; ulysses all-to-alls q,k,v and
out, fwd and bwd: 2*(cp-1)/cp * t*hd*2*(2a/tp + 2*max(kv_local, cp)) bytes.
PP: each of a rank's V chunks sends its activation forward and a gradient back, t*d*2/tp bytes
(SP-sharded) per microbatch (2V sends; 2V-1 when P = 2).
DP: ddp all-reduces fp32 grads once per step, 2(g-1)/g*4*P_gpu, in BUCKET_MB buckets; with dist_opt (Megatron's
distributed optimizer) it reduce-scatters them and all-gathers the updated bf16 weights, (g-1)/g*(4+2)*P_gpu.
fsdp with P = 1: per microbatch all-gathers bf16 weights for fwd and bwd and reduce-scatters fp32 grads,
(2+2+4)(S-1)/S*P_gpu;
with P > 1 one gather and one reduce-scatter per step. hsdp adds the replicas' all-reduce 2(R-1)/R*4*P_gpu/S.
fp8 (torchao's float8 all-gather): the block matmul weights (Shape.p_fp8) are gathered in 1 byte instead of 2.
"""
import math

from bench.planner.layout import ACT_B, BUCKET_MB, G_B, W_B, Shape, shard_size
from bench.planner.ours import ours_collectives


def collectives(s, w_bytes=W_B, g_bytes=G_B, a_bytes=ACT_B):
    """{group: (bytes sent per rank per step, ring steps per step)}, groups tp, cp, pp, dp, shard, replica."""
    if s.code == "ours":
        return ours_collectives(s, w_bytes, g_bytes, a_bytes)
    cfg, lay, d, n, M = s.cfg, s.lay, s.cfg.d_model, s.most, s.M
    tp, cp, S, g = lay.tp, lay.cp, shard_size(lay), lay.dp * lay.cp
    out = {}
    if tp > 1:  # per layer; plus the embedding's reduce-scatter, the head's all-gather and its grad's RS
        colls = n * (12 if lay.ckpt == "full" else 10 if lay.sp else 8) + (3 if lay.pp == 1 else 2)
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
    """Predicted bytes sent per rank per optimizer step, {"tp", "cp", "pp", "dp"}, in ring terms.

    cfg: model.ModelConfig; lay: Layout; seq: tokens per sequence; batch: global batch in sequences.
    For a rank of the fuller pipeline stage ("ours": the most any rank sends, per group); "dp" is the
    dp x cp gradient group (hsdp: shard + replica). Dtypes default to bf16 weights/activations and fp32
    grads; an fp32 CPU run passes 4, 4, 4. code: "reference" or "ours" (plan.py)."""
    out = {"tp": 0.0, "cp": 0.0, "pp": 0.0, "dp": 0.0}
    for group, (nbytes, _) in collectives(Shape(cfg, lay, seq, batch, code), w_bytes, g_bytes, a_bytes).items():
        out["dp" if group in ("shard", "replica") else group] += nbytes
    return out

"""Peak memory per GPU of a layout: the reference implementation (the one Llama 3 and Megatron-LM report);
--code ours is train.py's own model (memory.step_bytes, through ours.py). Notation and stage sizes: layout.py.

Memory per GPU, the fuller of the first and last pipeline stage. Bytes/param: bf16 weights 2, fp32 master 4,
fp32 grads 4, Adam 8. ddp replicates all (with dist_opt, Megatron's distributed optimizer, master and Adam are
sharded over dp x cp: 6 + 12/g bytes per parameter, as Megatron-LM documents it). fsdp/hsdp shard master + Adam
over S; with P = 1 also weights and grads (ZeRO-3) plus two gathered layers of weights and one of grads; with
P > 1 a stage runs many microbatches interleaved, so its weights stay gathered and its grads unsharded for the
step (Llama 3: no reshard after forward).
Activations per layer per token (bf16; flash attention has no T^2 term; the SwiGLU/GQA form of
Korthikanti et al.'s 34*s*b*h): none (12d + 6f)/tp + 4*hd*kv_local [x, norm, q, out, x2, norm, gate, up,
silu*up; k, v]; selective recomputes both norms and silu*up: (8d + 4f)/tp + 4*hd*kv_local; full keeps
2d/tp plus one layer's "none" set (sequence parallel shards x and the norms / tp; without it they are whole).
Times t tokens and the microbatches in flight on stage 0: gpipe M, 1f1b min(M, P), interleaved
min(M, P + (P-1)/V), zb1 and zbv min(M, P); the last stage holds 1 (gpipe M, zb1 and zbv min(M, P): a set lives
until its W) plus logits 6*t*vocab/tp (bf16 + fp32).
Plus OVERHEAD_GB and FRAG of the rest.
"""
from bench.planner.layout import ACT_B, ADAM_B, G_B, GB, MASTER_B, W_B, Shape, in_flight, shard_size
from bench.planner.ours import ours_memory

OVERHEAD_GB = 4.0    # CUDA context, NCCL buffers, cuBLAS workspaces
FRAG = 0.05          # caching-allocator fragmentation: reserved exceeds allocated by ~5%


def act_per_token(s, ckpt, a_bytes=ACT_B):
    """Activation bytes one layer keeps per token on this GPU until its backward (the reference's)."""
    d, f, tp = s.cfg.d_model, s.cfg.ffn_dim, s.lay.tp
    sh = tp if s.lay.sp else 1  # sequence parallel shards the residual stream and the norms
    kv = 2 * s.cfg.head_dim * s.kv_local
    return a_bytes * {"none": 4 * d / sh + (2 * d + 3 * f) / tp + kv,
                      "selective": 2 * d / sh + (2 * d + 2 * f) / tp + kv, "full": d / sh}[ckpt]


def memory(cfg, lay, seq, batch, overhead_gb=OVERHEAD_GB, frag=FRAG, w_bytes=W_B, a_bytes=ACT_B, code="reference"):
    """Predicted peak bytes per GPU, {"weights", "grads", "master", "adam", "activations", "logits",
    "overhead"}, for the fuller of the first and last pipeline stage (arguments as in comm_bytes).
    An fp32 CPU run has no bf16 weight copy and fp32 activations: w_bytes=0, a_bytes=4, and
    overhead_gb=0, frag=0 to compare with allocated bytes."""
    return shape_memory(Shape(cfg, lay, seq, batch, code), overhead_gb, frag, w_bytes, a_bytes)


def shape_memory(s, overhead_gb=OVERHEAD_GB, frag=FRAG, w_bytes=W_B, a_bytes=ACT_B):
    """memory() of a Shape. --code ours: memory.step_bytes's parts, which leave overhead and fragmentation to the
    margin (memory.MARGIN)."""
    if s.code == "ours":
        return ours_memory(s, a_bytes)
    lay, P, M = s.lay, s.lay.pp, s.M
    S = shard_size(lay) if lay.dp_mode != "ddp" else 1
    S_opt = lay.dp * lay.cp if lay.dist_opt else S  # Megatron's distributed optimizer shards master and Adam
    zero3 = lay.dp_mode != "ddp" and P == 1
    inflight, last_flight = in_flight(lay.schedule, M, P, lay.V)
    recompute = act_per_token(s, "none", a_bytes) * s.t if lay.ckpt == "full" else 0.0  # one layer at a time
    first, _, last = s.layers
    best = None
    for layers, params, flight, logits in ((first, s.p_first, inflight, P == 1),
                                           (last, s.p_last, last_flight, True)):
        gathered = 2 * s.p_layer * (w_bytes or MASTER_B) if zero3 else 0.0  # two full layers (prefetch)
        m = {"weights": w_bytes * params / (S if zero3 else 1) + gathered,
             "grads": G_B * (params / S + s.p_layer if zero3 else params),
             "master": MASTER_B * params / S_opt, "adam": ADAM_B * params / S_opt,
             "activations": flight * layers * s.t * act_per_token(s, lay.ckpt, a_bytes) + recompute,
             "logits": (a_bytes + 4) * s.t * s.cfg.padded_vocab / lay.tp if logits else 0.0}
        m["overhead"] = overhead_gb * GB + frag * sum(m.values())
        best = m if best is None or sum(m.values()) > sum(best.values()) else best
    return best

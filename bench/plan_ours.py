"""--code ours: the byte and memory formulas of this repository's parallel/*.py, where the reference ones
(plan_comm.py, plan_memory.py) describe the implementation Llama 3 and Megatron-LM report, the one the
planner's calibration is for. Notation: plan_layout.py.

tests/test_plan_measured.py holds these to fp32 CPU runs: bytes equal to the comm counters per group, memory
within 15% of the bytes allocated. The bytes come from the parallel modules' own traffic formulas (the end of
parallel/tp.py, cp.py, ring_attention.py, pp.py, ddp.py, fsdp.py, hsdp.py). They differ from the reference: TP
sends 8 (t, d) collectives per layer (sp: 10, as the reference; a recomputed block repeats 2, under sp 3), 2 each
for the embedding and the head (sp: 3), the loss all-gathers 2 fp32 per token, and sp norms all-reduce their
grads once per step; every TP collective blocks. Ring CP's backward adds cp hops of the fp32 dK,dV accumulators;
recomputation repeats the forward's CP traffic. PP adds a 48-byte shape broadcast. FSDP under pp gathers each
unit once per step and keeps it to the last backward (as the reference), reduces once per step, and holds the
unsharded fp32 grads while accumulating, then one unit's flat gradient and the previous unit's send in flight;
DDP copies two buckets at a time.

Activations per layer per token, with e the activation bytes and x = 4d/tp under sp (else 4d): the residual
stream and norms in fp32, 2(2x + e*d), plus e*(5d/tp + 4f/tp) (K and V repeated to every head; the attention
output re-laid for o_proj); ring attention keeps its own K,V instead (3d/tp + 2*hd*kv_local), allgather the
whole sequence's ((3 + 2cp)d/tp). The head's rank keeps fp32 log-probs. Peak = model state + the fullest moment
of the step: all of them hold the activations in flight and the earlier microbatches' grads, plus the loss's
backward (two more (t, V/tp) fp32 buffers), or the head's backward (fsdp gathers its unit again), or a block's
backward (three (t, f/tp) activation grads, the recompute; fsdp: the gathered units and their grads before the
reduce-scatter), or instead the end of backward (ddp: all grads and two buckets' copies; fsdp: the shards and the
units being reduced). At 405B this puts Llama 3's published layouts at 28-34% MFU with our code (full
checkpointing to fit; every TP collective blocks).
"""
import math

from bench.plan_layout import ACT_B, ADAM_B, BUCKET_MB, G_B, GB, MASTER_B, W_B, shard_size
from parallel.cp import allgather_bytes, ulysses_bytes
from parallel.ddp import all_reduce_bytes
from parallel.fsdp import gather_reduce_bytes, gathers_per_step
from parallel.hsdp import replica_bytes
from parallel.pp import p2p_bytes
from parallel.ring_attention import ring_bytes
from parallel.tp import activation_collectives, loss_bytes, seq_collective_bytes


def ours_collectives(s, w_bytes=W_B, g_bytes=G_B, a_bytes=ACT_B):
    """collectives() of this repository's parallel/*.py: for each group the most any rank of s.stages() sends,
    term by term what the comm counters of tests/test_plan_measured.py read."""
    cfg, lay, d, M, t = s.cfg, s.lay, s.cfg.d_model, s.M, s.t
    tp, cp, S, g = lay.tp, lay.cp, shard_size(lay), lay.dp * lay.cp
    redo = lay.ckpt != "none"  # a recomputed block repeats its forward collectives (but tp's last one)
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
        if lay.pp > 1:  # activations forward, gradients back ((b, T/tp, d) under sp), + the shape broadcast
            mine["pp"] = (p2p_bytes(M * sends, t, d, a_bytes, tp if lay.sp else 1), M * sends)
        units = layers + (embed or head)  # fsdp units: one per block, one for the embedding/norm/head
        if g > 1 and lay.dp_mode == "ddp":
            buckets = math.ceil(g_bytes * params / (BUCKET_MB * 1e6))
            mine["dp"] = (all_reduce_bytes(params, g, g_bytes), buckets * 2 * math.ceil(math.log2(g)))
        elif g > 1:  # each microbatch gathers every unit for forward and again for backward (under pp: once per
            gathers = gathers_per_step(M, keep_gathered=lay.pp > 1)  # step, kept until the last backward); one RS
            mine["dp" if lay.dp_mode == "fsdp" else "shard"] = (
                gather_reduce_bytes(params, S, gathers, w_bytes, g_bytes), (gathers + 1) * units * (S - 1))
            if lay.dp_mode == "hsdp":
                R = g // S
                mine["replica"] = (replica_bytes(params, S, R, g_bytes), units * 2 * math.ceil(math.log2(R)))
        for group, v in mine.items():
            out[group] = max(out.get(group, v), v)
    return out


def ours_act_per_token(s, ckpt, a_bytes=ACT_B):
    """act_per_token() of this repository's model: the tensors autograd saves (tests/test_plan_measured.py)."""
    cfg, lay = s.cfg, s.lay
    d, f, tp = cfg.d_model, cfg.ffn_dim, lay.tp
    x = 4 * d / (tp if lay.sp else 1)  # the fp32 residual stream (the embedding's dtype); sp shards it
    kv = cfg.head_dim * s.kv_local  # one of K, V
    if ckpt == "full":
        return x  # the block's input; backward recomputes the rest
    if ckpt == "selective":  # and the outputs of q, k, v, attention, o (unreduced), gate, up, down (unreduced)
        return x + a_bytes * (2 * d / tp + 2 * kv + 2 * d + 2 * f / tp)
    mode = lay.cp_mode if lay.cp > 1 else "sdpa"
    attention = {"ring": 3 * d / tp + 2 * kv,  # q, the own K and V, the output, the output laid out for o_proj
                 "allgather": (3 + 2 * lay.cp) * d / tp}.get(mode, 5 * d / tp)  # else K, V repeated to every head
    # per norm: its input and the normalized x in fp32, and its output as the matmuls save it (sp: the fp32 shard
    # they gather again in backward; else in the compute dtype);
    # the MLP: gate, silu(gate), up and their product
    norm_out = x if lay.sp else a_bytes * d
    return 2 * (2 * x + norm_out) + a_bytes * (attention + 4 * f / tp)


def ours_memory(s, overhead_gb, frag, w_bytes, a_bytes):
    """Model state plus the fullest moment of a step, on the fullest rank of s.stages(). Every moment holds the
    activations in flight and (accumulating) the earlier microbatches' grads; on top: the loss's backward (its
    two fp32 (t, V/tp) buffers), the head's backward (fsdp gathers its unit again), a block's backward (the MLP's
    three activation grads, a recompute; fsdp: the gathered units and their grads before the reduce-scatter),
    or the end of backward (the grads and their copies)."""
    cfg, lay, P, M, t, d = s.cfg, s.lay, s.lay.pp, s.M, s.t, s.cfg.d_model
    sharded = lay.dp_mode != "ddp"
    kept = sharded and P > 1  # under pp fsdp keeps its units gathered from the first forward to the last backward
    S, sh, vocab = shard_size(lay) if sharded else 1, lay.tp if lay.sp else 1, cfg.padded_vocab / lay.tp
    w_unit = w_bytes or MASTER_B  # fsdp gathers in the compute dtype (fp32 without autocast)
    keep = ours_act_per_token(s, lay.ckpt, a_bytes)
    redo = (ours_act_per_token(s, "none", a_bytes) - keep) * t  # a block recomputed in backward
    # sp: the (t, d) tensors a column-parallel backward holds: the output grad all-gathered from the next block,
    # the norm output gathered again (fp32, and cast to the compute dtype) and its grad
    regather = lay.sp * t * d * (4 + (a_bytes if a_bytes != 4 else 0) + 2 * a_bytes)
    block_bwd = 3 * t * cfg.ffn_dim / lay.tp * a_bytes + redo + regather
    inflight = {"gpipe": M, "1f1b": min(M, P), "interleaved": min(M, P + (P - 1) / lay.V)}[lay.schedule]
    best = None
    for layers, params, embed, head, _ in s.stages():
        flight = 1 if P == 1 else (M if lay.schedule == "gpipe" else 1) if head else inflight
        acts = layers * t * keep + (0.0 if head else t * 4 * d / sh)  # a microbatch's blocks (+ the output sent)
        norm_out = 4 * d / sh if lay.sp else a_bytes * d
        norm, logp = (t * (8 * d / sh + norm_out), 4 * t * vocab) if head else (0.0, 0.0)  # final norm, log-probs
        root = s.p_embed * embed + (s.p_embed + d) * head  # the fsdp unit of the embedding, final norm and head
        grads = G_B * params  # unsharded fp32: ddp's .grad; fsdp's flat buffers (accumulation, reduce-scatter)
        held, n = 0.0, flight  # earlier microbatches' grads, and microbatches in flight (gpipe: a backward done)
        if M > 1:
            held, n = max((0.0, flight), (grads, flight - 1), key=lambda h: h[0] + h[1] * (acts + norm + logp)) \
                if lay.schedule == "gpipe" else (grads, flight)
        unit = sharded * (root * head + s.p_layer) * w_unit  # a block's unit, and the head rank's root unit
        weights = w_bytes * params if not sharded else w_unit * params if kept else 0.0  # ddp: autocast's bf16
        gathering = 0.0 if kept else sharded * w_unit  # copies; fsdp under pp: the stage, gathered all step
        base = {"weights": weights, "grads": held, "activations": n * acts + (n - 1) * norm, "logits": (n - 1) * logp}
        moments = [{"activations": norm, "logits": logp + 2 * logp * head},  # the loss's backward
                   {"activations": norm, "logits": logp, "weights": gathering * head * (root + s.p_layer)},
                   # a block's backward as its unit reduces: its grads, their flat copy (in the room of the freed
                   # weights, unless kept), the previous unit's send in flight (in held when accumulating)
                   {"activations": block_bwd, "weights": unit * (not kept),
                    "grads": unit + sharded * G_B * s.p_layer * (kept + (not held))}]
        moment = max(moments, key=lambda m: sum(m.values()))
        m = {k: v + moment.get(k, 0.0) for k, v in base.items()}
        # the end of backward. ddp: the grads and two buckets' copies in flight. fsdp, as each unit reduces (blocks,
        # then the root): the shards, the unit's grads and their flat copy, the previous unit's send in flight
        unit_sizes = [s.p_layer] * layers + [root] * (root > 0)  # in the order backward reduces them
        reduce_peak = max(2 * size + before for before, size in zip([0] + unit_sizes, unit_sizes))
        end = {"weights": weights + gathering * (root + s.p_layer),  # the root and a prefetched block
               "grads": grads / S + G_B * reduce_peak if sharded else grads + min(grads, 2 * BUCKET_MB * 1e6),
               "activations": 0.0, "logits": 0.0}
        m = max(m, end, key=lambda x: sum(x.values()))
        m.update(master=MASTER_B * params / S, adam=ADAM_B * params / S)
        m["overhead"] = overhead_gb * GB + frag * sum(m.values())
        best = m if best is None or sum(m.values()) > sum(best.values()) else best
    return best

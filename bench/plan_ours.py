"""--code ours: the byte and memory formulas of this repository's parallel/*.py, where the reference ones
(plan_comm.py, plan_memory.py) describe the implementation Llama 3 and Megatron-LM report, the one the
planner's calibration is for. Notation: plan_layout.py; e the compute dtype's bytes, r the residual stream's: the
dtype of the weights forward sees, 4 under ddp (fp32 masters, autocast casts per matmul), e under fsdp and hsdp
(units gathered in the compute dtype).

tests/test_plan_measured.py holds these to fp32 CPU runs of train.train_step: bytes equal to the comm counters per
group, memory within 15% of the bytes allocated. The bytes come from the parallel modules' own traffic formulas (the
end of parallel/tp.py, cp.py, ring_attention.py, pp.py, ddp.py, fsdp.py, hsdp.py). They differ from the reference:
TP sends 8 (t, d) collectives per layer (sp: 10, as the reference; a recomputed block repeats 2, under sp 3), 2 each
for the embedding and the head (sp: 3), all counted in e, the loss all-gathers 2 fp32 per token, and sp norms
all-reduce their grads once per step; every TP collective blocks. Ring CP's backward adds cp hops of the fp32 dK,dV
accumulators; recomputation repeats the forward's CP traffic. PP sends each (t, d) activation and its grad in r, and
nothing else (shapes come from the config). FSDP under pp gathers each unit once per step and keeps it to the last
backward (as the reference), reduces once per step, and holds the unsharded fp32 grads while accumulating, then one
unit's flat gradient and the previous unit's send in flight; DDP's grads are views into its buckets (no copies).

Activations per layer per token (sh = tp under sp, else 1). A norm: F.rms_norm's fp32 input and rstd and the
normalized x, 4d + 4 + r*d, plus its output as the matmuls reading it save it: e*d, once per reader when autocast
casts it (r != e: q, k, v read the first norm, gate and up the second), else once; under sp (4d + 4 + 2r*d)/tp.
Attention (SDPA with enable_gqa: K,V with their own kv heads, never repeated per query head): q, K, V, the output
and the fp32 lse, e*(2d/tp + 2*hd*kv_local) + 4a/tp; under cp the output laid out again for o_proj, + e*d/tp, and
allgather keeps the whole sequence's K,V (cp*kv_local heads), ulysses the whole sequence for lcm(kv_local, cp)/cp
heads. The MLP: gate, silu(gate), up and their product, 4e*f/tp. selective: r*d/sh + e*(2d/tp + 2*hd*kv_local + 2d
+ 2f/tp) + 4a/tp (the matmuls' outputs, o and down unreduced, and the attention's); full: r*d/sh. The head's rank
keeps the final norm (one reader) and model.CrossEntropy's logits in e plus 13 bytes per token (fp32 lse, int64
shifted target, bool mask): no (t, V/tp) fp32 tensor, only one chunk of model.loss_chunks at a time.
Peak = model state + the fullest moment of the step: all of them hold the activations in flight and the grads
(ddp: its buckets, always; fsdp: while accumulating), plus the loss's backward (the logits' grad and three fp32
(rows, V/tp) chunk buffers), or the head's backward (the logits' and the input's grads; ddp: the head weight's grad
before it is added into its bucket; fsdp gathers its unit again), or the final norm's backward (its input and
RMS_BWD_TEMPS fp32 (t, d/sh) temporaries), or a block's backward (two more (t, f/tp) MLP grads, the residual's grad,
the recompute; sp: the input gathered again; fsdp: the gathered units and their grads before the reduce-scatter),
or instead the end of backward (fsdp: the shards and the units being reduced). At 405B this puts Llama 3's
published layouts at 28-34% MFU with our code (full checkpointing to fit: at V=8 none and selective keep 133-158 GB;
under sp selective saves the row-parallel matmuls' unreduced (t, d) outputs, about what none keeps; every TP
collective blocks).
"""
import math

from bench.plan_layout import ACT_B, ADAM_B, BUCKET_MB, G_B, GB, MASTER_B, W_B, shard_size
from model import loss_chunks
from parallel.cp import allgather_bytes, ulysses_bytes
from parallel.ddp import all_reduce_bytes
from parallel.fsdp import gather_reduce_bytes, gathers_per_step
from parallel.hsdp import replica_bytes
from parallel.pp import p2p_bytes
from parallel.ring_attention import ring_bytes
from parallel.tp import activation_collectives, loss_bytes, seq_collective_bytes

RMS_BWD_TEMPS = 5  # (t, d) fp32 temporaries at once in F.rms_norm's backward as torch composes it on CPU (the
# runs tests/test_plan_measured.py measures); CUDA's fused kernel makes fewer


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
        if lay.pp > 1:  # activations forward, gradients back ((b, T/tp, d) under sp), in the residual's dtype
            mine["pp"] = (p2p_bytes(M * sends, t, d, residual_bytes(s, a_bytes), tp if lay.sp else 1), M * sends)
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


def residual_bytes(s, a_bytes):
    """Bytes per element of the residual stream, in the dtype of the weights forward sees (the embedding's output,
    to which every block adds): ddp computes with the fp32 masters, fsdp and hsdp with units gathered in the compute
    dtype. The pipeline sends it between stages (parallel/pp.py)."""
    return 4 if s.lay.dp_mode == "ddp" else a_bytes


def norm_per_token(s, users, a_bytes):
    """Bytes per token one RMSNorm keeps: F.rms_norm's fp32 input (the residual, or its fp32 copy) and rstd, the
    normalized x in the residual's dtype r (for the weight's grad), and its output as the `users` matmuls reading it
    save it: under sp the shard they gather again in backward (r); else in the compute dtype e, one copy per matmul
    when autocast casts it (r != e), one shared when it is in that dtype already."""
    d, e, r = s.cfg.d_model, a_bytes, residual_bytes(s, a_bytes)
    if s.lay.sp and s.lay.tp > 1:
        return (4 * d + 4 + 2 * r * d) / s.lay.tp
    return 4 * d + 4 + r * d + e * d * (users if r != e else 1)


def ours_act_per_token(s, ckpt, a_bytes=ACT_B):
    """act_per_token() of this repository's model: the tensors autograd saves (tests/test_plan_measured.py)."""
    cfg, lay, e = s.cfg, s.lay, a_bytes
    d, f, tp = cfg.d_model, cfg.ffn_dim, lay.tp
    x = residual_bytes(s, a_bytes) * d / (tp if lay.sp else 1)  # the block's input; sp shards it
    kv = cfg.head_dim * s.kv_local  # one of K, V: never repeated per query head (SDPA's enable_gqa)
    lse = 4 * cfg.n_head / tp  # the attention kernel's fp32 log-sum-exp per head
    if ckpt == "full":
        return x  # backward recomputes the rest
    if ckpt == "selective":  # and the outputs of q, k, v, attention, o (unreduced), gate, up, down (unreduced)
        return x + e * (2 * d / tp + 2 * kv + 2 * d + 2 * f / tp) + lse
    # attention keeps q, K and V as its kernel reads them, its output and fp32 lse; under cp also the output laid out
    # again for o_proj. K,V keep their kv heads: ring its own block, allgather the whole sequence's (cp blocks),
    # ulysses the whole sequence for lcm(kv_local, cp)/cp heads (cp.py repeats them only until cp divides them)
    mode = lay.cp_mode if lay.cp > 1 else "sdpa"
    kv_heads = {"allgather": s.kv_local * lay.cp, "ulysses": math.lcm(int(s.kv_local), lay.cp)}.get(mode, s.kv_local)
    attention = e * ((2 + (mode != "sdpa")) * d / tp + 2 * cfg.head_dim * kv_heads) + lse
    # the two norms (q, k, v read the first, gate and up the second); the MLP: gate, silu(gate), up, their product
    return norm_per_token(s, 3, e) + norm_per_token(s, 2, e) + attention + e * 4 * f / tp


def ours_memory(s, overhead_gb, frag, w_bytes, a_bytes):
    """Model state plus the fullest moment of a step, on the fullest rank of s.stages(). Every moment holds the
    activations in flight and the grads held (ddp's buckets; fsdp's while accumulating); on top: the loss's backward,
    the head's backward, the final norm's backward, or a block's backward; or instead the end of backward (the module
    docstring lists what each holds)."""
    cfg, lay, P, M, t, d = s.cfg, s.lay, s.lay.pp, s.M, s.t, s.cfg.d_model
    sharded = lay.dp_mode != "ddp"
    kept = sharded and P > 1  # under pp fsdp keeps its units gathered from the first forward to the last backward
    S, sh, vocab = shard_size(lay) if sharded else 1, lay.tp if lay.sp else 1, cfg.padded_vocab / lay.tp
    r, e = residual_bytes(s, a_bytes), a_bytes
    w_unit = w_bytes or MASTER_B  # fsdp gathers in the compute dtype (fp32 without autocast)
    keep = ours_act_per_token(s, lay.ckpt, a_bytes)
    redo = (ours_act_per_token(s, "none", a_bytes) - keep) * t  # a block recomputed in backward
    # sp: the (t, d) tensors a column-parallel backward holds: the output grad all-gathered from the next block,
    # the norm output gathered again (in r, and cast to e) and its grad
    regather = (lay.sp and lay.tp > 1) * t * d * (r + (e if e != r else 0) + 2 * e)
    # the MLP's backward: three (t, f/tp) activation grads at once, after down_proj's backward freed its input, and
    # the residual stream's grad
    block_bwd = 2 * t * cfg.ffn_dim / lay.tp * e + t * r * d / sh + redo + regather
    # the loss (model.CrossEntropy) keeps the logits in their dtype and per token an fp32 lse, the target shifted
    # to this rank's vocabulary shard (int64) and whether it lives there; its backward adds the logits' grad and
    # three fp32 (rows, V/tp) buffers of one chunk (model.loss_chunks)
    chunk = loss_chunks(max(1, int(t)), max(1, int(vocab)))[0]
    loss_bwd = t * e * vocab + 3 * 4 * (chunk.stop - chunk.start) * vocab
    inflight = {"gpipe": M, "1f1b": min(M, P), "interleaved": min(M, P + (P - 1) / lay.V)}[lay.schedule]
    best = None
    for layers, params, embed, head, _ in s.stages():
        flight = 1 if P == 1 else (M if lay.schedule == "gpipe" else 1) if head else inflight
        acts = layers * t * keep + (0.0 if head else t * r * d / sh)  # a microbatch's blocks (+ the output sent)
        norm, logp = (t * norm_per_token(s, 1, e), t * (e * vocab + 4 + 8 + 1)) if head else (0.0, 0.0)
        root = s.p_embed * embed + (s.p_embed + d) * head  # the fsdp unit of the embedding, final norm and head
        grads = G_B * params  # unsharded fp32: ddp's buckets; fsdp's flat buffers (accumulation, reduce-scatter)
        held, n = 0.0, flight  # earlier microbatches' grads, and microbatches in flight (gpipe: a backward done)
        if not sharded:  # ddp's .grads are views into its buckets, kept from step to step
            held = grads
        elif M > 1:
            held, n = max((0.0, flight), (grads, flight - 1), key=lambda h: h[0] + h[1] * (acts + norm + logp)) \
                if lay.schedule == "gpipe" else (grads, flight)
        unit = sharded * (root * head + s.p_layer) * w_unit  # a block's unit, and the head rank's root unit
        weights = w_bytes * params if not sharded else w_unit * params if kept else 0.0  # ddp: autocast's bf16
        gathering = 0.0 if kept else sharded * w_unit  # copies; fsdp under pp: the stage, gathered all step
        base = {"weights": weights, "grads": held, "activations": n * acts + (n - 1) * norm, "logits": (n - 1) * logp}
        moments = [{"activations": norm, "logits": logp + loss_bwd * head},  # the loss's backward
                   # the head's backward: the logits' grad, the input's (ddp: the weight's, until added into its
                   # bucket; fsdp gathers the root unit again)
                   {"activations": norm + t * d * e * head, "logits": t * e * vocab,
                    "grads": (not sharded) * G_B * s.p_embed * head, "weights": gathering * head * (root + s.p_layer)},
                   # the final norm's backward: its fp32 input and the temporaries of F.rms_norm's backward
                   {"activations": head * t * (1 + RMS_BWD_TEMPS) * 4 * d / sh},
                   # a block's backward; fsdp, as its unit reduces: its grads, their flat copy (in the room of the
                   # freed weights, unless kept), the previous unit's send in flight (in held when accumulating)
                   {"activations": block_bwd, "weights": unit * (not kept),
                    "grads": unit + sharded * G_B * s.p_layer * (kept + (not held))}]
        moment = max(moments, key=lambda m: sum(m.values()))
        m = {k: v + moment.get(k, 0.0) for k, v in base.items()}
        # the end of backward. ddp: the buckets, all in flight (no copies). fsdp, as each unit reduces (blocks, then
        # the root): the shards, the unit's grads and their flat copy, the previous unit's send in flight
        unit_sizes = [s.p_layer] * layers + [root] * (root > 0)  # in the order backward reduces them
        reduce_peak = max(2 * size + before for before, size in zip([0] + unit_sizes, unit_sizes))
        end = {"weights": weights + gathering * (root + s.p_layer),  # the root and a prefetched block
               "grads": grads / S + G_B * reduce_peak if sharded else grads,
               "activations": 0.0, "logits": 0.0}
        m = max(m, end, key=lambda x: sum(x.values()))
        m.update(master=MASTER_B * params / S, adam=ADAM_B * params / S)
        m["overhead"] = overhead_gb * GB + frag * sum(m.values())
        best = m if best is None or sum(m.values()) > sum(best.values()) else best
    return best

"""--code ours: the byte and memory formulas of this repository's parallel/*.py, where the reference ones
(comm.py, memory.py) describe the implementation Llama 3 and Megatron-LM report, the one the
planner's calibration is for. Notation: layout.py; e the compute dtype's bytes, r the residual stream's: the
dtype of the weights forward sees, 4 under ddp (fp32 masters, autocast casts per matmul), e under fsdp and hsdp
(units gathered in the compute dtype); w the gathered units' bytes (e; 4 in an fp32 run).

tests/test_plan_measured.py holds these to fp32 CPU runs of train.train_step: bytes equal to the comm counters per
group, memory within 15% of the bytes allocated. The bytes come from the parallel modules' own traffic formulas (the
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

Activations per layer per token (sh = tp under sp, else 1). A norm (model.ScaledRMSNorm): its input, the residual,
and an fp32 1/rms, r*d + 4, plus its output as the matmuls reading it save it: under tp (ColumnParallel) once in its
own dtype, r*d (sp: its (t/tp, d) block, so (4 + 2r*d)/tp); without tp as model.py's linears save it, e*d, once
per reader when autocast casts it (r != e: q, k, v read the first norm, gate and up the second), else once.
Attention (SDPA with enable_gqa: K,V with their own kv heads, never repeated per query head): q, K, V, the output
and the fp32 lse, e*(2d/tp + 2*hd*kv_local) + 4a/tp; under cp the output laid out again for o_proj, + e*d/tp, and
allgather keeps the whole sequence's K,V (cp*kv_local heads), ulysses the whole sequence for lcm(kv_local, cp)/cp
heads. The MLP: gate, up and their product, 3e*f/tp (model.SwiGLU recomputes silu(gate)). selective: the same
without the norms' outputs and the product (parallel/ckpt.py remakes them in backward); full: r*d/sh. The head's
rank keeps the final norm (one reader; selective: its input) and model.CrossEntropy's logits in e plus 13
bytes per token (fp32 lse, int64 shifted target, bool mask): no (t, V/tp) fp32 tensor, only one chunk of
model.loss_chunks at a time.
Peak = model state + the fullest moment of the step. Model state: 12 B/param of fp32 master and Adam (/S sharded);
ddp's fp32 buckets (the .grads are their views), fsdp's fp32 shard gradients, 4P/S, whatever M. All moments hold the
activations in flight; fsdp also one flat gradient of its largest unit (fp32) from the step's first reduction to its
end, and gathered units (in w: under pp the stage's, all step; else the moment's, below). On top: the loss's backward
(the logits' grad and three fp32 (rows, V/tp) chunk buffers; fsdp: the head unit), the head's backward (the logits'
and the input's grads, the head weight's grad: ddp until added into its bucket, fsdp in w; fsdp: the head unit and
the prefetched last block), the final norm's backward (its input and RMS_BWD_TEMPS fp32 (t, d/sh) temporaries; fsdp:
as the head's, then its reduction), a block's backward (two more (t, f/tp) MLP grads, the residual's grad, the
recompute; sp: the input gathered again, tp: the input cast to e; fsdp: the block's grads in w, it and the prefetched
previous one; for the first block, the next microbatch's embedding instead, and no later block's activations) or the
embedding's (its dense grad in w, the next microbatch's embedding prefetched).
zb1 and zbv (deferred_per_token, zb_sets): a stage keeps forward sets and sets awaiting their W, which hold each
matmul's input and output gradient (about 1.3 forward sets); the set in B is counted as one awaiting its W.
At 405B the activations decide which of Llama 3's published meshes fit (with ckpt=none a block keeps its norms'
inputs and outputs, q, K, V, the attention output, gate, up and their product); what each then predicts, with its
range, is bench/planner/published.py's table (bench/README.md).
"""
import math

from bench.planner.layout import ACT_B, ADAM_B, BUCKET_MB, G_B, GB, MASTER_B, W_B, in_flight, shard_size
from model import loss_chunks
from parallel.cp import allgather_bytes, ulysses_bytes
from parallel.ddp import all_reduce_bytes
from parallel.fsdp import gather_reduce_bytes, gathers_per_step
from parallel.hsdp import replica_bytes
from parallel.pp import p2p_bytes
from parallel.ring_attention import ring_bytes
from parallel.tp import activation_collectives, loss_bytes, seq_collective_bytes

RMS_BWD_TEMPS = 5  # (t, d) fp32 temporaries at once in model.ScaledRMSNorm's backward (x̂, its grad, their product,
# the input's grad before its cast)


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


def norm_per_token(s, users, a_bytes, output=True):
    """Bytes per token one RMSNorm keeps: model.ScaledRMSNorm's input (the residual, in r) and fp32 1/rms, and its
    output as the `users` matmuls reading it save it: under tp once, in its own dtype r (parallel/tp.py's
    ColumnParallel; sp: its shard, gathered again in backward); else in the compute dtype e, one copy per matmul when
    autocast casts it (r != e), one when it is in that dtype already. output=False: --ckpt selective remakes it."""
    d, e, r, tp = s.cfg.d_model, a_bytes, residual_bytes(s, a_bytes), s.lay.tp
    if tp > 1:
        return (4 + (1 + output) * r * d) / (tp if s.lay.sp else 1)
    return 4 + r * d + output * e * d * (users if r != e else 1)


def ours_act_per_token(s, ckpt, a_bytes=ACT_B):
    """act_per_token() of this repository's model: the tensors autograd saves (tests/test_plan_measured.py)."""
    cfg, lay, e = s.cfg, s.lay, a_bytes
    d, f, tp = cfg.d_model, cfg.ffn_dim, lay.tp
    x = residual_bytes(s, a_bytes) * d / (tp if lay.sp else 1)  # the block's input; sp shards it
    lse = 4 * cfg.n_head / tp  # the attention kernel's fp32 log-sum-exp per head
    if ckpt == "full":
        return x  # backward recomputes the rest
    # attention keeps q, K and V as its kernel reads them, its output and fp32 lse; under cp also the output laid out
    # again for o_proj. K,V keep their kv heads: ring its own block, allgather the whole sequence's (cp blocks),
    # ulysses the whole sequence for lcm(kv_local, cp)/cp heads (cp.py repeats them only until cp divides them)
    mode = lay.cp_mode if lay.cp > 1 else "sdpa"
    kv_heads = {"allgather": s.kv_local * lay.cp, "ulysses": math.lcm(int(s.kv_local), lay.cp)}.get(mode, s.kv_local)
    attention = e * ((2 + (mode != "sdpa")) * d / tp + 2 * cfg.head_dim * kv_heads) + lse
    # the two norms (q, k, v read the first, gate and up the second); the MLP: gate, up, their product (selective
    # remakes the norms' outputs and the product in backward: parallel/ckpt.py)
    kept = ckpt != "selective"  # zb1 / zbv's norms (pp_bw_split.py) are not the Function selective remakes
    norms = kept or (lay.schedule in ("zb1", "zbv") and lay.pp > 1)
    return norm_per_token(s, 3, e, norms) + norm_per_token(s, 2, e, norms) + attention + e * (2 + kept) * f / tp



def transients(s, a_bytes):
    """(the activations a layer keeps per token, a block's backward on top of them, the loss's backward on top of
    the logits): the tensors each backward makes."""
    cfg, lay, t, d, e = s.cfg, s.lay, s.t, s.cfg.d_model, a_bytes
    r, sh, vocab = residual_bytes(s, a_bytes), lay.tp if lay.sp else 1, cfg.padded_vocab / lay.tp
    keep = ours_act_per_token(s, lay.ckpt, a_bytes)
    redo = (ours_act_per_token(s, "none", a_bytes) - keep) * t  # a block recomputed in backward
    if lay.ckpt == "selective":  # one remade output at a time: a norm's for one reader, or SwiGLU's
        redo = t * max(r * d / (lay.tp if lay.sp else 1), e * cfg.ffn_dim / lay.tp)
    # sp: the (t, d) tensors a column-parallel backward holds: the output grad all-gathered from the next block,
    # the norm output gathered again (in r, and cast to e) and its grad; tp without sp: the norm output cast to e
    regather = (lay.sp and lay.tp > 1) * t * d * (r + (e if e != r else 0) + 2 * e)
    regather += (lay.tp > 1 and not lay.sp) * t * d * (e if e != r else 0)
    # the MLP's backward: three (t, f/tp) activation grads at once, after down_proj's backward freed its input, and
    # the residual stream's grad
    block_bwd = 2 * t * cfg.ffn_dim / lay.tp * e + t * r * d / sh + redo + regather
    # the loss (model.CrossEntropy) keeps the logits in their dtype and per token an fp32 lse, the target shifted
    # to this rank's vocabulary shard (int64) and whether it lives there; its backward adds the logits' grad and
    # three fp32 (rows, V/tp) buffers of one chunk (model.loss_chunks)
    chunk = loss_chunks(max(1, int(t)), max(1, int(vocab)))[0]
    return keep, block_bwd, t * e * vocab + 3 * 4 * (chunk.stop - chunk.start) * vocab


def deferred_per_token(s, a_bytes):
    """zb1, zbv (parallel/pp_bw_split.py): per token, (what a layer's norms keep beyond ScaledRMSNorm's, what a layer
    holds from its B to its W, what the final norm and the head hold from B to W). A deferred norm keeps x in fp32
    and x̂ (+4d each); from B to W every matmul keeps its input and its output's gradient, every norm gain x̂ and
    its output's gradient, the head the logits' gradient (e*vocab/tp)."""
    cfg, lay, e, r = s.cfg, s.lay, a_bytes, residual_bytes(s, a_bytes)
    d, f, tp, sh = cfg.d_model, cfg.ffn_dim, lay.tp, lay.tp if lay.sp else 1

    def read(users):  # a norm's output as the matmuls reading it save it (norm_per_token)
        return r * d / sh if tp > 1 else e * d * (users if r != e else 1)
    grads = e * (d / tp + 2 * cfg.head_dim * s.kv_local + 2 * d + 2 * f / tp)  # q, k, v, o, gate, up, down outputs
    layer = 2 * 2 * r * d / sh + read(3) + read(2) + e * (d + f) / tp + grads
    return 2 * 4 * d / sh * (lay.ckpt == "none"), layer, 2 * r * d / sh + read(1) + e * cfg.padded_vocab / tp


def zb_sets(M, P, stage):
    """zb1, zbv: (forward sets, sets awaiting their W) at the fullest moment of the first, the last and a middle
    stage of s.stages(): stage r keeps P-r forwards and r sets between B and W (zb1 runs W r micro-batches late;
    zbv's cooldown runs r pairs of B before their W's), the middle at r = P-2, the fullest of them."""
    n = min(M, P)
    return [(n, 0), (1, n - 1), (2, n - 2)][stage]


def ours_memory(s, overhead_gb, frag, w_bytes, a_bytes):
    """Model state plus the fullest moment of a step, on the fullest rank of s.stages() (the module docstring lists
    what each moment holds)."""
    cfg, lay, P, M, t, d, e = s.cfg, s.lay, s.lay.pp, s.M, s.t, s.cfg.d_model, a_bytes
    sharded = lay.dp_mode != "ddp"
    S, sh, vocab = shard_size(lay) if sharded else 1, lay.tp if lay.sp else 1, cfg.padded_vocab / lay.tp
    r, (keep, block_bwd, loss_bwd) = residual_bytes(s, a_bytes), transients(s, a_bytes)
    last_flight = in_flight(lay.schedule, M, P, lay.V)[1]
    zb = lay.schedule in ("zb1", "zbv") and P > 1
    extra, held, held_head = deferred_per_token(s, a_bytes) if zb else (0.0, 0.0, 0.0)
    best = None
    for i, (layers, params, embed, head, _) in enumerate(s.stages()):
        rank = min(i, 1)  # s.stages(): the first rank, the last, a middle one (rank 1 keeps the most of those)
        flight = 1 if P == 1 else last_flight if head else in_flight(lay.schedule, M, P, lay.V, rank)[0]
        flight, waiting = zb_sets(M, P, i) if zb else (flight, 0)
        acts = layers * t * (keep + extra)  # a microbatch's blocks
        sending = 0.0 if head else t * r * d / sh  # one output in flight: parallel/pp.py frees it once sent
        norm = t * (norm_per_token(s, 1, e, lay.ckpt != "selective" or zb) + extra / 2) if head else 0.0
        logp = t * (e * vocab + 4 + 8 + 1) if head else 0.0
        held_acts = (waiting + zb) * t * (layers * held + head * held_head)  # with the set in B, as at its end
        stage = (layers, params, embed, head, acts, norm, logp)
        if not sharded:  # ddp: autocast's bf16 weight copies; the .grads are views into its buckets, kept all along
            cases = [({"weights": w_bytes * params, "grads": G_B * params}, flight, [
                {"activations": norm, "logits": logp + loss_bwd * head},  # the loss's backward
                # the head's backward: the logits' grad, the input's, the weight's until added into its bucket
                {"activations": norm + t * d * e * head, "logits": t * e * vocab * head,
                 "grads": G_B * s.p_embed * head},
                {"activations": head * t * (1 + RMS_BWD_TEMPS) * 4 * d / sh},  # the final norm's backward
                {"activations": block_bwd}])]  # a block's backward
        elif lay.schedule == "gpipe" and M > 1:  # the first backward without the flat gradient, later ones with it
            cases = [fsdp_moments(s, stage, w_bytes, a_bytes, flight, False),
                     fsdp_moments(s, stage, w_bytes, a_bytes, flight - 1, True)]
        else:
            cases = [fsdp_moments(s, stage, w_bytes, a_bytes, flight, M > 1)]
        for kept, n, moments in cases:
            base = dict(kept, activations=(n - zb) * acts + (n - 1) * norm + held_acts + sending, logits=(n - 1) * logp)
            moment = max(moments, key=lambda m: sum(m.values()))
            m = {k: v + moment.get(k, 0.0) for k, v in base.items()}
            m.update(master=MASTER_B * params / S, adam=ADAM_B * params / S)
            m["overhead"] = overhead_gb * GB + frag * sum(m.values())
            best = m if best is None or sum(m.values()) > sum(best.values()) else best
    return best


def fsdp_moments(s, stage, w_bytes, a_bytes, n, early):
    """(what fsdp/hsdp hold all step, microbatches in flight, the moments on top) of one stage (parallel/fsdp.py):
    the fp32 shard gradients; under pp the stage's units, gathered from their first forward to the end of the step,
    else the units a moment gathers; the flat gradient of the largest unit from the step's first reduction (`early`:
    already there at the loss, as in any microbatch after the first); the gathered units' grads, in their dtype."""
    layers, params, embed, head, acts, norm, logp = stage
    d, t, M, e, r = s.cfg.d_model, s.t, s.M, a_bytes, residual_bytes(s, a_bytes)
    S, sh, vocab = shard_size(s.lay), s.lay.tp if s.lay.sp else 1, s.cfg.padded_vocab / s.lay.tp
    kept, w, (keep, block_bwd, loss_bwd) = s.lay.pp > 1, w_bytes or MASTER_B, transients(s, a_bytes)
    g, block, p_head = (not kept) * w, s.p_layer * (layers > 0), s.p_embed + d
    unsharded = s.lay.accumulate == "unsharded"  # every unit's flat gradient held all step, none per moment
    flat = (not unsharded) * G_B * max([block, s.p_embed * embed, p_head * head])
    fl, after = flat * early, s.p_embed * embed * (M > 1)  # the next microbatch's embedding, prefetched
    moments = [{"grads": flat}]
    if layers:  # a block's backward (it and the one before, prefetched); the first block's (the embedding instead)
        moments += [{"activations": block_bwd, "weights": g * (block + (block if layers > 1 else after)),
                     "grads": flat + w * block},
                    {"activations": block_bwd - (layers - 1) * t * keep, "weights": g * (block + after),
                     "grads": flat + w * block}]
    if embed:  # the embedding's backward: its dense grad; the rest of the microbatch's activations are freed
        moments += [{"activations": t * r * d / sh - acts, "weights": g * after, "grads": flat + w * s.p_embed}]
    if head:  # the loss's backward, the head's, the final norm's, the head unit's reduction
        moments += [{"activations": norm, "logits": logp + loss_bwd, "weights": g * p_head, "grads": fl},
                    {"activations": norm + t * d * e, "logits": t * e * vocab, "weights": g * (p_head + block),
                     "grads": w * s.p_embed + fl},
                    {"activations": t * (1 + RMS_BWD_TEMPS) * 4 * d / sh, "weights": g * (p_head + block),
                     "grads": w * s.p_embed + fl},
                    {"activations": t * r * d / sh, "weights": g * block, "grads": w * s.p_embed + flat}]
    return {"weights": kept * w * params, "grads": G_B * params / S + unsharded * G_B * params}, n, moments

"""What hides under what: exposed TP and DP seconds, the price of cutting a collective into ring hops, and fp8's casts
(notation: layout.py; links, hide() and tax(): links.py; the factors: factors.py).

TP, --code ours (parallel/tp.py, tp_ring.py): without sp the 2 forward all-reduces of a layer block, the 2 backward
ones hide under the weight-grad matmuls of q,k,v and of gate,up (2*d*outputs/tp FLOPs per token each), lm_head's under
its own. With sp and overlap every (t, d) collective of a layer or the head is a ring of tp-1 hops, each under a 1/tp
chunk of the matmul next to it (ring()); what that costs, and no more than it, is priced: a chunk of t/tp rows runs at
the efficiency of its own size (step_time.py's rows model), so the chunked matmuls (forward, input gradients, the row
weights' gradients: 4*W + 2*W_row FLOPs per token of a layer's W) pay the difference; a hop hides only what the link
carries within its chunk's compute time, the rest is exposed; and each hop's RING_HOP_OPS ops are dispatched by the
host (the hops run outside the compiled graphs), launch_us each, which the GPU waits for where a hop's work is shorter.
The embedding's and the loss's collectives and sp's norm-grad all-reduce block. Under fp8 the rings are off (fp8.py):
every sp collective blocks, and each block linear all-reduces its amaxes over tp (and cp) in forward and backward.
TP, the reference (Megatron-LM): TP_EXPOSED of the collectives block (it hides the 4 backward ones under GEMMs); with
tp_comm_overlap (--tp-comm-overlap, Transformer Engine's userbuffers) every sp collective is a ring under its GEMM's
chunks as above, launched from C++ (no host term).
Which overlaps --code ours is credited for, and on what evidence: ddp's buckets, fsdp's and hsdp's gathers,
reduce-scatters and replica chain, tp's backward all-reduces without sp (the emulated cluster, bench/cluster,
measured each hidden); the sp rings (tests/test_tp_overlap.py: every hop in flight under its chunk's matmuls). The
cp ring's hops under attention and the pipeline's sends: no measurement yet, credited only the factor `credit`.
DP, --code ours: parallel/fsdp.py's gathers and reduce-scatters under each microbatch's compute (under pp: the step's
one gather of a unit under the first forward, the reduce-scatters under each backward), the first gather and the last
reduce-scatter of one unit exposed; hsdp's replica all-reduces are a chain through the last backward, each under one
unit's, the last units' exposed (replica_chain). The reference's dist_opt reduce-scatters under the last backward
and all-gathers under the next step's first forward (--overlap-grad-reduce, --overlap-param-gather), a bucket of
each exposed.
fp8 (fp8_bytes): the block matmuls only, at the factor fp8 times the bf16 rate; priced beside them, per token and layer,
the memory traffic of their casts: ours per linear 3 amax passes (x, W, dY), 5 casts, 3 transposed copies (fp8.py),
10 bytes per element of x and of W (per micro-batch) and 7 of dY; the reference (Transformer Engine) one fused
cast-and-transpose of x and dY, 4 bytes each, the amax taken by the producing kernel, the weights cast once a step.
"""
import math

from bench.planner.layout import G_B, shard_size
from bench.planner.links import all_reduce_latency, factors, hide, seconds, tax
from bench.planner.ours import fsdp_parts
from parallel.ddp import all_reduce_bytes
from parallel.hsdp import replica_bytes
from parallel.tp import activation_collectives, loss_bytes, seq_collective_bytes

TP_EXPOSED = 0.6     # reference: 6 of the 10 TP collectives block (4 fwd, 2 bwd); Megatron hides 4 bwd ones under GEMMs
RING_HOP_OPS = 6     # ops the host dispatches per hop of one collective (tp_ring.py: a p2p pair, each chunk's matmul
#                      and its copy or add; a column backward carries two collectives in one hop)
FP8_LINEARS = 7      # q, k, v, o, gate, up, down: each all-reduces its amaxes over tp and cp in forward and backward


def chunk_matmuls(s, extra=0.0):
    """(FLOPs per token of a layer's block matmuls cut into ring chunks, all of them): forward, input gradients and the
    row-parallel weights' gradients (o, down) run chunk by chunk; the column weights' gradients run whole (under the
    last hop). extra: forwards recomputed (full checkpointing: 1)."""
    cfg, tp = s.cfg, s.lay.tp
    w = s.p_layer - 2 * cfg.d_model                          # the layer's matmul weights on this GPU
    w_row = (cfg.n_head * cfg.head_dim + cfg.ffn_dim) * cfg.d_model / tp   # o and down
    return 4 * w + 2 * w_row + 2 * w * extra, 6 * w * (1 + extra / 3)


def ring(cl, lay, n, unit, mm, penalty, ops):
    """Exposed seconds of n collectives of `unit` seconds each, cut into tp-1 hops under the chunks of `mm` seconds
    of matmuls that took `penalty` seconds more for being chunked; ops: host ops per hop (0: launched from C++)."""
    hops = n * (lay.tp - 1)
    if not hops:
        return 0.0
    window = (lay.tp - 1) / lay.tp * (mm + penalty)  # the last chunk of each ring has no hop left to hide
    host = ops * factors(cl).launch_us * 1e-6
    waits = hops * max(host - max(n * unit, window) / hops, 0.0)  # the GPU waits for a host slower than its hop
    return hide(n * unit, window, tax(cl, lay, "tp")) + penalty + waits


def fp8_bytes(s, code):
    """Memory bytes per token per layer of the fp8 casts (module docstring): x, the linears' inputs; y, their outputs'
    gradients; w, their weights per micro-batch (ours) or per step (the reference)."""
    cfg, d, f, tp = s.cfg, s.cfg.d_model, s.cfg.ffn_dim, s.lay.tp
    attn = cfg.n_head * cfg.head_dim
    y = attn / tp + 2 * cfg.head_dim * s.kv_local + 2 * d + 2 * f / tp  # q, k, v, o, gate, up, down outputs
    w = s.p_layer - 2 * d
    if code == "ours":  # each linear casts its own input: q, k, v the first norm's output, gate and up the second's
        return 10 * (5 * d + attn / tp + f / tp) + 7 * y + 10 * w / s.t
    return 4 * (2 * d + attn / tp + f / tp) + 4 * y + 4 * w / (s.t * s.M)  # fused qkv and gate-up read x once


def ours_tp(s, cl, flop_at):
    """Exposed TP seconds per microbatch on the busiest stage, --code ours; flop_at(rows): seconds per matmul FLOP
    over that many rows on one GPU."""
    cfg, lay, d, t, tp = s.cfg, s.lay, s.cfg.d_model, s.t, s.lay.tp
    unit = seconds(cl, lay, "tp", seq_collective_bytes(t, d, tp, cl.dtype_bytes), tp - 1)  # a (t, d) gather or RS
    full = lay.ckpt == "full"
    n = activation_collectives(1, False, False, lay.sp, full)  # per layer; an all-reduce is 2
    lost, rate = tax(cl, lay, "tp"), (factors(cl).fp8 if lay.fp8 else 1.0)
    block = flop_at(t) / rate  # seconds per block-matmul FLOP
    head_units = 2 + lay.sp
    if not lay.overlap or (lay.sp and lay.fp8):  # every collective blocks (fp8: no rings)
        layer, head = n * unit, head_units * unit
    elif lay.sp:  # rings: each hop under a 1/tp chunk of the matmul next to it
        chunked, flops = chunk_matmuls(s, full)
        slower = flop_at(t / tp) - flop_at(t)
        layer = ring(cl, lay, n, unit, flops * t * block, chunked * t * slower, RING_HOP_OPS)
        head = ring(cl, lay, head_units, unit, 6 * s.p_embed * t * flop_at(t), 4 * s.p_embed * t * slower, RING_HOP_OPS)
    else:  # forward (and recompute) all-reduces block, backward ones run under the weight-grad matmuls
        qkv = 2 * d * (cfg.n_head * cfg.head_dim / tp + 2 * cfg.head_dim * s.kv_local) * t * block
        gate_up = 2 * d * 2 * cfg.ffn_dim / tp * t * block
        layer = (n - 4) * unit + hide(2 * unit, qkv, lost) + hide(2 * unit, gate_up, lost)
        head = hide(2 * unit, 2 * s.p_embed * t * flop_at(t), lost)
    if lay.fp8:  # each linear's amax all-reduces, forward and backward
        layer += 2 * FP8_LINEARS * all_reduce_latency(cl, lay, "tp", tp)
    loss = seconds(cl, lay, "tp", loss_bytes(t, tp), tp - 1)
    worst = 0.0
    for layers, _, embed, has_head, _ in s.stages():
        norms = seconds(cl, lay, "tp", all_reduce_bytes(d * (2 * layers + has_head), tp, G_B),
                        2 * math.ceil(math.log2(tp))) * lay.sp / s.M  # once per step
        worst = max(worst, layers * layer + embed * 2 * unit + has_head * (head + loss) + norms)
    return worst


def reference_tp(s, cl, comm_tp, flop_at):
    """Exposed TP seconds per microbatch, the reference: comm_tp, the collectives' seconds per microbatch."""
    lay, t = s.lay, s.t
    if not lay.overlap:
        return comm_tp
    if not lay.tp_comm_overlap:
        return TP_EXPOSED * comm_tp
    chunked, flops = chunk_matmuls(s, lay.ckpt == "full")
    rate = factors(cl).fp8 if lay.fp8 else 1.0
    mm = s.most * flops * t * flop_at(t) / rate + 6 * s.p_embed * t * flop_at(t)
    penalty = (s.most * chunked / rate + 4 * s.p_embed) * t * (flop_at(t / lay.tp) - flop_at(t))
    return ring(cl, lay, 1, comm_tp, mm, penalty, 0) if comm_tp else 0.0


def replica_chain(s, cl, layers, params, embed, head, t_layer, h):
    """Exposed seconds of one stage's hsdp replica all-reduces (parallel/fsdp.py's _finish_reduction). In the step's
    last backward, unit i's all-reduce is launched once its reduce-scatter is waited for, as unit i+1's backward
    ends, and waited for as unit i+2's ends, before unit i+1's is launched: a chain, each under one unit's backward.
    The last two units' have none (waited in finish_grad_sync), nor has the one under the embedding, whose backward
    is an index add. Backward in the units' reverse order: head (h layers), blocks, embedding; 2/3 of a layer's
    t_layer seconds each."""
    lay, S, d = s.lay, shard_size(s.lay), s.cfg.d_model
    R = lay.dp * lay.cp // S
    block = (params - s.p_embed * embed - (s.p_embed + d) * head) / layers
    units = [(s.p_embed + d, h)] * head + [(block, 1.0)] * layers + [(s.p_embed, 0.0)] * embed  # (params, layers)
    steps, lost = 2 * math.ceil(math.log2(R)), tax(cl, lay, "replica")
    sums = [seconds(cl, lay, "replica", replica_bytes(n, S, R, G_B), steps) for n, _ in units]
    windows = [2 / 3 * t_layer * w for _, w in units[2:]] + [0.0, 0.0]
    return sum(hide(r, w, lost) for r, w in zip(sums, windows))


def ours_dp(s, cl, t_stage, t_layer, h, wire_steps):
    """Exposed FSDP/HSDP seconds per step on the busiest stage, --code ours with overlap (parallel/fsdp.py, hsdp.py);
    t_layer: one layer's seconds per microbatch, h: the head in layers; wire_steps: links.gloo_rs's."""
    lay, M, worst = s.lay, s.M, 0.0
    for layers, params, embed, head, _ in s.stages():
        parts, units = fsdp_parts(s, layers, params, embed, head, w_bytes=cl.dtype_bytes)
        (gb, gs), (rb, rs) = parts["gather"], parts["reduce"]
        group = "dp" if lay.dp_mode == "fsdp" else "shard"
        lost = tax(cl, lay, group)
        wire, steps = wire_steps
        gather, reduce = seconds(cl, lay, group, gb, gs), seconds(cl, lay, group, rb * wire, rs * steps)
        # the step's first gather and last reduce-scatter, of one unit each, have nothing to hide under: exposed,
        # and taken out of what hides
        if lay.pp > 1:  # each unit gathered once, under the first forward; reduce-scattered under each backward
            first, last = gather / units, reduce / M / units
            exp = (hide(gather - first, t_stage / 3, lost) + (M - 1) * hide(reduce / M, t_stage * 2 / 3, lost)
                   + hide(reduce / M - last, t_stage * 2 / 3, lost) + first + last)
        else:  # every microbatch gathers and reduce-scatters under its own forward and backward
            per_mb = (gather + reduce) / M
            exp = (M - 1) * hide(per_mb, t_stage, lost) + hide(per_mb - per_mb / units, t_stage, lost) + per_mb / units
        if lay.dp_mode == "hsdp":  # once per step, a chain through the last backward
            exp += replica_chain(s, cl, layers, params, embed, head, t_layer, h)
        worst = max(worst, exp)
    return worst


def dist_opt_dp(cl, lay, comm_dp, buckets, t_stage):
    """Exposed seconds of Megatron's distributed optimizer: the fp32 gradients' reduce-scatter (4 of the 6 bytes per
    parameter) under the last backward, the bf16 weights' all-gather (2) under the next first forward, each but one
    bucket."""
    rs, ag, lost = comm_dp * 4 / 6, comm_dp * 2 / 6, tax(cl, lay, "dp")
    return hide(rs - rs / buckets, t_stage * 2 / 3, lost) + hide(ag - ag / buckets, t_stage / 3, lost) + (
        rs + ag) / buckets

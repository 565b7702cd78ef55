"""Seconds per step of a layout and its MFU: links and what hiding costs, what hides under what (TP and DP exposed,
ring hops, fp8's casts), the step's terms. The formulas: bench/README.md, "The planner's formulas".
"""
import math
from dataclasses import replace
from functools import lru_cache

from bench.planner import ours
from bench.planner.costs import collectives
from bench.planner.factors import FACTORS, REFERENCE, ranges, vary
from bench.planner.layout import BUCKET_MB, G_B, GB, Shape, shard_size
from model import flops_per_token
from parallel.ckpt import recomputed_layers

MM_EFF, OVERLAP_TAX = REFERENCE.mm, REFERENCE.tax  # the reference's factors (factors.py), as the tests name them
MM_ROWS0 = 128       # GEMMs over t token rows lose about one 128-row tile wave: * t/(t + 128)
ATTN_KEYS0 = 512     # a kernel streaming K keys: * K/(K + 512) (short ring-CP blocks run slower)
ELEM_BYTES = 75      # HBM bytes per token per layer per unit of d+f: norms, RoPE, SwiGLU, residuals fwd+bwd
OPT_BYTES = 40       # memory bytes per parameter of an update, --code ours: the clip reads the fp32 gradient twice
#                      and writes it once, fused AdamW reads weight, gradient and both moments and writes three
HOST_OPS_LAYER = 186  # aten ops one block's forward and backward dispatch; the embedding, final norm, head and
HOST_OPS_REST = 134   # loss another 134 per micro-batch (model.py; tests/test_plan_cluster.py counts both)
TP_EXPOSED = 0.6     # reference: 6 of the 10 TP collectives block (4 fwd, 2 bwd); Megatron hides 4 bwd ones under GEMMs
RING_HOP_OPS = 6     # ops the host dispatches per hop of one collective (tp_ring.py: a p2p pair, each chunk's matmul
#                      and its copy or add; a column backward carries two collectives in one hop)
FP8_LINEARS = 7      # q, k, v, o, gate, up, down: each all-reduces its amaxes over tp and cp in forward and backward


def factors(cl):
    """The cluster's efficiency factors (step_time.py sets them per code), the reference's if none."""
    return cl.factors or REFERENCE


@lru_cache(maxsize=None)
def members_per_node(gpus_per_node, tp, cp, pp, dp, S, group, order="node"):
    """How many members of rank 0's `group` (tp, cp, pp, dp = dp x cp, shard, replica) share its node: ranks
    0..gpus_per_node-1, or every (world / gpus_per_node)-th rank under the interleaved order."""
    def key(r):  # rank -> (tp, cp, pp, dp) coordinates, tp fastest; equal keys share a group
        t, r = r % tp, r // tp
        c, r = r % cp, r // cp
        p, d = r % pp, r // pp
        pos = c + cp * d  # position in the dp x cp group
        return {"tp": (c, p, d), "cp": (t, p, d), "pp": (t, c, d), "dp": (t, p),
                "shard": (t, p, pos // S), "replica": (t, p, pos % S)}[group]
    world = tp * cp * pp * dp
    nodes = max(world // gpus_per_node, 1)
    mine = range(0, world, nodes) if order == "interleaved" else range(min(gpus_per_node, world))
    return sum(key(r) == key(0) for r in mine)


def link(cl, lay, group):
    """(bytes/s, seconds per ring step) one rank of `group` gets."""
    S = shard_size(lay)
    size = {"tp": lay.tp, "cp": lay.cp, "pp": lay.pp, "dp": lay.dp * lay.cp, "shard": S,
            "replica": lay.dp * lay.cp // S}[group]
    k = members_per_node(cl.gpus_per_node, lay.tp, lay.cp, lay.pp, lay.dp, S, group, lay.order)
    eff = 1.0 if cl.measured else factors(cl).bus
    if k == size:
        return eff * cl.intra_gbs * GB, cl.lat_intra_us * 1e-6
    nics = k if cl.backend == "nccl" else 1  # NCCL stripes a ring over the node's NICs; gloo's one ring uses one
    return eff * min(cl.intra_gbs, nics * cl.inter_gbs) * GB, cl.lat_inter_us * 1e-6


def seconds(cl, lay, group, nbytes, steps):
    """Time for one rank of `group` to send `nbytes` in `steps` dependent ring steps."""
    bw, lat = link(cl, lay, group)
    return nbytes / bw + steps * lat


def all_reduce_latency(cl, lay, group, size):
    """Seconds of one tiny blocking all-reduce over `size` ranks of `group`: 2*log2 of it latency steps."""
    return 2 * math.ceil(math.log2(size)) * link(cl, lay, group)[1] if size > 1 else 0.0


def tax(cl, lay, group):
    """Compute lost per second of `group`'s communication hidden under it. NCCL: the factor `tax` (its kernels take
    SMs). gloo: a rank's own threads copy its bytes, at the loopback rate, on its own cores: all of a collective
    inside a node, the loopback's share of one whose wire is slower."""
    if cl.backend == "nccl":
        return factors(cl).tax
    return min(1.0, link(cl, lay, group)[0] / (cl.intra_gbs * GB * (1.0 if cl.measured else factors(cl).bus)))


def hide(t_comm, window, lost, credit=1.0):
    """Exposed seconds of communication overlapped with `window` seconds of compute, `lost` per second hidden; an
    overlap credited only `credit` of what it would hide exposes the rest."""
    hidden = min(t_comm, window)
    return max(t_comm - window, 0.0) + hidden * (lost + (1.0 - credit) * (1.0 - lost))


def gloo_rs(cl, S):
    """(bytes on the wire, ring steps) of a reduce-scatter over S ranks, each over its ring terms': on gloo (an
    all-reduce of its whole input, results/cluster.md) 2 and an all-reduce's 2*log2 S steps over S-1; else 1, 1."""
    return (2, 2 * math.ceil(math.log2(S)) / (S - 1)) if cl.backend == "gloo" and S > 1 else (1, 1)


def clip_norm(cl, lay):
    """The clip's all-reduce of a few floats over the world, blocking, once per step (optim.global_grad_norm): 2*log2
    of the world latency steps, over the network once the world spans nodes."""
    world = lay.tp * lay.cp * lay.pp * lay.dp
    lat = cl.lat_intra_us if world <= cl.gpus_per_node else cl.lat_inter_us
    return 2 * math.ceil(math.log2(world)) * lat * 1e-6


def recomputed_share(cfg, ckpt):
    """The share of a block's forward matmul FLOPs that backward runs again: full 1, op k + o + up."""
    if ckpt != "op":
        return float(ckpt == "full")
    kv, f = cfg.n_kv_head * cfg.head_dim, cfg.ffn_dim
    return (kv + cfg.n_head * cfg.head_dim + f) / (2 * cfg.n_head * cfg.head_dim + 2 * kv + 3 * f)


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
    """Memory bytes per token per layer of the fp8 casts (bench/README.md): x, the linears' inputs; y, their outputs'
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
    unit = seconds(cl, lay, "tp", ours.seq_collective_bytes(t, d, tp, cl.dtype_bytes), tp - 1)  # a (t, d) gather or RS
    redo = lay.ckpt in ("full", "op")
    n = ours.activation_collectives(1, False, False, lay.sp, redo)  # per layer; an all-reduce is 2
    lost, rate = tax(cl, lay, "tp"), (factors(cl).fp8 if lay.fp8 else 1.0)
    block = flop_at(t) / rate  # seconds per block-matmul FLOP
    head_units = 2 + lay.sp
    if not lay.overlap or (lay.sp and lay.fp8):  # every collective blocks (fp8: no rings)
        layer, head = n * unit, head_units * unit
    elif lay.sp:  # rings: each hop under a 1/tp chunk of the matmul next to it
        chunked, flops = chunk_matmuls(s, recomputed_share(cfg, lay.ckpt))
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
    loss = seconds(cl, lay, "tp", ours.loss_bytes(t, tp), tp - 1)
    worst = 0.0
    for layers, _, embed, has_head, _ in s.stages():
        norms = seconds(cl, lay, "tp", ours.all_reduce_bytes(d * (2 * layers + has_head), tp, G_B),
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
    chunked, flops = chunk_matmuls(s, recomputed_share(s.cfg, lay.ckpt))
    rate = factors(cl).fp8 if lay.fp8 else 1.0
    mm = s.most * flops * t * flop_at(t) / rate + 6 * s.p_embed * t * flop_at(t)
    penalty = (s.most * chunked / rate + 4 * s.p_embed) * t * (flop_at(t / lay.tp) - flop_at(t))
    return ring(cl, lay, 1, comm_tp, mm, penalty, 0) if comm_tp else 0.0


def replica_chain(s, cl, layers, params, embed, head, t_layer, h):
    """Exposed seconds of one stage's hsdp replica all-reduces (parallel/fsdp.py's _finish_reduction): in the last
    backward a chain, unit i's under unit i+2's backward (2/3 of t_layer per layer; the head h layers); the last two
    units' and the embedding's (an index add) hide under nothing."""
    lay, S, d = s.lay, shard_size(s.lay), s.cfg.d_model
    R = lay.dp * lay.cp // S
    block = (params - s.p_embed * embed - (s.p_embed + d) * head) / layers
    units = [(s.p_embed + d, h)] * head + [(block, 1.0)] * layers + [(s.p_embed, 0.0)] * embed  # (params, layers)
    steps, lost = 2 * math.ceil(math.log2(R)), tax(cl, lay, "replica")
    sums = [seconds(cl, lay, "replica", ours.replica_bytes(n, S, R, G_B), steps) for n, _ in units]
    windows = [2 / 3 * t_layer * w for _, w in units[2:]] + [0.0, 0.0]
    return sum(hide(r, w, lost) for r, w in zip(sums, windows))


def ours_dp(s, cl, t_stage, t_layer, h, wire_steps):
    """Exposed FSDP/HSDP seconds per step on the busiest stage, --code ours with overlap (parallel/fsdp.py, hsdp.py);
    t_layer: one layer's seconds per microbatch, h: the head in layers; wire_steps: links.gloo_rs's."""
    lay, M, worst = s.lay, s.M, 0.0
    for layers, params, embed, head, _ in s.stages():
        parts, units = ours.fsdp_parts(s, layers, params, embed, head, w_bytes=cl.dtype_bytes)
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


def landing_bytes(cl, lay, M):
    """Memory bytes per parameter and step taking each micro-batch's weight gradients to where the step sums them
    (--code ours): ddp's bucket adds (12), fsdp's copies into the flat fp32 buffer (adds under accumulate=unsharded)
    and, on gloo, the reduce-scatter's copy of it on the caller's thread."""
    if lay.dp_mode == "ddp":
        return M * 12
    unsharded = lay.accumulate == "unsharded"
    per_rs = 8 * (cl.backend == "gloo")
    return M * (cl.dtype_bytes + 4 + 4 * unsharded) + (1 if unsharded else M) * per_rs


def rates(s, cl):
    """Seconds per token of one layer on one GPU, by kind: {"mm", "attn", "elem", "fp8"}, and the matmul seconds per
    FLOP over `rows` rows, flop_at(rows), and per byte of memory traffic, per_byte."""
    cfg, lay, d, tp, f = s.cfg, s.lay, s.cfg.d_model, s.lay.tp, cl.factors
    peak = cl.peak_tflops * 1e12
    per_byte = 1 / (cl.hbm_tbs * 1e12 * (1.0 if cl.measured else f.elem))
    keys = s.seq / lay.cp if lay.cp_mode == "ring" else s.seq
    if cl.measured:  # rates measured at this workload's sizes: seconds per FLOP as they are
        def flop_at(rows):
            return 1 / peak
        attn = 12 * d * s.seq / tp / (cl.attn_tflops * 1e12)
    else:
        def flop_at(rows):
            return 1 / (peak * f.mm * rows / (rows + MM_ROWS0))
        attn = 12 * d * s.seq / tp / (peak * f.attn * keys / (keys + ATTN_KEYS0))
    mm = 6 * (s.p_layer - 2 * d) * flop_at(s.t) / (f.fp8 if lay.fp8 else 1.0)
    elem = ELEM_BYTES * cl.dtype_bytes / 2 * (d + cfg.ffn_dim) / tp * per_byte  # ELEM_BYTES: of bf16 tensors
    casts = fp8_bytes(s, s.code) * per_byte if lay.fp8 else 0.0
    return {"mm": mm, "attn": attn, "elem": elem, "fp8": casts}, flop_at, per_byte


@lru_cache(maxsize=64)
def priced(cl, code):
    """The cluster with `code`'s factors, unless it carries its own."""
    return cl if cl.factors else replace(cl, factors=FACTORS[code])


def step_time(cfg, cl, lay, seq, batch, code="reference"):
    """Predicted seconds per step by component (compute, recompute, imbalance, bubble, fp8, tp, cp, pp, dp, optimizer,
    grads), plus "total", "mfu" and "hfu"."""
    return shape_step_time(Shape(cfg, lay, seq, batch, code), cl)


def shape_step_time(s, cl):
    """step_time() of a Shape."""
    cl = priced(cl, s.code)
    cfg, lay, tp, most, f = s.cfg, s.lay, s.lay.tp, s.most, cl.factors
    peak = cl.peak_tflops * 1e12
    r, flop_at, per_byte = rates(s, cl)
    host = cl.host_us * 1e-6 / s.t  # seconds per token for each op the host dispatches in line (a CPU device)
    t_layer = r["mm"] + r["attn"] + r["elem"] + HOST_OPS_LAYER * host  # seconds per token per layer on one GPU
    redo = {"none": 0.0, "selective": r["elem"] / 3, "full": t_layer / 3,
            "op": (recomputed_share(cfg, "op") * r["mm"] + r["elem"]) / 3}[lay.ckpt]
    head_flop = flop_at(1e30)  # the head's matmul: no row loss
    t_head = 6 * s.p_embed * head_flop + 16 * cfg.padded_vocab / tp * per_byte + HOST_OPS_REST * host
    h = t_head / (t_layer + redo)  # the head in layers
    first, _, last = s.layers
    load = max(first, most, last + h) if lay.pp > 1 else first + h
    ideal = (cfg.n_layer + h) / lay.pp
    sent = collectives(s, cl.dtype_bytes, G_B, cl.dtype_bytes)
    comm = {k: seconds(cl, lay, k, *v) for k, v in sent.items()}
    if s.code == "ours" and tp > 1:  # per microbatch, the busiest stage
        tp_mb = ours_tp(s, cl, flop_at)
    else:
        tp_mb = reference_tp(s, cl, comm.get("tp", 0.0) / s.M, flop_at)
    cp_exp = comm.get("cp", 0.0) / (s.M * most)
    if lay.cp_mode == "ring":
        cp_exp = hide(cp_exp, s.t * (r["attn"] + redo * (lay.ckpt == "full")), tax(cl, lay, "cp"), f.credit)
    if lay.fp8 and s.code == "ours" and lay.cp > 1:  # each linear's amaxes all-reduced over cp too
        cp_exp += 14 * 2 * math.ceil(math.log2(lay.cp)) * link(cl, lay, "cp")[1]
    t_mb = s.t * (t_layer + redo)  # one layer, one microbatch
    casts = s.t * r["fp8"]  # fp8's casts of one layer, one microbatch
    t_stage = load * t_mb + most * (casts + cp_exp) + tp_mb
    chunk = max(1, math.ceil(cfg.n_layer / (lay.pp * lay.V)))  # layers per virtual stage
    P = lay.pp
    idle = {"zb1": max(P - 1, 2 * P - 1 - s.M) / 3, "zbv": max(P - 1, 3 * P - 3 - s.M) / 3}.get(lay.schedule, P - 1)
    updated = s.p_gpu / (shard_size(lay) if lay.dp_mode != "ddp" else 1)  # parameters this rank's optimizer updates
    out = {"compute": s.M * ideal * s.t * t_layer, "recompute": s.M * ideal * s.t * redo,
           "imbalance": s.M * (load - ideal) * t_mb, "bubble": idle * chunk / most * t_stage,
           "fp8": s.M * cfg.n_layer / lay.pp * casts, "tp": s.M * tp_mb, "cp": s.M * most * cp_exp, "pp": 0.0,
           "dp": 0.0, "optimizer": (s.code == "ours") * (OPT_BYTES * updated * per_byte + clip_norm(cl, lay)),
           "grads": (s.code == "ours") * landing_bytes(cl, lay, s.M) * s.p_gpu * per_byte}
    if lay.pp > 1:
        hop = seconds(cl, lay, "pp", sent["pp"][0] / sent["pp"][1], 1)  # one send: (t, d/tp under sp) activations
        out["pp"] = 2 * (lay.pp - 1) * hop + hide(comm["pp"], s.M * t_stage, tax(cl, lay, "pp"), f.credit)
    g = lay.dp * lay.cp
    buckets = math.ceil(G_B * s.p_gpu / (BUCKET_MB * 1e6))
    if g > 1 and not lay.overlap:
        out["dp"] = sum(comm.get(k, 0.0) for k in ("dp", "shard", "replica"))
    elif g > 1 and lay.dist_opt:
        out["dp"] = dist_opt_dp(cl, lay, comm["dp"], buckets, t_stage)
    elif g > 1 and lay.dp_mode == "ddp":  # under the last backward but the last bucket, which starts as it ends
        last = comm["dp"] / buckets
        out["dp"] = hide(comm["dp"] - last, t_stage * 2 / 3, tax(cl, lay, "dp")) + last
    elif g > 1 and s.code == "ours":
        out["dp"] = ours_dp(s, cl, t_stage, t_stage / load, h, gloo_rs(cl, shard_size(lay)))
    elif g > 1:  # per round (a microbatch, or the step when P > 1): under it, except one layer's share
        rounds = s.M if lay.pp == 1 else 1
        t_round = sum(comm.get(k, 0.0) for k in ("dp", "shard", "replica")) / rounds
        out["dp"] = rounds * (hide(t_round, t_stage, tax(cl, lay, "dp")) + t_round / (most + 1))
    out["total"] = sum(out.values())
    tokens = s.batch * s.seq
    out["mfu"] = flops_per_token(cfg, s.seq) * tokens / (cl.gpus * peak * out["total"])
    redone = cfg.n_layer if lay.ckpt == "full" else recomputed_layers(cfg, lay.ckpt) if lay.ckpt == "op" else 0
    out["hfu"] = flops_per_token(cfg, s.seq, redone) * tokens / (cl.gpus * peak * out["total"])
    return out


def error_bars(cfg, cl, lay, seq, batch, code, measured=()):
    """{"all": (MFU with every factor at its pessimistic end, at its optimistic end), factor: (the same, that factor
    alone)}, over factors.ranges of `code` (less the measured ones)."""
    base = cl.factors or FACTORS[code]
    spans = ranges(code, measured, lay.fp8)

    def mfu(f):
        return step_time(cfg, replace(cl, factors=f), lay, seq, batch, code)["mfu"]
    out = {"all": []}
    for end in (0, 1):
        every = base
        for name, span in spans.items():
            every = vary(every, name, span[end])
        out["all"].append(mfu(every))
    out.update({name: tuple(mfu(vary(base, name, span[end])) for end in (0, 1)) for name, span in spans.items()})
    return {k: tuple(v) for k, v in out.items()}

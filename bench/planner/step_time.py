"""Seconds per step of a layout and its MFU (notation: layout.py; bytes per group: comm.py; links and what
hiding costs: links.py; what hides under what: overlap.py; the efficiency factors: factors.py).

Bytes are in the cluster's compute dtype (--dtype: bf16; fp32 on a CPU cluster), gradients fp32. Each code is priced
with its own factors (factors.py: the reference's, or ours'), unless the cluster carries some (--factors, the
error bars' ends).

Time per step. One token through one layer on one GPU:
  6*N_layer/tp / (peak*mm * t/(t+MM_ROWS0) * R) + 12*d*T/tp / (peak*attn * K/(K+ATTN_KEYS0))
  + ELEM_BYTES*(d+f)/tp / (HBM*elem),     K = T/cp for ring CP (its key blocks), else T;
mm, attn, elem the factors; with --measured (a cluster that measured its own rates at this workload's sizes,
bench/cluster) the factors go: 6*N_layer/tp / peak + 12*d*T/tp / --attn-tflops; ELEM_BYTES counts bf16 tensors (x2
in fp32). N_layer/tp the matmul weights of a layer on one GPU (Shape.p_layer without the norms); R = the factor fp8
under fp8 (the block matmuls only), else 1; attention and the head stay bf16, and fp8's casts cost memory traffic of
their own (overlap.fp8_bytes), per micro-batch and layer on the stage ("fp8").
The optimizer's update, --code ours: OPT_BYTES per parameter the rank updates / HBM (ddp.py updates the whole
replica on every rank; the reference, Megatron's distributed optimizer or FSDP, shards it: negligible), and the
clip's blocking all-reduce of two floats over the world, 2*log2(world) latency steps. Gradients, --code ours:
landing_bytes per parameter of the stage / HBM, the copies that take each micro-batch's weight gradients into
the buffers the step reduces. Host: where the host is the device (--host-us > 0, a CPU cluster), every
dispatched op costs host_us in line, HOST_OPS_LAYER per layer and HOST_OPS_REST per micro-batch; a GPU's
kernels run while the host launches the next ones (--host-us 0), except where it waits for them (overlap.ring).
The head: 6*vocab*d/tp FLOPs + 16*vocab/tp bytes (cross-entropy). Recompute: full adds a third of the layer (its
forward), selective a third of the elementwise bytes. A stage's load in layers is max(first, middle, last + head);
per microbatch t_stage = load*t_layer + layers*(fp8 casts + TP + CP exposed), and
  step = M*t_stage + bubble + PP exposed + DP exposed,  bubble = idle * ceil(L/(P*V))/layers * t_stage,
idle = P-1 chunk forward-and-backwards; zb1 max(P-1, 2P-1-M)/3, zbv max(P-1, 3P-3-M)/3 (F = B = W, a third each:
parallel/pp_schedule.py).
Exposed communication: TP overlap.py. CP: ring is hidden under the layer's attention (and full checkpointing's
recompute of it); allgather and ulysses block. PP: the sends are asynchronous, hidden under compute except 2(P-1)
hops of fill and drain. DP: ddp's all-reduce runs under the last microbatch's backward but its last bucket
(BUCKET_MB, or the whole gradient if smaller: launched as backward ends); the reference's fsdp / hsdp per round (a
microbatch with P = 1, the step with P > 1), under that round except one layer's share; --code ours and dist_opt:
overlap.py. overlap=0 (train.py --no-overlap): every TP and DP collective blocks.
MFU = model.flops_per_token (PaLM: 6N + 12*L*d*T) * B*T / (gpus * peak * step); HFU adds the recompute.
Calibration: Llama 3 405B (Table 4) on 8k/16k H100s; tests/test_plan.py checks the predictions. bench/cluster checks
the time model against steps measured on an emulated CPU cluster, from that cluster's own measured rates.
"""
import math
from dataclasses import replace
from functools import lru_cache

from bench.planner.comm import collectives
from bench.planner.factors import FACTORS, REFERENCE
from bench.planner.layout import BUCKET_MB, G_B, Shape, shard_size
from bench.planner.links import clip_norm, gloo_rs, hide, link, members_per_node, seconds, tax
from bench.planner.overlap import TP_EXPOSED, dist_opt_dp, fp8_bytes, ours_dp, ours_tp, reference_tp, replica_chain
from model import flops_per_token

__all__ = ["ATTN_EFF", "BUS_EFF", "FP8_RATE", "HOST_OPS_LAYER", "HOST_OPS_REST", "MM_EFF", "MM_ROWS0", "OPT_BYTES",
           "OVERLAP_TAX", "TP_EXPOSED", "clip_norm", "gloo_rs", "hide", "landing_bytes", "link", "members_per_node",
           "rates", "replica_chain", "seconds", "shape_step_time", "step_time", "tax"]

MM_EFF, ATTN_EFF, BUS_EFF = REFERENCE.mm, REFERENCE.attn, REFERENCE.bus  # the reference's factors (factors.py)
OVERLAP_TAX, FP8_RATE = REFERENCE.tax, REFERENCE.fp8
MM_ROWS0 = 128       # GEMMs over t token rows lose about one 128-row tile wave: * t/(t + 128)
ATTN_KEYS0 = 512     # a kernel streaming K keys: * K/(K + 512) (short ring-CP blocks run slower)
ELEM_BYTES = 75      # HBM bytes per token per layer per unit of d+f: norms, RoPE, SwiGLU, residuals fwd+bwd
OPT_BYTES = 40       # memory bytes per parameter of an update, --code ours: the clip reads the fp32 gradient twice
#                      and writes it once, fused AdamW reads weight, gradient and both moments and writes three
HOST_OPS_LAYER = 186  # aten ops one block's forward and backward dispatch; the embedding, final norm, head and
HOST_OPS_REST = 135   # loss another 135 per micro-batch (model.py; tests/test_plan_cluster.py counts both)


def landing_bytes(cl, lay, M):
    """Memory bytes per parameter and step that take each micro-batch's fresh weight gradients to where the step
    sums them (--code ours). ddp.py: autograd adds them into the bucket views (reads both fp32, writes one).
    fsdp.py: each unit's are copied into its flat fp32 buffer (from the compute dtype), or added under
    accumulate=unsharded (one fp32 read more); on gloo the reduce-scatter copies that buffer again on the caller's
    thread, per micro-batch, or once per step under unsharded."""
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
    redo = {"none": 0.0, "selective": r["elem"] / 3, "full": t_layer / 3}[lay.ckpt]
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
    redone = cfg.n_layer if lay.ckpt == "full" else 0
    out["hfu"] = flops_per_token(cfg, s.seq, redone) * tokens / (cl.gpus * peak * out["total"])
    return out

"""Seconds per step of a layout and its MFU (notation: plan_layout.py; bytes per group: plan_comm.py).

Links. Ranks are ordered tp fastest, then cp, pp, dp (Llama 3; order=interleaved: rank r on node r % nodes, the
ablation that puts tp across nodes). A group inside one node uses NVLink (--intra-gbs, 450 GB/s per direction); a
group with k members per node drives k NICs: min(intra, k*inter), --inter-gbs 50 GB/s per GPU (400 Gb/s); gloo's
single ring crosses a node boundary on one NIC: min(intra, inter). Collectives reach BUS_EFF of that (1 with
--measured: the bandwidths are measured bus bandwidths) and pay the cluster's latency per ring step (--lat-intra-us
1, --lat-inter-us 5; g-1 steps for all-gather, reduce-scatter, all-to-all; 2*log2 g for an all-reduce, NCCL's
tree; 1 per send). On gloo a reduce-scatter takes as long as an all-reduce of its whole input: twice its ring bytes,
an all-reduce's steps.
Bytes are in the cluster's compute dtype (--dtype: bf16; fp32 on a CPU cluster), gradients fp32.

Time per step. One token through one layer on one GPU:
  6*N_layer/tp / (peak*MM_EFF * t/(t+MM_ROWS0) * R) + 12*d*T/tp / (peak*ATTN_EFF * K/(K+ATTN_KEYS0))
  + ELEM_BYTES*(d+f)/tp / HBM,     K = T/cp for ring CP (its key blocks), else T;
with --measured (a cluster that measured its own rates at this workload's sizes, bench/cluster.py) the H100's
factors go: 6*N_layer/tp / peak + 12*d*T/tp / --attn-tflops; ELEM_BYTES counts bf16 tensors (x2 in fp32).
N_layer/tp the matmul weights of a layer on one GPU (Shape.p_layer without the norms); R = FP8_RATE under fp8
(the block matmuls at Hopper's dense fp8 peak, 2x bf16's; their casts assumed fused into the neighbouring
elementwise kernels, as torch.compile does), else 1; attention and the head stay bf16.
The optimizer's update, --code ours: OPT_BYTES per parameter the rank updates / HBM (ddp.py updates the whole
replica on every rank; the reference, Megatron's distributed optimizer or FSDP, shards it: negligible), and the
clip's blocking all-reduce of two floats over the world, 2*log2(world) latency steps. Gradients, --code ours:
landing_bytes per parameter of the stage / HBM, the copies that take each micro-batch's weight gradients into
the buffers the step reduces. Host: where the host is the device (--host-us > 0, a CPU cluster), every
dispatched op costs host_us in line, HOST_OPS_LAYER per layer and HOST_OPS_REST per micro-batch; a GPU's
kernels run while the host launches the next ones (--host-us 0). The head:
6*vocab*d/tp FLOPs + 16*vocab/tp bytes (cross-entropy). Recompute: full adds a third of the layer (its
forward), selective a third of the elementwise bytes. A stage's load in layers is max(first, middle, last + head);
per microbatch t_stage = load*t_layer + layers*(TP + CP exposed), and
  step = M*t_stage + bubble + PP exposed + DP exposed,  bubble = idle * ceil(L/(P*V))/layers * t_stage,
idle = P-1 chunk forward-and-backwards; zb1 max(P-1, 2P-1-M)/3, zbv max(P-1, 3P-3-M)/3 (F = B = W, a third each:
parallel/pp_schedule.py).
Exposed communication. TP: TP_EXPOSED of the collectives block; --code ours follows parallel/tp.py: without sp
the 2 forward all-reduces of a layer block, the 2 backward ones hide under the weight-grad matmuls of q,k,v and of
gate,up (2*d*outputs/tp FLOPs per token each), lm_head's under its own; with sp every (t, d) collective of a layer
or the head is a ring of tp-1 hops under the neighbouring matmul, hide(layer's tp, (tp-1)/tp * its matmul time);
the embedding's and the loss's collectives and sp's norm-grad all-reduce block. CP: ring is hidden under the
layer's attention (and full checkpointing's recompute of it); allgather and ulysses block. PP: the sends are
asynchronous, hidden under compute except 2(P-1) hops of fill and drain. DP: ddp's all-reduce runs under the last
microbatch's backward but its last bucket (BUCKET_MB, or the whole gradient if smaller: launched as backward ends);
fsdp / hsdp per round (a microbatch with P = 1, the step
with P > 1), under that round except one layer's share; --code ours follows parallel/fsdp.py: each microbatch's
gathers and reduce-scatters under its compute (under pp: the step's one gather of a unit under the first forward,
the reduce-scatters under each backward), the first gather and the last reduce-scatter of one unit exposed; hsdp's
replica all-reduces are a chain through the last backward, each under one unit's, the last units' exposed
(replica_chain). overlap=0 (train.py --no-overlap): every TP and DP
collective blocks.
Hidden communication still costs compute: OVERLAP_TAX of its duration on NCCL (its kernels take SMs and HBM
bandwidth); on gloo a rank's own threads copy its bytes on its own cores at the loopback rate, so all of an
intra-node collective's time and intra/inter of an inter-node one's (tax()).
MFU = model.flops_per_token (PaLM: 6N + 12*L*d*T) * B*T / (gpus * peak * step); HFU adds the recompute.
Calibration: Llama 3 405B (Table 4) on 8k/16k H100s; the constants below are set from hardware facts, not
fitted per layout; tests/test_plan.py checks the predictions. bench/cluster.py checks the time model against
steps measured on an emulated CPU cluster, from that cluster's own measured rates.
"""
import math
from functools import lru_cache

from bench.plan_comm import collectives
from bench.plan_layout import BUCKET_MB, G_B, GB, Shape, shard_size
from bench.plan_ours import fsdp_parts
from model import flops_per_token
from parallel.ddp import all_reduce_bytes
from parallel.hsdp import replica_bytes
from parallel.tp import activation_collectives, loss_bytes, seq_collective_bytes

MM_EFF = 0.65        # sustained GEMM fraction of peak in training (an 8k GEMM alone ~0.8; clocks drop under load)
MM_ROWS0 = 128       # GEMMs over t token rows lose about one 128-row tile wave: * t/(t + 128)
ATTN_EFF = 0.40      # FlashAttention-2 fwd+bwd on H100 (PyTorch SDPA's flash kernel), long keys
ATTN_KEYS0 = 512     # a kernel streaming K keys: * K/(K + 512) (short ring-CP blocks run slower)
ELEM_BYTES = 75      # HBM bytes per token per layer per unit of d+f: norms, RoPE, SwiGLU, residuals fwd+bwd
BUS_EFF = 0.80       # NCCL bus bandwidth / link bandwidth (nccl-tests)
TP_EXPOSED = 0.6     # 6 of the 10 TP collectives block (4 fwd, 2 bwd); Megatron hides 4 bwd ones under GEMMs
OVERLAP_TAX = 0.25   # compute slowdown per second of hidden communication (NCCL uses ~16-32 of 132 SMs)
FP8_RATE = 2.0       # dense fp8 over dense bf16 tensor-core peak, H100/H200 SXM: 1979 / 989 TFLOP/s
OPT_BYTES = 40       # memory bytes per parameter of an update, --code ours: the clip reads the fp32 gradient twice
#                      and writes it once, fused AdamW reads weight, gradient and both moments and writes three
HOST_OPS_LAYER = 186  # aten ops one block's forward and backward dispatch; the embedding, final norm, head and
HOST_OPS_REST = 128   # loss another 128 per micro-batch (model.py; tests/test_plan_cluster.py counts both)


# ---------------------------------------------------------------- links

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
    eff = 1.0 if cl.measured else BUS_EFF
    if k == size:
        return eff * cl.intra_gbs * GB, cl.lat_intra_us * 1e-6
    nics = k if cl.backend == "nccl" else 1  # NCCL stripes a ring over the node's NICs; gloo's one ring uses one
    return eff * min(cl.intra_gbs, nics * cl.inter_gbs) * GB, cl.lat_inter_us * 1e-6


def seconds(cl, lay, group, nbytes, steps):
    """Time for one rank of `group` to send `nbytes` in `steps` dependent ring steps."""
    bw, lat = link(cl, lay, group)
    return nbytes / bw + steps * lat


def tax(cl, lay, group):
    """Compute lost per second of `group`'s communication hidden under it. NCCL: OVERLAP_TAX (its kernels take SMs).
    gloo: a rank's own threads copy its bytes, at the loopback rate, on its own cores: all of a collective inside
    a node, the loopback's share of one whose wire is slower."""
    if cl.backend == "nccl":
        return OVERLAP_TAX
    return min(1.0, link(cl, lay, group)[0] / (cl.intra_gbs * GB * (1.0 if cl.measured else BUS_EFF)))


# ---------------------------------------------------------------- time

def hide(t_comm, window, lost=OVERLAP_TAX):
    """Exposed seconds of communication overlapped with `window` seconds of compute, `lost` per second hidden."""
    return max(t_comm - window, 0.0) + lost * min(t_comm, window)


def gloo_rs(cl, S):
    """(bytes on the wire, ring steps) of a reduce-scatter over S ranks, each over its ring terms': on gloo, whose
    reduce-scatter is an all-reduce of its whole input, 2 and an all-reduce's 2*log2 S steps over S-1
    (bench/results/cluster.md: at half the ring bytes, half the bus bandwidth; its smallest as slow as an
    all-reduce's); else 1, 1."""
    return (2, 2 * math.ceil(math.log2(S)) / (S - 1)) if cl.backend == "gloo" and S > 1 else (1, 1)


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


def clip_norm(cl, lay):
    """The clip's all-reduce of two floats over the world, blocking, once per step (optim.global_grad_norm): 2*log2
    of the world latency steps, over the network once the world spans nodes."""
    world = lay.tp * lay.cp * lay.pp * lay.dp
    lat = cl.lat_intra_us if world <= cl.gpus_per_node else cl.lat_inter_us
    return 2 * math.ceil(math.log2(world)) * lat * 1e-6


def ours_tp(s, cl, flop):
    """Exposed TP seconds per microbatch on the busiest stage, --code ours (parallel/tp.py, tp_overlap.py); flop:
    seconds per matmul FLOP of t rows on one GPU."""
    cfg, lay, d, t, tp = s.cfg, s.lay, s.cfg.d_model, s.t, s.lay.tp
    unit = seconds(cl, lay, "tp", seq_collective_bytes(t, d, tp, cl.dtype_bytes), tp - 1)  # a (t, d) gather or RS
    n = activation_collectives(1, False, False, lay.sp, lay.ckpt == "full")  # per layer; an all-reduce is 2
    lost = tax(cl, lay, "tp")
    block = flop / (FP8_RATE if lay.fp8 else 1.0)  # seconds per block-matmul FLOP
    head_units, mm = 2 + lay.sp, 6 * (s.p_layer - 2 * d) * (1 + (lay.ckpt == "full") / 3) * t * block
    if not lay.overlap:
        layer, head = n * unit, head_units * unit
    elif lay.sp:  # rings: each hop under a 1/tp chunk of the matmul next to it
        hidden = (tp - 1) / tp
        layer = hide(n * unit, hidden * mm, lost)
        head = hide(head_units * unit, hidden * 6 * s.p_embed * t * flop, lost)
    else:  # forward (and recompute) all-reduces block, backward ones run under the weight-grad matmuls
        qkv = 2 * d * (cfg.n_head * cfg.head_dim / tp + 2 * cfg.head_dim * s.kv_local) * t * block
        gate_up = 2 * d * 2 * cfg.ffn_dim / tp * t * block
        layer = (n - 4) * unit + hide(2 * unit, qkv, lost) + hide(2 * unit, gate_up, lost)
        head = hide(2 * unit, 2 * s.p_embed * t * flop, lost)
    loss = seconds(cl, lay, "tp", loss_bytes(t, tp), tp - 1)
    worst = 0.0
    for layers, _, embed, has_head, _ in s.stages():
        norms = seconds(cl, lay, "tp", all_reduce_bytes(d * (2 * layers + has_head), tp, G_B),
                        2 * math.ceil(math.log2(tp))) * lay.sp / s.M  # once per step
        worst = max(worst, layers * layer + embed * 2 * unit + has_head * (head + loss) + norms)
    return worst


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


def ours_dp(s, cl, t_stage, t_layer, h):
    """Exposed FSDP/HSDP seconds per step on the busiest stage, --code ours with overlap (parallel/fsdp.py, hsdp.py);
    t_layer: one layer's seconds per microbatch, h: the head in layers."""
    lay, M, worst = s.lay, s.M, 0.0
    for layers, params, embed, head, _ in s.stages():
        parts, units = fsdp_parts(s, layers, params, embed, head, w_bytes=cl.dtype_bytes)
        (gb, gs), (rb, rs) = parts["gather"], parts["reduce"]
        group = "dp" if lay.dp_mode == "fsdp" else "shard"
        lost = tax(cl, lay, group)
        wire, steps = gloo_rs(cl, shard_size(lay))
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


def step_time(cfg, cl, lay, seq, batch, code="reference"):
    """Predicted seconds per step by component (compute, recompute, imbalance, bubble, tp, cp, pp, dp),
    plus "total", "mfu" and "hfu"."""
    return shape_step_time(Shape(cfg, lay, seq, batch, code), cl)


def shape_step_time(s, cl):
    """step_time() of a Shape."""
    cfg, lay, d, tp, most = s.cfg, s.lay, s.cfg.d_model, s.lay.tp, s.most
    peak, hbm = cl.peak_tflops * 1e12, cl.hbm_tbs * 1e12
    keys = s.seq / lay.cp if lay.cp_mode == "ring" else s.seq
    if cl.measured:  # rates measured at this workload's sizes: seconds per FLOP as they are
        flop = head_flop = 1 / peak
        attn = 12 * d * s.seq / tp / (cl.attn_tflops * 1e12)
    else:
        flop = 1 / (peak * MM_EFF * s.t / (s.t + MM_ROWS0))  # seconds per matmul FLOP over t rows
        head_flop = 1 / (peak * MM_EFF)
        attn = 12 * d * s.seq / tp / (peak * ATTN_EFF * keys / (keys + ATTN_KEYS0))
    mm = 6 * (s.p_layer - 2 * d) * flop / (FP8_RATE if lay.fp8 else 1.0)
    elem = ELEM_BYTES * cl.dtype_bytes / 2 * (d + cfg.ffn_dim) / tp / hbm  # ELEM_BYTES: of bf16 tensors
    host = cl.host_us * 1e-6 / s.t  # seconds per token for each op the host dispatches in line (a CPU device)
    t_layer = mm + attn + elem + HOST_OPS_LAYER * host  # seconds per token per layer on one GPU
    redo = {"none": 0.0, "selective": elem / 3, "full": t_layer / 3}[lay.ckpt]
    t_head = 6 * s.p_embed * head_flop + 16 * cfg.padded_vocab / tp / hbm + HOST_OPS_REST * host
    h = t_head / (t_layer + redo)  # the head in layers
    first, _, last = s.layers
    load = max(first, most, last + h) if lay.pp > 1 else first + h
    ideal = (cfg.n_layer + h) / lay.pp
    sent = collectives(s, cl.dtype_bytes, G_B, cl.dtype_bytes)
    comm = {k: seconds(cl, lay, k, *v) for k, v in sent.items()}
    if s.code == "ours" and tp > 1:  # per microbatch, the busiest stage
        tp_mb = ours_tp(s, cl, flop)
    else:
        tp_mb = (TP_EXPOSED if lay.overlap else 1.0) * comm.get("tp", 0.0) / s.M
    cp_exp = comm.get("cp", 0.0) / (s.M * most)
    if lay.cp_mode == "ring":
        cp_exp = hide(cp_exp, s.t * (attn + redo * (lay.ckpt == "full")), tax(cl, lay, "cp"))
    t_mb = s.t * (t_layer + redo)  # one layer, one microbatch
    t_stage = load * t_mb + most * cp_exp + tp_mb
    chunk = max(1, math.ceil(cfg.n_layer / (lay.pp * lay.V)))  # layers per virtual stage
    P = lay.pp
    idle = {"zb1": max(P - 1, 2 * P - 1 - s.M) / 3, "zbv": max(P - 1, 3 * P - 3 - s.M) / 3}.get(lay.schedule, P - 1)
    updated = s.p_gpu / (shard_size(lay) if lay.dp_mode != "ddp" else 1)  # parameters this rank's optimizer updates
    out = {"compute": s.M * ideal * s.t * t_layer, "recompute": s.M * ideal * s.t * redo,
           "imbalance": s.M * (load - ideal) * t_mb, "bubble": idle * chunk / most * t_stage,
           "tp": s.M * tp_mb, "cp": s.M * most * cp_exp, "pp": 0.0, "dp": 0.0,
           "optimizer": (s.code == "ours") * (OPT_BYTES * updated / hbm + clip_norm(cl, lay)),
           "grads": (s.code == "ours") * landing_bytes(cl, lay, s.M) * s.p_gpu / hbm}
    if lay.pp > 1:
        hop = seconds(cl, lay, "pp", sent["pp"][0] / sent["pp"][1], 1)  # one send: (t, d/tp under sp) activations
        out["pp"] = 2 * (lay.pp - 1) * hop + hide(comm["pp"], s.M * t_stage, tax(cl, lay, "pp"))
    g = lay.dp * lay.cp
    if g > 1 and not lay.overlap:
        out["dp"] = sum(comm.get(k, 0.0) for k in ("dp", "shard", "replica"))
    elif g > 1 and lay.dp_mode == "ddp":  # under the last backward but the last bucket, which starts as it ends
        last = comm["dp"] / math.ceil(G_B * s.p_gpu / (BUCKET_MB * 1e6))
        out["dp"] = hide(comm["dp"] - last, t_stage * 2 / 3, tax(cl, lay, "dp")) + last
    elif g > 1 and s.code == "ours":
        out["dp"] = ours_dp(s, cl, t_stage, t_stage / load, h)
    elif g > 1:  # per round (a microbatch, or the step when P > 1): under it, except one layer's share
        rounds = s.M if lay.pp == 1 else 1
        t_round = sum(comm.get(k, 0.0) for k in ("dp", "shard", "replica")) / rounds
        out["dp"] = rounds * (hide(t_round, t_stage) + t_round / (most + 1))
    out["total"] = sum(out.values())
    tokens = s.batch * s.seq
    out["mfu"] = flops_per_token(cfg, s.seq) * tokens / (cl.gpus * peak * out["total"])
    redone = cfg.n_layer if lay.ckpt == "full" else 0
    out["hfu"] = flops_per_token(cfg, s.seq, redone) * tokens / (cl.gpus * peak * out["total"])
    return out

"""Seconds per step of a layout and its MFU (notation: plan_layout.py; bytes per group: plan_comm.py).

Links. Ranks are ordered tp fastest, then cp, pp, dp (Llama 3). A group inside one node uses NVLink
(--intra-gbs, 450 GB/s per direction); a group with k members per node drives k NICs:
min(intra, k*inter), --inter-gbs 50 GB/s per GPU (400 Gb/s). Collectives reach BUS_EFF of that and pay a
latency per ring step (g-1 for all-gather, reduce-scatter, all-to-all; 2*log2 g for an all-reduce,
NCCL's tree; 1 per send).

Time per step. One token through one layer on one GPU:
  6*N_layer/tp / (peak*MM_EFF * t/(t+MM_ROWS0)) + 12*d*T/tp / (peak*ATTN_EFF * K/(K+ATTN_KEYS0))
  + ELEM_BYTES*(d+f)/tp / HBM,     K = T/cp for ring CP (its key blocks), else T;
N_layer/tp the matmul weights of a layer on one GPU (Shape.p_layer without the norms). The head:
6*vocab*d/tp FLOPs + 16*vocab/tp bytes (cross-entropy). Recompute: full adds a third of the layer (its
forward), selective a third of the elementwise bytes. A stage's load in layers is max(first, middle, last + head);
per microbatch t_stage = load*t_layer + layers*(TP + CP exposed), and
  step = M*t_stage + bubble + PP exposed + DP exposed,  bubble = (P-1) * ceil(L/(P*V))/layers * t_stage.
Exposed communication. TP: TP_EXPOSED of the collectives block (--code ours: every one). CP: ring is hidden
under the layer's attention (and full checkpointing's recompute of it); allgather and ulysses block. PP: the
sends are asynchronous, hidden under compute except 2(P-1) hops of fill and drain. DP: ddp's all-reduce runs
under the last microbatch's backward, one BUCKET_MB bucket left over; fsdp / hsdp per round (a microbatch with
P = 1 or --code ours; the step with P > 1), under that round except one layer's share.
Hidden communication still costs OVERLAP_TAX of its duration (NCCL kernels take SMs and HBM bandwidth).
MFU = model.flops_per_token (PaLM: 6N + 12*L*d*T) * B*T / (gpus * peak * step); HFU adds the recompute.
Calibration: Llama 3 405B (Table 4) on 8k/16k H100s; the constants below are set from hardware facts, not
fitted per layout; tests/test_plan.py checks the predictions.
"""
import math
from functools import lru_cache

from bench.plan_comm import collectives
from bench.plan_layout import BUCKET_MB, GB, Shape, shard_size
from model import flops_per_token

MM_EFF = 0.65        # sustained GEMM fraction of peak in training (an 8k GEMM alone ~0.8; clocks drop under load)
MM_ROWS0 = 128       # GEMMs over t token rows lose about one 128-row tile wave: * t/(t + 128)
ATTN_EFF = 0.40      # FlashAttention-2 fwd+bwd on H100 (PyTorch SDPA's flash kernel), long keys
ATTN_KEYS0 = 512     # a kernel streaming K keys: * K/(K + 512) (short ring-CP blocks run slower)
ELEM_BYTES = 75      # HBM bytes per token per layer per unit of d+f: norms, RoPE, SwiGLU, residuals fwd+bwd
BUS_EFF = 0.80       # NCCL bus bandwidth / link bandwidth (nccl-tests)
LAT_INTRA, LAT_INTER = 1e-6, 5e-6  # seconds per ring step over NVLink, over the network
TP_EXPOSED = 0.6     # 6 of the 10 TP collectives block (4 fwd, 2 bwd); Megatron hides 4 bwd ones under GEMMs
OVERLAP_TAX = 0.25   # compute slowdown per second of hidden communication (NCCL uses ~16-32 of 132 SMs)


# ---------------------------------------------------------------- links

@lru_cache(maxsize=None)
def members_per_node(gpus_per_node, tp, cp, pp, dp, S, group):
    """How many members of rank 0's `group` (tp, cp, pp, dp = dp x cp, shard, replica) share its node."""
    def key(r):  # rank -> (tp, cp, pp, dp) coordinates, tp fastest; equal keys share a group
        t, r = r % tp, r // tp
        c, r = r % cp, r // cp
        p, d = r % pp, r // pp
        pos = c + cp * d  # position in the dp x cp group
        return {"tp": (c, p, d), "cp": (t, p, d), "pp": (t, c, d), "dp": (t, p),
                "shard": (t, p, pos // S), "replica": (t, p, pos % S)}[group]
    return sum(key(r) == key(0) for r in range(min(gpus_per_node, tp * cp * pp * dp)))


def seconds(cl, lay, group, nbytes, steps):
    """Time for one rank of `group` to send `nbytes` in `steps` dependent ring steps."""
    S = shard_size(lay)
    size = {"tp": lay.tp, "cp": lay.cp, "pp": lay.pp, "dp": lay.dp * lay.cp, "shard": S,
            "replica": lay.dp * lay.cp // S}[group]
    k = members_per_node(cl.gpus_per_node, lay.tp, lay.cp, lay.pp, lay.dp, S, group)
    if k == size:
        return nbytes / (BUS_EFF * cl.intra_gbs * GB) + steps * LAT_INTRA
    return nbytes / (BUS_EFF * min(cl.intra_gbs, k * cl.inter_gbs) * GB) + steps * LAT_INTER


# ---------------------------------------------------------------- time

def hide(t_comm, window):
    """Exposed seconds of communication overlapped with `window` seconds of compute."""
    return max(t_comm - window, 0.0) + OVERLAP_TAX * min(t_comm, window)


def step_time(cfg, cl, lay, seq, batch, code="reference"):
    """Predicted seconds per step by component (compute, recompute, imbalance, bubble, tp, cp, pp, dp),
    plus "total", "mfu" and "hfu"."""
    return shape_step_time(Shape(cfg, lay, seq, batch, code), cl)


def shape_step_time(s, cl):
    """step_time() of a Shape."""
    cfg, lay, d, tp, most = s.cfg, s.lay, s.cfg.d_model, s.lay.tp, s.most
    peak, hbm = cl.peak_tflops * 1e12, cl.hbm_tbs * 1e12
    keys = s.seq / lay.cp if lay.cp_mode == "ring" else s.seq
    mm = 6 * (s.p_layer - 2 * d) / (peak * MM_EFF * s.t / (s.t + MM_ROWS0))
    attn = 12 * d * s.seq / tp / (peak * ATTN_EFF * keys / (keys + ATTN_KEYS0))
    elem = ELEM_BYTES * (d + cfg.ffn_dim) / tp / hbm
    t_layer = mm + attn + elem  # seconds per token per layer on one GPU
    redo = {"none": 0.0, "selective": elem / 3, "full": t_layer / 3}[lay.ckpt]
    t_head = 6 * s.p_embed / (peak * MM_EFF) + 16 * cfg.padded_vocab / tp / hbm
    h = t_head / (t_layer + redo)  # the head in layers
    first, _, last = s.layers
    load = max(first, most, last + h) if lay.pp > 1 else first + h
    ideal = (cfg.n_layer + h) / lay.pp
    sent = collectives(s)
    comm = {k: seconds(cl, lay, k, *v) for k, v in sent.items()}
    exposed = TP_EXPOSED if s.code == "reference" else 1.0  # parallel/tp.py overlaps none of its collectives
    tp_exp = exposed * comm.get("tp", 0.0) / (s.M * most)  # per layer per microbatch
    cp_exp = comm.get("cp", 0.0) / (s.M * most)
    if lay.cp_mode == "ring":
        cp_exp = hide(cp_exp, s.t * (attn + redo * (lay.ckpt == "full")))
    t_mb = s.t * (t_layer + redo)  # one layer, one microbatch
    t_stage = load * t_mb + most * (tp_exp + cp_exp)
    chunk = max(1, math.ceil(cfg.n_layer / (lay.pp * lay.V)))  # layers per virtual stage
    out = {"compute": s.M * ideal * s.t * t_layer, "recompute": s.M * ideal * s.t * redo,
           "imbalance": s.M * (load - ideal) * t_mb, "bubble": (lay.pp - 1) * chunk / most * t_stage,
           "tp": s.M * most * tp_exp, "cp": s.M * most * cp_exp, "pp": 0.0, "dp": 0.0}
    if lay.pp > 1:
        hop = seconds(cl, lay, "pp", sent["pp"][0] / sent["pp"][1], 1)  # one send: (t, d/tp under sp) activations
        out["pp"] = 2 * (lay.pp - 1) * hop + hide(comm["pp"], s.M * t_stage)
    g = lay.dp * lay.cp
    if g > 1 and lay.dp_mode == "ddp":  # under the last backward; the last bucket after it
        bucket = seconds(cl, lay, "dp", 2 * (g - 1) / g * BUCKET_MB * 1e6, 2 * math.ceil(math.log2(g)))
        out["dp"] = hide(comm["dp"], t_stage * 2 / 3) + bucket
    elif g > 1:  # per round (a microbatch, or the step when P > 1): under it, except one layer's share
        rounds = s.M if lay.pp == 1 or s.code == "ours" else 1  # ours gathers every microbatch under pp too
        t_round = sum(comm.get(k, 0.0) for k in ("dp", "shard", "replica")) / rounds
        out["dp"] = rounds * (hide(t_round, t_stage) + t_round / (most + 1))
    out["total"] = sum(out.values())
    tokens = s.batch * s.seq
    out["mfu"] = flops_per_token(cfg, s.seq) * tokens / (cl.gpus * peak * out["total"])
    redone = cfg.n_layer if lay.ckpt == "full" else 0
    out["hfu"] = flops_per_token(cfg, s.seq, redone) * tokens / (cl.gpus * peak * out["total"])
    return out

"""The 4D layout planner: which dp x cp x pp x tp layout trains a model fastest on a given cluster?

    python bench/plan.py --model llama3-405b --gpus 16384 --seq-len 131072
    python bench/plan.py --model llama3-405b --gpus 8192 --layout dp=64,tp=8,pp=16,dp_mode=fsdp,V=8
    python bench/plan.py --model llama3-8b --gpus 64 --compare-fsdp-scope        # L15

Closed formulas, no simulation. L layers, d width, f ffn width, a / kv heads, hd head dim, T sequence,
b micro-batch (sequences), t = b*T/cp tokens per microbatch per GPU, B global batch (sequences),
M = B/(dp*b) microbatches, P = pp, V virtual stages, g = dp*cp (CP ranks hold the same weights and see
other tokens, so gradients are reduced over dp x cp), S shard group (ddp 1, fsdp g, hsdp --shard),
R = g/S replicas, kv_local = kv/tp (1 when tp > kv: replicated).

Links. Ranks are ordered tp fastest, then cp, pp, dp (Llama 3). A group inside one node uses NVLink
(--intra-gbs, 450 GB/s per direction); a group with k members per node drives k NICs:
min(intra, k*inter), --inter-gbs 50 GB/s per GPU (400 Gb/s). Collectives reach BUS_EFF of that and pay a
latency per ring step (g-1 for all-gather, reduce-scatter, all-to-all; 2*log2 g for an all-reduce,
NCCL's tree; 1 per send). Bytes sent per rank, ring terms: all-reduce 2(g-1)/g*N, all-gather and
reduce-scatter (g-1)/g*N (N the full buffer), all-to-all (g-1)/g*N, send N.

Memory per GPU, the fuller of the first and last pipeline stage. Stages hold L/P layers; the first and
last take one fewer when P does not divide L (Llama 3), the first adds the embedding, the last the head;
all / tp. Bytes/param: bf16 weights 2, fp32 master 4, fp32 grads 4, Adam 8. ddp replicates all.
fsdp/hsdp shard master + Adam over S; with P = 1 also weights and grads (ZeRO-3) plus two gathered layers
of weights and one of grads; with P > 1 a stage runs many microbatches interleaved, so its weights stay
gathered and its grads unsharded for the step (Llama 3: no reshard after forward).
Activations per layer per token (bf16; flash attention has no T^2 term; the SwiGLU/GQA form of
Korthikanti et al.'s 34*s*b*h): none (12d + 6f)/tp + 4*hd*kv_local [x, norm, q, out, x2, norm, gate, up,
silu*up; k, v]; selective recomputes both norms and silu*up: (8d + 4f)/tp + 4*hd*kv_local; full keeps
2d/tp plus one layer's "none" set. Times t tokens and the microbatches in flight on stage 0: gpipe M,
1f1b min(M, P), interleaved min(M, P + (P-1)/V); the last stage holds 1 (gpipe M) plus logits
6*t*vocab/tp (bf16 + fp32). Plus OVERHEAD_GB and FRAG of the rest.

Time per step. One token through one layer on one GPU:
  6*N_layer/tp / (peak*MM_EFF * t/(t+MM_ROWS0)) + 12*d*T/tp / (peak*ATTN_EFF * K/(K+ATTN_KEYS0))
  + ELEM_BYTES*(d+f)/tp / HBM,     K = T/cp for ring CP (its key blocks), else T;
the head: 6*vocab*d/tp FLOPs + 16*vocab/tp bytes (cross-entropy). Recompute: full adds a third of the
layer (its forward), selective a third of the elementwise bytes. A stage's load in layers is
max(first, middle, last + head); per microbatch t_stage = load*t_layer + layers*(TP + CP exposed), and
  step = M*t_stage + bubble + PP exposed + DP exposed,  bubble = (P-1) * ceil(L/(P*V))/layers * t_stage.
TP, sequence parallel: 10 all-gathers/reduce-scatters of t*d*2 B per layer (4 fwd, 4 bwd, 2 re-gathers
of inputs for weight grads; full ckpt 12), plus 3 per microbatch for the embedding and head (a stage
with one of them: 2); TP_EXPOSED of them block.
CP per layer: ring passes K,V (cp-1) times in fwd and K,V,dK,dV in bwd: 3*(cp-1)*4*hd*kv_local*t bytes,
hidden under the layer's attention; allgather (Llama 3) all-gathers K,V and reduce-scatters dK,dV, 2/3 of
that, blocking; ulysses all-to-alls q,k,v and out, fwd and bwd:
2*(cp-1)/cp * t*hd*2*(2a/tp + 2*max(kv_local, cp)) bytes, blocking.
PP: each of a rank's V chunks sends its activation forward and a gradient back, t*d*2/tp bytes
(SP-sharded) per microbatch (2V sends; 2V-1 when P = 2), asynchronously: hidden under compute except
2(P-1) hops of fill and drain. Layers per chunk ceil(L/(P*V)); P*V <= L + 2 (embedding and head may
take a layer's slot, Llama 3).
DP: ddp all-reduces fp32 grads once per step, 2(g-1)/g*4*P_gpu, under the last microbatch's backward,
one BUCKET_MB bucket left over. fsdp with P = 1: per microbatch all-gathers bf16 weights for fwd and bwd
and reduce-scatters fp32 grads, (2+2+4)(S-1)/S*P_gpu, under that microbatch except one layer's share;
with P > 1 one gather and one reduce-scatter per step. hsdp adds the replicas' all-reduce 2(R-1)/R*4*P_gpu/S.
Hidden communication still costs OVERLAP_TAX of its duration (NCCL kernels take SMs and HBM bandwidth).
MFU = model.flops_per_token (PaLM: 6N + 12*L*d*T) * B*T / (gpus * peak * step); HFU adds the recompute.

Whose code (--code). The formulas above ("reference", the default) describe the implementation Llama 3
and Megatron-LM report, the one the calibration above is for. "ours" describes this repository's parallel/*.py,
and tests/test_plan_measured.py holds it to fp32 CPU runs: bytes equal to the comm counters per group, memory
within 15% of the bytes allocated. It differs: TP sends 8 (t, d) collectives per layer (sp: 10, as the
reference; a recomputed block repeats 2, under sp 3), 2 each for the embedding and the head (sp: 3), the loss
all-gathers 2 fp32 per token, and sp norms all-reduce their grads once per step; every
TP collective blocks. Ring CP's backward adds cp hops of the fp32 dK,dV accumulators; recomputation repeats
the forward's CP traffic. PP adds a 48-byte shape broadcast. FSDP under pp gathers each unit once per step and
keeps it to the last backward (as the reference), reduces once per step, and holds the unsharded fp32 grads
while accumulating, then one unit's flat gradient and the previous unit's send in flight; DDP copies two
buckets at a time.
Activations per layer per token, x = 4d/tp under sp (else 4d): the residual stream and norms in fp32, 2(2x + a*d), plus
a*(5d/tp + 4f/tp) (K and V repeated to every head; the attention output re-laid for o_proj); ring attention
keeps its own K,V instead (3d/tp + 2*hd*kv_local), allgather the whole sequence's ((3 + 2cp)d/tp). The head's
rank keeps fp32 log-probs. Peak = model state + the fullest moment of the step: all of them hold the activations
in flight and the earlier microbatches' grads, plus the loss's backward (two more (t, V/tp) fp32 buffers), or the
head's backward (fsdp gathers its unit again), or a block's backward (three (t, f/tp) activation grads, the
recompute; fsdp: the gathered units and their grads before the reduce-scatter), or instead the end of backward
(ddp: all grads and two buckets' copies; fsdp: the shards and the units being reduced). At 405B this puts Llama 3's
published layouts at 28-34% MFU with our code (full checkpointing to fit; every TP collective blocks).

Search: tp (inside a node), cp, micro-batch (<= 16) and hsdp shards are powers of two, pp any divisor, V
powers of two; hsdp shards smaller than a node's share of the dp x cp group and cp shards under 1024
tokens are skipped; per layout the lightest checkpointing that fits is kept (more recompute is never
faster), and a micro-batch that fits with no policy stops the larger ones. The table shows the best layout of
each dp x tp x pp x cp mesh. Calibration: Llama 3 405B (Table 4) on 8k/16k H100s, the constants above
are set from hardware facts, not fitted per layout; tests/test_plan.py checks the predictions.
"""
import argparse
import math
import sys
import time
from dataclasses import dataclass, fields, replace
from functools import lru_cache
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from model import PRESETS, flops_per_token, param_counts  # noqa: E402

MM_EFF = 0.65        # sustained GEMM fraction of peak in training (an 8k GEMM alone ~0.8; clocks drop under load)
MM_ROWS0 = 128       # GEMMs over t token rows lose about one 128-row tile wave: * t/(t + 128)
ATTN_EFF = 0.40      # FlashAttention-2 fwd+bwd on H100 (PyTorch SDPA's flash kernel), long keys
ATTN_KEYS0 = 512     # a kernel streaming K keys: * K/(K + 512) (short ring-CP blocks run slower)
ELEM_BYTES = 75      # HBM bytes per token per layer per unit of d+f: norms, RoPE, SwiGLU, residuals fwd+bwd
BUS_EFF = 0.80       # NCCL bus bandwidth / link bandwidth (nccl-tests)
LAT_INTRA, LAT_INTER = 1e-6, 5e-6  # seconds per ring step over NVLink, over the network
TP_EXPOSED = 0.6     # 6 of the 10 TP collectives block (4 fwd, 2 bwd); Megatron hides 4 bwd ones under GEMMs
OVERLAP_TAX = 0.25   # compute slowdown per second of hidden communication (NCCL uses ~16-32 of 132 SMs)
BUCKET_MB = 25       # DDP bucket (PyTorch's default)
OVERHEAD_GB = 4.0    # CUDA context, NCCL buffers, cuBLAS workspaces
FRAG = 0.05          # caching-allocator fragmentation: reserved exceeds allocated by ~5%
W_B, G_B, MASTER_B, ADAM_B, ACT_B = 2, 4, 4, 8, 2  # bytes: bf16 weights, fp32 grads, fp32 master, Adam, bf16
GB = 1e9


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int = 8
    hbm_gb: float = 80.0
    peak_tflops: float = 989.0  # dense bf16, H100 SXM
    intra_gbs: float = 450.0    # NVLink 4, per direction per GPU
    inter_gbs: float = 50.0     # one 400 Gb/s NIC per GPU
    hbm_tbs: float = 3.35       # HBM3, H100 SXM


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp_mode: str = "ddp"    # ddp | fsdp | hsdp
    shard: int = 0          # hsdp shard-group size
    micro: int = 1          # sequences per microbatch
    ckpt: str = "none"      # none | selective | full
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved
    V: int = 1              # virtual stages per rank (interleaved)
    cp_mode: str = "ring"   # ring | ulysses | allgather
    sp: bool = True         # sequence parallel with tp (train.py --sp)

    def __str__(self):
        s = f"dp={self.dp},tp={self.tp},pp={self.pp},cp={self.cp},dp_mode={self.dp_mode}"
        s += f",shard={self.shard}" if self.dp_mode == "hsdp" else ""
        s += f",micro={self.micro},ckpt={self.ckpt}"
        s += f",schedule={self.schedule},V={self.V}" if self.pp > 1 else ""
        s += ",sp=0" if self.tp > 1 and not self.sp else ""
        return s + (f",cp_mode={self.cp_mode}" if self.cp > 1 else "")


def parse_layout(text):
    """'dp=64,tp=8,pp=16,dp_mode=fsdp,V=8' -> Layout; unnamed fields keep their defaults, and V > 1
    implies schedule=interleaved. Booleans: sp=0 or sp=1."""
    kinds = {f.name: type(f.default) for f in fields(Layout)}
    kinds["sp"] = lambda v: v.lower() in ("1", "true", "yes", "on")
    kv = dict(item.split("=", 1) for item in text.replace(" ", "").split(",") if item)
    if set(kv) - set(kinds):
        raise ValueError(f"unknown layout keys {sorted(set(kv) - set(kinds))}; known: {sorted(kinds)}")
    if int(kv.get("V", 1)) > 1:
        kv.setdefault("schedule", "interleaved")
    return Layout(**{k: kinds[k](v) for k, v in kv.items()})


def shard_size(lay):
    return {"ddp": 1, "fsdp": lay.dp * lay.cp, "hsdp": lay.shard}.get(lay.dp_mode, 1)


def invalid(cfg, cl, lay, seq, batch):
    """Why this layout cannot run (one line), or None."""
    world, g = lay.dp * lay.tp * lay.pp * lay.cp, lay.dp * lay.cp
    for bad, why in [
        (world != cl.gpus, f"dp*tp*pp*cp = {world} != {cl.gpus} gpus"),
        (cl.gpus_per_node % lay.tp or cfg.n_head % lay.tp, "tp must divide the gpus per node and the heads"),
        (cfg.n_kv_head % lay.tp and lay.tp % cfg.n_kv_head, "kv heads and tp must divide one another"),
        (seq % (2 * lay.cp), "the sequence length must be divisible by 2*cp"),
        (lay.sp and seq % (lay.cp * lay.tp), "sequence parallel needs the sequence length divisible by cp*tp"),
        (lay.cp_mode == "ulysses" and cfg.n_head % (lay.tp * lay.cp), "ulysses needs heads % (tp*cp) == 0"),
        (batch % (lay.dp * lay.micro), f"the global batch ({batch}) is not divisible by dp*micro"),
        (lay.pp * lay.V > cfg.n_layer + 2 * (lay.pp > 1), "more pipeline chunks than layers (+ embedding, head)"),
        (lay.pp > 1 and batch // (lay.dp * lay.micro) < lay.pp, "fewer microbatches than pipeline stages"),
        ((lay.schedule == "interleaved") != (lay.V > 1 and lay.pp > 1), "V > 1 iff interleaved with pp > 1"),
        (lay.dp_mode == "hsdp" and not (1 < lay.shard < g and g % lay.shard == 0), "hsdp: shard in (1, dp*cp)"),
        (lay.dp_mode not in ("ddp", "fsdp", "hsdp"), "dp_mode: ddp | fsdp | hsdp"),
        (lay.ckpt not in ("none", "selective", "full"), "ckpt: none | selective | full"),
        (lay.schedule not in ("gpipe", "1f1b", "interleaved"), "schedule: gpipe | 1f1b | interleaved"),
        (lay.cp_mode not in ("ring", "ulysses", "allgather"), "cp_mode: ring | ulysses | allgather"),
    ]:
        if bad:
            return why
    return None


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


# ---------------------------------------------------------------- sizes, bytes, memory

def stage_layers(n_layer, pp):
    """(first, most, last): layers on the first, the fullest and the last pipeline stage."""
    q, r = divmod(n_layer, pp)
    if pp == 1 or r == 0:
        return q, q, q
    return (q if pp - r >= 2 else q + 1), q + 1, q


CODES = ("reference", "ours")  # whose implementation the byte and memory formulas describe (module docstring)


@dataclass
class Shape:
    """Per-GPU sizes of one layout, shared by the byte, memory and time formulas."""
    cfg: object
    lay: Layout
    seq: int
    batch: int
    code: str = "reference"

    def __post_init__(self):
        cfg, lay = self.cfg, self.lay
        if self.code not in CODES:
            raise ValueError(f"code: {' | '.join(CODES)}, got {self.code!r}")
        d, tp = cfg.d_model, lay.tp
        self.M = self.batch // (lay.dp * lay.micro)
        self.t = lay.micro * self.seq / lay.cp  # tokens per microbatch per GPU
        self.kv_local = cfg.n_kv_head / tp if cfg.n_kv_head % tp == 0 else 1
        self.p_layer = d * cfg.head_dim * (2 * cfg.n_head / tp + 2 * self.kv_local) + 3 * d * cfg.ffn_dim / tp + 2 * d
        self.p_embed = cfg.padded_vocab * d / tp  # the embedding, and likewise the head
        self.layers = first, self.most, last = stage_layers(cfg.n_layer, lay.pp)
        if lay.pp == 1:  # params on the first and last stage (the head's stage has the final norm)
            self.p_first = self.p_last = cfg.n_layer * self.p_layer + 2 * self.p_embed + d
        else:
            self.p_first, self.p_last = first * self.p_layer + self.p_embed, last * self.p_layer + self.p_embed + d
        self.p_gpu = max(self.p_first, self.p_last)

    def stages(self):
        """(layers, params, has the embedding, has the head, pipeline sends per microbatch) of the ranks that
        bound the per-rank numbers: the first, the last and (P > 2) a middle pipeline rank; one rank without pp."""
        (first, most, last), P, V = self.layers, self.lay.pp, self.lay.V
        if P == 1:
            return [(first, self.p_first, True, True, 0)]
        ends = [(first, self.p_first, True, False, 2 * V - 1), (last, self.p_last, False, True, 2 * V - 1)]
        return ends + [(most, most * self.p_layer, False, False, 2 * V)] * (P > 2)


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
    if g > 1 and lay.dp_mode == "ddp":
        buckets = math.ceil(g_bytes * s.p_gpu / (BUCKET_MB * 1e6))
        out["dp"] = (2 * (g - 1) / g * g_bytes * s.p_gpu, buckets * 2 * math.ceil(math.log2(g)))
    elif g > 1:
        rounds, gathers = (M, 2) if lay.pp == 1 else (1, 1)
        out["dp" if lay.dp_mode == "fsdp" else "shard"] = (
            rounds * (gathers * w_bytes + g_bytes) * (S - 1) / S * s.p_gpu, rounds * (gathers + 1) * (n + 1) * (S - 1))
        if lay.dp_mode == "hsdp":
            R = g // S
            out["replica"] = (2 * (R - 1) / R * g_bytes * s.p_gpu / S, (n + 1) * 2 * math.ceil(math.log2(R)))
    return out


def ours_collectives(s, w_bytes=W_B, g_bytes=G_B, a_bytes=ACT_B):
    """collectives() of this repository's parallel/*.py: for each group the most any rank of s.stages() sends,
    term by term what the comm counters of tests/test_plan_measured.py read."""
    cfg, lay, d, M, t = s.cfg, s.lay, s.cfg.d_model, s.M, s.t
    tp, cp, S, g = lay.tp, lay.cp, shard_size(lay), lay.dp * lay.cp
    redo = lay.ckpt != "none"  # a recomputed block repeats its forward collectives (but tp's last one)
    out = {}
    for layers, params, embed, head, sends in s.stages():
        mine = {}
        if tp > 1:  # u: an all-gather or reduce-scatter of the (t, d) activation; an all-reduce sends 2u
            u = (tp - 1) / tp * t * d * a_bytes
            # 4 all-reduces (or 4 AG + 4 RS, and the 2 norm outputs gathered again in backward) per layer;
            # embedding; final norm -> lm_head (sp: + its re-gather); loss: (2, t) fp32 AG
            units = layers * (8 + 2 * lay.sp + redo * (3 if lay.sp else 2)) + 2 * embed + (2 + lay.sp) * head
            loss = (tp - 1) * 2 * t * 4
            norms = 2 * (tp - 1) / tp * g_bytes * d * (2 * layers + head) if lay.sp else 0.0  # sp norms' grads
            mine["tp"] = (M * (units * u + head * loss) + norms, M * (units + head) * (tp - 1))
        if cp > 1:
            if lay.cp_mode == "ulysses":  # q, k, v to head shards and the output back; kv heads repeated to lcm
                heads = 2 * cfg.n_head / tp + 2 * math.lcm(int(s.kv_local), cp)
                fwd = bwd = (cp - 1) / cp * t * cfg.head_dim * heads * a_bytes
            else:  # ring: K,V hop cp-1 times each way plus cp hops of the fp32 dK,dV; allgather: an AG, an RS
                kv = 2 * cfg.head_dim * s.kv_local * t  # elements of this rank's K and V
                fwd = (cp - 1) * kv * a_bytes
                bwd = fwd + (cp * kv * 4 if lay.cp_mode == "ring" else 0.0)
            mine["cp"] = (M * layers * ((1 + redo) * fwd + bwd), M * layers * (cp - 1) * (3 + redo))
        if lay.pp > 1:  # activations forward, gradients back ((b, T/tp, d) under sp), + a 6-int64 shape broadcast
            mine["pp"] = (M * sends * t * d * a_bytes / (tp if lay.sp else 1) + 48, M * sends)
        units = layers + (embed or head)  # fsdp units: one per block, one for the embedding/norm/head
        if g > 1 and lay.dp_mode == "ddp":
            buckets = math.ceil(g_bytes * params / (BUCKET_MB * 1e6))
            mine["dp"] = (2 * (g - 1) / g * g_bytes * params, buckets * 2 * math.ceil(math.log2(g)))
        elif g > 1:  # each microbatch gathers every unit for forward and again for backward (under pp: once per
            gathers = 2 * M if lay.pp == 1 else 1  # step, kept until the last backward); one RS per step
            mine["dp" if lay.dp_mode == "fsdp" else "shard"] = (
                (gathers * w_bytes + g_bytes) * (S - 1) / S * params, (gathers + 1) * units * (S - 1))
            if lay.dp_mode == "hsdp":
                R = g // S
                mine["replica"] = (2 * (R - 1) / R * g_bytes * params / S, units * 2 * math.ceil(math.log2(R)))
        for group, v in mine.items():
            out[group] = max(out.get(group, v), v)
    return out


def comm_bytes(cfg, lay, seq, batch, w_bytes=W_B, g_bytes=G_B, a_bytes=ACT_B, code="reference"):
    """Predicted bytes sent per rank per optimizer step, {"tp", "cp", "pp", "dp"}, in ring terms.

    cfg: model.ModelConfig; lay: Layout; seq: tokens per sequence; batch: global batch in sequences.
    For a rank of the fuller pipeline stage ("ours": the most any rank sends, per group); "dp" is the
    dp x cp gradient group (hsdp: shard + replica). Dtypes default to bf16 weights/activations and fp32
    grads; an fp32 CPU run passes 4, 4, 4. code: "reference" or "ours" (the module docstring)."""
    out = {"tp": 0.0, "cp": 0.0, "pp": 0.0, "dp": 0.0}
    for group, (nbytes, _) in collectives(Shape(cfg, lay, seq, batch, code), w_bytes, g_bytes, a_bytes).items():
        out["dp" if group in ("shard", "replica") else group] += nbytes
    return out


def act_per_token(s, ckpt, a_bytes=ACT_B):
    """Activation bytes one layer keeps per token on this GPU until its backward."""
    if s.code == "ours":
        return ours_act_per_token(s, ckpt, a_bytes)
    d, f, tp = s.cfg.d_model, s.cfg.ffn_dim, s.lay.tp
    sh = tp if s.lay.sp else 1  # sequence parallel shards the residual stream and the norms
    kv = 2 * s.cfg.head_dim * s.kv_local
    return a_bytes * {"none": 4 * d / sh + (2 * d + 3 * f) / tp + kv,
                      "selective": 2 * d / sh + (2 * d + 2 * f) / tp + kv, "full": d / sh}[ckpt]


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


def memory(cfg, lay, seq, batch, overhead_gb=OVERHEAD_GB, frag=FRAG, w_bytes=W_B, a_bytes=ACT_B, code="reference"):
    """Predicted peak bytes per GPU, {"weights", "grads", "master", "adam", "activations", "logits",
    "overhead"}, for the fuller of the first and last pipeline stage (arguments as in comm_bytes).
    An fp32 CPU run has no bf16 weight copy and fp32 activations: w_bytes=0, a_bytes=4, and
    overhead_gb=0, frag=0 to compare with allocated bytes."""
    return _memory(Shape(cfg, lay, seq, batch, code), overhead_gb, frag, w_bytes, a_bytes)


def _memory(s, overhead_gb=OVERHEAD_GB, frag=FRAG, w_bytes=W_B, a_bytes=ACT_B):
    if s.code == "ours":
        return _ours_memory(s, overhead_gb, frag, w_bytes, a_bytes)
    lay, P, M = s.lay, s.lay.pp, s.M
    S = shard_size(lay) if lay.dp_mode != "ddp" else 1
    zero3 = lay.dp_mode != "ddp" and P == 1
    inflight = {"gpipe": M, "1f1b": min(M, P), "interleaved": min(M, P + (P - 1) / lay.V)}[lay.schedule]
    recompute = act_per_token(s, "none", a_bytes) * s.t if lay.ckpt == "full" else 0.0  # one layer at a time
    first, _, last = s.layers
    best = None
    for layers, params, flight, logits in ((first, s.p_first, inflight, P == 1),
                                           (last, s.p_last, M if lay.schedule == "gpipe" else 1, True)):
        gathered = 2 * s.p_layer * (w_bytes or MASTER_B) if zero3 else 0.0  # two full layers (prefetch)
        m = {"weights": w_bytes * params / (S if zero3 else 1) + gathered,
             "grads": G_B * (params / S + s.p_layer if zero3 else params),
             "master": MASTER_B * params / S, "adam": ADAM_B * params / S,
             "activations": flight * layers * s.t * act_per_token(s, lay.ckpt, a_bytes) + recompute,
             "logits": (a_bytes + 4) * s.t * s.cfg.padded_vocab / lay.tp if logits else 0.0}
        m["overhead"] = overhead_gb * GB + frag * sum(m.values())
        best = m if best is None or sum(m.values()) > sum(best.values()) else best
    return best


def _ours_memory(s, overhead_gb, frag, w_bytes, a_bytes):
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
    keep = act_per_token(s, lay.ckpt, a_bytes)
    redo = (act_per_token(s, "none", a_bytes) - keep) * t  # a block recomputed in backward
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

# ---------------------------------------------------------------- time

def hide(t_comm, window):
    """Exposed seconds of communication overlapped with `window` seconds of compute."""
    return max(t_comm - window, 0.0) + OVERLAP_TAX * min(t_comm, window)


def step_time(cfg, cl, lay, seq, batch, code="reference"):
    """Predicted seconds per step by component (compute, recompute, imbalance, bubble, tp, cp, pp, dp),
    plus "total", "mfu" and "hfu"."""
    return _step_time(Shape(cfg, lay, seq, batch, code), cl)


def _step_time(s, cl):
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
    comm = {k: seconds(cl, lay, k, *v) for k, v in collectives(s).items()}
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
        hop = seconds(cl, lay, "pp", s.t * d * ACT_B / (tp if lay.sp else 1), 1)
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


# ---------------------------------------------------------------- search

@dataclass
class Plan:
    layout: Layout
    time: dict
    mem: dict
    fits: bool

    @property
    def mfu(self):
        return self.time["mfu"]


def evaluate(cfg, cl, lay, seq, batch, need_fit=False, checked=False, code="reference"):
    """The Plan of one layout (None if need_fit and it does not fit); ValueError if it cannot run."""
    why = None if checked else invalid(cfg, cl, lay, seq, batch)
    if why:
        raise ValueError(f"{lay}: {why}")
    s = Shape(cfg, lay, seq, batch, code)
    mem = _memory(s)
    fits = sum(mem.values()) <= cl.hbm_gb * GB
    return Plan(lay, _step_time(s, cl), mem, fits) if fits or not need_fit else None


def pow2(limit):
    return [1 << i for i in range(int(math.log2(max(limit, 1))) + 1)]


CKPTS = ("none", "selective", "full")  # each saves more memory and recomputes more


def candidates(cfg, cl, seq, batch, max_micro=16, min_cp_tokens=1024):
    """Every valid layout, pruned: tp, cp, micro and hsdp shard powers of two, hsdp shards no smaller than
    a node's share, cp shards of at least min_cp_tokens. Yields families that differ only in micro-batch
    (ascending), each a list of one layout per checkpoint policy (CKPTS order)."""
    for tp in [x for x in pow2(cl.gpus_per_node) if cl.gpus % x == 0]:
        for cp in [c for c in pow2(seq // min_cp_tokens) if (cl.gpus // tp) % c == 0]:
            for pp in [p for p in range(1, cfg.n_layer + 1) if (cl.gpus // (tp * cp)) % p == 0]:
                dp = cl.gpus // (tp * cp * pp)
                if batch % dp:
                    continue
                g, local = dp * cp, members_per_node(cl.gpus_per_node, tp, cp, pp, dp, 1, "dp")
                shards = [k for k in pow2(g // 2) if k >= max(2, local)]
                modes = [("ddp", 0)] + [("fsdp", 0)] * (g > 1) + [("hsdp", k) for k in shards]
                scheds = [("gpipe", 1), ("1f1b", 1)] if pp > 1 else [("1f1b", 1)]
                scheds += [("interleaved", v) for v in pow2((cfg.n_layer + 2) // pp) if v > 1 and pp > 1]
                for mode, shard in modes:
                    for sched, V in scheds:
                        for cp_mode in ("ring", "ulysses", "allgather") if cp > 1 else ("ring",):
                            family = [[Layout(dp, tp, pp, cp, mode, shard, micro, c, sched, V, cp_mode) for c in CKPTS]
                                      for micro in pow2(min(max_micro, batch // dp))]
                            family = [lays for lays in family if not invalid(cfg, cl, lays[0], seq, batch)]
                            if family:
                                yield family


def rank_key(p):
    """By MFU; within 0.1 point, the simpler layout: ddp, hsdp, fsdp; fewer model splits; smaller micro."""
    lay = p.layout
    return -round(p.mfu, 3), ("ddp", "hsdp", "fsdp").index(lay.dp_mode), lay.tp * lay.pp * lay.cp, lay.micro


def plan(cfg, cl, seq, batch, top=10, code="reference"):
    """The `top` layouts that fit in memory, by predicted MFU, one per dp x tp x pp x cp mesh (its best
    dp mode, micro-batch, checkpointing, schedule and cp mode), for the implementation `code`."""
    best = {}
    for family in candidates(cfg, cl, seq, batch):
        for lays in family:
            # the lightest checkpointing that fits is the fastest; if none fits, larger micro-batches won't
            p = next((p for lay in lays if (p := evaluate(cfg, cl, lay, seq, batch, True, True, code))), None)
            if p is None:
                break
            mesh = (p.layout.dp, p.layout.tp, p.layout.pp, p.layout.cp)
            if mesh not in best or rank_key(p) < rank_key(best[mesh]):
                best[mesh] = p
    return sorted(best.values(), key=rank_key)[:top]


def default_batch_tokens(cfg):
    """GPT-3 / Llama practice: 0.5M tokens under 0.5B params, 1M under 3B, 4M under 100B, else 16M."""
    n = param_counts(cfg)[1]
    return 2**19 if n < 5e8 else 2**20 if n < 3e9 else 2**22 if n < 1e11 else 2**24


def bill(p, cl):
    """The layout, its MFU, and where its step time and memory go."""
    t, m = p.time, p.mem
    parts = ", ".join(f"{k} {v:.3g}" for k, v in t.items() if k not in ("total", "mfu", "hfu") and v > 0)
    mems = ", ".join(f"{k} {v / GB:.1f}" for k, v in m.items() if v > 0)
    return (f"{p.layout}\n  MFU {t['mfu']:.1%}  HFU {t['hfu']:.1%}  step {t['total']:.3g} s = {parts}\n"
            f"  memory {sum(m.values()) / GB:.1f} GB of {cl.hbm_gb:g} ({'fits' if p.fits else 'DOES NOT FIT'}): {mems}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="llama3-8b", choices=sorted(PRESETS))
    for name in ("n-layer", "d-model", "n-head", "n-kv-head", "ffn-dim", "vocab-size"):
        ap.add_argument(f"--{name}", type=int, help="override the preset (vocab: 50257 if the preset has none)")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--hbm-gb", type=float, default=80.0, help="memory per GPU (H100: 80)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H100 SXM: 989)")
    ap.add_argument("--intra-gbs", type=float, default=450.0, help="NVLink GB/s per direction per GPU")
    ap.add_argument("--inter-gbs", type=float, default=50.0, help="network GB/s per GPU (400 Gb/s)")
    ap.add_argument("--seq-len", type=int, help="default: the preset's")
    ap.add_argument("--global-batch-tokens", type=int, help="default: 0.5M-16M tokens by model size")
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--layout", help="the bill of one layout, e.g. dp=64,tp=8,pp=16,dp_mode=fsdp,V=8")
    ap.add_argument("--code", default="reference", choices=CODES,
                    help="whose implementation: Llama 3's (reference, the calibration) or this repository's (ours)")
    ap.add_argument("--compare-fsdp-scope", action="store_true",
                    help="L15: the winner's mesh with its FSDP group inside one node (hsdp) vs across nodes")
    args = ap.parse_args(argv)
    over = {k: getattr(args, k) for k in ("n_layer", "d_model", "n_head", "n_kv_head", "ffn_dim", "vocab_size")}
    cfg = replace(PRESETS[args.model], **{k: v for k, v in over.items() if v})
    cfg = cfg if cfg.vocab_size else replace(cfg, vocab_size=50257)  # the GPT-2 tokenizer of our data
    seq = args.seq_len or cfg.seq_len
    cl = Cluster(args.gpus, args.gpus_per_node, args.hbm_gb, args.peak_tflops, args.intra_gbs, args.inter_gbs)
    batch = max(1, (args.global_batch_tokens or default_batch_tokens(cfg)) // seq)
    total, non_emb = param_counts(cfg)
    print(f"{args.model}: {total / 1e9:.2f}B params ({non_emb / 1e9:.2f}B non-embedding), seq {seq}, batch "
          f"{batch} x {seq} = {batch * seq / 2**20:.1f}M tokens; {cl.gpus} GPUs, {cl.gpus_per_node}/node, "
          f"{cl.hbm_gb:g} GB, {cl.peak_tflops:g} TF, {cl.intra_gbs:g}/{cl.inter_gbs:g} GB/s intra/inter"
          + ("; code: ours (parallel/*.py)" if args.code == "ours" else ""))
    try:
        if args.layout:
            print(bill(evaluate(cfg, cl, parse_layout(args.layout), seq, batch, code=args.code), cl))
            return 0
        t0 = time.time()
        plans = plan(cfg, cl, seq, batch, args.top, args.code)
    except (ValueError, TypeError) as e:
        print(f"plan.py: error: {e}", file=sys.stderr)
        return 2
    if not plans:
        print("no layout fits in memory")
        return 1
    print(f"top {len(plans)} layouts by predicted MFU (searched in {time.time() - t0:.1f} s):")
    print(f"{'#':>2} {'MFU':>6} {'step s':>7} {'mem GB':>6}  layout")
    for i, p in enumerate(plans, 1):
        print(f"{i:>2} {p.mfu:6.1%} {p.time['total']:7.3g} {sum(p.mem.values()) / GB:6.1f}  {p.layout}")
    print("\nwhere the winner's time (s) and memory (GB) go:\n" + bill(plans[0], cl))
    if args.compare_fsdp_scope:
        lay = plans[0].layout
        local = members_per_node(cl.gpus_per_node, lay.tp, lay.cp, lay.pp, lay.dp, 1, "dp")
        print(f"\nL15, the same mesh with FSDP across nodes vs inside one node (shard={local}):")
        for alt in (replace(lay, dp_mode="fsdp", shard=0), replace(lay, dp_mode="hsdp", shard=local)):
            why = invalid(cfg, cl, alt, seq, batch)
            print(f"{alt}: {why}" if why else bill(evaluate(cfg, cl, alt, seq, batch, code=args.code), cl))
    return 0


if __name__ == "__main__":
    sys.exit(main())

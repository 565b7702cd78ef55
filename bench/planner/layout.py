"""The planner's layout: its fields, whether it can run (invalid), its per-GPU sizes (Shape). The notation and the
stage rules: bench/README.md, "The planner's formulas".
"""
from dataclasses import dataclass, fields
from typing import Optional

from model import layer_param_count
from parallel import memory
from parallel.mesh import LayoutError
from parallel.pp import layer_counts

W_B, G_B, MASTER_B, ADAM_B, ACT_B = 2, 4, 4, 8, 2  # bytes: bf16 weights, fp32 grads, fp32 master, Adam, bf16
BUCKET_MB = 25       # DDP bucket (PyTorch's default)
GB = 1e9
# --code reference: HBM left free beyond costs.py's OVERHEAD_GB and FRAG (allocator spikes, NCCL buffers, a larger
# CUDA context; torchtitan and Megatron-LM users keep 5-10%). --code ours: train.py's memory.MARGIN instead.
MEM_MARGIN = 0.05
CODES = ("reference", "ours")  # whose implementation the byte and memory formulas describe (plan.py)
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb1", "zbv")  # parallel/pp_schedule.py


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int = 8
    hbm_gb: float = 80.0
    peak_tflops: float = 989.0  # dense bf16, H100 SXM
    intra_gbs: float = 450.0    # NVLink 4, per direction per GPU
    inter_gbs: float = 50.0     # one 400 Gb/s NIC per GPU
    hbm_tbs: float = 3.35       # HBM3, H100 SXM
    lat_intra_us: float = 1.0   # per ring step over NVLink
    lat_inter_us: float = 5.0   # per ring step over the network
    backend: str = "nccl"       # gloo: a reduce-scatter takes as long as an all-reduce of its whole input
    dtype_bytes: int = 2        # the compute dtype's: bf16 on GPUs; 4 on a CPU, which trains in fp32
    # measured=True: the rates above (and attn_tflops) were measured on this cluster at the workload's own sizes
    # (bench/cluster), so step_time.py's H100 factors (GEMM and attention efficiency, NCCL's bus efficiency)
    # do not apply to them
    measured: bool = False
    attn_tflops: float = 0.0    # measured attention fwd + bwd rate (12*d*T FLOPs per token), measured clusters
    # host microseconds per dispatched op, paid in line where the host is the device (a CPU cluster measures it);
    # 0 on GPUs, whose kernels run while the host launches the next ones
    host_us: float = 0.0
    factors: object = None      # factors.Factors; None: those of the code priced (step_time.py)
    margin: Optional[float] = None  # share of hbm_gb a layout must leave free; None: the code's (margin_of)

    def margin_of(self, code):
        if self.margin is not None:
            return self.margin
        return memory.MARGIN if code == "ours" else MEM_MARGIN

    def usable_gb(self, code):
        return self.hbm_gb * (1 - self.margin_of(code))


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp_mode: str = "ddp"    # ddp | fsdp | hsdp
    shard: int = 0          # hsdp shard-group size
    micro: int = 1          # sequences per microbatch
    ckpt: str = "none"      # none | selective | op | full
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved | zb1 | zbv
    V: int = 1              # virtual stages per rank (interleaved; zbv: 2)
    cp_mode: str = "ring"   # ring | ulysses | allgather
    sp: bool = True         # sequence parallel with tp (train.py --sp)
    overlap: bool = True    # collectives overlap compute (train.py --no-overlap: overlap=0, every one blocks)
    accumulate: str = "sharded"  # fsdp/hsdp micro-batch gradients (train.py --accumulate): sharded | unsharded
    fp8: bool = False       # train.py --dtype fp8 (--fp8-all-gather under fsdp/hsdp): block matmuls and gathers in fp8
    order: str = "node"     # node: a node holds consecutive ranks (torchrun); interleaved: rank r on node r % nodes,
    #                         bench/cluster's ablation that puts tp across nodes
    # the reference only (Megatron-LM's options; train.py has neither, its sp rings are on with sp and overlap):
    tp_comm_overlap: bool = False  # --tp-comm-overlap: every sp all-gather and reduce-scatter under a GEMM's chunks
    dist_opt: bool = False  # --use-distributed-optimizer: ddp whose fp32 master and Adam are sharded over dp x cp

    def __str__(self):
        s = f"dp={self.dp},tp={self.tp},pp={self.pp},cp={self.cp},dp_mode={self.dp_mode}"
        s += f",shard={self.shard}" if self.dp_mode == "hsdp" else ""
        s += f",micro={self.micro},ckpt={self.ckpt}"
        s += f",schedule={self.schedule},V={self.V}" if self.pp > 1 else ""
        s += ",sp=0" if self.tp > 1 and not self.sp else ""
        s += ",overlap=0" if not self.overlap else ""
        s += f",accumulate={self.accumulate}" if self.accumulate != "sharded" else ""
        s += ",fp8=1" if self.fp8 else ""
        s += f",order={self.order}" if self.order != "node" else ""
        s += ",tp_comm_overlap=1" if self.tp_comm_overlap else ""
        s += ",dist_opt=1" if self.dist_opt else ""
        return s + (f",cp_mode={self.cp_mode}" if self.cp > 1 else "")


BOOLS = ("sp", "overlap", "fp8", "tp_comm_overlap", "dist_opt")
DEGREES = ("dp", "tp", "pp", "cp", "micro", "V")  # each at least 1; shard at least 0


def boolean(v):
    if v.lower() not in ("0", "1", "true", "false", "yes", "no", "on", "off"):
        raise ValueError
    return v.lower() in ("1", "true", "yes", "on")


def parse_layout(text):
    """'dp=64,tp=8,pp=16,dp_mode=fsdp,V=8' -> Layout; unnamed fields keep their defaults, V > 1
    implies schedule=interleaved and schedule=zbv V=2. Booleans (sp, overlap, fp8, ...): 0 or 1. ValueError, naming
    the field, for an unknown key, a value of the wrong kind or a degree below 1."""
    kinds = {f.name: type(f.default) for f in fields(Layout)}
    kinds.update(dict.fromkeys(BOOLS, boolean))
    items = [item for item in text.replace(" ", "").split(",") if item]
    if not items or any("=" not in item for item in items):
        raise ValueError(f"expected key=value pairs like dp=64,tp=8,pp=16, got {text!r}")
    kv = dict(item.split("=", 1) for item in items)
    if set(kv) - set(kinds):
        raise ValueError(f"unknown layout keys {sorted(set(kv) - set(kinds))}; known: {sorted(kinds)}")
    got = {}
    for k, v in kv.items():
        try:
            got[k] = kinds[k](v)
        except ValueError:
            what = "0 or 1" if k in BOOLS else "an integer" if kinds[k] is int else "a name"
            raise ValueError(f"{k} must be {what}, got {v!r}") from None
        if kinds[k] is int and got[k] < (k in DEGREES):
            raise ValueError(f"{k} must be {'a positive' if k in DEGREES else 'a non-negative'} integer, got {v}")
    if got.get("V", 1) > 1:
        got.setdefault("schedule", "interleaved")
    if got.get("schedule") == "zbv":
        got.setdefault("V", 2)
    return Layout(**got)


def shard_size(lay):
    return {"ddp": 1, "fsdp": lay.dp * lay.cp, "hsdp": lay.shard}.get(lay.dp_mode, 1)


def invalid(cfg, cl, lay, seq, batch, code="reference"):
    """Why this layout cannot run (one line), or None. code: whose implementation (CODES)."""
    if min(getattr(lay, k) for k in DEGREES) < 1 or lay.shard < 0:
        return f"{', '.join(DEGREES)} must be at least 1 and shard at least 0"
    world, g = lay.dp * lay.tp * lay.pp * lay.cp, lay.dp * lay.cp
    for bad, why in [(world != cl.gpus, f"dp*tp*pp*cp = {world} != {cl.gpus} gpus"),
        (cl.gpus_per_node % lay.tp or cfg.n_head % lay.tp, "tp must divide the gpus per node and the heads"),
        (cfg.n_kv_head % lay.tp and lay.tp % cfg.n_kv_head, "kv heads and tp must divide one another"),
        (seq % (2 * lay.cp), "the sequence length must be divisible by 2*cp"),
        (lay.sp and seq % (lay.cp * lay.tp), "sequence parallel needs the sequence length divisible by cp*tp"),
        (lay.cp_mode == "ulysses" and cfg.n_head % (lay.tp * lay.cp), "ulysses needs heads % (tp*cp) == 0"),
        (batch % (lay.dp * lay.micro), f"the global batch ({batch}) is not divisible by dp*micro"),
        (lay.pp * lay.V > cfg.n_layer + 2 * (lay.pp > 1), "more pipeline chunks than layers (+ embedding, head)"),
        (lay.pp > 1 and batch // (lay.dp * lay.micro) < lay.pp, "fewer microbatches than pipeline stages"),
        ((lay.schedule in ("interleaved", "zbv")) != (lay.V > 1 and lay.pp > 1),
         "V > 1 iff interleaved or zbv, with pp > 1"),
        (lay.schedule == "zbv" and lay.V != 2, "zbv runs V = 2 chunks per rank"),
        (lay.fp8 and lay.pp > 1 and lay.schedule in ("zb1", "zbv"), "zb1 and zbv do not run with fp8 (train.py)"),
        (lay.dp_mode == "hsdp" and not (1 < lay.shard < g and g % lay.shard == 0), "hsdp: shard in (1, dp*cp)"),
        (lay.dp_mode not in ("ddp", "fsdp", "hsdp"), "dp_mode: ddp | fsdp | hsdp"),
        (lay.ckpt not in ("none", "selective", "op", "full"), "ckpt: none | selective | op | full"),
        (lay.schedule not in SCHEDULES, "schedule: " + " | ".join(SCHEDULES)),
        (lay.cp_mode not in ("ring", "ulysses", "allgather"), "cp_mode: ring | ulysses | allgather"),
        (lay.accumulate not in ("sharded", "unsharded"), "accumulate: sharded | unsharded"),
        (lay.accumulate != "sharded" and lay.dp_mode == "ddp", "accumulate=unsharded needs dp_mode fsdp or hsdp"),
        (lay.order not in ("node", "interleaved"), "order: node | interleaved"),
        (code != "reference" and (lay.tp_comm_overlap or lay.dist_opt),
         "tp_comm_overlap and dist_opt are Megatron-LM's options (--code reference); train.py has neither"),
        (lay.tp_comm_overlap and not (lay.tp > 1 and lay.sp and lay.overlap),
         "tp_comm_overlap needs tp > 1, sp and overlap"),
        (lay.dist_opt and (lay.dp_mode != "ddp" or g == 1), "dist_opt shards ddp's optimizer over dp x cp > 1"),]:
        if bad:
            return why
    if code == "ours" and lay.pp > 1:  # train.py's own split of the layers over the stages
        try:
            layer_counts(cfg, lay.pp, lay.V, batch // (lay.dp * lay.micro), None, lay.schedule)
        except LayoutError as e:
            return str(e)
    return None


def in_flight(schedule, M, P, V, rank=0):
    """Activation sets (a stage's worth each) alive at once on (pipeline rank `rank`, the last rank): gpipe M on
    both; 1f1b min(M, P - rank) and 1; interleaved (Megatron's warmup) min(M, P + (P - 2·rank - 1)/V) and 1; zb1
    min(M, P) on both (a set lives until its W); zbv at most 2P chunk sets of half a stage, min(M, P), on both."""
    if schedule in ("zb1", "zbv"):
        return min(M, P), min(M, P)
    interleaved = min(M, P + (P - 2 * rank - 1) / V)
    last = M if schedule == "gpipe" else 1
    return {"gpipe": M, "1f1b": min(M, P - rank), "interleaved": interleaved}[schedule], last


def stage_layers(n_layer, pp):
    """(first, most, last): layers on the first, the fullest and the last pipeline stage."""
    q, r = divmod(n_layer, pp)
    if pp == 1 or r == 0:
        return q, q, q
    return (q if pp - r >= 2 else q + 1), q + 1, q


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
        norms, kv_head = 2 * d, 2 * d * cfg.head_dim  # a block's norm weights; k and v of one kv head
        split = layer_param_count(cfg) - norms - kv_head * cfg.n_kv_head  # q, o, gate, up, down
        self.p_layer = split / tp + kv_head * self.kv_local + norms
        self.p_embed = cfg.padded_vocab * d / tp  # the embedding, and likewise the head
        self.layers = first, self.most, last = stage_layers(cfg.n_layer, lay.pp)
        if lay.pp == 1:  # params on the first and last stage (the head's stage has the final norm)
            self.p_first = self.p_last = cfg.n_layer * self.p_layer + 2 * self.p_embed + d
        else:
            self.p_first, self.p_last = first * self.p_layer + self.p_embed, last * self.p_layer + self.p_embed + d
        if lay.schedule == "zbv" and lay.pp > 1:  # rank 0 the first and last of 2P chunks, rank P-1 two middle ones
            c_first, c_most, c_last = stage_layers(cfg.n_layer, 2 * lay.pp)
            self.p_first = (c_first + c_last) * self.p_layer + 2 * self.p_embed + d
            self.p_last = 2 * c_most * self.p_layer
        self.p_gpu = max(self.p_first, self.p_last)
        gpu_layers = cfg.n_layer if lay.pp == 1 else first if self.p_first >= self.p_last else last
        self.p_fp8 = gpu_layers * (self.p_layer - norms) if lay.fp8 else 0.0  # p_gpu's block matmul weights

    def stages(self):
        """(layers, params, has the embedding, has the head, pipeline sends per microbatch) of the ranks that
        bound the per-rank numbers: the first, the last and (P > 2) a middle pipeline rank; one rank without pp."""
        (first, most, last), P, V = self.layers, self.lay.pp, self.lay.V
        if P == 1:
            return [(first, self.p_first, True, True, 0)]
        if self.lay.schedule == "zbv":
            c_first, c_most, c_last = stage_layers(self.cfg.n_layer, 2 * P)
            return [(c_first + c_last, self.p_first, True, True, 2), (2 * c_most, self.p_last, False, False, 2)] + [
                (2 * c_most, self.p_last, False, False, 4)] * (P > 2)
        ends = [(first, self.p_first, True, False, 2 * V - 1), (last, self.p_last, False, True, 2 * V - 1)]
        return ends + [(most, most * self.p_layer, False, False, 2 * V)] * (P > 2)

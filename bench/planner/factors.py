"""The planner's efficiency factors: what fraction of the hardware's peak each kind of work reaches, for whose code
(--code), each with its source and a (pessimistic, optimistic) range (bench/README.md, "The planner's formulas").
"""
import json
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class Factors:
    mm: float         # sustained GEMM fraction of the dense bf16 peak, large GEMMs (step_time.py scales it by rows)
    attn: float       # attention forward + backward fraction of the peak, long keys
    elem: float       # fraction of the HBM bandwidth memory-bound kernels reach (norms, RoPE, SwiGLU, casts, updates)
    bus: float        # NCCL bus bandwidth over link bandwidth
    tax: float        # compute lost per second of communication hidden under it (NCCL's kernels take SMs)
    launch_us: float  # host microseconds per op dispatched where the GPU may wait for the host (sp ring hops)
    fp8: float        # fp8 block-GEMM speed over bf16's at the same sizes
    credit: float     # share of an overlap credited where no test or emulated run measured it hidden (0: exposed)


REFERENCE = Factors(
    mm=0.65,          # an 8k GEMM alone reaches ~0.8 of the H100's 989 TF/s; clocks drop under a training load
    attn=0.40,        # FlashAttention-2 forward + backward on H100 (PyTorch SDPA's flash kernel), long keys
    elem=1.0,         # the reference's elementwise bytes (ELEM_BYTES) already assume fused kernels at full rate
    bus=0.80,         # nccl-tests all-reduce bus bandwidth over an 8 x H100 node's NVLink
    tax=0.25,         # NCCL takes ~16-32 of the H100's 132 SMs while it runs
    launch_us=0.0,    # Megatron's TP overlap (Transformer Engine's userbuffers) launches its chunks from C++
    fp8=2.0,          # H100 SXM dense peaks: 1979 fp8 over 989 bf16 TF/s
    credit=1.0,       # Megatron's overlaps as its documentation describes them
)

# torchtitan's published benchmark (Dec 2024, benchmarks/llama3_h100_202412_torchtitan.md): Llama 3.1 8B, FSDP, seq
# 8192, local batch 2, selective (op) activation checkpointing, on H100s with 96 GB HBM2e (2.4 TB/s) at 500 W:
# tokens/s per GPU on 8 GPUs 5,762 eager, 6,667 compiled; on 128 GPUs 5,605 eager, 6,514 compiled (MFU over
# 989 TF/s: 33.7, 39.0, 32.8, 38.1%). bench/planner/published.py finds the scale of the reference's compute rates at
# which --code ours predicts a row:
COMPUTE_OURS = 0.901   # 8 GPUs, compiled (our default): the nominal
COMPUTE_EAGER = 0.777  # 8 GPUs, eager: the pessimistic end (a run where compilation gains nothing)
COMPUTE_SAC = 0.955    # 8 GPUs, compiled, its recompute of every second forward matmul priced: the optimistic end
# (torchtitan's op-level checkpointing recomputes them; the nominal keeps that cost inside the scale, conservative
# for this code, whose selective policy recomputes no matmul). Its GPUs ran at 500 W, below the 989 TF/s peak
# its MFU divides by: on a 700 W H100 the same code would reach more.

OURS = replace(
    REFERENCE,
    mm=REFERENCE.mm * COMPUTE_OURS, attn=REFERENCE.attn * COMPUTE_OURS, elem=REFERENCE.elem * COMPUTE_OURS,
    launch_us=10.0,   # not yet measured on a GPU host (bench/gpu does): PyTorch's eager dispatch plus a CUDA launch
    credit=0.0,       # overlaps no test or emulated run measured hidden are not credited (step_time.py)
)
FACTORS = {"reference": REFERENCE, "ours": OURS}

# (pessimistic, optimistic) per factor; "compute" scales mm, attn and elem together
RANGES = {
    "reference": {"bus": (0.70, 0.90), "tax": (0.35, 0.15), "fp8": (1.5, 2.0)},
    "ours": {"compute": (COMPUTE_EAGER / COMPUTE_OURS, COMPUTE_SAC / COMPUTE_OURS), "bus": (0.70, 0.90),
             "tax": (0.35, 0.15), "launch_us": (20.0, 5.0), "credit": (0.0, 1.0), "fp8": (1.5, 2.0)},
}
MEASURED = ("mm", "attn", "elem", "launch_us", "fp8")  # what bench/gpu's factors file may set


def vary(f, name, value):
    """Factors f with one factor at `value`: "compute" scales mm, attn and elem; the others are set."""
    if name == "compute":
        return replace(f, mm=f.mm * value, attn=f.attn * value, elem=f.elem * value)
    return replace(f, **{name: value})


def ranges(code, measured=(), fp8=False):
    """{factor: (pessimistic, optimistic)} for `code`, without the ones measured and, in bf16, without fp8's."""
    out = {k: v for k, v in RANGES[code].items() if (fp8 or k != "fp8") and k not in measured}
    if {"mm", "attn", "elem"} & set(measured):  # a measured rate is not scaled by torchtitan's range
        out.pop("compute", None)
    return out


def load(path):
    """(Factors, the names it measured) from bench/gpu's factors file (JSON): ours with the measured values.
    ValueError (one line) if it is not one."""
    try:
        got = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    if not isinstance(got, dict) or not isinstance(got.get("factors"), dict):
        raise ValueError(f"{path}: no 'factors' object (bench/gpu writes one)")
    bad = {k: v for k, v in got["factors"].items() if k not in MEASURED or not isinstance(v, (int, float)) or v <= 0}
    if bad:
        raise ValueError(f"{path}: factors must be positive numbers among {', '.join(MEASURED)}; got {bad}")
    return replace(OURS, **got["factors"]), tuple(sorted(got["factors"]))

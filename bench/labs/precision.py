"""L1-L4, mixed precision: what each dtype is, what it buys, and what fp16 needs, from real tensors.

    python -m bench.labs.precision             # all four tables into bench/results/
    python -m bench.labs.precision --only L3   # one of them

L1 the dtype of every tensor of one train.py step under fp32, bf16, fp16 and fp8; L2 its tokens/s in each (steps
interleaved, median); L3 matmul TFLOP/s at tile-aligned and unaligned n; L4 the share of nonzero fp32 gradients that
underflow to zero in fp16 as the loss is divided by k (k accumulated micro-batches), against a loss scale of 2^16
and bf16. `--only fp8` (and the full run) adds fp8's loss gap to bf16 and, on a GPU, its matmul rate.
"""
import statistics
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench import common
from config import DTYPES
from data.loader import TokenLoader
from parallel import fp8

LABELS = ["token ids (model input)", "q_proj input (residual stream after RMSNorm)",
          "parameters (master weights)", "q_proj output (Linear activation)",
          "block matmul operands, forward (x, W of layers.0 q_proj)",
          "block matmul operands, backward (dY, x of layers.0's last)", "attention output (SDPA)",
          "logits (lm_head output)", "loss (cross-entropy, in fp32)", "matmul accumulation (measured)",
          "activation gradient (d q_proj output)", "parameter gradients", "gradient norm",
          "AdamW exp_avg", "AdamW exp_avg_sq", "loss scale (optim.LossScaler)"]


def batch(device, rows, seq_len, step=0):
    loader = TokenLoader(common.pystdlib_folder(), "train", seq_len, rows, seed=1337, device=device, prefetch=False)
    return loader.get(step)


class Matmuls(TorchDispatchMode):
    """The operand dtypes of every matmul that runs (mm, addmm, bmm, _scaled_mm), in order. Under fp8 the block
    matmuls' are taken as fp8.scaled_mm receives them: on CPU it upcasts them to fp32 before its matmul."""

    KINDS = {getattr(torch.ops.aten, n).default for n in ("mm", "addmm", "bmm", "_scaled_mm")}

    def __init__(self, mode):
        super().__init__()
        self.mode, self.seen = mode, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.KINDS and self.mode != "fp8":
            a, b = args[1:3] if func is torch.ops.aten.addmm.default else args[:2]
            self.seen.append(f"{a.dtype} x {b.dtype}".replace("torch.", ""))
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self.scaled_mm = fp8.scaled_mm
        fp8.scaled_mm = lambda a, b, *rest, **kw: (self.seen.append(f"{a.dtype} x {b.dtype}".replace("torch.", "")),
                                                   self.scaled_mm(a, b, *rest, **kw))[1]
        return super().__enter__()

    def __exit__(self, *exc):
        fp8.scaled_mm = self.scaled_mm
        return super().__exit__(*exc)


def dtypes_of(tensors):
    names = sorted({str(t.dtype).replace("torch.", "") for t in tensors})
    return "/".join(names)


def sequential_sum(dtype, k):
    """1 + 1 + ... (k times) with a `dtype` accumulator: where a narrow accumulator stops counting."""
    acc = torch.zeros((), dtype=dtype)
    for _ in range(k):
        acc = (acc.float() + 1).to(dtype)  # each sum rounded to dtype (float8 has no arithmetic of its own)
    return int(acc.float().item())


# ---------------------------------------------------------------- L1

def dtype_column(mode, device, x, y, shape, k=4096):
    """The dtypes of one training step's tensors in one precision mode, in the order of LABELS."""
    step = common.TrainStep(mode, device, **shape)
    seen = {}
    attn = step.model.layers["0"].self_attn

    def grab_q(module, inputs, output):
        seen["linear_in"], seen["linear_out"] = inputs[0].dtype, output.dtype
        output.register_hook(lambda g: seen.__setitem__("act_grad", g.dtype))

    hooks = [attn.q_proj.register_forward_hook(grab_q),
             attn.o_proj.register_forward_hook(lambda m, i, o: seen.__setitem__("attn_out", i[0].dtype)),
             step.model.lm_head.register_forward_hook(lambda m, i, o: seen.__setitem__("logits", o.dtype))]
    forward, backward = Matmuls(mode), Matmuls(mode)
    with forward, common.autocast(mode, device):
        loss = step.model(x, y)
    with backward:
        (loss * step.scaler.scale).backward()
    grads = [p.grad for p in step.model.parameters()]
    norm = step.update()
    for h in hooks:
        h.remove()
    state = list(step.opt.state.values())
    narrow = fp8.E4M3 if mode == "fp8" else DTYPES[mode]  # fp8: the block matmuls' operands
    a = torch.ones(1, k, dtype=narrow, device=device)
    b = torch.ones(k, 1, dtype=narrow, device=device)
    one = torch.ones((), device=device)
    dot = int((fp8.scaled_mm(a, b, one, one, torch.float32) if mode == "fp8" else a @ b).item())
    if mode == "fp32":
        accum = f"fp32 (ones·ones over K={k} = {dot})"
    else:
        accum = (f"{'fp32' if dot == k else 'narrow'}: ones·ones over K={k} = {dot}; "
                 f"a {str(narrow).replace('torch.', '')} accumulator stops at {sequential_sum(narrow, k)}")
    column = [x.dtype, seen["linear_in"], dtypes_of(step.model.parameters()), seen["linear_out"], forward.seen[0],
              backward.seen[-1], seen["attn_out"],
              seen["logits"], loss.dtype, accum, seen["act_grad"], dtypes_of(grads), norm.dtype,
              dtypes_of([s["exp_avg"] for s in state]), dtypes_of([s["exp_avg_sq"] for s in state]),
              f"{step.scaler.scale.item():g}"]
    return [str(v).replace("torch.", "") for v in column]


def dtype_table(device, rows, seq_len, out, shape):
    x, y = batch(device, rows, seq_len)
    columns = {mode: dtype_column(mode, device, x, y, shape) for mode in DTYPES}
    table = [[label] + [columns[m][i] for m in DTYPES] for i, label in enumerate(LABELS)]
    notes = [f"Read from the tensors of one real training step of the tiny GPT ({rows} x {seq_len} tokens of "
             f"pystdlib) on {device.type}: forward hooks on layers.0 q_proj/o_proj and lm_head, a tensor hook "
             "for the activation gradient, p.grad and optimizer.state after the step.",
             "Autocast casts a Linear's fp32 input and fp32 weight to the compute dtype inside the op; the "
             "weights stay fp32 (master copy) and their gradients come back in fp32.",
             "Accumulation: measured as ones(1,K) @ ones(K,1): a bf16 (8-bit mantissa) accumulator would stop "
             "at 256, fp16 at 2048. Known: tensor cores (CUDA) and oneDNN (CPU) accumulate bf16/fp16 products "
             "in fp32; cuBLAS may reduce split-K partial sums in the narrow dtype when "
             "torch.backends.cuda.matmul.allow_{bf16,fp16}_reduced_precision_reduction is True "
             f"(now {torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction}/"
             f"{torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction}).",
             "fp8: bf16 autocast, and the block matmuls (q, k, v, o, gate, up, down) take x and W in e4m3 and, in "
             "backward, dY in e5m2, each with a power-of-two tensorwise scale (fp8.py); accumulation fp32, outputs "
             "bf16. Embedding, attention, lm_head and loss as bf16. Block matmul operands: the first matmul of "
             "forward (layers.0 q_proj) and the last of backward (a layers.0 weight gradient, dY with x); under fp8 "
             "as handed to fp8.scaled_mm (on a GPU torch._scaled_mm; on CPU upcast exactly to fp32 first). With "
             "--fp8-all-gather FSDP also all-gathers the block weights in e4m3 (and their norm gains in bf16).",]
    fp32_acc = all(columns[m][LABELS.index("matmul accumulation (measured)")].startswith("fp32") for m in columns)
    common.write_result(out, "L1_dtypes", "L1: dtypes in one training step, per precision mode",
                        ["tensor", "fp32", "bf16 autocast", "fp16 autocast", "fp8 (bf16 + fp8 block matmuls)"],
                        table, notes)
    common.answer("L1", f"params, grads, AdamW state fp32 in every mode; Linear outputs "
                        f"{columns['bf16'][3]}/{columns['fp16'][3]} "
                        f"under bf16/fp16 autocast; matmul accumulation {'fp32' if fp32_acc else 'NARROW'}; "
                        f"fp16 adds a loss scale of {columns['fp16'][-1]}")


# ---------------------------------------------------------------- L2

def throughput_table(device, preset, rows, seq_len, steps, out, shape):
    x, y = batch(device, rows, seq_len)
    runners = {mode: common.TrainStep(mode, device, preset, **shape) for mode in DTYPES}
    for run in runners.values():  # warm-up: first-call kernel selection, allocator
        run(x, y)
    times = {mode: [] for mode in DTYPES}
    for _ in range(steps):  # interleaved, so load from other processes hits every mode alike
        for mode, run in runners.items():
            common.sync(device)
            t0 = time.perf_counter()
            run(x, y)
            common.sync(device)
            times[mode].append(time.perf_counter() - t0)
    tokens = rows * seq_len
    base = tokens / statistics.median(times["fp32"])
    table = []
    for mode in DTYPES:
        dt = statistics.median(times[mode])
        label = {"fp32": "fp32", "fp8": "fp8 (bf16 autocast, fp8 block matmuls)"}.get(mode, f"{mode} autocast")
        table.append([label, f"{dt * 1e3:.1f}", f"{tokens / dt:.0f}", f"{tokens / dt / base:.2f}x"])
    cpu_only = device.type == "cpu"
    notes = [f"Model: {preset} preset, {rows} x {seq_len} tokens per step, full training step (forward, backward, "
             f"clip, AdamW), median of {steps} interleaved steps after one warm-up step each."]
    if cpu_only:
        flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
        has = {f: f in flags.split() for f in ("avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16")}
        notes.append("CPU-only numbers. This CPU's bf16/fp16 matmul instructions: "
                     + ", ".join(f"{f} {'yes' if v else 'no'}" for f, v in has.items())
                     + ". Without fp16 instructions fp16 matmuls take a slow fallback path, so fp16 autocast "
                     "is slow here; that is a CPU artefact. On an H100 bf16 and fp16 both run on tensor cores "
                     "at the same peak (989 TFLOP/s dense), 2x the TF32 rate and ~15x plain fp32.")
        notes.append("Shared 2-core machine: other processes were running; ratios are more reliable than "
                     "absolute tok/s.")
        notes.append("fp8 on CPU upcasts its fp8 operands and multiplies in fp32 (torch._scaled_mm is a reference "
                     "loop on CPU), and pays the casts: its CPU rate says nothing of a GPU's (`--only fp8` there).")
    common.write_result(out, "L2_autocast_throughput",
                        f"L2: training throughput by precision ({'CPU only' if cpu_only else device.type})",
                        ["precision", "step ms", "tokens/s", "vs fp32"], table, notes)
    common.answer("L2", ", ".join(f"{r[0]} {r[3]}" for r in table[1:]) + f" of fp32 tokens/s ({device.type})")


# ---------------------------------------------------------------- L3

def aligned_reference(n):
    return max(256, round(n / 256) * 256)


def matmul_table(device, sizes, dtypes, rounds, out):
    sizes = sorted(set(sizes) | {aligned_reference(n) for n in sizes})
    rates = {(d, n): [] for d in dtypes for n in sizes}
    for _ in range(rounds):  # round-robin, so background load spreads over every size
        for d in dtypes:
            for n in sizes:
                rates[(d, n)].append(common.matmul_tflops(n, DTYPES[d], device, min_s=0.1))
    peak = common.gpu_peak_tflops()
    table, ratios = [], {}
    for d in dtypes:
        for n in sizes:
            tf = statistics.median(rates[(d, n)])
            ref = aligned_reference(n)
            ratio = tf / statistics.median(rates[(d, ref)])
            row = [d, n, ref, f"{tf:.3f}", f"{ratio:.2f}"]
            if peak:
                row.append(f"{tf / peak:.0%}")
            table.append(row)
            ratios[(d, n)] = ratio
    header = ["dtype", "n (n x n x n)", "aligned reference", "TFLOP/s", "vs reference"]
    if peak:
        header.append("of peak")
    cpu_only = device.type == "cpu"
    notes = [f"Median of {rounds} rounds; TFLOP/s counts the useful 2·n^3 FLOPs. Reference = n rounded to a "
             "multiple of 256."]
    if cpu_only:
        notes.append("CPU only, scaled down (2048 instead of 8192: a CPU does 8192^3 in tens of seconds). A CPU "
                     "has no tensor-core tiles: what is measured here is the cost of odd leading dimensions in "
                     "oneDNN's blocking and vector lanes. On a GPU (run this script there: 8192 vs 8191/8200) "
                     "an unaligned n also loses 16-byte aligned loads, so cuBLAS falls back to slower kernels, "
                     "and n = 8200 pays tile/wave quantization: ceil(8200/128) = 65 tiles for 64 tiles of work.")
    else:
        notes.append("Tensor cores want every dimension a multiple of 8 (bf16/fp16: 16 bytes); 8191 breaks "
                     "alignment, 8200 keeps it but needs an extra partial tile per row and column of tiles.")
    common.write_result(out, "L3_matmul_alignment",
                        f"L3: matmul rate at tile-aligned vs unaligned sizes ({'CPU only' if cpu_only else device})",
                        header, table, notes)
    pairs = [n for n in sizes if n - 1 in sizes and n + 8 in sizes]  # 8192 with 8191 and 8200, or its stand-in
    if pairs:
        n = max(pairs)
        common.answer("L3", "; ".join(f"{d}: n={n - 1} {ratios[(d, n - 1)]:.2f}x, n={n + 8} {ratios[(d, n + 8)]:.2f}x "
                                      f"the rate of n={n}" for d in dtypes) + f" ({device.type})")


# ---------------------------------------------------------------- fp8: loss gap, matmul rate

def fp8_matmul_tflops(n, device):
    """TFLOP/s of an n x n x n torch._scaled_mm, e4m3 x e4m3 -> bf16 (fast accumulation, as fp8.py's forward)."""
    a = torch.randn(n, n, device=device).to(fp8.E4M3)
    b = torch.randn(n, n, device=device).to(fp8.E4M3).t()  # column-major, as _scaled_mm wants
    one = torch.ones((), device=device)
    mm = lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,  # noqa: E731
                                  use_fast_accum=True)
    return 2 * n ** 3 / common.time_it(mm, device, min_s=0.3) / 1e12


def fp8_table(device, preset, rows, seq_len, steps, n, out, shape):
    loader = TokenLoader(common.pystdlib_folder(), "train", seq_len, rows, seed=1337, device=device, prefetch=False)
    losses = {}
    for mode in ("bf16", "fp8"):
        run = common.TrainStep(mode, device, preset, **shape)
        losses[mode] = [run(*loader.get(step)).item() for step in range(steps)]
    last = min(10, steps)
    tail = {m: statistics.mean(v[-last:]) for m, v in losses.items()}
    step_gaps = [abs(f / b - 1) for f, b in zip(losses["fp8"], losses["bf16"])]
    table = [[m, f"{v[0]:.4f}", f"{v[-1]:.4f}", f"{tail[m]:.4f}", f"{tail[m] / tail['bf16'] - 1:+.2%}"]
             for m, v in losses.items()]
    sized = f" with {', '.join(f'{k}={v}' for k, v in shape.items())}" if shape else ""
    notes = [f"{preset} preset{sized}, {rows} x {seq_len} pystdlib tokens per step, {steps} steps of common.TrainStep "
             f"(AdamW 3e-4, clip 1), the same initial weights and batches; mean of the last {last} steps. Largest "
             f"per-step gap {max(step_gaps):.2%}."]
    rate = ["8192^3 matmul", "-", "-", "-", "skipped: needs a CUDA GPU (torch._scaled_mm is a reference loop on CPU)"]
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):
        bf16, f8 = common.matmul_tflops(n, torch.bfloat16, device, min_s=0.3), fp8_matmul_tflops(n, device)
        rate = [f"{n}^3 matmul", f"bf16 {bf16:.0f} TFLOP/s", f"fp8 {f8:.0f} TFLOP/s", "-", f"fp8 {f8 / bf16:.2f}x bf16"]
        notes.append("Matmul: a @ b in bf16 against torch._scaled_mm of e4m3 operands (b column-major) to bf16 with "
                     "fast accumulation, unit scales; useful 2n^3 FLOPs. Hopper's dense peaks: 989 (bf16), 1979 (fp8).")
    common.write_result(out, "fp8_vs_bf16", f"fp8 against bf16: loss over a short run, matmul rate ({device.type})",
                        ["mode", "first loss", "last loss", f"mean of last {last}", "vs bf16"], table + [rate], notes)
    print(f"fp8: mean loss of the last {last} steps {tail['fp8'] / tail['bf16'] - 1:+.2%} against bf16; "
          f"{rate[-1]}", flush=True)


# ---------------------------------------------------------------- L4

def grads_of(model, mode, device, x, y, divide, scale):
    model.zero_grad(set_to_none=True)
    with common.autocast(mode, device):
        loss = model(x, y) / divide
    (loss * scale).backward()
    return {n: p.grad.float() / scale for n, p in model.named_parameters()}


def underflow_table(device, rows, seq_len, divisors, out, shape):
    x, y = batch(device, rows, seq_len)
    model = common.build_gpt("tiny", device=device, **shape)
    ref1 = grads_of(model, "fp32", device, x, y, 1, 1.0)
    table, summary = [], {}
    for k in divisors:
        ref = {n: g / k for n, g in ref1.items()}  # exact: k is a power of two
        nonzero = sum(int((g != 0).sum()) for g in ref.values())
        for mode, scale in (("fp16", 1.0), ("fp16", 2.0 ** 16), ("bf16", 1.0)):
            got = grads_of(model, mode, device, x, y, k, scale)
            zeroed = sum(int(((got[n] == 0) & (ref[n] != 0)).sum()) for n in ref)
            bad = sum(int((~torch.isfinite(g)).sum()) for g in got.values())
            err = (sum(float((got[n] - ref[n]).pow(2).sum()) for n in ref) /
                   sum(float(g.pow(2).sum()) for g in ref.values())) ** 0.5
            table.append([k, rows * seq_len * k, mode, f"{scale:g}", f"{zeroed / nonzero:.2%}", f"{err:.2e}", bad])
            summary[(k, mode, scale)] = zeroed / nonzero
    notes = [f"Tiny GPT, one batch of {rows} x {seq_len} pystdlib tokens, the loss divided by k as train.py does "
             "for k accumulated micro-batches (so per-token gradients shrink as in a k-times larger batch). "
             "Reference: the same weights and batch in fp32. 'zeroed' counts gradient elements that are nonzero "
             "in fp32 and exactly zero in the autocast run, after dividing the scale back out.",
             "Where it happens: fp32 CE gives d logits ~ 1/tokens; that gradient enters the backward of every "
             "matmul in fp16, whose smallest subnormal is 2^-24 ~ 6e-8 (normal 6e-5), so small activation "
             "gradients flush to zero. bf16 has fp32's 8-bit exponent (min normal ~1e-38): no scaling needed, "
             "only less mantissa.",
             "The fix: optim.LossScaler multiplies the loss by 2^16 before backward and divides the fp32 gradients "
             "after; on inf/nan it skips the step and halves the scale (train.py --dtype fp16)."]
    if device.type == "cpu":
        notes.append("Run on CPU: rounding to fp16/bf16 is the same as on a GPU (only the accumulation order "
                     "differs), so the counts carry over.")
    common.write_result(out, "L4_fp16_underflow", "L4: fp16 gradient underflow without and with loss scaling",
                        ["loss / k", "tokens equivalent", "autocast", "loss scale", "zeroed grads", "rel. error",
                         "inf/nan"], table, notes)
    k = max(divisors)
    common.answer("L4", f"at loss/{k}: fp16 unscaled zeroes {summary[(k, 'fp16', 1.0)]:.1%} of nonzero grads, "
                        f"with scale 65536 {summary[(k, 'fp16', 2.0 ** 16)]:.1%}, bf16 {summary[(k, 'bf16', 1.0)]:.1%}")


@common.command
def main(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--only", choices=["L1", "L2", "L3", "L4", "fp8"], help="run one table")
    p.add_argument("--device", help="cpu | cuda (default: cuda if available)")
    p.add_argument("--sizes", help="L3 matrix sizes, comma-separated (default by device)")
    args = p.parse_args(argv)
    device = torch.device(args.device or common.default_device())
    gpu = device.type == "cuda"
    if args.quick:
        l1, l2, l3, l4 = (2, 32), ("tiny", 2, 32, 2), [256, 255, 264], (2, 32, [1, 4096])
        f8 = ("tiny", 2, 32, 3, 256)
    elif gpu:
        l1, l2, f8 = (8, 256), ("small", 8, 1024, 10), ("small", 8, 1024, 200, 8192)
        l3 = [1024, 2048, 4096, 4095, 4100, 8000, 8184, 8190, 8191, 8192, 8193, 8200, 8208, 8256, 16384]
        l4 = (8, 256, [1, 256, 4096, 65536])
    else:
        l1, l2, f8 = (4, 128), ("tiny", 4, 256, 6), ("tiny", 4, 32, 200, 8192)
        l3 = [512, 1000, 1023, 1024, 1025, 1536, 2047, 2048, 2049, 2056, 2064]
        l4 = (4, 128, [1, 256, 4096, 65536])
    if args.sizes:
        l3 = [int(s) for s in args.sizes.split(",")]
    l3_dtypes = ["bf16"] if gpu else ["fp32", "bf16"]
    todo = [args.only] if args.only else ["L1", "L2", "L3", "L4", "fp8"]
    shape = common.QUICK_MODEL if args.quick else {}
    torch.manual_seed(0)
    if "L1" in todo:
        dtype_table(device, *l1, args.out, shape)
    if "L2" in todo:
        throughput_table(device, *l2, args.out, shape)
    if "L3" in todo:
        matmul_table(device, l3, l3_dtypes, 1 if args.quick else 3, args.out)
    if "L4" in todo:
        underflow_table(device, *l4, args.out, shape)
    if "fp8" in todo:  # on CPU fp8 pays its casts op by op: a 2-layer tiny model keeps the run about a minute
        fp8_table(device, *f8, args.out, shape or ({} if gpu else dict(common.QUICK_MODEL, n_layer=2, d_model=64,
                                                                             n_head=4, n_kv_head=2, ffn_dim=128)))

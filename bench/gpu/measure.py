"""One GPU, one command of under 10 minutes, into --out: gpu.md and plan_factors.json.

    python -m bench.gpu --out DIR   # CUDA: small (seq 1024) and 1b (seq 2048); ends within --budget-s (480 s)
    python -m bench.gpu --smoke     # CPU, tiny shapes, every part (tests/test_gpu_bench.py runs it)

gpu.md's parts: 1. our step (train.py), 2. Hugging Face's (hf.py), 3. the attention kernels, 4. ring attention against
SDPA (checks.py), 5. fp8 against 1.'s bf16, 6. the planner's factors (factors.py); run in SCHEDULE's order, the rows
that matter most first. The budget leaves 2 minutes of 10 to start-up and the report; every run is a child killed at
its deadline (its row keeps the steps it finished), started only with MIN_START_S left; each section is written at
once. No GPU and no --smoke: says so and exits 0.
"""
import sys
import tempfile
import time
from pathlib import Path

import torch

import model
from bench import common
from bench.gpu import checks as gpu_checks
from bench.gpu import factors as gpu_factors
from bench.gpu.hf import transformers
from bench.gpu.runs import run_hf, run_ours
from config import nonnegative_float, positive_int

GPU_RUNS = [("small", {"seq_len": 1024}, 16), ("1b", {"seq_len": 2048}, 8)]  # preset, overrides, micro-batch
SMOKE_RUNS = [("tiny", dict(n_layer=2, d_model=64, n_head=4, n_kv_head=2, ffn_dim=128, seq_len=64), 4)]
GPU_ATTN, SMOKE_ATTN = (2, 32, 8, 2048, 64), (1, 4, 2, 64, 16)  # batch, heads, kv heads, seq, head dim (1b's heads)
SCHEDULE = [("ours", True), ("hf", True), ("factors", None), ("ours", False), ("hf", False), ("fp8", True),
            ("kernels", None), ("ring", None)]  # (part, compiled)
BUDGET_S = 480.0
RUN_CAP_S = {True: 150.0, False: 90.0}    # the most one compiled / eager run may take
MIN_START_S = {True: 60.0, False: 20.0, None: 10.0}  # a run (an in-process part) starts only with this much left
NO_HF = "transformers not installed (bench-only dependency)"
OURS = [("tok_s", ".0f"), ("mfu_pct", ".1f"), ("tflops", ".3g"), ("mem", ".3g"), ("reserved", ".3g")]


class Run:
    """The sizes (CUDA, or tiny ones on CPU with --smoke), the budget, and gpu.md."""

    def __init__(self, smoke, steps, budget_s, out, command):
        self.smoke, self.device = smoke, torch.device("cpu" if smoke else "cuda")
        self.dtype, self.modes = ("fp32", [False]) if smoke else ("bf16", [True, False])
        self.runs, self.attn = (SMOKE_RUNS, SMOKE_ATTN) if smoke else (GPU_RUNS, GPU_ATTN)
        self.steps = steps or (3 if smoke else 30)
        self.window = max(1, min(10, self.steps - 1))  # the medians are over the last 10 steps
        self.t0, self.budget = time.perf_counter(), budget_s
        self.out, self.command, self.sections, self.results = Path(out), command, {}, {}
        self.path = self.out / "gpu.md"
        self.name = f"CPU ({common.cpu_name()})" if smoke else torch.cuda.get_device_name()
        self.head = [f"# One {'CPU (smoke test: no GPU number here)' if smoke else 'GPU'}: training throughput, "
                     "attention kernels, ring attention, the planner's factors", "",
                     f"Date: {time.strftime('%Y-%m-%d')}  ", f"Device: {self.name}  ", f"torch: {torch.__version__}"
                     f"{'' if smoke else f' (CUDA {torch.version.cuda})'}  ", f"Hardware: {common.hardware_line()}"]

    def left(self):
        return self.t0 + self.budget - time.perf_counter()

    def skip(self, compiled):
        """Why a run or part does not start (too little budget left), or None. --smoke runs everything."""
        left = self.left()
        return None if self.smoke or left >= MIN_START_S[compiled] else f"skipped: budget spent ({left:.0f} s left)"

    def deadline(self, compiled):
        return max(0.0, min(RUN_CAP_S[compiled], self.left()))

    def log(self, text):
        print(f"[bench.gpu {time.perf_counter() - self.t0:4.0f} s] {text}", flush=True)

    def table(self, title, header, rows, notes):
        """Adds a section ("N. title") and rewrites gpu.md, sections in their order: a kill keeps what ran."""
        self.sections[title] = ["", f"## {title}", "", f"Command: `{self.command}`", "",
                                common.markdown_table(header, rows), "", *[f"- {n}" for n in notes]]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("\n".join(self.head + [x for t in sorted(self.sections) for x in self.sections[t]]) + "\n")


def cells(d, *specs):
    """The values of `d` for ("key", "format") specs, "-" where missing."""
    return ["-" if d.get(k) is None else format(d[k], f) for k, f in specs]


def sweep(r, what, fn, compiled):
    """fn(preset, overrides, micro) for each model, or its skip reason: {preset: (result, status)}."""
    out = {}
    for preset, overrides, micro in r.runs:
        t0, why = time.perf_counter(), r.skip(compiled)
        mode = "compiled" if compiled else "eager"
        r.log(f"{what} {preset} {mode}: {why or f'{r.steps} steps, at most {r.deadline(compiled):.0f} s'}")
        out[preset] = ({}, why) if why else fn(preset, overrides, micro)
        r.log(f"{what} {preset} {mode}: {out[preset][1]} ({time.perf_counter() - t0:.0f} s)")
    return out


def result(r, part, compiled, preset):
    return r.results.get((part, compiled, preset), ({}, "not run"))


def report_training(r):
    """Sections 1, 2 and 5 from the runs so far (each reads the others' rows: ours / HF, fp8 / bf16)."""
    rows1, rows2, rows5 = [], [], []
    for c in r.modes:
        for p, o, m in r.runs:
            mode, (mine, status) = "compiled" if c else "eager", result(r, "ours", c, p)
            rows1.append([p, mode, o["seq_len"], m, *cells(mine, *OURS), status])
            theirs, status = result(r, "hf", c, p)
            peak = mine["tflops"] / mine["mfu"] if mine.get("mfu") else common.gpu_peak_tflops()  # train.py's peak
            flops = model.flops_per_token(common.preset_config(p, **o))
            mfu = theirs.get("tok_s") and peak and 100 * flops * theirs["tok_s"] / (peak * 1e12)
            ratio = mine.get("tok_s") and theirs.get("tok_s") and mine["tok_s"] / theirs["tok_s"]
            rows2.append([p, mode, *([NO_HF] if transformers is None else cells(theirs, ("tok_s", ".0f"))), *cells(
                dict(theirs, mfu=mfu, ours=mine.get("tok_s"), ratio=ratio), ("mfu", ".1f"), ("mem", ".2f"),
                ("reserved", ".2f"), ("attn", "s"), ("ours", ".0f"), ("ratio", ".2f")), status])
    c = r.modes[0]  # fp8: compiled on a GPU
    for p, o, m in r.runs:
        got, status = result(r, "fp8", c, p)
        base = result(r, "ours", c, p)[0].get("tok_s")
        ratio = got.get("tok_s") and base and got["tok_s"] / base
        rows5.append([p, "compiled" if c else "eager", o["seq_len"], m, *cells(
            dict(got, base=base, ratio=ratio), ("tok_s", ".0f"), ("mfu_pct", ".1f"), ("mem", ".2f"), ("base", ".0f"),
            ("ratio", ".2f")), status])
    r.table("1. Our training step (train.py)", ["model", "compile", "seq", "micro-batch", "tokens/s", "MFU %",
            "TFLOP/s", "peak alloc GB", "peak reserved GB", "status"], rows1,
            [f"train.py --device {r.device.type} --dtype {r.dtype} in a child process, global batch = micro-batch, "
             f"{r.steps} steps: medians of the last {r.window} --metrics rows but the first (it compiles); memory: "
             "their largest per-step peak (CPU: peak RSS). MFU: train.py's, 6N + 12·L·d·T FLOPs/token over the device "
             "table's bf16 peak (CPU: a measured rate). A run stopped at the budget keeps the steps it finished."])
    amp = "bf16 autocast" if r.dtype == "bf16" else "fp32"
    r.table("2. Hugging Face LlamaForCausalLM, same shapes", ["model", "compile", "HF tokens/s", "HF MFU %",
            "HF peak alloc GB", "HF peak reserved GB", "HF attention", "ours tokens/s", "ours / HF", "status"], rows2,
            [f"transformers {getattr(transformers, '__version__', '-')}: bench/gpu/hf.py in a child process, "
             f"LlamaForCausalLM(LlamaConfig(hf_config(cfg))), torch.compile of the whole model when compiled, {amp}, "
             "fp32 cross-entropy, clip 1.0, AdamW (fused on CUDA), random ids in our batch shapes; median step of the "
             f"last {r.window} of {r.steps} but the first; memory: the peak over the run. ours / HF > 1: ours is "
             "faster."])
    r.table("5. FP8 block matmuls (--dtype fp8) against the same step", ["model", "compile", "seq", "micro-batch",
            "fp8 tokens/s", "MFU %", "peak alloc GB", f"{r.dtype} tokens/s", f"fp8 / {r.dtype}", "status"], rows5,
            [f"train.py --dtype fp8 as in 1. (q, k, v, o, gate, up, down in e4m3, gradients e5m2, dynamic "
             f"power-of-two tensorwise scales, fp8.py), against 1.'s {r.dtype} row of the same shape. MFU: over the "
             "bf16 peak, as in 1. The goal on 1b: fp8 >= 1.3x bf16 tokens/s."
             + (" Smoke: on CPU fp8 upcasts to an fp32 matmul; the ratio says nothing of a GPU." if r.smoke else "")])


def training(r, tmp, part, compiled):
    """One training part (ours, hf, fp8) for every model, then the training sections again."""
    gpu_fp8 = r.smoke or torch.cuda.get_device_capability() >= (8, 9)
    blocked = {"hf": NO_HF if transformers is None else None,
               "fp8": None if gpu_fp8 else "skipped: no FP8 tensor cores (compute capability < 8.9)"}.get(part)
    if part == "hf":
        def fn(p, o, m):
            return run_hf(r, tmp, p, o, m, compiled)
    else:
        def fn(p, o, m):
            return run_ours(r, tmp, p, o, m, compiled, "fp8" if part == "fp8" else r.dtype)
    got = {p: ({}, blocked) for p, _, _ in r.runs} if blocked else sweep(r, part, fn, compiled)
    for preset, outcome in got.items():
        r.results[part, compiled, preset] = outcome
    report_training(r)


def factors_part(r):
    """6. The planner's factors, measured at the largest model's sizes: printed, and written to plan_factors.json."""
    preset, overrides, micro = r.runs[-1]
    cfg, path = common.preset_config(preset, **overrides), r.out / "plan_factors.json"
    why = r.skip(None) or (None if r.smoke or common.gpu_peak_tflops() else "no bf16 peak for this device's name")
    got, status = ({}, why) if why else gpu_checks.attempt(gpu_factors.measure, cfg, micro, r.device, r.smoke)
    got = got or {}
    if got:
        gpu_factors.write(path, r.name, got)
    rates, factors = got.get("rates", {}), got.get("factors", {})
    rows = [[name, unit, cells(rates, (key, fmt))[0], cells(factors, (factor, ".3g"))[0]]
            for name, unit, key, fmt, factor in (("matmul, a block's linears", "TFLOP/s", "matmul_tflops", ".4g", "mm"),
                ("attention fwd + bwd (12 d T per token)", "TFLOP/s", "attention_tflops", ".4g", "attn"),
                ("elementwise (an out-of-place add)", "GB/s", "memory_gbs", ".4g", "elem"),
                ("host launch per tiny op", "us", "launch_us", ".3g", "launch_us"),
                ("fp8 matmuls over bf16", "x", "fp8_over_bf16", ".3g", "fp8"))]
    r.log(f"factors: {status}; " + ", ".join(f"{k} {v:.3g}" for k, v in factors.items()))
    r.table("6. This code's efficiency factors for the planner", ["what", "unit", "measured", "planner factor"], rows,
            [f"{status}. bench/gpu/factors.py, at {preset}'s sizes ({got.get('sizes', '-')}); the factors are the "
             "planner's (bench/planner/factors.py): fractions of the bf16 peak (matmul and attention, their rows and "
             f"keys losses taken out) and of the HBM bandwidth. Use: `python -m bench.planner --code ours --factors "
             f"{path.name}` (written beside gpu.md)" + (". Smoke: CPU rates, no GPU factor." if r.smoke else ".")])


def schedule(smoke):
    """SCHEDULE, with the compiled rows run eager on CPU (--smoke): each part once, in order."""
    out = []
    for part, compiled in SCHEDULE:
        step = (part, False if smoke and compiled is not None else compiled)
        if step not in out:
            out.append(step)
    return out


@common.command
def main(argv=None):
    p = common.parser(__doc__, results=False)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, every part: checks the script")
    p.add_argument("--out", default=str(common.RESULTS), help="folder for gpu.md and plan_factors.json")
    p.add_argument("--steps", type=positive_int, help="optimizer steps per run (default 30, --smoke 3)")
    p.add_argument("--budget-s", type=nonnegative_float, default=BUDGET_S,
                   help="the whole run's time budget, runs included")
    args = p.parse_args(argv)
    if not args.smoke and not common.has_cuda():
        print("bench.gpu: needs a CUDA GPU (none visible); skipped. `--smoke` checks the script on CPU.", flush=True)
        return 0
    shown = list(sys.argv[1:] if argv is None else argv)
    if "--out" in shown[:-1]:  # where the file goes does not change it
        del shown[shown.index("--out"):shown.index("--out") + 2]
    r = Run(args.smoke, args.steps, args.budget_s, args.out, " ".join(["python -m bench.gpu", *shown]))
    with tempfile.TemporaryDirectory() as tmp:
        for part, compiled in schedule(r.smoke):
            if part in ("ours", "hf", "fp8"):
                training(r, Path(tmp), part, compiled)
            elif part == "factors":
                factors_part(r)
            elif r.skip(None):  # the checks: their section says why they did not run
                title = {"kernels": "3. Attention kernels that actually ran", "ring": "4. Ring attention vs SDPA"}[part]
                r.table(title, ["status"], [[r.skip(None)]], [])
            else:
                {"kernels": gpu_checks.kernel_part, "ring": gpu_checks.ring_part}[part](r)
    done = [f"{p} {'compiled' if c else 'eager'} {100 * x['mfu']:.1f}%" for (part, c, p), (x, _) in r.results.items()
            if part == "ours" and x.get("mfu")]
    if done:
        common.answer("L22", f"MFU {', '.join(done)} ({r.name}, {r.dtype}{', smoke' if r.smoke else ''})")
    r.log(f"wrote {r.path}")
    print(r.path.read_text(), flush=True)
    return 0

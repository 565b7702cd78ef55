"""One GPU in under 10 minutes, into bench/results/gpu.md: 1. our training step (train.main in-process, --metrics):
tokens/s, MFU, peak memory; 2. Hugging Face's LlamaForCausalLM of the same shapes (optional); 3. the attention kernels
the profiler sees; 4. ring attention (cp = 1) and its block kernels against SDPA on the same bf16 inputs; 5. the step
with --dtype fp8 against 1.'s bf16 (FP8 tensor cores: compute capability 8.9+).

    python bench/gpu.py            # CUDA: small (seq 1024) and 1b (seq 2048), bf16, compiled and eager; fp8 compiled
    python bench/gpu.py --smoke    # CPU, tiny shapes, every part (tests/test_gpu_bench.py runs it)

Each part has a time budget: what does not fit is reported as skipped, an OOM in its row. No GPU, no --smoke: exits 0.
"""
import argparse
import gc
import json
import shutil
import sys
import tempfile
import time
import traceback
from collections import Counter
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import model as M  # noqa: E402
import train  # noqa: E402
from bench import common  # noqa: E402
from parallel.comm import CommStats, Group  # noqa: E402
from parallel.ring_attention import KERNELS, RingAttention, pick_kernel  # noqa: E402
from saves.export import hf_config  # noqa: E402

try:  # a bench-only dependency (requirements-dev.txt): without it part 2 says so and the rest runs
    import transformers
except ImportError:
    transformers = None

SHARES = {"kernels": 20, "ring": 40, "ours": 210, "fp8": 90, "hf": 180}  # seconds of the default 540-s budget
MIN_START_S = {True: 90, False: 30}  # a compiled / eager run starts only with this much of its part's budget left
GPU_RUNS = [("small", {"seq_len": 1024}, 16), ("1b", {"seq_len": 2048}, 8)]  # preset, overrides, micro-batch
SMOKE_RUNS = [("tiny", dict(n_layer=2, d_model=64, n_head=4, n_kv_head=2, ffn_dim=128, seq_len=64), 4)]
GPU_ATTN, SMOKE_ATTN = (2, 32, 8, 2048, 64), (1, 4, 2, 64, 16)  # batch, heads, kv heads, seq, head dim (1b's heads)
NO_HF = "transformers not installed (bench-only dependency)"
TOL = 2 ** -5  # bf16: max |diff| <= TOL x max(1, max |reference|), about 4 ulps of the tensor's largest element
CLASSES = {"cudnn": ("cudnn",), "flash": ("flash",), "efficient": ("fmha", "memeff", "efficientatt"),  # by name
           "math": ("attentionmath", "softmax", "logsumexp", "gemm", "bmm", "matmul", "nvjet", "xmma", "aten::mm")}
OURS = [("tok_s", ".0f"), ("mfu_pct", ".1f"), ("tflops", ".3g"), ("mem", ".2f"), ("reserved", ".2f")]
OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


class Run:
    """The sizes (CUDA, or tiny ones on CPU with --smoke), each part's deadline, and gpu.md."""

    def __init__(self, smoke, steps, budget_s, out, command):
        self.smoke, self.device = smoke, torch.device("cpu" if smoke else "cuda")
        self.dtype, self.modes = ("fp32", [False]) if smoke else ("bf16", [True, False])  # compiled first
        self.runs, self.attn = (SMOKE_RUNS, SMOKE_ATTN) if smoke else (GPU_RUNS, GPU_ATTN)
        self.steps = steps or (3 if smoke else 30)
        self.window = max(1, min(10, self.steps - 1))  # the medians are over the last 10 steps
        self.t0, self.budget, self.planned = time.perf_counter(), budget_s, 0.0
        self.path, self.command, self.sections = Path(out) / "gpu.md", command, {}
        self.name = f"CPU ({common.cpu_name()})" if smoke else torch.cuda.get_device_name()
        self.head = [f"# One {'CPU (smoke test: no GPU number here)' if smoke else 'GPU'}: training throughput, "
                     "attention kernels, ring attention", "", f"Date: {time.strftime('%Y-%m-%d')}  ",
                     f"Device: {self.name}  ", f"torch: {torch.__version__}"
                     f"{'' if smoke else f' (CUDA {torch.version.cuda})'}  ", f"Hardware: {common.hardware_line()}"]

    def start(self, part):
        self.planned += SHARES[part] * self.budget / sum(SHARES.values())
        self.log(f"part {part}: {self.left():.0f} s of budget")

    def left(self):
        return self.t0 + self.planned - time.perf_counter()

    def skip(self, compiled):
        return None if self.smoke or self.left() >= MIN_START_S[compiled] else f"skipped: {self.left():.0f} s left"

    def log(self, text):
        print(f"[gpu.py {time.perf_counter() - self.t0:4.0f} s] {text}", flush=True)

    def table(self, title, header, rows, notes):
        """Adds a section ("N. title") and rewrites gpu.md, sections in their order: a kill keeps what ran."""
        self.sections[title] = ["", f"## {title}", "", f"Command: `{self.command}`", "",
                                common.markdown_table(header, rows), "", *[f"- {n}" for n in notes]]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("\n".join(self.head + [x for t in sorted(self.sections) for x in self.sections[t]]) + "\n")


def attempt(fn, *args):
    """(fn(*args), "ok"), or (None, what went wrong): an OOM or any failure is its row's status, not the end. Frees
    what the run before left (compiled graphs, cached blocks) and resets the peak-memory counters first."""
    gc.collect()
    if hasattr(torch, "compiler") and hasattr(torch.compiler, "reset"):
        torch.compiler.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        return fn(*args), "ok"
    except OOM:
        return None, "OOM"
    except SystemExit as e:
        return None, f"train.py exited with status {e.code}"
    except Exception as e:  # the row says what failed; the traceback goes to stderr
        traceback.print_exc()
        return None, "OOM" if "out of memory" in str(e) else f"error: {type(e).__name__}: {str(e)[:120]}".split("\n")[0]


def cells(d, *specs):
    """The values of `d` for ("key", "format") specs, "-" where missing."""
    return ["-" if d.get(k) is None else format(d[k], f) for k, f in specs]


def model_cfg(preset, overrides):
    fields = {**M.PRESETS[preset].__dict__, **overrides}
    fields["vocab_size"] = fields["vocab_size"] or 257  # the pystdlib byte corpus train.py reads by default
    return M.ModelConfig(**fields)


# ---------------------------------------------------------------- 1. ours, 2. Hugging Face

def run_ours(r, preset, overrides, micro, compiled, metrics, dtype=None):
    shm = Path("/dev/shm")  # train.py saves at its last step (untimed, 12 B/param): into RAM when it has room
    room = shm.is_dir() and shutil.disk_usage(shm).free > 15 * M.param_counts(model_cfg(preset, overrides))[0]
    with tempfile.TemporaryDirectory(dir=shm if room else None) as out:
        flags = [x for k, v in overrides.items() for x in (f"--{k.replace('_', '-')}", str(v))]
        train.main(["--model", preset, *flags, "--device", r.device.type, "--dtype", dtype or r.dtype,
                    "--steps", str(r.steps),
                    "--compile" if compiled else "--no-compile", "--micro-batch", str(micro), "--global-batch",
                    str(micro), "--log-every", "0", "--eval-every", "0", "--metrics", str(metrics), "--out", out])
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()][-r.window:]
    peak = lambda key: max((row[key] for row in rows if row.get(key) is not None), default=None)  # noqa: E731
    median = lambda key: common.median([row.get(key) for row in rows])  # noqa: E731
    return dict(tok_s=median("tok_s"), mfu=median("mfu"), mfu_pct=median("mfu") and 100 * median("mfu"),
                tflops=median("tflops"), mem=peak("mem_gb"), reserved=peak("mem_reserved_gb"))


def run_hf(r, cfg, micro, compiled):
    fields = {k: v for k, v in hf_config(cfg).items() if k not in ("architectures", "model_type", "torch_dtype")}
    torch.manual_seed(0)
    with r.device:
        net = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields, attn_implementation="sdpa")).train()
    forward = torch.compile(net) if compiled else net
    opt = torch.optim.AdamW(net.parameters(), 3e-4, (0.9, 0.95), weight_decay=0.1, fused=r.device.type == "cuda")
    amp = torch.autocast(r.device.type, dtype=torch.bfloat16) if r.dtype == "bf16" else nullcontext()
    times = []
    for _ in range(r.steps):
        x = torch.randint(0, cfg.vocab_size, (micro, cfg.seq_len + 1), device=r.device)
        t0 = time.perf_counter()
        with amp:
            logits = forward(input_ids=x[:, :-1], use_cache=False).logits
            loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        common.sync(r.device)
        times.append(time.perf_counter() - t0)
    cuda = r.device.type == "cuda"
    return dict(tok_s=micro * cfg.seq_len / common.median(times[-r.window:]), attn=net.config._attn_implementation,
                mem=torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
                reserved=torch.cuda.max_memory_reserved() / 1e9 if cuda else None)


def sweep(r, what, fn, row, blocked=None, modes=None):
    """fn(preset, overrides, micro, compiled) for each configuration in budget: ({(preset, compiled): result}, rows)."""
    results, rows = {}, []
    for compiled in modes or r.modes:
        for preset, overrides, micro in r.runs:
            mode, t0 = "compiled" if compiled else "eager", time.perf_counter()
            got, status = {}, blocked or r.skip(compiled)
            if not status:
                r.log(f"{what} {preset} {mode}: {r.steps} steps")
                got, status = attempt(fn, preset, overrides, micro, compiled)
            results[preset, compiled] = got = got or {}
            rows.append([preset, mode, *row(preset, overrides, micro, compiled, got), status])
            r.log(f"{what} {preset} {mode}: {' | '.join(map(str, rows[-1][2:]))} ({time.perf_counter() - t0:.0f} s)")
    return results, rows


def training_parts(r):
    r.start("ours")
    with tempfile.TemporaryDirectory() as tmp:
        ours, rows = sweep(r, "ours", lambda p, o, m, c: run_ours(r, p, o, m, c, Path(tmp) / f"{p}{c}.jsonl"),
                           lambda p, o, m, c, x: [o["seq_len"], m, *cells(x, *OURS)])
    r.table("1. Our training step (train.main, in-process)", ["model", "compile", "seq", "micro-batch", "tokens/s",
            "MFU %", "TFLOP/s", "peak alloc GB", "peak reserved GB", "status"], rows,
            [f"train.main --device {r.device.type} --dtype {r.dtype}, global batch = micro-batch, {r.steps} steps: "
             f"medians of the last {r.window} --metrics rows; memory: their largest per-step peak (CPU: peak RSS). "
             "MFU: train.py's, 6N + 12·L·d·T FLOPs/token over the device table's bf16 peak (CPU: a measured rate)."])
    done = [f"{p} {'compiled' if c else 'eager'} {100 * x['mfu']:.1f}%" for (p, c), x in ours.items() if x.get("mfu")]
    if done:
        common.answer("L22", f"MFU {', '.join(done)} ({r.name}, {r.dtype}{', smoke' if r.smoke else ''})")
    fp8_part(r, ours)

    def versus(preset, overrides, micro, compiled, theirs):
        cfg, mine = model_cfg(preset, overrides), ours[preset, compiled]
        peak = mine["tflops"] / mine["mfu"] if mine.get("mfu") else common.gpu_peak_tflops()  # train.py's peak
        mfu = theirs.get("tok_s") and peak and 100 * M.flops_per_token(cfg) * theirs["tok_s"] / (peak * 1e12)
        ratio = mine.get("tok_s") and theirs.get("tok_s") and mine["tok_s"] / theirs["tok_s"]
        return ([NO_HF] if transformers is None else cells(theirs, ("tok_s", ".0f"))) + cells(
            dict(theirs, mfu=mfu, ours=mine.get("tok_s"), ratio=ratio), ("mfu", ".1f"), ("mem", ".2f"),
            ("reserved", ".2f"), ("attn", "s"), ("ours", ".0f"), ("ratio", ".2f"))
    r.start("hf")
    _, rows = sweep(r, "Hugging Face", lambda p, o, m, c: run_hf(r, model_cfg(p, o), m, c), versus,
                    NO_HF if transformers is None else None)
    r.table("2. Hugging Face LlamaForCausalLM, same shapes", ["model", "compile", "HF tokens/s", "HF MFU %",
            "HF peak alloc GB", "HF peak reserved GB", "HF attention", "ours tokens/s", "ours / HF", "status"], rows,
            [f"transformers {getattr(transformers, '__version__', '-')}: LlamaForCausalLM(LlamaConfig(hf_config(cfg)))"
             f", torch.compile of the whole model when compiled, {'bf16 autocast' if r.dtype == 'bf16' else 'fp32'}, "
             "fp32 cross-entropy, clip 1.0, AdamW (fused on CUDA), random ids in our batch shapes; median step of the "
             f"last {r.window} of {r.steps}; memory: the peak over the whole run. ours / HF > 1: ours is faster."])


def fp8_part(r, ours):
    """5. --dtype fp8 (fp8.py), compiled on a GPU, against part 1's run of the same shape in r.dtype."""
    r.start("fp8")
    gpu_fp8 = r.smoke or torch.cuda.get_device_capability() >= (8, 9)

    def row(preset, overrides, micro, compiled, got):
        base = ours[preset, compiled].get("tok_s")
        ratio = got.get("tok_s") and base and got["tok_s"] / base
        return [overrides["seq_len"], micro, *cells(dict(got, base=base, ratio=ratio), ("tok_s", ".0f"),
                                                     ("mfu_pct", ".1f"), ("mem", ".2f"), ("base", ".0f"),
                                                     ("ratio", ".2f"))]
    with tempfile.TemporaryDirectory() as tmp:
        _, rows = sweep(r, "fp8", lambda p, o, m, c: run_ours(r, p, o, m, c, Path(tmp) / f"{p}{c}.jsonl", "fp8"), row,
                        None if gpu_fp8 else "skipped: no FP8 tensor cores (compute capability < 8.9)", r.modes[:1])
    r.table("5. FP8 block matmuls (--dtype fp8) against the same step", ["model", "compile", "seq", "micro-batch",
            "fp8 tokens/s", "MFU %", "peak alloc GB", f"{r.dtype} tokens/s", f"fp8 / {r.dtype}", "status"], rows,
            [f"train.main --dtype fp8 as in 1. (q, k, v, o, gate, up, down in e4m3, gradients e5m2, dynamic "
             f"power-of-two tensorwise scales, fp8.py), against 1.'s {r.dtype} row of the same shape. MFU: over the "
             "bf16 peak, as in 1. The goal on 1b: fp8 >= 1.3x bf16 tokens/s."
             + (" Smoke: on CPU fp8 upcasts to an fp32 matmul; the ratio says nothing of a GPU." if r.smoke else "")])


# ---------------------------------------------------------------- 3. kernels, 4. ring attention vs SDPA

def inputs(shape, device, q_rows=None):
    B, H, Hkv, T, hd = shape
    g = torch.Generator(device=device).manual_seed(0)
    make = lambda h, t: torch.randn((B, h, t, hd), generator=g, device=device, dtype=torch.bfloat16)  # noqa: E731
    return make(H, q_rows or T), make(Hkv, T), make(Hkv, T), make(H, q_rows or T)


def with_grads(attend, q, k, v, dout):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = attend(q, k, v)
    out.backward(dout)
    return [out.detach(), q.grad, k.grad, v.grad]


def kernels_seen(attend, shape, device):
    """{name: calls} in one forward+backward after a warm-up one: CUDA kernels, or on CPU the profiler's aten ops."""
    q, k, v, dout = inputs(shape, device)
    with_grads(attend, q, k, v, dout)
    common.sync(device)
    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
        with_grads(attend, q, k, v, dout)
        common.sync(device)
    return Counter(e.name for e in prof.events() if (e.device_type == DeviceType.CUDA if cuda else
                                                     e.device_type == DeviceType.CPU and e.name.startswith("aten::")))


def kind(name):
    return next((c for c, words in CLASSES.items() if any(w in name.lower().replace("_", "") for w in words)), "other")


def kernel_part(r):
    rows, ran = [], []
    for label, attend in (("model.causal_attention", M.causal_attention),
                          (f"ring attention, cp = 1 ({pick_kernel(inputs(r.attn, r.device)[0])})",
                           RingAttention(Group("cp", [0], None, 0, CommStats())))):
        seen, status = attempt(kernels_seen, attend, r.attn, r.device)
        if not seen:
            rows.append([label, "-", status if seen is None else "the profiler saw no kernel", "-"])
            continue
        others = [n for n in seen if kind(n) == "other"]
        rows += [[label, kind(n), n[:110], seen[n]] for n in seen if kind(n) != "other"]
        rows.append([label, "other", f"{len(others)} kinds, e.g. {', '.join(n[:40] for n in others[:3])}",
                     sum(seen[n] for n in others)])
        ran.append(f"{label}: {', '.join(sorted({kind(n) for n in seen} - {'other'})) or 'no attention kernel'}")
        r.log(ran[-1])
    what = "CUDA kernels" if r.device.type == "cuda" else "aten ops from the CPU profiler (no GPU: no CUDA kernels)"
    r.table("3. Attention kernels that actually ran", ["attention path", "class", "kernel", "calls"], rows,
            [f"{what} in one forward+backward after a warm-up one, bf16, (batch, heads, kv heads, seq, head dim) = "
             f"{r.attn}; classed by name: {', '.join(CLASSES)}, else other."] + ran)


def ring_check(r, kernel, ring, causal, q_rows):
    """[(max |diff|, tolerance)] of out, dq, dk, dv: RingAttention (ring) or the block kernel, against SDPA on the kv
    heads repeated to the query heads."""
    q, k, v, dout = inputs(r.attn, r.device, q_rows)
    repeat = q.shape[1] // k.shape[1]
    ref = with_grads(lambda q, k, v: F.scaled_dot_product_attention(
        q, k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1), is_causal=causal), q, k, v, dout)
    if ring:
        got = with_grads(RingAttention(Group("cp", [0], None, 0, CommStats()), kernel=kernel), q, k, v, dout)
    else:
        (fwd, bwd), scale = KERNELS[kernel], q.shape[-1] ** -0.5
        out, lse, aux = fwd(q, k, v, causal, scale)
        got = [out, *bwd(dout, q, k, v, out, lse, causal, scale, aux)]
    return [((a.float() - b.float()).abs().max().item(), TOL * max(1.0, b.float().abs().max().item()))
            for a, b in zip(got, ref)]


def ring_part(r):
    B, H, Hkv, T, hd = r.attn
    fused = "flash_cuda" if r.device.type == "cuda" else pick_kernel(inputs(r.attn, r.device)[0])
    kernels = list(dict.fromkeys([fused, "math"]))
    checks = [("RingAttention cp = 1, causal", k, True, True, None) for k in kernels]
    checks += [(f"KERNELS[{k!r}], {what} block", k, False, causal, rows) for k in kernels
               for what, causal, rows in (("causal", True, None), (f"full ({T // 2} q x {T} k)", False, T // 2))]
    rows = []
    for label, kernel, ring, causal, q_rows in checks:
        diffs, status = attempt(ring_check, r, kernel, ring, causal, q_rows)
        bad = [f"{n} {d:.3g} > {t:.3g}" for n, (d, t) in zip(("out", "dq", "dk", "dv"), diffs or []) if d > t]
        verdict = status if diffs is None else ("FAIL: " + ", ".join(bad) if bad else "pass")
        rows.append([label, kernel, *([f"{d:.3g}" for d, _ in diffs] if diffs else ["-"] * 4), verdict])
        r.log(f"{label} ({kernel}): {verdict}")
    r.table("4. Ring attention vs SDPA (bf16)", ["check", "kernel", "max abs d out", "max abs d dq", "max abs d dk",
                                                 "max abs d dv", "bf16 tolerance"], rows,
            [f"against F.scaled_dot_product_attention (kv heads repeated) on the same bf16 q, k, v, dout; (batch, "
             f"heads, kv heads, seq, head dim) = {r.attn}, GQA {H}/{Hkv}; pass: each max abs diff <= 2^-5 x "
             "max(1, max abs reference), about 4 bf16 ulps of the tensor's largest element."])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, every part: checks the script")
    p.add_argument("--out", default=str(common.RESULTS), help="folder for gpu.md")
    p.add_argument("--steps", type=int, help="optimizer steps per run (default 30, --smoke 3)")
    p.add_argument("--budget-s", type=float, default=540.0, help="time budget of the whole run, split over the parts")
    args = p.parse_args(argv)
    if not args.smoke and not common.has_cuda():
        print("gpu.py: needs a CUDA GPU (none visible); skipped. `--smoke` checks the script on CPU.", flush=True)
        return 0
    shown = list(sys.argv[1:] if argv is None else argv)
    if "--out" in shown[:-1]:  # where the file goes does not change it
        del shown[shown.index("--out"):shown.index("--out") + 2]
    r = Run(args.smoke, args.steps, args.budget_s, args.out, " ".join(["python bench/gpu.py", *shown]))
    for part, fn in (("kernels", kernel_part), ("ring", ring_part)):
        r.start(part)
        fn(r)
    training_parts(r)
    r.log(f"wrote {r.path}")
    print(r.path.read_text(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

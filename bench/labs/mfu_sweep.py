"""L21-L24: useful FLOPs per step, and MFU/HFU measured over a sweep of layouts and micro-batch sizes.

    python -m bench.labs.mfu_sweep   # the FLOP table + the default sweep
    python -m bench.labs.mfu_sweep --flops-only --model llama3-70b --seq-len 8192 --global-batch-tokens 16777216
    python -m bench.labs.mfu_sweep --layout "tp2=2:--tp 2 --sp" --micro-batches 4,8 --steps 10

FLOPs per step: model.flops_per_token (PaLM: 6·N_non-embedding + 12·L·d·T per token) x tokens; HFU adds the recomputed
forwards. Each layout x micro-batch is a real train.py run (torchrun past world 1); MFU and HFU are its --metrics
medians over the steps after the first.
"""
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import model
from bench import common
from config import DTYPES
from data.metrics import read_metrics
from parallel.ckpt import recomputed_layers

# Tokens per optimizer step by preset: train.py's default (32 sequences) for tiny, GPT-2's 0.5M for
# small/medium, 1M for 1b, Llama 3's final 16M for its models.
BATCH_TOKENS = {"tiny": 32 * 256, "small": 2 ** 19, "medium": 2 ** 19, "1b": 2 ** 20, "llama3-8b": 2 ** 24,
                "llama3-70b": 2 ** 24, "llama3-405b": 2 ** 24}


# ---------------------------------------------------------------- L21

def config_of(preset, seq_len=None, vocab_size=None, **overrides):
    fields = {**model.PRESETS[preset].__dict__, **{k: v for k, v in overrides.items() if v is not None}}
    fields["vocab_size"] = vocab_size or fields["vocab_size"] or (257 if preset == "tiny" else 50257)
    fields["seq_len"] = seq_len or fields["seq_len"]
    return model.ModelConfig(**fields)


def flops_row(name, cfg, tokens):
    total, non_emb = model.param_counts(cfg)
    per_token = model.flops_per_token(cfg)
    recompute = model.flops_per_token(cfg, recomputed_layers=recomputed_layers(cfg, "full"))
    step = per_token * tokens
    return [name, cfg.n_layer, cfg.d_model, cfg.vocab_size, f"{total / 1e9:.3g}", f"{non_emb / 1e9:.3g}", cfg.seq_len,
            f"{per_token / 1e9:.4g}", f"{recompute / per_token:.3f}", tokens, f"{step:.3e}", f"{step / 989.4e12:.3g}"]


def flops_table(rows, out):
    header = ["model", "L", "d", "vocab", "params B", "non-emb B", "T", "GFLOP/token (MFU)", "HFU/MFU full ckpt",
              "tokens/step", "FLOP/step", "H100-s/step at peak"]
    notes = ["FLOP/token = 6·N_non-embedding + 12·L·d·T (PaLM appendix B, no causal discount); the lm_head "
             "counts as a matmul, the embedding lookup does not. FLOP/step = FLOP/token x tokens/step.",
             "HFU/MFU full ckpt: recomputing a layer's forward adds 2·N_layer + 4·d·T per token; "
             "parallel.ckpt.recomputed_layers(cfg, 'full') says how many layers' worth (torch's checkpoint "
             "does not redo each segment's last matmul).",
             "Presets without a vocabulary use 257 (tiny, the byte corpus) or GPT-2's 50257; tokens/step: tiny "
             "32 x 256 (train.py's default), small/medium 0.5M (GPT-2), 1b 1M, Llama 3 models 16M (their final "
             "batch). H100-s/step: FLOP/step / 989.4 TFLOP/s; divide by the GPU count and the MFU."]
    common.write_result(out, "L21_flops_per_step", "L21: useful FLOPs per training step", header, rows, notes)


# ---------------------------------------------------------------- L22-L24: the sweep

def default_layouts(max_world):
    """(name, world, flags): degree 2 of each axis (and the full width on a bigger GPU box)."""
    layouts = [("ddp 1", 1, []), ("ddp 1 + ckpt full", 1, ["--ckpt", "full"])]
    if max_world >= 2:
        layouts += [("ddp 2", 2, ["--dp", "2"]), ("fsdp 2", 2, ["--dp", "2", "--dp-mode", "fsdp"])]
        layouts += [(f"{axis} 2", 2, [f"--{axis}", "2"]) for axis in ("tp", "pp", "cp")]
    if max_world > 2:
        layouts += [(f"ddp {max_world}", max_world, ["--dp", str(max_world)]),
                    (f"fsdp {max_world}", max_world, ["--dp", str(max_world), "--dp-mode", "fsdp"])]
    return layouts


def parse_layout(text):
    """'NAME=WORLD:FLAGS' -> (name, world, flags), e.g. 'tp2=2:--tp 2 --sp'."""
    name, _, rest = text.partition("=")
    world, _, flags = rest.partition(":")
    return name.strip(), int(world), flags.split()


def launch(world, train_args, env, timeout):
    if world == 1:
        cmd = [sys.executable, "train.py", *train_args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
               "train.py", *train_args]
    return subprocess.run(cmd, cwd=common.REPO, env=env, capture_output=True, text=True, timeout=timeout)


def error_line(stderr):
    """The line that says what went wrong: train.py's `error: ...`, else the last exception line."""
    lines = [re.sub(r"^\[(default)?\d*\]:\s*|^\[rank\d+\]:\s*", "", line.strip()) for line in stderr.splitlines()]
    lines = [line for line in lines if line]
    for pattern in (r"^error: ", r"^[\w.]*(Error|Exception|Interrupt)\b"):
        found = [line for line in lines if re.match(pattern, line)]
        if found:
            return found[-1][:200]
    return (lines or ["no output"])[-1][:200]


def summarize(metrics_path):
    """Medians over the steps after the first (kernel selection, allocator warm-up), max of memory."""
    rows = read_metrics(metrics_path)[0]
    rows = [r for r in rows if "mfu" in r][1:]
    pick = {k: common.median([r.get(k) for r in rows]) for k in ("mfu", "hfu", "tok_s", "tflops", "comm_gb", "dt_s")}
    pick["mem_gb"] = max(r["mem_gb"] for r in rows)
    pick["steps"] = len(rows)
    return pick


def run_sweep(layouts, micro_batches, base, device, steps, timeout, tmp, quick=False, after_each=None,
              threads_per_rank=1):
    """Runs every layout x micro-batch; returns [(name, world, micro, flags, summary or None, error)] and
    the CPU peaks used. after_each(results, peaks) runs after every run (the table so far survives a kill)."""
    dtype = DTYPES[base[base.index("--dtype") + 1]]  # the CPU peak in the dtype the runs compute in
    peaks = {}
    results = []
    for name, world, flags in layouts:
        for micro in micro_batches:
            env = dict(os.environ)
            args = [*base, "--micro-batch", str(micro), "--steps", str(steps), *flags]
            if device.type == "cpu":
                threads = threads_per_rank
                if threads not in peaks:
                    peaks[threads] = common.measured_cpu_peak_tflops(dtype, threads, n=512 if quick else 2048,
                                                                     min_s=0.2 if quick else 1.0)
                env["OMP_NUM_THREADS"] = str(threads)
                args += ["--peak-tflops", f"{peaks[threads]:.6f}"]
            label = f"{name}, micro {micro}"
            metrics = Path(tmp) / f"{len(results)}.jsonl"
            args += ["--metrics", str(metrics), "--out", str(Path(tmp) / f"run{len(results)}")]
            print(f"[mfu_sweep] {label}: world {world}: train.py {' '.join(args)}", flush=True)
            try:
                proc = launch(world, args, env, timeout)
                error = None if proc.returncode == 0 else error_line(proc.stderr)
            except subprocess.TimeoutExpired:
                error = f"timed out after {timeout}s"
            summary = summarize(metrics) if error is None and metrics.exists() else None
            results.append((name, world, micro, flags, summary, error))
            if after_each:
                after_each(results, peaks)
    return results, peaks


def sweep_table(results, peaks, base, device, steps, out, name="L22_L24_mfu_sweep", final=True):
    header = ["layout", "world", "micro-batch", "MFU", "HFU", "HFU/MFU", "tok/s", "TFLOP/s per rank", "step ms",
              "peak mem GB", "comm GB/step/rank"]
    rows = []
    for layout, world, micro, _, s, error in results:
        if s is None:
            rows.append([layout, world, micro, f"failed: {error}"] + [""] * (len(header) - 4))
            continue
        rows.append([layout, world, micro, f"{s['mfu']:.1%}", f"{s['hfu']:.1%}", f"{s['hfu'] / s['mfu']:.3f}",
                     f"{s['tok_s']:.0f}", f"{s['tflops']:.4f}", f"{s['dt_s'] * 1e3:.1f}", f"{s['mem_gb']:.3f}",
                     f"{s['comm_gb']:.4f}"])
    cpu = device.type == "cpu"
    notes = [f"Each row: train.py {' '.join(base)} --micro-batch b --steps {steps} plus the layout's flags; "
             "medians over the steps after the first (from --metrics), peak memory is the max.",
             "MFU = 6·N_non-emb + 12·L·d·T FLOPs per token x tokens / (G · peak · t_step); HFU adds recomputed "
             "forwards (activation checkpointing). HFU != MFU exactly when something is recomputed: with "
             "--ckpt full each layer's forward runs again in backward, so HFU/MFU = flops_per_token(recomputed="
             "parallel.ckpt.recomputed_layers(cfg, 'full')) / flops_per_token() (a little under L layers: torch's "
             "checkpoint skips each segment's last matmul). Neither counts the optimizer, norms, softmax or "
             "communication, so both are below the busy fraction of the device."]
    if cpu:
        notes.append("CPU ONLY: G · peak is this machine's measured matmul rate in the run's dtype "
                     + ", ".join(f"{tf * 1e3:.1f} GFLOP/s with {t} thread(s)" for t, tf in sorted(peaks.items()))
                     + "; every rank runs that many threads (OMP_NUM_THREADS), so a rank is one 'device' and "
                     "G = world. One thread per rank by default: on a shared CPU, more threads than free cores "
                     "make OpenMP spin and steps slow down by 10x. Shared 2-core machine: rows move by tens of "
                     "percent from run to run. Memory is rank 0's peak RSS (includes ~0.4 GB of Python + torch), "
                     "not device memory.")
    else:
        notes.append("Memory: torch.cuda.max_memory_allocated on rank 0.")
    if not final:
        notes.append(f"PARTIAL: {len(results)} runs so far.")
    common.write_result(out, name, "L22-L24: MFU and HFU by layout and micro-batch"
                        + (" (CPU only)" if cpu else ""), header, rows, notes, echo=final)
    ok = [r for r in results if r[4] is not None]
    if ok and final:
        best = max(ok, key=lambda r: r[4]["mfu"])
        common.answer("L22", f"best MFU {best[4]['mfu']:.1%} ({best[0]}, micro {best[2]}; {device.type})")
        ranking = sorted(ok, key=lambda r: -r[4]["mfu"])
        common.answer("L24", "by MFU: " + " > ".join(f"{r[0]}/b{r[2]} {r[4]['mfu']:.0%}" for r in ranking))
    return ok


@common.command
def main(argv=None):
    p = common.parser(__doc__)
    p.add_argument("--model", default=None, help="preset for the sweep (default: tiny on CPU, small on GPU)")
    p.add_argument("--seq-len", type=int, help="sequence length (sweep and the one-config FLOP row)")
    p.add_argument("--global-batch", type=int, help="sequences per step in the sweep (default 16 CPU, 32 GPU)")
    p.add_argument("--global-batch-tokens", type=int, help="tokens per step for the FLOP row of --model")
    p.add_argument("--micro-batches", help="comma-separated micro-batch sizes (default 2,8 CPU; 4,8 GPU)")
    p.add_argument("--steps", type=int, help="steps per run (default 5 CPU, 10 GPU)")
    p.add_argument("--layout", action="append", help="NAME=WORLD:FLAGS, repeatable; replaces the default list")
    p.add_argument("--dtype", help="fp32 | bf16 (default: fp32 on CPU, bf16 on GPU)")
    p.add_argument("--timeout", type=int, default=300, help="seconds per run")
    p.add_argument("--flops-only", action="store_true", help="only the L21 table")
    p.add_argument("--name", default="L22_L24_mfu_sweep", help="file name of the sweep table")
    p.add_argument("--threads-per-rank", type=int, default=1, help="CPU threads of each rank (OMP_NUM_THREADS)")
    args = p.parse_args(argv)
    device = common.default_device()
    gpu = device.type == "cuda"

    rows = [flops_row(name, config_of(name), BATCH_TOKENS[name]) for name in model.PRESETS]
    if args.model or args.seq_len or args.global_batch_tokens:
        cfg = config_of(args.model or "tiny", args.seq_len)
        tokens = args.global_batch_tokens or BATCH_TOKENS[args.model or "tiny"]
        rows.append(flops_row(f"{args.model or 'tiny'} (this config)", cfg, tokens))
    flops_table(rows, args.out)
    big = flops_row("llama3-405b", config_of("llama3-405b"), BATCH_TOKENS["llama3-405b"])
    common.answer("L21", f"llama3-405b at seq 8192: {big[7]} GFLOP/token x 16M tokens = {big[10]} FLOP per step "
                         f"(6N alone: {6 * model.param_counts(config_of('llama3-405b'))[1] / 1e9:.4g} GFLOP/token)")
    if args.flops_only:
        return

    preset = args.model or ("small" if gpu else "tiny")
    seq_len = args.seq_len or (32 if args.quick else (1024 if gpu else 256))
    global_batch = args.global_batch or (4 if args.quick else (32 if gpu else 16))
    steps = args.steps or (2 if args.quick else (10 if gpu else 5))
    micro = [int(m) for m in (args.micro_batches or ("2" if args.quick else ("4,8" if gpu else "2,8"))).split(",")]
    dtype = args.dtype or ("bf16" if gpu else "fp32")
    max_world = torch.cuda.device_count() if gpu else min(2, common.cpu_cores())
    if args.layout:
        layouts = [parse_layout(t) for t in args.layout]
    elif args.quick:
        layouts = [("ddp 1", 1, [])]
    else:
        layouts = default_layouts(max_world)
    base = ["--model", preset, "--seq-len", str(seq_len), "--global-batch", str(global_batch), "--dtype", dtype,
            "--warmup", "2", "--log-every", "0", "--eval-every", "0"]
    with tempfile.TemporaryDirectory(prefix="mfu_sweep_") as tmp:
        def partial(results, peaks):
            sweep_table(results, peaks, base, device, steps, args.out, args.name, final=False)
        results, peaks = run_sweep(layouts, micro, base, device, steps, args.timeout, tmp, args.quick, partial,
                                   args.threads_per_rank)
    ok = sweep_table(results, peaks, base, device, steps, args.out, args.name)
    cfg = config_of(preset, seq_len)
    redone = recomputed_layers(cfg, "full")
    predicted = model.flops_per_token(cfg, recomputed_layers=redone) / model.flops_per_token(cfg)
    ckpt = [r for r in ok if "--ckpt" in r[3]]
    measured = f"; measured {ckpt[0][4]['hfu'] / ckpt[0][4]['mfu']:.3f} ({ckpt[0][0]})" if ckpt else \
        " (no --ckpt run in this sweep succeeded: predicted only)"
    common.answer("L23", f"HFU counts recomputed forwards, MFU does not: full ckpt on {preset} at T={seq_len} gives "
                         f"HFU/MFU = {predicted:.3f} predicted{measured}; without recompute HFU = MFU")
    if len(ok) < len(results):
        print(f"mfu_sweep: {len(results) - len(ok)} of {len(results)} runs failed (see the table)", file=sys.stderr)
        sys.exit(1)
